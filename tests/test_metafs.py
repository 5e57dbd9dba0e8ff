"""conformance/bench/metafs.py: the emulated metadata-bound file system of the packed bench.

Its one metadata server is checked alone (no FUSE needed): metadata requests queue one at a
time at the rate, shared by every thread; data requests never wait.  Then on a real mount
(skipped, saying why, where FUSE is not available: no /dev/fuse, no fuse3, no mfusepy): the
requests are counted by kind, bytes round-trip through the passthrough, and K metadata
operations at rate R take at least K / R seconds, from one thread or from several.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conformance.bench import metafs as M

RATE = 2000
"""The mount's metadata operations per second (0.5 ms each)."""
K = 50


# ---------------------------------------------------------------------------
# The server alone
# ---------------------------------------------------------------------------


def test_the_server_serves_metadata_one_at_a_time_for_every_thread() -> None:
    server = M.MetadataServer(1000)  # 1 ms per request
    threads = 8
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: [server.serve("getattr") for _ in range(5)], range(threads)))
    elapsed = time.perf_counter() - start
    # one server: 40 requests of 1 ms each take 40 ms, however many threads ask
    assert elapsed >= threads * 5 / 1000
    assert server.snapshot() == {"getattr": threads * 5}


def test_data_requests_are_counted_and_never_queued() -> None:
    server = M.MetadataServer(10)  # 100 ms per metadata request
    start = time.perf_counter()
    for _ in range(200):
        server.serve("write")
        server.serve("read")
        server.serve("release")
    assert time.perf_counter() - start < 0.1, "a data request waited for the metadata server"
    assert server.snapshot(reset=True) == {"write": 200, "read": 200, "release": 200}
    assert server.snapshot() == {}
    server.set_rate(0)  # unthrottled: counted, not queued
    start = time.perf_counter()
    for _ in range(50):
        server.serve("create")
    assert time.perf_counter() - start < 0.1
    assert server.snapshot() == {"create": 50}


def test_every_kind_is_metadata_data_or_a_release() -> None:
    assert not (M.METADATA_KINDS & M.DATA_KINDS)
    assert not (M.METADATA_KINDS & M.RELEASE_KINDS) and not (M.DATA_KINDS & M.RELEASE_KINDS)
    assert {"create", "open", "rename", "unlink", "mkdir", "rmdir", "opendir", "readdir",
            "fsync", "getattr", "access"} <= M.METADATA_KINDS
    assert M.metadata_ops({"getattr": 3, "write": 9, "create": 1, "flush": 2}) == 4
    assert M.label(2000) == "emulated metadata-bound file system, 2,000 operations/s"


# ---------------------------------------------------------------------------
# A real mount
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[M.MetaMount]:
    reason = M.unavailable()
    if reason is not None:
        pytest.skip(f"no FUSE mount on this host: {reason}")
    root = tmp_path_factory.mktemp("metafs")
    fs = M.MetaMount(str(root / "backing"), str(root / "mnt"), RATE)
    try:
        fs.start()
    except M.MountUnavailable as e:
        pytest.skip(f"no FUSE mount on this host: {e}")
    try:
        yield fs
    finally:
        fs.close()
        assert not os.path.ismount(fs.mountpoint), "the mount outlived its close()"


def test_requests_are_counted_by_kind_and_bytes_round_trip(mount: M.MetaMount) -> None:
    mnt, backing = Path(mount.mountpoint), Path(mount.backing)
    data = os.urandom(3 * 65536 + 123)
    mount.reset()
    (mnt / "d").mkdir()
    tmp, final = mnt / "d" / "file.tmp", mnt / "d" / "file"
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, final)
    with open(final, "rb") as f:
        got = f.read()
    assert (backing / "d" / "file").read_bytes() == data  # the passthrough wrote the backing file
    os.unlink(final)
    os.rmdir(mnt / "d")
    counts = mount.counts()
    assert got == data
    for kind in ("mkdir", "create", "rename", "open", "unlink", "rmdir"):
        assert counts.get(kind) == 1, (kind, counts)
    assert counts.get("write", 0) >= 1 and counts.get("read", 0) >= 1, counts
    assert counts.get("getattr", 0) >= 4, counts  # lookups: the kernel caches none
    assert counts.get("release") == 2 and counts.get("flush", 0) >= 2, counts
    assert M.metadata_ops(counts) == sum(n for k, n in counts.items() if k in M.METADATA_KINDS)
    assert not (backing / "d").exists()


def test_k_metadata_operations_take_at_least_k_over_the_rate(mount: M.MetaMount) -> None:
    """One server at ``RATE``: ``K`` stats take >= K / RATE, from one thread or from four."""
    mnt = mount.mountpoint
    mount.reset()
    start = time.perf_counter()
    for _ in range(K):
        os.stat(mnt)
    serial = time.perf_counter() - start
    assert mount.reset() == {"getattr": K}
    assert serial >= K / RATE

    barrier = threading.Barrier(4)

    def stats(n: int) -> None:
        barrier.wait()
        for _ in range(n):
            os.stat(mnt)

    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(stats, [K // 4] * 4))
    parallel = time.perf_counter() - start
    assert mount.counts() == {"getattr": K // 4 * 4}
    assert parallel >= (K // 4 * 4) / RATE, "the metadata rate is not shared by the threads"


def test_the_rate_can_change_and_reads_and_writes_are_not_throttled(mount: M.MetaMount) -> None:
    path = os.path.join(mount.mountpoint, "data")
    block = os.urandom(1 << 20)
    mount.set_rate(5)  # 200 ms per metadata request
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # a few requests: about a second
        try:
            mount.reset()
            start = time.perf_counter()
            for i in range(8):
                os.pwrite(fd, block, i << 20)
            for i in range(8):
                assert os.pread(fd, 1 << 20, i << 20) == block
            elapsed = time.perf_counter() - start
            counts = mount.reset()
        finally:
            os.close(fd)
    finally:
        mount.set_rate(RATE)
    # the kernel may stat the file around the data (attributes are never cached): only
    # those requests wait at 200 ms each; the 16 MiB of data requests themselves do not
    assert counts.get("write", 0) >= 8 and counts.get("read", 0) >= 1, counts
    assert elapsed < (M.metadata_ops(counts) + 2) * 0.2, (elapsed, counts)
    os.unlink(path)


def test_a_mount_that_fails_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the bench turns into a skip: a server that cannot start, or directories that
    cannot be made, raise MountUnavailable with the reason, and leave no mount behind."""
    (tmp_path / "file").write_text("")
    with pytest.raises(M.MountUnavailable):
        M.MetaMount(str(tmp_path / "backing"), str(tmp_path / "file" / "mnt"), RATE).start()
    monkeypatch.setattr(M.sys, "executable", "/bin/false")  # the server exits at once
    fs = M.MetaMount(str(tmp_path / "backing"), str(tmp_path / "mnt"), RATE)
    with pytest.raises(M.MountUnavailable) as failed:
        fs.start()
    assert str(failed.value)
    assert not os.path.ismount(tmp_path / "mnt")
    fs.close()  # closing a mount that never started is harmless
