"""The file economics' typed results: what a workload writes and reads under a chunking.

:mod:`vllm_adapter.economics` computes them (the CLI's ``config``, :mod:`vllm_adapter.planning`
and the benchmarks share it); :class:`vllm_adapter.cli.result.Sizing` carries them.  Field
names and order are keys of ``python -m vllm_adapter config --format json``.  No vLLM and no
CLI import.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BandwidthKnee",
    "DiskTimeRow",
    "FsModelInfo",
    "GroupTraffic",
    "LayoutTraffic",
    "PerGroupMap",
    "Sweep",
    "SweepPoint",
    "Traffic",
]


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
    metadata_ops_per_s: float | None = None
    """The shared metadata service's rate (``None``: not modelled)."""


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
    """``per_chunk``, ``packed`` (one or two files per store job: its full-attention keys,
    its window keys) or ``packed_per_request``."""
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
    """The tier's layouts side by side: ``per_chunk`` then ``packed`` (one or two files per
    store job)."""
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
