"""What ``python -m vllm_adapter config`` computes: :class:`Sizing`, typed and frozen.

Field names and order are the keys of the ``--format json`` document
(:meth:`Sizing.to_json`); ``scripts/check_serve_install.py`` and the tests read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "CpuTier",
    "EngineInfo",
    "FileEconomics",
    "GroupRow",
    "KnobInfo",
    "KvTransferConfig",
    "ModelInfo",
    "Sizing",
    "VllmInfo",
]


@dataclass(frozen=True)
class KvTransferConfig:
    """The ``--kv-transfer-config`` to paste."""

    kv_connector: str
    kv_connector_module_path: str
    kv_role: str
    kv_connector_extra_config: dict[str, Any]
    """The knob as given (or the chosen ``blocks_per_chunk``), ``spec_name``,
    ``cpu_bytes_to_use`` when given, ``secondary_tiers`` with ``TieringOffloadingSpec``."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ModelInfo:
    dir: str
    given: str
    """``--model`` as given."""
    architecture: str
    language_model_only: bool
    tensor_parallel_size: int


@dataclass(frozen=True)
class EngineInfo:
    """vLLM's engine flags as planned (``None``: vLLM's default)."""

    flags: str
    """The flags as vLLM's CLI spells them."""
    block_size: int | None
    kv_cache_dtype: str
    hybrid_kv_cache_manager: bool
    prefix_match_unit: int | None
    mamba_cache_mode: str | None
    max_model_len: int | None
    prefix_cache_retention_interval: int


@dataclass(frozen=True)
class VllmInfo:
    """What the installed vLLM's planning resolved."""

    version: str
    cache_block_size: int
    resolved_cache_dtype: str
    scheduler_block_size: int
    tokens_per_hash: int
    num_kv_cache_groups: int
    offloaded_group_ids: tuple[int, ...]


@dataclass(frozen=True)
class KnobInfo:
    given: dict[str, int]
    """``block_size`` / ``blocks_per_chunk`` / ``chunk_bytes`` as given; empty if none."""
    blocks_per_chunk: int
    alignment_tokens: int | None


@dataclass(frozen=True)
class CpuTier:
    """vLLM's CPU tier: one page-aligned slot per chunk key, for all rank copies."""

    spec_name: str
    worker_kv_bytes_per_block: int
    world_size: int
    replicated_layout: bool
    copies: int
    chunk_bytes_per_worker: int
    page_alignment: int
    slot_bytes: int
    cpu_bytes_to_use: int | None
    num_chunks: int | None
    """``cpu_bytes_to_use // slot_bytes``; ``None`` without ``--cpu-bytes``."""


@dataclass(frozen=True)
class GroupRow:
    """One offloaded KV-cache group."""

    index: int
    kind: str
    vllm_spec: str
    sliding_window: int | None
    attention_chunk_size: int | None
    is_eagle: bool
    tokens_per_block: int
    blocks_per_chunk: int
    tokens_per_chunk: int
    window_in_chunks: int | None
    group_bytes_per_block: int
    group_bytes_per_chunk: int
    """What this group's layers fill of a chunk, per worker."""
    chunk_bytes_per_worker: int
    chunks_per_gib: float | None
    files_per_million_tokens: float
    """``1e6 / tokens_per_chunk``: the fs tier writes one file per chunk of this group."""


@dataclass(frozen=True)
class FileEconomics:
    """Files vLLM's fs tier (``TieringOffloadingSpec``, ``type: fs``) writes for this knob.

    One file per chunk per offloaded group, each one CPU-tier chunk slot (all rank
    copies, page-aligned: :attr:`CpuTier.slot_bytes`), whichever group it holds.
    """

    file_bytes: int
    files_per_million_tokens: float
    """Summed over the offloaded groups."""
    fs_tier: dict[str, Any] | None
    """The configured fs tier (``secondary_tiers`` entry), ``None`` with the CPU spec."""


@dataclass(frozen=True)
class Sizing:
    """The plan for one model and engine: what every output format renders."""

    kv_transfer_config: KvTransferConfig
    model: ModelInfo
    engine: EngineInfo
    vllm: VllmInfo
    knob: KnobInfo
    cpu_tier: CpuTier
    groups: tuple[GroupRow, ...]
    files: FileEconomics
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """The ``--format json`` document (tuples become JSON arrays)."""
        return asdict(self)
