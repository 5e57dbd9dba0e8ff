"""Recipes: what one fixture is derived from (engine args, and where the layer specs come from).

:data:`RECIPES` holds the stored fixtures' recipes, read-only; a caller with a
recipe of its own (the CLI) passes it straight to
:func:`vllm_adapter.derive.derive_live`.  The synthetic recipes' per-layer specs
are hand-built here with vLLM's spec classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from vllm_adapter import vllm_tools_api as V
from vllm_adapter.names import CPU_SPEC, STOCK_CONNECTOR

__all__ = ["DERIVE_EXTRA_CONFIG", "GiB", "RECIPES", "Recipe"]

GiB = 1 << 30

DERIVE_EXTRA_CONFIG: Mapping[str, Any] = MappingProxyType({"blocks_per_chunk": 1})
"""Extra config of the KV-transfer config used while deriving (the stock connector).

It does not influence the geometry; only the connector's requested KV-cache
layout (LBHNC) does, through ``resolve_kv_cache_layout``.
"""


@dataclass(frozen=True)
class Recipe:
    """How to derive one fixture: the engine args and where the layer specs come from."""

    name: str
    model_dir: str  # relative to vllm_adapter/models, or absolute
    source: str  # "gemma4" | "deepseek_v4" | "synthetic"
    description: str
    tensor_parallel_size: int = 1
    block_size: int | None = None  # None: vLLM's default (backend-resolved)
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    disable_hybrid_kv_cache_manager: bool = False
    language_model_only: bool = False
    prefix_match_unit: int | None = None
    mamba_cache_mode: str | None = None
    max_model_len: int | None = None
    kv_budget_bytes_per_gpu: int = GiB
    synthetic_layers: Callable[[], dict[str, Any]] | None = field(default=None, compare=False)
    eagle_draft: bool = False

    def engine_args(self) -> dict[str, Any]:
        return {
            "tensor_parallel_size": self.tensor_parallel_size,
            "block_size": self.block_size,
            "kv_cache_dtype": self.kv_cache_dtype,
            "enable_prefix_caching": self.enable_prefix_caching,
            "disable_hybrid_kv_cache_manager": self.disable_hybrid_kv_cache_manager,
            "language_model_only": self.language_model_only,
            "prefix_match_unit": self.prefix_match_unit,
            "mamba_cache_mode": self.mamba_cache_mode,
            "max_model_len": self.max_model_len,
            "kv_connector": STOCK_CONNECTOR,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": CPU_SPEC,
                "cpu_bytes_to_use": GiB,
                **DERIVE_EXTRA_CONFIG,
            },
        }


# ---------------------------------------------------------------------------
# Synthetic layer specs (hand-built with vLLM's spec classes)
# ---------------------------------------------------------------------------

_BF16 = torch.bfloat16


def _full(block_size: int, num_kv_heads: int, head_size: int = 64) -> Any:
    return V.FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=_BF16
    )


def _swa(block_size: int, num_kv_heads: int, window: int, head_size: int = 64) -> Any:
    return V.SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=_BF16,
        sliding_window=window,
    )


def _attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _synthetic_full_swa() -> dict[str, Any]:
    # Full: 1 KV head x 64 x bf16 x (K+V) = 256 B/token, 64 tokens -> 16 KiB page.
    # SWA: 4 KV heads = 1 KiB/token, 16 tokens -> 16 KiB page (pages already equal).
    return {_attn(i): (_swa(16, 4, 128) if i % 2 == 0 else _full(64, 1)) for i in range(4)}


def _synthetic_full_mamba_align() -> dict[str, Any]:
    # Mamba state: 16 x 256 fp32 = 16 KiB, the same page as the 64-token full layer.
    layers: dict[str, Any] = {}
    for i in range(4):
        if i % 2 == 0:
            layers[f"model.layers.{i}.mixer"] = V.MambaSpec(
                block_size=64,
                shapes=((16, 256),),
                dtypes=(torch.float32,),
                mamba_cache_mode="align",
            )
        else:
            layers[_attn(i)] = _full(64, 1)
    return layers


def _synthetic_eagle() -> dict[str, Any]:
    layers = {_attn(i): (_swa(16, 4, 128) if i % 2 == 0 else _full(64, 1)) for i in range(8)}
    # One EAGLE draft layer (full attention), flagged the way the runner flags
    # draft layers (spec.is_draft=True; excluded from spec equality).
    layers["drafter.model.layers.0.self_attn.attn"] = dataclasses.replace(
        _full(64, 1), is_draft=True
    )
    return layers


def _synthetic_sub_hash() -> dict[str, Any]:
    # Full: 256 B/token x 16 tokens = 4 KiB; SWA: 1 KiB/token x 4 tokens = 4 KiB.
    return {_attn(i): (_swa(4, 4, 64) if i % 2 == 0 else _full(16, 1)) for i in range(4)}


# ---------------------------------------------------------------------------
# Recipes
# ---------------------------------------------------------------------------

_RECIPES = (
    Recipe(
        name="gemma-4-31B-it-tp2",
        model_dir="gemma-4-31B-it",
        source="gemma4",
        description="google/gemma-4-31B-it, TP=2, default block size, prefix caching + HMA on",
        tensor_parallel_size=2,
        language_model_only=True,
        kv_budget_bytes_per_gpu=40 * GiB,
    ),
    Recipe(
        name="deepseek-v4-flash-tp4",
        model_dir="DeepSeek-V4-Flash",
        source="deepseek_v4",
        description=(
            "deepseek-ai/DeepSeek-V4-Flash, TP=4, --kv-cache-dtype fp8 --block-size 256, "
            "prefix caching + HMA on"
        ),
        tensor_parallel_size=4,
        block_size=256,
        kv_cache_dtype="fp8",
        kv_budget_bytes_per_gpu=60 * GiB,
    ),
    Recipe(
        name="synthetic-full-swa",
        model_dir="tiny-hybrid",
        source="synthetic",
        description=(
            "FullAttentionSpec 64 tokens/block + SlidingWindowSpec(window 128) 16 tokens/block"
        ),
        block_size=64,
        synthetic_layers=_synthetic_full_swa,
    ),
    Recipe(
        name="synthetic-full-mamba-align",
        model_dir="tiny-hybrid",
        source="synthetic",
        description=(
            "FullAttentionSpec + MambaSpec(mamba_cache_mode='align'), both 64 tokens/block"
        ),
        block_size=64,
        mamba_cache_mode="align",
        synthetic_layers=_synthetic_full_mamba_align,
    ),
    Recipe(
        name="synthetic-eagle",
        model_dir="tiny-hybrid",
        source="synthetic",
        description=(
            "FullAttentionSpec 64 tokens/block + SlidingWindowSpec(window 128) 16 tokens/block "
            "+ one EAGLE draft full-attention layer; its group has is_eagle_group=True"
        ),
        block_size=64,
        synthetic_layers=_synthetic_eagle,
        eagle_draft=True,
    ),
    Recipe(
        name="synthetic-sub-hash",
        model_dir="tiny-hybrid",
        source="synthetic",
        description=(
            "FullAttentionSpec 16 tokens/block + SlidingWindowSpec(window 64) 4 tokens/block "
            "under prefix_match_unit=16 (a group smaller than the hash unit)"
        ),
        block_size=16,
        prefix_match_unit=16,
        synthetic_layers=_synthetic_sub_hash,
    ),
)

RECIPES: Mapping[str, Recipe] = MappingProxyType({r.name: r for r in _RECIPES})
"""The stored fixtures' recipes by name (read-only)."""
