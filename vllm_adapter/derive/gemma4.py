"""Gemma-4's KV-cache layers at one TP rank: real vLLM ``Attention`` modules, built on CPU."""

from __future__ import annotations

from typing import Any

from vllm_adapter import vllm_tools_api as V
from vllm_adapter.derive.engine import collect_runner_specs, current_config

__all__ = ["gemma4_backend_crosscheck", "gemma4_layers"]


def gemma4_layers(vllm_config: Any, tp: int) -> tuple[list[str], list[Any]]:
    """Gemma-4's attention layers as ``Gemma4Attention.__init__`` builds them at TP=``tp``.

    Real ``vllm...attention.Attention`` modules, constructed with the arguments
    ``Gemma4Attention`` passes (heads / KV heads divided by TP exactly as it
    does, per-layer head_dim / KV heads from ``per_layer_config``, the sliding
    window on sliding layers) and ``attn_backend=FlashAttentionBackend`` -- the
    backend a Hopper GPU gets (FA3, or FA4 picked by
    ``Gemma4Config.verify_and_update_config``).  The surrounding
    ``Gemma4Attention`` (projections, norms, RoPE) needs TP process groups and
    holds no KV cache, so it is not built.
    """
    api = V.load_gemma4_layer_api()
    model_config = vllm_config.model_config
    text = model_config.hf_text_config
    is_mm = "Gemma4ForConditionalGeneration" in (model_config.architectures or [])
    prefix_root = "language_model.model.layers" if is_mm else "model.layers"
    assert int(getattr(text, "num_kv_shared_layers", 0) or 0) == 0, "KV-shared layers not modelled"
    total_heads = text.num_attention_heads
    assert total_heads % tp == 0
    layers = []
    for i, layer_type in enumerate(text.layer_types):
        layer_config = text.per_layer_config[i]
        total_kv = layer_config.num_key_value_heads
        if total_kv >= tp:
            assert total_kv % tp == 0
        else:
            assert tp % total_kv == 0
        is_sliding = layer_type == "sliding_attention"
        layers.append(
            api.Attention(
                total_heads // tp,
                layer_config.head_dim,
                1.0,
                num_kv_heads=max(1, total_kv // tp),
                cache_config=vllm_config.cache_config,
                quant_config=None,
                logits_soft_cap=getattr(text, "attn_logit_softcapping", None),
                per_layer_sliding_window=text.sliding_window if is_sliding else None,
                kv_sharing_target_layer_name=None,
                mm_prefix_clamp_sliding_window=is_sliding,
                prefix=f"{prefix_root}.{i}.self_attn.attn",
                attn_backend=api.FlashAttentionBackend,
            )
        )
    notes = [
        f"Layers: {len(layers)} real vllm Attention modules built with the arguments "
        f"Gemma4Attention.__init__ passes at TP={tp} (heads {total_heads}//{tp}, KV heads "
        "max(1, per_layer_config[i].num_key_value_heads//TP), head_dim from per_layer_config, "
        "sliding_window on sliding layers), attn_backend=FlashAttentionBackend (what a Hopper GPU "
        "selects: FA3/FA4). Gemma4Attention's projections/norms/RoPE (no KV cache, need TP groups) "
        "were not built.",
    ]
    return notes, layers


def gemma4_backend_crosscheck(vllm_config: Any, specs: dict[str, Any]) -> str:
    """Re-collect the specs with TRITON_ATTN (the other Hopper choice); report whether equal."""
    api = V.load_gemma4_layer_api()
    layers = V.get_layers_from_vllm_config(vllm_config, api.Attention)
    saved = {name: layer.attn_backend for name, layer in layers.items()}
    try:
        for layer in layers.values():
            layer.attn_backend = api.TritonAttentionBackend
        with current_config(vllm_config):
            triton_specs, _ = collect_runner_specs(vllm_config)
    finally:
        for name, layer in layers.items():
            layer.attn_backend = saved[name]
    same = triton_specs == specs
    cpu_choice = vllm_config.attention_config.backend
    return (
        "Cross-check: the same layers with attn_backend=TritonAttentionBackend give "
        f"{'identical' if same else 'DIFFERENT'} per-layer specs. (vLLM's own config resolution on "
        f"this host set attention_config.backend={getattr(cpu_choice, 'name', cpu_choice)} because "
        "FA4 is unavailable here.)"
    )
