"""Deliberately wrong planners: what the corpus replay's failure reports look like.

Each is the reference :class:`~reference.plan.Planner` with one fault, exposed as a
planner factory for ``--backend``::

    python -m conformance.corpus replay --backend conformance.testing.broken_planner:long_hit

``long_hit``          answers its first positive lookup 16 tokens longer (one wrong answer).
``dropped_store``     never makes its first store job that holds a sliding-window block
                      (a wrong step answer; its later job ids are off by one, so a later
                      ``job_done`` of a job it does not hold raises ``KeyError``, as a
                      backend that keeps its own jobs would).
``raising``           raises ``RuntimeError`` at its third ``job_done`` call, every answer right.

``tests/test_corpus.py`` checks the reports these give.
"""

from __future__ import annotations

from collections.abc import Sequence

from reference.geometry import GroupKind
from reference.jobs import StoreJob
from reference.knobs import Chunking
from reference.plan import Planner, Policy, ScheduledRequest
from reference.store import ChunkStore

__all__ = ["dropped_store", "long_hit", "raising"]


class _LongHit(Planner):
    wrong = False

    def lookup(self, req_id: str, block_hashes: Sequence[bytes], num_tokens: int,
               computed_tokens: int, max_num_new_tokens: int | None = None,
               skip_reading_prefix_cache: bool = False) -> int | None:
        hit = super().lookup(req_id, block_hashes, num_tokens, computed_tokens,
                             max_num_new_tokens, skip_reading_prefix_cache)
        if hit and not self.wrong:
            self.wrong = True
            return hit + 16
        return hit


class _DroppedStore(Planner):
    dropped = False

    def _store_job(self, info: ScheduledRequest) -> tuple[int, StoreJob] | None:
        if self.dropped:
            return super()._store_job(info)
        windowed = [i for i, gc in enumerate(self.chunking.groups)
                    if gc.group.kind is GroupKind.SLIDING_WINDOW]
        before = self._next_job_id
        job = super()._store_job(info)
        if job is not None and any(job[1].group_sizes[i] for i in windowed):
            self.dropped = True
            self._next_job_id = before  # as if it had never been made
            del self._jobs[before]
            self._requests[info.req_id].jobs.discard(before)
            return None
        return job


class _Raising(Planner):
    calls = 0

    def job_done(self, job_id: int, success: bool = True) -> None:
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError(f"deliberate failure at job_done({job_id})")
        super().job_done(job_id, success)


def long_hit(chunking: Chunking, store: ChunkStore, policy: Policy) -> Planner:
    return _LongHit(chunking, store, policy)


def dropped_store(chunking: Chunking, store: ChunkStore, policy: Policy) -> Planner:
    return _DroppedStore(chunking, store, policy)


def raising(chunking: Chunking, store: ChunkStore, policy: Policy) -> Planner:
    return _Raising(chunking, store, policy)
