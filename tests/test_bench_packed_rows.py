"""The packed bench's plain-disk wall-time table (``conformance/bench/report.py``'s ``_packed``):
each row's second baseline, kvchunk's own checksummed per-chunk tier, beside its ratio against
vLLM's per-chunk tier (the layout's ratio and the integrity's, each with its interval, no
verdict), and a row of an older run without them said as not measured.  No timing, no vLLM."""

from __future__ import annotations

from typing import Any

from conformance.bench import report as R


def _row(**extra: Any) -> dict[str, Any]:
    return {
        "kind": "packed_time", "label": "DeepSeek-V4-Flash TP4", "workload": "agentic",
        "direction": "load", "cost": "disk as it is", "blocks_per_chunk": 1,
        "target_checked": True, "prompt_tokens": 150_000, "filesystem": "ext4 on /",
        "o_direct": True, "threads": 16, "rounds": 9,
        "per_chunk_s_median": 0.5, "packed_s_median": 0.4, "per_chunk_gbps": 1.2,
        "packed_gbps": 1.5, "ratio": 1.25, "ratio_ci": [1.2, 1.3],
        "per_chunk_job_p50_s": 0.01, "per_chunk_job_p99_s": 0.02,
        "packed_job_p50_s": 0.03, "packed_job_p99_s": 0.04,
        "limit_unavailable": "fio not installed", **extra,
    }


def _line(rows: list[dict[str, Any]], label: str) -> list[str]:
    return [x for x in R._packed(rows) if x.startswith(f"| {label}")]


def test_each_row_shows_the_second_baseline_beside_the_target_ratio() -> None:
    row = _row(kvchunk_per_chunk_s_median=0.625, layout_ratio=1.56,
               layout_ratio_ci=[1.41, 1.73], integrity_ratio=0.8,
               integrity_ratio_ci=[0.74, 0.87], kvchunk_per_chunk_job_p50_s=0.05,
               kvchunk_per_chunk_job_p99_s=0.06)
    times, jobs = _line([row], "DeepSeek-V4-Flash TP4")
    cells = [c.strip() for c in times.split("|")]
    assert "0.500 / 0.625 / 0.400" in cells
    speed_up = cells.index("1.25 [1.20, 1.30]")
    assert cells[speed_up + 1] == "met"  # the target judges vLLM's ratio alone
    assert cells[speed_up + 2:speed_up + 4] == ["1.56 [1.41, 1.73]", "0.80 [0.74, 0.87]"]
    assert [c.strip() for c in jobs.split("|")][-4:-1] == ["10.0 / 20.0", "50.0 / 60.0",
                                                           "30.0 / 40.0"]


def test_a_row_without_the_second_baseline_says_it_was_not_measured() -> None:
    times, jobs = _line([_row()], "DeepSeek-V4-Flash TP4")
    cells = [c.strip() for c in times.split("|")]
    assert "0.500 / - / 0.400" in cells
    assert cells[-3:-1] == ["-", "-"]
    assert [c.strip() for c in jobs.split("|")][-3] == "-"


def _limit_line(**extra: Any) -> list[str]:
    row = _row(**extra)
    del row["limit_unavailable"]
    row.update(limit_gbps=1.6, limit_s=[0.4], limit_io_bytes=1, limit_file_bytes=2 << 20,
               limit_files=16, limit_block_bytes=1 << 20)
    line = next(x for x in R._packed_limit([row]) if x.startswith("| DeepSeek-V4-Flash TP4"))
    return [c.strip() for c in line.split("|")]


def test_a_limit_missed_once_shows_both_batches_and_the_verdict_of_both() -> None:
    cells = _limit_line(limit_ratio=0.85, limit_ratio_ci=[0.8, 0.88], confirm_limit_ratio=0.93,
                        confirm_limit_ratio_ci=[0.89, 0.97])
    assert "0.85 [0.80, 0.88], again 0.93 [0.89, 0.97]" in cells
    assert "**inconclusive**" in cells
    cells = _limit_line(limit_ratio=0.85, limit_ratio_ci=[0.8, 0.88], confirm_limit_ratio=0.84,
                        confirm_limit_ratio_ci=[0.8, 0.87])
    assert "**missed**" in cells
    cells = _limit_line(limit_ratio=0.95, limit_ratio_ci=[0.92, 0.98])
    assert "0.95 [0.92, 0.98]" in cells and "met" in cells
