"""vLLM's KV-cache metadata -> the reference's :class:`~reference.geometry.Geometry`.

Every number comes from vLLM's own resolvers, never from a re-derivation:

* the offloaded groups: ``get_offloading_group_ids`` (prefix-cacheable,
  transfer-enabled groups; HiSparse indexer groups under HiSparse), in
  ascending original index;
* tokens per block: ``resolve_dcp_kv_block_size`` (attention scaled by DCP,
  Mamba not);
* tokens per hash: ``resolve_kv_cache_block_sizes(...)[1]``;
* the kind: the group's *first layer spec* (``iter_layer_specs``), exactly the
  spec vLLM's ``build_offloading_config`` hands to
  ``get_sliding_window_size_in_chunks`` (:func:`kind_fields_of`; the conformance
  driver describes its traces' groups with it too).

The reference policy of an engine is not derived here: it is the release's
rules (:mod:`vllm_adapter.releases`) with the engine's settings.

``page_bytes`` / ``num_layers`` use the **scheduler view**: ``page_bytes`` is
the (padded) page of the group's first layer spec and ``num_layers`` is
``len(group.layer_names)``.  For every group whose spec is not a
``UniformTypeKVCacheSpecs`` wrapper their product equals vLLM's
``_group_kv_bytes_per_block``; for a wrapper (worker view of DeepSeek-V4) the
worker's real per-block bytes are the sum of the members' pages, which this
view does not reproduce (vLLM's own ``kv_bytes_per_token`` uses the scheduler
view too).

:func:`vllm_blocks_per_chunk` runs vLLM's real ``build_offloading_config``
and turns its rejection into a typed :class:`VllmRejected`, for lanes that
compare vLLM's answer with the reference's.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reference.geometry import Geometry, GroupKind, KVGroup
from vllm_adapter import vllm_api as V

__all__ = [
    "VllmChunking",
    "VllmRejected",
    "geometry_from_vllm",
    "group_kind_fields",
    "kind_fields_of",
    "retention_interval_from",
    "vllm_blocks_per_chunk",
    "with_extra_config",
]


def _describe_vllm_group(index: int, spec: Any, tokens_per_block: int) -> str:
    return f"KV-cache group {index} ({type(spec).__name__}, {tokens_per_block} tokens/block)"


def _first_layer_spec(spec: Any) -> Any:
    """The spec vLLM's offloading config reads a group's window from."""
    return next(iter(V.iter_layer_specs(spec)))


def kind_fields_of(group_spec: Any) -> dict[str, Any] | None:
    """``kind`` plus the kind's extra :class:`KVGroup` fields for one vLLM group spec.

    Read from the group's first layer spec, in the isinstance order of vLLM's
    ``get_sliding_window_size_in_chunks``: sliding window (incl. MLA) first,
    then chunked local, Mamba, full attention (incl. MLA, RSWA, sink,
    hidden-state).  Mamba is ``MAMBA_ALIGN`` when the *group* spec is a
    ``MambaSpec`` in ``align`` mode, the test vLLM's scheduler uses for
    ``requires_cow_source`` and ``resolve_mamba_align_size``.  ``None`` for a
    spec of any other class (vLLM's offloading has no kind for it: it would
    trip ``assert isinstance(spec, FullAttentionSpec)``).
    """
    spec = _first_layer_spec(group_spec)
    if isinstance(spec, V.SlidingWindowSpec):
        return {
            "kind": GroupKind.SLIDING_WINDOW,
            "sliding_window": spec.sliding_window,
            "extra_retained_tokens": spec.extra_retained_tokens,
        }
    if isinstance(spec, V.ChunkedLocalAttentionSpec):
        return {
            "kind": GroupKind.CHUNKED_LOCAL,
            "attention_chunk_size": spec.attention_chunk_size,
        }
    if isinstance(spec, V.MambaSpec):
        align = isinstance(group_spec, V.MambaSpec) and group_spec.mamba_cache_mode == "align"
        return {"kind": GroupKind.MAMBA_ALIGN if align else GroupKind.MAMBA}
    if isinstance(spec, V.FullAttentionSpec):
        return {"kind": GroupKind.FULL}
    return None


def group_kind_fields(index: int, group_spec: Any, tokens_per_block: int) -> dict[str, Any]:
    """:func:`kind_fields_of` for a group vLLM offloads: a ``ValueError`` naming the
    group when the spec has no kind."""
    fields = kind_fields_of(group_spec)
    if fields is not None:
        return fields
    spec = _first_layer_spec(group_spec)
    wrapped = (
        f" (first layer spec of a {type(group_spec).__name__})" if spec is not group_spec else ""
    )
    raise ValueError(
        f"{_describe_vllm_group(index, spec, tokens_per_block)}{wrapped} cannot be offloaded: "
        f"vLLM {V.VLLM_VERSION}'s offloading handles full attention (incl. MLA, sink, RSWA), sliding "
        f"window (incl. sliding-window MLA), chunked-local attention and Mamba groups only."
    )


def geometry_from_vllm(kv_cache_config: Any, vllm_config: Any) -> Geometry:
    """The offloaded groups of ``kv_cache_config`` as the reference sees them.

    Raises ``ValueError`` (naming the group) for a group vLLM's offloading
    cannot handle, and lets vLLM's own ``ValueError`` from
    ``resolve_kv_cache_block_sizes`` (e.g. a bad ``prefix_match_unit``) through.
    An empty geometry (no eligible group) is returned as is; the reference's
    ``resolve`` rejects it with vLLM's message.  ``max_model_len`` is the model
    config's: the reference refuses chunks longer than it.
    """
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    _, tokens_per_hash = V.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    groups: list[KVGroup] = []
    for index in V.get_offloading_group_ids(kv_cache_config):
        group = kv_cache_config.kv_cache_groups[index]
        spec = group.kv_cache_spec
        tokens_per_block = V.resolve_dcp_kv_block_size(spec, dcp)
        fields = group_kind_fields(index, spec, tokens_per_block)
        try:
            groups.append(
                KVGroup(
                    index=index,
                    tokens_per_block=tokens_per_block,
                    page_bytes=_first_layer_spec(spec).page_size_bytes,
                    num_layers=len(group.layer_names),
                    is_eagle=bool(group.is_eagle_group),
                    **fields,
                )
            )
        except ValueError as e:
            raise ValueError(f"{_describe_vllm_group(index, spec, tokens_per_block)}: {e}") from e
    name = ""
    max_model_len: int | None = None
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None:
        name = str(getattr(model_config, "model", "") or "")
        if getattr(model_config, "max_model_len", None) is not None:
            max_model_len = int(model_config.max_model_len)
    return Geometry(groups=tuple(groups), tokens_per_hash=tokens_per_hash, name=name,
                    max_model_len=max_model_len)


def retention_interval_from(vllm_config: Any) -> int | None:
    """``cache_config.prefix_cache_retention_interval``: what vLLM's offloading scheduler reads."""
    return vllm_config.cache_config.prefix_cache_retention_interval


def with_extra_config(vllm_config: Any, extra_config: Mapping[str, Any]) -> Any:
    """A copy of ``vllm_config`` whose ``kv_connector_extra_config`` is ``extra_config``.

    The caller's config is never mutated.  The copy is shallow on purpose: it
    shares every sub-config (cache, parallel, model, scheduler ...) with the
    original, so later engine-side updates (``cache_config.num_gpu_blocks``,
    ``cache_config.block_size``) stay visible; only ``kv_transfer_config`` is a
    new object (``dataclasses.replace``, which keeps ``engine_id`` and every
    other field) holding a new dict.
    """
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        raise ValueError("kv_transfer_config must be set to configure KV offloading.")
    new = copy.copy(vllm_config)
    new.kv_transfer_config = dataclasses.replace(ktc, kv_connector_extra_config=dict(extra_config))
    return new


@dataclass(frozen=True)
class VllmChunking:
    """What vLLM's real ``build_offloading_config`` resolved."""

    blocks_per_chunk: int
    tokens_per_hash: int
    tokens_per_block: dict[int, int]
    """Original group index -> tokens per block."""
    sliding_window_size_in_chunks: dict[int, int | None]
    """Original group index -> window in chunks (``None``: full attention)."""


class VllmRejected(Exception):
    """vLLM refused the configuration; ``kind`` is its exception class name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind
        self.message = message


def vllm_blocks_per_chunk(
    kv_cache_config: Any,
    vllm_config: Any,
    extra_config: Mapping[str, Any] | None = None,
) -> VllmChunking:
    """Run the installed vLLM's ``build_offloading_config`` and report what it resolved.

    ``extra_config`` replaces the config's ``kv_connector_extra_config`` (on a
    copy).  Whatever vLLM raises (its bare ``AssertionError`` on mixed block
    sizes with ``block_size``, its ``ValueError``s, a ``TypeError`` from
    ``int(...)``) comes back as :class:`VllmRejected` with ``kind`` = the class
    name, so callers can compare it with the reference's answer.
    """
    if extra_config is not None:
        vllm_config = with_extra_config(vllm_config, extra_config)
    try:
        config = V.build_offloading_config(vllm_config, kv_cache_config)
    except Exception as e:  # vLLM's verdict, typed for comparison
        raise VllmRejected(type(e).__name__, str(e)) from e
    return VllmChunking(
        blocks_per_chunk=config.cache.blocks_per_chunk,
        tokens_per_hash=config.cache.tokens_per_hash,
        tokens_per_block={g.group_id: g.tokens_per_block for g in config.groups},
        sliding_window_size_in_chunks={
            g.group_id: g.sliding_window_size_in_chunks for g in config.groups
        },
    )
