"""Sizing on an already planned engine: the public entry point the CLI and the bench share.

``python -m vllm_adapter config`` (:mod:`vllm_adapter.cli`) parses arguments, runs
vLLM's planning and renders; what it computes once vLLM has planned the engine lives
here (and in :mod:`vllm_adapter.economics`, whose results are :mod:`vllm_adapter.results`'),
so the benchmarks (``conformance/bench``) time and reuse it without reaching into
the CLI (the imports run one way: the CLI imports this module, never the reverse):

* :func:`release_policy`: the rules a release runs with the engine's settings;
* :class:`PlannedEngine`: a knob resolved as the connector resolves it, and vLLM's
  offloading config for it;
* :func:`cpu_row`: vLLM's CPU-tier row (= fs-tier file) for a resolved knob, sized by
  the one :func:`reference.geometry.cpu_row_bytes`;
* :func:`fixture_knob`: all of the above on a stored fixture geometry;
* :func:`sweep_inputs` / :func:`run_sweep`: what ``--sweep`` computes.

vLLM is imported lazily (inside the functions), as the CLI's argument checks need.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from reference.disk_economics import DiskEconomics, miss_ratio_curve
from reference.eviction import EvictionRule, Layout
from reference.geometry import cpu_row_bytes
from reference.knobs import BLOCK_SIZE, BLOCKS_PER_CHUNK, Chunking
from reference.packed_split import LoadSplit
from reference.plan import Policy
from reference.tiered_curve import TieredEconomics, tiered_miss_ratio_curve
from reference.workload import Workload
from vllm_adapter import economics as E
from vllm_adapter.disk_model import FS_MODELS, FsModel
from vllm_adapter.economics import SweepInput
from vllm_adapter.names import CPU_SPEC
from vllm_adapter.results import Sweep, Traffic

__all__ = [
    "DEFAULT_WORKLOAD",
    "DISK_SWEEP_POINTS",
    "SWEEP_POINTS",
    "CpuRow",
    "DiskSweep",
    "FixtureKnob",
    "PlannedEngine",
    "cpu_row",
    "disk_curve",
    "disk_sweep",
    "fixture_knob",
    "knob_traffic",
    "forget_served",
    "release_policy",
    "run_sweep",
    "sweep_inputs",
    "sweep_values",
]

GiB = 1 << 30
DEFAULT_WORKLOAD = "chat"
"""The workload when ``--workload`` is not given.  Chat is the commonest deployment and,
of the presets, the one that writes the most files and recomputes the most tokens per
million prompt tokens (short turns leave a partial chunk per request), so a disk sized
by it is not sized for the easy case."""
SWEEP_POINTS = 8
"""Knob values a ``--sweep`` shows."""
DISK_SWEEP_POINTS = 8
"""Disk sizes a ``--sweep-disk`` shows: ``peak * k / 8``, k = 1..8 (the unbounded run's
peak bytes last: nothing evicted)."""
SWEEP_FIRST_BLOCK_SIZE = 256
SWEEP_LAST_EXPONENT = 24
"""The largest power of two a ``--block-size`` sweep tries (2**24 tokens)."""


def release_policy(version: str, vllm_config: Any, offload_prompt_only: bool) -> tuple[Policy, bool]:
    """The rules ``version`` runs (:mod:`vllm_adapter.releases`) with the engine's settings
    (retention as vLLM's offloading scheduler reads it, prompt-only storing, prefix
    caching); and whether the release is known."""
    from vllm_adapter.geometry import retention_interval_from
    from vllm_adapter.releases import rules_for

    rules = rules_for(version)
    policy = replace(
        rules.policy,
        retention_interval=retention_interval_from(vllm_config),
        offload_prompt_only=offload_prompt_only,
        prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
    )
    return policy, rules.known


@dataclass(frozen=True)
class PlannedEngine:
    """The planned engine: resolve a knob, build vLLM's offloading config for it."""

    vllm_config: Any
    scheduler_kv_cache_config: Any
    cpu_bytes_for_checks: int
    """``cpu_bytes_to_use`` is required by CPUOffloadingSpec: a stand-in when not given."""

    def resolve(self, knob_extra: dict[str, int]) -> tuple[Chunking, dict[str, Any]]:
        """The chunking and the extra config vLLM runs; a ``ValueError`` when refused."""
        from vllm_adapter.connector import resolve_for_vllm
        from vllm_adapter.geometry import with_extra_config

        extra = {**knob_extra, "spec_name": CPU_SPEC, "cpu_bytes_to_use": self.cpu_bytes_for_checks}
        return resolve_for_vllm(
            with_extra_config(self.vllm_config, extra), self.scheduler_kv_cache_config
        )

    def offloading_config(self, vllm_extra: dict[str, Any]) -> Any:
        from vllm_adapter import vllm_tools_api as V
        from vllm_adapter.geometry import with_extra_config

        return V.build_offloading_config(
            with_extra_config(self.vllm_config, vllm_extra), self.scheduler_kv_cache_config
        )


@dataclass(frozen=True)
class CpuRow:
    """vLLM's CPU-tier row for one resolved knob (also one fs-tier chunk file)."""

    worker_kv_bytes_per_block: int
    replicated_layout: bool
    copies: int
    """Rank copies in a row: 1 with vLLM's replicated MLA layout, else the world size."""
    page_alignment: int
    blocks_per_chunk: int

    @property
    def chunk_bytes_per_worker(self) -> int:
        return self.worker_kv_bytes_per_block * self.blocks_per_chunk

    def row_bytes(self, bytes_per_block: int | None = None, blocks: int | None = None) -> int:
        """:func:`reference.geometry.cpu_row_bytes` of this row (or of one group's
        ``bytes_per_block`` / another ``blocks`` per chunk)."""
        return cpu_row_bytes(
            self.worker_kv_bytes_per_block if bytes_per_block is None else bytes_per_block,
            self.copies,
            self.blocks_per_chunk if blocks is None else blocks,
            self.page_alignment,
        )

    def chunks_in(self, cpu_bytes: int) -> int:
        """The chunk slots ``cpu_bytes_to_use`` holds: whole rows (vLLM's CPU tier)."""
        return cpu_bytes // self.row_bytes()


@dataclass(frozen=True)
class DiskSweep:
    """``--sweep-disk``'s curves (:func:`disk_sweep`): per size, each rule's economics of
    the disk alone, and with ``cpu_chunks`` those of the disk behind vLLM's CPU tier."""

    sizes: tuple[int, ...]
    rule: tuple[DiskEconomics, ...]
    lru: tuple[DiskEconomics, ...]
    cpu_rule: tuple[TieredEconomics, ...] | None
    cpu_lru: tuple[TieredEconomics, ...] | None


def disk_curve(
    chunking: Chunking, scaled_workload: Workload, sizes: tuple[int, ...] | int,
    rule: EvictionRule, policy: Policy, key_bytes: Mapping[int, int],
    load_split: LoadSplit | None = None,
) -> tuple[DiskEconomics, ...]:
    """The packed layout's disk-only curve the CLI computes (``--disk-bytes``: one size;
    :func:`disk_sweep`: its sizes): :func:`reference.disk_economics.miss_ratio_curve` with
    ``scaled_workload``'s ``gpu_cache``.  A chunking the rule does not model raises
    ``ValueError``."""
    return miss_ratio_curve(chunking, scaled_workload, sizes, rule, key_bytes, Layout.PACKED,
                            policy, load_split=load_split, gpu_cache=scaled_workload.gpu_cache)


def disk_sweep(
    chunking: Chunking, scaled_workload: Workload, policy: Policy, key_bytes: Mapping[int, int],
    cpu_chunks: int | None = None, load_split: LoadSplit | None = None,
) -> DiskSweep:
    """What ``python -m vllm_adapter config --sweep-disk`` computes after vLLM's planning
    (the CLI renders it, the curve bench times it): the rule's curve over
    :data:`DISK_SWEEP_POINTS` sizes of the packed layout, plain LRU's at the same sizes,
    and with ``cpu_chunks`` both again with vLLM's CPU tier of that many chunk slots in
    front (:func:`reference.tiered_curve.tiered_miss_ratio_curve`).  ``scaled_workload``:
    the workload as :func:`reference.disk_economics.scaled` makes it; its ``gpu_cache``
    is both series'.  A chunking the rule does not model raises ``ValueError``."""
    def curve(sizes: tuple[int, ...] | int, rule: EvictionRule) -> tuple[DiskEconomics, ...]:
        return disk_curve(chunking, scaled_workload, sizes, rule, policy, key_bytes, load_split)

    def tiered(sizes: tuple[int, ...], slots: int,
               rule: EvictionRule) -> tuple[TieredEconomics, ...]:
        return tiered_miss_ratio_curve(chunking, scaled_workload, sizes, slots, rule, key_bytes,
                                       Layout.PACKED, policy, load_split=load_split,
                                       gpu_cache=scaled_workload.gpu_cache)

    rule_curve = curve(DISK_SWEEP_POINTS, EvictionRule.REACHABLE)
    sizes = tuple(e.budget_bytes or 0 for e in rule_curve)
    lru_curve = curve(sizes, EvictionRule.LRU)
    if cpu_chunks is None:
        return DiskSweep(sizes, rule_curve, lru_curve, None, None)
    return DiskSweep(sizes, rule_curve, lru_curve,
                     tiered(sizes, cpu_chunks, EvictionRule.REACHABLE),
                     tiered(sizes, cpu_chunks, EvictionRule.LRU))


def cpu_row(offloading_config: Any, world_size: int, blocks_per_chunk: int) -> CpuRow:
    """The row vLLM's ``CPUOffloadingSpec`` lays out for ``offloading_config``."""
    from vllm_adapter import vllm_tools_api as V

    replicated = bool(offloading_config.replicated_layout)
    return CpuRow(
        worker_kv_bytes_per_block=int(offloading_config.worker_kv_bytes_per_block),
        replicated_layout=replicated,
        copies=1 if replicated else world_size,
        page_alignment=int(V.CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT),
        blocks_per_chunk=blocks_per_chunk,
    )


@dataclass(frozen=True)
class FixtureKnob:
    """A knob resolved on a stored fixture geometry (``vllm_adapter/fixtures``)."""

    chunking: Chunking
    vllm_config: Any
    worker_kv_cache_config: Any
    row: CpuRow
    policy: Policy
    """The installed release's rules, prompt-only storing."""

    @property
    def file_bytes(self) -> int:
        return self.row.row_bytes()


def fixture_knob(geometry: str, knob: str, value: int) -> FixtureKnob:
    """``knob=value`` on fixture ``geometry`` under the installed vLLM, as the connector
    resolves it: the chunking, the CPU-tier row (= fs file) and the release's rules."""
    from vllm_adapter import fixtures as fx
    from vllm_adapter import vllm_tools_api as V

    data = fx.load_fixture(geometry)
    engine = PlannedEngine(fx.make_vllm_config(data, {}),
                           fx.rebuild_kv_cache_config(data, "scheduler"), GiB)
    chunking, vllm_extra = engine.resolve({knob: value})
    worker = fx.rebuild_kv_cache_config(data, "worker")
    worker_engine = PlannedEngine(engine.vllm_config, worker, GiB)
    base = {"spec_name": CPU_SPEC, "cpu_bytes_to_use": GiB}
    config = worker_engine.offloading_config({**vllm_extra, **base})
    row = cpu_row(config, int(config.parallel.world_size), int(vllm_extra[BLOCKS_PER_CHUNK]))
    policy, _ = release_policy(V.VLLM_VERSION, engine.vllm_config, True)
    return FixtureKnob(chunking, engine.vllm_config, worker, row, policy)


def sweep_values(knob_name: str) -> list[int]:
    """The values a sweep tries, in order: powers of two (``block_size`` from 256)."""
    if knob_name == BLOCK_SIZE:
        first = SWEEP_FIRST_BLOCK_SIZE.bit_length() - 1
        return [1 << k for k in range(first, SWEEP_LAST_EXPONENT + 1)]
    return [1 << k for k in range(SWEEP_POINTS)]


def sweep_inputs(
    engine: PlannedEngine, knob_name: str, row: CpuRow
) -> tuple[list[SweepInput], list[str]]:
    """:data:`SWEEP_POINTS` valid knob values (resolved as the connector will), and the
    values skipped on the way, each with vLLM's or the reference's reason."""
    points: list[SweepInput] = []
    skipped: list[str] = []
    for value in sweep_values(knob_name):
        if len(points) == SWEEP_POINTS:
            break
        try:
            chunking, vllm_extra = engine.resolve({knob_name: value})
        except ValueError as e:
            skipped.append(f"{knob_name}={value}: {' '.join(str(e).split())}")
            continue
        blocks = int(vllm_extra[BLOCKS_PER_CHUNK])
        points.append(SweepInput({knob_name: value}, chunking, blocks,
                                 row.row_bytes(blocks=blocks)))
    return points, skipped


def run_sweep(
    vllm_config: Any,
    scheduler_kv_cache_config: Any,
    knob_name: str,
    workload: Workload,
    models: tuple[FsModel, ...] = FS_MODELS,
) -> Sweep:
    """``--sweep`` on an already planned engine (no model dir, no planning run): the
    knob values resolved as the connector will, each served through the workload, the
    packed tier's loads split as one on vLLM's default pool splits them (what ``--sweep``
    counts without ``--fs-*`` threads).  The benchmark
    (``conformance/bench/test_bench_sweep.py``) times this."""
    from vllm_adapter import vllm_tools_api as V
    from vllm_adapter.disk.tier import configured_load_split

    engine = PlannedEngine(vllm_config, scheduler_kv_cache_config, GiB)
    _, base_extra = engine.resolve({BLOCKS_PER_CHUNK: 1})
    row = cpu_row(engine.offloading_config(base_extra),
                  int(vllm_config.parallel_config.world_size), 1)
    policy, _ = release_policy(V.VLLM_VERSION, vllm_config, True)
    points, skipped = sweep_inputs(engine, knob_name, row)
    return E.sweep(knob_name, points, skipped, workload, policy, models, configured_load_split({}))


def forget_served() -> None:
    """Drop the per-process serving results :func:`run_sweep` reuses (a benchmark times
    fresh runs)."""
    E.forget_served()


def knob_traffic(
    chunking: Chunking, file_bytes: int, workload: Workload, policy: Policy,
    models: tuple[FsModel, ...] = FS_MODELS,
) -> Traffic:
    """What ``config`` prints for one knob: the workload's files, bytes, recomputed tokens
    and modelled disk time, every group's file ``file_bytes`` (one CPU-tier row)."""
    return E.traffic(E.serve(chunking, workload, policy),
                   {gc.group.index: file_bytes for gc in chunking.groups}, models)
