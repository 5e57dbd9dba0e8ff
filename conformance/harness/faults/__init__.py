"""Reliability: fault injection through the data path, leak checks, load.

Used by ``conformance/lanes/test_faults.py``, which records the counters of the
report's Reliability table.  Config fuzzing, the lane's other part, lives in
:mod:`conformance.harness.fuzz`; the broken workers the lane's meta tests install live
in :mod:`conformance.meta.mutants.worker`.

Modules: :mod:`.worker` (:class:`FaultyWorker`, :class:`FaultPlan`,
:class:`FaultStats`), :mod:`.runner` (:class:`FaultRunner`, the load and read
checks), :mod:`.leaks` (:func:`leak_report`, :func:`final_reset_report`),
:mod:`.scenarios` (:class:`FaultScenario`, :func:`play`,
:func:`run_fault_scenario`), :mod:`.load` (:func:`run_load_trace`).

Fault injection (:class:`FaultyWorker`, :class:`FaultRunner`, :func:`run_fault_scenario`)
    The driver's runner path (vLLM's real ``Scheduler``, ``OffloadingConnector``
    scheduler and worker halves, ``CPUOffloadingManager``) with
    :class:`vllm_adapter.spec.ReferenceOffloadingWorker` doing the copies,
    wrapped by :class:`FaultyWorker`, which decides each job's fate:

    * *delayed*: the copy runs when the job is due, ``0 .. max_delay`` steps
      after submission, at the worker's ``get_finished`` -- after that step's
      forward pass -- or earlier when vLLM ``wait`` s for it (a flush, a sync
      load).  Every job is executed this lazily, so a block vLLM reuses before
      flushing a store, or a request run before its load finished, shows.
    * *failed store* (``store_lost``): vLLM 0.33.0 cannot represent one --
      ``OffloadingConnectorWorker.get_finished`` asserts
      ``TransferResult.success`` -- so a failed store is a *lost* one: the
      worker drops the copy, fills the destination CPU chunks with poison and
      never reports the job.  vLLM keeps its keys write-pending
      (``ref_cnt == -1``, ``LookupResult.HIT_PENDING``): never loadable, which
      the suite checks on every load job and at the end.  The price is
      liveness: a lookup that meets a pending key is deferred, so every
      request sharing that prefix (and the request itself, if preempted) waits
      until a connector reset drops the key -- :func:`play` detects the stall
      and resets (``lost_store_stall_resets``).  The job, its chunks and its
      request's connector state stay allocated until such a reset; after it the
      job waits in vLLM's reset fence forever (``has_pending_push_work()``
      stays True, the engine never idles).  That residue is accounted
      (``lost_store_*`` counters), not counted as a leak.
    * *rank-partial store* (world size > 1): a random non-empty proper subset
      of the ranks loses the job; the others report it.  vLLM sums the reports
      (:meth:`DriverSession._rank_reports`), the job never reaches
      ``world_size`` and stays pending like a lost one (chunks poisoned).
    * *failed load* (``load_failed``; with world size > 1 a random non-empty
      subset of ranks fails it): the copy is not made, the destination blocks
      keep their poison, the job is reported done and its request named in
      ``KVConnectorOutput.failed_recving`` -- vLLM's
      ``kv_load_failure_policy="recompute"`` path resets the request and
      recomputes.  Only asynchronous loads can fail (a sync load's request
      already runs that step; vLLM has no per-request failure report for it).

    The scenario adds the rest through vLLM's own mechanisms: a tiny CPU pool
    (``prepare_store`` refuses: *cpu_full*), evictions while loads pin chunks,
    small GPU pools (preemption with transfers in flight), aborts of requests
    with jobs in flight, and GPU / connector prefix-cache resets mid-flight.
    Two reset patterns hit vLLM bugs (both in 0.33.0; the first still in 0.34.0)
    and are steered around (``scenarios._reset``;
    deviations ``connector-reset-stale-swa-blocks`` and ``connector-reset-twice``,
    reproduced by strict-xfail tests in the lane): a connector reset while
    requests keep running on a geometry with a sliding-window group, and two
    resets between one step and the next.

    Checks (:class:`FaultRunner`): every executed load is compared block by
    block with the synthetic expected bytes (:mod:`conformance.harness.kv_pattern`), with
    no byte outside its destination rows changed; in every forward pass
    (after its writes: vLLM lets a request hit blocks another request of the
    same batch is filling) every complete, non-null block the request's table
    holds in a non-Mamba group must hold its expected bytes -- checked against
    a shadow of what each block holds, and byte by byte on small KV memories
    (*reads*: this covers loads
    finished late, failed loads recomputed, stale blocks after resets); no load
    job may name a key whose store was lost.  After the trace drains
    (:func:`leak_report`): every GPU block free with ref count 0 (free count
    back to its baseline), no request state left in the scheduler, the
    connector scheduler and the worker beyond what lost stores account for,
    every CPU chunk in vLLM's manager with ref count 0 (or -1 for a lost
    store's key) and the manager's counters consistent; then a connector
    reset must leave the manager empty.

Load (:func:`run_load_trace`)
    >= 1,000 requests over a handful of shared documents, small GPU and CPU
    pools, periodic GPU prefix-cache resets, jobs delayed at random; the same
    checks, plus RSS and bookkeeping sizes sampled over the run.
"""

from __future__ import annotations

from conformance.harness.faults.leaks import final_reset_report, leak_report
from conformance.harness.faults.load import LoadReport, load_requests, run_load_trace
from conformance.harness.faults.runner import FaultRunner
from conformance.harness.faults.scenarios import (
    FaultScenario,
    FaultSession,
    drain_and_check,
    fault_session,
    play,
    replace_seed,
    run_fault_scenario,
    scenario_driver,
    scenario_requests,
)
from conformance.harness.faults.worker import (
    FAULT_TYPES,
    POISON,
    FaultPlan,
    FaultStats,
    FaultyWorker,
)

__all__ = [
    "FAULT_TYPES",
    "POISON",
    "FaultPlan",
    "FaultRunner",
    "FaultScenario",
    "FaultSession",
    "FaultStats",
    "FaultyWorker",
    "LoadReport",
    "drain_and_check",
    "fault_session",
    "final_reset_report",
    "leak_report",
    "load_requests",
    "play",
    "replace_seed",
    "run_fault_scenario",
    "run_load_trace",
    "scenario_driver",
    "scenario_requests",
]
