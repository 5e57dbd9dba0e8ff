"""DeepSeek-V4's KV-cache layers at one TP rank, in ``DeepseekV4Attention.__init__`` order.

Real modules: ``DeepseekV4SWACache``, ``CompressorStateCache`` (attention and
indexer compressors), ``DeepseekV4IndexerCache``.  The attention layer itself
(``DeepseekV4FlashMLAAttention``, chosen by vLLM's ``_select_dsv4_attn_cls``)
needs CUDA streams/events and MoE, so it is an instance of the real class
created without ``__init__``, carrying only what ``get_kv_cache_spec`` and
``get_attn_backend`` read (``compress_ratio``, ``head_dim``,
``kv_cache_dtype`` / ``kv_cache_torch_dtype`` from vLLM's
``_resolve_dsv4_kv_cache_dtype``), computed as ``__init__`` computes them.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_adapter import vllm_tools_api as V

__all__ = ["dsv4_layers"]

_QUANT_BLOCK_SIZE = 128  # DeepseekV4Indexer.quant_block_size


def _compressor_state_cache(api: Any, head_dim: int, compress_ratio: int, prefix: str) -> Any:
    """``CompressorStateCache`` as ``DeepseekCompressor`` builds it (coff = 1 + (ratio == 4))."""
    return api.CompressorStateCache(
        state_dim=2 * (1 + (compress_ratio == 4)) * head_dim,
        dtype=torch.float32,
        compress_ratio=compress_ratio,
        prefix=prefix,
    )


def _indexer_layers(api: Any, vllm_config: Any, compress_ratio: int, prefix: str) -> list[Any]:
    """The ``DeepseekV4Indexer``'s caches (built first in ``DeepseekV4Attention.__init__``)."""
    if api.dsa_indexer_uses_fp4(vllm_config):
        raise ValueError(
            "DeepSeek-V4 with the MXFP4 indexer cache is not modelled by "
            "vllm_adapter.derive; plan it with the default fp8 indexer cache"
        )
    index_head_dim = vllm_config.model_config.hf_config.index_head_dim
    return [
        api.DeepseekV4IndexerCache(
            head_dim=index_head_dim + index_head_dim // _QUANT_BLOCK_SIZE * 4,
            dtype=torch.uint8,
            prefix=f"{prefix}.indexer.k_cache",
            cache_config=vllm_config.cache_config,
            compress_ratio=compress_ratio,
        ),
        _compressor_state_cache(
            api, index_head_dim, compress_ratio, f"{prefix}.indexer.compressor.state_cache"
        ),
    ]


def _decoder_layer(api: Any, vllm_config: Any, attn_cls: Any, layer_id: int) -> list[Any]:
    """One decoder layer's KV-cache modules, the attention stand-in registered in the context."""
    config = vllm_config.model_config.hf_config
    cache_config = vllm_config.cache_config
    context = vllm_config.compilation_config.static_forward_context
    prefix = f"model.layers.{layer_id}.attn"
    compress_ratio = max(1, config.compress_rates.get(config.layer_types[layer_id], 0))
    attn = attn_cls.__new__(attn_cls)
    torch.nn.Module.__init__(attn)
    attn.prefix = prefix
    attn.head_dim = config.head_dim
    attn.window_size = config.sliding_window
    attn.compress_ratio = compress_ratio
    layers: list[Any] = []
    if compress_ratio == 4:
        layers.extend(_indexer_layers(api, vllm_config, compress_ratio, prefix))
    attn.kv_cache_dtype, attn.kv_cache_torch_dtype = api.resolve_dsv4_kv_cache_dtype(
        attn._uses_fp8_ds_mla_layout(), cache_config.cache_dtype, cache_config
    )
    layers.append(
        api.DeepseekV4SWACache(
            head_dim=attn.head_dim,
            window_size=attn.window_size,
            dtype=attn.kv_cache_torch_dtype,
            prefix=f"{prefix}.swa_cache",
            cache_config=cache_config,
            backend_cls=attn_cls.swa_backend_cls,
        )
    )
    assert prefix not in context
    context[prefix] = attn
    layers.append(attn)
    if compress_ratio > 1:  # DeepseekCompressor
        layers.append(
            _compressor_state_cache(
                api, attn.head_dim, compress_ratio, f"{prefix}.compressor.state_cache"
            )
        )
    return layers


def dsv4_layers(vllm_config: Any, tp: int) -> tuple[list[str], list[Any]]:
    """DeepSeek-V4's KV-cache layers (see the module doc) and the provenance notes on them.

    ``tp`` keeps the signature of :func:`~vllm_adapter.derive.gemma4.gemma4_layers`; the
    modules built here do not depend on it.
    """
    api = V.load_deepseek_v4_layer_api()
    config = vllm_config.model_config.hf_config
    attn_cls = api.select_dsv4_attn_cls(vllm_config)
    layers: list[Any] = []
    for layer_id in range(config.num_hidden_layers):
        layers.extend(_decoder_layer(api, vllm_config, attn_cls, layer_id))
    ratios = [layer.compress_ratio for layer in layers if isinstance(layer, attn_cls)]
    notes = [
        f"Attention class: {attn_cls.__name__} from vLLM's _select_dsv4_attn_cls (no device "
        "capability on this host -> the sm90/sm100 default, FlashMLA); "
        f"use_fp8_ds_mla_layout={attn_cls.use_fp8_ds_mla_layout}.",
        f"Layers: {config.num_hidden_layers} decoder layers, compress ratios "
        f"1/4/128 x {ratios.count(1)}/{ratios.count(4)}/{ratios.count(128)} "
        "(compress_ratio = max(1, compress_rates.get(layer_type, 0)), as DeepseekV4Attention).",
        "Real modules: DeepseekV4SWACache (backend_cls=the attention class's swa_backend_cls), "
        "CompressorStateCache (state_dim = 2*coff*head_dim, coff = 1 + (ratio == 4)), "
        "DeepseekV4IndexerCache (FP8 indexer: head_dim 128 + 128//128*4 = 132 B, uint8). "
        f"Stand-in: {attn_cls.__name__} instance created without __init__ (needs CUDA + MoE), "
        "carrying compress_ratio, head_dim and kv_cache_dtype/kv_cache_torch_dtype from the real "
        "_resolve_dsv4_kv_cache_dtype; its real get_kv_cache_spec/get_attn_backend were used. "
        "Registration order per layer: indexer.k_cache, indexer.compressor.state_cache, "
        "swa_cache, attn, compressor.state_cache (DeepseekV4Attention.__init__ order).",
    ]
    return notes, layers
