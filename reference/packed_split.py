"""How a packed store or load job is split across the tier's I/O pool (issue #30 item 1:
queue depth inside a job).

The tier (``vllm_adapter.disk.packed_split``) hands a large packed job to vLLM's pool as
several sub-tasks instead of one.  This module is the rule, stated once: the tier imports
it, and :mod:`reference.layout_economics` counts a split load's opens and reads with it.

* **How many parts** (:func:`part_count`): one per :data:`PART_BYTES` of the job's
  payload, at most :data:`MAX_PARTS` and at most the pool's threads; a job below twice
  ``PART_BYTES`` stays one task.  Stores and loads alike.
* **Where a job is cut** (:func:`cut`): its sections in the order they are written or
  read, cut into that many contiguous parts of about equal (page-rounded) bytes; a section
  is never cut.
* **A split load** (:func:`load_slices`): the sections a load job wants, file after file
  (files in a canonical order), each file's in position order, cut so.
  Each slice is one sub-task: it opens every file it touches once (so a file whose sections
  fall in two slices is opened twice) and reads each run of adjacent sections it holds of
  a file in one read (so a run that a cut falls in is two reads): :func:`load_counts`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from reference.packed import page_round, read_runs

__all__ = [
    "MAX_PARTS",
    "PART_BYTES",
    "LoadSplit",
    "cut",
    "load_counts",
    "load_slices",
    "part_count",
]

PART_BYTES = 8 << 20
"""A job is split into parts of at least this many payload bytes: below twice it, the job
stays one task."""
MAX_PARTS = 8
"""At most this many sub-tasks per job (and at most the pool's threads)."""

F = TypeVar("F", bound=Hashable)
"""What names a file (the tier: its path; the reference: a file id)."""


def part_count(job_bytes: int, threads: int, part_bytes: int = PART_BYTES,
               max_parts: int = MAX_PARTS) -> int:
    """How many sub-tasks a job of ``job_bytes`` payload bytes gets (1: not split)."""
    return max(1, min(max_parts, threads, job_bytes // max(1, part_bytes)))


def cut(sizes: Sequence[int], n: int) -> tuple[int, ...]:
    """The part (0 to ``n - 1``) of each item when items of ``sizes`` bytes, in order, are
    cut into ``n`` contiguous parts of about equal bytes: an item goes to the part its
    first byte falls in (``bytes before it * n // total``).  Non-decreasing; some parts are
    empty when there are fewer items than ``n`` (or a few items carry most bytes)."""
    if n < 1:
        raise ValueError(f"cut into {n} parts")
    total = sum(sizes)
    out, at = [], 0
    for size in sizes:
        out.append(min(n - 1, at * n // total) if total else 0)
        at += size
    return tuple(out)


@dataclass(frozen=True)
class LoadSplit:
    """What a tier's load jobs are split by: its pool's threads, the part size and the
    most parts (:func:`part_count`)."""

    threads: int
    part_bytes: int = PART_BYTES
    max_parts: int = MAX_PARTS


def load_slices(wanted: Iterable[tuple[F, int, int]],
                split: LoadSplit | None) -> tuple[tuple[tuple[F, tuple[int, ...]], ...], ...]:
    """The sub-tasks of one load job: ``wanted`` holds the ``(file, position, payload
    bytes)`` of each section the job reads (a file: anything that names one).  The job's
    sections are taken file after file, each file's in position order (the order a file is
    read), the files in a canonical order: by their wanted sections' positions and bytes.
    So the cut depends on neither the order a release hands the job's keys in nor the
    keys' hash values; files that tie hold the same positions and bytes, so which comes
    first changes no count.  The job's page-rounded bytes give the parts
    (:func:`part_count`; ``split`` None: one task) and :func:`cut` cuts them.  Each slice:
    per file it touches, the positions it reads there.  Empty parts are left out: one slice
    (the whole job) when it is not split, fewer than the part count when the cut leaves
    some part empty."""
    by_file: dict[F, dict[int, int]] = {}
    for f, p, b in wanted:
        by_file.setdefault(f, {})[p] = b
    files = sorted(by_file, key=lambda f: sorted(by_file[f].items()))
    flat = [(f, p, page_round(b)) for f in files for p, b in sorted(by_file[f].items())]
    n = 1 if split is None else part_count(sum(b for _, _, b in flat), split.threads,
                                           split.part_bytes, split.max_parts)
    parts: list[dict[F, list[int]]] = [{} for _ in range(n)]
    for (f, p, _), j in zip(flat, cut([b for _, _, b in flat], n), strict=True):
        parts[j].setdefault(f, []).append(p)
    return tuple(tuple((f, tuple(ps)) for f, ps in part.items()) for part in parts if part)


def load_counts(slices: Sequence[Sequence[tuple[Hashable, Sequence[int]]]]) -> tuple[int, int]:
    """``(opens, reads)`` of a load job split into ``slices``: one open per file per slice
    that touches it, one read per run of adjacent sections within a slice
    (:func:`reference.packed.read_runs`)."""
    opens = sum(len(s) for s in slices)
    reads = sum(read_runs(ps) for s in slices for _, ps in s)
    return opens, reads
