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

**Start** (:meth:`PackedIndex.start`): the files the index snapshot describes are indexed
from it, their keys at once and their sections at each file's first load; the other
files listed from their headers (:mod:`vllm_adapter.disk.packed_snapshot`: what it holds,
and why a stale or damaged one never serves a wrong byte).  :meth:`PackedIndex.save_snapshot`
writes it.

:class:`vllm_adapter.disk.tier.KvchunkFileTierManager` calls both through its
:class:`~vllm_adapter.disk.fileio.TierFileIO` (the conformance lanes wrap it there).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reference.packed import ENTRY_FIXED_BYTES
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk import packed_snapshot as PS
from vllm_adapter.disk.chunk_file import ChunkFileError, ChunkIO, slices

__all__ = ["IndexStart", "LoadPlan", "PackedIndex", "load_packed_files", "store_packed_file"]

logger = logging.getLogger("vllm_adapter.disk.tier")


@dataclass(frozen=True)
class _File:
    """One indexed file: its keys, its sections (parsed now or at its first load) and its
    identity when indexed."""

    keys: tuple[bytes, ...]
    identity: P.FileIdentity | None
    """None: indexed from sections alone, or from a snapshot entry that failed its check;
    its first load parses the header."""
    sections: Mapping[bytes, P.Section] | None
    """None: not parsed yet (an index snapshot's entry): :attr:`raw` is, at first need."""
    raw: P.HeaderIndex | None = None
    """The header as the file holds it (what an index snapshot writes; None: not known)."""


@dataclass(frozen=True)
class IndexStart:
    """What :meth:`PackedIndex.start` did."""

    files: int
    """Packed files indexed."""
    bad: int
    """Files whose header failed (not indexed)."""
    from_snapshot: int
    """Files indexed from the snapshot (no header read)."""
    from_headers: int
    """Files whose header was read: every file when the snapshot was not used, else the
    files written after it."""
    dropped: int
    """Snapshot entries whose file is not listed (gone since), or not a header of this
    namespace's format."""
    snapshot: str
    """``used``, or why not (``missing``, ``damaged``, ``version``, ``namespace``, ``off``)."""


class PackedIndex:
    """Which packed file and section holds each key (thread-safe): the packed tier's lookups.

    Filled as stores finish and, when a tier starts, from the index snapshot and the
    headers of the files it does not describe (:meth:`start`; :meth:`rebuild`: every
    header); a section that fails verification leaves it (:meth:`drop`).  Each file's
    identity lets a load skip its header (:func:`load_packed_files`).  A file indexed from
    a snapshot has its keys indexed at once and its sections parsed at its first load.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._where: dict[bytes, str] = {}
        self._files: dict[str, _File] = {}
        self._lazy: dict[str, int] = {}
        """Files indexed from the snapshot and not touched since: path -> its place in
        :attr:`_snapshot` (its entry is built at first need, :meth:`_entry`)."""
        self._snapshot: PS.Snapshot | None = None
        self._check: tuple[bytes, str] | None = None
        """The namespace and checksum algorithm snapshot entries are checked against."""
        self.generation = 0
        """Bumped by every change a snapshot would show (a file indexed, refreshed, gone)."""

    def add(self, path: str, written: P.PackedHeader | Sequence[P.Section]) -> None:
        """Index a file: its header as stored or read (sections and identity), or its
        sections alone (no identity: the first load reads the header)."""
        if isinstance(written, P.PackedHeader):
            sections, identity, raw = written.sections, written.identity, written.raw
        else:
            sections, identity, raw = tuple(written), None, None
        by_key = {s.key: s for s in sections}
        with self._lock:
            self._forget_keys(path)
            self._files[path] = _File(tuple(by_key), identity, by_key, raw)
            for key in by_key:
                self._where[key] = path
            self.generation += 1

    def add_keys(self, path: str, keys: Iterable[bytes]) -> None:
        """Index a file by its keys alone (another engine's, as the root's ledger names them),
        without opening it: its first load reads and checks its header (the full path of
        :func:`load_packed_files`), and the index takes its sections and identity then."""
        with self._lock:
            self._forget_keys(path)
            self._files[path] = _File(tuple(bytes(k) for k in keys), None, None, None)
            for key in self._files[path].keys:
                self._where[key] = path
            self.generation += 1

    def _entry(self, path: str) -> _File | None:
        """``path``'s entry (under the lock), a snapshot's built now."""
        entry = self._files.get(path)
        if entry is not None or not self._lazy:
            return entry
        i = self._lazy.pop(path, None)
        if i is None or self._snapshot is None:
            return None
        identity, raw = self._snapshot.file(i)
        entry = self._files[path] = _File(tuple(self._snapshot.keys[
            self._snapshot.starts[i] : self._snapshot.starts[i + 1]]), identity, None, raw)
        if not self._lazy:
            self._snapshot = None  # every entry built: its bytes can go
        return entry

    def _forget_keys(self, path: str) -> None:
        entry = self._entry(path)
        for key in entry.keys if entry is not None else ():
            if self._where.get(key) == path:
                del self._where[key]

    def _sections(self, path: str, entry: _File) -> Mapping[bytes, P.Section]:
        """``entry``'s sections, a snapshot entry's parsed now (under the lock): checked as
        its file's header would be; keys it does not serve leave the index, and an entry
        that fails is kept without identity (its first load reads the file's header)."""
        if entry.sections is not None:
            return entry.sections
        header = None
        if entry.raw is not None and entry.identity is not None and self._check is not None:
            try:
                header = P.parse_stored_header(path, entry.raw, entry.identity, *self._check)
            except ChunkFileError as exc:
                logger.warning("kvchunk fs tier: the index snapshot's entry of %s failed its "
                               "check (%s): its header is read at its first load", path, exc.why)
        if header is None:
            self._files[path] = _File(entry.keys, None, {}, None)
            self.generation += 1
            return {}
        now = {s.key: s for s in header.sections}
        keys = tuple(k for k in entry.keys if k in now)
        for key in entry.keys:
            if key not in now and self._where.get(key) == path:
                del self._where[key]
        sections = {k: now[k] for k in keys}
        self._files[path] = _File(keys, entry.identity, sections, entry.raw)
        return sections

    def _find(self, key: bytes) -> tuple[str, P.Section | None] | None:
        path = self._where.get(key)
        entry = None if path is None else self._entry(path)
        if path is None or entry is None:
            return None
        section = self._sections(path, entry).get(key)
        if section is None and self._files[path].identity is not None:
            return None  # its entry's header does not serve it (it left the index)
        return path, section

    def get(self, key: bytes) -> tuple[str, P.Section | None] | None:
        """The file holding ``key`` and its section (None: known only once the file's
        header is read, at its next load)."""
        with self._lock:
            return self._find(bytes(key))

    def locate(
        self, keys: Sequence[Any]
    ) -> tuple[list[tuple[str, P.Section | None] | None], dict[str, P.FileIdentity | None]]:
        """Where each key is, and the identity of each file named: one consistent
        snapshot (a refresh between the two would pair old sections with a new identity)."""
        with self._lock:
            where = [self._find(bytes(k)) for k in keys]
            files = {w[0]: self._identity(w[0]) for w in where if w is not None}
        return where, files

    def identity(self, path: str) -> P.FileIdentity | None:
        """The identity a load of ``path`` checks (None: not indexed, or not known)."""
        with self._lock:
            return self._identity(path)

    def _identity(self, path: str) -> P.FileIdentity | None:
        entry = self._entry(path)
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
            entry = self._entry(path)
            if identity is None or entry is None or entry.identity != seen:
                return
            now = {s.key: s for s in header.sections}
            self.generation += 1
            if seen is not None and seen.header_digest == header.header_digest:
                sections = entry.sections
                if sections is None:
                    sections = {k: now[k] for k in entry.keys if k in now}
                self._files[path] = _File(entry.keys, identity, sections, entry.raw)
                return
            keys = tuple(k for k in entry.keys if k in now)
            for key in entry.keys:
                if key not in now and self._where.get(key) == path:
                    del self._where[key]
            self._files[path] = _File(keys, identity, {k: now[k] for k in keys}, header.raw)

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
            if self._files.pop(path, None) is not None:
                self.generation += 1

    def files(self) -> int:
        with self._lock:
            return len(self._files) + len(self._lazy)

    def has_file(self, path: str) -> bool:
        with self._lock:
            return path in self._files or path in self._lazy

    def __len__(self) -> int:
        with self._lock:
            return len(self._where)

    def _add_from_header(self, path: str, io: ChunkIO) -> bool:
        try:
            header = P.read_packed_index(path, io.namespace, io.checksum)
        except OSError as exc:
            logger.warning("kvchunk fs tier: %s not indexed: %s", path, exc)
            return False
        self.add(path, header)
        return True

    def rebuild(self, namespace_dir: str, io: ChunkIO) -> tuple[int, int]:
        """Index every packed file under ``namespace_dir`` from its header; ``(files, bad)``.

        A file whose header fails is left alone here (its keys are not indexed, so no
        load ever reads it); a section the header itself rejects is not indexed.
        """
        files = bad = 0
        for path in P.iter_packed_files(namespace_dir):
            if self._add_from_header(path, io):
                files += 1
            else:
                bad += 1
        return files, bad

    def start(self, namespace_dir: str, io: ChunkIO, snapshot: bool = True,
              listing: Iterable[str] | None = None) -> IndexStart:
        """Index every packed file listed under ``namespace_dir`` (an empty index: a tier
        starting): the files the index snapshot (:mod:`~vllm_adapter.disk.packed_snapshot`)
        describes from it, without reading them; every other listed file from its header
        (all of them when the snapshot is missing, damaged or another namespace's, or
        ``snapshot`` is false).  Snapshot entries whose file is not listed are dropped.  Why
        a stale entry never serves a wrong byte: :mod:`~vllm_adapter.disk.packed_snapshot`.

        ``listing``: the packed files under ``namespace_dir`` as the caller listed them
        (:func:`~vllm_adapter.disk.packed_file.iter_packed_files`'s paths; a tier passes
        its start's listing less what the ledger's start removed, so the namespace is
        walked once); default: walk it now."""
        prefix = os.path.join(namespace_dir, "")
        listed = {path[len(prefix):]: path
                  for path in (P.iter_packed_files(namespace_dir) if listing is None else listing)}
        found = (PS.read_snapshot(os.path.join(namespace_dir, PS.SNAPSHOT_FILE), io.namespace,
                                  io.checksum) if snapshot else "off")
        from_snapshot = dropped = 0
        if isinstance(found, PS.Snapshot):
            paths = [listed.pop(name, None) for name in found.names]
            kept = [path is not None for path in paths]
            from_snapshot = sum(kept)
            dropped = len(paths) - from_snapshot
            per_key = itertools.chain.from_iterable(map(itertools.repeat, kept, found.counts))
            named = [path or "" for path in paths]  # "": dropped (compressed out below)
            key_paths = itertools.chain.from_iterable(map(itertools.repeat, named, found.counts))
            with self._lock:
                assert not self._files and not self._lazy, "start() indexes an empty index"
                self._check = (io.namespace, io.checksum)
                self._snapshot = found
                self._lazy = {path: i for i, path in enumerate(paths) if path is not None}
                pairs = zip(found.keys, key_paths, strict=True)
                self._where.update(itertools.compress(pairs, per_key))
                if not self._lazy:
                    self._snapshot = None
                self.generation += 1
        bad = 0
        for path in listed.values():
            bad += not self._add_from_header(path, io)
        return IndexStart(from_snapshot + len(listed) - bad, bad, from_snapshot, len(listed),
                          dropped, "used" if isinstance(found, PS.Snapshot) else found)

    def snapshot_entries(self, namespace_dir: str) -> list[PS.SnapshotEntry]:
        """What a snapshot of this index holds: every file under ``namespace_dir`` indexed
        with its identity and header (a file whose identity is not known is left out: the
        next start reads its header)."""
        prefix = os.path.join(namespace_dir, "")
        with self._lock:
            entries = [(path, e.identity, e.raw) for path, e in self._files.items()]
            lazy, snap = list(self._lazy.items()), self._snapshot
        out = [PS.entry_of(path[len(prefix):], identity, raw) for path, identity, raw in entries
               if identity is not None and raw is not None and path.startswith(prefix)]
        if snap is not None:
            out += [snap.entry(i, path[len(prefix):]) for path, i in lazy
                    if path.startswith(prefix)]
        return [e for e in out if e is not None]

    def save_snapshot(self, namespace_dir: str, io: ChunkIO,
                      max_bytes: int | None = None) -> int | None:
        """Write this index's snapshot (:func:`~vllm_adapter.disk.packed_snapshot.write_snapshot`):
        its bytes, or None when it would pass ``max_bytes`` (known without encoding it when
        its index entries alone would)."""
        if max_bytes is not None and len(self) * ENTRY_FIXED_BYTES > max_bytes:
            return None
        return PS.write_snapshot(namespace_dir, io, self.snapshot_entries(namespace_dir),
                                 max_bytes)


def store_packed_file(
    path: str, keys: Sequence[bytes], view: memoryview, offsets: Sequence[int], size: int,
    io: ChunkIO, tmp: str | None = None,
) -> P.PackedHeader:
    """One packed file of a store job's keys (one of its
    :func:`reference.packed.store_job_files`; region rows at ``offsets``); its header as
    written (sections and identity: what :meth:`PackedIndex.add` takes)."""
    header = P.store_packed(path, keys, slices(view, offsets, size), io, tmp)
    io.counters.add(files_stored=1, sections_stored=len(header.sections))
    io.counters.per_group("sections_stored_per_group", [s.group for s in header.sections])
    return header


@dataclass(frozen=True)
class LoadPlan:
    """A load job split across the pool (:mod:`vllm_adapter.disk.packed_split`), as the
    index placed its keys when it was split: each key's file, each file's identity then,
    and each file as its slices share it (:class:`~vllm_adapter.disk.packed_file.SharedFile`:
    the indexed sections, and what the first slice to open it found)."""

    path_of: Mapping[bytes, str]
    identities: Mapping[str, P.FileIdentity | None]
    files: Mapping[str, P.SharedFile]

    @classmethod
    def of(cls, index: PackedIndex, keys: Sequence[Any]) -> LoadPlan | None:
        """The plan of ``keys`` (None when a key is not indexed or its section is not
        known yet: a file not parsed since it was indexed by its keys is loaded whole)."""
        where, identities = index.locate(keys)
        path_of: dict[bytes, str] = {}
        sections: dict[str, dict[bytes, P.Section]] = {}
        for key, found in zip(keys, where, strict=True):
            if found is None or found[1] is None or identities[found[0]] is None:
                return None
            path_of[bytes(key)] = found[0]
            sections.setdefault(found[0], {})[bytes(key)] = found[1]
        files = {}
        for path, by_key in sections.items():
            identity = identities[path]
            assert identity is not None
            files[path] = P.SharedFile(P.IndexedFile(identity, by_key))
        return cls(path_of, identities, files)


def load_packed_files(
    index: PackedIndex, keys: Sequence[Any], view: memoryview, offsets: Sequence[int], size: int,
    io: ChunkIO, preadv: P.Preadv | None = None, plan: LoadPlan | None = None,
) -> None:
    """Load a job's keys from the packed files the index names, each file opened once.

    A file whose ``fstat`` matches its indexed identity is read at the indexed sections
    (no header read); any other is parsed, and its index entry refreshed from the header.
    Every section is verified against its checksum.  ``preadv``: how files are read
    (``os.preadv`` by default; the tier's :class:`~vllm_adapter.disk.fileio.TierFileIO`).
    ``plan``: ``keys`` are one slice of a load job split across the pool, placed by the
    job's :class:`LoadPlan` (not looked up again), each file shared with the other slices.

    On failure raises an ``OSError`` carrying ``num_succeeded`` (the keys before
    the first failed one, in job order, as vLLM's ``batch_load_block``); every
    failed key leaves the index, and the job's other files are still read (a
    bad section is found once, not by every later request).
    """
    by_file: dict[str, list[tuple[bytes, memoryview]]] = {}
    sections: dict[str, dict[bytes, P.Section]] = {}
    failed: dict[bytes, str] = {}
    rows = slices(view, offsets, size)
    if plan is None:
        where, identities = index.locate(keys)
    else:
        where = [(path, None) if (path := plan.path_of.get(bytes(k))) else None for k in keys]
        identities = dict(plan.identities)
    for key, dest, found in zip(keys, rows, where, strict=True):
        if found is None:
            failed[bytes(key)] = "not indexed"
            continue
        path, section = found
        by_file.setdefault(path, []).append((bytes(key), dest))
        known_sections = sections.setdefault(path, {})
        if section is not None:
            known_sections[bytes(key)] = section
    for path, wants in by_file.items():
        seen = identities[path]
        if plan is not None:
            loaded = P.load_indexed(path, wants, io, None, preadv, plan.files[path])
        else:
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
