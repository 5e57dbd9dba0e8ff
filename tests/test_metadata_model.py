"""vllm_adapter.metadata_model: metadata operations per layout and engines per file system.

The per-event costs are restated here from the syscalls (``strace`` of vLLM's ``fs_io_C`` and
of kvchunk's ledger), not imported, and the totals recomputed from
``reference.economics``' counts.  No vLLM needed (the CLI's run on both models:
``tests/test_cli.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest

from conformance.harness.tables import DSV4_TP4, GEMMA4_TP2
from reference.economics import Engine, Tally, economics, hashed, summarize
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.keys import split_key
from reference.knobs import BlockSize, BlocksPerChunk, resolve
from reference.plan import Policy
from reference.workload import preset, requests
from vllm_adapter import metadata_model as M

# Per event, by kind: (created, opened, renamed, unlinked, makedirs, lookups, root lock,
# ledger appends).
VLLM_STORE = (1, 0, 1, 0, 1, 1, 0, 0)  # access(dest); create_directories' stat; create; rename
VLLM_LOAD = (0, 1, 0, 0, 0, 1, 0, 0)  # the access that found it; open
VLLM_MISS = (0, 0, 0, 0, 0, 1, 0, 0)  # per request and group: the access after the hit
# open lock, flock, symlink held, open journal (replay; fstat), open journal, write, readlink
# held, unlink held, release
TRANSACTION = (0, 3, 0, 0, 0, 0, 5, 1)
PACKED_FILE = (0, 1, 2, 0, 0, 1, 0, 0)  # the victim's rename onto the temporary name (it is
# recycled), its open, the rename into place, poll stat; no mkdir
PACKED_STORE_JOB = tuple(2 * t for t in TRANSACTION)  # reserve and complete: its files together
PACKED_LOAD = (0, 1, 0, 0, 0, 0, 0, 0)
PACKED_JOB = (0, 1, 0, 0, 0, 0, 0, 1)
POLLS = 2  # the ledger follower's polls per second (a stat each): every 0.5 s


def test_the_per_event_tables_are_the_syscalls() -> None:
    for ops, want in ((M.PER_CHUNK_STORE, VLLM_STORE), (M.PER_CHUNK_LOAD, VLLM_LOAD),
                      (M.PER_CHUNK_MISS_PROBE, VLLM_MISS), (M.LEDGER_TRANSACTION, TRANSACTION),
                      (M.PACKED_FILE, PACKED_FILE), (M.PACKED_STORE_JOB, PACKED_STORE_JOB),
                      (M.PACKED_LOAD, PACKED_LOAD),
                      (M.PACKED_LOAD_JOB, PACKED_JOB)):
        assert tuple(getattr(ops, k) for k in M.OP_KINDS) == want
    assert (M.PER_CHUNK_STORE.total, M.LEDGER_TRANSACTION.total, M.PACKED_FILE.total,
            M.PACKED_STORE_JOB.total) == (4, 9, 4, 18)
    assert M.FOLLOWER_REPLAY.total == 7 and M.FOLLOWER_POLLS_PER_S == POLLS


def each_engine(n: int, own: float, fixed: float, peer_appends: float) -> float:
    replays = min(fixed, (n - 1) * peer_appends)  # one replay per poll at most
    return own + fixed + 7 * replays  # a peer's file costs nothing until a load opens it


def most_engines(capacity: float, own: float, fixed: float = 0.0,
                 peer_appends: float = 0.0) -> int:
    """A linear scan: the last n whose n engines fit."""
    n = 0
    while (n + 1) * each_engine(n + 1, own, fixed, peer_appends) <= capacity:
        n += 1
    return n


@pytest.mark.parametrize(("capacity", "own", "fixed", "appends"), [
    (2700, 257.3, 0, 0), (2700, 2700, 0, 0), (2700, 2700.5, 0, 0), (10, 0.001, 0, 0),
    (2700, 69, 2, 9.0), (10000, 70.7, 2, 9.0), (2700, 1, 2, 0.02), (2700, 69, 50, 9.0),
    (500, 600, 2, 1), (100_000, 5, 2, 100),
])
def test_engines_served_is_the_last_count_that_fits(
    capacity: float, own: float, fixed: float, appends: float
) -> None:
    got = M.engines_served(capacity, own, fixed, appends)
    assert got == most_engines(capacity, own, fixed, appends)
    if not fixed:
        assert got == math.floor(capacity / own)


def test_an_engine_that_asks_nothing_has_no_limit() -> None:
    assert M.engines_served(2700, 0.0) is None


def test_both_layouts_are_the_reference_counts_times_the_per_event_costs() -> None:
    """A small hybrid geometry (full attention and a window) on the chat preset: every kind
    per million prompt tokens, the rate at T and the engines at N, recomputed."""
    groups = (KVGroup(0, GroupKind.FULL, 16),
              KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=1024))
    chunking = resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(32))
    e = economics(chunking, preset("chat"), Policy())
    per_million = 1e6 / e.prompt_tokens
    tokens, capacity = 20_000, 5_000
    m = M.metadata_economics(e, capacity, tokens)
    assert (m.fs_metadata_ops, m.prefill_tokens_per_s) == (capacity, tokens)
    assert m.cached_fraction == pytest.approx(
        (e.gpu_hit_tokens + e.offload_hit_tokens) / e.prompt_tokens)
    per_chunk, packed = m.layouts
    assert (per_chunk.layout, packed.layout) == ("per_chunk", "packed")
    want_chunk = [
        (e.per_chunk.files_written * s + e.per_chunk.file_opens * r
         + e.requests * len(e.groups) * p) * per_million
        for s, r, p in zip(VLLM_STORE, VLLM_LOAD, VLLM_MISS, strict=True)
    ]
    # A job writes a file of its full-attention keys and one of its window keys (one when it
    # holds one kind): more files than jobs here, at most two per job.
    jobs = e.packed.jobs_written
    assert 0 < jobs < e.packed.files_written <= 2 * jobs
    want_packed = [
        (e.packed.files_written * f + jobs * t + e.packed.file_opens * r + e.load_jobs * j)
        * per_million
        for f, t, r, j in zip(PACKED_FILE, PACKED_STORE_JOB, PACKED_LOAD, PACKED_JOB, strict=True)
    ]
    for row, want in ((per_chunk, want_chunk), (packed, want_packed)):
        got = [getattr(row, f"{k}_per_million") for k in M.OP_KINDS]
        assert got == pytest.approx(want)
        assert row.ops_per_million == pytest.approx(sum(want))
    assert per_chunk.unlinked_per_million == 0 and per_chunk.ledger_locks_per_million == 0
    # No ordering here: this geometry's packed files are not many times fewer than its chunk
    # files, and each job costs two ledger transactions (test_cli.py holds the order on both
    # real models)
    own_chunk = sum(want_chunk) * tokens / 1e6
    assert per_chunk.ops_per_second == pytest.approx(own_chunk)
    assert per_chunk.engines == math.floor(capacity / own_chunk)
    own_packed = sum(want_packed) * tokens / 1e6
    assert packed.ops_per_second == pytest.approx(own_packed + POLLS)
    peer_appends = (2 * jobs + e.load_jobs) * per_million * tokens / 1e6
    n = most_engines(capacity, own_packed, POLLS, peer_appends)
    assert packed.engines == n
    assert packed.ops_per_second_per_engine_at_engines == pytest.approx(
        each_engine(n, own_packed, POLLS, peer_appends))
    assert n * packed.ops_per_second_per_engine_at_engines <= capacity


def test_without_a_prefill_rate_only_the_counts() -> None:
    groups = (KVGroup(0, GroupKind.FULL, 16),)
    chunking = resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(32))
    m = M.metadata_economics(economics(chunking, preset("chat"), Policy()))
    assert m.fs_metadata_ops == M.DEFAULT_FS_METADATA_OPS and "CephFS" in m.fs_metadata_ops_source
    assert "disk-anchors.md" in m.fs_metadata_ops_source
    for row in m.layouts:
        assert row.ops_per_million > 0
        assert (row.ops_per_second, row.engines, row.ops_per_second_per_engine_at_engines) == (
            None, None, None)


class _JobRecorder(Engine):
    """The economics' engine, keeping each store job's keys not stored before (what the
    tier writes: a key already on disk is not written again)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.jobs: list[list[bytes]] = []
        self._stored: set[bytes] = set()

    def _count_store(self, keys: Sequence[bytes], tally: Tally) -> None:
        super()._count_store(keys, tally)
        new = [k for k in dict.fromkeys(keys) if k not in self._stored]
        self._stored.update(new)
        if new:
            self.jobs.append(new)


@pytest.mark.parametrize(("geometry", "full"), [(GEMMA4_TP2, {5}), (DSV4_TP4, {2})],
                         ids=["gemma-4", "dsv4"])
def test_a_store_job_holding_windows_writes_two_files(geometry: Geometry, full: set[int]) -> None:
    """The packed tier writes a store job's full-attention keys in one file and its window
    keys in another (``reference.packed.store_job_files``), so on the two hybrid models at
    ``block_size`` 512 the files written are one per job and kind of key it holds: more
    than the jobs, at most twice; the metadata model prices a file per file and two ledger
    transactions per job."""
    chunking = resolve(geometry, BlockSize(512))
    assert {gc.group.index for gc in chunking.groups if gc.window_in_chunks is None} == full
    workload = preset("agentic")
    engine = _JobRecorder(chunking, Policy(), workload.max_num_batched_tokens)
    engine.gpu_cache = workload.gpu_cache
    for req, chain in hashed(list(requests(workload)), chunking.tokens_per_hash):
        engine.serve(req, chain)
    e = summarize(workload.name, chunking, engine.tally)
    jobs = engine.jobs
    kinds = [(any(split_key(k)[1] in full for k in job), any(split_key(k)[1] not in full
                                                             for k in job)) for job in jobs]
    want_files = sum(a + b for a, b in kinds)
    assert e.packed.jobs_written == len(jobs)
    assert e.packed.files_written == want_files
    assert len(jobs) < want_files <= 2 * len(jobs)
    assert any(a and b for a, b in kinds), "no job held both kinds: the case tests nothing"
    # Every file holds one kind of key, each key one section.
    for sections, _ in e.packed.files:
        assert len({g in full for g, _ in sections}) == 1, sections
    assert e.packed.sections_written == e.per_chunk.files_written == sum(len(j) for j in jobs)
    m = M.metadata_economics(e)
    per_million = 1e6 / e.prompt_tokens
    packed = m.layouts[1]
    # each file: its victim renamed onto the temporary name and the rename into place
    assert packed.renamed_per_million == pytest.approx(2 * want_files * per_million)
    assert packed.created_per_million == 0
    assert packed.ledger_locks_per_million == pytest.approx(len(jobs) * 2 * 5 * per_million)
