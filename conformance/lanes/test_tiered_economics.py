"""Tiered lane, economics: the files the reference predicts are the files vLLM's fs tier writes.

The operator's disk numbers (``python -m vllm_adapter config``) come from
:mod:`reference.economics`: a workload served through the reference's own store
and lookup rules.  Here the same workload (:mod:`reference.workload`, expanded
to the same requests) runs through vLLM's real scheduler, connector and
``TieringOffloadingSpec`` with its file-system tier, on the gemma-4 and
DeepSeek-V4 fixtures with ``block_size: 512``, under retention 0 (vLLM's
default), a periodic interval and ``None`` (dense), for two workload shapes:
disjoint prompts, and conversations behind a shared system prompt.

Pass 1 serves the workload with the GPU prefix cache reset before every request
(every reuse comes from offload); the files on disk per group must **equal**
the chunks the reference stores.  Then the CPU tier is reset and poisoned, and
pass 2 serves the workload again from files: the files read per group must equal
the chunks the reference loads for the first time in that pass (the CPU tier,
large here, keeps what it promoted).  Tiers are large enough that nothing is
refused: capacity effects are not part of this comparison.

The predicted-versus-written table goes to the report (``econ:`` properties).
A disagreement is a finding: a deviation with its smallest case in
``conformance/protocol/deviations/``, or a fix to the reference.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from conformance.harness import tiered as T  # noqa: E402
from conformance.harness import vllm_harness_api as V  # noqa: E402
from conformance.harness.cases import DSV4, GEMMA  # noqa: E402
from conformance.harness.fixture_runs import FixtureCase  # noqa: E402
from conformance.protocol import deviations  # noqa: E402
from conformance.protocol.versions import rules_for  # noqa: E402
from reference.economics import serve  # noqa: E402
from reference.workload import GpuCache, Span, Workload, WorkloadRequest, requests  # noqa: E402

pytestmark = pytest.mark.data

HEAVY_LANE_LOCK = Path(tempfile.gettempdir()) / "kvchunk-heavy-lane.lock"
"""Held while this lane runs: CI runs the releases' chains side by side (``.ci/run``), and
this is the suite's memory-heavy lane (real-model KV caches), so one runs it at a time."""


@pytest.fixture(autouse=True, scope="module")
def one_heavy_lane_per_machine() -> Iterator[None]:
    with HEAVY_LANE_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)

OUTPUT_TOKENS = 2
"""Outputs are not stored (prompt-only storing, vLLM's default): two tokens suffice."""

SHAPES: dict[str, Workload] = {
    "disjoint": Workload(
        name="disjoint", description="two unrelated prompts", source="conformance shape",
        sessions=2, turns=1, system_tokens=0, turn_tokens=Span(600, 700),
        output_tokens=Span(OUTPUT_TOKENS, OUTPUT_TOKENS), seed=11,
    ),
    "shared-prefix": Workload(
        name="shared-prefix",
        description="two conversations of two turns behind one unaligned system prompt",
        source="conformance shape", sessions=2, turns=2, system_tokens=700,
        turn_tokens=Span(150, 350), output_tokens=Span(OUTPUT_TOKENS, OUTPUT_TOKENS), seed=12,
    ),
}
RETENTIONS: dict[str, int | None] = {"retention=0": 0, "retention=1024": 1024, "retention=None": None}
BUDGET = 256
"""Prefill tokens per step, vLLM's and the reference's alike."""


@dataclass(frozen=True)
class EconomicsCase:
    fixture: str
    shape: str
    retention: str
    num_cpu_chunks: int
    num_gpu_blocks: int

    def __str__(self) -> str:
        return f"{self.fixture}-block_size512-{self.shape}-{self.retention}"

    @property
    def base(self) -> FixtureCase:
        return FixtureCase(self.fixture, (("block_size", 512),), True, self.num_gpu_blocks,
                           self.num_cpu_chunks,
                           0, budget=BUDGET)

    @property
    def workload(self) -> Workload:
        return SHAPES[self.shape]

    @property
    def retention_interval(self) -> int | None:
        return RETENTIONS[self.retention]


DEEP = os.environ.get("KVCHUNK_PROFILE", "ci") == "deep"
GEMMA_RETENTIONS = tuple(RETENTIONS) if DEEP else ("retention=0",)
"""gemma-4's files are 40 MiB (2 ranks x 20 MiB) and a case takes minutes on a 2-core
runner: CI runs vLLM's default retention (0), the nightly ``deep`` profile all three."""

CASES = [
    # gemma-4: the CPU tier holds every chunk of a pass.
    *(EconomicsCase(GEMMA, s, r, 48, 512) for s in SHAPES for r in GEMMA_RETENTIONS),
    # DeepSeek-V4: 2 MiB files, 8- and 16-token chunks in groups 3 and 4 (dense: ~130 per
    # prompt).  GPU blocks: every group of a request fits (one pool; 4-token blocks in group 3).
    *(EconomicsCase(DSV4, s, r, 640, 1024) for s in SHAPES for r in RETENTIONS),
]


def _prompts(workload: Workload) -> list[WorkloadRequest]:
    return list(requests(workload))


def predicted(case: EconomicsCase, chunking: Any, reqs: list[WorkloadRequest]) -> tuple[Any, Any]:
    """The reference's two passes (GPU cache cold, CPU tier reset between passes)."""
    policy = dataclasses.replace(
        rules_for(V.VLLM_VERSION).policy, retention_interval=case.retention_interval
    )
    first, second = serve(chunking, [reqs, reqs], policy, gpu_cache=GpuCache.COLD, budget=BUDGET)
    return first, second


@pytest.mark.parametrize("case", CASES, ids=str)
def test_predicted_files_are_the_files_written(
    case: EconomicsCase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    record_property: Any,
    request: pytest.FixtureRequest,
) -> None:
    dev = deviations.find("vllm", "data", str(case))
    if dev is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=dev.xfail_reason()))
    record_property("fixture", case.fixture)
    record_property("knob", f"block_size=512, {case.retention}, {case.shape}")
    reqs = _prompts(case.workload)
    driver = _with_retention(case, tmp_path)
    from vllm_adapter.connector import resolve_for_vllm

    chunking, _ = resolve_for_vllm(driver.vllm_config, driver.kv_cache_config)
    first, second = predicted(case, chunking, reqs)
    probe = T.FileProbe().install(monkeypatch)
    session, runner = T.open_session(driver, BUDGET)
    try:
        passes = T.run_workload_passes(
            session, probe, tmp_path, [(r.prompt, OUTPUT_TOKENS) for r in reqs]
        )
    finally:
        T.shutdown(session)
    groups = [gc.group.index for gc in chunking.groups]
    want_written = {g: first.written[g] + second.written[g] for g in groups}
    want_read = {g: second.read_once[g] for g in groups}
    got_written = {g: passes[-1].written.get(g, 0) for g in groups}
    got_read = {g: passes[-1].read.get(g, 0) for g in groups}
    for g in groups:
        record_property(f"econ:predicted_written:g{g}", want_written[g])
        record_property(f"econ:written:g{g}", got_written[g])
        record_property(f"econ:predicted_read:g{g}", want_read[g])
        record_property(f"econ:read:g{g}", got_read[g])
    record_property("econ:prompt_tokens", first.prompt_tokens)
    stats = runner.stats
    summary = (
        f"{case}: written {got_written} (reference {want_written}); read {got_read} "
        f"(reference {want_read}); {stats.describe()}"
    )
    assert not probe.store_failures and not probe.load_failures, (
        f"file I/O failed, the comparison needs a healthy tier: {probe.store_failures[:2]} "
        f"{probe.load_failures[:2]}; {summary}"
    )
    assert stats.corrupted_loads == 0 and stats.foreign_bytes_changed == 0, summary
    assert passes[0].written == passes[-1].written, (
        f"pass 2 wrote new files (everything was stored in pass 1): {passes[0].written} -> "
        f"{passes[-1].written}; {summary}"
    )
    assert got_written == want_written, f"files written per group differ: {summary}"
    assert got_read == want_read, f"files read per group differ: {summary}"


def _with_retention(case: EconomicsCase, root: Path) -> Any:
    from conformance.harness.fixture_runs import fixture_driver
    from vllm_adapter.names import connector_module

    base = case.base
    return fixture_driver(
        base.fixture, dict(base.extra), num_gpu_blocks=base.num_gpu_blocks,
        num_cpu_chunks=base.num_cpu_chunks, connector=base.connector,
        connector_module_path=connector_module(base.connector), spec=T.tiering_spec(root),
        retention_interval=case.retention_interval,
    )
