"""The serving core's vLLM imports: what kvchunk needs inside a running engine.

:mod:`vllm_adapter.connector`, :mod:`~vllm_adapter.spec`, :mod:`~vllm_adapter.tiering`,
:mod:`~vllm_adapter.disk.tier` and :mod:`~vllm_adapter.geometry` do
``from vllm_adapter import vllm_api as V`` and reach vLLM through ``V.<name>``.
A new vLLM release that renames something serving uses changes this file (or
:mod:`vllm_adapter.vllm_shims`, where the two supported releases differ).

vLLM's imports are split three ways so that a rename outside serving cannot
break ``import vllm_adapter.connector``:

* this module: serving only (it re-exports the shims serving uses);
* :mod:`vllm_adapter.vllm_tools_api`: the operator tooling (``python -m
  vllm_adapter config``, fixture derivation), which reaches into vLLM's engine
  core, workers and private helpers;
* :mod:`conformance.harness.vllm_harness_api`: the conformance harness and the tests
  (driver, benchmarks, GPU lanes, mutation targets).

``tests/test_serving_imports.py`` imports the serving modules with the other
two made unimportable.  Importing this module fails with ``ImportError`` when
vLLM is not installed; callers that can run without vLLM guard on that.
"""

from __future__ import annotations

import inspect

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
    get_offloading_group_ids,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector,
)
from vllm.platforms import current_platform
from vllm.v1.core.kv_cache_utils import resolve_dcp_kv_block_size, resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
    iter_layer_specs,
)
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from vllm_adapter.vllm_shims import GpuBlocks, fs_tier_track_store, gpu_blocks

__all__ = [
    # connector (vllm_adapter.connector): the stock connector it extends, and the
    # CPU manager's eviction-policy registry (a bad 'eviction_policy' is rejected
    # with a ValueError naming the key, as vLLM's CPU manager would resolve it).
    "VLLM_VERSION",
    "CachePolicyFactory",
    "OffloadingConnector",
    # geometry (vllm_adapter.geometry): vLLM's own resolvers and spec classes.
    "ChunkedLocalAttentionSpec",
    "FullAttentionSpec",
    "MambaSpec",
    "SlidingWindowSpec",
    "build_offloading_config",
    "get_offloading_group_ids",
    "iter_layer_specs",
    "resolve_dcp_kv_block_size",
    "resolve_kv_cache_block_sizes",
    # reference spec (vllm_adapter.spec): the CPU tier it replaces the worker of.
    "CPUOffloadingInfo",
    "CPUOffloadingManager",
    "CPUOffloadingSpec",
    "GpuBlocks",
    "OffloadingSpec",
    "OffloadingWorker",
    "TransferResult",
    "gpu_blocks",
    # tiering (vllm_adapter.tiering, vllm_adapter.disk.tier): vLLM's TieringOffloadingSpec,
    # its secondary-tier registry and file-system tier, and the platform check
    # deciding between vLLM's CUDA worker and the reference worker.
    "FileSystemTierManager",
    "LookupResult",
    "SecondaryTierFactory",
    "SharedOffloadRegion",
    "TieringOffloadingSpec",
    "FS_TIER_POOL_PARAMETERS",
    "cuda_offloading_platform",
    "fs_tier_pool_defaults",
    "fs_tier_track_store",
    # tier metrics (vllm_adapter.disk.metrics): the file tier's counters and gauges as
    # vLLM's offloading metric definitions, and the stats payload its get_stats returns.
    "OffloadingConnectorStats",
    "OffloadingCounterMetadata",
    "OffloadingGaugeMetadata",
    "OffloadingMetricMetadata",
    # tiering (vllm_adapter.tiering): the SharedOffloadRegion each side of
    # TieringOffloadingSpec maps, whose /dev/shm name kvchunk unlinks once all have.
    "scheduler_region",
    "worker_region",
]

VLLM_VERSION: str = vllm.__version__


def cuda_offloading_platform() -> bool:
    """Whether vLLM's own ``CPUOffloadingWorker`` runs here (CUDA-alike, not ROCm)."""
    return bool(current_platform.is_cuda_alike() and not current_platform.is_rocm())


FS_TIER_POOL_PARAMETERS = ("n_read_threads", "n_write_threads")
"""``FileSystemTierManager``'s parameters (and the fs tier entry's keys) of the threads its
I/O pool starts, read- and write-priority (0.33.0, 0.34.0)."""


def fs_tier_pool_defaults() -> dict[str, int]:
    """vLLM's ``FileSystemTierManager`` defaults of :data:`FS_TIER_POOL_PARAMETERS`:
    parameter -> threads, what its pool starts when the fs tier entry does not say.
    ``TypeError`` when the class no longer takes one of them with a default (a vLLM
    that renamed them: this module, and the entry's keys, follow it)."""
    params = inspect.signature(FileSystemTierManager.__init__).parameters
    missing = [k for k in FS_TIER_POOL_PARAMETERS
               if k not in params or params[k].default is inspect.Parameter.empty]
    if missing:
        raise TypeError(
            f"vLLM {VLLM_VERSION}'s FileSystemTierManager takes no {' or '.join(missing)} "
            f"with a default (its parameters: {', '.join(list(params)[1:])}): kvchunk reads "
            f"its I/O pool's thread counts from them (vllm_adapter/vllm_api.py)")
    return {k: int(params[k].default) for k in FS_TIER_POOL_PARAMETERS}


def scheduler_region(spec: TieringOffloadingSpec) -> SharedOffloadRegion | None:
    """The scheduler side's ``SharedOffloadRegion`` of a ``TieringOffloadingSpec`` (``None``
    before ``get_manager``); vLLM keeps it in ``_scheduler_mmap`` (0.33.0, 0.34.0)."""
    region: SharedOffloadRegion | None = getattr(spec, "_scheduler_mmap", None)
    return region


def worker_region(worker: object) -> SharedOffloadRegion | None:
    """The ``SharedOffloadRegion`` a ``CPUOffloadingWorker`` maps (``None``: private CPU
    tensors); vLLM keeps it in ``_mmap_region`` (0.33.0, 0.34.0)."""
    region: SharedOffloadRegion | None = getattr(worker, "_mmap_region", None)
    return region
