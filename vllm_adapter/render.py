"""The project's one table renderer: aligned text columns or a GitHub markdown table.

Built on ``tabulate`` (installed with vLLM).  Cells print as ``str(cell)``, never
re-formatted as numbers (``disable_numparse``), so ``"51.20"`` stays ``"51.20"``.
No vLLM import: the CLI, the conformance report and the docs tables all use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

from tabulate import tabulate

__all__ = ["Align", "TableFormat", "render_table"]

TableFormat = Literal["text", "markdown"]
Align = Literal["left", "right"]


def render_table(
    headers: Sequence[str],
    rows: Iterable[Sequence[object]],
    fmt: TableFormat = "markdown",
    *,
    align: Sequence[Align] | None = None,
) -> str:
    """``rows`` under ``headers``, without a trailing newline.

    * ``text``: columns as wide as their widest cell (header included), two spaces
      apart, each line right-stripped; ``align`` per column (default left).
    * ``markdown``: a GitHub pipe table (header, ``|---|`` rule, rows), cells left-aligned
      and padded to the column width (``align`` is ignored: markdown renders it).
    """
    header = [str(h) for h in headers]
    body = [[str(cell) for cell in row] for row in rows]
    for row in body:
        if len(row) != len(header):
            raise ValueError(f"table row {row!r} has {len(row)} cells, headers {len(header)}")
    if fmt == "markdown":
        return tabulate(body, headers=header, tablefmt="github", disable_numparse=True)
    if fmt != "text":
        raise ValueError(f"table format must be 'text' or 'markdown', got {fmt!r}")
    # The header goes in as a row: tabulate pads real headers by two extra spaces.
    text = tabulate(
        [header, *body],
        tablefmt="plain",
        colalign=tuple(align) if align is not None else ("left",) * len(header),
        disable_numparse=True,
    )
    return "\n".join(line.rstrip() for line in text.splitlines())
