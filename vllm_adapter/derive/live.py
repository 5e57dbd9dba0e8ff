"""The derivation's steps (see :mod:`vllm_adapter.derive`): one recipe in, one fixture out.

:func:`derive_live` runs them in order: the engine's ``VllmConfig``
(:func:`_engine_config`), the per-layer specs one rank reports
(:func:`_collect_specs`), vLLM's KV-cache planning (:func:`_plan`), the values
vLLM resolves from the plan (:func:`_resolved`), and the fixture dict
(:func:`_fixture`).  Every step appends what it did to the fixture's provenance.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from vllm_adapter import vllm_tools_api as V
from vllm_adapter.codec import (
    MODELS_DIR,
    SCHEMA_VERSION,
    encode_kv_cache_config,
    encode_spec_map,
    engine_vllm_config,
    kv_transfer_config,
)
from vllm_adapter.derive.dsv4 import dsv4_layers
from vllm_adapter.derive.engine import (
    WorkerReport,
    collect_runner_specs,
    current_config,
    customize_attention_spec,
    initialize_kv_caches,
    plan_until_resolution,
)
from vllm_adapter.derive.gemma4 import gemma4_backend_crosscheck, gemma4_layers
from vllm_adapter.derive.probes import error_record, probes
from vllm_adapter.derive.recipes import DERIVE_EXTRA_CONFIG, RECIPES, GiB, Recipe
from vllm_adapter.names import STOCK_CONNECTOR

__all__ = ["Derivation", "derive", "derive_live"]


@dataclass(frozen=True)
class Derivation:
    """A derivation's live vLLM objects next to the fixture dict made from them."""

    fixture: dict[str, Any]
    vllm_config: Any
    layer_specs: dict[str, Any]
    scheduler_kv_cache_config: Any
    worker_kv_cache_configs: list[Any]


@dataclass(frozen=True)
class _Collected:
    """The per-layer specs one rank reports, and how they were obtained."""

    specs: dict[str, Any]
    runner: str
    layouts: list[str]
    layouts_source: str
    block_size_after_backend: int
    notes: list[str]


@dataclass(frozen=True)
class _Plan:
    """vLLM's KV-cache plan: the scheduler view, each rank's worker view, any rejection."""

    vllm_config: Any  # a fresh one when the engine core rejected the geometry
    scheduler: Any
    workers: list[Any]
    error: dict[str, str] | None
    notes: list[str]


def derive(name: str) -> dict[str, Any]:
    """Run vLLM's own KV-cache planning for the stored fixture ``name``; return its dict."""
    return derive_live(RECIPES[name]).fixture


def derive_live(recipe: Recipe) -> Derivation:
    """Run vLLM's own KV-cache planning for ``recipe``; the fixture and the live objects."""
    vllm_config, platform_patches = _engine_config(recipe)
    initial_block_size = vllm_config.cache_config.block_size
    with current_config(vllm_config):
        collected = _collect_specs(recipe, vllm_config, initial_block_size)
    report = WorkerReport(
        specs=collected.specs,
        layouts=collected.layouts,
        tensor_parallel_size=recipe.tensor_parallel_size,
        kv_budget_bytes_per_gpu=recipe.kv_budget_bytes_per_gpu,
    )
    requested_layout = V.OffloadingConnector.get_required_kvcache_layout(vllm_config)
    plan = _plan(recipe, vllm_config, report)
    if recipe.eagle_draft:
        _mark_eagle_groups(collected.specs, [plan.scheduler, *plan.workers])
    provenance = [
        f"vLLM {V.VLLM_VERSION} on CPU; {recipe.description}.",
        *collected.notes,
        *_eagle_notes(recipe),
        _engine_core_note(recipe, collected),
        *plan.notes,
    ]
    resolved = _resolved(plan, initial_block_size, collected.block_size_after_backend)
    fixture = _fixture(
        recipe,
        plan,
        collected,
        provenance=provenance,
        cpu_patches=_cpu_patches(recipe, platform_patches),
        resolved=resolved,
        requested_layout=requested_layout,
    )
    return Derivation(
        fixture=fixture,
        vllm_config=plan.vllm_config,
        layer_specs=collected.specs,
        scheduler_kv_cache_config=plan.scheduler,
        worker_kv_cache_configs=plan.workers,
    )


# ---------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------


def _engine_config(recipe: Recipe) -> tuple[Any, list[str]]:
    """The engine's ``VllmConfig`` for the recipe, as a GPU host's engine would start with."""
    transfer_config = kv_transfer_config(
        DERIVE_EXTRA_CONFIG,
        connector=STOCK_CONNECTOR,
        connector_module_path=None,
        cpu_bytes=GiB,
    )
    return engine_vllm_config(MODELS_DIR / recipe.model_dir, recipe.engine_args(), transfer_config)


def _cpu_patches(recipe: Recipe, platform_patches: list[str]) -> list[str]:
    patches = [
        *platform_patches,
        "DeviceConfig(device='cpu'): UnspecifiedPlatform has no device type "
        "(vLLM's own CPU connector tests do the same)",
    ]
    if recipe.language_model_only:
        patches.append(
            "ModelConfig(language_model_only=True): the vision tower holds no KV cache; set so a "
            "Scheduler can be built without the Gemma-4 multimodal processor/tokenizer"
        )
    return patches


def _collect_specs(recipe: Recipe, vllm_config: Any, initial_block_size: int) -> _Collected:
    """The per-layer specs one rank reports (call under :func:`current_config`)."""
    if recipe.source == "synthetic":
        return _synthetic_specs(recipe, vllm_config)
    if recipe.source == "gemma4":
        notes, _layers = gemma4_layers(vllm_config, recipe.tensor_parallel_size)
    elif recipe.source == "deepseek_v4":
        notes, _layers = dsv4_layers(vllm_config, recipe.tensor_parallel_size)
    else:
        raise ValueError(
            f"recipe {recipe.name!r}: source must be 'synthetic', 'gemma4' or 'deepseek_v4', "
            f"got {recipe.source!r}"
        )
    V.Platform.update_block_size_for_backend(vllm_config)
    block_size_after_backend = vllm_config.cache_config.block_size
    notes.append(
        "Platform.update_block_size_for_backend (the base implementation CudaPlatform "
        "inherits) ran on the registered layers, as the executor does after load_model: "
        f"cache_config.block_size {initial_block_size} -> {block_size_after_backend}."
    )
    specs, runner = collect_runner_specs(vllm_config)
    notes.append(f"Per-layer specs: the GPU model runner's get_kv_cache_spec, {runner}.")
    if recipe.source == "gemma4":
        notes.append(gemma4_backend_crosscheck(vllm_config, specs))
    return _Collected(
        specs=specs,
        runner=runner,
        layouts=V.WorkerBase.get_supported_kv_cache_layouts(
            SimpleNamespace(vllm_config=vllm_config)
        ),
        layouts_source=(
            "WorkerBase.get_supported_kv_cache_layouts over the registered layers' backends"
        ),
        block_size_after_backend=block_size_after_backend,
        notes=notes,
    )


def _synthetic_specs(recipe: Recipe, vllm_config: Any) -> _Collected:
    """Hand-built specs, through ``customize_attention_spec`` with ``FlashAttentionBackend``."""
    assert recipe.synthetic_layers is not None, recipe.name
    backend = V.load_gemma4_layer_api().FlashAttentionBackend
    specs = {
        layer: (
            customize_attention_spec(backend, spec) if isinstance(spec, V.AttentionSpec) else spec
        )
        for layer, spec in recipe.synthetic_layers().items()
    }
    return _Collected(
        specs=specs,
        runner="none (synthetic specs)",
        layouts=[layout.name for layout in V.get_supported_kv_cache_layouts([backend])],
        layouts_source="FlashAttentionBackend's declaration (none -> vLLM's default preference)",
        block_size_after_backend=vllm_config.cache_config.block_size,
        notes=[
            "Per-layer specs hand-built with vLLM's spec classes (see vllm_adapter.derive), "
            "passed through customize_attention_spec(FlashAttentionBackend, spec) like the runner."
        ],
    )


def _eagle_notes(recipe: Recipe) -> list[str]:
    if not recipe.eagle_draft:
        return []
    return [
        "EAGLE: the draft layer's spec has is_draft=True; is_eagle_group was then set on the "
        "groups with vLLM's own rule from get_global_kv_cache_groups (group.is_eagle_group = "
        "draft layers intersect group.layer_names), because a real SpeculativeConfig needs a "
        "draft model; no speculative_config is set."
    ]


def _engine_core_note(recipe: Recipe, collected: _Collected) -> str:
    return (
        "EngineCore._initialize_kv_caches (vLLM's, unmodified) was called unbound on a stand-in "
        f"engine core whose executor reports these specs for each of the "
        f"{recipe.tensor_parallel_size} TP rank(s), supported layouts {collected.layouts} "
        f"({collected.layouts_source}) and {recipe.kv_budget_bytes_per_gpu // GiB} GiB of KV "
        "memory per GPU (assumed; only num_blocks depends on it)."
    )


def _plan(recipe: Recipe, vllm_config: Any, report: WorkerReport) -> _Plan:
    """vLLM's engine-core KV-cache init; on a rejection, the plan made up to that point."""
    try:
        scheduler, workers = initialize_kv_caches(vllm_config, report)
        return _Plan(vllm_config, scheduler, workers, error=None, notes=[])
    except ValueError as exc:
        # vLLM refuses the geometry in the engine core (e.g. prefix_match_unit that
        # a prefix-cacheable group's block size is not a multiple of).  Record the
        # rejection, and the plan vLLM had made up to that point.
        error = error_record(exc)
    note = (
        f"EngineCore._initialize_kv_caches raised {error['type']}; the stored KV-cache "
        "configs are re-planned on a fresh VllmConfig by the same vLLM calls the engine core "
        "makes before the failing one (resolve_kv_cache_layout, get_global_kv_cache_groups, "
        "get_kv_cache_configs, generate_scheduler_kv_cache_config, cache_config.block_size "
        "update); hash_block_size / cache_hit_alignment_tokens stay unset."
    )
    fresh_config, _ = _engine_config(recipe)
    scheduler, workers = plan_until_resolution(fresh_config, report)
    return _Plan(fresh_config, scheduler, workers, error=error, notes=[note])


def _mark_eagle_groups(specs: dict[str, Any], kv_cache_configs: list[Any]) -> None:
    """vLLM's rule: a group is an EAGLE group when it holds a draft layer."""
    draft = {layer for layer, spec in specs.items() if spec.is_draft}
    for cfg in kv_cache_configs:
        for group in cfg.kv_cache_groups:
            group.is_eagle_group = not draft.isdisjoint(group.layer_names)


# ---------------------------------------------------------------------------
# What vLLM resolves from the plan, and the fixture
# ---------------------------------------------------------------------------


def _resolved(
    plan: _Plan, initial_block_size: int, block_size_after_backend: int
) -> dict[str, Any]:
    """The block sizes, hash unit and alignment vLLM resolves, and per-group facts."""
    vllm_config, sched_cfg = plan.vllm_config, plan.scheduler
    cache_config = vllm_config.cache_config
    resolved: dict[str, Any] = {
        "error": plan.error,
        "cache_config_block_size_initial": initial_block_size,
        "cache_config_block_size_after_backend": block_size_after_backend,
        "cache_config_block_size": cache_config.block_size,
        "cache_dtype": cache_config.cache_dtype,
        "num_blocks": sched_cfg.num_blocks,
        "kv_tp_replicas": sched_cfg.kv_tp_replicas,
        "scheduler_block_size": None,
        "tokens_per_hash": None,
        "cache_hit_alignment_tokens": None,
    }
    if plan.error is None:
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
    resolved["groups"] = _group_facts(sched_cfg, plan.workers[0], vllm_config)
    resolved["offloaded_group_ids"] = list(V.get_offloading_group_ids(sched_cfg))
    return resolved


def _group_facts(sched_cfg: Any, worker_cfg: Any, vllm_config: Any) -> list[dict[str, Any]]:
    """One row per KV-cache group: its spec, tokens per block, page and per-block bytes."""
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


def _fixture(
    recipe: Recipe,
    plan: _Plan,
    collected: _Collected,
    *,
    provenance: list[str],
    cpu_patches: list[str],
    resolved: dict[str, Any],
    requested_layout: Any,
) -> dict[str, Any]:
    """The fixture dict, in the stored key order (see :mod:`vllm_adapter.fixtures`)."""
    vllm_config, sched_cfg = plan.vllm_config, plan.scheduler
    scheduler_encoded = encode_kv_cache_config(sched_cfg)
    workers_encoded = [encode_kv_cache_config(cfg) for cfg in plan.workers]
    for rank, encoded in enumerate(workers_encoded[1:], start=1):
        assert encoded == workers_encoded[0], f"rank {rank} differs"
    worker_same = workers_encoded[0] == scheduler_encoded
    return {
        "schema_version": SCHEMA_VERSION,
        "name": recipe.name,
        "description": recipe.description,
        "model_dir": recipe.model_dir,
        "vllm_version": V.VLLM_VERSION,
        "engine_args": recipe.engine_args(),
        "kv_budget_bytes_per_gpu": recipe.kv_budget_bytes_per_gpu,
        "provenance": provenance,
        "cpu_patches": cpu_patches,
        "runner": collected.runner,
        "use_v2_model_runner": V.uses_v2_model_runner(vllm_config),
        "use_mla": bool(vllm_config.model_config.use_mla),
        "distributed_executor_backend": str(
            vllm_config.parallel_config.distributed_executor_backend
        ),
        "supported_kv_cache_layouts": list(collected.layouts),
        "connector_requested_layout": requested_layout,
        "kv_cache_layout": vllm_config.cache_config.kv_cache_layout,
        "resolved": resolved,
        "probes": probes(sched_cfg, vllm_config) if plan.error is not None else None,
        "layer_specs": encode_spec_map(collected.specs),
        "scheduler_kv_cache_config": scheduler_encoded,
        "worker_view_same_as_scheduler": worker_same,
        "worker_kv_cache_config": None if worker_same else workers_encoded[0],
    }
