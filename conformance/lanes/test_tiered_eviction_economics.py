"""Tiered lane, eviction economics: a budgeted packed tier evicts, keeps, reads and makes
recompute exactly what the reference predicts.

kvchunk's file tier (``KvchunkTieringOffloadingSpec``, ``layout: packed``, per store job
a file of its full-attention keys and one of its window keys) enforces ``disk_bytes_to_use`` per root with the eviction rule of
:mod:`reference.eviction` (``eviction: reachable``; :mod:`vllm_adapter.disk.budget`).
Here a workload (:mod:`reference.workload`) runs through vLLM's real scheduler,
connector and tiering manager over that tier, on the gemma-4-31B-it TP2 and
DeepSeek-V4-Flash TP4 fixtures with ``block_size: 512`` and vLLM's default retention
(0, sparse), as the economics lane (:mod:`conformance.lanes.test_tiered_economics`)
does: pass 1 with the GPU prefix cache reset before every request, so every reuse is
an offload hit, served by a CPU tier large enough to hold every chunk of a pass; then
the CPU tier is reset and its region poisoned, and pass 2 serves the workload again
from the files the budget left.

Each case is a fixture, a workload shape (:data:`SHAPES`) and a budget that forces
evictions: a fraction (:data:`SHAPE_FRACTIONS`) of the bytes pass 1 writes to an unbounded
disk, as the reference counts them, at least the largest file
(:func:`conformance.harness.eviction_econ.budgets`).  In each pass these counts of the
tier must **equal** the reference's prediction
(:func:`conformance.harness.eviction_econ.predict`), :data:`COUNTS`:

* files evicted (``tier.budget.counters.files_evicted``);
* packed files on disk when the pass ended (the namespace directory, listed; the
  ledger must agree);
* files read (packed file opens, ``tier.counters.files_opened``; 0 in pass 1; a load
  job split across the tier's pool opens a file once per slice that reads it:
  :func:`reference.packed_split.load_slices`, with the tier's threads and part size);
* prompt tokens recomputed: per request, the prompt less the GPU prefix hit and the
  offload hit (``get_num_new_matched_tokens`` as the scheduler last asked it);
* files written, stores refused and keys left out as stranded on arrival.

Both sides go to the report (``econ:pass<n>:<count>`` and ``econ:pass<n>:predicted
<count>`` properties).  The file tier's I/O is drained after every engine step
(:func:`conformance.harness.hybrid_tier.run_drained`), so each cascade is written before
the next one reserves, the order of events the prediction models.

What the prediction models (the module docstring of :mod:`conformance.harness.eviction_econ`
states it in full): the reference's :class:`~reference.economics.Engine` and
:class:`~reference.plan.Planner`, over an unbounded CPU tier in front of a
:class:`~reference.disk_economics.BudgetedIndex` (packed layout, the rule "reachable"), in
vLLM's tiering order: a store job's keys new to the CPU tier are cascaded to the disk
when the job completes, in job order, each a packed file of its full-attention keys and
one of its window keys (:func:`reference.packed.store_job_files`); in pass 1 the CPU tier
serves every reuse, so the disk takes stores (and evicts for them) and is never hit
nor read; in pass 2 the CPU tier starts empty, the disk is looked up (a hit refreshes
its file) and read for the keys a load job takes from it (a read per distinct file,
refreshing it), and every chunk recomputed is stored again and cascaded again.  Two
statements of intent the reference's pieces leave to the caller: a packed file's bytes
are :func:`reference.packed.packed_file_bytes` of one CPU-tier row per section
(:func:`reference.geometry.cpu_row_bytes`); and a store admits *pending windows*
(:meth:`reference.eviction.Disk.arrives_stranded` with ``pending_windows`` and
``window_siblings``, as the tier's ledger admits): the
Planner, in :data:`BUDGET`-token steps, stores a boundary's window chunks before its
full-attention chunk, as vLLM does.  Every expected number comes from the reference
and the fixture's geometry; none from the tier under test.

A disagreement is a finding: a deviation (backend ``kvchunk``, lane ``data``,
:mod:`conformance.protocol.deviations`) makes its case a strict xfail.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from conformance.harness import eviction_econ as X  # noqa: E402
from conformance.harness import hybrid_tier as H  # noqa: E402
from conformance.harness import tiered as T  # noqa: E402
from conformance.harness import vllm_harness_api as V  # noqa: E402
from conformance.harness.cases import DSV4, GEMMA  # noqa: E402
from conformance.harness.heavy_lock import one_heavy_lane_per_machine  # noqa: E402,F401 (autouse)
from conformance.protocol import deviations  # noqa: E402
from conformance.protocol.versions import rules_for  # noqa: E402
from reference.workload import Span, Workload, WorkloadRequest, requests  # noqa: E402

pytestmark = [pytest.mark.data, pytest.mark.xdist_group("heavy")]


OUTPUT_TOKENS = 2
BUDGET = 256
"""Prefill tokens per step, vLLM's and the reference's alike."""
RETENTION = H.RETENTION

SHAPES: dict[str, Workload] = {
    "disjoint": Workload(
        name="disjoint", description="four unrelated prompts of one to three chunks",
        source="conformance shape", sessions=4, turns=1, system_tokens=0,
        turn_tokens=Span(600, 1700), output_tokens=Span(OUTPUT_TOKENS, OUTPUT_TOKENS), seed=24,
    ),
    "conversations": Workload(
        name="conversations", description="three conversations of two turns, no shared prefix",
        source="conformance shape", sessions=3, turns=2, system_tokens=0,
        turn_tokens=Span(600, 900), output_tokens=Span(OUTPUT_TOKENS, OUTPUT_TOKENS), seed=25,
    ),
    "agentic": Workload(
        name="agentic", description="the CLI's agentic preset (reference/workloads/agentic.toml) "
        "scaled down: two sessions of three turns after a shared system prompt",
        source="conformance shape", sessions=2, turns=3, system_tokens=768,
        turn_tokens=Span(256, 640), output_tokens=Span(OUTPUT_TOKENS, OUTPUT_TOKENS), seed=26,
    ),
}
"""``disjoint``: every prompt is new and pass 2 asks for them in pass 1's order, so the
budget has evicted a prompt's files by the time it comes back (nothing read in pass 2,
everything stored again).  ``conversations``: turn by turn round-robin, each second turn
extends its first (its files' parents are the first turn's), so pass 2 reads what the
rule kept and stores the rest again.  At a quarter of the bytes the tier also refuses
stores and leaves keys out as stranded; at the half budget of ``conversations`` and at
the quarter budgets the rule evicts other files than a plain LRU would.  ``agentic``: the shape of the
CLI's agentic preset (a system prompt every session shares, each turn extending the
session's last, tool outputs of a few hundred tokens), small enough for a CPU tier that
holds a pass; it runs at the smallest point of ``--sweep-disk`` (an eighth of the
bytes, :data:`vllm_adapter.cli.disk.DISK_SWEEP_POINTS`), where the rule refuses stores
and leaves keys out rather than evicting."""

FRACTIONS = {"budget=1/2": 0.5, "budget=1/4": 0.25}
"""The budgets: these fractions of the bytes pass 1 writes to an unbounded disk."""
SMALLEST = {"budget=1/8": 0.125}
"""The smallest disk ``--sweep-disk`` draws (1 of 8 points)."""
SHAPE_FRACTIONS = {"disjoint": FRACTIONS, "conversations": FRACTIONS, "agentic": SMALLEST}

DEEP = os.environ.get("KVCHUNK_PROFILE", "ci") == "deep"


@dataclass(frozen=True)
class EvictionCase:
    fixture: str
    shape: str
    budget: str
    num_cpu_chunks: int
    num_gpu_blocks: int

    def __str__(self) -> str:
        return f"{self.fixture}-block_size512-{self.shape}-{self.budget}-packed"

    @property
    def workload(self) -> Workload:
        return SHAPES[self.shape]


GEMMA_CI = (("conversations", "budget=1/2"), ("disjoint", "budget=1/4"), ("agentic", "budget=1/8"))
"""gemma-4's rows are 40 MiB (2 ranks x 20 MiB): a pass writes one to two GiB of files.
CI runs these three gemma cases (about 10-30 s each on a 2-core runner), ``deep`` all five."""

CASES = [
    # DeepSeek-V4: 2 MiB rows; the CPU tier holds every chunk of a pass.
    *(EvictionCase(DSV4, s, b, 640, 1024) for s in SHAPES for b in SHAPE_FRACTIONS[s]),
    # gemma-4: the CPU tier holds every chunk of a pass (about 90, 40 MiB each).
    *(EvictionCase(GEMMA, s, b, 96, 512) for s in SHAPES for b in SHAPE_FRACTIONS[s]
      if DEEP or (s, b) in GEMMA_CI),
]


def _prompts(workload: Workload) -> list[WorkloadRequest]:
    return list(requests(workload))


def _driver(case: EvictionCase, root: Path, disk_bytes: int) -> Any:
    """The case's engine (:func:`conformance.harness.hybrid_tier.tier_driver`, packed)."""
    return H.tier_driver(case.fixture, root, layout="packed", disk_bytes=disk_bytes,
                         num_cpu_chunks=case.num_cpu_chunks, num_gpu_blocks=case.num_gpu_blocks)


@dataclass(frozen=True)
class TierState:
    """What kvchunk's tier had done when a pass ended (cumulative)."""

    files_stored: int
    files_opened: int
    files_evicted: int
    stores_refused: int
    keys_not_admitted: int
    store_failures: int
    load_failures: int
    files_on_disk: int
    ledger_files: int
    stranded_bytes: int
    """By the tier's own count: 0, as no store is pending when a pass ends (issue #31)."""


def _tier_state(tier: Any) -> TierState:
    from vllm_adapter.disk.packed_file import iter_packed_files

    budget = tier.budget.counters.as_dict()
    snap = tier.budget.snapshot(stranded=True)
    c = tier.counters
    return TierState(
        files_stored=c.files_stored, files_opened=c.files_opened,
        files_evicted=budget["files_evicted"], stores_refused=budget["stores_refused"],
        keys_not_admitted=budget["keys_not_admitted"], store_failures=c.store_failures,
        load_failures=c.load_failures,
        files_on_disk=sum(1 for _ in iter_packed_files(tier.namespace_dir)),
        ledger_files=snap["disk_files"], stranded_bytes=snap["stranded_bytes"],
    )


def _record_hits(session: Any, monkeypatch: pytest.MonkeyPatch) -> dict[str, tuple[int, int, int]]:
    """Request id -> (prompt tokens, GPU prefix hit, offload hit) of the last answer the
    connector gave the scheduler (a deferred lookup, None, is asked again)."""
    connector = session.connector_scheduler
    real = connector.get_num_new_matched_tokens
    hits: dict[str, tuple[int, int, int]] = {}

    def lookup(request: Any, num_computed_tokens: int, *args: Any, **kwargs: Any) -> Any:
        out = real(request, num_computed_tokens, *args, **kwargs)
        if out[0] is not None:
            hits[request.request_id] = (int(request.num_prompt_tokens), int(num_computed_tokens),
                                        int(out[0]))
        return out

    monkeypatch.setattr(connector, "get_num_new_matched_tokens", lookup)
    return hits


def _serve_passes(session: Any, tier: Any, prompts: list[tuple[int, ...]]) -> list[TierState]:
    """The economics lane's two passes (:func:`conformance.harness.tiered.run_workload_passes`),
    file I/O drained after every step (:func:`conformance.harness.hybrid_tier.run_drained`):
    the GPU prefix cache reset before every request; between the passes the CPU tier
    reset and its region poisoned.  The tier's state when each pass ended."""
    from conformance.protocol.trace import RequestSpec

    states: list[TierState] = []
    for n in range(2):
        if n:
            T.reset_all(session)
            T._poison_region(session)
        for i, prompt in enumerate(prompts):
            assert session.reset_prefix_cache(), "GPU prefix-cache reset refused between requests"
            session.add_request(RequestSpec(f"p{n}r{i}", prompt, max_tokens=OUTPUT_TOKENS))
            H.run_drained(session)
            T.drain_files(session)
        states.append(_tier_state(tier))
    return states


COUNTS = ("files evicted", "files on disk", "files read", "tokens recomputed",
          "files written", "stores refused", "keys not admitted")
"""What must equal the reference, in both passes (pass 1's files read must be 0: the CPU
tier serves every reuse)."""


def _reference(counts: X.PassCounts) -> dict[str, int]:
    return {
        "files evicted": counts.files_evicted, "files on disk": counts.files_on_disk,
        "files read": counts.files_read, "tokens recomputed": counts.recomputed_tokens,
        "files written": counts.files_written, "stores refused": counts.stores_refused,
        "keys not admitted": counts.keys_not_admitted,
    }


@pytest.mark.parametrize("case", CASES, ids=str)
def test_budgeted_packed_tier_evicts_keeps_and_reads_what_the_reference_predicts(
    case: EvictionCase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    record_property: Any,
    request: pytest.FixtureRequest,
) -> None:
    from conformance.harness import safe_fs_faults as SF
    from vllm_adapter.connector import resolve_for_vllm
    from vllm_adapter.planning import fixture_knob

    dev = deviations.find("kvchunk", "data", str(case))
    if dev is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=dev.xfail_reason()))
    record_property("fixture", case.fixture)
    record_property("knob", f"block_size=512, retention=0, {case.shape}, {case.budget}, "
                    "packed tier, eviction reachable")
    reqs = _prompts(case.workload)
    policy = dataclasses.replace(rules_for(V.VLLM_VERSION).policy, retention_interval=RETENTION)
    knob = fixture_knob(case.fixture, "block_size", 512)
    row = knob.row.row_bytes()
    fractions = SHAPE_FRACTIONS[case.shape]
    total, sizes = X.budgets(knob.chunking, reqs, policy, row_bytes=row, budget_tokens=BUDGET,
                             fractions=list(fractions.values()))
    disk_bytes = dict(zip(fractions, sizes, strict=True))[case.budget]
    want = X.predict(knob.chunking, reqs, policy, row_bytes=row, budget_bytes=disk_bytes,
                     budget_tokens=BUDGET)
    record_property("econ:disk_bytes_to_use", disk_bytes)
    record_property("econ:pass1_unbounded_bytes", total)

    driver = _driver(case, tmp_path, disk_bytes)
    chunking, _ = resolve_for_vllm(driver.vllm_config, driver.kv_cache_config)
    assert chunking == knob.chunking, f"{case}: the driver's chunking is not the fixture's knob"
    assert max(p.cpu_keys for p in want) <= case.num_cpu_chunks, (
        f"{case}: the reference stores {max(p.cpu_keys for p in want)} chunks in a pass, more "
        f"than the CPU tier's {case.num_cpu_chunks}: the model needs a CPU tier that holds them"
    )
    session, runner = T.open_session(driver, BUDGET)
    tier = SF.tier_of(session)
    assert tier.layout == "packed" and tier.budget.ledger.files_budget == disk_bytes, (
        tier.layout, tier.budget.ledger.files_budget)
    assert tier._block_size == row, (
        f"{case}: the tier's rows are {tier._block_size} bytes, the geometry's {row}")
    # Files read are the tier's opens: a load job large enough to split across its pool
    # opens a file once per slice (reference.packed_split.load_slices, the tier's rule).
    want = X.predict(knob.chunking, reqs, policy, row_bytes=row, budget_bytes=disk_bytes,
                     budget_tokens=BUDGET, load_split=tier.load_split)
    hits = _record_hits(session, monkeypatch)
    try:
        states = _serve_passes(session, tier, [r.prompt for r in reqs])
    finally:
        T.shutdown(session)
    zero = TierState(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    got: list[dict[str, int]] = []
    for n, (state, before) in enumerate(zip(states, [zero, *states[:-1]], strict=True)):
        served = [hits[f"p{n}r{i}"] for i in range(len(reqs))]
        got.append({
            "files evicted": state.files_evicted - before.files_evicted,
            "files on disk": state.files_on_disk,
            "files read": state.files_opened - before.files_opened,
            "tokens recomputed": sum(p - g - e for p, g, e in served),
            "files written": state.files_stored - before.files_stored,
            "stores refused": state.stores_refused - before.stores_refused,
            "keys not admitted": state.keys_not_admitted - before.keys_not_admitted,
        })
    expected = [_reference(p) for p in want]
    for n in range(len(got)):
        for name in COUNTS:
            record_property(f"econ:pass{n + 1}:predicted {name}", expected[n][name])
            record_property(f"econ:pass{n + 1}:{name}", got[n][name])
    summary = (
        f"{case} (disk_bytes_to_use {disk_bytes}): tier {got}; reference {expected}; "
        f"tier states {states}; {runner.stats.describe()}"
    )
    differ = [
        f"pass {n + 1} {name}: tier {got[n][name]}, reference {expected[n][name]}"
        for n in range(len(got)) for name in COUNTS if got[n][name] != expected[n][name]
    ]
    assert not differ, f"{case}: {'; '.join(differ)} ({summary})"
    last = states[-1]
    assert last.load_failures == 0, f"a load failed: the comparison needs readable files; {summary}"
    assert last.store_failures == last.stores_refused, (
        f"a store failed other than by the budget: {summary}")
    assert runner.stats.corrupted_loads == 0 and runner.stats.foreign_bytes_changed == 0, summary
    assert all(s.files_on_disk == s.ledger_files for s in states), (
        f"the ledger and the directory disagree: {summary}")
    assert all(s.stranded_bytes == 0 for s in states), (
        f"a pass ended with stranded bytes, no store pending: {summary}")
