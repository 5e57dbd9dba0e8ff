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
