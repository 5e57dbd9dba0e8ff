"""The one table of stored-fixture cases every lane and benchmark filters (OpInfo-style).

A :class:`Case` is a stored fixture geometry (``vllm_adapter/fixtures/<release>/``)
with one knob, and it says which lanes run it and at what size.  Lanes never
rebuild the fixture x knob x connector product themselves: they filter
:data:`CASES` (``[c for c in CASES if c.data]``) or call :func:`config_cases`.
Which connector a knob goes through is a rule, stated once in
:attr:`Knob.connector`: ``block_size`` needs kvchunk's connector on mixed
groups, ``blocks_per_chunk`` is vLLM's own knob and goes through the stock one.

The hand-made hybrid configs of the plan and data lanes (``fa64+sw128@16``, ...)
are workloads of the driver's synthetic builders, not stored fixtures; they stay
next to the lane that explains why each exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_adapter.names import KVCHUNK_CONNECTOR, STOCK_CONNECTOR, connector_module


@dataclass(frozen=True)
class Fixture:
    """A stored fixture: vLLM's own planning of one model or hand-made geometry."""

    name: str
    label: str
    model: bool
    """A real model's config (the CLI and benchmarks plan these), else hand-made groups."""
    vllm_plans: bool = True
    """False where vLLM refuses the geometry itself (the fixture stores the error)."""


GEMMA = "gemma-4-31B-it-tp2"
DSV4 = "deepseek-v4-flash-tp4"

FIXTURES: tuple[Fixture, ...] = (
    Fixture(GEMMA, "gemma-4-31B-it TP2", model=True),
    Fixture(DSV4, "DeepSeek-V4-Flash TP4", model=True),
    Fixture("synthetic-full-swa", "full attention + sliding window", model=False),
    Fixture("synthetic-eagle", "sliding window + EAGLE draft group", model=False),
    Fixture("synthetic-full-mamba-align", "full attention + Mamba (align)", model=False),
    Fixture("synthetic-sub-hash", "groups below the hash unit", model=False, vllm_plans=False),
)

MODEL_FIXTURES: tuple[str, ...] = tuple(f.name for f in FIXTURES if f.model)

CURVE_CPU_BYTES: dict[str, str] = {GEMMA: "8GiB", DSV4: "400MiB"}
"""``--cpu-bytes`` of each model's ``--sweep-disk`` curves with vLLM's CPU tier in front, as
``scripts/disk_curves_cpu.py`` runs them and the curve bench times them: about a quarter to
a sixth of the workloads' unbounded peak on disk."""
LABELS: dict[str, str] = {f.name: f.label for f in FIXTURES}


class ConnectorChoice:
    """A case's knob items (``extra``) through kvchunk's connector (``kvchunk``) or vLLM's
    stock one: the connector name and the knob label, for the cases that choose the
    connector themselves (fixture runs, e2e)."""

    extra: tuple[tuple[str, Any], ...]
    kvchunk: bool

    @property
    def connector(self) -> str:
        """``kv_connector``: kvchunk's connector or vLLM's stock one."""
        return KVCHUNK_CONNECTOR if self.kvchunk else STOCK_CONNECTOR

    @property
    def knob(self) -> str:
        (key, value), *_ = self.extra
        return f"{key}={value} ({self.connector})"


@dataclass(frozen=True)
class Knob:
    """One ``kv_connector_extra_config`` knob setting (valid or not)."""

    items: tuple[tuple[str, Any], ...]

    @classmethod
    def of(cls, **knob: Any) -> Knob:
        return cls(tuple(knob.items()))

    @property
    def extra(self) -> dict[str, Any]:
        return dict(self.items)

    @property
    def connector(self) -> str:
        """``block_size`` goes through kvchunk's connector, ``blocks_per_chunk`` through vLLM's."""
        return KVCHUNK_CONNECTOR if "block_size" in self.extra else STOCK_CONNECTOR

    @property
    def connector_module(self) -> str | None:
        return connector_module(self.connector)

    @property
    def kvchunk(self) -> bool:
        return self.connector == KVCHUNK_CONNECTOR

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.items)


CONFIG_KNOBS: tuple[Knob, ...] = (
    Knob.of(blocks_per_chunk=1), Knob.of(blocks_per_chunk=2), Knob.of(blocks_per_chunk=4),
    Knob.of(blocks_per_chunk=16), Knob.of(block_size=512), Knob.of(block_size=256),
    Knob.of(block_size=100), Knob.of(blocks_per_chunk=0), Knob.of(blocks_per_chunk="8"),
)
"""The config lane's knobs: valid ones, one that no group divides, and two that are wrong."""

BENCH_BLOCKS_PER_CHUNK: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
BENCH_BLOCK_SIZES: tuple[int, ...] = (256, 512, 1024)


@dataclass(frozen=True)
class PlanSizes:
    """Plan lane: GPU blocks, CPU chunks and the longest shared prefix drawn."""

    num_gpu_blocks: int
    num_cpu_chunks: int
    max_len: int


@dataclass(frozen=True)
class DataSizes:
    """Data lane: GPU blocks, CPU chunks, prompt length (see ``fixture_runs.FixtureCase``)."""

    num_gpu_blocks: int
    num_cpu_chunks: int
    prompt_len: int
    block_tokens_base: int | None = None


@dataclass(frozen=True)
class Case:
    """A stored fixture with one knob, and the lanes (with sizes) that run it."""

    fixture: str
    knob: Knob
    plan: PlanSizes | None = None
    data: DataSizes | None = None

    def __str__(self) -> str:
        return f"{self.fixture} {self.knob}"


_PLAN = PlanSizes(num_gpu_blocks=4096, num_cpu_chunks=4096, max_len=1600)

CASES: tuple[Case, ...] = (
    # gemma-4: 10 canonical tensors of 128 KiB pages, 6 groups each referring to all 10.
    Case(GEMMA, Knob.of(block_size=512), plan=_PLAN, data=DataSizes(384, 24, 640)),
    Case(GEMMA, Knob.of(blocks_per_chunk=2), plan=_PLAN),
    Case(GEMMA, Knob.of(blocks_per_chunk=1), data=DataSizes(224, 256, 320)),
    # Sized for 0.33.0's 32-token blocks; scaled with the fixture's (block_tokens_base).
    Case(GEMMA, Knob.of(blocks_per_chunk=4), data=DataSizes(224, 72, 320, block_tokens_base=32)),
    # DeepSeek-V4: one packed canonical tensor (1002240-byte blocks), one whole-block ref per group.
    Case(DSV4, Knob.of(block_size=512), plan=_PLAN, data=DataSizes(256, 96, 1100)),
    Case(DSV4, Knob.of(blocks_per_chunk=1), plan=_PLAN, data=DataSizes(256, 192, 600)),
    Case(DSV4, Knob.of(blocks_per_chunk=2), data=DataSizes(256, 96, 600)),
)


def config_cases() -> list[Case]:
    """The config lane: every fixture vLLM plans, with every knob of :data:`CONFIG_KNOBS`."""
    return [Case(f.name, k) for f in FIXTURES if f.vllm_plans for k in CONFIG_KNOBS]
