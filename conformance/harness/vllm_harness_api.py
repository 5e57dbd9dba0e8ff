"""The conformance harness's vLLM imports (and the tests'): driver, benchmarks, GPU lanes, mutants.

``conformance/`` and ``tests/`` do ``from conformance import vllm_harness_api as V``.
Names serving or the operator tooling also use are re-exported from
:mod:`vllm_adapter.vllm_api` / :mod:`vllm_adapter.vllm_tools_api`, and the
version shims from :mod:`vllm_adapter.vllm_shims` (same objects); the rest is
imported from vLLM here and nowhere else.  Serving never imports this module,
so an upstream rename of a harness-only name breaks the harness, not
``import vllm_adapter.connector`` (``tests/test_serving_imports.py``).
"""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import vllm.distributed.kv_transfer.kv_connector.v1.offloading.config as _mut_config
import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as _mut_sched
import vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker as _mut_worker
import vllm.v1.kv_offload.cpu.manager as _mut_cpu_manager
import vllm.v1.kv_offload.cpu.spec as cpu_offloading_spec_module
import vllm.v1.kv_offload.tiering.fs.manager as fs_tier_module
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    get_sliding_window_size_in_chunks,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    SchedulerOffloadConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
    OffloadingConnectorWorker,
)
from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    CrossAttentionSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCacheTensor,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker, SingleDirectionOffloadingHandler
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.fs.io import batch_load_block, batch_store_block, probe_o_direct
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.worker.utils import allocate_kv_cache

from vllm_adapter.vllm_api import (
    VLLM_VERSION,
    ChunkedLocalAttentionSpec,
    CPUOffloadingManager,
    CPUOffloadingSpec,
    FileSystemTierManager,
    FullAttentionSpec,
    GpuBlocks,
    MambaSpec,
    OffloadingSpec,
    OffloadingWorker,
    SecondaryTierFactory,
    SharedOffloadRegion,
    SlidingWindowSpec,
    TieringOffloadingSpec,
    TransferResult,
    build_offloading_config,
    get_offloading_group_ids,
    gpu_blocks,
    iter_layer_specs,
    resolve_dcp_kv_block_size,
    resolve_kv_cache_block_sizes,
)
from vllm_adapter.vllm_shims import (
    SUPPORTS_FAILED_TRANSFERS,
    WORKER_TAKES_DEVICE_POINTERS,
    CanonicalKVCaches,
    DevicePointers,
    GPULoadStoreSpec,
    cpu_worker_views,
    failed_job_ids,
    install_transfer_engine,
    iter_pointer_groups,
    model_runner_output,
    resolve_device_pointers,
    skips_external_kv,
    worker_gpu_arg,
)
from vllm_adapter.vllm_tools_api import (
    AttentionSpec,
    CacheConfig,
    DeviceConfig,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVTransferConfig,
    ModelConfig,
    Scheduler,
    SchedulerConfig,
    SlidingWindowMLASpec,
    StructuredOutputManager,
    UniformTypeKVCacheSpecs,
    VllmConfig,
    group_kv_bytes_per_block,
    resolve_cache_hit_alignment_tokens,
)

__all__ = [
    # engine config and KV-cache specs (driver configs, geometry tests)
    "CacheConfig",
    "DeviceConfig",
    "KVTransferConfig",
    "ModelConfig",
    "SchedulerConfig",
    "VllmConfig",
    "VLLM_VERSION",
    "AttentionSpec",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupSpec",
    "MLAAttentionSpec",
    "MambaSpec",
    "RSWASpec",
    "SinkFullAttentionSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "UniformTypeKVCacheSpecs",
    "iter_layer_specs",
    "resolve_cache_hit_alignment_tokens",
    "resolve_dcp_kv_block_size",
    "resolve_kv_cache_block_sizes",
    # conformance driver: vLLM's scheduler and connector, run on CPU
    "KVConnectorFactory",
    "KVConnectorOutput",
    "KVConnectorRole",
    "OffloadingConnectorMetadata",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerOffloadConfig",
    "StructuredOutputManager",
    "build_offloading_config",
    "get_hash_fn_by_name",
    "get_offloading_group_ids",
    "get_request_block_hasher",
    "get_sliding_window_size_in_chunks",
    "init_none_hash",
    "yield_req_data",
    # worker side: transfers, CPU tier, data lane (conformance.harness.kvdata, kv_memory), GPU lanes
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "CPUOffloadingSpec",
    "OffloadingSpec",
    "TieringOffloadingSpec",
    "CPUOffloadingWorker",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "DevicePointers",
    "GPULoadStoreSpec",
    "GpuBlocks",
    "OffloadingConnectorWorker",
    "OffloadingWorker",
    "SharedOffloadRegion",
    "SingleDirectionOffloadingHandler",
    "TransferResult",
    "allocate_kv_cache",
    "cpu_offloading_spec_module",
    "get_kv_cache_config_from_groups",
    "gpu_blocks",
    "resolve_device_pointers",
    "iter_pointer_groups",
    # version shims the harness uses
    "SUPPORTS_FAILED_TRANSFERS",
    "WORKER_TAKES_DEVICE_POINTERS",
    "cpu_worker_views",
    "failed_job_ids",
    "install_transfer_engine",
    "model_runner_output",
    "skips_external_kv",
    "worker_gpu_arg",
    # file tier (conformance.harness.tiered wraps fs_tier_module's globals) and disk bench
    # (vLLM's file-system tier I/O, naming and thread pool, as FileSystemTierManager uses them)
    "DualQueueThreadPool",
    "FileMapper",
    "FileSystemTierManager",
    "ReqContext",
    "SecondaryTierFactory",
    "TransferJob",
    "batch_load_block",
    "batch_store_block",
    "fs_tier_module",
    "make_offload_key",
    "probe_o_direct",
    "group_kv_bytes_per_block",
    # e2e lane
    "EngineArgs",
    "load_llm_api",
    # meta lane
    "MUTATION_TARGETS",
]


def load_llm_api() -> SimpleNamespace:
    """``vllm.LLM``, ``SamplingParams`` and the between-engines cleanup (e2e lane only: heavy)."""
    from vllm import LLM
    from vllm import SamplingParams as _SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    return SimpleNamespace(
        LLM=LLM, SamplingParams=_SamplingParams, cleanup=cleanup_dist_env_and_memory
    )


MUTATION_TARGETS: dict[str, ModuleType] = {
    "offloading.config": _mut_config,
    "offloading.scheduler": _mut_sched,
    "offloading.worker": _mut_worker,
    "kv_offload.cpu.manager": _mut_cpu_manager,
    "kv_offload.cpu.spec": cpu_offloading_spec_module,
}
"""Short name -> vLLM module whose functions and classes the meta lane's mutants patch
(:mod:`conformance.meta.mutants.vllm_side` replaces one function or method of these
modules, in process, with monkeypatch, by a copy with one line changed)."""
