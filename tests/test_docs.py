"""docs/semantics.md §7 is the output of ``python -m conformance.harness.tables``, verbatim."""

from __future__ import annotations

from pathlib import Path

from conformance.harness.tables import DSV4_TP4, GEMMA4_TP2, table

DOC = Path(__file__).resolve().parent.parent / "docs" / "semantics.md"


def test_worked_example_tables_match_the_reference() -> None:
    text = DOC.read_text()
    for geometry in (GEMMA4_TP2, DSV4_TP4):
        computed = table(geometry)
        assert computed in text, (
            f"docs/semantics.md §7 differs from `python -m conformance.harness.tables` for "
            f"{geometry.name}; paste its output:\n{computed}"
        )


def test_the_eviction_curves_hold_what_semantics_section_10_claims() -> None:
    """``docs/semantics.md`` section 10's claims against ``reports/disk-curves.md``: four
    curves of 8 points; with windows apart the rule serves at least plain LRU's hits within
    0.5 points at every point (against LRU with windows apart and on the tier's layout) and
    beats LRU by 5 points or more somewhere; no point strands a byte; on the tier's layout
    the rule still loses to LRU somewhere (the paragraph says so)."""
    import re

    report = (DOC.parent.parent / "reports" / "disk-curves.md").read_text()
    section = DOC.read_text().split("\n## 10. ", 1)[1].split("\n## ", 1)[0]
    assert "reports/disk-curves.md" in section and "(within 0.5 points)" in section
    curves = re.split(r"^### ", report, flags=re.MULTILINE)[1:]
    assert len(curves) == 4, [c.splitlines()[0] for c in curves]
    best, worst_today = -100.0, 100.0
    for curve in curves:
        rows = [line.strip("|").split("|") for line in curve.splitlines()
                if re.match(r"^\| [0-9.]+ GiB", line)]
        assert len(rows) == 8, curve.splitlines()[0]
        for cells in rows:
            today, apart, apart_vs_today = float(cells[3]), float(cells[7]), float(cells[8])
            assert min(apart, apart_vs_today) >= -0.5, (curve.splitlines()[0], cells)
            assert [int(x) for x in cells[9].split(",")] == [0, 0], (curve.splitlines()[0], cells)
            best, worst_today = max(best, apart, apart_vs_today), min(worst_today, today)
    assert best >= 5.0
    assert worst_today < -0.5, "the rule no longer loses on the tier's layout: update section 10"
