"""The root ledger's model: what a replay of the journal gives, and the journal's I/O.

:class:`LedgerModel` is the half of :class:`~vllm_adapter.disk.ledger.RootLedger` that
holds the model (the reference's :class:`~reference.eviction.Disk` per namespace, the
current reservation of each path, recency on one clock) and keeps it equal to the
journal: applying records (:mod:`vllm_adapter.disk.journal`), replaying what other
engines appended, appending whole records.  It takes no lock and makes no decision;
:class:`~vllm_adapter.disk.ledger.RootLedger` (the operations under the root's lock)
does both.  ``RootLedger.replayed`` is this model read from a root without acting.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from reference.eviction import Disk, EvictionRule
from reference.knobs import Chunking
from reference.prefix_structure import PrefixStructure
from vllm_adapter.disk.counters import Counters
from vllm_adapter.disk.journal import decode, encode
from vllm_adapter.disk.lease import LeaseIO

__all__ = ["LEDGER_FILE", "LOCK_FILE", "BudgetCounters", "Damaged", "LedgerIO", "LedgerModel"]

LEDGER_FILE = "kvchunk-ledger.jsonl"
LOCK_FILE = "kvchunk-ledger.lock"

logger = logging.getLogger(__name__)


class Damaged(ValueError):
    """A field of the ledger's snapshot does not hold (:mod:`vllm_adapter.disk.ledger_snapshot`)."""


@dataclass
class BudgetCounters(Counters):
    """What the root's budget did, as seen by one tier (thread-safe snapshot via :meth:`as_dict`)."""

    files_evicted: int = 0
    bytes_evicted: int = 0
    stores_refused: int = 0
    keys_not_admitted: int = 0
    """Keys a store left out because they would arrive stranded (the rule only)."""
    orphans_removed: int = 0
    reservations_reclaimed: int = 0
    """Reservations of dead writers failed by this tier."""
    reservations_lost: int = 0
    """This tier's reservations a peer reclaimed (it stalled past its lease)."""
    leases_lost: int = 0
    """Times a peer judged this tier dead and removed its lease."""
    journal_records_skipped: int = 0
    """Journal lines that were torn or damaged (skipped on replay)."""
    compactions: int = 0
    snapshot_loads: int = 0
    """Whole replays that loaded the model from the ledger's snapshot and replayed only the
    journal's tail after it (:mod:`vllm_adapter.disk.ledger_snapshot`)."""
    snapshot_fallbacks: int = 0
    """Whole replays that tried the snapshot and replayed the whole journal (missing,
    stale, damaged: :attr:`LedgerModel.snapshot_start` says why), and loaded snapshots one
    of whose namespaces did not hold when it was built (the model then replaced by the full
    replay: :meth:`LedgerModel._snapshot_damaged`)."""
    snapshots_written: int = 0
    """Ledger snapshots this tier wrote (at a compaction, at shutdown)."""
    files_recycled: int = 0
    """Victims that became a new file's temporary file (of ``files_evicted``)."""
    finished_keys_dropped: int = 0
    """Keys no lookup could load that left as the request of this engine that stored them
    finished (:meth:`~vllm_adapter.disk.ledger.RootLedger.drop_finished`: window chunks of a
    boundary whose full-attention store was refused, or whose sibling never came)."""
    finished_files_removed: int = 0
    """Files every key of which so left (counted in ``files_evicted``)."""

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


class LedgerIO(LeaseIO):
    """The ledger's own file operations, one object (a test injects faults and crashes
    here, or makes the engine another host: :class:`~vllm_adapter.disk.lease.LeaseIO`)."""

    def write(self, fd: int, data: bytes) -> int:
        return os.write(fd, data)

    def unlink(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)


@dataclass
class Namespace:
    structure: PrefixStructure
    disk: Disk
    path_of: dict[int, str] = field(default_factory=dict)

    def file_bytes(self) -> int:
        """Bytes of the namespace's files (reservations included)."""
        return self.disk.bytes

    def chunking(self) -> Chunking | None:
        """The chunking its structure judges prefixes with (None: not known yet)."""
        return self.structure.chunking

    def is_ready(self, fid: int) -> bool:
        """File ``fid`` is written (False: reserved, being written)."""
        return self.disk.files[fid].ready

    def take(self, other: Namespace) -> None:
        """Become ``other`` (its structure, Disk and paths, shared): an operation holding
        this namespace works on ``other``'s state (:meth:`LedgerModel._snapshot_damaged`)."""
        self.structure, self.disk, self.path_of = other.structure, other.disk, other.path_of

    def stranded_bytes(self) -> int:
        """Bytes of its files whose every key is stranded, plus each partly stranded file's
        share."""
        stranded = self.disk.stranded()
        total = 0
        for f in self.disk.files.values():
            if f.keys and stranded.issuperset(f.keys):
                total += f.nbytes
            elif f.keys:
                total += f.nbytes * sum(k in stranded for k in f.keys) // len(f.keys)
        return total


class DeferredNamespace(Namespace):
    """A namespace loaded from the ledger's snapshot whose structure, Disk and paths are
    built on first access (``build``: :mod:`vllm_adapter.disk.ledger_snapshot`'s, which
    checks them and raises its ``Damaged`` when the payload's fields do not hold).

    A start reads the few things it needs without them: the namespace's bytes, its
    chunking, which files are written (a file is written when its path is not pending:
    the build checks that each record agrees).  Anything else -- the first store, an
    eviction, a read of a file's keys -- builds it once, under the caller's lock.

    A build that raises :class:`Damaged` calls ``damaged`` (the model's
    :meth:`LedgerModel._snapshot_damaged`: the model, this namespace included, becomes the
    full replay of the journal); without it, the error is raised and nothing is built."""

    def __init__(self, build: Callable[[], Namespace], file_bytes: int,
                 chunking: Chunking | None, pending: frozenset[int], source: bytes,
                 stranded_bytes: int = 0,
                 damaged: Callable[[Damaged], None] | None = None) -> None:
        self._build: Callable[[], Namespace] | None = build
        self._damaged = damaged
        self._bytes = file_bytes
        self._stranded = stranded_bytes
        """Its stranded bytes when the snapshot was written: unbuilt, nothing changed them
        (a record naming the namespace builds it), so vLLM's scheduler thread, which asks
        for them (:meth:`LedgerModel.peek`), never pays a build."""
        self._chunking = chunking
        self._pending = pending
        """Fids of the namespace's files pending when the snapshot was written."""
        self.source = source
        """The payload's bytes it is built from (a snapshot written while it is not built
        writes them again: nothing changed it)."""

    @property
    def built(self) -> bool:
        return self._build is None

    def __getattr__(self, name: str) -> Any:
        if name not in ("structure", "disk", "path_of") or self.__dict__.get("_build") is None:
            raise AttributeError(name)
        self.ensure_built()
        return self.__dict__[name]

    def ensure_built(self) -> None:
        """Build it now, if it is not (a build that does not hold: the class docstring)."""
        build = self._build
        if build is None:
            return
        try:
            space = build()
        except Damaged as e:
            if self._damaged is None:
                raise
            self._damaged(e)  # the model replayed whole: this namespace took its part
            assert self._build is None, "the fallback left a namespace unbuilt"
            return
        self.take(space)

    def take(self, other: Namespace) -> None:
        self.__dict__.update(structure=other.structure, disk=other.disk, path_of=other.path_of)
        self._build = None

    def file_bytes(self) -> int:
        return self._bytes if self._build is not None else self.disk.bytes

    def chunking(self) -> Chunking | None:
        return self._chunking if self._build is not None else self.structure.chunking

    def is_ready(self, fid: int) -> bool:
        return fid not in self._pending if self._build is not None else super().is_ready(fid)

    def stranded_bytes(self) -> int:
        return self._stranded if self._build is not None else super().stranded_bytes()


@dataclass
class Reservation:
    rid: str
    ns: str
    fid: int
    owner: str
    line_bytes: int


class LedgerModel:
    """The files model of a root, kept equal to its journal (see the module docstring).

    Attributes a subclass sets before :meth:`_reset`: ``root``, ``rule``, ``counters``,
    ``io``, ``ledger_path``, ``_thread_lock``, ``_chunkings``, ``_kept``, ``_compacted_bytes``."""

    root: str
    rule: EvictionRule
    counters: BudgetCounters
    io: LedgerIO
    ledger_path: str
    _thread_lock: threading.RLock
    _chunkings: dict[str, Chunking]
    _kept: dict[str, PrefixStructure]
    _compacted_bytes: int
    """About the journal's size were it compacted now: the live records' bytes, set when
    :meth:`_sync` replays it whole (a start, a compaction, a replaced journal)."""
    _use_snapshot: bool = False
    """A whole replay with no structures to keep loads the ledger's snapshot when it binds
    the journal (:mod:`vllm_adapter.disk.ledger_snapshot`); False: always the whole journal."""
    snapshot_start: str = ""
    """How the last whole replay that tried the snapshot began: ``used``, or why not
    (``missing``, ``stale``, ``damaged``, ``version``, ``chunking``, ``unreadable``)."""
    _deferring: bool = False
    """The model was loaded from the ledger's snapshot: a namespace may be unbuilt (a
    record builds the namespaces it names before it changes anything: :meth:`_apply`)."""
    _at: int | None = None
    """The journal's offset of the record being applied (None: none is), where a build that
    falls back replays the journal up to (:meth:`_snapshot_damaged`)."""
    _replaying: bytes | None = None
    """The journal's bytes a whole replay is applying (:meth:`_replay_whole`)."""
    _verified: dict[str, str] = {}  # noqa: RUF012  (replaced, never changed in place)
    """Path -> rid of the files whose size the snapshot this model was loaded from found
    equal to their record when it was written (:meth:`RootLedger._reconcile_sizes` need
    not ``stat`` them again); empty when the model was replayed."""

    def _reset(self) -> None:
        self._spaces: dict[str, Namespace] = {}
        self._res: dict[str, Reservation] = {}
        """Path -> its current reservation."""
        self._by_rid: dict[str, str] = {}
        """Rid -> path, for the current reservations."""
        self._pending: set[str] = set()
        """Paths reserved and not yet done."""
        self._clock = 0
        self._events: dict[str, dict[str, bool]] = {}
        self._inode: int | None = None
        self._offset = 0
        self._recorded_budget: int | None = None
        self._deferring = False

    def _space(self, ns: str) -> Namespace:
        if ns not in self._spaces:
            structure = self._kept.pop(ns, None)
            if structure is None or (structure.chunking is None and ns in self._chunkings):
                structure = PrefixStructure(self._chunkings.get(ns))  # (with the chunking now known)
            self._spaces[ns] = Namespace(structure, Disk(structure))
        return self._spaces[ns]

    @property
    def total_bytes(self) -> int:
        """Bytes of the files the ledger holds (reservations included)."""
        return sum(s.file_bytes() for s in self._spaces.values())

    def files(self, ns: str | None = None) -> dict[str, bool]:
        """Path -> written (False: reserved, being written) of the files the ledger holds."""
        with self._thread_lock:
            spaces = self._spaces
            return {p: spaces[r.ns].is_ready(r.fid)
                    for p, r in self._res.items() if ns is None or r.ns == ns}

    def entry(self, path: str) -> tuple[tuple[bytes, ...], int, bool, str] | None:
        """What the ledger holds of ``path``: its keys, bytes, written, and reservation id."""
        with self._thread_lock:
            r = self._res.get(path)
            if r is None:
                return None
            f = self._spaces[r.ns].disk.files[r.fid]
            return f.keys, f.nbytes, f.ready, r.rid

    def rids(self, paths: Iterable[str]) -> dict[str, str]:
        """Path -> current reservation id, of the given paths the ledger holds (a load keeps
        them, so that what it reports later touches only the files it read)."""
        with self._thread_lock:
            return {p: self._res[p].rid for p in paths if p in self._res}

    def owners(self) -> dict[str, str]:
        """Pending path -> its writer's lease id."""
        with self._thread_lock:
            return {p: self._res[p].owner for p in self._pending}

    def totals(self) -> dict[str, int]:
        """Bytes and files on the root (every namespace, reservations included)."""
        with self._thread_lock:
            return {"disk_bytes": self.total_bytes, "disk_files": len(self._res),
                    "ledger_bytes": self._offset}

    def model(self) -> dict[str, tuple[str, str, int, bool, tuple[bytes, ...]]]:
        """Path -> (namespace, rid, bytes, written, keys): the whole files model, for
        comparing engines with a fresh replay."""
        with self._thread_lock:
            out = {}
            for p, r in self._res.items():
                f = self._spaces[r.ns].disk.files[r.fid]
                out[p] = (r.ns, r.rid, f.nbytes, f.ready, tuple(sorted(f.keys)))
            return out

    def _changed(self) -> bool:
        try:
            st = os.stat(self.ledger_path)
        except FileNotFoundError:
            return self._inode is not None
        return st.st_ino != self._inode or st.st_size != self._offset

    def stranded_bytes(self) -> int:
        """Bytes of files whose every key is stranded, plus each partly stranded file's share."""
        with self._thread_lock:
            return sum(space.stranded_bytes() for space in self._spaces.values())

    # -- applying records -------------------------------------------------------

    def _current(self, rec: dict[str, Any]) -> str | None:
        """The path a record's rid names now (None: an older reservation, or none)."""
        return self._by_rid.get(rec["rid"])

    def _apply(self, rec: dict[str, Any], line_bytes: int = 0) -> None:
        op = rec["op"]
        if op == "budget":
            self._recorded_budget = rec["bytes"]  # the last one recorded holds
            return
        if self._deferring:
            self._build_named(rec)
        if op == "use":
            for rid in rec["rids"]:
                path = self._by_rid.get(rid)
                if path is not None:
                    r = self._res[path]
                    space = self._spaces[r.ns]
                    if space.disk.files[r.fid].ready:
                        self._touch(space, r.fid)
            return
        if op == "add":
            self._add(rec, line_bytes)
            return
        path = self._current(rec)
        if path is None:
            return  # about an older reservation (or a line that lost its add)
        r = self._res[path]
        space = self._spaces[r.ns]
        if op == "done":
            self._pending.discard(path)
            if rec["ok"]:
                space.disk.files[r.fid].ready = True
                self._touch(space, r.fid)
                self._event(r.ns, path, True)
            else:
                self._remove(path)
        elif op == "rm":
            self._remove(path)
        elif op == "drop":
            f = space.disk.files[r.fid]
            left = tuple(k for k in f.keys if k not in set(rec["keys"]))
            if not left:
                self._remove(path)
            elif len(left) < len(f.keys):
                space.disk.keep_keys(r.fid, left)
        elif op == "size":
            space.disk.resize(r.fid, rec["bytes"])

    def _build_named(self, rec: dict[str, Any]) -> None:
        """Build the unbuilt namespaces record ``rec`` changes, before it changes anything:
        one that falls back to the full replay replays the journal up to ``rec``
        (:attr:`_at`), which is then applied to that model as to this one."""
        op = rec["op"]
        if op == "use":
            paths = [self._by_rid.get(rid) for rid in rec["rids"]]
        else:
            paths = [rec["path"] if op == "add" else self._current(rec)]
        names = {self._res[p].ns for p in paths if p is not None and p in self._res}
        if op == "add":
            names.add(rec["ns"])
        for ns in sorted(names):
            space = self._spaces.get(ns)
            if isinstance(space, DeferredNamespace):
                space.ensure_built()

    def _build_all(self) -> None:
        """Build every unbuilt namespace (before an operation that changes several)."""
        if self._deferring:
            for space in list(self._spaces.values()):
                if isinstance(space, DeferredNamespace):
                    space.ensure_built()

    def _snapshot_damaged(self, error: Damaged) -> None:
        """A namespace of the snapshot this model was loaded from did not hold when it was
        built (``error``; only a payload forged with its digest gets there): the snapshot is
        not used any further, and the model becomes the full replay of the journal up to
        where it is (:attr:`_at`, else :attr:`_offset`), as a start without the snapshot
        would have built it; every namespace takes its part of that replay, so no other is
        built from the payload and this happens once.  Under the model's lock; the
        operation that built it goes on with the replayed model."""
        from vllm_adapter.disk import ledger_snapshot

        with self._thread_lock:
            at = self._offset if self._at is None else self._at
            inode = self._inode
            if self._replaying is not None:
                data = self._replaying[:at]
            else:
                try:
                    f = open(self.ledger_path, "rb")
                except FileNotFoundError:
                    data, inode = b"", None
                else:
                    with f:
                        st = os.fstat(f.fileno())
                        if st.st_ino != self._inode or st.st_size < at:
                            # another engine replaced it since it was read (a reader outside
                            # the root's lock): its model is the journal now on disk
                            assert self._at is None, "a journal replaced while applying it"
                            data, inode = f.read(st.st_size), st.st_ino
                        else:
                            data = f.read(at)
            replayed = ledger_snapshot.replay(self.ledger_path, data, self._chunkings,
                                              snapshot=False)
            logger.warning(
                "kvchunk: the ledger's snapshot of %s is damaged (%s): its model replaced by "
                "the full replay of the journal (%d bytes)", self.root, error, replayed._offset)
            self._use_snapshot = False
            self.snapshot_start = "damaged"
            self.counters.add(snapshot_fallbacks=1)
            self._take_model(replayed)
            self._inode = inode

    def _take_model(self, other: LedgerModel) -> None:
        """Become ``other``'s model, keeping the objects an operation may hold: a namespace
        takes its part of ``other``'s (one ``other`` lacks, an empty one), a reservation its
        fields; events for the files that came, went or were written."""
        before = {p: r.ns for p, r in self._res.items()}
        pending = set(self._pending)
        spaces: dict[str, Namespace] = {}
        for ns, space in other._spaces.items():
            mine = self._spaces.get(ns)
            if mine is None:
                spaces[ns] = space
            else:
                mine.take(space)
                spaces[ns] = mine
        for ns, mine in self._spaces.items():
            if ns not in spaces:
                structure = PrefixStructure(self._chunkings.get(ns))
                mine.take(Namespace(structure, Disk(structure)))
        res: dict[str, Reservation] = {}
        for path, r in other._res.items():
            held = self._res.get(path)
            if held is not None:
                held.rid, held.ns, held.fid = r.rid, r.ns, r.fid
                held.owner, held.line_bytes = r.owner, r.line_bytes
                r = held
            res[path] = r
        self._spaces, self._res = spaces, res
        self._by_rid, self._pending = dict(other._by_rid), set(other._pending)
        self._clock, self._recorded_budget = other._clock, other._recorded_budget
        self._offset, self._compacted_bytes = other._offset, other._compacted_bytes
        self._verified, self._deferring = {}, False
        for path, ns in before.items():
            if path not in res:
                self._event(ns, path, False)
        for path, r in res.items():
            if path not in self._pending and (path not in before or path in pending):
                self._event(r.ns, path, True)

    def _add(self, rec: dict[str, Any], line_bytes: int) -> None:
        path, rid = rec["path"], rec["rid"]
        if path in self._res:
            if rec["legacy"] or self._res[path].rid == rid:
                return
            self._remove(path)  # a newer reservation of the same path replaces the old one
        space = self._space(rec["ns"])
        space.structure.record(rec["fragment"])
        on_disk = space.disk.file_of
        keys = [k for k in dict.fromkeys(rec["keys"]) if k not in on_disk]
        self._tick(space.disk)
        fid = space.disk.add(keys, rec["bytes"], ready=False)
        self._tock(space.disk)
        space.path_of[fid] = path
        self._res[path] = Reservation(rid, rec["ns"], fid, rec["owner"], line_bytes)
        self._by_rid[rid] = path
        self._pending.add(path)

    def _event(self, ns: str, path: str, written: bool) -> None:
        events = self._events.setdefault(ns, {})
        events.pop(path, None)
        events[path] = written

    def _tick(self, disk: Disk) -> None:
        disk.clock = self._clock

    def _tock(self, disk: Disk) -> None:
        self._clock = max(self._clock, disk.clock)

    def _touch(self, space: Namespace, fid: int) -> None:
        self._tick(space.disk)
        space.disk.touch(fid)
        self._tock(space.disk)

    def _remove(self, path: str) -> None:
        r = self._res.pop(path, None)
        self._pending.discard(path)
        if r is None:
            return
        self._by_rid.pop(r.rid, None)
        self._event(r.ns, path, False)
        space = self._spaces[r.ns]
        if r.fid in space.disk.files:
            space.disk.remove(r.fid)
        space.path_of.pop(r.fid, None)

    # -- the lock and the journal ---------------------------------------------

    def peek(self, stranded: bool = False) -> dict[str, int] | None:
        """:meth:`totals` (and ``stranded_bytes``) without waiting: None while another thread
        of this process is changing the model (vLLM's scheduler thread asks every step)."""
        if not self._thread_lock.acquire(blocking=False):
            return None
        try:
            out = self.totals()
            if stranded:
                out["stranded_bytes"] = self.stranded_bytes()
            return out
        finally:
            self._thread_lock.release()

    def _sync(self) -> None:
        """Replay what was appended since this ledger last read the journal (all of it when
        another engine compacted it, or it shrank: a new inode or a smaller size).  The
        journal is opened, then ``fstat``-ed: a network file system's close-to-open
        consistency gives its current size, where a ``stat`` may answer from a cache."""
        try:
            f = open(self.ledger_path, "rb")
        except FileNotFoundError:
            if self._inode is not None:
                self._replay_all(keep_events=True, from_disk=False)
            return
        with f:
            st = os.fstat(f.fileno())
            if st.st_ino == self._inode and st.st_size >= self._offset:
                self._replay(f, st.st_size)
                return
            before = {p: r.ns for p, r in self._res.items()}
            events = self._events
            kept = {**self._kept, **{ns: space.structure for ns, space in self._spaces.items()}}
            self._reset()
            self._kept = kept
            self._replay_whole(f.read(st.st_size))
            self._inode = st.st_ino
        self._kept = {}
        self._events = events
        for path, ns in before.items():
            if path not in self._res:
                self._event(ns, path, False)
        for path, r in self._res.items():
            if path not in before and self._spaces[r.ns].is_ready(r.fid):
                self._event(r.ns, path, True)

    def _replay_whole(self, data: bytes) -> None:
        """The model of the journal's bytes ``data``, into a model just reset: from the
        ledger's snapshot and the journal after it when the snapshot binds ``data`` (and no
        structure is kept, :attr:`_kept`: a fresh replay is then what the model would be),
        else every line."""
        self._verified = {}
        if self._use_snapshot and not self._kept:
            from vllm_adapter.disk import ledger_snapshot

            self.snapshot_start = ledger_snapshot.load(self, data)
            if self.snapshot_start == "used":
                self.counters.add(snapshot_loads=1)
            else:
                self.counters.add(snapshot_fallbacks=1)
        self._replaying = data
        try:
            self._apply_lines(data[self._offset:] if self._offset else data)
        finally:
            self._replaying = None
        self._compacted_bytes = sum(r.line_bytes for r in self._res.values())

    def _replay(self, f: Any, size: int) -> None:
        if size <= self._offset:
            return
        f.seek(self._offset)
        self._apply_lines(f.read(size - self._offset))

    def _apply_lines(self, data: bytes) -> None:
        """Apply the whole lines of ``data``, the journal from :attr:`_offset`."""
        base = self._offset
        end = data.rfind(b"\n") + 1
        at = base
        try:
            for raw in data[:end].splitlines(keepends=True):
                line = raw.rstrip(b"\r\n")  # (one line ending: \n, \r or \r\n)
                self._at = at
                at += len(raw)
                rec = decode(line)
                if rec is None:
                    if line.strip():
                        self.counters.add(journal_records_skipped=1)
                    continue
                self._apply(rec, len(line) + 1)
        finally:
            self._at = None
        self._offset = base + end

    def _append(self, records: Sequence[dict[str, Any]]) -> None:
        """Append ``records`` whole, then apply them; a write that fails (a full disk)
        leaves the journal as it was (truncated back) and the model unchanged.

        Written at the end the journal has under the root's lock (a fresh ``open``: a
        network file system's close-to-open consistency gives its current size), not with
        ``O_APPEND``, whose atomicity does not hold across a network file system's
        clients; the lock makes this the only writer."""
        if not records:
            return
        data = b"".join(encode(r) for r in records)
        fd = os.open(self.ledger_path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            st = os.fstat(fd)
            os.lseek(fd, st.st_size, os.SEEK_SET)
            if self._inode != st.st_ino:
                self._inode, self._offset = st.st_ino, 0
            start = st.st_size
            if start > self._offset:  # a torn tail a crashed writer left: end it on its own line
                data = b"\n" + data
            try:
                view = memoryview(data)
                while view:
                    n = self.io.write(fd, bytes(view))
                    if n <= 0:
                        raise OSError(errno.ENOSPC, "the ledger's write made no progress")
                    view = view[n:]
            except OSError:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
                raise
            self._offset = start + len(data)
        finally:
            os.close(fd)
        at = start + len(data) - sum(len(encode(r)) for r in records)
        try:
            for r in records:
                line = encode(r)
                rec = decode(line)
                assert rec is not None, r
                self._at = at
                at += len(line)
                self._apply(rec, len(line))
        finally:
            self._at = None
        self._offset = at

    # -- dead owners ------------------------------------------------------------

    def _replay_all(self, keep_events: bool = True, from_disk: bool = True) -> None:
        """The files model as the journal says, rebuilt (the prefix structures kept)."""
        events = self._events
        kept = {ns: space.structure for ns, space in self._spaces.items()}
        self._reset()
        self._kept = kept
        if from_disk:
            self._sync()
        self._kept = {}
        if keep_events:
            self._events = events
