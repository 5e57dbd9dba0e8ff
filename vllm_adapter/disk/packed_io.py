"""The packed tier's key index and its per-job file I/O (:mod:`vllm_adapter.disk.packed_file`'s layout).

:class:`PackedIndex` answers which packed file and section holds each key, and
keeps each file's :class:`~vllm_adapter.disk.packed_file.FileIdentity` (device,
inode, size, mtime, header digest) from its store or its last header parse;
:func:`store_packed_file` writes one packed file of a store job's keys (its full-attention
keys, or its window keys: :func:`reference.packed.store_job_files`) and
:func:`load_packed_files` loads a job's keys, each file it needs opened once.

**No header re-read on load**: a file whose ``fstat`` matches the identity the index
keeps is read at the indexed sections directly (the fast path of
:func:`~vllm_adapter.disk.packed_file.load_indexed`); every section read is still
verified against its checksum.  The full header parse happens only for a file the
index holds no identity of, or whose device, inode, size or mtime changed (rewritten
by rename, truncated, grown, written in place): the index entry is then refreshed from
the parsed header (:meth:`PackedIndex.refresh`), or, when the header fails, every key of
the file fails and the file leaves the index.

:class:`vllm_adapter.disk.tier.KvchunkFileTierManager` calls both through its
:class:`~vllm_adapter.disk.fileio.TierFileIO` (the conformance lanes wrap it there).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk.chunk_file import ChunkFileError, ChunkIO, slices

__all__ = ["PackedIndex", "load_packed_files", "store_packed_file"]

logger = logging.getLogger("vllm_adapter.disk.tier")


@dataclass(frozen=True)
class _File:
    """One indexed file: the sections it was indexed with, and its identity then."""

    sections: tuple[P.Section, ...]
    identity: P.FileIdentity | None
    """None: indexed from sections alone; its first load parses the header."""


class PackedIndex:
    """Which packed file and section holds each key (thread-safe): the packed tier's lookups.

    Filled as stores finish and, when a tier starts, from the headers of the files
    already in its namespace (:meth:`rebuild`); a section that fails verification
    leaves it (:meth:`drop`).  Each file's identity lets a load skip its header
    (:func:`load_packed_files`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._where: dict[bytes, tuple[str, P.Section]] = {}
        self._files: dict[str, _File] = {}

    def add(self, path: str, written: P.PackedHeader | Sequence[P.Section]) -> None:
        """Index a file: its header as stored or read (sections and identity), or its
        sections alone (no identity: the first load reads the header)."""
        if isinstance(written, P.PackedHeader):
            sections, identity = written.sections, written.identity
        else:
            sections, identity = tuple(written), None
        with self._lock:
            self._forget_keys(path)
            self._files[path] = _File(tuple(sections), identity)
            for s in sections:
                self._where[s.key] = (path, s)

    def _forget_keys(self, path: str) -> None:
        entry = self._files.get(path)
        for s in entry.sections if entry is not None else ():
            if self._where.get(s.key, ("",))[0] == path:
                del self._where[s.key]

    def get(self, key: bytes) -> tuple[str, P.Section] | None:
        with self._lock:
            return self._where.get(bytes(key))

    def locate(
        self, keys: Sequence[Any]
    ) -> tuple[list[tuple[str, P.Section] | None], dict[str, P.FileIdentity | None]]:
        """Where each key is, and the identity of each file named: one consistent
        snapshot (a refresh between the two would pair old sections with a new identity)."""
        with self._lock:
            where = [self._where.get(bytes(k)) for k in keys]
            files = {w[0]: self._identity(w[0]) for w in where if w is not None}
        return where, files

    def identity(self, path: str) -> P.FileIdentity | None:
        """The identity a load of ``path`` checks (None: not indexed, or not known)."""
        with self._lock:
            return self._identity(path)

    def _identity(self, path: str) -> P.FileIdentity | None:
        entry = self._files.get(path)
        return entry.identity if entry is not None else None

    def refresh(self, path: str, seen: P.FileIdentity | None, header: P.PackedHeader) -> None:
        """After a load parsed ``path``'s header (``header``, with the file's identity)
        because the identity it found here (``seen``) did not match the file.

        The same header digest: the indexed sections stand, only the identity is new.
        Another header (another file renamed to the name): each key indexed at ``path``
        takes its section in ``header``, or leaves the index when ``header`` does not
        serve it; no key joins (a key the index dropped stays dropped).  Nothing
        changes when the entry changed since the load looked (``seen`` differs: a store
        or another refresh indexed it anew) or the file left the index."""
        identity = header.identity
        with self._lock:
            entry = self._files.get(path)
            if identity is None or entry is None or entry.identity != seen:
                return
            if seen is not None and seen.header_digest == header.header_digest:
                self._files[path] = _File(entry.sections, identity)
                return
            now = {s.key: s for s in header.sections}
            kept = []
            for s in entry.sections:
                new = now.get(s.key)
                if self._where.get(s.key, ("",))[0] == path:
                    if new is None:
                        del self._where[s.key]
                    else:
                        self._where[s.key] = (path, new)
                if new is not None:
                    kept.append(new)
            self._files[path] = _File(tuple(kept), identity)

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
            self._forget_keys(path)
            self._files.pop(path, None)

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
            self.add(path, header)
            files += 1
        return files, bad


def store_packed_file(
    path: str, keys: Sequence[bytes], view: memoryview, offsets: Sequence[int], size: int,
    io: ChunkIO,
) -> P.PackedHeader:
    """One packed file of a store job's keys (one of its
    :func:`reference.packed.store_job_files`; region rows at ``offsets``); its header as
    written (sections and identity: what :meth:`PackedIndex.add` takes)."""
    header = P.store_packed(path, keys, slices(view, offsets, size), io)
    io.counters.add(files_stored=1, sections_stored=len(header.sections))
    io.counters.per_group("sections_stored_per_group", [s.group for s in header.sections])
    return header


def load_packed_files(
    index: PackedIndex, keys: Sequence[Any], view: memoryview, offsets: Sequence[int], size: int,
    io: ChunkIO, preadv: P.Preadv | None = None,
) -> None:
    """Load a job's keys from the packed files the index names, each file opened once.

    A file whose ``fstat`` matches its indexed identity is read at the indexed sections
    (no header read); any other is parsed, and its index entry refreshed from the header.
    Every section is verified against its checksum.  ``preadv``: how files are read
    (``os.preadv`` by default; the tier's :class:`~vllm_adapter.disk.fileio.TierFileIO`).

    On failure raises an ``OSError`` carrying ``num_succeeded`` (the keys before
    the first failed one, in job order, as vLLM's ``batch_load_block``); every
    failed key leaves the index, and the job's other files are still read (a
    bad section is found once, not by every later request).
    """
    by_file: dict[str, list[tuple[bytes, memoryview]]] = {}
    sections: dict[str, dict[bytes, P.Section]] = {}
    failed: dict[bytes, str] = {}
    rows = slices(view, offsets, size)
    where, identities = index.locate(keys)
    for key, dest, found in zip(keys, rows, where, strict=True):
        if found is None:
            failed[bytes(key)] = "not indexed"
            continue
        path, section = found
        by_file.setdefault(path, []).append((bytes(key), dest))
        sections.setdefault(path, {})[bytes(key)] = section
    for path, wants in by_file.items():
        seen = identities[path]
        known = None if seen is None else P.IndexedFile(seen, sections[path])
        loaded = P.load_indexed(path, wants, io, known, preadv)
        failures = loaded.failed
        if P.WHOLE_FILE & set(failures.values()):
            index.drop_file(path)
        elif loaded.header is not None:
            index.refresh(path, seen, loaded.header)
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
