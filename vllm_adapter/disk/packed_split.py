"""Packed store and load jobs split across the tier's I/O pool (issue #30 item 1: queue
depth inside a job).

The sizes and the cut are :mod:`reference.packed_split`'s (:data:`PART_BYTES`,
:data:`MAX_PARTS`, :func:`part_count` are its objects), the rule the reference counts
split loads with.

A store job of at least twice :data:`PART_BYTES` of new sections is handed to vLLM's
pool as ``n`` sub-tasks (:func:`part_count`: one per ``PART_BYTES``, at most
:data:`MAX_PARTS` and the pool's threads; vLLM's ``JobState`` finishes the job when all
``n`` have run, failed if any raised).  The sub-tasks share one :class:`SplitStore`:

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

A load job of as many bytes, every key placed by the index with its section
(:class:`~vllm_adapter.disk.packed_io.LoadPlan`), is one sub-task per slice of
:func:`reference.packed_split.load_slices` (:func:`load_job_slices`, :class:`SplitLoad`).
Each calls the tier's :meth:`~vllm_adapter.disk.fileio.TierFileIO.load_packed` with its
keys and the job's plan: it opens each file of its slice (so a file in two slices is
opened twice, as the reference counts), checks it (``fstat`` against the indexed identity,
the header parsed on a mismatch, once per job: the file's
:class:`~vllm_adapter.disk.packed_file.SharedFile`), reads each run of adjacent sections
in one ``preadv`` into the destination rows and **verifies every section's checksum**.
The last sub-task reports the job once, as the one-task load reports it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from reference.packed import page_round
from reference.packed_split import MAX_PARTS, PART_BYTES, LoadSplit, cut, load_slices, part_count
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk import packed_io as PIO
from vllm_adapter.disk.chunk_file import ChunkIO
from vllm_adapter.disk.fileio import TierFileIO

__all__ = ["MAX_PARTS", "PART_BYTES", "Part", "SplitLoad", "SplitStore", "load_job_slices",
           "part_count", "pool_threads", "split_load_job", "split_parts", "store_job_parts"]


def pool_threads(pool: Any) -> int:
    """The threads of vLLM's I/O pool (its ``DualQueueThreadPool``: the read-priority and
    the write-priority threads together); a job's sub-tasks are at most these."""
    return len(getattr(pool, "_threads", ())) or 1


def store_job_parts(new_keys: int, size: int, threads: int, part_bytes: int = PART_BYTES) -> int:
    """How many sub-tasks a packed store job of ``new_keys`` sections of ``size`` payload
    bytes gets on a pool of ``threads`` threads (:func:`part_count` of its payload; 1: one
    task, more: a :class:`SplitStore` of that many).  The tier decides by it, and the
    packed bench (``conformance/bench/test_bench_packed.py``) runs its stores by it."""
    return part_count(new_keys * size, threads, part_bytes)


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
    flat = [(f, s) for f, file_ in enumerate(lengths) for s in range(len(file_))]
    where = cut([page_round(n_) for file_ in lengths for n_ in file_], n)
    out: list[list[Part]] = [[] for _ in range(n)]
    for (f, s), j in zip(flat, where, strict=True):
        parts = out[j]
        if parts and parts[-1].file == f and parts[-1].stop == s:
            parts[-1] = Part(f, parts[-1].first, s + 1)
        else:
            parts.append(Part(f, s, s + 1))
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


def load_job_slices(plan: PIO.LoadPlan, keys: Sequence[Any],
                    split: LoadSplit) -> list[list[int]]:
    """A load job's sub-tasks: per slice, the places of its keys in the job, file by file
    and each file's in position order.  The slices are
    :func:`reference.packed_split.load_slices` of the sections the plan places the keys
    at, the rule the reference counts the job's opens and reads with."""
    wanted: dict[bytes, tuple[str, int, int]] = {}
    at: dict[tuple[str, int], list[int]] = {}
    for i, key in enumerate(keys):
        path = plan.path_of[bytes(key)]
        indexed = plan.files[path].indexed
        assert indexed is not None
        section = indexed.sections[bytes(key)]
        wanted[bytes(key)] = (path, section.position, section.length)
        at.setdefault((path, section.position), []).append(i)
    return [[i for path, positions in part for p in positions for i in at[(path, p)]]
            for part in load_slices(wanted.values(), split)]


def split_load_job(index: PIO.PackedIndex, keys: Sequence[Any], size: int,
                   split: LoadSplit | None) -> tuple[PIO.LoadPlan, list[list[int]]] | None:
    """How a packed tier runs one load job of ``keys`` (rows of ``size`` bytes) under
    ``split``: the job's plan and its slices (:func:`load_job_slices`), or None when it is
    one task: no split, a job below two parts (:func:`part_count`), a key the index cannot
    place by its section yet, or a cut that leaves one slice."""
    if split is None:
        return None
    job_bytes = len(keys) * page_round(size)
    if part_count(job_bytes, split.threads, split.part_bytes, split.max_parts) < 2:
        return None
    plan = PIO.LoadPlan.of(index, keys)
    if plan is None:
        return None
    slices = load_job_slices(plan, keys, split)
    return (plan, slices) if len(slices) > 1 else None


class SplitLoad:
    """One load job's shared state across its sub-tasks (:attr:`tasks`), one per slice of
    :func:`load_job_slices` (each: ``load(keys, offsets)`` of the slice's keys, the tier's
    :meth:`~vllm_adapter.disk.fileio.TierFileIO.load_packed` with the job's plan).

    ``begin()`` runs once, in the first sub-task, before any load (the reservations the
    job reads); ``end(begun, error)`` runs once, in the last, with what ``begin`` returned
    and the job's error, as the one-task load reports it: an ``OSError`` whose
    ``num_succeeded`` counts the keys before the first failed key in job order and whose
    ``failed_by_file`` lists, for every file of the job, its failed keys in job order (or
    the first other exception; None when every slice loaded).  The last sub-task raises
    it, once; a slice that failed before returns, so the pool fails the job once."""

    def __init__(
        self, keys: Sequence[Any], offsets: Sequence[int], slices: Sequence[Sequence[int]],
        key_files: Sequence[str], *, begin: Callable[[], Any],
        load: Callable[[Sequence[Any], Sequence[int]], None],
        end: Callable[[Any, BaseException | None], None],
    ) -> None:
        self._keys, self._offsets = list(keys), list(offsets)
        self._slices = [list(s) for s in slices]
        self._key_files = list(key_files)
        """Each key's file (the job's plan)."""
        self._begin, self._load, self._end = begin, load, end
        self._lock = threading.Lock()
        self._began = False
        self._begun: Any = None
        self._begin_error: BaseException | None = None
        self._errors: dict[int, BaseException] = {}
        self._done = 0
        self.tasks: list[Callable[[], None]] = [functools.partial(self.run, i)
                                                for i in range(len(self._slices))]
        """The sub-tasks, one per slice; any order, any thread."""

    def run(self, i: int) -> None:
        """Sub-task ``i``: begin if first, load slice ``i``, end the job if last."""
        try:
            with self._lock:
                if not self._began:
                    self._began = True
                    try:
                        self._begun = self._begin()
                    except BaseException as exc:
                        self._begin_error = exc
            if self._begin_error is None:
                part = self._slices[i]
                try:
                    self._load([self._keys[j] for j in part], [self._offsets[j] for j in part])
                except Exception as exc:
                    with self._lock:
                        self._errors[i] = exc
        finally:
            with self._lock:
                self._done += 1
                last = self._done == len(self._slices)
        if last:
            error = self._error()
            self._end(self._begun, error)
            if error is not None:
                raise error

    def _error(self) -> BaseException | None:
        """The job's error (:meth:`run`'s last sub-task raises it)."""
        if self._begin_error is not None:
            return self._begin_error
        if not self._errors:
            return None
        first = min(self._errors, key=lambda i: min(self._slices[i]))
        exc = self._errors[first]
        if not isinstance(exc, OSError):
            return exc
        failed: set[bytes] = set()
        unknown: list[int] = []  # slices that failed without naming their keys
        for i, e in self._errors.items():
            named = getattr(e, "failed_by_file", None)
            if named is None:
                unknown.extend(self._slices[i])
            for ks in (named or {}).values():
                failed.update(bytes(k) for k in ks)
        keys = [bytes(k) for k in self._keys]
        exc.num_succeeded = min(  # type: ignore[attr-defined]
            [i for i, k in enumerate(keys) if k in failed] + unknown, default=0)
        by_file: dict[str, list[bytes]] = {path: [] for path in self._key_files}
        for key, path in zip(keys, self._key_files, strict=True):
            if key in failed:
                by_file[path].append(key)
        exc.failed_by_file = by_file  # type: ignore[attr-defined]
        return exc
