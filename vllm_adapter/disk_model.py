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

A shared file system's metadata service is a **rate shared by every client**, not a
latency the threads overlap (a CephFS MDS, a Lustre MDT): a model with
``metadata_ops_per_s`` also floors the time of a layout's work at its metadata
operations over that rate (:func:`disk_time_of` with ``metadata_ops``: the layout's
creates, opens, renames, unlinks, directory calls, lookups and ledger operations,
:func:`vllm_adapter.metadata_model.layout_ops`), and says ``metadata`` when that floor
is the time.  Without it, per-file latency over threads hides any number of files
behind bandwidth, and the model would predict no gain from fewer files on exactly the
file systems packing is for (the bench's emulated metadata-bound mount measured packed
stores many times faster than vLLM's per-chunk files: ``reports/bench.md``).

:data:`FS_MODELS`: a local disk measured by the disk benchmark
(``conformance/bench/test_bench_disk.py``), read from the latest
``reports/bench.json`` (:func:`local_disk_from_bench`, its date and commit in the
model's ``source``; absent when that file is, e.g. in an installed wheel), and two
shared file systems whose latencies are assumptions (each model's ``source`` says
which).  The operator CLI (``python -m vllm_adapter config``) and the benchmarks'
file-economics table share this one copy; the CLI's ``--fs-read-threads`` /
``--fs-write-threads`` set the models' concurrency (:meth:`FsModel.with_threads`).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from vllm_adapter.metadata_model import DEFAULT_FS_METADATA_OPS, FS_METADATA_SOURCE

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
    "local_disk_from_bench",
    "modelled",
]

BENCH_JSON = Path(__file__).resolve().parents[1] / "reports" / "bench.json"
"""The bench's latest results in a checkout (``nox -s bench`` writes them)."""

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
    read_concurrency: int | None = None
    """Read threads; ``None``: as writes (vLLM's tier: 16 and 16)."""
    metadata_ops_per_s: float | None = None
    """The file system's metadata operations per second, shared by its clients (``None``:
    a local disk, whose metadata the per-file latency already prices)."""

    def with_threads(self, write: int | None, read: int | None) -> FsModel:
        """This model on ``write`` / ``read`` I/O threads (``None``: unchanged): the tier's
        ``n_write_threads`` / ``n_read_threads`` overlap the per-file latency."""
        reads = read if read is not None else (
            self.read_concurrency if self.read_concurrency is not None else self.concurrency)
        return replace(self, concurrency=write if write is not None else self.concurrency,
                       read_concurrency=reads)

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
            concurrency=self.read_concurrency
            if self.read_concurrency is not None
            else self.concurrency,
            read_file_latency_s=None,
            read_bandwidth_bps=None,
            read_concurrency=None,
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
    model: FsModel, files: Iterable[tuple[float, int]], direction: Direction,
    metadata_ops: float = 0.0,
) -> DiskTime:
    """:func:`disk_time` summed over ``(files, file_bytes)`` pairs: files of several sizes,
    each priced with its own bytes.  The bound is the one every size shares, ``"mixed"``
    where they differ, ``"-"`` when nothing moves.  ``metadata_ops``: the work's metadata
    operations; on a model with a shared metadata rate the time is at least those
    operations over it (bound ``"metadata"`` when that is longer)."""
    parts = [disk_time(model, n, size, direction) for n, size in files]
    bounds = {p.bound for p in parts} - {"-"}
    bound = "-" if not bounds else bounds.pop() if len(bounds) == 1 else "mixed"
    seconds = sum(p.seconds for p in parts)
    if model.metadata_ops_per_s and metadata_ops / model.metadata_ops_per_s > seconds:
        return DiskTime(metadata_ops / model.metadata_ops_per_s, "metadata")
    return DiskTime(seconds, bound)


def local_disk_from_bench(path: Path = BENCH_JSON) -> FsModel | None:
    """The local-disk model the disk benchmark measured (``None`` without ``path``).

    From the ``test_disk[...]`` results (vLLM's own ``batch_store_block`` /
    ``batch_load_block`` on its thread pool, the benchmark's baseline): bandwidth = the
    median over the file sizes of the baseline's GB/s; per-file latency = threads x the
    baseline's time per file at the smallest size, an upper bound (those files already
    move near full bandwidth, so the true per-file cost is lower)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    runs = [b["extra_info"] for b in data.get("benchmarks", ())
            if str(b.get("name", "")).startswith("test_disk[")]
    figures: dict[str, tuple[float, float, int, Any]] = {}
    for direction in ("write", "read"):
        mine = [r for r in runs if r.get("direction") == direction]
        if not mine:
            return None
        bandwidth = statistics.median(float(r["limit_gbps"]) for r in mine) * 1e9
        small = min(mine, key=lambda r: int(r["file_bytes"]))
        per_file = statistics.median(float(s) for s in small["baseline_s"]) / int(small["files"])
        figures[direction] = (bandwidth, per_file, int(small["threads"]), small)
    (w_bw, w_file, threads, small), (r_bw, r_file, _, _) = figures["write"], figures["read"]
    when = str(data.get("datetime", "?"))[:16].replace("T", " ")
    commit = str(data.get("commit_info", {}).get("id", "?"))[:7]
    return FsModel(
        "local disk",
        threads * w_file,
        threads,
        w_bw,
        f"measured by conformance/bench/test_bench_disk.py (reports/bench.json of {when} UTC, "
        f"commit {commit}; {small.get('filesystem', '?')}, O_DIRECT {small.get('o_direct')}): "
        f"vLLM's batch_store_block / batch_load_block on its {threads}-thread pool; bandwidth = "
        f"the median over {len([r for r in runs if r.get('direction') == 'write'])} file sizes, "
        f"{w_bw / 1e9:.2f} GB/s write and {r_bw / 1e9:.2f} GB/s read; per-file latency = "
        f"{threads} threads x the time per file at {small['file_bytes'] / 2**20:.2f} MiB "
        f"({1 / w_file:.0f} files/s write, {1 / r_file:.0f} read), an upper bound",
        read_file_latency_s=threads * r_file,
        read_bandwidth_bps=r_bw,
    )


LOCAL_DISK = local_disk_from_bench()
"""The measured local disk, or ``None`` where ``reports/bench.json`` is not shipped."""

_ASSUMED: tuple[tuple[str, FsModel], ...] = (
    ("nfs", FsModel(
        "NFS/Lustre",
        2e-3,
        16,
        2e9,
        "assumed 2 ms per file (create + write + close: 2-3 metadata round trips of ~0.5-1 ms "
        "on a datacenter network; mdtest file-create rates of a few thousand/s per client are "
        "the usual published order for Lustre and NFS), 16 fs-tier threads, 2 GB/s "
        f"per client; its metadata service {DEFAULT_FS_METADATA_OPS:,} operations/s shared "
        f"by every client ({FS_METADATA_SOURCE}), a floor on a layout's metadata operations",
        metadata_ops_per_s=DEFAULT_FS_METADATA_OPS,
    )),
    ("object-store", FsModel(
        "object store via FUSE",
        30e-3,
        16,
        2e9,
        "assumed 30 ms per file (S3-class PUT latency; AWS's S3 performance guidance "
        "quotes 100-200 ms first-byte for small objects at the tail, tens of ms typical), "
        "16 threads, 2 GB/s per client",
    )),
)

FS_MODEL_KEYS: dict[str, FsModel] = dict(
    ((("local", LOCAL_DISK),) if LOCAL_DISK is not None else ()) + _ASSUMED
)
"""Command-line names of :data:`FS_MODELS` (``--fs-model``)."""

FS_MODELS: tuple[FsModel, ...] = tuple(FS_MODEL_KEYS.values())
"""The file-tier models: the measured one (where the bench's report is) and two assumed
(provenance in each ``source``)."""


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
