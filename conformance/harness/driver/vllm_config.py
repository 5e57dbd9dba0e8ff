"""The ``VllmConfig`` a driver runs under, resolved as ``EngineCore`` would."""

from __future__ import annotations

import copy
import importlib
from pathlib import Path
from typing import Any

from conformance.harness import vllm_harness_api as V
from conformance.harness.driver.configs import TINY_LLAMA
from vllm_adapter.names import CPU_SPEC, REFERENCE_SPEC_NAME, STOCK_CONNECTOR

DEFAULT_NUM_CPU_CHUNKS = 4096


def _prefix_cacheable_block_sizes(kv_cache_config: Any) -> list[int]:
    groups = kv_cache_config.kv_cache_groups
    sizes = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    return sizes or [g.kv_cache_spec.block_size for g in groups]


def _has_mamba_align(kv_cache_config: Any) -> bool:
    return any(
        isinstance(g.kv_cache_spec, V.MambaSpec) and g.kv_cache_spec.mamba_cache_mode == "align"
        for g in kv_cache_config.kv_cache_groups
    )


def _cache_config(
    kv_cache_config: Any, enable_prefix_caching: bool, prefix_cache_retention_interval: int | None
) -> Any:
    cache_kwargs: dict[str, Any] = dict(
        block_size=min(_prefix_cacheable_block_sizes(kv_cache_config)),
        enable_prefix_caching=enable_prefix_caching,
        prefix_cache_retention_interval=prefix_cache_retention_interval,
    )
    if _has_mamba_align(kv_cache_config):
        cache_kwargs["mamba_cache_mode"] = "align"
    return V.CacheConfig(**cache_kwargs)


def _transfer_config(
    connector: str,
    connector_module_path: str | None,
    extra_config: dict[str, Any],
    kv_load_failure_policy: str,
) -> Any:
    transfer_kwargs: dict[str, Any] = dict(
        kv_connector=connector,
        kv_role="kv_both",
        kv_connector_extra_config=extra_config,
        kv_load_failure_policy=kv_load_failure_policy,
    )
    if connector_module_path is not None:
        transfer_kwargs["kv_connector_module_path"] = connector_module_path
    return V.KVTransferConfig(**transfer_kwargs)


def _resolve(
    kv_cache_config: Any,
    vllm_config: Any,
    num_blocks: int,
    prefix_cache_retention_interval: int | None,
) -> Any:
    """A copy of ``kv_cache_config`` with the fields ``EngineCore`` fills in."""
    resolved = copy.deepcopy(kv_cache_config)
    resolved.num_blocks = num_blocks
    resolved.prefix_cache_retention_interval = prefix_cache_retention_interval
    sched_block, hash_block = V.resolve_kv_cache_block_sizes(resolved, vllm_config)
    resolved.hash_block_size = hash_block
    resolved.cache_hit_alignment_tokens = V.resolve_cache_hit_alignment_tokens(
        resolved, vllm_config, sched_block, hash_block
    )
    return resolved


def is_kvchunk_spec(cls: type) -> bool:
    """A subclass of one of kvchunk's reference specs: it takes ``num_cpu_chunks``, and its
    worker is the reference one wherever vLLM's would need CUDA."""
    from vllm_adapter.spec import ReferenceOffloadingSpec
    from vllm_adapter.tiering import ReferenceTieringOffloadingSpec

    return issubclass(cls, ReferenceOffloadingSpec | ReferenceTieringOffloadingSpec)


def takes_chunk_count(extra_config: dict[str, Any]) -> bool:
    """Whether the extra config's spec is one of kvchunk's, which take ``num_cpu_chunks``.

    Decided by class, not name: vLLM's own specs (``CPUOffloadingSpec``,
    ``TieringOffloadingSpec``) and any third-party spec size the CPU tier in bytes only
    (``cpu_bytes_to_use``), so the driver must give them bytes.
    """
    name = extra_config.get("spec_name", CPU_SPEC)
    module = extra_config.get("spec_module_path")
    if module is None:  # a spec registered with vLLM's factory: vLLM's own
        return bool(name == REFERENCE_SPEC_NAME)
    cls = getattr(importlib.import_module(module), name, None)
    return isinstance(cls, type) and is_kvchunk_spec(cls)


def _size_cpu_tier(vllm_config: Any, resolved: Any, num_cpu_chunks: int) -> None:
    """Size the spec's CPU tier at ``num_cpu_chunks`` chunks, unless the extra config sizes it.

    kvchunk's specs take the count itself.  Every other spec (vLLM's, a third party's)
    gets ``cpu_bytes_to_use``: vLLM's own chunk size, asked of vLLM's
    ``CPUOffloadingSpec``, times the count.
    """
    live_extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    if takes_chunk_count(live_extra):
        if not ({"num_cpu_chunks", "cpu_bytes_to_use"} & set(live_extra)):
            live_extra["num_cpu_chunks"] = num_cpu_chunks
    elif "cpu_bytes_to_use" not in live_extra:
        live_extra["cpu_bytes_to_use"] = 1
        probe = V.CPUOffloadingSpec(V.build_offloading_config(vllm_config, resolved))
        live_extra["cpu_bytes_to_use"] = max(1, probe.kv_bytes_per_chunk * num_cpu_chunks)


def build_vllm_config(
    kv_cache_config: Any,
    *,
    model_dir: str | Path = TINY_LLAMA,
    extra_config: dict[str, Any] | None = None,
    prefix_cache_retention_interval: int | None = 0,
    num_gpu_blocks: int | None = None,
    num_cpu_chunks: int = DEFAULT_NUM_CPU_CHUNKS,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 8192,
    max_num_seqs: int = 16,
    connector: str = STOCK_CONNECTOR,
    connector_module_path: str | None = None,
    kv_load_failure_policy: str = "fail",
    enable_prefix_caching: bool = True,
) -> tuple[Any, Any]:
    """A ``VllmConfig`` for ``kv_cache_config``, and the config resolved as the engine would.

    Mirrors ``EngineCore._initialize_kv_caches`` on what the scheduler reads:
    ``cache_config.block_size`` = smallest prefix-cacheable group block size,
    ``cache_config.num_gpu_blocks``, and on the ``KVCacheConfig``:
    ``num_blocks``, ``prefix_cache_retention_interval``, ``hash_block_size``,
    ``cache_hit_alignment_tokens``.  Synchronous scheduling (one batch in
    flight).  ``cpu_bytes_to_use`` is sized for ``num_cpu_chunks`` CPU chunks
    unless ``extra_config`` sets it.  Returns ``(vllm_config, kv_cache_config)``.
    """
    num_blocks = num_gpu_blocks if num_gpu_blocks is not None else kv_cache_config.num_blocks
    model_config = V.ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="float16",
        seed=0,
    )
    cache_config = _cache_config(
        kv_cache_config, enable_prefix_caching, prefix_cache_retention_interval
    )
    scheduler_config = V.SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    transfer_config = _transfer_config(
        connector, connector_module_path, dict(extra_config or {}), kv_load_failure_policy
    )
    vllm_config = V.VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        kv_transfer_config=transfer_config,
        device_config=V.DeviceConfig("cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    resolved = _resolve(kv_cache_config, vllm_config, num_blocks, prefix_cache_retention_interval)
    _size_cpu_tier(vllm_config, resolved, num_cpu_chunks)
    return vllm_config, resolved
