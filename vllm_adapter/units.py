"""Byte counts as operators write them: ``26843545600``, ``25GiB``, ``800GB``.

One parser for every place that takes a size: the CLI's ``--cpu-bytes``,
``--chunk-bytes`` and ``--disk-bytes`` (:mod:`vllm_adapter.cli.args`) and the disk
tier's ``disk_bytes_to_use`` (:mod:`vllm_adapter.disk.budget`), so a value the CLI
prints or accepts is one the tier accepts.  No vLLM and no CLI import.
"""

from __future__ import annotations

import re
from fractions import Fraction

from pydantic import ByteSize

__all__ = ["BYTE_UNITS", "BYTES_EXAMPLES", "parse_bytes"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
BYTE_UNITS: dict[str, int] = {
    unit: int(multiplier)
    for unit, multiplier in ByteSize.byte_sizes.items()
    if unit.endswith("b")
}
"""pydantic's ``ByteSize`` units (``KB`` = 1000, ``KiB`` = 1024, ...), minus its bit units
and its one-letter shorthands (``25G`` is 25 * 10**9 there, a trap next to ``GiB``)."""
BYTES_EXAMPLES = "26843545600, 25GiB or 16MiB"
"""Valid values, for error messages."""


def parse_bytes(text: str) -> int:
    """A byte count: ``26843545600``, ``25GiB``, ``16MiB``, ``1.5GB`` (KiB = 1024, KB = 1000).

    Units are pydantic's :data:`BYTE_UNITS` (case-insensitive); the number is exact
    (``Fraction``, not pydantic's float), so ``1.5B`` is refused where ``ByteSize``
    would truncate it to 1, and a bare number is digits only (``ByteSize`` takes ``1_0``).
    A ``ValueError`` (its message starting "must be") otherwise, and for zero.
    """
    match = _SIZE.match(text)
    unit = (match.group(2).lower() or "b") if match else ""
    if match is None or unit not in BYTE_UNITS:
        raise ValueError(f"must be a byte count such as {BYTES_EXAMPLES}, got {text!r}")
    value = Fraction(match.group(1)) * BYTE_UNITS[unit]
    if value.denominator != 1 or value <= 0:
        raise ValueError(
            f"must be a positive whole number of bytes, got {text!r} (= {float(value):g} bytes)"
        )
    return int(value)
