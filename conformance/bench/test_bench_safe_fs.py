"""Disk: kvchunk's checksummed file tier vs vLLM's plain fs tier, and the checksum alone.

``test_checksummed_vs_plain``: the same chunk files as ``test_bench_disk`` (its
:class:`~conformance.bench.test_bench_disk.DiskCase`: vLLM's ``FileMapper`` names,
one CPU-tier row per file, the tier's ``DualQueueThreadPool`` with 16 + 16
threads, one job per chunk, ``O_DIRECT`` when the directory supports it),
written and read by kvchunk's ``batch_store_chunks`` / ``batch_load_chunks``
(:mod:`vllm_adapter.disk.tier`: a 4 KiB header, the tier's default payload checksum
-- :data:`vllm_adapter.disk.chunk_file.CHECKSUM`, XXH3-128 -- on store and on load, temp
file + rename) against vLLM's ``batch_store_block`` /
``batch_load_block`` (temp file + rename, no check), interleaved (``B A B A ...
B``, :func:`conformance.bench.measure`) at every ``blocks_per_chunk``.  Reads
drop the page cache first where the kernel allows it.  Target: ratio (plain time
/ checksummed time) >= 0.95 for ``blocks_per_chunk >= 4``; smaller chunks are
measured and reported, not checked (a 4 KiB header and a per-file hash call
weigh more on small files).

``test_checksum_throughput``: XXH3-128 (the tier's default, through the tier's own
:func:`~vllm_adapter.disk.chunk_file.payload_digest`), BLAKE3 (16-byte digest) on one core
and on all cores (the tier's BLAKE3 mode for payloads of 1 MiB and more), and zlib's
CRC-32 for comparison, GB/s over 256 MiB.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
import zlib
from typing import Any

import pytest

from conformance.bench import CASES, GEOMETRIES, Variant, case_id, env_int, measure, record, rounded
from conformance.testing.requires import require_vllm

require_vllm()

import blake3  # noqa: E402

from conformance.bench.test_bench_disk import (  # noqa: E402
    REPO,
    ROUNDS,
    THREADS,
    DiskCase,
    drop_caches,
    filesystem,
)
from vllm_adapter.disk import tier as S  # noqa: E402
from vllm_adapter.disk.chunk_file import CHECKSUM, payload_digest  # noqa: E402


@pytest.fixture
def disk_root() -> Any:
    """As ``test_bench_disk``'s: a fresh directory in the checkout, or ``KVCHUNK_BENCH_DIR``."""
    root = tempfile.mkdtemp(prefix=".kvchunk-bench-", dir=os.environ.get("KVCHUNK_BENCH_DIR") or str(REPO))
    yield root
    shutil.rmtree(root, ignore_errors=True)


class ChecksummedCase:
    """A :class:`DiskCase` whose files are also written and read through kvchunk's tier I/O."""

    def __init__(self, name: str, blocks_per_chunk: int, root: str) -> None:
        self.disk = DiskCase(name, blocks_per_chunk, root)
        tier_root = os.path.join(root, "tier")
        self.safe_root = os.path.join(root, "safe")
        self.paths = [self.safe_root + p[len(tier_root):] for p in self.disk.paths]
        self.key_ids = [S.key_digest(p.encode()) for p in self.paths]
        self.io = S.ChunkIO(namespace=bytes(16), checksum=CHECKSUM, o_direct=self.disk.o_direct)

    def _run(self, enqueue: Any, io: Any) -> None:
        d = self.disk
        first = d._job
        for i, (path, kid) in enumerate(zip(self.paths, self.key_ids, strict=True)):
            d._job += 1
            task = functools.partial(
                io, [path], [kid], d.view, [i * d.file_bytes], d.file_bytes, self.io
            )
            enqueue(d._job, 1, [task])
        d.pool.wait_idle()
        results = d.pool.get_finished()
        failed = [job for job, ok, _ in results if not ok]
        assert len(results) == d._job - first and not failed, f"jobs failed: {failed[:5]}"

    def write(self, _: Any = None) -> None:
        self._run(self.disk.pool.enqueue_store, S.batch_store_chunks)

    def read(self, _: Any = None) -> None:
        self._run(self.disk.pool.enqueue_load, S.batch_load_chunks)

    def remove(self) -> None:
        shutil.rmtree(self.safe_root, ignore_errors=True)


PARAMS = [(g, b, d) for g, b in CASES for d in ("write", "read")]


@pytest.mark.parametrize(
    "geometry,blocks_per_chunk,direction",
    PARAMS,
    ids=[f"{case_id((g, b))}-{d}" for g, b, d in PARAMS],
)
def test_checksummed_vs_plain(
    benchmark: Any, disk_root: str, geometry: str, blocks_per_chunk: int, direction: str
) -> None:
    case = ChecksummedCase(geometry, blocks_per_chunk, disk_root)
    d = case.disk
    dropped: list[bool] = []
    try:
        if direction == "write":
            candidate = Variant(case.write, case.remove)
            plain = Variant(d.tier_write, d.remove_tier_files)
        else:
            case.write()
            d.tier_write()

            def cold() -> None:
                dropped.append(drop_caches())

            candidate = Variant(case.read, cold)
            plain = Variant(d.tier_read, cold)
        about = {"kind": "disk_checksum", "blocks_per_chunk": blocks_per_chunk,
                 "target_checked": blocks_per_chunk >= 4}
        m = measure(benchmark, candidate, {"plain": plain}, rounds=ROUNDS)
        if direction == "read":  # kvchunk's files give back the bytes written
            d.array[:] = 0
            case.read()
            assert d.intact(), "the checksummed tier read back other bytes than it wrote"
        cand, base = m.median(), m.median("plain")
        record(
            benchmark,
            **about,
            geometry=geometry,
            label=GEOMETRIES[geometry],
            direction=direction,
            bytes=d.nbytes,
            files=d.num_files,
            file_bytes=d.file_bytes,
            o_direct=d.o_direct,
            filesystem=filesystem(os.path.realpath(disk_root)),
            drop_caches=None if direction == "write" else bool(dropped and all(dropped)),
            threads=THREADS,
            checksum=case.io.checksum,
            **m.ratio_fields("plain", speed=True, about=about),
            candidate_gbps=d.nbytes / cand / 1e9,
            plain_gbps=d.nbytes / base / 1e9,
            candidate_s=rounded(m.candidate),
            baseline_s=rounded(m.baselines["plain"]),
        )
    finally:
        d.close()


CHECKSUM_MB = env_int("KVCHUNK_BENCH_CHECKSUM_MB", 256)


CHECKSUMS: dict[str, Any] = {
    "xxh3-128": functools.partial(payload_digest, "xxh3-128"),
    "blake3": lambda b: blake3.blake3(b).digest(16),
    "blake3-all-cores": lambda b: blake3.blake3(b, max_threads=blake3.blake3.AUTO).digest(16),
    "crc32": zlib.crc32,
}
"""XXH3-128 (the tier's default, as the tier computes it), BLAKE3 on one core and on all
(the tier's BLAKE3 mode for payloads of 1 MiB and more), and zlib's CRC-32 (one core)
for comparison."""


@pytest.mark.parametrize("algorithm", list(CHECKSUMS))
def test_checksum_throughput(benchmark: Any, algorithm: str) -> None:
    """One call over the whole buffer, as the tier hashes one chunk file's payload."""
    data = memoryview(bytearray(os.urandom(1 << 20)) * CHECKSUM_MB)
    fn = CHECKSUMS[algorithm]
    times: list[float] = []

    def run() -> None:
        start = time.perf_counter()
        fn(data)
        times.append(time.perf_counter() - start)

    fn(data)
    benchmark.pedantic(run, rounds=5, iterations=1, warmup_rounds=0)
    best = min(times)
    record(benchmark, kind="checksum", algorithm=algorithm, bytes=len(data),
           gbps=len(data) / best / 1e9, seconds=rounded(times), cpus=os.cpu_count())
