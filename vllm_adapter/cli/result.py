"""What ``python -m vllm_adapter config`` computes: :class:`Sizing`, typed and frozen.

Field names and order are the keys of the ``--format json`` document
(:meth:`Sizing.to_json`); ``scripts/check_serve_install.py`` and the tests read it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

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
    "ModelInfo",
    "PerGroupMap",
    "PolicyInfo",
    "Sizing",
    "Sweep",
    "SweepPoint",
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
class FsModelInfo:
    """A file-tier model (:mod:`vllm_adapter.disk_model`)."""

    name: str
    file_latency_s: float
    read_file_latency_s: float
    concurrency: int
    bandwidth_bps: float
    read_bandwidth_bps: float
    crossover_bytes: float
    """Write file size above which the model is bandwidth-bound."""
    source: str


@dataclass(frozen=True)
class GroupTraffic:
    """One group's files and bytes per million prompt tokens."""

    index: int
    tokens_per_chunk: int
    file_bytes: int
    files_written_per_million: float
    files_read_per_million: float
    files_read_once_per_million: float
    bytes_written_per_million: float
    bytes_read_per_million: float


@dataclass(frozen=True)
class DiskTimeRow:
    """Seconds of file-tier work per million prompt tokens under one fs model."""

    fs_model: str
    write_seconds_per_million: float
    write_bound: str
    """``IOPS``, ``bandwidth``, ``mixed`` (groups differ) or ``-`` (nothing written)."""
    read_seconds_per_million: float
    read_bound: str


@dataclass(frozen=True)
class LayoutTraffic:
    """One disk layout's files, opens and bytes per million prompt tokens
    (:class:`reference.layout_economics.LayoutEconomics`).

    ``*_read_once``: each loaded key read from disk once per pass (a CPU tier that
    keeps what it promoted; what the tiered economics check verifies); the others:
    every load reads from disk (a CPU tier that never holds the chunk).
    """

    layout: str
    """``per_chunk``, ``packed`` (one file per store job) or ``packed_per_request``."""
    files_written_per_million: float
    sections_written_per_million: float
    """Keys written (per chunk: one per file)."""
    file_opens_per_million: float
    file_opens_once_per_million: float
    sections_read_per_million: float
    sections_read_once_per_million: float
    reads_per_million: float
    """Maximal runs of adjacent sections of one file a load job reads (per chunk: files)."""
    reads_once_per_million: float
    bytes_written_per_million: float
    bytes_read_per_million: float
    bytes_read_once_per_million: float
    disk: tuple[DiskTimeRow, ...]
    """Writes: each file with its own bytes; reads: each open (every load) with the bytes
    it reads."""


@dataclass(frozen=True)
class Traffic:
    """What the workload writes to and reads from the offload tier under one chunking.

    Computed by :func:`reference.economics.economics` (the reference Planner serving
    the workload's requests); loads are counted as file reads (the CPU tier assumed
    not to hold the chunk: the disk's worst case).  Per million prompt tokens.
    """

    groups: tuple[GroupTraffic, ...]
    files_written_per_million: float
    files_read_per_million: float
    """Every load read from disk (a CPU tier that never holds the chunk)."""
    files_read_once_per_million: float
    """Each loaded chunk read from disk once per pass (a CPU tier that keeps what it read)."""
    bytes_written_per_million: float
    bytes_read_per_million: float
    ideal_hit_per_million: float
    """Tokens an ideal cache would serve (the longest prefix seen before)."""
    gpu_hit_per_million: float
    offload_hit_per_million: float
    recomputed_tail_per_million: float
    """Past the last full-attention chunk end of the ideal prefix (a partial chunk)."""
    recomputed_lost_per_million: float
    """Whole chunks a request could not use (unaligned GPU hits, windows not kept, ...)."""
    recomputed_per_million: float
    disk: tuple[DiskTimeRow, ...]
    layouts: tuple[LayoutTraffic, ...]
    """The tier's layouts side by side: ``per_chunk`` then ``packed`` (one file per store
    job)."""
    packed_per_request: LayoutTraffic
    """One file per request (reference only: the alternative packing unit)."""


@dataclass(frozen=True)
class PerGroupMap:
    """A per-group ``blocks_per_chunk`` map (every group the full-attention groups'
    tokens per chunk) on the same workload: what per-group chunking would give.

    Reference-only: vLLM executes one ``blocks_per_chunk`` for every group and the
    connector rejects such maps.  Each group's file is its own bytes per chunk x copies
    (page-aligned), not a whole CPU-tier slot.
    """

    tokens_per_chunk: int | None
    blocks_per_chunk: dict[int, int]
    """Group index -> B_g (empty when no valid map exists)."""
    valid: bool
    reason: str | None
    """Why no valid map exists (``valid`` False)."""
    traffic: Traffic | None


@dataclass(frozen=True)
class SweepPoint:
    """One knob value of a sweep."""

    knob: dict[str, int]
    blocks_per_chunk: int
    alignment_tokens: int | None
    file_bytes: int
    traffic: Traffic
    recomputed_added_per_million: float | None
    """Recomputed tokens per million added by this step up from the previous point
    (``None`` for the first): the hit cost of the larger chunk."""


@dataclass(frozen=True)
class BandwidthKnee:
    """The smallest swept chunk at which a fs model is no longer IOPS-bound."""

    fs_model: str
    knob: dict[str, int] | None
    """``None``: IOPS-bound at every swept value."""
    file_bytes: int | None


@dataclass(frozen=True)
class Sweep:
    """The same figures across knob values (``--sweep``)."""

    knob_name: str
    points: tuple[SweepPoint, ...]
    skipped: tuple[str, ...]
    """Values not valid here, each with the reason."""
    knees: tuple[BandwidthKnee, ...]
    plot: str | None
    """The PNG written (``--plot``), else ``None``."""


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

    def to_json(self) -> dict[str, Any]:
        """The ``--format json`` document (tuples become JSON arrays)."""
        return asdict(self)
