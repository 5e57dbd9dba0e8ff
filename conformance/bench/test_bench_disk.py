"""Disk: chunk files as vLLM's file-system tier writes and reads them, vs one sequential file.

Layout, as ``FileSystemTierManager`` (``vllm/v1/kv_offload/tiering/fs``) does it:
one file per chunk per group, named by vLLM's ``FileMapper`` (built from the
fixture's ``CPUOffloadingSpec`` with ``blocks_per_file = blocks_per_chunk``,
``<root>/<model>_<digest>_r0/<hhh>/<hh>_g<group>/<hash>.bin``; groups taken in
turn), each file one CPU-tier chunk row: ``round_up(worker_kv_bytes_per_block
x copies x blocks_per_chunk, 4096)`` bytes, ``copies`` = TP ranks, or 1 with
vLLM's replicated layout (DeepSeek-V4 on CUDA; a CPU-only host would keep 4).
I/O: vLLM's own ``batch_store_block`` / ``batch_load_block`` (temp file +
rename on store; ``O_DIRECT`` when the directory supports it, as the tier
probes) on the tier's ``DualQueueThreadPool`` with its default 16 read + 16
write threads, one job per chunk.  About ``KVCHUNK_BENCH_DISK_MB`` (default
256) MiB per configuration instead of 2 GiB, to keep ``nox -s bench`` within
its time budget.

The files go to a fresh directory in the checkout (``/tmp`` is often RAM), or
under ``KVCHUNK_BENCH_DIR``.  The limit: the same bytes as one file, written
(read) sequentially by one thread in 64 MiB calls with the same ``O_DIRECT``
setting.  Between writing and
reading, ``sync`` and ``echo 3 > /proc/sys/vm/drop_caches`` (when permitted;
``extra_info`` says whether it was, and whether reads bypassed the page cache).
"""

from __future__ import annotations

import functools
import mmap
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conformance.bench import (
    CASES,
    DISK_MB,
    GEOMETRIES,
    Variant,
    case_id,
    env_int,
    measure,
    record,
    rounded,
)
from conformance.testing.requires import require_vllm
from reference.geometry import cpu_row_bytes

require_vllm()

from conformance.harness import vllm_harness_api as V  # noqa: E402
from vllm_adapter import fixtures as fx  # noqa: E402

ROUNDS = env_int("KVCHUNK_BENCH_DISK_ROUNDS", 3)
"""Disk rounds are few: each moves ``DISK_MB`` MiB twice."""
IO_CALL = 64 << 20
THREADS = 16
"""FileSystemTierManager's default n_read_threads and n_write_threads."""


def drop_caches() -> bool:
    """``sync`` and drop the page cache; whether the kernel let us."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


@functools.cache
def tier_spec(name: str, blocks_per_chunk: int) -> tuple[Any, int, int]:
    """The fixture's ``CPUOffloadingSpec``, its chunk file bytes and its group count."""
    data = fx.load_fixture(name)
    vc = fx.make_vllm_config(data, {"blocks_per_chunk": blocks_per_chunk})
    config = V.build_offloading_config(vc, fx.rebuild_kv_cache_config(data, "worker"))
    copies = 1 if config.replicated_layout else config.parallel.world_size
    align = V.CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT
    file_bytes = cpu_row_bytes(config.worker_kv_bytes_per_block, copies, blocks_per_chunk, align)
    return V.CPUOffloadingSpec(config), file_bytes, len(config.groups)


class DiskCase:
    """``num_files`` chunk files of one configuration, their buffer, paths and the pool."""

    def __init__(self, name: str, blocks_per_chunk: int, root: str) -> None:
        spec, self.file_bytes, groups = tier_spec(name, blocks_per_chunk)
        self.num_files = max(1, (DISK_MB << 20) // self.file_bytes)
        self.nbytes = self.num_files * self.file_bytes
        self.root = root
        mapper = V.FileMapper.from_offloading_spec(
            os.path.join(root, "tier"),
            spec,
            blocks_per_file=blocks_per_chunk,
            parallel_agnostic=True,
        )
        self.paths = [
            mapper.get_file_name(V.make_offload_key(os.urandom(32), i % groups))
            for i in range(self.num_files)
        ]
        self.seq_path = os.path.join(root, "sequential.bin")
        self.buffer = mmap.mmap(-1, self.nbytes)  # page-aligned, as O_DIRECT needs
        self.array = np.frombuffer(self.buffer, dtype=np.uint8)
        pattern = np.frombuffer(os.urandom(1 << 20), dtype=np.uint8)
        for start in range(0, self.nbytes, 1 << 20):
            piece = self.array[start : start + (1 << 20)]
            piece[:] = pattern[: piece.size]
        self.pages = self.array.view(np.uint64)[::512]  # the first 8 bytes of every 4 KiB page
        self.pages[:] = np.arange(self.pages.size, dtype=np.uint64)  # ... name the page
        self.view = memoryview(self.buffer)
        self.o_direct = V.probe_o_direct(root)
        self.pool = V.DualQueueThreadPool(THREADS, THREADS, thread_name_prefix="kvchunk_bench_fs")
        self._job = 0
        self.tail = zlib.crc32(self.view[-self.file_bytes :])

    def intact(self) -> bool:
        """Every page holds its own number (and the last file its bytes)."""
        numbered = np.array_equal(self.pages, np.arange(self.pages.size, dtype=np.uint64))
        return numbered and zlib.crc32(self.view[-self.file_bytes :]) == self.tail

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.view.release()
        del self.pages, self.array
        self.buffer.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- vLLM's fs tier -------------------------------------------------------

    def _run(self, enqueue: Any, io: Any) -> None:
        first = self._job
        for i, path in enumerate(self.paths):
            self._job += 1
            enqueue(
                self._job,
                1,
                [
                    functools.partial(
                        io, [path], self.view, [i * self.file_bytes], self.file_bytes, self.o_direct
                    )
                ],
            )
        self.pool.wait_idle()
        results = self.pool.get_finished()
        failed = [job for job, ok, _ in results if not ok]
        assert len(results) == self._job - first and not failed, (
            f"fs tier jobs failed: {failed[:5]}"
        )

    def remove_tier_files(self) -> None:
        shutil.rmtree(os.path.join(self.root, "tier"), ignore_errors=True)

    def tier_write(self, _: Any = None) -> None:
        self._run(self.pool.enqueue_store, V.batch_store_block)

    def tier_read(self, _: Any = None) -> None:
        self._run(self.pool.enqueue_load, V.batch_load_block)

    # -- the limit: one sequential file ---------------------------------------

    def _open(self, flags: int) -> int:
        direct = getattr(os, "O_DIRECT", 0) if self.o_direct else 0
        return os.open(self.seq_path, flags | direct, 0o644)

    def seq_write(self, _: Any = None) -> None:
        fd = self._open(os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
        try:
            for start in range(0, self.nbytes, IO_CALL):
                chunk = self.view[start : min(start + IO_CALL, self.nbytes)]
                assert os.write(fd, chunk) == len(chunk)
        finally:
            os.close(fd)

    def seq_read(self, _: Any = None) -> None:
        fd = self._open(os.O_RDONLY)
        try:
            for start in range(0, self.nbytes, IO_CALL):
                chunk = self.view[start : min(start + IO_CALL, self.nbytes)]
                assert os.readv(fd, [chunk]) == len(chunk)
        finally:
            os.close(fd)


REPO = Path(__file__).resolve().parents[2]


def filesystem(path: str) -> str:
    """``"<fstype> on <mount point>"`` of the mount holding ``path`` (from /proc/mounts),
    with ``", mounted with discard"`` where it is: every unlink then discards the file's
    blocks at once (an eviction's cost; a periodic ``fstrim`` does not)."""
    best = ("", "unknown", "")
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                mount, fstype, options = parts[1], parts[2], parts[3]
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[0]):
                    best = (mount, fstype, options)
    except OSError as e:
        return f"unknown file system (/proc/mounts unreadable: {e.strerror or e})"
    discard = ", mounted with discard" if "discard" in best[2].split(",") else ""
    return f"{best[1]} on {best[0] or '?'}{discard}"


@pytest.fixture
def disk_root() -> Any:
    """A fresh directory on the checkout's file system (``/tmp`` is often RAM), or ``KVCHUNK_BENCH_DIR``."""
    parent = os.environ.get("KVCHUNK_BENCH_DIR") or str(REPO)
    root = tempfile.mkdtemp(prefix=".kvchunk-bench-", dir=parent)
    yield root
    shutil.rmtree(root, ignore_errors=True)


PARAMS = [(g, b, d) for g, b in CASES for d in ("write", "read")]


@pytest.mark.parametrize(
    "geometry,blocks_per_chunk,direction",
    PARAMS,
    ids=[f"{case_id((g, b))}-{d}" for g, b, d in PARAMS],
)
def test_disk(
    benchmark: Any, disk_root: str, geometry: str, blocks_per_chunk: int, direction: str
) -> None:
    case = DiskCase(geometry, blocks_per_chunk, disk_root)
    dropped: list[bool] = []
    try:
        if direction == "write":
            candidate = Variant(case.tier_write, case.remove_tier_files)
            limit = Variant(case.seq_write)
        else:
            case.tier_write()
            case.seq_write()

            def cold() -> None:
                dropped.append(drop_caches())

            candidate = Variant(case.tier_read, cold)
            limit = Variant(case.seq_read, cold)
        m = measure(benchmark, candidate, {"sequential": limit}, rounds=ROUNDS)
        if direction == "read":  # the bytes come back
            case.array[:] = 0
            case.tier_read()
            assert case.intact(), "the fs tier read back other bytes than it wrote"
        cand, base = m.median(), m.median("sequential")
        cached = not (case.o_direct or (dropped and all(dropped)))
        record(
            benchmark,
            kind="disk",
            geometry=geometry,
            label=GEOMETRIES[geometry],
            blocks_per_chunk=blocks_per_chunk,
            direction=direction,
            bytes=case.nbytes,
            files=case.num_files,
            file_bytes=case.file_bytes,
            o_direct=case.o_direct,
            filesystem=filesystem(os.path.realpath(disk_root)),
            drop_caches=None if direction == "write" else bool(dropped and all(dropped)),
            read_from_page_cache=None if direction == "write" else cached,
            threads=THREADS,
            **m.ratio_fields("sequential", speed=True),
            candidate_gbps=case.nbytes / cand / 1e9,
            limit_gbps=case.nbytes / base / 1e9,
            files_per_s=case.num_files / cand,
            candidate_s=rounded(m.candidate),
            baseline_s=rounded(m.baselines["sequential"]),
        )
    finally:
        case.close()
