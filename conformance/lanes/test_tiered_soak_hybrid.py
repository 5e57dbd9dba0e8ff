"""Faults lane, tiered: kvchunk's file tier under a small byte budget on the real hybrid
geometries, a multi-turn soak that must strand nothing whenever the engine is idle.

The budget lane (:mod:`conformance.lanes.test_tiered_budget`) soaks the synthetic
one-group fixture.  Here the gemma-4-31B-it TP2 and DeepSeek-V4-Flash TP4 fixtures at
``block_size: 512`` (full-attention and sliding-window groups: a boundary's hit needs
its window chunks as well as its full-attention prefix) run through vLLM's real
scheduler, connector and tiering manager over kvchunk's tier
(:func:`conformance.harness.hybrid_tier.tier_driver`: eviction ``reachable``, both
layouts) with:

* a budget of a few boundary-sized files (:attr:`SoakCase.boundary_files` of
  :func:`boundary_bytes`: the files of the keys one 512-token alignment step adds to a
  boundary's hit);
* a small CPU tier in front (:attr:`SoakCase.num_cpu_chunks` chunks, a few steps'
  stores), so reuse comes from files and vLLM's CPU tier often still holds part of a
  prefix whose files the disk evicted (its CPU-to-disk cascade carries only the chunks
  it newly stored);
* multi-turn sessions (:func:`soak_prompts`): each turn extends the session's previous
  prompt and output, sessions served round-robin, some sharing a system prefix; the GPU
  prefix cache reset before every request; the file tier's I/O drained after every
  engine step (:func:`conformance.harness.hybrid_tier.run_drained`), so a run is
  reproducible.

After every request (the engine idle, no I/O in flight): the tier's own count of
stranded bytes (``tier.budget.snapshot(stranded=True)``) is 0;
:func:`conformance.harness.budget_checks.quiescent_problems` finds nothing (bytes within
the budget, the ledger naming exactly the files on disk at their sizes, no key in two
files, and no key on disk the reference finds stranded over the requests' whole hash
chains); the root's bytes stayed within the budget after every finished job; no load
was wrong.  At the end: files were evicted (more bytes than the budget) and loads were
served from files.

``ci`` soaks :data:`SESSIONS` sessions of :data:`TURNS` turns (60 requests) on DeepSeek-V4,
packed layout (the per-chunk layout runs the same ledger and rule; its case took 41-58 s
a release under the heavy-lane lock, which CI's two release chains take in turn);
``KVCHUNK_PROFILE=deep`` :data:`DEEP_SESSIONS` sessions of :data:`DEEP_TURNS` turns (160)
on both fixtures and both layouts (gemma-4 in ``deep`` only, 60 requests: :data:`GEMMA_TURNS`).

gemma-4 in ``ci`` (issue #31,
:func:`test_gemma_window_keys_with_a_gap_leave_when_their_request_finishes`): no request is
served; one request's two store jobs go through the tier's ``submit_store``, the first
boundary's keys with a gap on a sliding-window group: its window keys stay while the
request is live and leave once vLLM finishes it.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conformance.testing.requires import require_vllm  # noqa: E402

require_vllm()

from conformance.harness import budget_checks as BC  # noqa: E402
from conformance.harness import hybrid_tier as H  # noqa: E402
from conformance.harness import safe_fs_faults as SF  # noqa: E402
from conformance.harness import tiered as T  # noqa: E402
from conformance.harness.cases import DSV4, GEMMA  # noqa: E402
from conformance.harness.heavy_lock import one_heavy_lane_per_machine  # noqa: E402,F401 (autouse)
from conformance.protocol import deviations  # noqa: E402
from conformance.protocol.trace import RequestSpec  # noqa: E402
from reference import packed as RP  # noqa: E402
from reference.keys import GROUP_ID_BYTES  # noqa: E402
from reference.knobs import Chunking  # noqa: E402
from vllm_adapter.disk import packed_file as P  # noqa: E402
from vllm_adapter.disk import tier as S  # noqa: E402
from vllm_adapter.disk.ledger import budget_for_files  # noqa: E402

pytestmark = [pytest.mark.faults, pytest.mark.xdist_group("heavy")]

PROFILE = os.environ.get("KVCHUNK_PROFILE", "ci")
DEEP = PROFILE == "deep"
SESSIONS, TURNS = 4, 15
GEMMA_TURNS = 6
"""gemma-4's turns per session, were it in ``ci`` (24 requests, not 60): its 40 MiB rows
make a request cost 10-27 s on a loaded 2-core machine (the synthetic runner checks
every loaded block), so 60 would take 10-20 minutes a case.  Its cases run in ``deep``
only, at the issue's 60 requests (:data:`GEMMA_DEEP_SESSIONS` x :data:`GEMMA_DEEP_TURNS`,
not the 160 of DeepSeek-V4's deep cases, which would take about an hour a case): at 24 requests, vLLM 0.34.0, packed,
every request ended with 0 stranded bytes (tier and reference) and 9 files were
evicted, but no load was served from files (the CPU tier, which must hold a hit's 24
and more rows, served every reuse), so the case proves nothing there."""
DEEP_SESSIONS, DEEP_TURNS = 8, 20
GEMMA_DEEP_SESSIONS, GEMMA_DEEP_TURNS = SESSIONS, TURNS
LAYOUTS = ("packed", "per_chunk")
BLOCK_SIZE = 512
STEP_TOKENS = 256
"""Prefill tokens per engine step (``max_num_batched_tokens``): a boundary's window
chunks are stored in steps before its full-attention chunk, as vLLM's chunked prefill
does."""
OUTPUT_TOKENS = 2
KEY_BYTES = 32 + GROUP_ID_BYTES
"""A key: vLLM's 32-byte block hash and the group index."""


@dataclass(frozen=True)
class SoakCase:
    fixture: str
    layout: str
    num_cpu_chunks: int
    """vLLM's CPU tier, in chunks of one row: a few steps' stores, far less than a session."""
    num_gpu_blocks: int
    boundary_files: int
    """The files' budget, in boundary-sized files (:func:`boundary_bytes`)."""
    system_tokens: int
    turn_tokens: tuple[int, int]
    """New user tokens per turn, drawn uniformly in this closed range."""
    turns: int
    """Turns per session in the ``ci`` profile (:data:`SESSIONS` sessions)."""

    def __str__(self) -> str:
        return f"{self.fixture}-block_size{BLOCK_SIZE}-soak-{self.layout}"


CASES = [
    # gemma-4: 40 MiB rows; a 512-token step adds 11 keys to a boundary's hit (2 window
    # chunks of each of 5 sliding groups, 1 full-attention chunk); a deep boundary's hit
    # needs 20 windows.  The CPU tier holds the largest hit and a step's store: a smaller
    # one promotes a hit's files over and over (seen with 16 chunks: one request read
    # 343 GB of files in 5 minutes and never finished).
    *(SoakCase(GEMMA, layout, 40, 512, 4, 256, (64, 256), GEMMA_TURNS) for layout in LAYOUTS
      if DEEP),
    # DeepSeek-V4: 2 MiB rows; a 512-token step adds 12 keys to a hit.  A CPU tier that
    # holds the budget serves every reuse (96 chunks over 4 boundaries' files: no file
    # read in 50 requests), so the budget is 8 boundaries and the CPU tier half of it.
    *(SoakCase(DSV4, layout, 48, 1024, 8, 256, (64, 256), TURNS) for layout in LAYOUTS
      if DEEP or layout == "packed"),
]


def soak_prompts(case: SoakCase, sessions: int, turns: int, seed: int = 31
                 ) -> list[tuple[str, tuple[int, ...]]]:
    """``sessions x turns`` (request id, prompt); each turn's prompt is its session's
    previous prompt, its output and new tokens.  The next request is the same session's
    next turn half the time (a user answering at once), else a turn of another session
    drawn at random.  Sessions start with one of two system prefixes (the first half of
    them the first one, the others the second, every third none)."""
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(100, 60000) for _ in range(n))

    systems = (tokens(case.system_tokens), tokens(case.system_tokens + 300))
    history = [() if s % 3 == 2 else systems[0 if s < sessions // 2 else 1]
               for s in range(sessions)]
    left = dict.fromkeys(range(sessions), turns)
    out: list[tuple[str, tuple[int, ...]]] = []
    s = 0
    while left:
        if s not in left or rng.random() >= 0.5:
            s = rng.choice(sorted(left))
        prompt = history[s] + tokens(rng.randint(*case.turn_tokens))
        history[s] = prompt + tokens(OUTPUT_TOKENS)
        out.append((f"s{s}t{turns - left[s]}", prompt))
        left[s] -= 1
        if not left[s]:
            del left[s]
    return out


def boundary_bytes(chunking: Chunking, row_bytes: int, layout: str) -> int:
    """The bytes of the files that one alignment step (``alignment_tokens``) adds to a
    boundary's hit: each full-attention group's chunks of the step, and each window
    group's chunks of the step its window keeps (at most ``window_in_chunks``); packed, a
    file of the full-attention keys and one of the window keys
    (:func:`reference.packed.packed_file_bytes`); per chunk, a file a key."""
    assert chunking.alignment_tokens is not None, "a hybrid fixture at block_size 512 aligns"
    full = window = 0
    for g in chunking.groups:
        n = max(1, chunking.alignment_tokens // g.tokens_per_chunk)
        if g.window_in_chunks is None:
            full += n
        else:
            window += min(n, g.window_in_chunks)
    if layout == "per_chunk":
        return (full + window) * (S.HEADER_SIZE + row_bytes)
    return sum(RP.packed_file_bytes([row_bytes] * n, [KEY_BYTES] * n) for n in (full, window) if n)


def _serve(session: Any, judge: BC.ReferenceJudge, req_id: str, prompt: tuple[int, ...]) -> bool:
    """Serve one request to the end, file I/O drained after every step; the judge learns
    its whole hash chain.  Whether it finished."""
    session.add_request(RequestSpec(req_id, prompt, max_tokens=OUTPUT_TOKENS))
    request = session.scheduler.requests[req_id]
    H.run_drained(session)
    T.drain_files(session)
    judge.observe(request.block_hashes)
    return req_id not in session.scheduler.requests


@pytest.mark.parametrize("case", CASES, ids=str)
def test_hybrid_soak_small_budget_strands_nothing_when_idle(
    case: SoakCase, tmp_path: Path, record_property: Any, request: pytest.FixtureRequest,
) -> None:
    from vllm_adapter.connector import resolve_for_vllm
    from vllm_adapter.planning import fixture_knob

    dev = deviations.find("kvchunk", "faults", str(case))
    if dev is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=dev.xfail_reason()))
    knob = fixture_knob(case.fixture, "block_size", BLOCK_SIZE)
    row = knob.row.row_bytes()
    files_bytes = case.boundary_files * boundary_bytes(knob.chunking, row, case.layout)
    budget = budget_for_files(files_bytes)
    if DEEP:
        sessions, turns = ((GEMMA_DEEP_SESSIONS, GEMMA_DEEP_TURNS) if case.fixture == GEMMA
                           else (DEEP_SESSIONS, DEEP_TURNS))
    else:
        sessions, turns = SESSIONS, case.turns
    prompts = soak_prompts(case, sessions, turns)
    record_property("fixture", case.fixture)
    record_property("knob", f"block_size={BLOCK_SIZE}, kvchunk {case.layout} fs tier, "
                    f"disk_bytes_to_use {budget} ({case.boundary_files} boundary-sized files), "
                    f"{case.num_cpu_chunks} CPU chunks, {len(prompts)} requests")
    driver = H.tier_driver(case.fixture, tmp_path, layout=case.layout, disk_bytes=files_bytes,
                           num_cpu_chunks=case.num_cpu_chunks, num_gpu_blocks=case.num_gpu_blocks)
    chunking, _ = resolve_for_vllm(driver.vllm_config, driver.kv_cache_config)
    assert chunking == knob.chunking, f"{case}: the driver's chunking is not the fixture's knob"
    session, runner = T.open_session(driver, STEP_TOKENS)
    tier = SF.tier_of(session)
    assert session.hash_block_size == chunking.geometry.tokens_per_hash, (
        f"the engine hashes {session.hash_block_size}-token blocks, the reference chunking "
        f"{chunking.geometry.tokens_per_hash}-token ones")
    assert tier.layout == case.layout and tier.budget.budget == budget, (
        tier.layout, tier.budget.budget)
    judge = BC.ReferenceJudge(chunking)
    watch = BC.BoundWatch(tier, tmp_path, budget, case.layout).install()
    try:
        for i, (req_id, prompt) in enumerate(prompts):
            assert session.reset_prefix_cache(), f"GPU prefix-cache reset refused before {req_id}"
            finished = _serve(session, judge, req_id, prompt)
            snap = tier.budget.snapshot(stranded=True)
            where = f"after request {i + 1} of {len(prompts)} ({req_id}, {len(prompt)} tokens; {snap})"
            assert finished, f"request {req_id} did not finish; {where}"
            assert not watch.excesses, f"bytes over the budget mid-flight: {watch.excesses[:3]}; {where}"
            watch.check(f"request {req_id} drained")
            assert snap["stranded_bytes"] == 0, f"the tier's own model counts stranded bytes {where}"
            problems = BC.quiescent_problems([tier], tmp_path, budget, judge)
            assert not problems, f"{where}: " + "; ".join(problems)
            stats = runner.stats
            assert stats.corrupted_loads == 0 and stats.foreign_bytes_changed == 0, (
                f"wrong bytes served {where}: {stats.describe()}")
    finally:
        T.shutdown(session)
    stats = runner.stats
    snap = tier.budget.snapshot(stranded=True)
    loads = BC.file_loads(tier)
    for name in ("files_evicted", "bytes_evicted", "stores_refused", "keys_not_admitted",
                 "stranded_bytes"):
        record_property(f"counter:budget_{name}", snap[name])
    record_property("counter:budget_file_loads", loads)
    record_property("counter:budget_peak_disk_bytes", watch.peak)
    summary = (f"{snap}; {tier.counters}; {stats.describe()}; {watch.checks} bound checks "
               f"({watch.job_checks} after finished jobs), peak {watch.peak} of {budget} bytes")
    assert snap["files_evicted"] > 0 and snap["bytes_evicted"] > budget, (
        f"the budget never turned over: {summary}")
    assert loads > 0 and stats.loaded_blocks_checked > 0, f"no load was served from files: {summary}"
    assert tier.counters.load_failures == 0, f"a load failed: {summary}"
    assert watch.job_checks > 0, f"the bound was never checked as jobs finished: {summary}"


GAP_SPLIT = 256
"""The gap case's store A ends here: gemma-4's window chunks (256 tokens) of the first
512-token boundary's first half (:func:`conformance.harness.window_gap.window_gap`)."""


def test_gemma_window_keys_with_a_gap_leave_when_their_request_finishes(
    tmp_path: Path, record_property: Any,
) -> None:
    """Issue #31 on gemma-4-31B-it TP2 (``ci``; the soak's gemma-4 cases run in ``deep``):
    the real tier, packed layout, takes one request's two store jobs through
    ``submit_store`` (vLLM's ``TransferJob`` and ``ReqContext``; the tier's reservations,
    packed writer and index), the first boundary's keys with a gap on a sliding-window
    group.  While the request is live its window keys stay (a later chunked-prefill step
    may complete the boundary), though they are stranded by then; once vLLM finishes it
    (``on_request_finished``) they leave: 0 stranded bytes by the tier's own count and by
    :func:`~conformance.harness.budget_checks.quiescent_problems`, store A's file gone from
    the disk, the ledger and the tier's index, B's full-attention file kept."""
    import numpy as np

    from conformance.harness import vllm_harness_api as VH
    from conformance.harness.window_gap import window_gap
    from reference.keys import prefix_block_hashes
    from vllm_adapter.planning import fixture_knob

    knob = fixture_knob(GEMMA, "block_size", BLOCK_SIZE)
    row = knob.row.row_bytes()
    files_bytes = 4 * boundary_bytes(knob.chunking, row, "packed")
    budget = budget_for_files(files_bytes)
    driver = H.tier_driver(GEMMA, tmp_path, layout="packed", disk_bytes=files_bytes,
                           num_cpu_chunks=16, num_gpu_blocks=64)
    session, _ = T.open_session(driver, STEP_TOKENS)
    tier = SF.tier_of(session)
    try:
        chunking = knob.chunking
        hashes = prefix_block_hashes(list(range(1000, 1000 + 2 * BLOCK_SIZE)),
                                     chunking.tokens_per_hash)
        judge = BC.ReferenceJudge(chunking)
        judge.observe(hashes)
        gap = window_gap(chunking, hashes, GAP_SPLIT)
        a, b, missing = list(gap.a), list(gap.b), gap.missing
        ctx = VH.ReqContext(req_id="gap")
        ctx._offload_key_positions.update(gap.positions)
        job_ids = iter(range(1 << 30, (1 << 30) + 2))

        def submit(keys: list[bytes], first_chunk: int) -> None:
            tier.submit_store(VH.TransferJob(
                job_id=next(job_ids), keys=keys, chunk_ids=np.arange(
                    first_chunk, first_chunk + len(keys), dtype=np.int64),
                is_promotion=False, req_context=ctx))
            tier.drain_jobs()

        def counters() -> str:
            return f"{tier.budget.snapshot(stranded=True)}"

        submit(a, 0)
        a_files = {tier.index.get(k)[0] for k in a if tier.index.get(k)}  # type: ignore[index]
        assert len(a_files) == 1 and all(k in tier.index for k in a), (
            f"store A's window chunks were not admitted pending their boundary: {counters()}")
        submit(b, len(a))
        assert all(k in tier.index for k in a), f"A left while its request was live: {counters()}"
        live = tier.budget.snapshot(stranded=True)
        assert live["stranded_bytes"] > 0, (
            f"not vacuous: A's window keys are stranded once B is done: {live}")
        tier.on_request_finished(ctx)
        tier.drain_jobs()
        snap = tier.budget.snapshot(stranded=True)
        record_property("knob", f"block_size={BLOCK_SIZE}, kvchunk packed fs tier, "
                        f"disk_bytes_to_use {budget}, a boundary's window chunk missing")
        for name in ("finished_keys_dropped", "finished_files_removed", "keys_not_admitted",
                     "stranded_bytes"):
            record_property(f"counter:budget_{name}", snap[name])
        where = f"A {len(a)} keys, B {len(b)} keys; live {live}; finished {snap}"
        assert snap["stranded_bytes"] == 0, f"the tier's own model counts stranded bytes: {where}"
        problems = BC.quiescent_problems([tier], tmp_path, budget, judge)
        assert not problems, f"{where}: " + "; ".join(problems)
        assert snap["finished_keys_dropped"] == len(a) and snap["finished_files_removed"] == 1, where
        assert not any(os.path.exists(p) or tier.index.has_file(p) for p in a_files), where
        assert all(k not in tier.index for k in a) and missing not in tier.index, where
        full = [k for k in b if P.group_of_key(k) in chunking.full_groups]
        assert full and all(k in tier.index for k in full), f"B's full-attention file left: {where}"
    finally:
        T.shutdown(session)
