"""vllm_adapter.disk_model: the local-disk model is the bench's latest measurement, and the
tier's thread counts set the models' concurrency.

Expected figures are computed here from a hand-written bench result, not from the module.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_adapter import disk_model as D


def _bench(tmp_path: Path) -> Path:
    """Two sizes per direction: 1 MiB files (100 in 0.2 s write, 0.1 s read, baseline) and
    8 MiB files; baseline GB/s 1.0 and 3.0 (write), 2.0 and 4.0 (read)."""
    def run(direction: str, file_bytes: int, files: int, seconds: list[float], gbps: float) -> dict:
        return {"name": f"test_disk[g-bpc1-{direction}]", "extra_info": {
            "direction": direction, "file_bytes": file_bytes, "files": files,
            "baseline_s": seconds, "limit_gbps": gbps, "threads": 16,
            "filesystem": "ext4 on /", "o_direct": True}}
    data = {
        "datetime": "2026-12-01T10:20:30+00:00", "commit_info": {"id": "abcdef0123"},
        "benchmarks": [
            run("write", 1 << 20, 100, [0.3, 0.2, 0.1], 1.0),
            run("write", 8 << 20, 10, [1.0], 3.0),
            run("read", 1 << 20, 100, [0.1, 0.1, 0.5], 2.0),
            run("read", 8 << 20, 10, [1.0], 4.0),
            {"name": "test_other[x]", "extra_info": {}},
        ],
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return path


def test_the_local_disk_model_is_the_benchs_latest_measurement(tmp_path: Path) -> None:
    m = D.local_disk_from_bench(_bench(tmp_path))
    assert m is not None
    assert m.bandwidth_bps == pytest.approx(2.0e9)  # median of 1.0 and 3.0 GB/s
    assert m.read_bandwidth_bps == pytest.approx(3.0e9)
    assert m.file_latency_s == pytest.approx(16 * 0.2 / 100)  # 16 threads x median 0.2 s / 100
    assert m.read_file_latency_s == pytest.approx(16 * 0.1 / 100)
    assert "2026-12-01 10:20" in m.source and "abcdef0" in m.source, m.source


def test_without_the_benchs_report_there_is_no_local_model(tmp_path: Path) -> None:
    assert D.local_disk_from_bench(tmp_path / "absent.json") is None


def test_the_checkout_model_is_the_checkouts_report() -> None:
    if not D.BENCH_JSON.exists():
        pytest.fail(f"{D.BENCH_JSON} is part of the checkout (nox -s bench writes it)")
    assert D.FS_MODELS[0] == D.local_disk_from_bench(D.BENCH_JSON)
    assert [k for k in D.FS_MODEL_KEYS] == ["local", "nfs", "object-store"]


def test_thread_counts_set_the_concurrency_of_each_direction() -> None:
    base = D.FsModel("m", 16e-3, 16, 1e12, "test", read_file_latency_s=32e-3)
    m = base.with_threads(write=4, read=8)
    small = 1000  # latency-bound: seconds per file = latency / threads
    assert m.seconds_per_file(small, "write") == pytest.approx(16e-3 / 4)
    assert m.seconds_per_file(small, "read") == pytest.approx(32e-3 / 8)
    assert base.with_threads(None, None).seconds_per_file(small, "read") == pytest.approx(
        32e-3 / 16)
    only_writes = base.with_threads(write=4, read=None)  # reads keep their 16 threads
    assert only_writes.seconds_per_file(small, "read") == pytest.approx(32e-3 / 16)
    assert only_writes.seconds_per_file(small, "write") == pytest.approx(16e-3 / 4)


def test_a_shared_metadata_rate_floors_the_time_of_a_layouts_operations() -> None:
    """1,000 files of 1 MB at 1 GB/s take 1 s whatever the per-file latency the threads
    hide; a file system serving 1,000 metadata operations a second takes at least 4 s for
    4,000 of them (vLLM's per-chunk store: access, directory stat, create, rename a file),
    and says so; 500 operations (fewer files, packed) leave the bandwidth's 1 s.  A model
    without a shared rate (a local disk) ignores the operations."""
    shared = D.FsModel("shared", 2e-3, 16, 1e9, "test", metadata_ops_per_s=1000)
    files = [(1000.0, 10**6)]
    assert D.disk_time_of(shared, files, "write") == D.DiskTime(pytest.approx(1.0), "bandwidth")
    assert D.disk_time_of(shared, files, "write", 4000) == D.DiskTime(pytest.approx(4.0),
                                                                      "metadata")
    assert D.disk_time_of(shared, files, "write", 500) == D.DiskTime(pytest.approx(1.0),
                                                                     "bandwidth")
    local = D.FsModel("local", 2e-3, 16, 1e9, "test")
    assert D.disk_time_of(local, files, "write", 4000) == D.DiskTime(pytest.approx(1.0),
                                                                     "bandwidth")
    assert D.disk_time_of(shared, [], "read", 2000) == D.DiskTime(pytest.approx(2.0), "metadata")


def test_the_shared_file_system_model_has_the_cli_s_default_metadata_rate() -> None:
    """The assumed NFS/Lustre model's metadata service is the rate the engines-per-file-
    system answer defaults to (one figure, one place), and the local disk has none."""
    from vllm_adapter.metadata_model import DEFAULT_FS_METADATA_OPS

    assert D.fs_model("nfs").metadata_ops_per_s == DEFAULT_FS_METADATA_OPS
    assert D.fs_model("object-store").metadata_ops_per_s is None
    if D.LOCAL_DISK is not None:
        assert D.LOCAL_DISK.metadata_ops_per_s is None
