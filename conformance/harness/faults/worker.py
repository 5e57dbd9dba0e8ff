"""The faulty transfer worker: each job's fate (delayed, lost, rank-partial, failed), and the stats.

:class:`FaultyWorker` wraps the spec's real ``OffloadingWorker``
(:class:`vllm_adapter.spec.ReferenceOffloadingWorker`) and decides each job's
fate with seeded dice (:class:`FaultPlan`); what it injected and what the
checks saw is counted in :class:`FaultStats`.  What each fate means in vLLM is
described in :mod:`conformance.harness.faults`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from conformance.harness.faults.runner import FaultRunner

POISON = 0xE7
"""Fills lost stores' CPU chunks and failed (or not yet finished) loads' GPU blocks."""

FAULT_TYPES = (
    "delayed_jobs",
    "store_lost",
    "store_rank_partial",
    "load_failed",
    "load_rank_partial",
    "cpu_full",
    "evictions_with_loads_pending",
    "preemptions_in_flight",
    "aborts_in_flight",
    "resets_in_flight",
    "connector_resets",
)
"""Fault kinds counted by the suite (``fault:<type>`` counters)."""


@dataclass(frozen=True)
class FaultPlan:
    """Per-job fault probabilities (seeded): the :class:`FaultyWorker`'s dice."""

    seed: int = 0
    max_delay: int = 0
    """Each job finishes ``0 .. max_delay`` steps after submission (uniform)."""
    p_store_lost: float = 0.0
    p_load_fail: float = 0.0
    p_rank_partial: float = 0.0
    """World size > 1: share of the failures above that hit a random subset of ranks only."""


@dataclass
class FaultStats:
    """What the fault suite injected and saw; every field becomes a counter."""

    injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_TYPES, 0))
    jobs_submitted: int = 0
    loads_executed: int = 0
    loaded_blocks_checked: int = 0
    corrupted_loads: int = 0
    foreign_bytes_changed: int = 0
    blocks_read_checked: int = 0
    corrupted_reads: int = 0
    recomputed_blocks_checked: int = 0
    failed_store_loaded: int = 0
    lost_store_keys_checked: int = 0
    lost_store_jobs_retained: int = 0
    lost_store_stall_resets: int = 0
    """Connector resets the suite made because requests waited forever on a lost store's key."""
    leaks: int = 0
    failures: list[str] = field(default_factory=list)

    def merge(self, other: FaultStats) -> None:
        for k, v in other.injected.items():
            self.injected[k] = self.injected.get(k, 0) + v
        for name in _STAT_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for text in other.failures:
            self.fail(text)

    def count(self, kind: str, n: int = 1) -> None:
        self.injected[kind] += n

    def fail(self, text: str) -> None:
        if len(self.failures) < 12:
            self.failures.append(text)

    def counters(self) -> dict[str, int]:
        out = {f"fault:{k}": v for k, v in self.injected.items()}
        for name in _STAT_FIELDS:
            out[f"faults_{name}"] = int(getattr(self, name))
        return out

    def describe(self) -> str:
        inj = ", ".join(f"{k} {v}" for k, v in self.injected.items() if v)
        return (
            f"injected: {inj or 'nothing'}; {self.loads_executed} loads executed, "
            f"{self.loaded_blocks_checked} loaded blocks checked "
            f"({self.corrupted_loads} corrupted, "
            f"{self.foreign_bytes_changed} foreign bytes changed), "
            f"{self.blocks_read_checked} reads checked ({self.corrupted_reads} corrupted, "
            f"{self.recomputed_blocks_checked} after a failed load), "
            f"{self.failed_store_loaded} loads of lost-store keys, {self.leaks} leaks, "
            f"{self.lost_store_jobs_retained} lost store jobs retained, "
            f"{self.lost_store_stall_resets} stall resets"
            + "".join(f"\n  {f}" for f in self.failures)
        )


_STAT_FIELDS = (
    "jobs_submitted", "loads_executed", "loaded_blocks_checked", "corrupted_loads",
    "foreign_bytes_changed", "blocks_read_checked", "corrupted_reads", "recomputed_blocks_checked",
    "failed_store_loaded", "lost_store_keys_checked", "lost_store_jobs_retained",
    "lost_store_stall_resets", "leaks",
)


@dataclass(eq=False)
class _Job:
    job_id: int
    store: bool
    src: Any
    dst: Any
    due: int
    fate: str = "ok"
    """ok | lost | partial (stores); ok | fail (loads)."""
    ranks: int = 0
    """Ranks that report the job (partial stores)."""
    req_id: str | None = None
    tokens: tuple[int, ...] = ()
    keys: frozenset[bytes] = frozenset()


class FaultyWorker:
    """An ``OffloadingWorker`` around the spec's real one that injects faults (package doc).

    Installed by ``VllmDriver.session(worker_wrapper=...)``; ``inner`` is the
    :class:`vllm_adapter.spec.ReferenceOffloadingWorker` ``register_kv_caches``
    built.  Copies are the inner worker's, made when a job is due.
    """

    def __init__(
        self, session: Any, inner: Any, plan: FaultPlan, runner: FaultRunner, stats: FaultStats
    ) -> None:
        self.session = session
        self.inner = inner
        self.plan = plan
        self.runner = runner
        self.stats = stats
        self.rng = random.Random(plan.seed)
        self.world_size = int(session.vllm_config.parallel_config.world_size)
        self.pending: dict[int, _Job] = {}
        self.lost: dict[int, _Job] = {}
        self.lost_keys: set[bytes] = set()
        self._results: list[Any] = []
        self._failed: set[int] = set()
        self._ranks: dict[int, int] = {}
        self.failed_load_reqs: set[str] = set()

    # -- the OffloadingWorker interface --------------------------------------

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self.stats.jobs_submitted += 1
        src_spec = self._gpu_side(src_spec)
        job = _Job(job_id, True, src_spec, dst_spec, self.session.step_no + self._delay())
        job.keys = self._job_keys(job_id)
        status = self.session.connector_scheduler._jobs.get(job_id)
        job.req_id = None if status is None else status.req_id
        if job.due > self.session.step_no:
            self.stats.count("delayed_jobs")
        if self.rng.random() < self.plan.p_store_lost:
            self._roll_store_loss(job)
            if job.fate == "lost":
                return True
        self.pending[job_id] = job
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any,
                    expedited: bool = False) -> bool:
        self.stats.jobs_submitted += 1
        s = self.session
        dst_spec = self._gpu_side(dst_spec)
        job = _Job(job_id, False, src_spec, dst_spec,
                   s.step_no + (0 if expedited else self._delay()))
        job.req_id = s.load_req.get(job_id)
        if job.req_id is not None and job.req_id in s.scheduler.requests:
            job.tokens = tuple(s.scheduler.requests[job.req_id].all_token_ids)
        job.keys = self._job_keys(job_id)
        if job.keys & self.lost_keys:
            self.stats.failed_store_loaded += len(job.keys & self.lost_keys)
            self.stats.fail(f"load job {job_id} ({job.req_id}) reads keys whose store was lost")
        if job.due > s.step_no:
            self.stats.count("delayed_jobs")
        if not expedited and self.rng.random() < self.plan.p_load_fail:
            job.fate = "fail"
            partial = self.world_size > 1 and self.rng.random() < self.plan.p_rank_partial
            self.stats.count("load_rank_partial" if partial else "load_failed")
        # Until the copy is made the destination holds poison: a read shows it.
        self.runner.poison_gpu(dst_spec)
        self.pending[job_id] = job
        if expedited:
            self.wait({job_id})
        return True

    def get_finished(self) -> list[Any]:
        now = self.session.step_no
        for job_id in sorted(j for j, job in self.pending.items() if job.due <= now):
            self._execute(self.pending.pop(job_id))
        done = list(self.inner.get_finished()) + self._results
        self._results = []
        return done

    def wait(self, job_ids: set[int]) -> None:
        for job_id in sorted(job_ids):
            job = self.pending.pop(job_id, None)
            if job is not None:
                self._execute(job)

    def shutdown(self) -> None:
        self.pending.clear()
        self.inner.shutdown()

    # -- driver hooks --------------------------------------------------------

    @property
    def in_flight(self) -> set[int]:
        """Jobs that will still be reported (lost ones will not)."""
        return set(self.pending) | set(self.inner.in_flight) | {r.job_id for r in self._results}

    def reporting_ranks(self, job_id: int, world_size: int) -> int:
        return self._ranks.pop(job_id, world_size)

    def take_failed_loads(self) -> set[int]:
        out, self._failed = self._failed, set()
        return out

    # -- submission ----------------------------------------------------------

    def _delay(self) -> int:
        return self.rng.randint(0, self.plan.max_delay) if self.plan.max_delay else 0

    def _job_keys(self, job_id: int) -> frozenset[bytes]:
        status = self.session.connector_scheduler._jobs.get(job_id)
        return frozenset(status.keys) if status is not None else frozenset()

    def _gpu_side(self, gpu_side: Any) -> Any:
        """The GPU side of a job as ``vllm_shims.GpuBlocks`` (block ids, group sizes, indices).

        vLLM passes a ``GPULoadStoreSpec`` (0.33.0) or ``DevicePointers`` (0.34.0);
        the inner worker decodes either and takes the result back when the job runs,
        and the runner's checks read its ``block_ids`` / ``group_sizes`` /
        ``block_indices`` whatever the release.
        """
        return self.inner.gpu_blocks(gpu_side)

    def _roll_store_loss(self, job: _Job) -> None:
        """A store that fails: lost on every rank, or (world size > 1) on some ranks only."""
        if self.world_size > 1 and self.rng.random() < self.plan.p_rank_partial:
            job.fate, job.ranks = "partial", self.rng.randint(1, self.world_size - 1)
            self.stats.count("store_rank_partial")
        else:
            job.fate = "lost"
            self.stats.count("store_lost")
        self._lose(job)

    # -- execution -----------------------------------------------------------

    def _lose(self, job: _Job) -> None:
        """The copy never happens: the destination chunks hold poison, the keys are never
        loadable."""
        slots = torch.from_numpy(job.dst.block_ids.astype("int64", copy=False))
        if slots.numel():
            self.inner.pool.index_fill_(0, slots, POISON)
        self.lost[job.job_id] = job
        self.lost_keys |= job.keys

    def _execute(self, job: _Job) -> None:
        if job.store:
            self._execute_store(job)
        else:
            self._execute_load(job)

    def _execute_store(self, job: _Job) -> None:
        from conformance.harness import vllm_harness_api as V

        if job.fate == "partial":
            # Some ranks lost it: what reaches the CPU tier is garbage; the rest report it.
            self._ranks[job.job_id] = job.ranks
            self._results.append(V.TransferResult(job_id=job.job_id, success=True))
            return
        self.inner.submit_store(job.job_id, job.src, job.dst)
        self.lost_keys -= job.keys  # stored again after a reset dropped the lost copy

    def _execute_load(self, job: _Job) -> None:
        from conformance.harness import vllm_harness_api as V

        self.stats.loads_executed += 1
        if job.fate == "fail":
            # No copy: the blocks keep their poison.  vLLM 0.34.0's worker takes the
            # failure itself (failed_jobs; failed_recving for the request).  0.33.0's
            # cannot: every rank reports the job done and the driver names the request
            # in failed_recving (take_failed_loads).
            if V.SUPPORTS_FAILED_TRANSFERS:
                self._results.append(V.TransferResult(job_id=job.job_id, success=False))
            else:
                self._results.append(V.TransferResult(job_id=job.job_id, success=True))
                self._failed.add(job.job_id)
            if job.req_id is not None:
                self.failed_load_reqs.add(job.req_id)
            return
        snapshot = self.runner.snapshot() if self.runner.check_foreign else None
        self.inner.submit_load(job.job_id, job.src, job.dst)
        self.runner.check_loaded(self, job, snapshot)
