"""Leak checks after a faulty trace drained, and after a final connector reset.

Every GPU block free with ref count 0 (free count back to its baseline), no
request state left in the scheduler, the connector scheduler and the worker
beyond what lost stores account for, every CPU chunk in vLLM's manager with
ref count 0 (or -1 for a lost store's key) and the manager's counters
consistent; then a connector reset must leave the manager empty.
"""

from __future__ import annotations

from typing import Any

from conformance.harness.faults.worker import FaultyWorker


def manager_chunks(mgr: Any) -> dict[bytes, Any] | None:
    """The CPU chunks vLLM's offloading manager holds (key -> chunk), if its policy exposes them."""
    return getattr(getattr(mgr, "_policy", None), "chunks", None)


def leak_report(session: Any, worker: FaultyWorker, baseline_free: int) -> list[str]:
    """What is still held after the trace drained, beyond what lost stores account for.

    Lost (and rank-partial) store jobs legitimately keep their vLLM job, their
    write-pending chunks, their request's connector state and their deferred
    GPU-block fences; everything else must be back at baseline.
    """
    return [
        *_scheduler_leaks(session, baseline_free),
        *_connector_leaks(session.connector_scheduler, worker),
        *_worker_leaks(session, worker),
        *_cpu_tier_leaks(session.connector_scheduler.manager, worker),
    ]


def _scheduler_leaks(session: Any, baseline_free: int) -> list[str]:
    leaks: list[str] = []
    sched = session.scheduler
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool
    if pool.get_num_free_blocks() != baseline_free:
        leaks.append(f"GPU block pool: {pool.get_num_free_blocks()} free, baseline {baseline_free}")
    held = [b.block_id for b in pool.blocks if not b.is_null and b.ref_cnt != 0]
    if held:
        leaks.append(f"GPU blocks with ref counts: {held[:8]}")
    if sched.requests:
        leaks.append(f"scheduler still holds requests {sorted(sched.requests)[:5]}")
    for i, mgr in enumerate(kvm.coordinator.single_type_managers):
        left = [r for r, blocks in mgr.req_to_blocks.items() if blocks]
        if left:
            leaks.append(f"KV group manager {i} still maps {left[:5]} to blocks")
    for name in ("finished_recving_kv_req_ids", "failed_recving_kv_req_ids"):
        if getattr(sched, name, None):
            leaks.append(f"scheduler.{name} = {sorted(getattr(sched, name))[:5]}")
    return leaks


def _connector_leaks(cs: Any, worker: FaultyWorker) -> list[str]:
    leaks: list[str] = []
    lost = set(worker.lost)
    lost_reqs = {worker.lost[j].req_id for j in lost}
    if set(cs._jobs) - lost:
        leaks.append(f"connector jobs pending: {sorted(set(cs._jobs) - lost)[:8]}")
    if set(cs._req_status) - lost_reqs:
        leaks.append(f"connector request state left: {sorted(set(cs._req_status) - lost_reqs)[:5]}")
    fenced = {j for jobs in cs._block_id_to_pending_jobs.values() for j in jobs} - lost
    if fenced:
        leaks.append(f"GPU-block fences on jobs {sorted(fenced)[:8]}")
    if set(cs._reset_fence) - lost:
        leaks.append(f"reset fence waits on {sorted(set(cs._reset_fence) - lost)[:8]}")
    if cs._chunks_being_loaded:
        leaks.append(f"{len(cs._chunks_being_loaded)} chunks still marked being loaded")
    for name in ("_current_batch_load_jobs", "_current_batch_sync_loads",
                 "_current_batch_allocated_block_ids"):
        if getattr(cs, name):
            leaks.append(f"connector {name} not empty")
    return leaks


def _worker_leaks(session: Any, worker: FaultyWorker) -> list[str]:
    leaks: list[str] = []
    cw = session.worker_connector.connector_worker
    if cw._load_jobs or cw._unsubmitted_store_jobs:
        leaks.append(f"worker connector: loads {sorted(cw._load_jobs)}, unsubmitted stores "
                     f"{[j for j, *_ in cw._unsubmitted_store_jobs]}")
    if worker.pending or worker.inner.in_flight:
        leaks.append(f"worker jobs never finished: {sorted(worker.pending)[:8]}")
    return leaks


def _cpu_tier_leaks(mgr: Any, worker: FaultyWorker) -> list[str]:
    chunks = manager_chunks(mgr)
    if chunks is None:
        return []
    leaks: list[str] = []
    pinned = [k for k, c in chunks.items() if c.ref_cnt > 0]
    pending = [k for k, c in chunks.items() if c.ref_cnt < 0]
    if pinned:
        leaks.append(f"{len(pinned)} CPU chunks still pinned by loads (ref_cnt > 0)")
    stray = [k for k in pending if k not in worker.lost_keys]
    if stray:
        leaks.append(f"{len(stray)} CPU chunks write-pending without a lost store")
    ready = len(chunks) - len(pending)
    if mgr._num_write_pending_chunks != len(pending):
        leaks.append(f"manager counts {mgr._num_write_pending_chunks} write-pending chunks, "
                     f"holds {len(pending)}")
    if mgr._num_evictable_cache_chunks != ready:
        leaks.append(f"manager counts {mgr._num_evictable_cache_chunks} evictable chunks, "
                     f"{ready} are ready with no load")
    if mgr._num_allocated_chunks - len(mgr._free_list) != len(chunks):
        leaks.append(f"manager: {mgr._num_allocated_chunks} allocated - "
                     f"{len(mgr._free_list)} free != {len(chunks)} held")
    evictable = getattr(mgr._policy, "_evictable", None)
    idle = {k for k, c in chunks.items() if c.ref_cnt == 0}
    if evictable is not None and set(evictable) != idle:
        leaks.append("LRU policy's evictable set differs from the ref counts")
    return leaks


def final_reset_report(session: Any, worker: FaultyWorker, baseline_free: int) -> list[str]:
    """A GPU + connector reset after the drain must leave the CPU tier and the pool empty."""
    leaks: list[str] = []
    if not session.reset_prefix_cache(reset_connector=True):
        leaks.append("the final prefix-cache reset failed (GPU blocks still in use)")
    session.step()  # delivers the reset's flush to the worker
    cs = session.connector_scheduler
    mgr = cs.manager
    chunks = manager_chunks(mgr)
    if chunks:
        leaks.append(f"{len(chunks)} CPU chunks survive a connector reset")
    if mgr._num_allocated_chunks or mgr._free_list or mgr._num_write_pending_chunks:
        leaks.append("the manager's pool counters survive a connector reset")
    if cs._jobs or cs._req_status:
        leaks.append(f"connector state survives a reset: jobs {sorted(cs._jobs)[:5]}, "
                     f"requests {sorted(cs._req_status)[:5]}")
    unreported = set(cs._reset_fence) - set(worker.lost)
    if unreported:
        leaks.append(f"reset fence waits on reported jobs {sorted(unreported)}")
    pool = session.scheduler.kv_cache_manager.block_pool
    if pool.get_num_free_blocks() != baseline_free:
        leaks.append(f"GPU block pool after reset: {pool.get_num_free_blocks()} free, "
                     f"baseline {baseline_free}")
    return leaks
