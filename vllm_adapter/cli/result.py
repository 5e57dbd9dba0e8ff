"""What ``python -m vllm_adapter config`` computes: :class:`Sizing`, typed and frozen.

Field names and order are the keys of the ``--format json`` document
(:meth:`Sizing.to_json`); ``scripts/check_serve_install.py`` and the tests read it.
The file economics' types (:class:`Traffic`, :class:`Sweep`, ...) are
:mod:`vllm_adapter.results`', re-exported here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from vllm_adapter.metadata_model import MetadataEconomics, MetadataLayout
from vllm_adapter.results import (
    BandwidthKnee,
    DiskTimeRow,
    FsModelInfo,
    GroupTraffic,
    LayoutTraffic,
    PerGroupMap,
    Sweep,
    SweepPoint,
    Traffic,
)

__all__ = [
    "BandwidthKnee",
    "CpuTier",
    "DiskCurvePoint",
    "DiskRun",
    "DiskTier",
    "DiskTimeRow",
    "EngineInfo",
    "FileEconomics",
    "FsModelInfo",
    "GroupRow",
    "GroupTraffic",
    "KnobInfo",
    "KvTransferConfig",
    "LayoutTraffic",
    "MetadataEconomics",
    "MetadataLayout",
    "ModelInfo",
    "PerGroupMap",
    "PolicyInfo",
    "Sizing",
    "Sweep",
    "SweepPoint",
    "TieredDiskRun",
    "Traffic",
    "VllmInfo",
    "WorkloadInfo",
]


@dataclass(frozen=True)
class KvTransferConfig:
    """The ``--kv-transfer-config`` to paste."""

    kv_connector: str
    kv_connector_module_path: str
    kv_role: str
    kv_connector_extra_config: dict[str, Any]
    """The knob as given (or the chosen ``blocks_per_chunk``), ``spec_name`` (and
    ``spec_module_path`` for kvchunk's ``KvchunkTieringOffloadingSpec``),
    ``cpu_bytes_to_use`` when given, ``secondary_tiers`` with a tiering spec."""

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
    prefix_cache_retention_interval: int | None
    """``None``: dense retention (vLLM's ``--prefix-cache-retention-interval None``)."""


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


@dataclass(frozen=True)
class FileEconomics:
    """Files vLLM's fs tier (``TieringOffloadingSpec``, ``type: fs``) writes for this knob.

    One file per chunk per offloaded group, each one CPU-tier chunk slot (all rank
    copies, page-aligned: :attr:`CpuTier.slot_bytes`), whichever group it holds.
    How many a workload writes and reads: :attr:`Sizing.traffic`.
    """

    file_bytes: int
    fs_tier: dict[str, Any] | None
    """The configured fs tier (``secondary_tiers`` entry), ``None`` with the CPU spec."""


@dataclass(frozen=True)
class WorkloadInfo:
    """The workload served (:mod:`reference.workload`): a preset or a TOML file."""

    given: str
    """``--workload`` as given (a preset name or a path)."""
    name: str
    description: str
    shape: str
    """:meth:`reference.workload.Workload.describe`: the shape in numbers."""
    source: str
    """Where the workload's numbers come from."""
    requests: int
    prompt_tokens: int
    """The denominator of every per-million figure: the requests' prompt tokens summed."""


@dataclass(frozen=True)
class PolicyInfo:
    """The engine rules the workload is served under (vLLM's, for the installed release)."""

    vllm_release: str
    release_known: bool
    """False: a release with no row in :data:`vllm_adapter.releases.RELEASES` (newest assumed)."""
    prefix_cache_retention_interval: int | None
    """0 sparse (vLLM's default), ``None`` dense, N > 0 every N tokens."""
    offload_prompt_only: bool
    """vLLM's ``offload_prompt_only`` (default true); ``--decode-storing`` sets it false."""
    offload_junctions: bool


@dataclass(frozen=True)
class DiskRun:
    """The workload served over a disk of ``budget_bytes`` under one eviction rule
    (:func:`reference.disk_economics.disk_economics`); per million prompt tokens."""

    rule: str
    """``reachable`` (the reference's rule: leaves first, strands nothing) or ``lru``."""
    budget_bytes: int | None
    hit_rate: float
    """Prompt tokens served from the disk, as a fraction of all prompt tokens."""
    hits_per_million: float
    """Prompt tokens served from the disk."""
    files_read_per_million: float
    files_written_per_million: float
    files_evicted_per_million: float
    recomputed_for_space_per_million: float
    """Tokens an unbounded disk serves that this one does not (lack of space; tokens
    recomputed for chunk granularity, which the unbounded disk recomputes too, apart)."""
    stranded_bytes: int
    """Bytes on disk at the end that no lookup can load (the rule: always 0)."""
    bytes_on_disk: int
    """Bytes on disk at the end."""
    stores_refused: int
    """Stores refused whole: nothing the rule may evict made room (the Planner offers the
    keys again next step)."""
    keys_dropped: int
    """Keys left out of stores because they would arrive stranded (admission; the rule only)."""
    recomputed_for_space_tokens: int
    """``recomputed_for_space_per_million``'s count: tokens the unbounded disk serves that this
    one does not."""


@dataclass(frozen=True)
class TieredDiskRun(DiskRun):
    """:class:`DiskRun` of a disk behind vLLM's CPU tier
    (:func:`reference.tiered_curve.tiered_miss_ratio_curve`): :attr:`hit_rate` and
    :attr:`hits_per_million` count the prompt tokens the CPU tier or the disk served; the
    disk's figures are the disk's alone (stranded: unreachable from the disk alone)."""

    keys_promoted_per_million: float = 0.0
    """Chunks read from the disk into the CPU tier (a lookup found them there)."""
    promotions_refused: int = 0
    """Disk hits the CPU tier had no slot for (the lookup missed)."""
    cpu_stores_refused: int = 0
    """GPU->CPU stores the CPU tier had no room for (offered again next step)."""
    lookups_abandoned: int = 0
    """Lookups still deferred after promotions landed 8 times (a request whose hit needs
    more CPU slots than the tier has: its promotions evict each other; served with no
    offload hit)."""
    hits_evicted_by_promotions: int = 0
    """Lookups whose hit lost a chunk to a promotion the same lookup started (the CPU tier
    had answered HIT for it; vLLM's ``prepare_load`` asserts there): asked again."""


@dataclass(frozen=True)
class DiskCurvePoint:
    """One disk size of ``--sweep-disk``: both rules."""

    budget_bytes: int
    rule: DiskRun
    lru: DiskRun


@dataclass(frozen=True)
class DiskTier:
    """``--disk-bytes`` / ``--sweep-disk``: the scaled workload over a budgeted disk tier."""

    workload: str
    scaling: str
    """How the workload was scaled (sessions over time) and what the GPU cache holds."""
    sessions: int
    prompt_tokens: int
    """The denominator of the per-million figures."""
    layout: str
    key_bytes: dict[int, int]
    """Bytes per key, per group index (one CPU-tier row; a packed file holds its keys')."""
    at_budget: tuple[DiskRun, ...] | None
    """``--disk-bytes``: the rule, then plain LRU."""
    curve: tuple[DiskCurvePoint, ...] | None
    """``--sweep-disk``: the miss-ratio curve, smallest disk first."""
    plot: str | None
    cpu_bytes: int | None = None
    """``--cpu-bytes``: the CPU tier in front of the disk in :attr:`cpu_curve`."""
    cpu_chunks: int | None = None
    """Chunk slots of that CPU tier (one per key)."""
    cpu_curve: tuple[DiskCurvePoint, ...] | None = None
    """``--sweep-disk`` with ``--cpu-bytes``: the same disk sizes with vLLM's CPU tier in
    front (its runs are :class:`TieredDiskRun`)."""


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
    workload: WorkloadInfo
    policy: PolicyInfo
    fs_models: tuple[FsModelInfo, ...]
    """The fs models the disk times use (``--fs-model``: one; default all)."""
    traffic: Traffic
    """The chosen knob's files, bytes, recomputed tokens and disk time on the workload."""
    per_group_map: PerGroupMap
    sweep: Sweep | None
    disk: DiskTier | None = None
    """``--disk-bytes`` / ``--sweep-disk`` (``None`` without them)."""
    metadata: MetadataEconomics | None = None
    """Metadata operations per layout and the engines one file system serves
    (``--fs-metadata-ops`` / ``--prefill-tokens-per-s``)."""

    def to_json(self) -> dict[str, Any]:
        """The ``--format json`` document (tuples become JSON arrays)."""
        return asdict(self)
