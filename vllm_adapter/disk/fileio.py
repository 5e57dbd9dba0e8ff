"""The tier's file I/O as one object: every file the tier reads or writes goes through it.

:class:`~vllm_adapter.disk.tier.KvchunkFileTierManager` builds one per tier from its
class attribute ``file_io_factory`` and calls files only through it, so a test wraps
this object (``conformance/harness/safe_fs_faults.py``'s probes) to count calls or inject
faults; a call moved inside the tier still goes through the object, and a probe that
saw no call says so (its counts stay zero).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from vllm_adapter.disk import chunk_file as C
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk import packed_io as PIO

__all__ = ["TierFileIO"]


class TierFileIO:
    """The default file I/O: :mod:`~vllm_adapter.disk.chunk_file`'s and
    :mod:`~vllm_adapter.disk.packed_io`'s functions, unchanged."""

    def store_chunks(self, paths: Sequence[str], key_ids: Sequence[bytes], view: memoryview,
                     offsets: Sequence[int], size: int, io: C.ChunkIO,
                     tmps: Sequence[str | None] | None = None) -> None:
        """Per-chunk layout: one chunk file per key (:func:`~.chunk_file.batch_store_chunks`;
        ``tmps``: recycled victims to overwrite)."""
        C.batch_store_chunks(list(paths), list(key_ids), view, list(offsets), size, io, tmps)

    def load_chunks(self, paths: Sequence[str], key_ids: Sequence[bytes], view: memoryview,
                    offsets: Sequence[int], size: int, io: C.ChunkIO) -> None:
        """Per-chunk layout: a job's chunk files, verified (:func:`~.chunk_file.batch_load_chunks`)."""
        C.batch_load_chunks(list(paths), list(key_ids), view, list(offsets), size, io)

    def store_packed(self, path: str, keys: Sequence[bytes], view: memoryview,
                     offsets: Sequence[int], size: int, io: C.ChunkIO,
                     tmp: str | None = None) -> P.PackedHeader:
        """Packed layout: one file of a store job's keys (its full-attention keys, or its window
        keys); its header as written (the
        sections and the file's identity, for the index); ``tmp``: a recycled victim to
        overwrite."""
        return PIO.store_packed_file(path, keys, view, offsets, size, io, tmp)

    def open_packed(self, path: str, plan: P.PackedPlan, io: C.ChunkIO,
                    tmp: str | None = None) -> P.PackedTemp:
        """Packed layout, a store in parts: ``path``'s temporary file, sized to ``plan``
        (:func:`~.packed_file.open_packed_temp`; ``tmp``: a recycled victim)."""
        return P.open_packed_temp(path, plan, io, tmp)

    def store_packed_part(self, temp: P.PackedTemp, plan: P.PackedPlan, first: int,
                          view: memoryview, offsets: Sequence[int], size: int,
                          io: C.ChunkIO) -> list[bytes]:
        """Packed layout, a store in parts: the sections ``first``, ``first + 1``, ... (region
        rows at ``offsets``) hashed and written at their offsets; their checksums
        (:func:`~.packed_file.write_packed_range`)."""
        return P.write_packed_range(temp, plan, first, C.slices(view, offsets, size), io)

    def finish_packed(self, temp: P.PackedTemp, plan: P.PackedPlan, sums: Sequence[bytes],
                      io: C.ChunkIO) -> P.PackedHeader:
        """Packed layout, a store in parts: the header written, the file renamed into place
        (:func:`~.packed_file.finish_packed_temp`); its header as written."""
        header = P.finish_packed_temp(temp, plan, sums, io)
        io.counters.add(files_stored=1, sections_stored=len(header.sections))
        io.counters.per_group("sections_stored_per_group", [s.group for s in header.sections])
        return header

    def discard_packed(self, temp: P.PackedTemp) -> None:
        """Packed layout, a store in parts that failed: its temporary file closed and removed."""
        P.discard_packed_temp(temp)

    def load_packed(self, index: PIO.PackedIndex, keys: Sequence[Any], view: memoryview,
                    offsets: Sequence[int], size: int, io: C.ChunkIO,
                    plan: PIO.LoadPlan | None = None) -> None:
        """Packed layout: a job's keys from the files the index names (a file unchanged
        since it was indexed is read without its header), read with :meth:`preadv`;
        ``plan``: ``keys`` are one slice of a job split across the pool (one call per slice,
        :mod:`~vllm_adapter.disk.packed_split`)."""
        PIO.load_packed_files(index, keys, view, offsets, size, io, self.preadv, plan)

    def preadv(self, fd: int, buffers: list[Any], offset: int) -> int:
        """Packed layout: every read of a packed file's header or sections (``os.preadv``)."""
        return os.preadv(fd, buffers, offset)
