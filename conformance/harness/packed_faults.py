"""Faults of packed files (:mod:`vllm_adapter.disk.packed_file`): damaged bytes and crafted headers.

No vLLM import: the format tests (``tests/test_packed_file.py``) and the tiered faults
lane (``conformance/lanes/test_tiered_packed.py``) both use it.

* :func:`rewrite_header`: edit a file's header fields and index entries, then sign the
  header again (its digest verifies), so a crafted index reaches the per-section checks;
* :func:`damage_index`: the bad-input cases of the packed layout: ``torn-index`` (one
  index byte flipped, digest left stale), ``section-past-end`` (the last section's
  offset moved past the file's end), ``duplicate-key`` (a second section claims the
  first one's key), ``other-version`` (a header of the next format version).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from reference.packed import FIXED_HEADER_BYTES
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk import packed_header as PH
from vllm_adapter.disk.chunk_file import digest

__all__ = ["INDEX_FAULTS", "damage_index", "entries", "pack_entries", "rewrite_header"]

INDEX_FAULTS = ("torn-index", "section-past-end", "duplicate-key", "other-version")
"""The header faults of issue #24 item 5, each a failed load of exactly the keys it affects."""

Entry = list[object]
"""An index entry: key length, group, offset, length, checksum, key."""
Edit = Callable[[list[object], list[Entry]], tuple[list[object], list[Entry]]]


def entries(index: bytes) -> list[Entry]:
    """The index entries of a header's index bytes."""
    out: list[Entry] = []
    at = 0
    while at < len(index):
        fields: list[object] = list(PH.ENTRY_STRUCT.unpack_from(index, at))
        at += PH.ENTRY_STRUCT.size
        key_len = int(fields[0])  # type: ignore[call-overload]
        out.append([*fields, index[at : at + key_len]])
        at += key_len
    return out


def pack_entries(items: Sequence[Entry]) -> bytes:
    return b"".join(PH.ENTRY_STRUCT.pack(*e[:5]) + bytes(e[5]) for e in items)  # type: ignore[call-overload]


def rewrite_header(path: Path, edit: Edit) -> None:
    """Apply ``edit(fixed fields, entries)`` to a packed file's header and re-sign it."""
    raw = bytearray(path.read_bytes())
    fixed = list(PH.FIXED_STRUCT.unpack_from(raw, 0))
    index = bytes(raw[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + int(fixed[5])])
    fields, items = edit(fixed, entries(index))
    new_index = pack_entries(items)
    fields[5] = len(new_index)
    packed = PH.FIXED_STRUCT.pack(*fields)
    end = FIXED_HEADER_BYTES + len(new_index)
    if end > int(fields[3]):  # type: ignore[call-overload]
        raise ValueError("the edited index does not fit the header")
    raw[: PH.FIXED_STRUCT.size] = packed
    raw[PH.FIXED_STRUCT.size : FIXED_HEADER_BYTES] = digest(packed + new_index)
    raw[FIXED_HEADER_BYTES:end] = new_index
    path.write_bytes(raw)


def _past_end(fields: list[object], items: list[Entry]) -> tuple[list[object], list[Entry]]:
    last = items[-1]
    last[2] = int(last[2]) + int(last[3]) + 4096  # type: ignore[call-overload]
    return fields, items


def _duplicate(fields: list[object], items: list[Entry]) -> tuple[list[object], list[Entry]]:
    if len(items) < 2:
        raise ValueError("a duplicate key needs a file of two sections")
    items[1][5] = items[0][5]
    items[1][0] = items[0][0]
    return fields, items


def _next_version(fields: list[object], items: list[Entry]) -> tuple[list[object], list[Entry]]:
    fields[1] = P.FORMAT_VERSION + 1
    return fields, items


def damage_index(paths: Sequence[Path], how: str) -> None:
    """Apply one of :data:`INDEX_FAULTS` to every packed file in ``paths``."""
    for path in paths:
        if how == "torn-index":
            raw = bytearray(path.read_bytes())
            raw[FIXED_HEADER_BYTES + 3] ^= 0x40
            path.write_bytes(raw)
        elif how == "section-past-end":
            rewrite_header(path, _past_end)
        elif how == "duplicate-key":
            if len(entries_of(path)) >= 2:
                rewrite_header(path, _duplicate)
        elif how == "other-version":
            rewrite_header(path, _next_version)
        else:
            raise ValueError(f"unknown index fault {how!r}: use one of {', '.join(INDEX_FAULTS)}")


def entries_of(path: Path) -> list[Entry]:
    raw = path.read_bytes()
    index_len = int(PH.FIXED_STRUCT.unpack_from(raw, 0)[5])
    return entries(raw[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + index_len])
