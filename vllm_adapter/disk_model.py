"""How long a file tier takes for a number of files of a size: one model, stated.

vLLM's file-system tier (``vllm/v1/kv_offload/tiering/fs``) writes **one file
per chunk per offloaded group**, each file one CPU-tier chunk row
(``round_up(worker_kv_bytes_per_block x copies x blocks_per_chunk, 4096)``
bytes), on a pool of I/O threads.  :class:`FsModel` prices a file as a fixed
per-file latency (create + write + close/rename, or open + read: metadata round
trips) that ``concurrency`` threads overlap, or its bytes at the client's
bandwidth, whichever is longer::

    seconds per file = max(file_latency_s / concurrency, file_bytes / bandwidth_bps)

The tier is **IOPS-bound** while the latency term wins and **bandwidth-bound**
after; the crossover file size is ``file_latency_s x bandwidth_bps / concurrency``.
Reads and writes may differ (:meth:`FsModel.direction`).

:data:`FS_MODELS`: a local disk measured on the development machine by the disk
benchmark (``conformance/bench/test_bench_disk.py``), and two shared file
systems whose latencies are assumptions (each model's ``source`` says which).
The operator CLI (``python -m vllm_adapter config``) and the benchmarks'
file-economics table share this one copy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "FS_MODELS",
    "FS_MODEL_KEYS",
    "Direction",
    "DiskTime",
    "FsModel",
    "ModelledThroughput",
    "disk_time",
    "disk_time_of",
    "fs_model",
    "modelled",
]

Direction = Literal["write", "read"]


@dataclass(frozen=True)
class FsModel:
    name: str
    file_latency_s: float
    """Per-file latency of a write (one thread, one file)."""
    concurrency: int
    """I/O threads overlapping the latency (vLLM's fs tier: 16 write + 16 read threads)."""
    bandwidth_bps: float
    """Write bandwidth per client, bytes/s."""
    source: str
    """Where the numbers come from: a measurement (date, commit) or an assumption."""
    read_file_latency_s: float | None = None
    """Per-file latency of a read; ``None``: as a write."""
    read_bandwidth_bps: float | None = None
    """Read bandwidth; ``None``: as a write."""

    def direction(self, direction: Direction) -> FsModel:
        """This model with the ``read`` figures as its write figures (``write``: itself)."""
        if direction == "write":
            return self
        return replace(
            self,
            file_latency_s=self.read_file_latency_s
            if self.read_file_latency_s is not None
            else self.file_latency_s,
            bandwidth_bps=self.read_bandwidth_bps
            if self.read_bandwidth_bps is not None
            else self.bandwidth_bps,
            read_file_latency_s=None,
            read_bandwidth_bps=None,
        )

    @property
    def crossover_bytes(self) -> float:
        """Write file size above which the model is bandwidth-bound."""
        return self.file_latency_s * self.bandwidth_bps / self.concurrency

    def seconds_per_file(self, file_bytes: int, direction: Direction = "write") -> float:
        m = self.direction(direction)
        return max(m.file_latency_s / m.concurrency, file_bytes / m.bandwidth_bps)

    def bound(self, file_bytes: int, direction: Direction = "write") -> str:
        """``"IOPS"`` while the per-file latency term wins, else ``"bandwidth"``."""
        m = self.direction(direction)
        return "IOPS" if m.file_latency_s / m.concurrency > file_bytes / m.bandwidth_bps else (
            "bandwidth"
        )


@dataclass(frozen=True)
class ModelledThroughput:
    files_per_s: float
    bytes_per_s: float
    bound: str
    """``"IOPS"`` or ``"bandwidth"``."""


def modelled(model: FsModel, file_bytes: int, direction: Direction = "write") -> ModelledThroughput:
    """Files/s and bytes/s of ``model`` moving files of ``file_bytes``."""
    seconds = model.seconds_per_file(file_bytes, direction)
    return ModelledThroughput(1 / seconds, file_bytes / seconds, model.bound(file_bytes, direction))


@dataclass(frozen=True)
class DiskTime:
    """Seconds of file-tier work for ``files`` files of ``file_bytes`` one way."""

    seconds: float
    bound: str
    """``"IOPS"`` or ``"bandwidth"`` (of this file size; ``"-"`` for no files)."""


def disk_time(model: FsModel, files: float, file_bytes: int, direction: Direction) -> DiskTime:
    """``files x seconds_per_file``: the disk work of moving that many files one way."""
    if files <= 0 or file_bytes <= 0:
        return DiskTime(0.0, "-")
    return DiskTime(
        files * model.seconds_per_file(file_bytes, direction), model.bound(file_bytes, direction)
    )


def disk_time_of(
    model: FsModel, files: Iterable[tuple[float, int]], direction: Direction
) -> DiskTime:
    """:func:`disk_time` summed over ``(files, file_bytes)`` pairs: files of several sizes,
    each priced with its own bytes.  The bound is the one every size shares, ``"mixed"``
    where they differ, ``"-"`` when nothing moves."""
    parts = [disk_time(model, n, size, direction) for n, size in files]
    bounds = {p.bound for p in parts} - {"-"}
    bound = "-" if not bounds else bounds.pop() if len(bounds) == 1 else "mixed"
    return DiskTime(sum(p.seconds for p in parts), bound)


LOCAL_DISK = FsModel(
    "local disk",
    16 * 0.000599,
    16,
    1.54e9,
    "measured on the development machine (a 2-core x86_64 VM, ext4 on a virtio disk, "
    "O_DIRECT, page cache dropped before reads) by conformance/bench/test_bench_disk.py "
    "(vLLM 0.34.0's batch_store_block / batch_load_block on its 16+16-thread pool; "
    "reports/bench.json of 2026-12-03 15:27 UTC, commit 6441842+): bandwidth = the median "
    "over 12 file sizes of 0.96-320 MiB, 1.54 GB/s write and 1.20 GB/s read; per-file "
    "latency = 16 threads x the time per file at the smallest size (1668 files/s write, "
    "1287 files/s read of 0.96 MiB files), an upper bound: those files already ran at full "
    "bandwidth, so the true per-file cost is lower. Local NVMe is typically faster",
    read_file_latency_s=16 * 0.000777,
    read_bandwidth_bps=1.20e9,
)

FS_MODELS: tuple[FsModel, ...] = (
    LOCAL_DISK,
    FsModel(
        "NFS/Lustre",
        2e-3,
        16,
        2e9,
        "assumed 2 ms per file (create + write + close: 2-3 metadata round trips of ~0.5-1 ms "
        "on a datacenter network; mdtest file-create rates of a few thousand/s per client are "
        "the usual published order for Lustre and NFS), 16 fs-tier threads, 2 GB/s "
        "per client",
    ),
    FsModel(
        "object store via FUSE",
        30e-3,
        16,
        2e9,
        "assumed 30 ms per file (S3-class PUT latency; AWS's S3 performance guidance "
        "quotes 100-200 ms first-byte for small objects at the tail, tens of ms typical), "
        "16 threads, 2 GB/s per client",
    ),
)
"""The file-tier models: one measured, two assumed (provenance in each ``source``)."""

FS_MODEL_KEYS: dict[str, FsModel] = dict(zip(("local", "nfs", "object-store"), FS_MODELS, strict=True))
"""Command-line names of :data:`FS_MODELS` (``--fs-model``)."""


def fs_model(name: str) -> FsModel:
    """The model of :data:`FS_MODELS` called ``name`` (case-insensitive); ``ValueError`` else."""
    key = name.strip().lower()
    if key in FS_MODEL_KEYS:
        return FS_MODEL_KEYS[key]
    for m in FS_MODELS:
        if m.name.lower() == key:
            return m
    raise ValueError(
        f"no fs model {name!r}; models: {', '.join(repr(m.name) for m in FS_MODELS)}"
    )
