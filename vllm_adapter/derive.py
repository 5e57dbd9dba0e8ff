"""Derive KV-cache geometry fixtures by running the installed vLLM's own planning on CPU.

One set per vLLM release (0.33.0, 0.34.0): see :mod:`vllm_adapter.fixtures`.

:func:`derive` builds, for one recipe in :data:`RECIPES`:

1. a real ``VllmConfig`` (``ModelConfig`` from a ``config.json``-only dir under
   ``vllm_adapter/models``, the recipe's engine args, the stock
   ``OffloadingConnector`` as KV-transfer config);
2. the per-layer ``KVCacheSpec``\\ s of one TP rank:

   * **model recipes**: the model's KV-cache layers are instantiated the way the
     model's ``__init__`` would at that TP size (real vLLM layer classes where
     they can be built on CPU, stand-ins carrying the attributes
     ``get_kv_cache_spec`` reads where they cannot), registered in
     ``static_forward_context`` in construction order; vLLM's
     ``Platform.update_block_size_for_backend`` then runs (as the executor does
     after ``load_model``), and the GPU model runner's own ``get_kv_cache_spec``
     collects the specs (``get_kv_cache_spec`` of each layer +
     ``customize_attention_spec`` with the layer's backend);
   * **synthetic recipes**: hand-built with vLLM's spec classes, passed through
     ``customize_attention_spec`` with ``FlashAttentionBackend``;

3. vLLM's engine-core KV-cache init, unmodified: ``EngineCore._initialize_kv_caches``
   called unbound on a stand-in engine core whose executor reports those specs
   for every TP rank and an assumed per-GPU KV budget.  That runs
   ``resolve_kv_cache_layout``, ``get_global_kv_cache_groups`` (grouping, page
   unification, packing), ``get_kv_cache_configs``,
   ``generate_scheduler_kv_cache_config``, the ``cache_config.block_size``
   update, ``resolve_kv_cache_block_sizes`` and
   ``resolve_cache_hit_alignment_tokens``;

4. the result, serialized with :mod:`vllm_adapter.fixtures`' codec.

Every deviation from a GPU host is listed in the fixture's ``provenance`` and
``cpu_patches`` fields; the platform patch is scoped to the ``VllmConfig``
construction (:func:`vllm_adapter.fixtures.cpu_platform_patches`).
``num_blocks`` depends only on the assumed KV budget (40 GiB per GPU for Gemma,
60 GiB for DeepSeek-V4, 1 GiB for the synthetic ones): illustrative only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from vllm_adapter import vllm_api as V
from vllm_adapter.fixtures import (
    MODELS_DIR,
    SCHEMA_VERSION,
    _kv_transfer_config,
    _spec_map,
    encode_kv_cache_config,
    engine_vllm_config,
)

__all__ = ["RECIPES", "Derivation", "Recipe", "derive", "derive_live"]

GiB = 1 << 30

# The KV-transfer config used while deriving: the stock connector, as in the
# notes.  Its extra config does not influence the geometry; only its requested
# KV-cache layout (LBHNC) does, through resolve_kv_cache_layout.
_DERIVE_EXTRA_CONFIG = {"blocks_per_chunk": 1}


@dataclass(frozen=True)
class Recipe:
    """How to derive one fixture: the engine args and where the layer specs come from."""

    name: str
    model_dir: str
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
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "CPUOffloadingSpec",
                "cpu_bytes_to_use": GiB,
                **_DERIVE_EXTRA_CONFIG,
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

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
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
            description="FullAttentionSpec 64 tokens/block + SlidingWindowSpec(window 128) 16 tokens/block",
            block_size=64,
            synthetic_layers=_synthetic_full_swa,
        ),
        Recipe(
            name="synthetic-full-mamba-align",
            model_dir="tiny-hybrid",
            source="synthetic",
            description="FullAttentionSpec + MambaSpec(mamba_cache_mode='align'), both 64 tokens/block",
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
}


# ---------------------------------------------------------------------------
# VllmConfig
# ---------------------------------------------------------------------------


def _build_vllm_config(recipe: Recipe) -> tuple[Any, list[str]]:
    """The engine's ``VllmConfig`` for the recipe, as a GPU host's engine would start with."""
    args = recipe.engine_args()
    kv_transfer_config = _kv_transfer_config(
        _DERIVE_EXTRA_CONFIG,
        connector=args["kv_connector"],
        connector_module_path=None,
        cpu_bytes=GiB,
    )
    return engine_vllm_config(MODELS_DIR / recipe.model_dir, args, kv_transfer_config)


# ---------------------------------------------------------------------------
# Model layers (per TP rank)
# ---------------------------------------------------------------------------


def _gemma4_layers(vllm_config: Any, tp: int) -> tuple[list[str], list[Any]]:
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


def _dsv4_layers(vllm_config: Any, tp: int) -> tuple[list[str], list[Any]]:
    """DeepSeek-V4's KV-cache layers, in ``DeepseekV4Attention.__init__`` registration order.

    Real modules: ``DeepseekV4SWACache``, ``CompressorStateCache`` (attention and
    indexer compressors), ``DeepseekV4IndexerCache``.  The attention layer itself
    (``DeepseekV4FlashMLAAttention``, chosen by vLLM's ``_select_dsv4_attn_cls``)
    needs CUDA streams/events and MoE, so it is an instance of the real class
    created without ``__init__``, carrying only what ``get_kv_cache_spec`` and
    ``get_attn_backend`` read (``compress_ratio``, ``head_dim``,
    ``kv_cache_dtype`` / ``kv_cache_torch_dtype`` from vLLM's
    ``_resolve_dsv4_kv_cache_dtype``), computed as ``__init__`` computes them.
    """
    api = V.load_deepseek_v4_layer_api()
    config = vllm_config.model_config.hf_config
    cache_config = vllm_config.cache_config
    attn_cls = api.select_dsv4_attn_cls(vllm_config)
    context = vllm_config.compilation_config.static_forward_context
    index_head_dim = config.index_head_dim
    quant_block_size = 128  # DeepseekV4Indexer.quant_block_size
    layers: list[Any] = []
    for layer_id in range(config.num_hidden_layers):
        prefix = f"model.layers.{layer_id}.attn"
        compress_ratio = max(1, config.compress_rates.get(config.layer_types[layer_id], 0))
        attn = attn_cls.__new__(attn_cls)
        torch.nn.Module.__init__(attn)
        attn.prefix = prefix
        attn.head_dim = config.head_dim
        attn.window_size = config.sliding_window
        attn.compress_ratio = compress_ratio
        if compress_ratio == 4:  # DeepseekV4Indexer (built first in __init__)
            if api.dsa_indexer_uses_fp4(vllm_config):
                raise ValueError(
                    "DeepSeek-V4 with the MXFP4 indexer cache is not modelled by "
                    "vllm_adapter.derive; plan it with the default fp8 indexer cache"
                )
            layers.append(
                api.DeepseekV4IndexerCache(
                    head_dim=index_head_dim + index_head_dim // quant_block_size * 4,
                    dtype=torch.uint8,
                    prefix=f"{prefix}.indexer.k_cache",
                    cache_config=cache_config,
                    compress_ratio=compress_ratio,
                )
            )
            layers.append(
                api.CompressorStateCache(
                    state_dim=2 * (1 + (compress_ratio == 4)) * index_head_dim,
                    dtype=torch.float32,
                    compress_ratio=compress_ratio,
                    prefix=f"{prefix}.indexer.compressor.state_cache",
                )
            )
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
                api.CompressorStateCache(
                    state_dim=2 * (1 + (compress_ratio == 4)) * attn.head_dim,
                    dtype=torch.float32,
                    compress_ratio=compress_ratio,
                    prefix=f"{prefix}.compressor.state_cache",
                )
            )
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


def _collect_runner_specs(vllm_config: Any) -> tuple[dict[str, Any], str]:
    """The GPU model runner's own ``get_kv_cache_spec`` over ``static_forward_context``."""
    api = V.load_runner_api()
    if V.uses_v2_model_runner(vllm_config):
        return api.v2_get_kv_cache_spec(
            vllm_config
        ), "v2 (vllm.v1.worker.gpu.attn_utils.get_kv_cache_spec)"
    runner = SimpleNamespace(vllm_config=vllm_config, shared_kv_cache_layers={})
    return api.v1_runner_cls().get_kv_cache_spec(runner), "v1 (GPUModelRunner.get_kv_cache_spec)"


# ---------------------------------------------------------------------------
# Engine core stand-in
# ---------------------------------------------------------------------------


class _StandInExecutor:
    """Answers the executor calls ``EngineCore._initialize_kv_caches`` makes."""

    def __init__(self, specs: dict[str, Any], layouts: list[str], tp: int, budget: int) -> None:
        self._specs = specs
        self._layouts = layouts
        self._tp = tp
        self._budget = budget
        self.worker_kv_cache_configs: list[Any] | None = None
        self.layout_set: tuple[str, int] | None = None

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        return [dict(self._specs) for _ in range(self._tp)]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [list(self._layouts) for _ in range(self._tp)]

    def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int) -> None:
        self.layout_set = (layout_name, cp_kv_cache_interleave_size)

    def determine_available_memory(self) -> list[int]:
        return [self._budget] * self._tp

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        self.worker_kv_cache_configs = kv_cache_configs

    def compile_or_warm_up_model(self) -> None:
        return None


class _StandInEngineCore:
    def __init__(self, executor: _StandInExecutor) -> None:
        self.model_executor = executor
        self.available_gpu_memory_for_kv_cache = -1

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return []


# ---------------------------------------------------------------------------
# derive()
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def _current_config(vllm_config: Any) -> Iterator[None]:
    with V.set_current_vllm_config(vllm_config):
        yield


def _group_facts(sched_cfg: Any, worker_cfg: Any, vllm_config: Any) -> list[dict[str, Any]]:
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    facts = []
    for index, (group, worker_group) in enumerate(
        zip(sched_cfg.kv_cache_groups, worker_cfg.kv_cache_groups, strict=True)
    ):
        spec = group.kv_cache_spec
        worker_spec = worker_group.kv_cache_spec
        if isinstance(worker_spec, V.UniformTypeKVCacheSpecs):
            worker_bytes = worker_spec.page_size_bytes
        else:
            worker_bytes = worker_spec.page_size_bytes * len(worker_group.layer_names)
        tokens_per_state = spec.tokens_per_state
        facts.append(
            {
                "index": index,
                "spec_class": type(spec).__name__,
                "worker_spec_class": type(worker_spec).__name__,
                "kind": V.get_kv_cache_spec_kind(spec).value,
                "tokens_per_block": V.resolve_dcp_kv_block_size(spec, dcp),
                "page_size_bytes": spec.page_size_bytes,
                "num_layers": len(group.layer_names),
                "scheduler_bytes_per_block": spec.page_size_bytes * len(group.layer_names),
                "worker_bytes_per_block": worker_bytes,
                "sliding_window": V.get_kv_cache_spec_sliding_window(spec),
                "tokens_per_state": tokens_per_state
                if isinstance(tokens_per_state, int)
                else str(tokens_per_state),
                "prefix_cacheable": spec.prefix_cacheable,
                "enable_kv_transfer": group.enable_kv_transfer,
                "is_eagle_group": group.is_eagle_group,
            }
        )
    return facts


def _error_record(exc: BaseException) -> dict[str, str]:
    return {"type": type(exc).__name__, "message": str(exc)}


@dataclass
class Derivation:
    """A derivation's live vLLM objects next to the fixture dict made from them."""

    fixture: dict[str, Any]
    vllm_config: Any
    layer_specs: dict[str, Any]
    scheduler_kv_cache_config: Any
    worker_kv_cache_configs: list[Any]


def derive(name: str) -> dict[str, Any]:
    """Run vLLM's own KV-cache planning for fixture ``name``; return the fixture dict."""
    return derive_live(name).fixture


def derive_live(name: str) -> Derivation:
    """:func:`derive`, also returning the live vLLM objects (for round-trip checks)."""
    recipe = RECIPES[name]
    tp = recipe.tensor_parallel_size
    provenance: list[str] = [f"vLLM {V.VLLM_VERSION} on CPU; {recipe.description}."]
    vllm_config, platform_patches = _build_vllm_config(recipe)
    cpu_patches = [
        *platform_patches,
        "DeviceConfig(device='cpu'): UnspecifiedPlatform has no device type "
        "(vLLM's own CPU connector tests do the same)",
    ]
    if recipe.language_model_only:
        cpu_patches.append(
            "ModelConfig(language_model_only=True): the vision tower holds no KV cache; set so a "
            "Scheduler can be built without the Gemma-4 multimodal processor/tokenizer"
        )
    cache_config = vllm_config.cache_config
    initial_block_size = cache_config.block_size
    layouts_source: str
    with _current_config(vllm_config):
        if recipe.source == "synthetic":
            assert recipe.synthetic_layers is not None
            gemma = V.load_gemma4_layer_api()
            specs = {
                layer: (
                    _customize(gemma.FlashAttentionBackend, spec)
                    if isinstance(spec, V.AttentionSpec)
                    else spec
                )
                for layer, spec in recipe.synthetic_layers().items()
            }
            runner = "none (synthetic specs)"
            layouts = [
                layout.name
                for layout in V.get_supported_kv_cache_layouts([gemma.FlashAttentionBackend])
            ]
            layouts_source = (
                "FlashAttentionBackend's declaration (none -> vLLM's default preference)"
            )
            block_size_after_backend = cache_config.block_size
            provenance.append(
                "Per-layer specs hand-built with vLLM's spec classes (see vllm_adapter.derive), "
                "passed through customize_attention_spec(FlashAttentionBackend, spec) like the runner."
            )
        else:
            if recipe.source == "gemma4":
                notes, _layers = _gemma4_layers(vllm_config, tp)
            elif recipe.source == "deepseek_v4":
                notes, _layers = _dsv4_layers(vllm_config, tp)
            else:  # pragma: no cover
                raise ValueError(recipe.source)
            provenance.extend(notes)
            V.Platform.update_block_size_for_backend(vllm_config)
            block_size_after_backend = cache_config.block_size
            provenance.append(
                "Platform.update_block_size_for_backend (the base implementation CudaPlatform "
                "inherits) ran on the registered layers, as the executor does after load_model: "
                f"cache_config.block_size {initial_block_size} -> {block_size_after_backend}."
            )
            specs, runner = _collect_runner_specs(vllm_config)
            layouts = V.WorkerBase.get_supported_kv_cache_layouts(
                SimpleNamespace(vllm_config=vllm_config)
            )
            layouts_source = (
                "WorkerBase.get_supported_kv_cache_layouts over the registered layers' backends"
            )
            provenance.append(
                f"Per-layer specs: the GPU model runner's get_kv_cache_spec, {runner}."
            )
            if recipe.source == "gemma4":
                provenance.append(_gemma4_backend_crosscheck(vllm_config, specs, runner))
    if recipe.eagle_draft:
        provenance.append(
            "EAGLE: the draft layer's spec has is_draft=True; is_eagle_group was then set on the "
            "groups with vLLM's own rule from get_global_kv_cache_groups (group.is_eagle_group = "
            "draft layers intersect group.layer_names), because a real SpeculativeConfig needs a "
            "draft model; no speculative_config is set."
        )
    executor = _StandInExecutor(specs, layouts, tp, recipe.kv_budget_bytes_per_gpu)
    core = _StandInEngineCore(executor)
    requested_layout = V.OffloadingConnector.get_required_kvcache_layout(vllm_config)
    provenance.append(
        "EngineCore._initialize_kv_caches (vLLM's, unmodified) was called unbound on a stand-in "
        f"engine core whose executor reports these specs for each of the {tp} TP rank(s), "
        f"supported layouts {layouts} ({layouts_source}) and "
        f"{recipe.kv_budget_bytes_per_gpu // GiB} GiB of KV memory per GPU (assumed; only "
        "num_blocks depends on it)."
    )
    error: dict[str, str] | None = None
    try:
        with _current_config(vllm_config):
            sched_cfg = V.EngineCore._initialize_kv_caches(core, vllm_config)
        worker_cfgs = executor.worker_kv_cache_configs
        assert worker_cfgs is not None and len(worker_cfgs) == tp
    except ValueError as exc:
        # vLLM refuses the geometry in the engine core (e.g. prefix_match_unit that
        # a prefix-cacheable group's block size is not a multiple of).  Record the
        # rejection, and the plan vLLM had made up to that point.
        error = _error_record(exc)
        provenance.append(
            f"EngineCore._initialize_kv_caches raised {error['type']}; the stored KV-cache "
            "configs are re-planned on a fresh VllmConfig by the same vLLM calls the engine core "
            "makes before the failing one (resolve_kv_cache_layout, get_global_kv_cache_groups, "
            "get_kv_cache_configs, generate_scheduler_kv_cache_config, cache_config.block_size "
            "update); hash_block_size / cache_hit_alignment_tokens stay unset."
        )
        vllm_config, _ = _build_vllm_config(recipe)
        sched_cfg, worker_cfgs = _plan_until_resolution(vllm_config, specs, layouts, tp, recipe)
    cache_config = vllm_config.cache_config
    if recipe.eagle_draft:
        draft = {layer for layer, spec in specs.items() if spec.is_draft}
        for cfg in (sched_cfg, *worker_cfgs):
            for group in cfg.kv_cache_groups:
                group.is_eagle_group = not draft.isdisjoint(group.layer_names)
    worker_cfg = worker_cfgs[0]
    worker_same = encode_kv_cache_config(worker_cfg) == encode_kv_cache_config(sched_cfg)
    for rank, cfg in enumerate(worker_cfgs[1:], start=1):
        assert encode_kv_cache_config(cfg) == encode_kv_cache_config(worker_cfg), (
            f"rank {rank} differs"
        )

    resolved: dict[str, Any] = {
        "error": error,
        "cache_config_block_size_initial": initial_block_size,
        "cache_config_block_size_after_backend": block_size_after_backend,
        "cache_config_block_size": cache_config.block_size,
        "cache_dtype": cache_config.cache_dtype,
        "num_blocks": sched_cfg.num_blocks,
        "kv_tp_replicas": sched_cfg.kv_tp_replicas,
    }
    if error is None:
        scheduler_block_size, tokens_per_hash = V.resolve_kv_cache_block_sizes(
            sched_cfg, vllm_config
        )
        alignment = V.resolve_cache_hit_alignment_tokens(
            sched_cfg, vllm_config, scheduler_block_size, tokens_per_hash
        )
        assert sched_cfg.hash_block_size == tokens_per_hash
        assert sched_cfg.cache_hit_alignment_tokens == alignment
        resolved.update(
            scheduler_block_size=scheduler_block_size,
            tokens_per_hash=tokens_per_hash,
            cache_hit_alignment_tokens=alignment,
        )
    else:
        resolved.update(
            scheduler_block_size=None, tokens_per_hash=None, cache_hit_alignment_tokens=None
        )
    resolved["groups"] = _group_facts(sched_cfg, worker_cfg, vllm_config)
    resolved["offloaded_group_ids"] = list(V.get_offloading_group_ids(sched_cfg))
    probes = _probes(recipe, sched_cfg, vllm_config) if error is not None else None

    fixture = {
        "schema_version": SCHEMA_VERSION,
        "name": recipe.name,
        "description": recipe.description,
        "model_dir": recipe.model_dir,
        "vllm_version": V.VLLM_VERSION,
        "engine_args": recipe.engine_args(),
        "kv_budget_bytes_per_gpu": recipe.kv_budget_bytes_per_gpu,
        "provenance": provenance,
        "cpu_patches": cpu_patches,
        "runner": runner,
        "use_v2_model_runner": V.uses_v2_model_runner(vllm_config),
        "use_mla": bool(vllm_config.model_config.use_mla),
        "distributed_executor_backend": str(
            vllm_config.parallel_config.distributed_executor_backend
        ),
        "supported_kv_cache_layouts": list(layouts),
        "connector_requested_layout": requested_layout,
        "kv_cache_layout": cache_config.kv_cache_layout,
        "resolved": resolved,
        "probes": probes,
        "layer_specs": _spec_map(specs),
        "scheduler_kv_cache_config": encode_kv_cache_config(sched_cfg),
        "worker_view_same_as_scheduler": worker_same,
        "worker_kv_cache_config": None if worker_same else encode_kv_cache_config(worker_cfg),
    }
    return Derivation(
        fixture=fixture,
        vllm_config=vllm_config,
        layer_specs=specs,
        scheduler_kv_cache_config=sched_cfg,
        worker_kv_cache_configs=list(worker_cfgs),
    )


def _customize(backend: Any, spec: Any) -> Any:
    """The runner's ``customize_attention_spec`` (backend packing + kernel-block alignment)."""
    return V.load_runner_api().customize_attention_spec(backend, spec)


def _gemma4_backend_crosscheck(vllm_config: Any, specs: dict[str, Any], runner: str) -> str:
    """Re-collect the specs with TRITON_ATTN (the other Hopper choice); report whether equal."""
    api = V.load_gemma4_layer_api()
    layers = V.get_layers_from_vllm_config(vllm_config, api.Attention)
    saved = {name: layer.attn_backend for name, layer in layers.items()}
    try:
        for layer in layers.values():
            layer.attn_backend = api.TritonAttentionBackend
        with _current_config(vllm_config):
            triton_specs, _ = _collect_runner_specs(vllm_config)
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


def _plan_until_resolution(
    vllm_config: Any, specs: dict[str, Any], layouts: list[str], tp: int, recipe: Recipe
) -> tuple[Any, list[Any]]:
    """The engine core's planning calls that precede ``resolve_kv_cache_block_sizes``."""
    specs_per_rank = [dict(specs) for _ in range(tp)]
    with _current_config(vllm_config):
        V.resolve_kv_cache_layout(
            vllm_config, [list(layouts)] * tp, [s for d in specs_per_rank for s in d.values()]
        )
        groups = V.get_global_kv_cache_groups(vllm_config, specs_per_rank)
        configs = V.get_kv_cache_configs(
            vllm_config, specs_per_rank, [recipe.kv_budget_bytes_per_gpu] * tp, groups
        )
        for cfg in configs:
            cfg.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
        sched = V.generate_scheduler_kv_cache_config(configs)
        participating = [
            g.kv_cache_spec.block_size
            for g in sched.kv_cache_groups
            if g.kv_cache_spec.prefix_cacheable
        ]
        vllm_config.cache_config.block_size = min(
            participating or [g.kv_cache_spec.block_size for g in sched.kv_cache_groups]
        )
    return sched, configs


def _probes(recipe: Recipe, sched_cfg: Any, vllm_config: Any) -> dict[str, Any]:
    """What ``resolve_kv_cache_block_sizes`` answers for nearby variants of a rejected geometry."""
    probes: dict[str, Any] = {}
    saved_unit = vllm_config.cache_config.prefix_match_unit
    try:
        vllm_config.cache_config.prefix_match_unit = None
        sbs, hbs = V.resolve_kv_cache_block_sizes(sched_cfg, vllm_config)
        probes["prefix_match_unit=None"] = {"scheduler_block_size": sbs, "tokens_per_hash": hbs}
    except ValueError as exc:
        probes["prefix_match_unit=None"] = {"error": _error_record(exc)}
    finally:
        vllm_config.cache_config.prefix_match_unit = saved_unit
    # The small group made non-prefix-cacheable (SlidingWindowMLASpec with
    # bounded_replay=True is the one such sliding spec in 0.33.0 and 0.34.0): excluded from
    # the hash-unit check.
    small = min(
        range(len(sched_cfg.kv_cache_groups)),
        key=lambda i: sched_cfg.kv_cache_groups[i].kv_cache_spec.block_size,
    )
    variant = dataclasses.replace(sched_cfg, kv_cache_groups=list(sched_cfg.kv_cache_groups))
    group = variant.kv_cache_groups[small]
    spec = group.kv_cache_spec
    if isinstance(spec, V.SlidingWindowSpec):
        replay_spec = V.SlidingWindowMLASpec(
            block_size=spec.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            dtype=spec.dtype,
            sliding_window=spec.sliding_window,
            bounded_replay=True,
            model_version="deepseek_v4",
        )
        variant.kv_cache_groups[small] = V.KVCacheGroupSpec(list(group.layer_names), replay_spec)
        key = f"group {small} not prefix-cacheable (SlidingWindowMLASpec bounded_replay=True)"
        try:
            sbs, hbs = V.resolve_kv_cache_block_sizes(variant, vllm_config)
            probes[key] = {"scheduler_block_size": sbs, "tokens_per_hash": hbs}
        except ValueError as exc:
            probes[key] = {"error": _error_record(exc)}
    return probes
