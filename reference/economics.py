"""File economics from the rules: what a workload writes to and reads from an offload tier.

An operator sizing a disk tier asks: for this knob and this workload, how many
files (and bytes) does the tier write and read per million tokens, and how many
tokens does the chunk granularity cost?  :func:`economics` answers by serving
the workload's requests (:mod:`reference.workload`) through the reference's own
:class:`~reference.plan.Planner` -- the same store and lookup rules the plan lane
holds vLLM to -- over an unbounded chunk index, with the calls an engine makes:
lookup, allocate, prefill in ``max_num_batched_tokens`` steps, decode, finish.

What it counts
--------------
* **files written** per group: chunk keys the store accepted (vLLM's file tier
  writes one file per chunk per group, every stored chunk, once: it is
  write-through below the CPU tier and a key already held is not stored again).
* **files read** per group: chunk keys of every load job.  A load is counted as a
  disk read: the CPU tier is assumed not to hold the chunk (the disk tier's
  worst case, and what a CPU tier much smaller than the disk sees).
* **tokens recomputed** because of chunk granularity: per request, the tokens an
  ideal cache would serve (the longest prefix computed before, to the hash unit,
  at most ``prompt - 1``) minus those served (GPU hit plus offload hit).  Split as
  ``partial tail`` (past the last full-attention chunk end of that ideal prefix)
  and ``lost chunks`` (whole chunks a request could not use: an unaligned GPU hit
  that forfeits the chunk it overlaps, windows not kept under sparse retention,
  output tokens not stored under prompt-only storing).

* **the packed layout** (:class:`~reference.layout_economics.LayoutEconomics`): files,
  sections, opens and reads of the tier's packed files (per store job, its
  full-attention keys in one file and its window keys in another:
  :func:`reference.packed.store_job_files`), and of one file per request (the
  alternative unit), counted from the Planner's own store and load jobs
  (:mod:`reference.layout_economics`).

Counts are per million *prompt tokens served* (the sum of the requests' prompt
lengths): the traffic an operator knows.  Bytes are files times the file size
the caller gives per group (vLLM: one CPU-tier row per file).

What it assumes
---------------
* Nothing is refused: the index is unbounded (capacity effects are separate).
* The GPU prefix cache holds what :class:`~reference.workload.GpuCache` says: ``cold``
  (the default, and what ``conformance/lanes/test_tiered_economics.py`` checks against
  vLLM) or ``hot_shared_prefix`` (modelled, not checked: vLLM's LRU block pool keeps the
  sessions' recent blocks, not the shared prefix -- deviation
  ``gpu-cache-keeps-recent-requests-not-the-shared-prefix``).
* Junctions follow :attr:`Policy.offload_junctions`
  (:func:`reference.rules.shared_prefix_junction`); with a hot shared prefix the
  GPU cache pins one at the GPU hit (:func:`reference.rules.gpu_prefix_hit`,
  :func:`reference.rules.pinned_junction`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from reference.jobs import LoadJob, StoreJob
from reference.keys import group_keys, prefix_block_hashes, split_key
from reference.knobs import Chunking, GroupChunking
from reference.layout_economics import (
    PACKED,
    PACKED_PER_REQUEST,
    PER_CHUNK,
    LayoutEconomics,
    LayoutTally,
    PackedLoads,
    Sections,
    _PackedFiles,
    layout_economics,
)
from reference.mathutil import cdiv, round_down
from reference.packed import store_job_files
from reference.plan import BlockRef, Planner, Policy, ScheduledRequest
from reference.plan_inputs import NULL_BLOCK, ChunkIndex, block_ref
from reference.rules import (
    first_kept_block,
    full_attention_end,
    gpu_prefix_hit,
    hit_limit,
    pinned_junction,
    shared_prefix_junction,
)
from reference.store import LookupResult, StorePlan
from reference.workload import GpuCache, Workload, WorkloadRequest, requests

__all__ = [
    "MILLION",
    "Economics",
    "Engine",
    "GroupEconomics",
    "Tally",
    "UnboundedIndex",
    "economics",
    "hashed",
    "serve",
    "summarize",
]

MILLION = 10**6


class UnboundedIndex:
    """A chunk index that holds every key it is given (no slots, no eviction, no bytes)."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self._pending: set[bytes] = set()

    def lookup(self, key: bytes) -> LookupResult:
        if key in self._pending:
            return LookupResult.HIT_PENDING
        return LookupResult.HIT if key in self.held else LookupResult.MISS

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        new = tuple(dict.fromkeys(k for k in keys if k not in self.held and k not in self._pending))
        self._pending.update(new)
        return StorePlan(new, tuple(range(len(new))), ())

    def prepare_load(self, keys: Sequence[bytes]) -> object:
        return None

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        self._pending.difference_update(keys)
        if success:
            self.held.update(keys)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        return None

    def reset(self) -> None:
        self.held.clear()
        self._pending.clear()


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupEconomics:
    index: int
    tokens_per_chunk: int
    files_written: int
    files_read: int
    """Every load read from disk (a CPU tier that never holds the chunk)."""
    files_read_once: int
    """Each loaded chunk read from disk once (a CPU tier that keeps what it read)."""
    file_bytes: int

    @property
    def bytes_written(self) -> int:
        return self.files_written * self.file_bytes

    @property
    def bytes_read(self) -> int:
        return self.files_read * self.file_bytes


@dataclass(frozen=True)
class Economics:
    """What serving a workload wrote, read and recomputed (totals; see :meth:`per_million`)."""

    workload: str
    requests: int
    prompt_tokens: int
    """The denominator: the sum of the requests' prompt lengths."""
    groups: tuple[GroupEconomics, ...]
    ideal_tokens: int
    """Tokens an ideal cache would serve (see the module docstring)."""
    gpu_hit_tokens: int
    offload_hit_tokens: int
    recomputed_tail_tokens: int
    recomputed_lost_tokens: int
    load_jobs: int
    packed: LayoutEconomics
    """The tier's packed files: per store job, its full-attention keys in one file and its
    window keys in another (:func:`reference.packed.store_job_files`), each key a section."""
    packed_per_request: LayoutEconomics
    """One file per request, all its stored keys (the alternative unit)."""

    @property
    def per_chunk(self) -> LayoutEconomics:
        """Today's layout in :class:`LayoutEconomics` terms: a file per key, a read per file."""
        def one(g: GroupEconomics) -> Sections:
            return ((g.index, 0),)  # a per-chunk file's size does not depend on its key

        return LayoutEconomics(
            PER_CHUNK,
            tuple((one(g), g.files_written) for g in self.groups if g.files_written),
            tuple(((one(g), one(g)), g.files_read) for g in self.groups if g.files_read),
            tuple(((one(g), one(g)), g.files_read_once) for g in self.groups
                  if g.files_read_once),
            self.files_read, self.files_read_once,
        )

    @property
    def layouts(self) -> tuple[LayoutEconomics, LayoutEconomics]:
        """The tier's two layouts: per chunk, packed (one or two files per store job)."""
        return self.per_chunk, self.packed

    @property
    def file_bytes(self) -> dict[int, int]:
        """Group index -> its file (CPU-tier row) bytes as given to :func:`summarize`."""
        return {g.index: g.file_bytes for g in self.groups}

    @property
    def files_written(self) -> int:
        return sum(g.files_written for g in self.groups)

    @property
    def files_read(self) -> int:
        return sum(g.files_read for g in self.groups)

    @property
    def files_read_once(self) -> int:
        return sum(g.files_read_once for g in self.groups)

    @property
    def bytes_written(self) -> int:
        return sum(g.bytes_written for g in self.groups)

    @property
    def bytes_read(self) -> int:
        return sum(g.bytes_read for g in self.groups)

    @property
    def recomputed_tokens(self) -> int:
        return self.recomputed_tail_tokens + self.recomputed_lost_tokens

    def per_million(self, count: int) -> float:
        """``count`` per million prompt tokens served."""
        return count * MILLION / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Tally:
    """One pass's counters (per group index where keyed by group)."""

    written: Counter[int] = field(default_factory=Counter)
    read: Counter[int] = field(default_factory=Counter)
    read_once: Counter[int] = field(default_factory=Counter)
    """Loaded keys not loaded before in the pass: the reads of a CPU tier that keeps
    whatever it read (each chunk read from disk once)."""
    requests: int = 0
    prompt_tokens: int = 0
    ideal: int = 0
    gpu_hit: int = 0
    offload_hit: int = 0
    tail: int = 0
    lost: int = 0
    load_jobs: int = 0
    packed: LayoutTally = field(default_factory=LayoutTally)
    """The packed tier's files: one or two per store job (full-attention, windows)."""
    packed_per_request: LayoutTally = field(default_factory=LayoutTally)
    """One file per request, all its stored keys (the alternative unit)."""


# ---------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------


class Engine:
    """Scheduler-side engine over a Planner: one request at a time, jobs done at once.

    The one engine loop of the project (:meth:`serve`): the economics counts its
    jobs; :class:`conformance.harness.sim.SimEngine` subclasses it to move real bytes.
    What a subclass changes are the hooks :meth:`_allocate` (block ids),
    :meth:`_table_tokens` (how much of the request a block table covers),
    :meth:`_allocated` (the tables are known), :meth:`_computing` (the model computes a token range), :meth:`_run_load` and
    :meth:`_run_store` (execute a job; a store answers whether it succeeded), and the
    ``index`` and ``pin_junctions`` it is built with.
    """

    def __init__(
        self,
        chunking: Chunking,
        policy: Policy,
        budget: int,
        index: ChunkIndex | None = None,
        *,
        pin_junctions: bool = True,
        packed_loads: PackedLoads | None = None,
    ) -> None:
        self.chunking = chunking
        self.policy = policy
        self.budget = budget
        self.index: ChunkIndex = UnboundedIndex() if index is None else index
        self.planner = Planner(chunking, self.index, policy)
        self.pin_junctions = pin_junctions
        """Shared-prefix junctions (:func:`pinned_junction`) go to the Planner as the
        engine's ``shared_prefix_boundary``; False: never (the simulator's engine)."""
        self.num_groups = max(gc.group.index for gc in chunking.groups) + 1
        self.gpu_alignment = math.lcm(*(gc.group.tokens_per_block for gc in chunking.groups))
        self.tph = chunking.tokens_per_hash
        self.next_block = 1
        self.seen_hashes: set[bytes] = set()
        """Every hash unit computed so far (prompts and outputs): the ideal cache."""
        self.hot_prefixes: set[bytes] = set()
        """Hashes at the end of shared prefixes the GPU cache holds (HOT_SHARED_PREFIX)."""
        self.windowed = any(gc.window_in_chunks is not None for gc in chunking.groups)
        self.tally = Tally()
        self.loaded: set[bytes] = set()
        """Keys loaded in this pass (see ``Tally.read_once``)."""
        self.packed = _PackedFiles(packed_loads)
        """The packed tier's files: one or two per store job (kept across passes, like the
        files); ``packed_loads``: how its load jobs are split across the pool (None: one
        task each)."""
        self.packed_per_request = _PackedFiles(packed_loads)
        """One file per request (kept across passes)."""
        self._request_keys: list[bytes] = []
        """Keys stored by the request being served (its per-request file)."""
        self._ids = 0

    # -- hooks ----------------------------------------------------------------

    def _allocate(self, gc: GroupChunking, n: int) -> list[int]:
        """``n`` fresh block ids for group ``gc`` (one pool for all groups; 0 is the null block)."""
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def _table_tokens(self, prompt_tokens: int, total_tokens: int) -> int:
        """Tokens a request's block tables cover: the prompt and its output."""
        return total_tokens

    def _allocated(self, req_id: str, tables: Sequence[Sequence[int]]) -> None:
        """The request's block tables (per group index, 0 a null block) are allocated."""

    def _computing(self, req_id: str, tables: Sequence[Sequence[int]], start: int,
                   end: int) -> None:
        """The model computes tokens ``[start, end)`` of the request (nothing to do here)."""

    def _run_load(self, req_id: str, load: LoadJob) -> None:
        """Execute a load job (here: count it)."""
        self._count_load(load, self.tally)

    def _run_store(self, job_id: int, job: StoreJob) -> bool:
        """Execute a store job (here: count it); whether it succeeded."""
        self._count_store(job.keys, self.tally)
        return True

    # -- the loop ---------------------------------------------------------------

    def _junction(self, hashes: Sequence[bytes], n: int, computed: int, hit: int) -> int | None:
        """:func:`shared_prefix_junction` for this lookup (the offload side pins it)."""
        if not (self.policy.offload_junctions and self.windowed):
            return None
        groups = self.chunking.groups
        keys = [len(hashes) // gc.hashes_per_chunk for gc in groups]
        limit = hit_limit(
            n, computed, (), self.windowed, self.policy.last_token,
            self.chunking.mamba_align_tokens,
        )
        key_lists = [group_keys(hashes, gc) for gc in groups]

        def held(p: int, k: int) -> bool:
            return self.index.lookup(key_lists[p][k]) is LookupResult.HIT

        end = full_attention_end(groups, keys, held, computed, limit, False, self.policy.window)
        return shared_prefix_junction(end, computed, hit, self.policy.retention_interval)

    def _gpu_hit(self, req: WorkloadRequest, hashes: Sequence[bytes], n: int) -> int:
        """:func:`gpu_prefix_hit` under :attr:`gpu_cache`: is the request's system prompt held?"""
        units = req.system_tokens // self.tph
        held = (self.gpu_cache is GpuCache.HOT_SHARED_PREFIX and units > 0
                and hashes[units - 1] in self.hot_prefixes)
        return gpu_prefix_hit(req.system_tokens, n, self.gpu_alignment, held)

    gpu_cache: GpuCache = GpuCache.COLD

    def serve(
        self, req: WorkloadRequest, all_hashes: Sequence[bytes], req_id: str | None = None,
    ) -> None:
        """One request, start to finish (``all_hashes``: its prompt's and output's hash units;
        ``req_id``: its id, else ``r<n>``)."""
        tally = self.tally
        self._ids += 1
        rid = f"r{self._ids}" if req_id is None else req_id
        self._request_keys = []
        prompt = req.prompt
        n = len(prompt)
        hashes = tuple(all_hashes[: n // self.tph])
        ideal_units = 0
        for h in hashes:
            if h not in self.seen_hashes:
                break
            ideal_units += 1
        ideal = min(ideal_units * self.tph, n - 1)

        gpu_hit = self._gpu_hit(req, hashes, n)
        planner = self.planner
        planner.new_request(rid, n)
        ext = planner.lookup(rid, hashes, n, gpu_hit)
        assert ext is not None, "nothing is in flight between requests: a lookup cannot defer"
        junction = (
            pinned_junction(self._junction(hashes, n, gpu_hit, ext), gpu_hit,
                            self.policy.retention_interval)
            if self.pin_junctions else 0
        )
        served = gpu_hit + ext

        total = n + len(req.output)
        table_tokens = self._table_tokens(n, total)
        tables: list[list[int]] = [[] for _ in range(self.num_groups)]
        refs: list[list[BlockRef]] = [[] for _ in range(self.num_groups)]
        for gc in self.chunking.groups:
            tpb = gc.group.tokens_per_block
            ids = self._allocate(gc, cdiv(table_tokens, tpb))
            cached = gpu_hit // tpb
            skip = first_kept_block(gc, served) if gc.window_in_chunks is not None else 0
            # the blocks a window left behind (before ``skip``, within what was served) are
            # null: the same frozen reference for each
            nulls = min(skip, cdiv(served, tpb), len(ids))
            ids[:nulls] = [0] * nulls
            row = [NULL_BLOCK] * nulls
            row += [block_ref(b, j < cached) for j, b in enumerate(ids[nulls:], nulls)]
            tables[gc.group.index] = ids
            refs[gc.group.index] = row
        self._allocated(rid, tables)
        load = planner.allocated(rid, refs, ext)
        if load is not None:
            self._run_load(rid, load)
            assert planner.last_job_id is not None
            planner.job_done(planner.last_job_id, success=True)

        done = served
        first = True
        while done < n:
            todo = min(self.budget, n - done)
            self._computing(rid, tables, done, done + todo)
            self._step([ScheduledRequest(
                req_id=rid, num_prompt_tokens=n, num_tokens=n, num_computed_tokens=done,
                num_scheduled_tokens=todo, block_hashes=hashes,
                new_block_ids=tuple(tuple(t) for t in tables) if first else None,
                is_full_table=first, shared_prefix_boundary=junction,
            )])
            done += todo
            first = False
        out = len(req.output)
        final_hashes = tuple(all_hashes[: total // self.tph])
        if out > 1:
            self._computing(rid, tables, n, total - 1)
            self._step([ScheduledRequest(
                req_id=rid, num_prompt_tokens=n, num_tokens=total, num_computed_tokens=n,
                num_scheduled_tokens=out - 1, block_hashes=final_hashes,
                new_block_ids=tuple(tuple(t) for t in tables) if first else None,
                is_full_table=first, shared_prefix_boundary=junction,
            )])
        finished = ScheduledRequest(
            req_id=rid, num_prompt_tokens=n, num_tokens=total, num_computed_tokens=total - 1,
            num_scheduled_tokens=0, block_hashes=final_hashes, is_finished=True,
            shared_prefix_boundary=junction,
        )
        self._step([], finished=[finished])
        self.packed_per_request.write(self._request_keys, tally.packed_per_request)

        self.seen_hashes.update(all_hashes[: (total - 1) // self.tph])
        if req.system_tokens >= self.tph:
            self.hot_prefixes.add(hashes[req.system_tokens // self.tph - 1])
        tally.requests += 1
        tally.prompt_tokens += n
        tally.ideal += ideal
        tally.gpu_hit += gpu_hit
        tally.offload_hit += ext
        full_spans = [gc.tokens_per_chunk for gc in self.chunking.groups
                      if gc.window_in_chunks is None] or [
                          max(gc.tokens_per_chunk for gc in self.chunking.groups)]
        boundary = round_down(ideal, max(full_spans))
        if served < ideal:
            tally.tail += ideal - max(served, boundary)
            tally.lost += max(0, boundary - served)

    def _step(
        self, scheduled: Sequence[ScheduledRequest], finished: Sequence[ScheduledRequest] = (),
    ) -> None:
        """One scheduler step: run the store jobs it gives."""
        for job_id, job in self.planner.step(list(scheduled), finished=list(finished)):
            self.planner.job_done(job_id, success=self._run_store(job_id, job))

    def _count_store(self, keys: Sequence[bytes], tally: Tally) -> None:
        """One store job: a file per key (per chunk); packed, its full-attention keys in one
        file and its window keys in another (:func:`reference.packed.store_job_files`, as
        the tier writes them), each without the keys already on disk."""
        tally.written.update(split_key(k)[1] for k in keys)
        wrote = [self.packed.write(f, tally.packed)
                 for f in store_job_files(keys, self.chunking.full_groups)]
        tally.packed.jobs += any(wrote)
        self._request_keys.extend(keys)

    def _count_load(self, load: LoadJob, tally: Tally) -> None:
        tally.load_jobs += 1
        tally.read.update(split_key(k)[1] for k in load.keys)
        fresh = [k for k in load.keys if k not in self.loaded]
        self.loaded.update(fresh)
        tally.read_once.update(split_key(k)[1] for k in fresh)
        self.packed.read(load.keys, tally.packed, fresh)
        self.packed_per_request.read(load.keys, tally.packed_per_request, fresh)


_Engine = Engine
"""The name :mod:`reference.disk_economics` builds the engine by."""


def hashed(
    reqs: Sequence[WorkloadRequest], tokens_per_hash: int
) -> list[tuple[WorkloadRequest, tuple[bytes, ...]]]:
    """Each request with the hash units of its prompt and output.

    A session's requests are prefixes of its last one (prompt plus output), so
    one hash chain per session serves them all.
    """
    final: dict[int, WorkloadRequest] = {}
    for req in reqs:
        final[req.session] = req
    chains = {
        s: tuple(prefix_block_hashes(r.prompt + r.output, tokens_per_hash))
        for s, r in final.items()
    }
    return [
        (r, chains[r.session][: (len(r.prompt) + len(r.output)) // tokens_per_hash])
        for r in reqs
    ]


@lru_cache(maxsize=16)
def _hashed_workload(
    workload: Workload, tokens_per_hash: int
) -> list[tuple[WorkloadRequest, tuple[bytes, ...]]]:
    """:func:`hashed` of a workload's requests: a sweep expands and hashes them once."""
    return hashed(list(requests(workload)), tokens_per_hash)


def serve(
    chunking: Chunking,
    passes: Sequence[Sequence[WorkloadRequest]],
    policy: Policy = Policy(),  # noqa: B008  (a frozen dataclass)
    *,
    gpu_cache: GpuCache = GpuCache.COLD,
    budget: int = 8192,
    packed_loads: PackedLoads | None = None,
) -> list[Tally]:
    """Serve ``passes`` of requests one after another over one index; a tally per pass.

    The GPU prefix cache is as ``gpu_cache`` says within a pass and empty at the
    start of each (the conformance check resets it between passes).  ``packed_loads``:
    how the packed tier splits its load jobs (its opens and reads; None: one task each).
    """
    return _serve_hashed(
        chunking, [hashed(batch, chunking.tokens_per_hash) for batch in passes], policy,
        gpu_cache, budget, packed_loads,
    )


def _serve_hashed(
    chunking: Chunking,
    passes: Sequence[Sequence[tuple[WorkloadRequest, Sequence[bytes]]]],
    policy: Policy,
    gpu_cache: GpuCache,
    budget: int,
    packed_loads: PackedLoads | None = None,
) -> list[Tally]:
    engine = Engine(chunking, policy, budget, packed_loads=packed_loads)
    engine.gpu_cache = gpu_cache
    tallies = []
    for batch in passes:
        engine.tally = Tally()
        engine.hot_prefixes.clear()
        engine.loaded.clear()
        for req, all_hashes in batch:
            engine.serve(req, all_hashes)
        tallies.append(engine.tally)
    return tallies


def summarize(
    name: str, chunking: Chunking, tally: Tally, file_bytes: Mapping[int, int] | int = 0
) -> Economics:
    """An :class:`Economics` from one pass's tally; ``file_bytes``: per group index, or one size."""
    sizes = (
        {gc.group.index: file_bytes for gc in chunking.groups}
        if isinstance(file_bytes, int)
        else dict(file_bytes)
    )
    groups = tuple(
        GroupEconomics(
            gc.group.index, gc.tokens_per_chunk, tally.written[gc.group.index],
            tally.read[gc.group.index], tally.read_once[gc.group.index],
            sizes.get(gc.group.index, 0),
        )
        for gc in chunking.groups
    )
    return Economics(
        workload=name, requests=tally.requests, prompt_tokens=tally.prompt_tokens, groups=groups,
        ideal_tokens=tally.ideal, gpu_hit_tokens=tally.gpu_hit, offload_hit_tokens=tally.offload_hit,
        recomputed_tail_tokens=tally.tail, recomputed_lost_tokens=tally.lost,
        load_jobs=tally.load_jobs,
        packed=layout_economics(PACKED, tally.packed),
        packed_per_request=layout_economics(PACKED_PER_REQUEST, tally.packed_per_request),
    )


def economics(
    chunking: Chunking,
    workload: Workload,
    policy: Policy = Policy(),  # noqa: B008  (a frozen dataclass)
    file_bytes: Mapping[int, int] | int = 0,
    *,
    packed_loads: PackedLoads | None = None,
) -> Economics:
    """Serve ``workload`` once under ``chunking`` and ``policy``: what the tier writes and
    reads; ``packed_loads``: how the packed tier splits its load jobs (its opens and reads;
    None: one task each)."""
    (tally,) = _serve_hashed(
        chunking, [_hashed_workload(workload, chunking.tokens_per_hash)], policy,
        workload.gpu_cache, workload.max_num_batched_tokens, packed_loads,
    )
    return summarize(workload.name, chunking, tally, file_bytes)

