"""Deliberately wrong backends: the suite must fail on them (meta lane).

Each mutant is a planner factory, usable as ``--backend conformance.meta.mutants.planner:NAME``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from reference.jobs import LoadJob, StoreJob
from reference.knobs import Chunking
from reference.plan import BlockRef, Planner, Policy, ScheduledRequest
from reference.store import ChunkStore


class _OffByOneChunks(Planner):
    """Names every stored chunk by the hash one unit early (an off-by-one chunk boundary)."""

    def step(self, scheduled: Sequence[ScheduledRequest], finished: Sequence[ScheduledRequest] = (),
             block_copy_dst_ids: Sequence[int] = (), boundary_handoffs: object = None
             ) -> list[tuple[int, StoreJob]]:
        jobs = super().step(scheduled, finished, block_copy_dst_ids, boundary_handoffs)  # type: ignore[arg-type]
        return [(i, replace(j, block_indices=tuple(b + 1 if n else b for b, n in zip(j.block_indices, j.group_sizes, strict=True)))) for i, j in jobs]


class _SwappedGroups(Planner):
    """Emits load jobs with the first two groups' destinations swapped."""

    def allocated(self, req_id: str, blocks: Sequence[Sequence[BlockRef]], num_external_tokens: int
                  ) -> LoadJob | None:
        job = super().allocated(req_id, blocks, num_external_tokens)
        if job is None or len(job.group_sizes) < 2:
            return job
        sizes = list(job.group_sizes)
        sizes[0], sizes[1] = sizes[1], sizes[0]
        idx = list(job.block_indices)
        idx[0], idx[1] = idx[1], idx[0]
        return replace(job, group_sizes=tuple(sizes), block_indices=tuple(idx))


class _ShortLookup(Planner):
    """Claims one chunk less than available on every hit (a conservative but wrong hit)."""

    def lookup(self, req_id: str, block_hashes: Sequence[bytes], num_tokens: int, computed_tokens: int,
               max_num_new_tokens: int | None = None, skip_reading_prefix_cache: bool = False) -> int | None:
        hit = super().lookup(req_id, block_hashes, num_tokens, computed_tokens, max_num_new_tokens,
                             skip_reading_prefix_cache)
        return hit - 1 if hit else hit


def off_by_one(chunking: Chunking, store: ChunkStore, policy: Policy) -> Planner:
    return _OffByOneChunks(chunking, store, policy)


def swapped_groups(chunking: Chunking, store: ChunkStore, policy: Policy) -> Planner:
    return _SwappedGroups(chunking, store, policy)


def short_lookup(chunking: Chunking, store: ChunkStore, policy: Policy) -> Planner:
    return _ShortLookup(chunking, store, policy)


MUTANTS = {"off_by_one": off_by_one, "swapped_groups": swapped_groups, "short_lookup": short_lookup}
