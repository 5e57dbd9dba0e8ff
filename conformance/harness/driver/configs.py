"""Synthetic ``KVCacheConfig`` s: hand-made hybrid layouts over the tiny Llama model.

Every group's page (block) is :data:`PAGE_BYTES` bytes, as vLLM's hybrid
allocator requires (one shared block pool); head sizes are derived from it.
The configs carry no ``kv_cache_tensors``: the scheduler needs none, and
:class:`conformance.harness.kvdata.SyntheticModelRunner` allocates one tensor per layer.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from conformance.harness import vllm_harness_api as V
from vllm_adapter.fixtures import MODELS_DIR

TINY_LLAMA = MODELS_DIR / "tiny-llama"
"""A ``config.json``-only Llama dir: the model the synthetic KV configs pretend to serve."""

DTYPE = torch.float16
ELEMENT_BYTES = 2
PAGE_BYTES = 4096
"""Bytes of one block of every group."""


def _attn_kwargs(tokens_per_block: int) -> dict[str, Any]:
    # page = 2 (K and V) * tokens_per_block * heads * head_size * elem
    num_kv_heads = 1
    head_size = PAGE_BYTES // (2 * tokens_per_block * num_kv_heads * ELEMENT_BYTES)
    if head_size < 1:
        raise ValueError(f"block_size {tokens_per_block} too large for a {PAGE_BYTES}-byte page")
    return dict(
        block_size=tokens_per_block, num_kv_heads=num_kv_heads, head_size=head_size, dtype=DTYPE
    )


def _group(name: str, spec: Any, *, is_eagle_group: bool = False, num_layers: int = 1) -> Any:
    layers = [f"model.layers.{name}.{i}.attn" for i in range(num_layers)]
    return V.KVCacheGroupSpec(layers, spec, is_eagle_group=is_eagle_group)


def _kv_cache_config(groups: list[Any], num_blocks: int) -> Any:
    return V.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def full_attention_kv_cache_config(block_size: int = 16, num_blocks: int = 1024) -> Any:
    """One full-attention group at ``block_size`` tokens per block."""
    return _kv_cache_config(
        [_group("full", V.FullAttentionSpec(**_attn_kwargs(block_size)))], num_blocks
    )


def full_swa_kv_cache_config(
    full_block_size: int = 64,
    swa_block_size: int = 16,
    sliding_window: int = 128,
    num_blocks: int = 1024,
    *,
    eagle_group: int | None = None,
    extra_retained_tokens: int = 0,
    num_layers: int = 1,
) -> Any:
    """Group 0 full attention, group 1 sliding window (the notes' FA64 + SW128@16).

    ``eagle_group`` marks group 0 or 1 as an EAGLE/MTP draft group;
    ``extra_retained_tokens`` is the window's MTP tail (tokens kept past the window);
    ``num_layers`` layers per group.
    """
    return _kv_cache_config(
        [
            _group(
                "full",
                V.FullAttentionSpec(**_attn_kwargs(full_block_size)),
                is_eagle_group=eagle_group == 0,
                num_layers=num_layers,
            ),
            _group(
                "swa",
                V.SlidingWindowSpec(
                    **_attn_kwargs(swa_block_size),
                    sliding_window=sliding_window,
                    extra_retained_tokens=extra_retained_tokens,
                ),
                is_eagle_group=eagle_group == 1,
                num_layers=num_layers,
            ),
        ],
        num_blocks,
    )


def swa_eagle_kv_cache_config(
    full_block_size: int = 64,
    swa_block_size: int = 16,
    sliding_window: int = 128,
    num_blocks: int = 1024,
) -> Any:
    """FA + one SWA group that is an EAGLE draft group (``is_eagle_group``)."""
    return full_swa_kv_cache_config(
        full_block_size, swa_block_size, sliding_window, num_blocks, eagle_group=1
    )


def two_eagle_swa_kv_cache_config(
    full_block_size: int = 64,
    first_swa: tuple[int, int] = (16, 40),
    second_swa: tuple[int, int] = (8, 4),
    num_blocks: int = 1024,
) -> Any:
    """FA + two sliding-window EAGLE draft groups, each ``(block_size, sliding_window)``.

    vLLM marks every group holding a draft layer (``is_eagle_group``); a drafter with
    windowed layers of two specs, or with two layers of one spec split over the target's
    windowed groups (``layers[i::num_groups]``), has two windowed EAGLE groups.
    """
    swa = [
        _group(
            f"swa{i}",
            V.SlidingWindowSpec(**_attn_kwargs(block), sliding_window=window),
            is_eagle_group=True,
        )
        for i, (block, window) in enumerate((first_swa, second_swa))
    ]
    full = _group("full", V.FullAttentionSpec(**_attn_kwargs(full_block_size)))
    return _kv_cache_config([full, *swa], num_blocks)


def swa_mtp_kv_cache_config(
    full_block_size: int = 64,
    swa_block_size: int = 16,
    sliding_window: int = 32,
    extra_retained_tokens: int = 2,
    num_blocks: int = 1024,
) -> Any:
    """FA + one SWA group whose window retains ``extra_retained_tokens`` more (MTP)."""
    return full_swa_kv_cache_config(
        full_block_size, swa_block_size, sliding_window, num_blocks,
        extra_retained_tokens=extra_retained_tokens,
    )


def full_swa_two_layer_kv_cache_config(num_blocks: int = 1024) -> Any:
    """FA64 + SW128@16 with two layers per group (several canonical tensors per slot)."""
    return full_swa_kv_cache_config(64, 16, 128, num_blocks, num_layers=2)


def full_padded_swa_kv_cache_config(num_blocks: int = 1024) -> Any:
    """FA64 + SW128@16 whose window layer's real page is half of :data:`PAGE_BYTES`,
    padded to it (``page_size_padded``): the worker must copy the real page only."""
    real = _attn_kwargs(16)
    real["head_size"] //= 2
    swa = V.SlidingWindowSpec(**real, sliding_window=128, page_size_padded=PAGE_BYTES)
    full = _group("full", V.FullAttentionSpec(**_attn_kwargs(64)))
    return _kv_cache_config([full, _group("swa", swa)], num_blocks)


def _unequal_pages_specs() -> dict[str, Any]:
    big = _attn_kwargs(16)
    small = {**big, "head_size": big["head_size"] // 2}
    return {"model.layers.full.0.attn": V.FullAttentionSpec(**big),
            "model.layers.full.1.attn": V.FullAttentionSpec(**small)}


def unequal_pages_kv_cache_config(num_blocks: int = 1024) -> Any:
    """The scheduler's view of one full-attention group (16 tokens a block) of two
    layers whose pages differ (:data:`PAGE_BYTES` and half of it); the workers get
    :func:`unequal_pages_worker_view` (a chunk slot's tensors have unequal pages)."""
    specs = _unequal_pages_specs()
    first = next(iter(specs.values()))
    return _kv_cache_config([V.KVCacheGroupSpec(list(specs), first)], num_blocks)


def unequal_pages_worker_view(kv_cache_config: Any) -> Any:
    """``kv_cache_config`` (resolved) with the group's layers merged as vLLM merges them
    for the workers (``UniformTypeKVCacheSpecs``, each layer its own page)."""
    out = copy.deepcopy(kv_cache_config)
    specs = _unequal_pages_specs()
    group = out.kv_cache_groups[0]
    out.kv_cache_groups[0] = V.KVCacheGroupSpec(
        group.layer_names, V.UniformTypeKVCacheSpecs.from_specs(specs))
    return out


def full_mamba_align_kv_cache_config(
    full_block_size: int = 64, mamba_block_size: int = 64, num_blocks: int = 1024
) -> Any:
    """Group 0 full attention, group 1 Mamba in ``align`` cache mode."""
    # One state tensor whose size fills the page exactly.
    state = (PAGE_BYTES // ELEMENT_BYTES,)
    mamba = V.MambaSpec(
        block_size=mamba_block_size,
        shapes=(state,),
        dtypes=(DTYPE,),
        mamba_cache_mode="align",
    )
    full = _group("full", V.FullAttentionSpec(**_attn_kwargs(full_block_size)))
    return _kv_cache_config([full, _group("mamba", mamba)], num_blocks)
