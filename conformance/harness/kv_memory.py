"""The worker's KV memory: layers' pages as byte views, and KV-cache configs planned by vLLM.

:class:`LayerPages` is one layer's blocks as bytes (a view into the KV memory)
with the rows the synthetic runner expects there (:mod:`conformance.harness.kv_pattern`).
:func:`with_planned_tensors` and :func:`shrink_kv_cache_config` give a config
``kv_cache_tensors`` from vLLM's own planner (``get_kv_cache_config_from_groups``),
so offsets and strides are what the engine would use.  :func:`unpadded_page_bytes`,
:func:`layer_specs` and :func:`flat_bytes` are what the runner allocates and snapshots with.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from conformance.harness import vllm_harness_api as V
from conformance.harness.kv_pattern import expected_words

__all__ = [
    "LayerPages",
    "flat_bytes",
    "layer_specs",
    "shrink_kv_cache_config",
    "unpadded_page_bytes",
    "with_planned_tensors",
]


@dataclass(eq=False)
class LayerPages:
    """One layer's blocks as bytes: ``pages[b]`` = bytes ``[0, nbytes)`` of block ``b``."""

    name: str
    group_id: int
    tokens_per_block: int
    is_mamba: bool
    nbytes: int
    pages: torch.Tensor
    """uint8 ``[num_blocks, nbytes]`` view into the KV memory (row stride = block stride)."""

    @property
    def data(self) -> torch.Tensor:
        """``pages`` as int64 words when size, stride and address allow, else ``pages``."""
        p = self.pages
        if self.nbytes % 8 == 0 and p.stride(0) % 8 == 0 and p.data_ptr() % 8 == 0:
            return p.view(torch.int64)
        return p

    def rows(self, positions: Sequence[int], hashes: Sequence[int]) -> torch.Tensor:
        """The expected contents of blocks at ``positions``, shaped like ``data`` rows."""
        words = expected_words(
            self.name, positions, hashes, -(-self.nbytes // 8), self.pages.device
        )
        if self.data.dtype == torch.int64:
            return words
        return words.view(torch.uint8)[:, : self.nbytes]


def unpadded_page_bytes(spec: Any) -> int:
    """The layer's real bytes per block (what vLLM's offloading worker copies)."""
    if isinstance(spec, V.AttentionSpec):
        return int(spec.unpadded_page_size_bytes)
    if isinstance(spec, V.MambaSpec):
        return int(dataclasses.replace(spec, page_size_padded=None).page_size_bytes)
    raise ValueError(
        f"the synthetic runner writes attention and Mamba layers only, not {type(spec).__name__}"
    )


def layer_specs(group: Any) -> dict[str, Any]:
    """Layer name -> its KV-cache spec, for one KV-cache group (per layer when uniform-type)."""
    spec = group.kv_cache_spec
    per_layer = spec.kv_cache_specs if isinstance(spec, V.UniformTypeKVCacheSpecs) else {}
    return {name: per_layer.get(name, spec) for name in group.layer_names}


def flat_bytes(storage: Any, device: torch.device) -> torch.Tensor:
    """A 1-D uint8 tensor over a whole untyped storage."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def with_planned_tensors(kv_cache_config: Any, vllm_config: Any, layout: str = "LBHNC") -> Any:
    """A copy of a hand-made ``kv_cache_config`` with ``kv_cache_tensors`` planned by vLLM.

    ``get_kv_cache_config_from_groups`` places the groups as the engine would:
    cache groups overlay each other from byte 0, so one layer of each group
    shares a backing region (vLLM's worker then folds them into one canonical
    tensor with one ref per group).  Sets ``cache_config.kv_cache_layout`` to
    ``layout`` when the config has none.
    """
    cache = vllm_config.cache_config
    if cache.kv_cache_layout is None:
        cache.kv_cache_layout = layout
    groups = kv_cache_config.kv_cache_groups
    probe = V.get_kv_cache_config_from_groups(vllm_config, groups, 1 << 30)
    bytes_per_block = probe.kv_cache_tensors[0].size // probe.num_blocks
    out = copy.deepcopy(kv_cache_config)
    planned = V.get_kv_cache_config_from_groups(
        vllm_config, groups, bytes_per_block * kv_cache_config.num_blocks
    )
    out.kv_cache_tensors = planned.kv_cache_tensors
    return out


def shrink_kv_cache_config(
    kv_cache_config: Any, vllm_config: Any, num_blocks: int, like: Any | None = None
) -> Any:
    """``kv_cache_config`` re-planned by vLLM for ``num_blocks`` blocks.

    ``kv_cache_tensors`` come from vLLM's own planner
    (``get_kv_cache_config_from_groups``, the function that produced the
    original), so offsets and strides are what the engine would use at that
    size; the resolved fields (``hash_block_size``, retention, alignment, ...)
    are kept.  With ``like`` (another view of the same engine, e.g. the
    scheduler view) the tensors are copied onto a copy of ``like`` instead.
    """
    if like is not None:
        out = copy.deepcopy(like)
        out.num_blocks = num_blocks
        out.kv_cache_tensors = copy.deepcopy(kv_cache_config.kv_cache_tensors)
        return out
    out = copy.deepcopy(kv_cache_config)
    out.num_blocks = num_blocks
    if not kv_cache_config.kv_cache_tensors:
        return out
    total = kv_cache_config.kv_cache_tensors[0].size
    bytes_per_block = total // kv_cache_config.num_blocks
    planned = V.get_kv_cache_config_from_groups(
        vllm_config, kv_cache_config.kv_cache_groups, bytes_per_block * num_blocks
    )
    if planned.num_blocks != num_blocks:
        raise ValueError(
            f"vLLM planned {planned.num_blocks} blocks for {bytes_per_block * num_blocks} bytes, "
            f"not {num_blocks}"
        )
    out.kv_cache_tensors = planned.kv_cache_tensors
    return out
