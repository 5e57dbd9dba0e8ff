"""The packed file layout: a store job's keys in one or two files, every key a section.

vLLM's file tier writes one file per chunk per KV-cache group.  kvchunk's
packed layout writes the keys of one **store job** the tiering manager hands the
tier (one GPU->CPU store of one request: every key it stored, all groups) as the
sections of at most two files (:func:`store_job_files`): its full-attention keys in
one, its window keys (the groups with a window: sliding, chunked-local, Mamba) in the
other, and a job with keys of one kind only in one file.  A workload writes one or
two files per store job, not one per chunk key, at the same chunk size.  The window
keys go apart so that the eviction rule can evict the window file of a boundary a
prefix went on past while the full-attention file, the prefix of deeper boundaries,
stays (issue #31; ``docs/semantics.md`` section 10).  This module is the layout's
definition; the tier (``vllm_adapter.disk.packed_file``, ``vllm_adapter.disk.tier``)
writes and reads exactly these bytes, and the economics (:mod:`reference.economics`,
:mod:`reference.disk_economics`) count files, sections and reads with it.

A packed file is::

    [header: header_bytes(key sizes), a multiple of PAGE]
    [section 0 payload, padded to a multiple of PAGE]
    [section 1 payload, padded to a multiple of PAGE]
    ...

* The header holds a fixed part (:data:`FIXED_HEADER_BYTES`: magic, format
  version, checksum algorithm, header size, section count, index size, the
  geometry namespace, and a digest of the whole header), then one index entry per
  section (:data:`ENTRY_FIXED_BYTES` plus the key): the key, its group, the
  section's offset and length, and the payload's checksum.
* Every section starts on a page boundary, so ``O_DIRECT`` reads land whole
  sections into page-aligned memory, and a file's sections follow each other in job
  order: group-major, each group's chunks in prefix order (the Planner's store job; a tier
  handed the keys in another order, as vLLM 0.33.0's set, writes them in this one).
* A load reads the sections it needs and nothing else; sections adjacent in the
  file and wanted by the same load are one read (:func:`read_runs`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

from reference.keys import split_key
from reference.mathutil import cdiv

__all__ = [
    "DIGEST_BYTES",
    "ENTRY_FIXED_BYTES",
    "FIXED_HEADER_BYTES",
    "PAGE",
    "header_bytes",
    "packed_file_bytes",
    "page_round",
    "read_runs",
    "section_offsets",
    "store_job_files",
]

PAGE = 4096
"""Sections and the header are page multiples: ``O_DIRECT`` and page-cache friendly."""
DIGEST_BYTES = 16
"""A payload checksum (and the header digest): 128 bits."""
FIXED_HEADER_BYTES = 40 + DIGEST_BYTES
"""magic (8), version (2), checksum id (2), header bytes (4), section count (4), index
bytes (4), namespace digest (16); then the header digest (16)."""
ENTRY_FIXED_BYTES = 2 + 4 + 8 + 8 + DIGEST_BYTES
"""Per section: key length (2), group (4), offset (8), length (8), checksum (16); the key follows."""


def store_job_files(keys: Sequence[bytes], full_groups: Collection[int]) -> tuple[tuple[bytes, ...], ...]:
    """The packed files one store job of ``keys`` writes: its keys of ``full_groups`` (the
    full-attention groups, :attr:`reference.knobs.Chunking.full_groups`), then its other
    keys (window groups), each in job order; a kind the job lacks writes no file."""
    full = tuple(k for k in keys if split_key(k)[1] in full_groups)
    windows = tuple(k for k in keys if split_key(k)[1] not in full_groups)
    return tuple(f for f in (full, windows) if f)


def page_round(n: int) -> int:
    """``n`` rounded up to a whole number of pages."""
    return cdiv(n, PAGE) * PAGE


def header_bytes(key_bytes: Sequence[int]) -> int:
    """The header of a file whose sections' keys are ``key_bytes`` long: page-rounded."""
    return page_round(FIXED_HEADER_BYTES + sum(ENTRY_FIXED_BYTES + k for k in key_bytes))


def section_offsets(section_bytes: Sequence[int], key_bytes: Sequence[int]) -> tuple[int, ...]:
    """Where each section's payload starts: after the header, each on a page boundary."""
    if len(section_bytes) != len(key_bytes):
        raise ValueError(f"{len(section_bytes)} sections but {len(key_bytes)} keys")
    offsets, at = [], header_bytes(key_bytes)
    for n in section_bytes:
        offsets.append(at)
        at += page_round(n)
    return tuple(offsets)


def packed_file_bytes(section_bytes: Sequence[int], key_bytes: Sequence[int]) -> int:
    """The size of a packed file: its header plus every section, page-rounded."""
    if len(section_bytes) != len(key_bytes):
        raise ValueError(f"{len(section_bytes)} sections but {len(key_bytes)} keys")
    return header_bytes(key_bytes) + sum(page_round(n) for n in section_bytes)


def read_runs(positions: Iterable[int]) -> int:
    """How many reads a load of these section positions (of one file) takes.

    Sections at consecutive positions are adjacent in the file (each starts where
    the one before ends, page-rounded), so a run of consecutive positions is one
    read: ``{0, 1, 2, 5}`` is two reads.
    """
    ordered = sorted(set(positions))
    return sum(1 for i, p in enumerate(ordered) if i == 0 or ordered[i - 1] != p - 1)
