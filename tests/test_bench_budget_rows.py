"""The disk-budget bench rows' targets and sections (issue #30 item 4), on rows written here.

Which row a target checks (a start from the index snapshot, an eviction row at real
section sizes; not the small-file eviction row, not a row of the old start), and what
``reports/bench.md`` says of each (:mod:`conformance.bench.report_budget`).  No timing.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance.bench import TARGETS
from conformance.bench.report_budget import disk_budget_markdown


def _steps(value: float) -> dict[str, Any]:
    return {"s_per_100k": value, "s_per_100k_ci": [value * 0.9, value * 1.1]}


def _start(seconds: float, **extra: Any) -> dict[str, Any]:
    """A start row as ``test_budget_restart`` records it (cold page cache)."""
    row: dict[str, Any] = {
        "kind": "budget_restart", "index": "snapshot", "blocks_per_chunk": 0,
        "label": "gemma-4-31B-it TP2", "keys_per_file": 11, "file_bytes": 49152,
        "scaling": "measured at 20,000 files, scaled linearly to 100,000 (x 5)",
        "filesystem": "ext4 on /", "headline": "cold page cache", "target_checked": True,
        "s_per_100k": seconds, "s_per_100k_ci": [seconds * 0.9, seconds * 1.1],
        "ratio": seconds / 2, "ratio_ci": [seconds * 0.9 / 2, seconds * 1.1 / 2],
        "snapshot_bytes": 18_000_000, "snapshot_bytes_per_file": 900.0,
        "snapshot_write_s_per_100k": 0.7, "snapshot_cap_bytes": 960_000,
        "snapshot_within_cap": False,
        **{f"{c}_{s}": _steps(1.0) for c in ("cold", "warm")
           for s in ("total", "scan", "ledger", "index", "index_headers")},
        "warm_ledger_second_start": _steps(1.0),
    }
    row.update(extra)
    return row


def _eviction(sizes: str, ratio: float, **extra: Any) -> dict[str, Any]:
    phases = {"reserve": 0.5, "write": 3.0, "complete": 0.1}
    row: dict[str, Any] = {
        "kind": "budget_eviction", "sizes": sizes, "blocks_per_chunk": 0,
        "target_checked": sizes == "real", "label": "DeepSeek-V4-Flash TP4",
        "geometry": "deepseek-v4-flash-tp4", "keys_per_file": 1, "file_bytes": 2_011_136,
        "section_bytes": 2_007_040, "real_section_bytes": 2_007_040, "section_scale": 1,
        "files_on_full_root": 512, "stores_per_round": 64, "rounds": 7, "rule": "reachable",
        "filesystem": "ext4 on /", "o_direct": True, "ratio": ratio,
        "ratio_ci": [ratio - 0.01, ratio + 0.01], "full_files_per_s": 300.0,
        "empty_files_per_s": 310.0, "full_ms_per_store": phases, "empty_ms_per_store": phases,
    }
    row.update(extra)
    return row


def _checked_by(row: dict[str, Any]) -> list[str]:
    return [t.text for t in TARGETS if t.applies(row)]


@pytest.mark.parametrize(("seconds", "verdict"), [(1.5, "met"), (2.5, "missed"),
                                                  (2.0, "inconclusive")])
def test_a_start_from_the_snapshot_is_held_to_2_s_per_100k_files(
    seconds: float, verdict: str
) -> None:
    row = _start(seconds)
    (target,) = [t for t in TARGETS if t.applies(row)]
    assert "2 s per 100k files" in target.text and target.verdict(row) == verdict
    text = "\n".join(disk_budget_markdown([row]))
    assert f"Target <= 2 s per 100k files, cold page cache: {'met' if verdict == 'met' else f'**{verdict}**'}" in text
    assert "index from the headers (no snapshot)" in text
    assert "over the tier's cap at this budget (960,000 bytes" in text


def test_a_start_row_without_a_dropped_cache_or_of_the_old_start_is_not_checked() -> None:
    warm = _start(5.0, target_checked=False, headline="warm page cache")
    assert _checked_by(warm) == []
    assert "not checked (the page cache could not be dropped)" in "\n".join(
        disk_budget_markdown([warm]))
    old = {k: v for k, v in _start(20.0).items()
           if k not in ("index", "ratio", "ratio_ci", "target_checked")}
    assert _checked_by(old) == []
    text = "\n".join(disk_budget_markdown([old]))
    assert "Informational. " in text and "one header read per file" in text


@pytest.mark.parametrize(("ratio", "verdict"), [(0.97, "met"), (0.9, "missed")])
def test_real_size_eviction_rows_are_held_to_095(ratio: float, verdict: str) -> None:
    row = _eviction("real", ratio)
    (target,) = [t for t in TARGETS if t.applies(row)]
    assert target.min_ratio == 0.95 and target.verdict(row) == verdict
    text = "\n".join(disk_budget_markdown([row]))
    assert "eviction overhead at real section sizes" in text
    assert ("| met" if verdict == "met" else "**missed**") in text


def test_the_small_file_eviction_row_is_informational() -> None:
    small = _eviction("small", 0.6, keys_per_file=11, file_bytes=49152, section_bytes=4096)
    assert _checked_by(small) == []
    old = {k: v for k, v in small.items() if k not in ("sizes", "target_checked")}
    assert _checked_by(old) == [], "a row of the old small-file bench is checked"
    text = "\n".join(disk_budget_markdown([small]))
    assert "eviction overhead, small files" in text and "Informational" in text
    assert "real section sizes" not in text.split("Informational")[0]


def test_a_scaled_section_says_its_real_size() -> None:
    row = _eviction("real", 0.99, label="gemma-4-31B-it TP2", section_bytes=2_621_440,
                    real_section_bytes=41_943_040, section_scale=16)
    assert "2,621,440 (1/16 of the real 41,943,040)" in "\n".join(disk_budget_markdown([row]))


def _curve(series: str | None, median_s: float) -> dict[str, Any]:
    """A ``--sweep-disk`` speed row as ``test_disk_curve_speed`` records it."""
    budget = {"disk only": 10.0, "both": 20.0}.get(series or "", 10.0)
    row: dict[str, Any] = {
        "kind": "disk_curve", "label": "DeepSeek-V4-Flash TP4", "workload": "agentic-1m",
        "budget_s": budget, "seconds": [median_s] * 3, "median_s": median_s,
        "ratio": median_s / budget, "ratio_ci": [median_s * 0.95 / budget,
                                                median_s * 1.05 / budget],
        "rounds": 3, "cpu_bytes": 400 << 20 if series == "both" else None,
    }
    if series is not None:
        row["series"] = series
    return row


@pytest.mark.parametrize(("series", "median_s", "verdict"), [
    ("disk only", 8.0, "met"), ("disk only", 12.0, "missed"),
    ("both", 12.0, "met"), ("both", 24.0, "missed"),
])
def test_each_sweep_series_is_held_to_its_own_budget(series: str, median_s: float,
                                                     verdict: str) -> None:
    """Issue #31: ``--sweep-disk`` within 10 s per curve, both series within 20 s: 12 s
    meets the second and misses the first; each row is judged by its series' target only."""
    row = _curve(series, median_s)
    targets = [t for t in TARGETS if t.kind == "disk_curve" and t.applies(row)]
    assert len(targets) == 1 and targets[0].verdict(row) == verdict
    line = next(x for x in disk_budget_markdown([row]) if x.startswith("| DeepSeek"))
    cells = [c.strip() for c in line.split("|")]
    assert cells[-2] == (verdict if verdict == "met" else f"**{verdict}**")
    assert ("CPU tier 400 MiB" in line) == (series == "both")


def test_a_curve_row_of_an_older_run_is_said_as_such_and_not_checked() -> None:
    row = _curve(None, 5.0)
    assert not any(t.applies(row) for t in TARGETS if t.kind == "disk_curve")
    line = next(x for x in disk_budget_markdown([row]) if x.startswith("| DeepSeek"))
    cells = [c.strip() for c in line.split("|")]
    assert "the rule alone (older run)" in cells and cells[-2] == "-"
