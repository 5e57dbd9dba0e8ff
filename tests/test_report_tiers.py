"""The conformance report's side-by-side file-tier table (conformance/report.py)."""

from __future__ import annotations

from typing import Any

import pytest

from conformance.report import ConformanceReport


def _report(knob: str, outcome: str, wrong: int, xfail: str | None = None) -> pytest.TestReport:
    props: list[tuple[str, Any]] = [
        ("lane", "faults"), ("fixture", "synthetic-full"), ("knob", knob),
        ("counter:tier_wrong_loads", wrong), ("counter:files_written", 12),
    ]
    report = pytest.TestReport(
        nodeid=f"x::{knob}", location=("x", 0, knob), keywords={}, outcome=outcome,
        longrepr=None, when="call", user_properties=props,
    )
    if xfail is not None:
        report.wasxfail = xfail
    return report


def test_each_fault_case_is_one_row_with_both_tiers_and_their_totals() -> None:
    plugin = ConformanceReport()
    plugin.pytest_runtest_logreport(_report(
        "blocks_per_chunk=2, vllm fs tier, file flipped", "skipped", 12,
        "suspected-bug deviation 'fs-tier-no-checksum': no checksum"))
    plugin.pytest_runtest_logreport(_report(
        "blocks_per_chunk=2, kvchunk fs tier, file flipped", "passed", 0))
    plugin.pytest_runtest_logreport(_report("blocks_per_chunk=2, kvchunk fs tier, file missing",
                                            "passed", 0))
    totals, cases = plugin.tier_comparison()[1], plugin.tier_comparison()[0]
    flipped = next(line for line in cases.splitlines() if "file flipped" in line)
    assert "blocks_per_chunk=2, file flipped" in flipped
    assert "1 xfailed (deviation fs-tier-no-checksum)" in flipped and "1 passed" in flipped
    missing = next(line for line in cases.splitlines() if "file missing" in line)
    assert "case not run on this tier" in missing, "a one-tier case shows the other as not run"
    wrong = next(line for line in totals.splitlines() if "wrong loads" in line)
    assert [c.strip() for c in wrong.split("|")[2:4]] == ["12", "0"]
    written = next(line for line in totals.splitlines() if "files written" in line)
    assert [c.strip() for c in written.split("|")[2:4]] == ["12", "24"]


def test_no_tier_cases_no_section() -> None:
    assert ConformanceReport().tier_comparison() == ("", "")
