"""The packed tier's key index and its per-job file I/O (:mod:`vllm_adapter.disk.packed_file`'s layout).

:class:`PackedIndex` answers which packed file and section holds each key;
:func:`store_packed_file` writes one store job's keys as one packed file and
:func:`load_packed_files` loads a job's keys, each file it needs opened once.
:class:`vllm_adapter.disk.tier.KvchunkFileTierManager` calls both through its own
module's names (the conformance lanes wrap them there).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk.chunk_file import ChunkFileError, ChunkIO, slices

__all__ = ["PackedIndex", "load_packed_files", "store_packed_file"]

logger = logging.getLogger("vllm_adapter.disk.tier")


class PackedIndex:
    """Which packed file and section holds each key (thread-safe): the packed tier's lookups.

    Filled as stores finish and, when a tier starts, from the headers of the files
    already in its namespace (:meth:`rebuild`); a section that fails verification
    leaves it (:meth:`drop`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._where: dict[bytes, tuple[str, P.Section]] = {}
        self._files: dict[str, tuple[P.Section, ...]] = {}

    def add(self, path: str, sections: Sequence[P.Section]) -> None:
        with self._lock:
            for s in self._files.get(path, ()):
                if self._where.get(s.key, ("",))[0] == path:
                    del self._where[s.key]
            self._files[path] = tuple(sections)
            for s in sections:
                self._where[s.key] = (path, s)

    def get(self, key: bytes) -> tuple[str, P.Section] | None:
        with self._lock:
            return self._where.get(bytes(key))

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return isinstance(key, bytes) and key in self._where

    def drop(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._where.pop(bytes(key), None)

    def drop_file(self, path: str) -> None:
        """Forget a file and every key it holds (it is gone)."""
        with self._lock:
            for s in self._files.pop(path, ()):
                if self._where.get(s.key, ("",))[0] == path:
                    del self._where[s.key]

    def files(self) -> int:
        with self._lock:
            return len(self._files)

    def has_file(self, path: str) -> bool:
        with self._lock:
            return path in self._files

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)

    def rebuild(self, namespace_dir: str, io: ChunkIO) -> tuple[int, int]:
        """Index every packed file under ``namespace_dir`` from its header; ``(files, bad)``.

        A file whose header fails is left alone here (its keys are not indexed, so no
        load ever reads it); a section the header itself rejects is not indexed.
        """
        files = bad = 0
        for path in P.iter_packed_files(namespace_dir):
            try:
                header = P.read_packed_index(path, io.namespace, io.checksum)
            except OSError as exc:
                bad += 1
                logger.warning("kvchunk fs tier: %s not indexed: %s", path, exc)
                continue
            self.add(path, header.sections)
            files += 1
        return files, bad


def store_packed_file(
    path: str, keys: Sequence[bytes], view: memoryview, offsets: Sequence[int], size: int,
    io: ChunkIO,
) -> tuple[P.Section, ...]:
    """One packed file of a store job's keys (region rows at ``offsets``); the sections written."""
    sections = P.store_packed(path, keys, slices(view, offsets, size), io)
    io.counters.add(files_stored=1, sections_stored=len(sections))
    io.counters.per_group("sections_stored_per_group", [s.group for s in sections])
    return sections


def load_packed_files(
    index: PackedIndex, keys: Sequence[Any], view: memoryview, offsets: Sequence[int], size: int,
    io: ChunkIO,
) -> None:
    """Load a job's keys from the packed files the index names, each file opened once.

    On failure raises an ``OSError`` carrying ``num_succeeded`` (the keys before
    the first failed one, in job order, as vLLM's ``batch_load_block``); every
    failed key leaves the index, and the job's other files are still read (a
    bad section is found once, not by every later request).
    """
    by_file: dict[str, list[tuple[bytes, memoryview]]] = {}
    failed: dict[bytes, str] = {}
    rows = slices(view, offsets, size)
    for key, dest in zip(keys, rows, strict=True):
        where = index.get(bytes(key))
        if where is None:
            failed[bytes(key)] = "not indexed"
            continue
        by_file.setdefault(where[0], []).append((bytes(key), dest))
    for path, wants in by_file.items():
        failures = P.load_packed(path, wants, io)
        if P.WHOLE_FILE & set(failures.values()):
            index.drop_file(path)
        failed.update(failures)
    if not failed:
        return
    index.drop(failed)
    first = next(i for i, k in enumerate(keys) if bytes(k) in failed)
    why = failed[bytes(keys[first])]
    exc = ChunkFileError(str(next(iter(by_file), "")), f"packed section: {why}")
    exc.num_succeeded = first  # type: ignore[attr-defined]
    exc.failed_by_file = {  # type: ignore[attr-defined]
        path: [k for k, _ in wants if k in failed] for path, wants in by_file.items()
    }
    raise exc

