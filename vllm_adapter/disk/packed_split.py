"""A packed store job split across the tier's I/O pool (issue #30 item 1: queue depth
inside a job).

A store job of at least twice :data:`PART_BYTES` of new sections is handed to vLLM's
pool as ``n`` sub-tasks (:func:`part_count`: one per ``PART_BYTES``, at most
:data:`MAX_PARTS` and the pool's threads; vLLM's ``JobState`` finishes the job when all ``n``
have run, failed if any raised).  The sub-tasks share one :class:`SplitStore`:

* the first to run reserves the job's files in the root's ledger (never vLLM's
  scheduler thread, which only enqueues) and creates each file's temporary file, sized
  to the whole file; the others wait for it on the store's lock.  A refused store
  writes nothing;
* each sub-task hashes its contiguous range of sections (:func:`split_parts`: the job's
  sections in file order, cut into ``n`` ranges of about equal bytes) and writes it at
  its offsets in one vectored write, while the others do the same with theirs;
* the last to finish writes each file's header (it needs every section's checksum),
  fsyncs if the tier asks, renames it into place and completes the reservation: a file
  any of whose ranges failed is removed instead and its reservation fails.

A failure is counted and raised once, by the last sub-task (the first error seen);
the sub-tasks that failed before it return, so the pool fails the job once.  The files
are byte for byte what the one-task store (:func:`~vllm_adapter.disk.packed_file.store_packed`)
writes.  Every file operation goes through the tier's
:class:`~vllm_adapter.disk.fileio.TierFileIO`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from reference.packed import page_round
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk.chunk_file import ChunkIO
from vllm_adapter.disk.fileio import TierFileIO

__all__ = ["MAX_PARTS", "PART_BYTES", "Part", "SplitStore", "part_count", "split_parts"]

PART_BYTES = 8 << 20
"""A store job is split into sub-tasks of at least this many payload bytes: below it, the
job stays one task (the one-task store's single vectored write)."""
MAX_PARTS = 8
"""At most this many sub-tasks per job (and at most the pool's threads)."""


def part_count(job_bytes: int, threads: int, part_bytes: int = PART_BYTES,
               max_parts: int = MAX_PARTS) -> int:
    """How many sub-tasks a store job of ``job_bytes`` payload bytes gets (1: not split)."""
    return max(1, min(max_parts, threads, job_bytes // max(1, part_bytes)))


@dataclass(frozen=True)
class Part:
    """Sections ``first`` to ``stop`` (excluded) of a job's file ``file``."""

    file: int
    first: int
    stop: int


def split_parts(lengths: Sequence[Sequence[int]], n: int) -> list[list[Part]]:
    """The job's sections (``lengths[f][s]``: section ``s`` of file ``f``), in file order,
    cut into ``n`` contiguous ranges of about equal (page-rounded) bytes; each range as
    one :class:`Part` per file it spans.  Some ranges are empty when there are fewer
    sections than ``n``."""
    flat = [(f, s, page_round(n_)) for f, file_ in enumerate(lengths)
            for s, n_ in enumerate(file_)]
    total = sum(b for _, _, b in flat)
    out: list[list[Part]] = [[] for _ in range(n)]
    at = 0
    for f, s, b in flat:
        j = min(n - 1, at * n // total) if total else 0
        parts = out[j]
        if parts and parts[-1].file == f and parts[-1].stop == s:
            parts[-1] = Part(f, parts[-1].first, s + 1)
        else:
            parts.append(Part(f, s, s + 1))
        at += b
    return out


@dataclass
class _File:
    """One admitted file of the job while its parts are written."""

    path: str
    plan: P.PackedPlan
    sums: list[bytes]
    temp: P.PackedTemp | None = None
    error: BaseException | None = None


class SplitStore:
    """One store job's shared state across its ``n`` sub-tasks (:attr:`tasks`).

    ``reserve()``: the job's admitted files ``(path, keys)`` (raises when refused);
    ``complete(results)``: the ledger's completion of ``(path, ok)`` for each admitted file;
    ``written(path, header)``: a file renamed into place (the index), before completion;
    ``failed(error)``: the store failed (counted once); ``recycled(path)``: the temporary
    file a recycled victim became for ``path`` (None: create one)."""

    def __init__(
        self, n: int, *, reserve: Callable[[], Sequence[tuple[str, tuple[bytes, ...]]]],
        complete: Callable[[list[tuple[str, bool]]], Any],
        written: Callable[[str, P.PackedHeader], None], failed: Callable[[BaseException], None],
        file_io: TierFileIO, io: ChunkIO, view: memoryview, offset_of: dict[bytes, int],
        size: int, recycled: Callable[[str], str | None] = lambda path: None,
    ) -> None:
        self._n = n
        self._reserve, self._complete = reserve, complete
        self._written, self._failed = written, failed
        self._file_io, self._io, self._view = file_io, io, view
        self._offset_of, self._size = offset_of, size
        self._recycled = recycled
        self._lock = threading.Lock()
        self._began = False
        self._reserved = False
        self._error: BaseException | None = None
        self._files: list[_File] = []
        self._parts: list[list[Part]] = [[] for _ in range(n)]
        self._done = 0
        self.tasks: list[Callable[[], None]] = [functools.partial(self.run, i)
                                                for i in range(n)]
        """The sub-tasks, one per part; any order, any thread."""

    def _begin(self) -> None:
        """The first sub-task's part (under the lock): reserve, then create the temporary files."""
        try:
            admitted = self._reserve()
        except BaseException as exc:
            self._error = exc
            return
        self._reserved = True
        for path, keys in admitted:
            plan = P.plan_packed(keys, [self._size] * len(keys))
            self._files.append(_File(path, plan, [b""] * len(keys)))
        for f in self._files:
            try:
                f.temp = self._file_io.open_packed(f.path, f.plan, self._io,
                                                   self._recycled(f.path))
            except Exception as exc:
                f.error = exc
        self._parts = split_parts([f.plan.lengths for f in self._files], self._n)

    def _write(self, i: int) -> None:
        for part in self._parts[i]:
            f = self._files[part.file]
            if f.error is not None or f.temp is None:
                continue
            keys = f.plan.keys[part.first : part.stop]
            try:
                sums = self._file_io.store_packed_part(
                    f.temp, f.plan, part.first, self._view,
                    [self._offset_of[k] for k in keys], self._size, self._io)
            except Exception as exc:
                with self._lock:
                    f.error = f.error or exc
                continue
            with self._lock:
                f.sums[part.first : part.stop] = sums

    def run(self, i: int) -> None:
        """Sub-task ``i``: reserve if first, write part ``i``, finish the job if last."""
        try:
            with self._lock:
                if not self._began:
                    self._began = True
                    self._begin()
            if self._reserved:
                self._write(i)
        finally:
            with self._lock:
                self._done += 1
                last = self._done == self._n
        if last:
            self._finish()

    def _finish(self) -> None:
        """The last sub-task: each file renamed into place or removed, the reservation
        completed, the first error counted and raised."""
        error = self._error
        if self._reserved:
            results: list[tuple[str, bool]] = []
            for f in self._files:
                if f.error is None and f.temp is not None:
                    try:
                        header = self._file_io.finish_packed(f.temp, f.plan, f.sums, self._io)
                        self._written(f.path, header)
                        results.append((f.path, True))
                        continue
                    except Exception as exc:
                        f.error = exc
                if f.temp is not None:  # failed: its temporary file goes (a no-op if gone)
                    self._file_io.discard_packed(f.temp)
                results.append((f.path, False))
                error = error or f.error
            try:
                self._complete(results)
            except Exception as exc:
                error = error or exc
        if error is not None:
            self._failed(error)
            raise error
