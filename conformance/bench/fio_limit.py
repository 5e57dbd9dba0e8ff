"""The disk's own limit, measured by ``fio`` (issue #30 item 3): the limit row of the
plain-disk table.

A pass of a tier moves ``total_bytes`` through ``files`` files of one size, in I/Os of one
row (``block_bytes``), on ``threads`` pool threads with ``O_DIRECT``.  :func:`run` asks
``fio`` to do the same on the same directory: ``threads`` jobs (``numjobs``, synchronous
``psync`` I/O, so the queue depth is the thread count, as the pool's), ``direct=1`` when
the tier ran with ``O_DIRECT``, the same I/O size, files of the same size, and at least
the same total bytes (the files split evenly between the jobs, so a job's share rounds
up to whole files).  Writes create their files, as a store does; reads find files
``fio`` laid out before it started timing (not counted), as a load finds the tier's.

The limit is ``fio``'s own: the bytes it moved over its bandwidth (the slowest job's
runtime), without its process start.  Where ``fio`` is not installed,
:func:`unavailable` says so and the row is not measured (never a harness error).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from dataclasses import dataclass

__all__ = ["FioJob", "FioResult", "run", "unavailable"]


def unavailable() -> str | None:
    """Why no limit can be measured here (``None``: ``fio`` is on PATH)."""
    if shutil.which("fio") is None:
        return "fio is not installed (Debian: apt-get install fio)"
    return None


@dataclass(frozen=True)
class FioJob:
    """One ``fio`` run shaped like one pass of a tier."""

    directory: str
    direction: str
    """``"store"`` (fio writes) or ``"load"`` (fio reads)."""
    total_bytes: int
    file_bytes: int
    block_bytes: int
    threads: int
    direct: bool

    def __post_init__(self) -> None:
        if self.direction not in ("store", "load"):
            raise ValueError(f"direction must be 'store' or 'load', got {self.direction!r}")
        for name in ("total_bytes", "file_bytes", "block_bytes", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def io_file_bytes(self) -> int:
        """The file size ``fio`` uses: the tier's, rounded up to whole I/Os."""
        return math.ceil(self.file_bytes / self.block_bytes) * self.block_bytes

    @property
    def files_per_job(self) -> int:
        """Files per ``fio`` job: the pass's bytes, split evenly, in whole files."""
        return max(1, math.ceil(self.total_bytes / (self.threads * self.io_file_bytes)))

    def argv(self) -> list[str]:
        return [
            "fio", "--name=limit", f"--directory={self.directory}",
            f"--rw={'write' if self.direction == 'store' else 'read'}",
            f"--bs={self.block_bytes}", f"--filesize={self.io_file_bytes}",
            f"--nrfiles={self.files_per_job}", f"--numjobs={self.threads}",
            f"--direct={int(self.direct)}", "--ioengine=psync", "--group_reporting",
            "--output-format=json",
        ]


@dataclass(frozen=True)
class FioResult:
    """What ``fio`` moved and in how long (its own clock)."""

    io_bytes: int
    bytes_per_s: float

    @property
    def seconds(self) -> float:
        return self.io_bytes / self.bytes_per_s

    @property
    def gbps(self) -> float:
        return self.bytes_per_s / 1e9


def parse(output: str, direction: str) -> FioResult:
    """``fio --output-format=json --group_reporting``'s figures of ``direction``."""
    start = output.find("{")  # fio may print notes before its JSON
    if start < 0:
        raise ValueError(f"fio printed no JSON: {output[:200]!r}")
    job = json.loads(output[start:])["jobs"][0]["write" if direction == "store" else "read"]
    if job["io_bytes"] <= 0 or job["bw_bytes"] <= 0:
        raise ValueError(f"fio moved nothing: {job['io_bytes']} bytes at {job['bw_bytes']} B/s")
    return FioResult(int(job["io_bytes"]), float(job["bw_bytes"]))


def run(job: FioJob, *, timeout_s: float = 600) -> FioResult:
    """Run ``job`` in a fresh ``fio`` directory under ``job.directory`` (removed after a
    write; kept after a read for the next read, :func:`clear` removes it)."""
    os.makedirs(job.directory, exist_ok=True)
    done = subprocess.run(job.argv(), capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    result = parse(done.stdout, job.direction)
    if job.direction == "store":
        clear(job.directory)
    return result


def clear(directory: str) -> None:
    shutil.rmtree(directory, ignore_errors=True)
