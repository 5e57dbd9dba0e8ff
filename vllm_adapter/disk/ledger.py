"""The ledger of one ``root_dir``: the model every engine writing there shares.

The design (a journal under an ``flock``, replayed by every engine before it decides),
its bound and its crash handling are :mod:`vllm_adapter.disk.budget`'s docstring; this
module is the mechanism.  It is one class, :class:`RootLedger`: the model (the
reference's :class:`~reference.eviction.Disk` per namespace, paths, writers, recency on
one clock), the journal it is replayed from, and the operations a tier calls (reserve,
complete, drop keys, touch, forget, start, compact) that change both together.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from reference.eviction import Disk, EvictionRule, _File
from reference.knobs import Chunking
from reference.prefix_structure import PrefixStructure
from vllm_adapter.disk.counters import Counters
from vllm_adapter.disk.journal import _alive, _fragment_json, _fragment_of, _hex

__all__ = ["COMPACT_MIN_BYTES", "LEDGER_FILE", "LOCK_FILE", "BudgetCounters", "RootLedger"]

LEDGER_FILE = "kvchunk-ledger.jsonl"
LOCK_FILE = "kvchunk-ledger.lock"
COMPACT_MIN_BYTES = 4 << 20
"""The ledger is rewritten from the live files once it is this large and 4x their records."""


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

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


@dataclass
class _Namespace:
    structure: PrefixStructure
    disk: Disk
    path_of: dict[int, str] = field(default_factory=dict)


class RootLedger:
    """The model of one ``root_dir`` every tier writing there shares (see the module docstring).

    Paths are relative to the root.  Every public method takes the root's lock and
    first replays what other engines appended.  Thread-safe.
    """

    def __init__(self, root: str, budget: int, rule: EvictionRule = EvictionRule.REACHABLE,
                 counters: BudgetCounters | None = None,
                 unlink: Callable[[str], None] | None = None) -> None:
        self.root = root
        self.budget = budget
        self.rule = rule
        self.counters = counters or BudgetCounters()
        self.ledger_path = os.path.join(root, LEDGER_FILE)
        self._lock_path = os.path.join(root, LOCK_FILE)
        self._thread_lock = threading.RLock()
        self._chunkings: dict[str, Chunking] = {}
        self._kept: dict[str, PrefixStructure] = {}
        """Structures a replay of the files model reuses (:meth:`_replay_all`)."""
        self._owner = [socket.gethostname(), os.getpid()]
        self._unlink = unlink or _unlink_quietly
        self._reset()

    # -- model ----------------------------------------------------------------

    def _reset(self) -> None:
        self._spaces: dict[str, _Namespace] = {}
        self._where: dict[str, tuple[str, int]] = {}
        """Path -> (namespace, file id)."""
        self._owners: dict[str, list[Any]] = {}
        """Pending path -> its writer."""
        self._clock = 0
        self._events: dict[str, dict[str, bool]] = {}
        """Namespace -> path -> written (True) or gone (False), the last of either since
        :meth:`drain` last took them."""
        self._inode: int | None = None
        self._offset = 0
        self._live_records = 0
        self._add_bytes = 0
        self._adds = 0
        """Bytes and count of the ``add`` records read or written: a snapshot's size per file."""

    def _space(self, ns: str) -> _Namespace:
        if ns not in self._spaces:
            structure = self._kept.pop(ns, None) or PrefixStructure(self._chunkings.get(ns))
            self._spaces[ns] = _Namespace(structure, Disk(structure))
        return self._spaces[ns]

    def observe(self, ns: str, positions: Any) -> None:
        """Feed namespace ``ns``'s own structure a request's key positions (key -> end
        token).  A replay from scratch (another engine compacted the ledger) forgets what
        was observed and not stored: pass ``positions`` to :meth:`reserve` instead."""
        with self._locked():
            self._space(ns).structure.observe_positions(positions)

    def set_chunking(self, ns: str, chunking: Chunking) -> None:
        """Namespace ``ns`` is this tier's: its structure is fed by :meth:`observe` too."""
        with self._thread_lock:
            self._chunkings[ns] = chunking  # before the first replay: one replay, with it
        with self._locked():
            if self._spaces.get(ns) is not None and self._spaces[ns].structure.chunking is None:
                self._reset()  # replay with the chunking
                self._sync()

    @property
    def total_bytes(self) -> int:
        return sum(s.disk.bytes for s in self._spaces.values())

    def files(self, ns: str | None = None) -> dict[str, bool]:
        """Path -> written (False: reserved, being written) of the files the ledger holds."""
        with self._thread_lock:
            return {p: self._spaces[n].disk.files[fid].ready
                    for p, (n, fid) in self._where.items() if ns is None or n == ns}

    def totals(self) -> dict[str, int]:
        """Bytes and files on the root (every namespace, reservations included)."""
        with self._thread_lock:
            return {"disk_bytes": self.total_bytes, "disk_files": len(self._where)}

    def drain(self, ns: str, refresh: bool = False) -> tuple[list[str], list[str]]:
        """Files of ``ns`` written and files gone since the last call (``refresh``: replay
        the ledger first, when it grew or was replaced)."""
        if refresh and self._changed():
            with self._locked():
                pass
        with self._thread_lock:
            events = self._events.pop(ns, {})
            return ([p for p, w in events.items() if w and p in self._where],
                    [p for p, w in events.items() if not w])

    def _changed(self) -> bool:
        try:
            st = os.stat(self.ledger_path)
        except FileNotFoundError:
            return self._inode is not None
        return st.st_ino != self._inode or st.st_size != self._offset

    def stranded_bytes(self) -> int:
        """Bytes of files whose every key is stranded, plus each partly stranded file's share."""
        with self._thread_lock:
            total = 0
            for space in self._spaces.values():
                stranded = space.disk.stranded()
                for f in space.disk.files.values():
                    if f.keys and stranded.issuperset(f.keys):
                        total += f.nbytes
                    elif f.keys:
                        total += f.nbytes * sum(k in stranded for k in f.keys) // len(f.keys)
            return total

    def _tick(self, disk: Disk) -> None:
        disk.clock = self._clock

    def _tock(self, disk: Disk) -> None:
        self._clock = max(self._clock, disk.clock)

    def _apply(self, rec: dict[str, Any]) -> None:
        op = rec.get("op")
        if op == "add":
            path = rec["path"]
            if path in self._where:
                return
            space = self._space(rec["ns"])
            fragment = _fragment_of(rec["fragment"])
            space.structure.record(fragment)
            keys = [bytes.fromhex(k) for k in rec["keys"]]
            keys = [k for k in dict.fromkeys(keys) if k not in space.disk.file_of]
            self._tick(space.disk)
            fid = space.disk.add(keys, int(rec["bytes"]), ready=False)
            self._tock(space.disk)
            space.path_of[fid] = path
            self._where[path] = (rec["ns"], fid)
            self._owners[path] = rec.get("owner", ["", 0])
            self._live_records += 1
        elif op == "done":
            where = self._where.get(rec["path"])
            if where is None:
                return
            self._owners.pop(rec["path"], None)
            space = self._spaces[where[0]]
            if rec.get("ok"):
                space.disk.files[where[1]].ready = True
                self._touch(space, where[1])
                self._event(where[0], rec["path"], True)
            else:
                self._remove(rec["path"])
        elif op == "rm":
            self._remove(rec["path"])
        elif op == "drop":
            self._drop(rec["path"], {bytes.fromhex(k) for k in rec["keys"]})
        elif op == "use":
            for path in rec["paths"]:
                where = self._where.get(path)
                if where is not None and where[1] in self._spaces[where[0]].disk.files:
                    self._touch(self._spaces[where[0]], where[1])

    def _drop(self, path: str, keys: set[bytes]) -> None:
        where = self._where.get(path)
        if where is None:
            return
        space = self._spaces[where[0]]
        f = space.disk.files.get(where[1])
        if f is None:
            return
        left = tuple(k for k in f.keys if k not in keys)
        if not left:
            self._remove(path)
            return
        space.disk.remove(where[1])
        space.disk._restore(where[1], _File(left, f.nbytes, f.last_use, f.ready, f.pins))

    def _event(self, ns: str, path: str, written: bool) -> None:
        events = self._events.setdefault(ns, {})
        events.pop(path, None)
        events[path] = written

    def _touch(self, space: _Namespace, fid: int) -> None:
        self._tick(space.disk)
        space.disk.touch(fid)
        self._tock(space.disk)

    def _remove(self, path: str) -> None:
        where = self._where.pop(path, None)
        self._owners.pop(path, None)
        if where is None:
            return
        self._event(where[0], path, False)
        space = self._spaces[where[0]]
        if where[1] in space.disk.files:
            space.disk.remove(where[1])
        space.path_of.pop(where[1], None)
        self._live_records -= 1

    # -- the lock and the journal ---------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._sync()
                yield
            finally:
                os.close(fd)  # releases the flock

    def _sync(self) -> None:
        """Replay what was appended since this tier last read the ledger (all of it when
        another engine compacted it: a new inode)."""
        try:
            st = os.stat(self.ledger_path)
        except FileNotFoundError:
            if self._inode is not None:
                self._reset()
            return
        if st.st_ino != self._inode:
            before = dict(self._where)
            events = self._events
            self._reset()
            self._inode = st.st_ino
            self._replay(st.st_size)
            self._events = events
            for path, (ns, _) in before.items():
                if path not in self._where:
                    self._event(ns, path, False)
            for path, (ns, fid) in self._where.items():
                if path not in before and self._spaces[ns].disk.files[fid].ready:
                    self._event(ns, path, True)
            return
        self._replay(st.st_size)

    def _replay(self, size: int) -> None:
        if size <= self._offset:
            return
        with open(self.ledger_path, "rb") as f:
            f.seek(self._offset)
            data = f.read(size - self._offset)
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a record torn by a writer killed mid-append
            self._count_add(rec, len(line))
            self._apply(rec)
        self._offset += end

    def _count_add(self, rec: dict[str, Any], nbytes: int) -> None:
        if rec.get("op") == "add":
            self._add_bytes += nbytes
            self._adds += 1

    def _append(self, records: Sequence[dict[str, Any]]) -> None:
        if not records:
            return
        lines = [json.dumps(r, separators=(",", ":")).encode() for r in records]
        for r, line in zip(records, lines, strict=True):
            self._count_add(r, len(line))
        data = b"".join(line + b"\n" for line in lines)
        fd = os.open(self.ledger_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            st = os.fstat(fd)
            if st.st_size > self._offset:  # a torn tail: start on a new line
                data = b"\n" + data
            if self._inode != st.st_ino:
                self._inode, self._offset = st.st_ino, 0
            os.write(fd, data)
            self._offset = os.fstat(fd).st_size
        finally:
            os.close(fd)
        for r in records:
            self._apply(r)

    # -- what a tier does -------------------------------------------------------

    def reserve(
        self, ns: str, files: Sequence[Sequence[bytes]],
        name_of: Callable[[Sequence[bytes]], str], size_of: Callable[[Sequence[bytes]], int],
        positions: Any = None, servable: Callable[[bytes, str], bool] | None = None,
    ) -> list[tuple[str, tuple[bytes, ...]]] | None:
        """Room for new files of ``ns`` (each a list of keys), evicting by the rule first.

        Returns the files to write, ``(path, keys)``: under the rule, keys that would
        arrive stranded (their parent is not on the root, or no boundary they serve
        could be whole) are left out, and a file left empty is not written.  Keys
        already on the root are left out too.  None when they do not fit: nothing
        reserved, nothing evicted.  Victims are removed from the ledger and unlinked
        before this returns.  ``positions``: the request's key -> end token, observed
        first (:meth:`observe`).  ``servable(key, path)``: whether the tier can still load a
        key the ledger holds in the file at ``path``; a key it cannot (its section failed, its file vanished) leaves its
        file first (:meth:`drop_keys`) and is stored anew."""
        with self._locked():
            space = self._space(ns)
            if positions:
                space.structure.observe_positions(positions)
            if servable is not None:
                dead: dict[str, list[bytes]] = {}
                for keys in files:
                    for k in keys:
                        fid = space.disk.file_of.get(k)
                        if (fid is not None and space.disk.files[fid].ready
                                and not servable(k, space.path_of[fid])):
                            dead.setdefault(space.path_of[fid], []).append(k)
                for path, keys in dead.items():
                    self._drop_keys_locked(path, keys)
            out: list[tuple[str, tuple[bytes, ...]]] = []
            taken: set[bytes] = set()
            offered = [k for k in dict.fromkeys(k for keys in files for k in keys)
                       if k not in space.disk.file_of]
            bad: set[bytes] = set()
            if self.rule is EvictionRule.REACHABLE and offered:
                # the job's files arrive together; chunked prefill stores a boundary's
                # window chunks before its full-attention chunk
                bad = space.disk.arrives_stranded(offered, pending_windows=True)
                self.counters.add(keys_not_admitted=len(bad))
            for keys in files:
                new = [k for k in dict.fromkeys(keys) if k not in space.disk.file_of
                       and k not in taken and k not in bad]
                if not new:
                    continue
                path = name_of(new)
                if path in self._where:
                    continue
                taken.update(new)
                out.append((path, tuple(new)))
            if not out:
                return []
            added: list[int] = []
            for _path, keys in out:
                self._tick(space.disk)
                added.append(space.disk.add(keys, size_of(keys), ready=False))
                self._tock(space.disk)
            victims = self._evict(0)
            if victims is None:
                self._replay_all()  # drops the files just added (and any removal)
                self.counters.add(stores_refused=1)
                return None
            for fid in added:
                space.disk.remove(fid)
            records: list[dict[str, Any]] = [{"op": "rm", "path": p} for p, _ in victims]
            for path, keys in out:
                records.append({
                    "op": "add", "ns": ns, "path": path, "bytes": size_of(keys),
                    "keys": _hex(keys), "owner": self._owner,
                    "fragment": _fragment_json(space.structure.fragment(keys)),
                })
            self._append(records)
            for p, _ in victims:
                self._unlink(os.path.join(self.root, p))
            self.counters.add(files_evicted=len(victims),
                              bytes_evicted=sum(n for _, n in victims))
            return out

    def _candidates(self) -> Iterator[tuple[int, str, tuple[int, ...]]]:
        for ns, space in self._spaces.items():
            disk = space.disk
            if self.rule is EvictionRule.REACHABLE:
                unit = disk._next_unit()
                if unit is not None:
                    disk._push_if_leaf(unit[0])  # _next_unit popped it; it may not be taken
            else:
                unit = disk._lru_file()
            if unit is not None:
                yield disk.files[unit[0]].last_use, ns, unit

    def _evict(self, needed: int) -> list[tuple[str, int]] | None:
        """Remove units by the rule from the model until ``needed`` more bytes fit; the
        victims ``(path, bytes)`` (the caller appends their ``rm`` records and unlinks
        them), or None with the model as the journal says (replayed: a refusal is rare,
        and undoing the removals one by one costs O(files) each)."""
        victims: list[tuple[str, int]] = []
        while self.total_bytes + needed > self.budget:
            best = min(self._candidates(), default=None)
            if best is None:
                return None  # the caller replays the journal: the model as it was
            _, ns, unit = best
            space = self._spaces[ns]
            for fid in unit:
                path = space.path_of[fid]
                victims.append((path, space.disk.files[fid].nbytes))
                self._remove(path)
        return victims

    def _replay_all(self) -> None:
        """The files model as the journal says, rebuilt; the pending events and the
        prefix structures are kept (a structure holds what this tier observed of requests
        whose chunks are not stored, e.g. the parent of a refused store's keys)."""
        events = self._events
        kept = {ns: space.structure for ns, space in self._spaces.items()}
        self._reset()
        self._kept = kept
        self._sync()
        self._kept = {}
        self._events = events

    def complete(self, results: Sequence[tuple[str, bool]]) -> list[str]:
        """Files written (True) or failed (False).  A failed file leaves the ledger, and
        under the rule so do the files its absence strands (a failed store leaves no
        trace): they are unlinked; returns their paths."""
        with self._locked():
            self._append([{"op": "done", "path": p, "ok": ok} for p, ok in results])
            if all(ok for _, ok in results) or self.rule is not EvictionRule.REACHABLE:
                return []
            return self._drop_stranded()

    def _drop_stranded(self) -> list[str]:
        """Stranded keys leave the ledger's model (a file whose every key is stranded
        goes: removed and unlinked); returns the paths removed.  Files being written
        are left alone (their keys are judged when they complete)."""
        gone: list[str] = []
        while True:
            records: list[dict[str, Any]] = []
            victims: list[str] = []
            for space in self._spaces.values():
                by_file: dict[int, list[bytes]] = {}
                for k in space.disk.stranded(pending_windows=True):
                    by_file.setdefault(space.disk.file_of[k], []).append(k)
                for fid, keys in by_file.items():
                    f = space.disk.files[fid]
                    if not f.ready:
                        continue
                    path = space.path_of[fid]
                    if len(keys) == len(f.keys):
                        records.append({"op": "rm", "path": path})
                        victims.append(path)
                    else:
                        records.append({"op": "drop", "path": path, "keys": _hex(keys)})
            if not records:
                return gone
            self._append(records)
            for p in victims:
                self._unlink(os.path.join(self.root, p))
            self.counters.add(files_evicted=len(victims))
            gone += victims

    def drop_keys(self, path: str, keys: Iterable[bytes]) -> list[str]:
        """Keys of a file no load can serve any more (their section failed verification):
        they leave the ledger's model of the file, and the files that strands go (the
        rule); a file left with no key goes too.  Returns the paths removed."""
        with self._locked():
            return self._drop_keys_locked(path, list(keys))

    def _drop_keys_locked(self, path: str, keys: list[bytes]) -> list[str]:
        if path not in self._where or not keys:
            return []
        self._append([{"op": "drop", "path": path, "keys": _hex(keys)}])
        gone = []
        if path not in self._where:  # no key left: the file goes
            self._unlink(os.path.join(self.root, path))
            gone.append(path)
        if self.rule is EvictionRule.REACHABLE:
            gone += self._drop_stranded()
        return gone

    def touch(self, paths: Iterable[str]) -> None:
        """Files read (their use time becomes now, for every engine)."""
        paths = [p for p in dict.fromkeys(paths)]
        if not paths:
            return
        with self._locked():
            known = [p for p in paths if p in self._where]
            if known:
                self._append([{"op": "use", "paths": known}])

    def forget(self, paths: Iterable[str]) -> None:
        """Files that are gone (a bad file deleted or quarantined by a load)."""
        with self._locked():
            self._append([{"op": "rm", "path": p} for p in paths if p in self._where])

    def removed_since(self, known: Iterable[str]) -> list[str]:
        """Of ``known`` paths, those the ledger no longer holds (after replaying it)."""
        with self._locked():
            return [p for p in known if p not in self._where]

    def start(self, ns: str, on_disk: Iterable[str]) -> dict[str, int]:
        """A tier of ``ns`` starts over the root (``on_disk``: its namespace's files, paths
        relative to the root): dead writers' reservations fail, the ledger and the
        directory are reconciled, and the budget is enforced.  Counts of what it did."""
        with self._locked():
            on_disk = set(on_disk)
            reclaimed = [p for p, owner in self._owners.items() if not _alive(owner)]
            gone = self.complete_locked([(p, False) for p in reclaimed])
            mine = {p for p, (n, _) in self._where.items() if n == ns}
            missing = sorted(p for p in mine - on_disk if p not in self._owners)
            self._append([{"op": "rm", "path": p} for p in missing])
            orphans = sorted(on_disk - mine - set(gone) - set(reclaimed))
            for p in orphans:
                self._unlink(os.path.join(self.root, p))
            victims = self._evict(0) or []
            self._append([{"op": "rm", "path": p} for p, _ in victims])
            for p, _ in victims:
                self._unlink(os.path.join(self.root, p))
            self.counters.add(orphans_removed=len(orphans), reservations_reclaimed=len(reclaimed),
                              files_evicted=len(victims))
            self._compact_if_large()
            return {"reclaimed": len(reclaimed), "missing": len(missing),
                    "orphans": len(orphans), "evicted": len(victims),
                    "files": len(self._where), "bytes": self.total_bytes}

    def complete_locked(self, results: Sequence[tuple[str, bool]]) -> list[str]:
        if not results:
            return []
        for p, ok in results:
            if not ok:
                self._unlink(os.path.join(self.root, p))
        self._append([{"op": "done", "path": p, "ok": ok} for p, ok in results])
        if self.rule is not EvictionRule.REACHABLE:
            return []
        return self._drop_stranded()

    # -- compaction -------------------------------------------------------------

    def _compact_if_large(self) -> None:
        size = self._offset
        if size >= COMPACT_MIN_BYTES and size > 4 * self._snapshot_estimate():
            self.compact_locked()

    def _snapshot_estimate(self) -> int:
        """Bytes a compacted ledger takes: the live files' add records (and their done)."""
        per_file = self._add_bytes / self._adds if self._adds else 512
        return int(max(1, self._live_records) * (per_file + 64))

    def compact(self) -> None:
        with self._locked():
            self.compact_locked()

    def compact_locked(self) -> None:
        """Rewrite the ledger as the live files, least recently used first (same model)."""
        entries = []
        for ns, space in self._spaces.items():
            for fid, f in space.disk.files.items():
                entries.append((f.last_use, ns, fid, f))
        records: list[dict[str, Any]] = []
        for _, ns, fid, f in sorted(entries, key=lambda e: e[0]):
            space = self._spaces[ns]
            path = space.path_of[fid]
            records.append({
                "op": "add", "ns": ns, "path": path, "bytes": f.nbytes, "keys": _hex(f.keys),
                "owner": self._owners.get(path, self._owner),
                "fragment": _fragment_json(space.structure.fragment(f.keys)),
            })
            if f.ready:
                records.append({"op": "done", "path": path, "ok": True})
        tmp = f"{self.ledger_path}.{os.getpid()}.compact"
        with open(tmp, "wb") as out:
            for r in records:
                out.write(json.dumps(r, separators=(",", ":")).encode() + b"\n")
        os.replace(tmp, self.ledger_path)
        self._sync()  # a new inode: replayed whole, the structures pruned to the live files


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
