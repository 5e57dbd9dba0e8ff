"""The plain-disk limit row's ``fio`` job (:mod:`conformance.bench.fio_limit`) and the target
that judges a second ratio of one row (:attr:`conformance.bench.Target.field`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conformance.bench import TARGETS
from conformance.bench import fio_limit as FIO


def _job(tmp_path: Path, direction: str = "store", **kw: int) -> FIO.FioJob:
    shape = {"total_bytes": 10 << 20, "file_bytes": 1_000_000, "block_bytes": 256 << 10,
             "threads": 4} | kw
    return FIO.FioJob(str(tmp_path / "fio"), direction, direct=False, **shape)


def test_the_job_moves_at_least_the_pass_bytes_in_files_of_whole_ios(tmp_path: Path) -> None:
    for total, file_bytes, block, threads in [(10 << 20, 1_000_000, 256 << 10, 4),
                                              (4096, 4096, 4096, 16), (7 << 20, 3 << 20, 1 << 20, 3)]:
        job = _job(tmp_path, total_bytes=total, file_bytes=file_bytes, block_bytes=block,
                   threads=threads)
        assert job.io_file_bytes % block == 0 and job.io_file_bytes >= file_bytes
        assert job.io_file_bytes - file_bytes < block
        moved = job.files_per_job * job.threads * job.io_file_bytes
        assert moved >= total, (total, moved)
        # no more than one file per job beyond the pass's bytes
        assert moved - total < job.threads * job.io_file_bytes
        argv = job.argv()
        assert f"--numjobs={threads}" in argv and f"--bs={block}" in argv
        assert "--ioengine=psync" in argv  # one I/O in flight per job: queue depth = threads


def test_bad_shapes_are_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="direction"):
        _job(tmp_path, "write")
    with pytest.raises(ValueError, match="threads"):
        _job(tmp_path, threads=0)


def test_parse_reads_the_direction_asked(tmp_path: Path) -> None:
    out = "note: both groups\n" + json.dumps({"jobs": [{
        "write": {"io_bytes": 2_000, "bw_bytes": 1_000},
        "read": {"io_bytes": 9_000, "bw_bytes": 3_000}}]})
    w, r = FIO.parse(out, "store"), FIO.parse(out, "load")
    assert (w.io_bytes, w.seconds) == (2_000, 2.0)
    assert (r.io_bytes, r.seconds) == (9_000, 3.0)
    with pytest.raises(ValueError, match="moved nothing"):
        FIO.parse(json.dumps({"jobs": [{"write": {"io_bytes": 0, "bw_bytes": 0}}]}), "store")
    with pytest.raises(ValueError, match="no JSON"):
        FIO.parse("fio: command failed", "store")


@pytest.mark.skipif(FIO.unavailable() is not None, reason=str(FIO.unavailable()))
def test_fio_writes_then_reads_the_pass_bytes(tmp_path: Path) -> None:
    store = _job(tmp_path, "store")
    wrote = FIO.run(store)
    assert wrote.io_bytes >= store.total_bytes and wrote.bytes_per_s > 0
    assert not os.path.exists(store.directory), "a write's files must not stay on disk"
    load = _job(tmp_path, "load")
    try:
        read = FIO.run(load)
        assert read.io_bytes >= load.total_bytes and read.bytes_per_s > 0
    finally:
        FIO.clear(load.directory)
    assert not os.path.exists(load.directory)


def test_a_row_is_judged_by_the_limit_target_only_where_the_limit_was_measured() -> None:
    target = next(t for t in TARGETS if t.field == "limit_ratio")
    layout = next(t for t in TARGETS if t.kind == "packed_time" and t.field == "ratio")
    row = {"kind": "packed_time", "ratio": 1.2, "ratio_ci": [1.1, 1.3], "blocks_per_chunk": 1}
    assert layout.applies(row) and not target.applies(row)  # fio not installed
    slow = row | {"limit_ratio": 0.5, "limit_ratio_ci": [0.45, 0.55]}
    assert layout.verdict(slow) == "met"  # each target reads its own ratio
    assert target.applies(slow) and target.verdict(slow) == "missed"
    assert "0.500 [0.450, 0.550]" in target.explain(slow)
    near = row | {"limit_ratio": 0.95, "limit_ratio_ci": [0.85, 1.05]}
    assert target.verdict(near) == "inconclusive"
