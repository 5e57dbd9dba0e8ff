"""The operator tooling's vLLM imports: ``python -m vllm_adapter config`` and fixture derivation.

:mod:`vllm_adapter.codec`, :mod:`~vllm_adapter.fixtures`, :mod:`vllm_adapter.derive`
and :mod:`vllm_adapter.cli` do ``from vllm_adapter import vllm_tools_api as V``
(the CLI inside the functions that need vLLM).  The derivation reaches into
vLLM's engine core, workers, planning helpers, one private helper
(``_group_kv_bytes_per_block``) and model-specific layer modules; keeping those
names out of :mod:`vllm_adapter.vllm_api` means a rename among them cannot break
serving.  The serving names the tooling also uses are re-exported from there,
the version shims from :mod:`vllm_adapter.vllm_shims` (same objects).

Model-specific layer modules (Gemma-4 attention, DeepSeek-V4 caches) are heavy,
so they load lazily through the ``load_*`` functions below; the import
statements still live only here.
"""

from __future__ import annotations

import importlib
from types import ModuleType, SimpleNamespace
from typing import Any

from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.config.vllm import get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    _group_kv_bytes_per_block as group_kv_bytes_per_block,
)
from vllm.platforms import current_platform
from vllm.platforms.interface import Platform
from vllm.v1.attention.backend import MultipleOf
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    resolve_cache_hit_alignment_tokens,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupRole,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    KVQuantMode,
    SlidingWindowMLASpec,
    SparseCacheRole,
    UniformTypeKVCacheSpecs,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.worker_base import WorkerBase

from vllm_adapter.vllm_api import (
    VLLM_VERSION,
    CPUOffloadingSpec,
    FullAttentionSpec,
    MambaSpec,
    OffloadingConnector,
    SlidingWindowSpec,
    build_offloading_config,
    get_offloading_group_ids,
    resolve_dcp_kv_block_size,
    resolve_kv_cache_block_sizes,
)
from vllm_adapter.vllm_shims import uses_v2_model_runner

__all__ = [
    # engine config
    "CacheConfig",
    "DeviceConfig",
    "KVTransferConfig",
    "ModelConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "VllmConfig",
    "set_current_vllm_config",
    # KV-cache specs and planning (codec, derive)
    "AttentionSpec",
    "FullAttentionSpec",
    "KVCacheConfig",
    "KVCacheGroupRole",
    "KVCacheGroupSpec",
    "KVCacheSpec",
    "KVCacheTensor",
    "KVQuantMode",
    "MambaSpec",
    "SlidingWindowMLASpec",
    "SlidingWindowSpec",
    "SparseCacheRole",
    "UniformTypeKVCacheSpecs",
    "generate_scheduler_kv_cache_config",
    "get_global_kv_cache_groups",
    "get_kv_cache_configs",
    "get_kv_cache_spec_kind",
    "get_kv_cache_spec_sliding_window",
    "get_offloading_group_ids",
    "resolve_cache_hit_alignment_tokens",
    "resolve_dcp_kv_block_size",
    "resolve_kv_cache_block_sizes",
    # engine core, workers, platform, backends (derive)
    "EngineCore",
    "MambaAttentionBackendEnum",
    "MultipleOf",
    "Platform",
    "WorkerBase",
    "current_platform",
    "get_layers_from_vllm_config",
    "get_supported_kv_cache_layouts",
    "import_vllm_module",
    "load_deepseek_v4_layer_api",
    "load_gemma4_layer_api",
    "load_runner_api",
    "resolve_kv_cache_layout",
    "uses_v2_model_runner",
    # scheduler + connector (fixtures: a scheduler over a fixture's config)
    "VLLM_VERSION",
    "OffloadingConnector",
    "Scheduler",
    "StructuredOutputManager",
    # offloading config and bytes per block (CLI sizing): vLLM's own per-group
    # bytes per block (worker view), as its offloading config uses.
    "CPUOffloadingSpec",
    "build_offloading_config",
    "group_kv_bytes_per_block",
]


def import_vllm_module(name: str) -> ModuleType:
    """Import a ``vllm.*`` module by name (to rebuild a spec class stored by module path)."""
    if not (name == "vllm" or name.startswith("vllm.")):
        raise ValueError(f"not a vLLM module: {name!r}")
    return importlib.import_module(name)


def load_runner_api() -> SimpleNamespace:
    """The GPU model runners' ``get_kv_cache_spec`` (V2: module function; V1: method)."""
    from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec as v2_get_kv_cache_spec
    from vllm.v1.worker.utils import customize_attention_spec

    def v1_runner_cls() -> Any:  # heavy import, only when V1 is selected
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        return GPUModelRunner

    return SimpleNamespace(
        v2_get_kv_cache_spec=v2_get_kv_cache_spec,
        v1_runner_cls=v1_runner_cls,
        customize_attention_spec=customize_attention_spec,
    )


def load_gemma4_layer_api() -> SimpleNamespace:
    """vLLM's generic ``Attention`` layer and the two Hopper backends Gemma-4 can get."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    return SimpleNamespace(
        Attention=Attention,
        FlashAttentionBackend=FlashAttentionBackend,
        TritonAttentionBackend=TritonAttentionBackend,
    )


def load_deepseek_v4_layer_api() -> SimpleNamespace:
    """DeepSeek-V4's cache modules, attention-class selector and dtype resolver (CUDA build)."""
    from vllm.models.deepseek_v4.attention import (
        DeepseekV4IndexerCache,
        _resolve_dsv4_kv_cache_dtype,
    )
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.models.deepseek_v4.nvidia.model import _select_dsv4_attn_cls
    from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    return SimpleNamespace(
        DeepseekV4IndexerCache=DeepseekV4IndexerCache,
        resolve_dsv4_kv_cache_dtype=_resolve_dsv4_kv_cache_dtype,
        CompressorStateCache=CompressorStateCache,
        select_dsv4_attn_cls=_select_dsv4_attn_cls,
        dsa_indexer_uses_fp4=dsa_indexer_uses_fp4,
        DeepseekV4SWACache=DeepseekV4SWACache,
    )
