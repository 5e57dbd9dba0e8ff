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
    curves of 8 points; on the tier's layout (windows apart) the rule serves at least plain
    LRU's hits within 0.5 points at every point (against LRU on that layout and on one file
    per store job) and beats LRU by 5 points or more somewhere; no point strands a byte; on
    one file per store job the rule loses to LRU somewhere (the paragraph says so)."""
    import re

    report = (DOC.parent.parent / "reports" / "disk-curves.md").read_text()
    section = DOC.read_text().split("\n## 10. ", 1)[1].split("\n## ", 1)[0]
    assert "reports/disk-curves.md" in section and "(within 0.5 points)" in section
    curves = re.split(r"^### ", report, flags=re.MULTILINE)[1:]
    assert len(curves) == 4, [c.splitlines()[0] for c in curves]
    header = ("| disk | rule | LRU | rule - LRU | rule, recency only | one file per job: rule | "
              "one file per job: LRU | one file per job: rule - LRU | rule - LRU one file per job "
              "| stranded (rule, one file per job: rule) |")
    best, worst_one_file = -100.0, 100.0
    for curve in curves:
        assert header in curve, curve.splitlines()[0]
        rows = [line.strip("|").split("|") for line in curve.splitlines()
                if re.match(r"^\| [0-9.]+ GiB", line)]
        assert len(rows) == 8, curve.splitlines()[0]
        for cells in rows:
            tier, one_file, tier_vs_one_file = float(cells[3]), float(cells[7]), float(cells[8])
            assert min(tier, tier_vs_one_file) >= -0.5, (curve.splitlines()[0], cells)
            assert [int(x) for x in cells[9].split(",")] == [0, 0], (curve.splitlines()[0], cells)
            best, worst_one_file = max(best, tier, tier_vs_one_file), min(worst_one_file, one_file)
    assert best >= 5.0
    assert worst_one_file < -0.5, "the rule no longer loses on one file per job: update section 10"


def test_the_curves_with_the_cpu_tier_in_front_hold_issue_31_s_target() -> None:
    """``reports/disk-curves-cpu.md`` (``scripts/disk_curves_cpu.py``: the CLI's own
    ``--sweep-disk --cpu-bytes`` figures): four curves of 8 points; in both series the rule
    serves at least LRU's hits within 0.5 points, never strands a byte, and beats LRU by 5
    points or more somewhere behind the CPU tier; the list of trailing points says none."""
    import re

    report = (DOC.parent.parent / "reports" / "disk-curves-cpu.md").read_text()
    curves = re.split(r"^### ", report, flags=re.MULTILINE)[1:]
    *curves, trailing = curves
    assert len(curves) == 4, [c.splitlines()[0] for c in curves]
    assert trailing.startswith("Points where the rule trails") and "\nNone.\n" in trailing
    best = -100.0
    for curve in curves:
        assert "--cpu-bytes" in curve and "--sweep-disk" in curve, curve.splitlines()[0]
        rows = [line.strip("|").split("|") for line in curve.splitlines()
                if re.match(r"^\| [0-9.]+ GiB", line)]
        assert len(rows) == 8, curve.splitlines()[0]
        for cells in rows:
            alone, front = float(cells[3]), float(cells[6])
            assert min(alone, front) >= -0.5, (curve.splitlines()[0], cells)
            assert cells[7].split("/")[0].strip() == "0.00 GiB", (curve.splitlines()[0], cells)
            best = max(best, front)
    assert best >= 5.0


def test_section_10_s_ablation_table_is_the_script_s_and_agrees_with_the_curves() -> None:
    """Issue #31 item 2: ``docs/semantics.md`` section 10 carries the ablation at the small
    disk (``--sweep-disk``'s second point of the agentic curve, both models) with what each
    variant costs (hit rate, stores refused, keys dropped by admission, tokens recomputed for
    lack of space, bytes stranded and on disk), as ``scripts/disk_ablation.py --doc`` writes
    it (``--check`` reruns it).  Its figures agree with ``reports/disk-curves.md`` at that
    point (the rule with admission and refusals, LRU without admission, the rule without its
    order, both on one file per store job), and no variant of the rule strands a byte."""
    import re

    section = DOC.read_text().split("\n## 10. ", 1)[1].split("\n## ", 1)[0]
    found = re.search(r"<!-- generated:disk-ablation -->(.*?)<!-- /generated:disk-ablation -->",
                      section, re.S)
    assert found, "section 10 has no generated:disk-ablation region (scripts/disk_ablation.py --doc)"
    region = found[1]
    assert "scripts/disk_ablation.py" in region
    report = (DOC.parent.parent / "reports" / "disk-curves.md").read_text()
    tables = re.split(r"^#### ", region, flags=re.MULTILINE)[1:]
    assert len(tables) == 2, [t.splitlines()[0] for t in tables]
    for part in tables:
        model = part.split(":", 1)[0]
        assert "stores refused | keys dropped" in part and "recomputed for space/1M" in part
        rows = {cells[0].strip(): cells for cells in
                (line.strip("|").split("|") for line in part.splitlines()
                 if line.startswith("| ") and not line.startswith("| variant"))}
        assert len(rows) == 13, (model, list(rows))
        curve = report.split(f"### {model}: agentic", 1)[1].split("\n### ", 1)[0]
        size = re.search(r"\(([0-9.]+ GiB)\)", part.splitlines()[0])
        assert size, part.splitlines()[0]
        point = next(line.strip("|").split("|") for line in curve.splitlines()
                     if line.startswith(f"| {size[1]} |"))
        expect = {
            "rule (leaves first), admission on, refused whole": point[1],
            "LRU, admission off, refused whole": point[2],
            "rule, recency only (no passed windows first)": point[4],
            "rule, one file per store job (before #31)": point[5],
            "LRU, one file per store job (before #31)": point[6],
        }
        for variant, hit_rate in expect.items():
            assert rows[variant][1].strip() == hit_rate.strip(), (model, variant)
        for variant, cells in rows.items():
            if variant.startswith("rule"):
                assert cells[6].strip() == "0.00 GiB", (model, variant, cells)


def test_section_10_s_repair_summary_is_the_script_s_and_says_it_was_not_kept() -> None:
    """Issue #31 item 3: ``docs/semantics.md`` section 10 carries repair's summary as
    ``scripts/disk_ablation.py --repair --doc`` writes it (``--repair --check`` reruns it):
    the four ``--sweep-disk --cpu-bytes`` curves, repair against the rule with the CPU tier
    in front.  The paragraph says repair was not kept: it strands nothing, is ahead of the
    rule at no point and behind it somewhere (else the verdict above it is stale)."""
    import re

    section = DOC.read_text().split("\n## 10. ", 1)[1].split("\n## ", 1)[0]
    assert "**Repair, measured and not kept**" in section
    found = re.search(r"<!-- generated:disk-repair -->(.*?)<!-- /generated:disk-repair -->",
                      section, re.S)
    assert found, "section 10 has no generated:disk-repair region (disk_ablation.py --repair --doc)"
    region = found[1]
    assert "scripts/disk_ablation.py --repair" in region
    rows = [line.strip("|").split("|") for line in region.splitlines()
            if line.startswith("| ") and not line.startswith("| curve")]
    assert len(rows) == 4, rows
    behind = 0
    for cells in rows:
        assert cells[-1].strip() == "0.00 GiB", cells
        points_behind, points_ahead = (int(x) for x in cells[1].split("/"))
        assert points_ahead == 0, ("repair gains somewhere: update section 10's verdict", cells)
        behind += points_behind
    assert behind > 0, "repair loses nowhere: update section 10's verdict"
