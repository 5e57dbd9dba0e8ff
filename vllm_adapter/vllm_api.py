# ruff: noqa: I001, F811
"""Every vLLM import of kvchunk, and nothing else.

Other modules do ``from vllm_adapter import vllm_api as V`` and reach vLLM
through ``V.<name>``.  Importing this module fails with ``ImportError`` when
vLLM is not installed; callers that can run without vLLM guard on that.
Sections belong to the helpers that use them; add names under your own header.
"""

from __future__ import annotations

# --- conformance driver ---
from vllm.config import (  # noqa: F401
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: F401
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # noqa: F401
    build_offloading_config,
    get_offloading_group_ids,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: F401
    OffloadingConnectorScheduler,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: F401
    OffloadingConnector,
)
from vllm.sampling_params import SamplingParams  # noqa: F401
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: F401
from vllm.v1.core.kv_cache_utils import (  # noqa: F401
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.v1.kv_cache_interface import (  # noqa: F401
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.kv_offload.base import (  # noqa: F401
    GPULoadStoreSpec,
    LookupResult,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: F401
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: F401
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: F401
from vllm.v1.request import Request, RequestStatus  # noqa: F401
from vllm.v1.structured_output import StructuredOutputManager  # noqa: F401

# --- adapter: geometry + connector ---
# Self-contained on purpose: names another section also imports are imported
# again here (same objects), so this section does not depend on the others.
from vllm.config import (  # noqa: E402, F401, F811
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole  # noqa: E402, F401, F811
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: E402, F401
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402, F401, F811
    OffloadingConnectorMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # noqa: E402, F401, F811
    build_offloading_config,
    get_offloading_group_ids,
    get_sliding_window_size_in_chunks,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (  # noqa: E402, F401
    SchedulerOffloadConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402, F401, F811
    OffloadingConnector,
)
from vllm.sampling_params import SamplingParams  # noqa: E402, F401, F811
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402, F401, F811
from vllm.v1.core.kv_cache_utils import (  # noqa: E402, F401, F811
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_dcp_kv_block_size,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402, F401, F811
from vllm.v1.kv_cache_interface import (  # noqa: E402, F401, F811
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    iter_layer_specs,
)
from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: E402, F401
from vllm.v1.request import Request  # noqa: E402, F401, F811
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402, F401, F811

# --- fixtures / geometry derivation ---
# Used by vllm_adapter.derive, .codec and .fixtures.  Self-contained like the
# sections above (shared names are imported again).  Model-specific layer modules
# (Gemma-4 attention, DeepSeek-V4 caches) are heavy, so they load lazily through
# the ``load_*`` functions below; the import statements still live only here.
import importlib as _importlib  # noqa: E402
from types import SimpleNamespace as _SimpleNamespace  # noqa: E402

import vllm as _vllm  # noqa: E402
import vllm.v1.kv_cache_interface as kv_cache_interface  # noqa: E402, F401
from vllm.config import (  # noqa: E402, F401, F811
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # noqa: E402, F401, F811
    build_offloading_config,
    get_offloading_group_ids,
)
from vllm.config.vllm import get_layers_from_vllm_config  # noqa: E402, F401
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (  # noqa: E402, F401, F811
    OffloadingConnector,
)
from vllm.platforms import current_platform  # noqa: E402, F401
from vllm.platforms.interface import Platform  # noqa: E402, F401
from vllm.v1.attention.backend import MultipleOf  # noqa: E402, F401
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402, F401
from vllm.v1.attention.backends.utils import (  # noqa: E402, F401
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_planning import (  # noqa: E402, F401
    get_global_kv_cache_groups,
    get_kv_cache_configs,
    get_kv_cache_groups,
)
from vllm.v1.core.kv_cache_utils import (  # noqa: E402, F401, F811
    generate_scheduler_kv_cache_config,
    resolve_cache_hit_alignment_tokens,
    resolve_dcp_kv_block_size,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402, F401, F811
from vllm.v1.engine.core import EngineCore  # noqa: E402, F401
from vllm.v1.kv_cache_interface import (  # noqa: E402, F401, F811
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    KVQuantMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
    iter_layer_specs,
)
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402, F401, F811
from vllm.v1.worker.worker_base import WorkerBase  # noqa: E402, F401

VLLM_VERSION: str = _vllm.__version__


def import_vllm_module(name: str):  # noqa: ANN201
    """Import a ``vllm.*`` module by name (to rebuild a spec class stored by module path)."""
    if not (name == "vllm" or name.startswith("vllm.")):
        raise ValueError(f"not a vLLM module: {name!r}")
    return _importlib.import_module(name)


def load_runner_api() -> _SimpleNamespace:
    """The GPU model runners' ``get_kv_cache_spec`` (V2: module function; V1: method)."""
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec as v2_get_kv_cache_spec
    from vllm.v1.worker.utils import customize_attention_spec

    def v1_runner_cls():  # noqa: ANN202 - heavy import, only when V1 is selected
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return GPUModelRunner

    return _SimpleNamespace(
        v2_get_kv_cache_spec=v2_get_kv_cache_spec,
        v1_runner_cls=v1_runner_cls,
        customize_attention_spec=customize_attention_spec,
    )


def load_gemma4_layer_api() -> _SimpleNamespace:
    """vLLM's generic ``Attention`` layer and the two Hopper backends Gemma-4 can get."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    return _SimpleNamespace(
        Attention=Attention,
        FlashAttentionBackend=FlashAttentionBackend,
        TritonAttentionBackend=TritonAttentionBackend,
    )


def load_deepseek_v4_layer_api() -> _SimpleNamespace:
    """DeepSeek-V4's cache modules, attention-class selector and dtype resolver (CUDA build)."""
    from vllm.models.deepseek_v4.attention import (
        DeepseekV4IndexerCache,
        _resolve_dsv4_kv_cache_dtype,
    )
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.models.deepseek_v4.nvidia.model import _select_dsv4_attn_cls
    from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    return _SimpleNamespace(
        DeepseekV4IndexerCache=DeepseekV4IndexerCache,
        resolve_dsv4_kv_cache_dtype=_resolve_dsv4_kv_cache_dtype,
        CompressorStateCache=CompressorStateCache,
        select_dsv4_attn_cls=_select_dsv4_attn_cls,
        dsa_indexer_uses_fp4=dsa_indexer_uses_fp4,
        DeepseekV4SWACache=DeepseekV4SWACache,
    )


# --- reference spec / data lane ---
# Used by vllm_adapter.spec (ReferenceOffloadingSpec) and conformance.kvdata
# (synthetic model runner).  Self-contained like the sections above.
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (  # noqa: E402, F401
    OffloadingConnectorWorker,
)
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups  # noqa: E402, F401
from vllm.v1.kv_cache_interface import (  # noqa: E402, F401, F811
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    MambaSpec,
    UniformTypeKVCacheSpecs,
    group_kernel_blocks,
)
from vllm.v1.kv_offload.base import (  # noqa: E402, F401, F811
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    OffloadingSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingInfo  # noqa: E402, F401
from vllm.v1.kv_offload.cpu.gpu_worker import SingleDirectionOffloadingHandler  # noqa: E402, F401
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402, F401, F811
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402, F401, F811
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402, F401

# --- gpu lanes ---
# Used by conformance.gpu_copy and the gpu_copy / e2e lanes.  Importing these needs
# no GPU (vLLM's CUDA worker asserts CUDA only when constructed).
import vllm.v1.kv_offload.cpu.spec as cpu_offloading_spec_module  # noqa: E402, F401
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # noqa: E402, F401, F811
    build_offloading_config,
)
from vllm.v1.kv_offload.cpu.gpu_worker import (  # noqa: E402, F401, F811
    CPUOffloadingWorker,
    SingleDirectionOffloadingHandler,
    compute_sub_block_ptrs,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402, F401
from vllm.engine.arg_utils import EngineArgs  # noqa: E402, F401


def load_llm_api() -> _SimpleNamespace:
    """``vllm.LLM``, ``SamplingParams`` and the between-engines cleanup (e2e lane only: heavy)."""
    from vllm import LLM
    from vllm import SamplingParams as _SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    return _SimpleNamespace(
        LLM=LLM, SamplingParams=_SamplingParams, cleanup=cleanup_dist_env_and_memory
    )


# --- faults ---
# Used by conformance.faults (fault injection, leak checks) and by
# vllm_adapter.connector (it resolves 'eviction_policy' the way vLLM's CPU
# manager will, to reject a bad one with a ValueError naming the key).
from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory  # noqa: E402, F401

# --- config CLI ---
# Used by vllm_adapter.cli (``python -m vllm_adapter config``): vLLM's own
# per-group bytes per block (worker view invariant), as its offloading config uses.
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (  # noqa: E402, F401
    _group_kv_bytes_per_block as group_kv_bytes_per_block,
)

# --- bench ---
# Used by conformance.bench (disk benchmark): vLLM's file-system tier I/O, its
# file naming and its thread pool, exactly as FileSystemTierManager uses them.
from vllm.v1.kv_offload.file_mapper import FileMapper  # noqa: E402, F401
from vllm.v1.kv_offload.base import make_offload_key  # noqa: E402, F401
from vllm.v1.kv_offload.tiering.fs.io import (  # noqa: E402, F401
    batch_load_block,
    batch_store_block,
    probe_o_direct,
)
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool  # noqa: E402, F401


# --- version shims (vLLM 0.33.0 / 0.34.0) ---
# Every difference between the supported releases that kvchunk's code meets is
# one small, named shim here, detected by feature (never by version string), so
# the harness reads the same on both.  conformance.versions documents which
# behaviours (as opposed to APIs) changed.
import dataclasses as _dataclasses  # noqa: E402
from typing import Any as _Any  # noqa: E402
from typing import NamedTuple as _NamedTuple  # noqa: E402

import numpy as _np  # noqa: E402

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (  # noqa: E402, F811
    OffloadingWorkerMetadata,
)

SUPPORTS_FAILED_TRANSFERS: bool = "failed_jobs" in {
    f.name for f in _dataclasses.fields(OffloadingWorkerMetadata)
}
"""0.34.0: a worker may report ``TransferResult(success=False)``; the job's id
reaches the scheduler in ``OffloadingWorkerMetadata.failed_jobs`` (a failed store
is dropped, a failed load's request is listed in ``failed_recving`` and never
loads from the offloaded cache again).  0.33.0 asserts ``success``."""

try:  # 0.34.0: transfers take pre-resolved device pointers, not GPULoadStoreSpec
    from vllm.v1.kv_offload.base import DevicePointers  # noqa: F401
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers  # noqa: F401

    WORKER_TAKES_DEVICE_POINTERS: bool = True
except ImportError:  # 0.33.0
    DevicePointers = None  # type: ignore[assignment,misc]
    resolve_device_pointers = None  # type: ignore[assignment]
    WORKER_TAKES_DEVICE_POINTERS = False


def skips_external_kv(request: _Any) -> bool:
    """The request must not read offloaded KV (0.34.0 ``skip_reading_external_kv``,
    0.33.0 ``skip_reading_prefix_cache``)."""
    if hasattr(type(request), "skip_reading_external_kv"):
        return bool(request.skip_reading_external_kv)
    return bool(request.skip_reading_prefix_cache)


def failed_job_ids(worker_meta: _Any) -> set[int]:
    """Job ids a worker reported as failed (always empty on 0.33.0)."""
    return set(getattr(worker_meta, "failed_jobs", ()) or ())


class GpuBlocks(_NamedTuple):
    """The GPU side of one transfer job, whichever form the worker received."""

    block_ids: _np.ndarray
    """int64 block ids, group-major."""
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


def gpu_blocks(gpu_side: _Any, kv_caches: _Any) -> GpuBlocks:
    """Block ids, group sizes and block indices of a worker call's GPU argument.

    0.33.0 passes the ``GPULoadStoreSpec``.  0.34.0 passes ``DevicePointers``
    (``base + block_id * row_stride`` per data ref per block, see
    ``pointer_utils.resolve_device_pointers``); the block ids are recovered from
    the first data ref of each group, and every other data ref of the group
    must name the same blocks (``ValueError`` otherwise).
    """
    if isinstance(gpu_side, GPULoadStoreSpec):
        return GpuBlocks(
            _np.asarray(gpu_side.block_ids, dtype=_np.int64),
            tuple(int(n) for n in gpu_side.group_sizes),
            tuple(int(i) for i in gpu_side.block_indices),
        )
    if DevicePointers is None or not isinstance(gpu_side, DevicePointers):
        raise TypeError(
            f"expected a GPULoadStoreSpec or DevicePointers, got {type(gpu_side).__name__}"
        )
    out: list[_np.ndarray] = []
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
            base = _np.uint64(tensor.data_ptr())
            stride = _np.uint64(tensor.stride(0))  # as resolve_device_pointers computes it
            ptrs = gpu_side.ptrs[op : op + size]
            got = ((ptrs - base) // stride).astype(_np.int64)
            if ids is None:
                ids = got
            elif not _np.array_equal(ids, got):
                raise ValueError("DevicePointers: data refs of one group name different blocks")
            op += size
        assert ids is not None
        out.append(ids)
    block_ids = _np.concatenate(out) if out else _np.zeros(0, dtype=_np.int64)
    return GpuBlocks(
        block_ids,
        tuple(int(n) for n in gpu_side.group_block_counts),
        tuple(int(i) for i in gpu_side.block_indices),
    )


def install_transfer_engine(connector_worker: _Any, engine: _Any, num_groups: int) -> None:
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
    req_ids: list[str], sampled_token_ids: list[list[int]], kv_connector_output: _Any
) -> _Any:
    """A ``ModelRunnerOutput`` (0.34.0 dropped ``req_id_to_index``: the order of
    ``req_ids`` is the index)."""
    fields = {f.name for f in _dataclasses.fields(ModelRunnerOutput)}
    extra: dict[str, _Any] = {}
    if "req_id_to_index" in fields:
        extra["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(
        req_ids=req_ids,
        sampled_token_ids=sampled_token_ids,
        kv_connector_output=kv_connector_output,
        **extra,
    )


# --- version shims: worker side ---
# What an ``OffloadingWorker`` receives and what vLLM's CPU worker keeps, on
# either release (detected by feature, like the section above).
try:  # 0.34.0
    from vllm.v1.kv_offload.pointer_utils import iter_pointer_groups  # noqa: F401
except ImportError:  # 0.33.0
    iter_pointer_groups = None  # type: ignore[assignment]


def worker_gpu_arg(gpu_spec: _Any, kv_caches: _Any) -> _Any:
    """The GPU-side argument ``submit_store`` / ``submit_load`` get for ``gpu_spec``.

    What ``OffloadingConnectorWorker`` passes: the ``GPULoadStoreSpec`` itself
    (0.33.0), or ``resolve_device_pointers(gpu_spec, kv_caches)`` over the
    worker's ``CanonicalKVCaches`` (0.34.0).
    """
    if WORKER_TAKES_DEVICE_POINTERS:
        return resolve_device_pointers(gpu_spec, kv_caches)
    return gpu_spec


def cpu_worker_views(worker: _Any) -> list[_Any]:
    """The CPU tensors (one per canonical tensor) of a ``CPUOffloadingWorker``'s store handler.

    ``SingleDirectionOffloadingHandler.dst_tensors`` on 0.33.0 (the store
    handler's destination); 0.34.0 keeps only ``cpu_tensors`` (the GPU side
    comes as pointers).
    """
    handler = worker._store_handler
    views = getattr(handler, "cpu_tensors", None)
    return list(views if views is not None else handler.dst_tensors)


# --- version shims: fixtures/cli ---
# Used by vllm_adapter.derive (fixtures, CLI planning).  Detected by feature.


def uses_v2_model_runner(vllm_config: _Any) -> bool:
    """Whether the GPU worker builds Model Runner V2.

    0.33.0 decides per config (``VllmConfig.use_v2_model_runner``); 0.34.0 removed
    the V1 ``GPUModelRunner`` (and the property): V2 is the only GPU runner.
    """
    if hasattr(type(vllm_config), "use_v2_model_runner"):
        return bool(vllm_config.use_v2_model_runner)
    return True


# --- mutation targets: module objects the meta lane patches ---
# conformance.mutants.vllm_side replaces one function or method of these
# modules (in process, with monkeypatch) by a copy with one line changed.
# Targeted edits only below this line.

import vllm.distributed.kv_transfer.kv_connector.v1.offloading.config as _mut_config  # noqa: E402
import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as _mut_sched  # noqa: E402
import vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker as _mut_worker  # noqa: E402
import vllm.v1.kv_offload.cpu.manager as _mut_cpu_manager  # noqa: E402
import vllm.v1.kv_offload.cpu.spec as _mut_cpu_spec  # noqa: E402

MUTATION_TARGETS: dict[str, _Any] = {
    "offloading.config": _mut_config,
    "offloading.scheduler": _mut_sched,
    "offloading.worker": _mut_worker,
    "kv_offload.cpu.manager": _mut_cpu_manager,
    "kv_offload.cpu.spec": _mut_cpu_spec,
}
"""Short name -> vLLM module whose functions and classes the meta lane's mutants patch."""


# --- tiering (disk) ---
# Used by vllm_adapter.tiering (ReferenceTieringOffloadingSpec) and the tiered
# data / faults lanes (conformance.tiered): vLLM's TieringOffloadingSpec, its
# file-system tier (whose module globals the lanes wrap to count and fault file
# I/O) and the platform check deciding between vLLM's CUDA worker and the
# reference worker.  Targeted edits only below this line.
import vllm.v1.kv_offload.tiering.fs.manager as fs_tier_module  # noqa: E402, F401
from vllm.platforms import current_platform as _current_platform  # noqa: E402
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager  # noqa: E402, F401
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager  # noqa: E402, F401
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402, F401


def cuda_offloading_platform() -> bool:
    """Whether vLLM's own ``CPUOffloadingWorker`` runs here (CUDA-alike, not ROCm)."""
    return bool(_current_platform.is_cuda_alike() and not _current_platform.is_rocm())


import vllm.v1.kv_offload.tiering.spec as _tiering_spec_module  # noqa: E402

TIERING_REJECTS_MULTINODE: bool = hasattr(_tiering_spec_module, "_reject_workers_across_nodes")
"""0.34.0: ``TieringOffloadingSpec.create_worker`` rejects secondary tiers on
engines whose workers span nodes (a collective over the TP/PP/PCP groups);
0.33.0 has no such check."""


# --- checksummed file tier ---
# Used by vllm_adapter.safe_fs (KvchunkTieringOffloadingSpec / KvchunkFileTierManager):
# vLLM's secondary-tier registry (the tier registers under a short type name) and
# the one bookkeeping difference of FileSystemTierManager.submit_store between
# the releases.
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402, F401


def fs_tier_track_store(tier: _Any, job: _Any) -> None:
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
