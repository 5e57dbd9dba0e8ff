"""Store and load plans: which chunks are stored, which hits are loaded.

:class:`Planner` is driven by the same scheduler-side calls an engine makes on
an offloading connector, in the same order (see ``docs/semantics.md`` and the
conformance protocol):

``new_request``  a request arrives.
``lookup``       how many tokens past the GPU prefix hit can be loaded.
``allocated``    the engine allocated blocks for the hit: build the load job.
``step``         one scheduler step: update block tables, build store jobs.
``job_done``     a worker finished a job (stores become visible on success).
``reset``        the offload cache is reset.

The rules themselves are stated once in :mod:`reference.rules`; this module
applies them in the engine's order and keeps the engine details that module's
docstring lists (steps and in-flight transfers, re-offered chunks, nulled
reused blocks).  Blocks per chunk is per group throughout; with
one value for all groups each rule is vLLM 0.33.0's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import cache

from reference.geometry import GroupKind
from reference.jobs import LoadJob, StoreJob
from reference.keys import boundary_key
from reference.knobs import Chunking, supports_partial_tail
from reference.plan_inputs import (
    BlockRef,
    ChunkIndex,
    NullBlockRule,
    Policy,
    ScheduledRequest,
    UnsupportedChunking,
)
from reference.plan_state import (
    GroupState,
    JobRecord,
    RequestState,
    boundary_store_job,
    load_job_of,
    store_job_of,
    update_keys,
)
from reference.rules import (
    LastTokenRule,
    StoreState,
    WindowRule,
    computed_after_step,
    hit,
    hit_limit,
    lookup_deferred,
    offered_under_prompt_horizon,
    offloadable_tokens,
    reconsider_from,
    storable_chunk_count,
    storable_chunks,
)
from reference.store import LookupResult

__all__ = [  # the planner and its public inputs (re-exported)
    "BlockRef", "ChunkIndex", "LastTokenRule", "NullBlockRule", "Planner", "Policy",
    "ScheduledRequest", "UnsupportedChunking", "WindowRule", "supports_partial_tail",
]

# ---------------------------------------------------------------------------
# The planner
# ---------------------------------------------------------------------------


class Planner:
    """Scheduler-side offloading semantics for one engine, one chunk store."""

    def __init__(
        self,
        chunking: Chunking,
        store: ChunkIndex,
        policy: Policy = Policy(),  # noqa: B008  (a frozen dataclass)
        num_workers: int = 1,
    ) -> None:
        if supports_partial_tail(chunking):
            raise UnsupportedChunking(
                "this chunking enables vLLM's partial tails (sub-chunk Mamba-align hits: "
                "blocks_per_chunk 1, one block size, a Mamba-align group wider than the "
                "hash unit); the reference does not model them"
            )
        self.chunking = chunking
        self.store = store
        self.policy = policy
        self.num_workers = num_workers
        self._windowed = tuple(
            i for i, gc in enumerate(chunking.groups) if gc.window_in_chunks is not None
        )
        self._requests: dict[str, RequestState] = {}
        self._jobs: dict[int, JobRecord] = {}
        self._next_job_id = 0
        self._stale_below = 0
        self._being_loaded: set[bytes] | None = set() if policy.prefix_caching else None
        self._step_allocated: set[int] = set()
        self._step_loads: list[LoadJob] = []
        self.last_job_id: int | None = None
        """Id of the last load job :meth:`allocated` created."""

    # -- bookkeeping ------------------------------------------------------

    def _new_job(self, req: RequestState, keys: tuple[bytes, ...], is_store: bool) -> int:
        """A fresh job id, recorded for ``req``."""
        job_id = self._next_job_id
        self._next_job_id += 1
        req.jobs.add(job_id)
        self._jobs[job_id] = JobRecord(req.req_id, keys, is_store)
        return job_id

    def new_request(
        self,
        req_id: str,
        num_prompt_tokens: int,
        max_load_tokens: int | None = None,
        max_offload_tokens: int | None = None,
    ) -> None:
        self._requests[req_id] = RequestState(
            req_id=req_id,
            num_prompt_tokens=num_prompt_tokens,
            groups=tuple(GroupState() for _ in self.chunking.groups),
            max_load_tokens=max_load_tokens,
            max_offload_tokens=max_offload_tokens,
        )

    def pending_jobs(self, req_id: str) -> frozenset[int]:
        req = self._requests.get(req_id)
        return frozenset(req.jobs) if req else frozenset()

    # -- (L) lookup -------------------------------------------------------

    def lookup(
        self,
        req_id: str,
        block_hashes: Sequence[bytes],
        num_tokens: int,
        computed_tokens: int,
        max_num_new_tokens: int | None = None,
        skip_reading_prefix_cache: bool = False,
    ) -> int | None:
        """Tokens past ``computed_tokens`` loadable from the store; None = ask again later."""
        req = self._requests[req_id]
        for state in req.groups:
            state.block_ids.clear()
            state.next_stored_chunk = 0  # restarting at token 0: offer every chunk again
        if req.jobs:
            return None
        req.block_hashes = tuple(block_hashes)
        req.num_tokens = num_tokens
        update_keys(self.chunking, req)
        req.computed_tokens = computed_tokens
        if skip_reading_prefix_cache or req.load_failed:
            return 0
        return self._offload_hit(req, max_num_new_tokens)

    def _offload_hit(self, req: RequestState, max_num_new_tokens: int | None) -> int | None:
        """:func:`~reference.rules.hit` over the chunks the store holds (HIT or
        HIT_PENDING), then :func:`~reference.rules.lookup_deferred` (None: ask again)."""
        groups = self.chunking.groups
        computed = req.computed_tokens
        limit = hit_limit(
            req.num_tokens, computed, (max_num_new_tokens, req.max_load_tokens),
            bool(self._windowed), self.policy.last_token, self.chunking.mamba_align_tokens,
        )

        @cache
        def answer(g: int, k: int) -> LookupResult:
            return self.store.lookup(req.groups[g].keys[k])

        tokens = hit(
            groups, [len(state.keys) for state in req.groups],
            lambda g, k: answer(g, k) is not LookupResult.MISS, computed, limit,
            req.max_load_tokens is not None, self.policy.window,
        )
        if tokens == 0:
            return 0
        loading: set[bytes] | frozenset[bytes] = self._being_loaded or frozenset()
        if lookup_deferred(
            groups, computed, computed + tokens,
            lambda g, k: answer(g, k) is LookupResult.HIT_PENDING,
            lambda g, k: req.groups[g].keys[k] in loading, self.policy.window,
        ):
            return None
        return tokens

    # -- (D) load ---------------------------------------------------------

    def allocated(
        self,
        req_id: str,
        blocks: Sequence[Sequence[BlockRef]],
        num_external_tokens: int,
    ) -> LoadJob | None:
        """The engine allocated blocks (per KV-cache group, original index) for the hit.

        Returns the load job, or None when nothing comes from the store.
        """
        for group_blocks in blocks:
            self._step_allocated.update(b.block_id for b in group_blocks if not b.is_null)
        if num_external_tokens == 0:
            return None
        req = self._requests[req_id]
        job = load_job_of(self.chunking, req, blocks, num_external_tokens)
        keys = job.keys
        self.store.prepare_load(keys)
        self.last_job_id = self._new_job(req, keys, is_store=False)
        if self._being_loaded is not None:
            self._being_loaded.update(keys)
        self._step_loads.append(job)
        return job

    # -- (T) one scheduler step -----------------------------------------------

    def step(
        self,
        scheduled: Sequence[ScheduledRequest],
        finished: Sequence[ScheduledRequest] = (),
        block_copy_dst_ids: Sequence[int] = (),
        boundary_handoffs: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
    ) -> list[tuple[int, StoreJob]]:
        """Update block tables and return this step's store jobs (with their job ids).

        ``scheduled`` are the requests with tokens this step, ``finished`` those
        that finished since the last step (in that order, as vLLM iterates).
        ``boundary_handoffs`` maps a request to ``(group index, block id,
        boundary tokens)`` Mamba-align states the engine hands over.
        """
        self._update_tables(scheduled, block_copy_dst_ids)
        jobs = self._boundary_store_jobs(boundary_handoffs or {})
        for info in (*scheduled, *finished):
            if info.req_id not in self._requests:
                continue
            job = self._store_job(info)
            if job is not None:
                jobs.append(job)
        for info in finished:
            req = self._requests.get(info.req_id)
            if req is None:
                continue
            req.finished_signaled = True
            if not req.jobs:
                del self._requests[info.req_id]
        self._step_allocated = set()
        self._step_loads = []
        return jobs

    def _refresh(self, req: RequestState, info: ScheduledRequest) -> None:
        req.block_hashes = info.block_hashes
        req.num_tokens = info.num_tokens
        req.finished = info.is_finished
        update_keys(self.chunking, req)

    def _update_tables(
        self, scheduled: Sequence[ScheduledRequest], block_copy_dst_ids: Sequence[int]
    ) -> None:
        """Extend block tables; null out windowed entries whose block was reused this step."""
        old_ends: dict[str, tuple[int, ...]] = {}
        for info in scheduled:
            req = self._requests.get(info.req_id)
            if req is None:
                continue
            self._refresh(req, info)
            if info.is_full_table:
                for state in req.groups:
                    state.block_ids.clear()
            if info.new_block_ids:
                old_ends[info.req_id] = tuple(len(req.groups[i].block_ids) for i in self._windowed)
                for gc, state in zip(self.chunking.groups, req.groups, strict=True):
                    new = info.new_block_ids[gc.group.index]
                    state.block_ids.extend(new)
                    self._step_allocated.update(b for b in new if b)
        self._step_allocated.update(block_copy_dst_ids)
        if not (self._windowed and self._step_allocated):
            return
        for req_id, req in self._requests.items():
            ends = old_ends.get(req_id)
            for n, i in enumerate(self._windowed):
                state = req.groups[i]
                bpc = self.chunking.groups[i].blocks_per_chunk
                end = ends[n] if ends is not None else len(state.block_ids)
                for j in range(state.next_stored_chunk * bpc, end):
                    if state.block_ids[j] in self._step_allocated:
                        state.block_ids[j] = 0

    def _offloadable(self, req: RequestState, num_tokens: int) -> int:
        return offloadable_tokens(
            num_tokens, req.num_tokens, req.num_prompt_tokens, req.max_offload_tokens,
            self.policy.offload_prompt_only,
        )

    def _storable_chunks(self, req: RequestState, i: int, offloadable: int) -> int:
        gc, state = self.chunking.groups[i], req.groups[i]
        return storable_chunk_count(
            gc, offloadable, req.num_prompt_tokens, req.finished, len(state.block_ids),
            len(state.keys),
        )

    def _advance(self, req: RequestState, offloadable: int) -> None:
        for i, state in enumerate(req.groups):
            state.next_stored_chunk = max(
                state.next_stored_chunk, self._storable_chunks(req, i, offloadable)
            )

    def _store_job(self, info: ScheduledRequest) -> tuple[int, StoreJob] | None:
        req = self._requests[info.req_id]
        self._refresh(req, info)
        after = computed_after_step(
            info.num_computed_tokens, info.num_scheduled_tokens, info.num_prompt_tokens,
            info.num_tokens, info.is_finished, info.is_aborted,
        )
        offloadable = self._offloadable(req, after)
        prompt_offloadable = self._offloadable(req, req.num_prompt_tokens)
        retention = self.policy.retention_interval
        alignment = self.chunking.alignment_tokens
        boundaries: tuple[int, ...] = ()
        if retention is not None:
            boundaries = (req.num_prompt_tokens - 1,)
            if info.shared_prefix_boundary:
                boundaries += (info.shared_prefix_boundary,)

        offered: list[bytes] = []
        ranges: list[tuple[int, int]] = []
        for i, (gc, state) in enumerate(zip(self.chunking.groups, req.groups, strict=True)):
            num_chunks = self._storable_chunks(req, i, offloadable)
            prompt_chunks = prompt_offloadable // gc.tokens_per_chunk
            start = state.next_stored_chunk
            again = reconsider_from(
                gc, num_chunks, prompt_chunks, req.finished, retention, alignment
            )
            if again is not None:
                start = min(start, again)
            ranges.append((start, num_chunks))
            if gc.group.kind is GroupKind.MAMBA_ALIGN or num_chunks <= start:
                continue
            view = StoreState(
                tuple(state.block_ids), len(state.keys), offloadable, prompt_offloadable,
                req.num_prompt_tokens, req.finished, boundaries,
            )
            chunks = storable_chunks(gc, view, start, alignment, retention)
            if again is not None:  # engine detail: chunks offered before are not re-offered
                seen = offered_under_prompt_horizon(
                    gc, view, start, state.next_stored_chunk, alignment, retention
                )
                chunks = tuple(k for k in chunks if k not in seen)
            offered.extend(state.keys[k] for k in chunks)

        if not offered:
            self._advance(req, offloadable)
            return None
        plan = self.store.prepare_store(offered)
        if plan is None:
            return None  # the store is full: retry next step
        if not plan.keys_to_store:
            self._advance(req, offloadable)
            return None
        return self._store_job_of(req, offered, set(plan.keys_to_store), ranges)

    def _store_job_of(
        self, req: RequestState, offered: Sequence[bytes], to_store: set[bytes],
        ranges: Sequence[tuple[int, int]],
    ) -> tuple[int, StoreJob]:
        """The job for the offered keys the store accepted (:func:`store_job_of`)."""
        placeholders = self.policy.null_blocks_in_store is NullBlockRule.PLACEHOLDER
        job = store_job_of(self.chunking, req, offered, to_store, ranges, placeholders)
        return self._new_job(req, job.keys, is_store=True), job

    def _boundary_store_jobs(
        self, handoffs: Mapping[str, Sequence[tuple[int, int, int]]]
    ) -> list[tuple[int, StoreJob]]:
        """Mamba-align states handed over at chunk boundaries: one job per key."""
        jobs: list[tuple[int, StoreJob]] = []
        position = {gc.group.index: i for i, gc in enumerate(self.chunking.groups)}
        for req_id, entries in handoffs.items():
            req = self._requests.get(req_id)
            if req is None:
                continue
            limit = self._offloadable(req, req.num_tokens)
            for group_index, block_id, boundary in entries:
                i = position.get(group_index)
                if i is None:
                    continue
                gc = self.chunking.groups[i]
                if block_id == 0 or boundary > limit or boundary % gc.tokens_per_chunk:
                    continue
                key = boundary_key(
                    req.block_hashes, self.chunking.tokens_per_hash, group_index, boundary
                )
                plan = self.store.prepare_store([key])
                if plan is None or not plan.keys_to_store:
                    continue
                job = boundary_store_job(self.chunking, req_id, i, key, block_id, boundary)
                jobs.append((self._new_job(req, job.keys, is_store=True), job))
        return jobs

    # -- completions and resets ---------------------------------------------

    def job_done(self, job_id: int, success: bool = True) -> None:
        """All workers reported ``job_id``; a failed store becomes visible to nobody."""
        if job_id < self._stale_below:
            return  # flushed by a reset
        job = self._jobs.pop(job_id)
        req = self._requests[job.req_id]
        if job.is_store:
            self.store.complete_store(job.keys, success)
        else:
            self.store.complete_load(job.keys)
            if not success and not self.policy.reload_after_failed_load:
                req.load_failed = True
            if self._being_loaded:
                self._being_loaded.difference_update(job.keys)
        req.jobs.discard(job_id)
        if req.finished_signaled and not req.jobs:
            del self._requests[job.req_id]

    def request_finished(self, req_id: str, block_hashes: Sequence[bytes] | None = None) -> None:
        """The request stopped or was aborted (its blocks are not freed yet)."""
        req = self._requests.get(req_id)
        if req is None:
            return
        req.finished = True
        if block_hashes is not None:
            req.block_hashes = tuple(block_hashes)
            update_keys(self.chunking, req)

    def reset(self) -> None:
        """Reset the offload cache: every stored chunk and in-flight job is forgotten."""
        for req_id, req in list(self._requests.items()):
            if req.finished:
                del self._requests[req_id]
        self.store.reset()
        for req in self._requests.values():
            for state in req.groups:
                state.next_stored_chunk = 0
            req.jobs.clear()
        self._stale_below = self._next_job_id
        self._jobs.clear()
        if self._being_loaded is not None:
            self._being_loaded.clear()
