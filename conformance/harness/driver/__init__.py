"""Drive vLLM's real ``Scheduler`` + offloading connector on CPU, and record it.

:class:`VllmDriver` builds the real ``vllm.v1.core.sched.scheduler.Scheduler``
with the KV connector named in ``kv_transfer_config`` (``OffloadingConnector``
by default), runs a :class:`~conformance.protocol.trace.WorkloadSpec` step by step the
way the engine core does, and returns a :class:`~conformance.protocol.trace.Trace` of
every scheduler-side connector call.

What is real and what is emulated:

* Scheduler side, all real: the core ``Scheduler`` (prefix cache, chunked
  prefill, preemption), the connector's ``OffloadingConnectorScheduler`` and
  its manager, which for the default spec is vLLM's ``CPUOffloadingManager``
  built by ``CPUOffloadingSpec.get_manager()`` (constructing the spec and
  the manager needs no GPU; only ``CPUOffloadingSpec.get_worker`` does).
* Worker side: the connector's real worker half (``OffloadingConnectorWorker``,
  created through ``KVConnectorFactory`` with role ``WORKER``) runs the same
  call sequence as the GPU model runner (``handle_preemptions``,
  ``bind_connector_metadata``, ``start_load_kv``, ``wait_for_save``,
  ``get_transfer_results``, ``build_connector_worker_meta``,
  ``clear_connector_metadata``).  Only the transfer engine below it -- the
  ``OffloadingWorker`` that would copy bytes -- is replaced by
  :class:`TransferEngine`, which moves nothing and reports each job done when
  the workload says so.  ``register_kv_caches`` is not called (there are no
  KV tensors); the engine is installed directly.  With a ``model_runner``
  (:meth:`VllmDriver.session`; :class:`conformance.harness.kvdata.SyntheticModelRunner`)
  the worker side is real instead: the runner's KV tensors go through
  ``register_kv_caches`` and the spec's own ``OffloadingWorker`` moves bytes
  (``vllm_adapter.spec.ReferenceOffloadingSpec`` does so on CPU).
* The model: deterministic sampled tokens, :func:`sampled_token`.

Recording (:mod:`.recorder`) wraps methods of the live objects (instance
attributes), calls the original unchanged and only reads arguments and
results; it never alters behaviour.  Wrapped: the connector scheduler's
``on_new_request``, ``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``,
``update_connector_output``, ``request_finished``, ``reset_cache`` (and, to
label job kinds, ``_build_aligned_boundary_store_jobs`` /
``_build_partial_tail_store_jobs``); the manager's ``lookup``,
``prepare_load`` and ``prepare_store``.  A few private attributes of the
connector scheduler are read (``_current_batch_load_jobs``, ``config``).

How a job's completion reaches the connector in vLLM 0.33.0: the worker's
``get_finished`` turns each ``TransferResult`` into
``OffloadingWorkerMetadata.completed_jobs[job_id] = 1``; the model runner puts
that in ``KVConnectorOutput.kv_connector_worker_meta`` (loads also name their
request in ``finished_recving``); ``Scheduler.update_from_output`` passes the
output to ``connector.update_connector_output``, which completes a job when
``world_size`` workers reported it.  The worker asserts
``TransferResult.success``: failures cannot be reported per job.  A failed
*load* is emulated the way the core accepts it for hybrid layouts: the job is
reported done and its request is put in ``KVConnectorOutput.failed_recving``.
A failed store has no representation and is refused (``JobFault(never=True)``
loses the job instead; on the runner path :mod:`conformance.harness.faults` does the
same with real bytes, see there).  One emulated worker stands for every rank:
with ``world_size > 1`` each job it finishes is reported ``world_size`` times
(:meth:`DriverSession._rank_reports`), as the executor's aggregation of the
ranks' worker meta would; a worker may report fewer ranks for a job.

Modules: :mod:`.configs` (synthetic ``KVCacheConfig`` s), :mod:`.vllm_config`
(:func:`build_vllm_config`), :mod:`.engine` (:class:`TransferEngine`),
:mod:`.model` (the fake model), :mod:`.records` / :mod:`.recorder` (recording),
:mod:`.session` (:class:`DriverSession`), :mod:`.driver` (:class:`VllmDriver`).
Importers use the package: ``from conformance import driver as D``.
"""

from __future__ import annotations

from conformance.harness.driver.configs import (
    TINY_LLAMA,
    full_attention_kv_cache_config,
    full_mamba_align_kv_cache_config,
    full_padded_swa_kv_cache_config,
    full_swa_kv_cache_config,
    full_swa_two_layer_kv_cache_config,
    swa_eagle_kv_cache_config,
    swa_mtp_kv_cache_config,
    two_eagle_swa_kv_cache_config,
    unequal_pages_kv_cache_config,
    unequal_pages_worker_view,
)
from conformance.harness.driver.driver import VllmDriver
from conformance.harness.driver.engine import TransferEngine
from conformance.harness.driver.model import FIRST_SAMPLED_TOKEN, VOCAB_SIZE, sampled_token
from conformance.harness.driver.session import DispatchedJob, DriverSession
from conformance.harness.driver.vllm_config import DEFAULT_NUM_CPU_CHUNKS, build_vllm_config
from conformance.protocol.trace import JobFault  # workloads build faults as ``D.JobFault``
from vllm_adapter.fixtures import MODELS_DIR

__all__ = [
    "DEFAULT_NUM_CPU_CHUNKS",
    "FIRST_SAMPLED_TOKEN",
    "MODELS_DIR",
    "TINY_LLAMA",
    "VOCAB_SIZE",
    "DispatchedJob",
    "DriverSession",
    "JobFault",
    "TransferEngine",
    "VllmDriver",
    "build_vllm_config",
    "full_attention_kv_cache_config",
    "full_mamba_align_kv_cache_config",
    "full_padded_swa_kv_cache_config",
    "full_swa_kv_cache_config",
    "full_swa_two_layer_kv_cache_config",
    "sampled_token",
    "swa_eagle_kv_cache_config",
    "swa_mtp_kv_cache_config",
    "two_eagle_swa_kv_cache_config",
    "unequal_pages_kv_cache_config",
    "unequal_pages_worker_view",
]
