"""Every difference between the supported vLLM releases (0.33.0, 0.34.0) that kvchunk meets.

One small, named shim per difference, detected by feature (never by version
string), so the code that uses it reads the same on both releases.
:mod:`conformance.protocol.versions` documents which *behaviours* (as opposed to APIs)
changed.

Serving imports this module (through :mod:`vllm_adapter.vllm_api`), so its
top-level vLLM imports are only names serving depends on anyway, or guarded by
``try``/``except ImportError`` where a release lacks them; a shim that needs a
harness-only name imports it inside the function.  The serving core, the CLI
tooling (:mod:`vllm_adapter.vllm_tools_api`) and the harness
(:mod:`conformance.harness.vllm_harness_api`) re-export the shims they use.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec

__all__ = [
    "SUPPORTS_FAILED_TRANSFERS",
    "WORKER_TAKES_DEVICE_POINTERS",
    "CanonicalKVCaches",
    "DevicePointers",
    "GPULoadStoreSpec",
    "GpuBlocks",
    "cpu_worker_views",
    "failed_job_ids",
    "fs_tier_track_store",
    "gpu_blocks",
    "install_transfer_engine",
    "iter_pointer_groups",
    "model_runner_output",
    "resolve_device_pointers",
    "skips_external_kv",
    "uses_v2_model_runner",
    "worker_gpu_arg",
]

# --- scheduler / connector worker ---

SUPPORTS_FAILED_TRANSFERS: bool = "failed_jobs" in {
    f.name for f in dataclasses.fields(OffloadingWorkerMetadata)
}
"""0.34.0: a worker may report ``TransferResult(success=False)``; the job's id
reaches the scheduler in ``OffloadingWorkerMetadata.failed_jobs`` (a failed store
is dropped, a failed load's request is listed in ``failed_recving`` and never
loads from the offloaded cache again).  0.33.0 asserts ``success``."""

try:  # 0.34.0: transfers take pre-resolved device pointers, not GPULoadStoreSpec
    from vllm.v1.kv_offload.base import DevicePointers
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    WORKER_TAKES_DEVICE_POINTERS: bool = True
except ImportError:  # 0.33.0
    DevicePointers = None  # type: ignore[assignment,misc]
    resolve_device_pointers = None  # type: ignore[assignment]
    WORKER_TAKES_DEVICE_POINTERS = False

try:  # 0.34.0
    from vllm.v1.kv_offload.pointer_utils import iter_pointer_groups
except ImportError:  # 0.33.0
    iter_pointer_groups = None  # type: ignore[assignment]


def skips_external_kv(request: Any) -> bool:
    """The request must not read offloaded KV (0.34.0 ``skip_reading_external_kv``,
    0.33.0 ``skip_reading_prefix_cache``)."""
    if hasattr(type(request), "skip_reading_external_kv"):
        return bool(request.skip_reading_external_kv)
    return bool(request.skip_reading_prefix_cache)


def failed_job_ids(worker_meta: Any) -> set[int]:
    """Job ids a worker reported as failed (always empty on 0.33.0)."""
    return set(getattr(worker_meta, "failed_jobs", ()) or ())


class GpuBlocks(NamedTuple):
    """The GPU side of one transfer job, whichever form the worker received."""

    block_ids: np.ndarray
    """int64 block ids, group-major."""
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


def gpu_blocks(gpu_side: Any, kv_caches: Any) -> GpuBlocks:
    """Block ids, group sizes and block indices of a worker call's GPU argument.

    0.33.0 passes the ``GPULoadStoreSpec``.  0.34.0 passes ``DevicePointers``
    (``base + block_id * row_stride`` per data ref per block, see
    ``pointer_utils.resolve_device_pointers``); the block ids are recovered from
    the first data ref of each group, and every other data ref of the group
    must name the same blocks (``ValueError`` otherwise).
    """
    if isinstance(gpu_side, GPULoadStoreSpec):
        return GpuBlocks(
            np.asarray(gpu_side.block_ids, dtype=np.int64),
            tuple(int(n) for n in gpu_side.group_sizes),
            tuple(int(i) for i in gpu_side.block_indices),
        )
    if DevicePointers is None or not isinstance(gpu_side, DevicePointers):
        raise TypeError(
            f"expected a GPULoadStoreSpec or DevicePointers, got {type(gpu_side).__name__}"
        )
    out: list[np.ndarray] = []
    op = 0
    for size, n_refs, refs in zip(
        gpu_side.group_block_counts,
        gpu_side.group_data_ref_counts,
        kv_caches.group_data_refs,
        strict=True,
    ):
        if size == 0:
            continue
        ids = None
        for ref in refs[:n_refs]:
            tensor = kv_caches.tensors[ref.tensor_idx].tensor
            base = np.uint64(tensor.data_ptr())
            stride = np.uint64(tensor.stride(0))  # as resolve_device_pointers computes it
            ptrs = gpu_side.ptrs[op : op + size]
            got = ((ptrs - base) // stride).astype(np.int64)
            if ids is None:
                ids = got
            elif not np.array_equal(ids, got):
                raise ValueError("DevicePointers: data refs of one group name different blocks")
            op += size
        assert ids is not None
        out.append(ids)
    block_ids = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    return GpuBlocks(
        block_ids,
        tuple(int(n) for n in gpu_side.group_block_counts),
        tuple(int(i) for i in gpu_side.block_indices),
    )


def install_transfer_engine(connector_worker: Any, engine: Any, num_groups: int) -> None:
    """Put ``engine`` under an ``OffloadingConnectorWorker`` without KV tensors.

    0.34.0's worker resolves device pointers from ``_kv_caches`` before every
    submit; an engine that moves no bytes gets caches with no data refs (its
    submits then see empty pointer arrays and the per-group block counts).
    """
    connector_worker.worker = engine
    if WORKER_TAKES_DEVICE_POINTERS:
        connector_worker._kv_caches = CanonicalKVCaches(
            tensors=[], group_data_refs=[[] for _ in range(num_groups)]
        )


def model_runner_output(
    req_ids: list[str], sampled_token_ids: list[list[int]], kv_connector_output: Any
) -> Any:
    """A ``ModelRunnerOutput`` (0.34.0 dropped ``req_id_to_index``: the order of
    ``req_ids`` is the index)."""
    # Imported here, not at the top: ModelRunnerOutput is a harness-only name (the
    # driver's model), so an upstream rename of it cannot break serving imports.
    from vllm.v1.outputs import ModelRunnerOutput

    fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    extra: dict[str, Any] = {}
    if "req_id_to_index" in fields:
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=sampled_token_ids,
        kv_connector_output=kv_connector_output,
        **extra,
    )


# --- worker side ---
# What an ``OffloadingWorker`` receives and what vLLM's CPU worker keeps.


def worker_gpu_arg(gpu_spec: Any, kv_caches: Any) -> Any:
    """The GPU-side argument ``submit_store`` / ``submit_load`` get for ``gpu_spec``.

    What ``OffloadingConnectorWorker`` passes: the ``GPULoadStoreSpec`` itself
    (0.33.0), or ``resolve_device_pointers(gpu_spec, kv_caches)`` over the
    worker's ``CanonicalKVCaches`` (0.34.0).
    """
    if WORKER_TAKES_DEVICE_POINTERS:
        return resolve_device_pointers(gpu_spec, kv_caches)
    return gpu_spec


def cpu_worker_views(worker: Any) -> list[Any]:
    """The CPU tensors (one per canonical tensor) of a ``CPUOffloadingWorker``'s store handler.

    ``SingleDirectionOffloadingHandler.dst_tensors`` on 0.33.0 (the store
    handler's destination); 0.34.0 keeps only ``cpu_tensors`` (the GPU side
    comes as pointers).
    """
    handler = worker._store_handler
    views = getattr(handler, "cpu_tensors", None)
    return list(views if views is not None else handler.dst_tensors)


# --- fixtures / CLI ---
# Used by vllm_adapter.derive (fixtures, CLI planning).


def uses_v2_model_runner(vllm_config: Any) -> bool:
    """Whether the GPU worker builds Model Runner V2.

    0.33.0 decides per config (``VllmConfig.use_v2_model_runner``); 0.34.0 removed
    the V1 ``GPUModelRunner`` (and the property): V2 is the only GPU runner.
    """
    if hasattr(type(vllm_config), "use_v2_model_runner"):
        return bool(vllm_config.use_v2_model_runner)
    return True


# --- file tier ---
# Used by vllm_adapter.disk.tier (KvchunkFileTierManager).


def fs_tier_track_store(tier: Any, job: Any) -> None:
    """Record a store job as ``FileSystemTierManager.submit_store`` does before enqueueing it.

    0.34.0 keeps every store job (``_store_jobs``: a finished store marks its keys
    present in the lookup cache, and feeds KV events); 0.33.0 keeps the keys only
    when KV events are on (``_store_job_keys``).  Detected by the attribute the
    release's ``__init__`` created.
    """
    jobs = getattr(tier, "_store_jobs", None)
    if isinstance(jobs, dict):
        jobs[job.job_id] = job
    elif tier.events is not None:
        tier._store_job_keys[job.job_id] = list(job.keys)
