"""Probes: what vLLM answers for nearby variants of a geometry it rejected."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_adapter import vllm_tools_api as V

__all__ = ["error_record", "probes"]


def error_record(exc: BaseException) -> dict[str, str]:
    """An exception as the fixture stores it: ``{"type", "message"}``."""
    return {"type": type(exc).__name__, "message": str(exc)}


def probes(sched_cfg: Any, vllm_config: Any) -> dict[str, Any]:
    """What ``resolve_kv_cache_block_sizes`` answers for nearby variants of a rejected geometry."""
    answers: dict[str, Any] = {}
    saved_unit = vllm_config.cache_config.prefix_match_unit
    try:
        vllm_config.cache_config.prefix_match_unit = None
        sbs, hbs = V.resolve_kv_cache_block_sizes(sched_cfg, vllm_config)
        answers["prefix_match_unit=None"] = {"scheduler_block_size": sbs, "tokens_per_hash": hbs}
    except ValueError as exc:
        answers["prefix_match_unit=None"] = {"error": error_record(exc)}
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
            answers[key] = {"scheduler_block_size": sbs, "tokens_per_hash": hbs}
        except ValueError as exc:
            answers[key] = {"error": error_record(exc)}
    return answers
