"""The ledger of one ``root_dir``: the model every engine writing there shares.

The design (a journal under the root's lock, replayed by every engine before it decides),
its bound and its crash handling are :mod:`vllm_adapter.disk.budget`'s docstring; the
records and leases are :mod:`vllm_adapter.disk.journal`'s; this module is the mechanism.
It is one class, :class:`RootLedger`: the model (the reference's
:class:`~reference.eviction.Disk` per namespace, paths, reservations, recency on one
clock), the journal it is replayed from, and the operations a tier calls (reserve,
complete, drop keys, touch, forget, start, compact) that change both together.

**The store protocol** (:func:`vllm_adapter.disk.tier_budget.store_files` runs it):
``reserve`` appends an ``add`` per file (evicting first: victims are unlinked, then their
``rm`` appended), the writer fills a temporary file and renames it, then ``complete``
appends ``done``.  A crash at any step leaves a reservation whose owner's lease is free:
the next engine that takes the lock reclaims it (its file and its temporary files
removed, ``done`` false appended).  A crash between a victim's unlink and its ``rm``
record leaves the ledger counting a file that is gone: an over-count, which the next
start reconciles.  Bytes on the root therefore never exceed the budget at any step.

**Recycling a victim** (``reserve(..., recycle=True)``, what a tier does): a victim no
larger than a new file becomes that file's temporary file, so its blocks are overwritten
rather than freed and allocated again (an unlink on a file system mounted with ``discard``
costs about a third of a 2 MiB write, and the allocation of the new file's extents most of
another; Mooncake's bucket files reuse space the same way).  The order keeps the bound:
the new file's ``add`` is appended first (the ledger counts the victim and the new file);
then the victim is renamed onto the new file's temporary name; then the victim's ``rm``
is appended.  A crash after the ``add`` leaves the victim in place and counted, and a
pending reservation that the next lock acquisition reclaims; a crash after the rename
leaves the ledger counting the victim (gone: an over-count) and the new file, whose
temporary file the reclaim removes.  A victim being read by this engine (:meth:`RootLedger.reading`) is unlinked,
not recycled; another engine's read of a recycled victim fails its checksums (the key is
recomputed, never served wrong) where an unlinked one would still read its old bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import itertools
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from reference.eviction import EvictionRule, unit_last_use
from reference.knobs import Chunking
from reference.prefix_structure import PrefixStructure
from vllm_adapter.disk import ledger_snapshot
from vllm_adapter.disk.atomic_file import TEMP_SUFFIX, temp_path
from vllm_adapter.disk.journal import encode, fragment_json, hex_keys
from vllm_adapter.disk.lease import LEASE_SECONDS, FlockUnsupported, Lease, RootLock
from vllm_adapter.disk.ledger_model import (
    LEDGER_FILE,
    LOCK_FILE,
    BudgetCounters,
    DeferredNamespace,
    LedgerIO,
    LedgerModel,
)

__all__ = [
    "LEDGER_FILE",
    "LOCK_FILE",
    "BudgetCounters",
    "BudgetMismatch",
    "LedgerIO",
    "RootLedger",
    "budget_for_files",
    "ledger_reserve",
]

USE_BATCH = 64
"""Reads are journaled in batches: at the next locked operation, or once this many wait."""
RESERVE_MIN = 1 << 20
RESERVE_MAX = 1 << 30
COMPACT_MIN_BYTES = 64 << 10
"""The journal is never compacted below this size (a ledger with no reserve still compacts)."""


def ledger_reserve(disk_bytes: int) -> int:
    """The part of ``disk_bytes_to_use`` kept for the ledger's own files (the journal, its
    lock, the leases) and the quarantine: 1/128 of the budget, at least 1 MiB and at most
    1 GiB.  Files get the rest.  The journal is compacted once it passes half of it."""
    return max(RESERVE_MIN, min(RESERVE_MAX, disk_bytes // 128))


def budget_for_files(files_bytes: int) -> int:
    """The smallest ``disk_bytes_to_use`` whose files' part (after :func:`ledger_reserve`)
    holds ``files_bytes``."""
    budget = files_bytes + max(RESERVE_MIN, min(RESERVE_MAX, -(-files_bytes // 127)))
    while budget - ledger_reserve(budget) < files_bytes:
        budget += 1
    while budget > files_bytes and (budget - 1) - ledger_reserve(budget - 1) >= files_bytes:
        budget -= 1
    return budget


class BudgetMismatch(ValueError):
    """An engine starts on a root with another budget than the one recorded there."""


class RootLedger(LedgerModel):
    """The model of one ``root_dir`` every tier writing there shares (see the module docstring).

    Paths are relative to the root.  Every public method takes the root's lock and first
    replays what other engines appended and reclaims dead owners' reservations.
    Thread-safe.  ``budget`` is ``disk_bytes_to_use``: files get ``budget -
    ledger_reserve(budget)`` (``reserve`` overrides it; 0: the budget covers the files alone,
    as in tests of the eviction rule).
    ``adopt_budget``: an engine whose budget differs from the one recorded on the root
    takes the recorded one instead of refusing.
    """

    def __init__(self, root: str, budget: int, rule: EvictionRule = EvictionRule.REACHABLE,
                 counters: BudgetCounters | None = None, *, reserve: int | None = None,
                 adopt_budget: bool = False, io: LedgerIO | None = None,
                 owner_id: str | None = None, lease_s: float = LEASE_SECONDS,
                 chunkings: Mapping[str, Chunking] | None = None) -> None:
        self.root = root
        self.rule = rule
        self.counters = counters or BudgetCounters()
        self.io = io or LedgerIO()
        self.ledger_path = os.path.join(root, LEDGER_FILE)
        self._lock_path = os.path.join(root, LOCK_FILE)
        self._thread_lock = threading.RLock()
        self._acquiring = threading.Lock()
        """One thread of this ledger at a time takes the root's lock (the held symlink names
        the ledger, not the thread)."""
        self._local = threading.local()
        """``depth``: how deep this thread is inside :meth:`_locked`."""
        self._chunkings: dict[str, Chunking] = dict(chunkings or {})
        """Namespace -> the chunking its structure judges prefixes with (:meth:`set_chunking`;
        given here, the first replay builds those structures once instead of twice)."""
        self._kept: dict[str, PrefixStructure] = {}
        self._mine: dict[str, str] = {}
        """Path -> rid of the reservations this ledger made and has not completed."""
        self._uses: dict[str, None] = {}
        """Rids read since the last ``use`` record."""
        self._compacted_bytes = 0
        """About the journal's size were it compacted now: its live records' bytes when it
        was last replayed whole (:meth:`_sync`, at a start or after a compaction)."""
        self._owed: list[tuple[str, str, bool]] = []
        """Completions (path, rid, written) whose ``done`` record the journal refused (a full
        disk, a file-size limit): journaled at this ledger's next locked operation."""
        self._recycled: dict[str, str] = {}
        """Path of this ledger's pending reservation -> the temporary file (absolute) a
        recycled victim became, until its writer takes it (:meth:`take_recycled`)."""
        self._taken: dict[str, str] = {}
        """The same, once taken, until the reservation completes."""
        self._reading: dict[str, int] = {}
        """Path -> loads of this engine reading it now (never recycled)."""
        self._fixed_reserve = reserve
        self._adopt = adopt_budget
        self._use_snapshot = True
        self.budget = budget
        self._set_budget(budget)
        self._reset()
        self.lease = Lease(root, owner_id, io=self.io, lease_s=lease_s)
        self.owner = self.lease.id
        self._root_lock = RootLock(root, self.lease)
        self._rids = itertools.count()
        try:
            with self._locked():
                self._record_budget()
        except BaseException:
            self.lease.release()
            raise

    @classmethod
    def replayed(cls, root: str, rule: EvictionRule = EvictionRule.REACHABLE, *,
                 snapshot: bool = False,
                 chunkings: Mapping[str, Chunking] | None = None) -> RootLedger:
        """The model a fresh replay of ``root``'s journal gives, read without the lock and
        without a lease (a check compares engines with it; it must not act): every line
        replayed, or with ``snapshot``, from the ledger's snapshot when it binds the
        journal.  ``chunkings``: as the engine's (namespace -> its chunking)."""
        self = cls.__new__(cls)
        self.root, self.rule = root, rule
        self.counters = BudgetCounters()
        self.io = LedgerIO()
        self.ledger_path = os.path.join(root, LEDGER_FILE)
        self._thread_lock = threading.RLock()
        self._local = threading.local()
        self._chunkings, self._kept, self._mine, self._uses = dict(chunkings or {}), {}, {}, {}
        self._owed, self._compacted_bytes = [], 0
        self._recycled, self._taken, self._reading = {}, {}, {}
        self._fixed_reserve, self._adopt = None, False
        self._use_snapshot = snapshot
        self._reset()
        self._sync()
        self._set_budget(self._recorded_budget or 0)
        return self

    # -- the budget -------------------------------------------------------------

    def _set_budget(self, budget: int) -> None:
        self.budget = budget
        self.ledger_bytes = self._fixed_reserve if self._fixed_reserve is not None else ledger_reserve(budget)
        self.files_budget = max(0, budget - self.ledger_bytes)

    def _record_budget(self) -> None:
        recorded = self._recorded_budget
        if recorded is None:
            self._append([{"op": "budget", "bytes": self.budget}])
        elif recorded != self.budget:
            if not self._peers_alive():  # no engine runs on the old budget: the new one holds
                self._append([{"op": "budget", "bytes": self.budget}])
                return
            if not self._adopt:
                raise BudgetMismatch(
                    f"'disk_bytes_to_use' is {self.budget}, but the root {self.root!r} records "
                    f"{recorded} (set by the first engine there): every engine on a root shares "
                    f"one budget. Give {recorded}, or set \"adopt_recorded_budget\": true to use "
                    f"the recorded value")
            self._set_budget(recorded)

    def _peers_alive(self) -> bool:
        """Whether another owner's lease on the root is held."""
        try:
            names = os.listdir(self.lease.dir)
        except FileNotFoundError:
            return False
        return any(self.lease.alive(n[: -len(".lease")]) for n in names
                   if n.endswith(".lease") and n[: -len(".lease")] != self.owner)

    # -- model ----------------------------------------------------------------

    def observe(self, ns: str, positions: Any) -> None:
        """Feed namespace ``ns``'s own structure a request's key positions (key -> end token)."""
        with self._locked():
            self._space(ns).structure.observe_positions(positions)

    def set_chunking(self, ns: str, chunking: Chunking) -> None:
        """Namespace ``ns`` is this tier's: its structure is fed by :meth:`observe` too."""
        with self._thread_lock:
            self._chunkings[ns] = chunking
        with self._locked():
            if self._spaces.get(ns) is not None and self._spaces[ns].chunking() is None:
                self._replay_all()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The root's lock: replayed, dead owners reclaimed, reads journaled, then the body;
        the journal compacted when it passed half the reserve.

        The lock is an ``flock`` of the lock file (where ``flock`` works: processes of one
        kernel queue on it without polling), then the root's held symlink
        (:class:`~vllm_adapter.disk.lease.RootLock`: what excludes engines on other
        hosts, where no ``flock`` is trusted).  Both are waited for without the in-process
        lock, so a reader of the model (:meth:`files`, :meth:`totals`, on any thread)
        never waits on another process.  Re-entrant on one thread."""
        if getattr(self._local, "depth", 0):
            self._local.depth += 1
            try:
                yield
            finally:
                self._local.depth -= 1
            return
        with self._acquiring:
            fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                if self.lease.flock_works:
                    try:
                        self.io.flock(fd, fcntl.LOCK_EX, self.root)
                    except FlockUnsupported:
                        self.lease.flock_works = False
                self._root_lock.acquire()
                try:
                    with self._thread_lock:
                        self._local.depth = 1
                        try:
                            if self.lease.lost():
                                self.counters.add(leases_lost=1)
                            self._sync()
                            self._reclaim_dead()
                            self._pay_owed()
                            self._flush_uses()
                            yield
                            self._compact_if_large()
                        finally:
                            self._local.depth = 0
                finally:
                    self._root_lock.release()
            finally:
                os.close(fd)  # releases the flock

    def _reclaim_dead(self) -> list[str]:
        """Fail the reservations of owners whose lease is free: their files and temporary
        files are removed, then ``done`` false is appended (and what that strands goes)."""
        if not self._pending:
            return []
        alive: dict[str, bool] = {}
        dead = []
        for path in sorted(self._pending):
            owner = self._res[path].owner
            if owner == self.owner:
                continue
            if owner not in alive:
                alive[owner] = self.lease.alive(owner)
            if not alive[owner]:
                dead.append(path)
        if not dead:
            return []
        for path in dead:
            self._unlink_with_temps(path)
        self.counters.add(reservations_reclaimed=len(dead))
        return self._complete_locked([(p, self._res[p].rid, False) for p in dead])

    def _unlink_with_temps(self, path: str) -> None:
        full = os.path.join(self.root, path)
        for tmp in glob.glob(glob.escape(full) + ".*" + TEMP_SUFFIX):
            self.io.unlink(tmp)
        self.io.unlink(full)

    # -- uses -------------------------------------------------------------------

    def _pay_owed(self) -> None:
        """Journal the completions the journal refused before (:attr:`_owed`); what it
        still refuses stays owed."""
        if self._owed:
            owed, self._owed = self._owed, []
            with contextlib.suppress(OSError):  # what it strands goes at a later completion
                self._complete_locked(owed)

    def _flush_uses(self) -> None:
        if self._uses:
            rids = [r for r in self._uses if r in self._by_rid]
            self._uses = {}
            if rids:
                self._append([{"op": "use", "rids": rids}])

    # -- what a tier does -------------------------------------------------------

    def reserve(
        self, ns: str, files: Sequence[Sequence[bytes]],
        name_of: Callable[[Sequence[bytes]], str], size_of: Callable[[Sequence[bytes]], int],
        positions: Any = None, servable: Callable[[bytes, str], bool] | None = None,
        recycle: bool = False,
    ) -> list[tuple[str, tuple[bytes, ...]]] | None:
        """Room for new files of ``ns`` (each a list of keys), evicting by the rule first.

        Returns the files to write, ``(path, keys)``: under the rule, keys that would
        arrive stranded are left out, and a file left empty is not written.  Keys already
        on the root are left out too.  None when they do not fit: nothing reserved,
        nothing evicted.  Victims are unlinked, then their ``rm`` records appended, before
        this returns.  ``positions``: the request's key -> end token.  ``servable(key,
        path)``: whether the tier can still load a key the ledger holds in the file at
        ``path``; a key it cannot leaves its file first and is stored anew.  ``recycle``:
        a victim no larger than a new file becomes its temporary file (the module
        docstring; the writer takes it with :meth:`take_recycled`)."""
        with self._locked():
            space = self._space(ns)
            if isinstance(space, DeferredNamespace):
                space.ensure_built()  # (before it changes the model: a fallback replays it)
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
                    if path in self._res:  # an earlier drop may have stranded it out already
                        self._drop_keys_locked(path, self._res[path].rid, keys)
            out: list[tuple[str, tuple[bytes, ...]]] = []
            taken: set[bytes] = set()
            offered = [k for k in dict.fromkeys(k for keys in files for k in keys)
                       if k not in space.disk.file_of]
            bad: set[bytes] = set()
            if self.rule is EvictionRule.REACHABLE and offered:
                # a window key is judged by its boundary's every key: a sibling that ends
                # before the store's last key and is not on the root never comes (vLLM's
                # CPU tier cascades only what it newly stored), so the key is left out
                bad = space.disk.arrives_stranded(offered, pending_windows=True,
                                                  window_siblings=True)
                self.counters.add(keys_not_admitted=len(bad))
            for keys in files:
                new = [k for k in dict.fromkeys(keys) if k not in space.disk.file_of
                       and k not in taken and k not in bad]
                if not new:
                    continue
                path = name_of(new)
                if path in self._res:
                    continue
                taken.update(new)
                out.append((path, tuple(new)))
            if not out:
                return []
            if (self._deferring and self.total_bytes + sum(size_of(keys) for _, keys in out)
                    > self.files_budget):
                self._build_all()  # its evictions read them all: built before it adds
            added: list[int] = []
            for _path, keys in out:
                self._tick(space.disk)
                added.append(space.disk.add(keys, size_of(keys), ready=False))
                self._tock(space.disk)
            victims = self._plan_evictions()
            if victims is None:
                self.counters.add(stores_refused=1)
                return None
            for fid in added:
                space.disk.remove(fid)
            reuse = self._pair_victims(out, victims, size_of) if recycle else {}
            recycled = set(reuse.values())
            self._evict([v for v in victims if v[0] not in recycled])
            records: list[dict[str, Any]] = []
            rids = []
            for path, keys in out:
                rid = f"{self.owner}.{next(self._rids)}"
                rids.append(rid)
                records.append({
                    "op": "add", "rid": rid, "ns": ns, "path": path, "bytes": size_of(keys),
                    "keys": hex_keys(keys), "owner": self.owner,
                    "fragment": fragment_json(space.structure.fragment(keys)),
                })
            try:
                self._append(records)
            except OSError:
                if reuse:
                    self._replay_all()  # the recycled victims' removal undone in the model
                raise
            for (path, _), rid in zip(out, rids, strict=True):
                self._mine[path] = rid
            if reuse:
                out = self._recycle(reuse, victims, out)
            return out

    def _pair_victims(self, out: Sequence[tuple[str, tuple[bytes, ...]]],
                      victims: Sequence[tuple[str, int]],
                      size_of: Callable[[Sequence[bytes]], int]) -> dict[str, str]:
        """New path -> the victim it recycles: for each new file in order, the largest victim
        left that is no larger (its bytes stay within the new file's reservation) and that
        no load of this engine is reading."""
        left = sorted(((n, p) for p, n in victims if p not in self._reading), reverse=True)
        reuse: dict[str, str] = {}
        for path, keys in out:
            size = size_of(keys)
            for i, (n, victim) in enumerate(left):
                if n <= size:
                    reuse[path] = victim
                    del left[i]
                    break
        return reuse

    def _recycle(self, reuse: dict[str, str], victims: Sequence[tuple[str, int]],
                 out: list[tuple[str, tuple[bytes, ...]]]) -> list[tuple[str, tuple[bytes, ...]]]:
        """Rename each recycled victim onto its new file's temporary name, then append the
        victims' ``rm``.  A victim that can be neither renamed nor unlinked stays (the
        ledger still holds it) and its new file is not written: completed as failed."""
        moved: list[str] = []
        failed: list[str] = []
        for path, victim in reuse.items():
            src = os.path.join(self.root, victim)
            dst = temp_path(os.path.join(self.root, path))
            try:
                try:
                    self.io.replace(src, dst)
                except FileNotFoundError:
                    if not os.path.exists(src):
                        moved.append(victim)  # gone already (a crash's over-count)
                        continue
                    os.makedirs(os.path.dirname(dst), exist_ok=True)
                    self.io.replace(src, dst)
                self._recycled[path] = dst
                with contextlib.suppress(OSError):  # a stale-temporary sweep judges its age
                    os.utime(dst)                   # by its mtime
            except OSError:
                try:
                    self.io.unlink(src)
                except OSError:
                    failed.append(path)
                    continue
            moved.append(victim)
        sizes = dict(victims)
        if moved:
            try:
                self._append([{"op": "rm", "rid": self._res[v].rid} for v in moved])
            except OSError:
                self._replay_all()  # the journal still counts them: an over-count, safe
            self.counters.add(files_evicted=len(moved), bytes_evicted=sum(sizes[v] for v in moved),
                              files_recycled=len(self._recycled.keys() & reuse.keys()))
        if failed:
            self._replay_all()  # the victims kept are back in the model
            self._complete_locked([(p, self._mine.pop(p), False) for p in failed])
            out = [(p, k) for p, k in out if p not in failed]
        return out

    def take_recycled(self, path: str) -> str | None:
        """The temporary file (absolute path) a victim became for this ledger's pending
        reservation of ``path``, or None: the writer opens it instead of creating one.  One
        that no writer takes is removed when the reservation completes (its bytes are the
        victim's, which the ledger no longer counts)."""
        with self._thread_lock:
            tmp = self._recycled.pop(path, None)
            if tmp is not None:
                self._taken[path] = tmp
            return tmp

    @contextlib.contextmanager
    def reading(self, paths: Iterable[str]) -> Iterator[None]:
        """While a load of this engine reads ``paths``, none of them is recycled."""
        paths = list(paths)
        self.begin_reading(paths)
        try:
            yield
        finally:
            self.end_reading(paths)

    def begin_reading(self, paths: Iterable[str]) -> None:
        """A load of this engine begins reading ``paths`` (:meth:`reading`, for a load whose
        sub-tasks begin and end on different threads)."""
        with self._thread_lock:
            for p in paths:
                self._reading[p] = self._reading.get(p, 0) + 1

    def end_reading(self, paths: Iterable[str]) -> None:
        with self._thread_lock:
            for p in paths:
                if self._reading[p] <= 1:
                    del self._reading[p]
                else:
                    self._reading[p] -= 1

    def _plan_evictions(self, partial: bool = False) -> list[tuple[str, int]] | None:
        """Remove units by the rule from the files model until its files fit the files'
        budget; the victims ``(path, bytes)`` in order (still named by the ledger: the
        caller unlinks them and appends their ``rm`` with :meth:`_evict`).  When nothing
        more may go: None with the model as the journal says (``partial``: the victims so
        far, the rest being pinned by pending reservations)."""
        victims: list[tuple[str, int]] = []
        total = self.total_bytes
        if total > self.files_budget:
            self._build_all()  # (it changes several: none falls back half way)
        while total > self.files_budget:
            best = None
            for space in self._spaces.values():
                unit = space.disk.next_victim(self.rule)
                if unit is not None:  # namespaces' units compared as the rule orders its own
                    use = unit_last_use(space.disk, unit)
                    if best is None or use < best[0]:
                        best = (use, space, unit)
            if best is None:
                if partial:
                    break
                self._replay_all()  # a refusal is rare: the model as the journal says
                return None
            _, space, unit = best
            for fid in unit:
                f = space.disk.files[fid]
                victims.append((space.path_of[fid], f.nbytes))
                total -= f.nbytes
                space.disk.remove(fid)
        return victims

    def _evict(self, victims: Sequence[tuple[str, int]]) -> None:
        """Unlink the victims, then append their ``rm`` records (a crash between the two
        over-counts: the ledger names a file that is gone, which is safe)."""
        if not victims:
            return
        records = [{"op": "rm", "rid": self._res[p].rid} for p, _ in victims]
        try:
            for path, _ in victims:
                self.io.unlink(os.path.join(self.root, path))
            self._append(records)
        except OSError:
            self._replay_all()  # the victims' removal undone in the model (an over-count)
            raise
        self.counters.add(files_evicted=len(victims), bytes_evicted=sum(n for _, n in victims))

    def complete(self, results: Sequence[tuple[str, bool]]) -> list[str]:
        """This ledger's reservations written (True) or failed (False).  A failed file is
        removed and leaves the ledger, and under the rule so do the files its absence
        strands.  Returns the paths removed.  A path this ledger did not reserve (or
        already completed) is ignored.  A reservation a peer reclaimed meanwhile (this owner
        stalled past its lease) is lost: its file, written or not, is removed unless the
        path was reserved anew.  Completions the journal refuses (a full disk) stay owed
        and are journaled by this ledger's next locked operation (:meth:`close` included):
        until then the files count as pending."""
        with self._locked():
            for p, ok in results:
                untaken = self._recycled.pop(p, None)  # its writer wrote a file of its own
                taken = self._taken.pop(p, None)
                if untaken is not None:
                    self.io.unlink(untaken)
                if taken is not None and not ok:  # the writer removes it; once more if it did not
                    self.io.unlink(taken)
            mine = [(p, self._mine.pop(p), ok) for p, ok in results if p in self._mine]
            lost = [p for p, rid, _ in mine if self._by_rid.get(rid) != p]
            for p in lost:
                if p not in self._res:
                    self._unlink_with_temps(p)
            if lost:
                self.counters.add(reservations_lost=len(lost))
            return self._complete_locked(mine)

    def _complete_locked(self, results: Sequence[tuple[str, str, bool]]) -> list[str]:
        live = [(p, rid, ok) for p, rid, ok in results if self._by_rid.get(rid) == p]
        if not live:
            return []
        for p, _, ok in live:
            if not ok:
                self.io.unlink(os.path.join(self.root, p))
        try:
            self._append([{"op": "done", "rid": rid, "ok": ok} for _, rid, ok in live])
        except OSError:
            # The journal refused the records (full disk, file-size limit): the files stay
            # counted as pending (the budget holds) and are completed by this ledger's next
            # locked operation, not left pending until the owner dies.
            self._owed.extend(live)
            return [p for p, _, ok in live if not ok]
        if all(ok for _, _, ok in live) or self.rule is not EvictionRule.REACHABLE:
            return [p for p, _, ok in live if not ok]
        return [p for p, _, ok in live if not ok] + self._drop_stranded()

    def _drop_stranded(self) -> list[str]:
        """Stranded keys leave the model (a file whose every key is stranded goes: unlinked,
        then removed); returns the paths removed.  Files being written are left alone."""
        gone: list[str] = []
        while True:
            drops: list[dict[str, Any]] = []
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
                        victims.append(path)
                    else:
                        drops.append({"op": "drop", "rid": self._res[path].rid,
                                      "keys": hex_keys(keys)})
            if not drops and not victims:
                return gone
            for p in victims:
                self.io.unlink(os.path.join(self.root, p))
            self._append([{"op": "rm", "rid": self._res[p].rid} for p in victims] + drops)
            self.counters.add(files_evicted=len(victims))
            gone += victims

    def drop_finished(self, ns: str, keys: Iterable[bytes]) -> list[str]:
        """A request of this engine finished and its stores are done: of ``keys`` (its
        store jobs' keys), those in this ledger's written files that no lookup can load
        leave (:meth:`reference.eviction.Disk.stranded_among`: window chunks admitted
        pending a boundary whose full-attention store was refused, or whose sibling never
        came), as the reference's ``BudgetedIndex.idle`` drops them; a file left with no
        key goes (unlinked, then removed).  Files another engine owns (its requests may
        still complete their boundaries) and files a load of this engine is reading stay.
        The work grows with ``keys``, not the root.  Returns the paths removed."""
        if self.rule is not EvictionRule.REACHABLE:
            return []
        with self._locked():
            if ns not in self._spaces:
                return []
            space = self._space(ns)
            if isinstance(space, DeferredNamespace):
                space.ensure_built()
            mine: list[bytes] = []
            for k in dict.fromkeys(keys):
                fid = space.disk.file_of.get(k)
                if fid is None or not space.disk.files[fid].ready:
                    continue
                path = space.path_of[fid]
                if self._res[path].owner == self.owner and path not in self._reading:
                    mine.append(k)
            by_file: dict[int, list[bytes]] = {}
            for k in space.disk.stranded_among(mine):
                by_file.setdefault(space.disk.file_of[k], []).append(k)
            victims: list[str] = []
            drops: list[dict[str, Any]] = []
            for fid, dropped in by_file.items():
                path = space.path_of[fid]
                if len(dropped) == len(space.disk.files[fid].keys):
                    victims.append(path)
                else:
                    drops.append({"op": "drop", "rid": self._res[path].rid,
                                  "keys": hex_keys(dropped)})
            if not by_file:
                return []
            for p in victims:
                self.io.unlink(os.path.join(self.root, p))
            self._append([{"op": "rm", "rid": self._res[p].rid} for p in victims] + drops)
            self.counters.add(files_evicted=len(victims), finished_keys_dropped=sum(
                len(v) for v in by_file.values()), finished_files_removed=len(victims))
            return victims

    def drop_keys(self, path: str, keys: Iterable[bytes], rid: str | None = None) -> list[str]:
        """Keys of a file no load can serve any more: they leave the ledger's model of the
        file, and the files that strands go (the rule); a file left with no key goes too.
        ``rid``: the reservation the load read (a newer one of the path is left alone).
        Returns the paths removed."""
        with self._locked():
            current = self._res.get(path)
            if current is None or (rid is not None and rid != current.rid):
                return []
            return self._drop_keys_locked(path, current.rid, list(keys))

    def _drop_keys_locked(self, path: str, rid: str, keys: list[bytes]) -> list[str]:
        if not keys:
            return []
        f = self._spaces[self._res[path].ns].disk.files[self._res[path].fid]
        gone = []
        if set(f.keys) <= set(keys):  # no key left: the file goes
            self.io.unlink(os.path.join(self.root, path))
            gone.append(path)
        self._append([{"op": "drop", "rid": rid, "keys": hex_keys(keys)}])
        if self.rule is EvictionRule.REACHABLE:
            gone += self._drop_stranded()
        return gone

    def touch(self, paths: Iterable[str], rids: dict[str, str] | None = None) -> None:
        """Files read (their use time becomes now, for every engine): journaled in batches
        of :data:`USE_BATCH`, or at this ledger's next locked operation.  ``rids``: the
        reservations the load read (:meth:`rids`); by default the current ones."""
        with self._thread_lock:
            for p in paths:
                rid = rids.get(p) if rids is not None else (
                    self._res[p].rid if p in self._res else None)
                if rid is not None:
                    self._uses[rid] = None
            flush = len(self._uses) >= USE_BATCH
        if flush:
            with self._locked():
                pass

    def forget(self, paths: Iterable[str] | dict[str, str]) -> None:
        """Files that are gone (a bad file deleted or quarantined by a load).  Given as
        path -> rid (:meth:`rids` when the load began), a path reserved anew since is
        left alone; given as paths, the current reservations go."""
        with self._locked():
            items = (paths.items() if isinstance(paths, dict)
                     else ((p, self._res[p].rid) for p in paths if p in self._res))
            records = [{"op": "rm", "rid": rid} for p, rid in items
                       if self._by_rid.get(rid) == p and p not in self._pending]
            self._append(records)

    def removed_since(self, known: Iterable[str]) -> list[str]:
        """Of ``known`` paths, those the ledger no longer holds (after replaying it)."""
        with self._locked():
            return [p for p in known if p not in self._res]

    def sync(self) -> None:
        """Replay what other engines appended and reclaim dead owners (takes the lock)."""
        with self._locked():
            pass

    def drain(self, ns: str, refresh: bool = False) -> tuple[list[str], list[str]]:
        """Files of ``ns`` written and files gone since the last call (``refresh``: replay
        the ledger first, when it grew or was replaced)."""
        if refresh and self._changed():
            with self._locked():
                pass
        with self._thread_lock:
            events = self._events.pop(ns, {})
            return ([p for p, w in events.items() if w and p in self._res],
                    [p for p, w in events.items() if not w])

    def start(self, ns: str, on_disk: Iterable[str], temps: Iterable[str] = ()) -> dict[str, int]:
        """A tier of ``ns`` starts over the root (``on_disk``: its namespace's files,
        ``temps``: its writers' temporary files, paths relative to the root): dead writers'
        reservations fail, the ledger and the directory are reconciled (names and sizes),
        and the budget is enforced.  Counts of what it did.

        A temporary file whose file is not pending in the ledger is an orphan (a writer
        reserves before it writes, so a live write's file is pending): a damaged journal
        can lose a crashed writer's reservation, and its temporary file would otherwise
        stay outside the budget until it ages out."""
        with self._locked():
            on_disk = set(on_disk)
            mine = {p for p, r in self._res.items() if r.ns == ns}
            missing = sorted(p for p in mine - on_disk if p not in self._pending)
            self._append([{"op": "rm", "rid": self._res[p].rid} for p in missing])
            orphans = sorted(on_disk - mine)
            for p in orphans:
                self.io.unlink(os.path.join(self.root, p))
            stray = [t for t in temps if t.rsplit(".", 2)[0] not in self._pending]
            for t in stray:
                self.io.unlink(os.path.join(self.root, t))
            orphans += stray
            self._reconcile_sizes(self._verified)
            self._verified = {}
            victims = self._plan_evictions(partial=True) or []
            self._evict(victims)
            self.counters.add(orphans_removed=len(orphans))
            reclaimed = self.counters.as_dict()["reservations_reclaimed"]  # since the ledger opened
            return {"reclaimed": reclaimed, "missing": len(missing),
                    "orphans": len(orphans), "evicted": len(victims),
                    "files": len(self._res), "bytes": self.total_bytes}

    def _reconcile_sizes(self, verified: Mapping[str, str] | None = None) -> None:
        """Written files whose size on disk differs from their record get a ``size`` record
        (a damaged or lying journal never lets the root pass its budget).  ``verified``:
        path -> rid of files whose size the ledger's snapshot found right when it was
        written at shutdown (the journal is then byte for byte the one checked, so their
        records are the ones checked; a file's size changes after its ``done`` only by a
        new reservation of its path, which the snapshot does not hold): not ``stat``-ed."""
        records = []
        verified = verified or {}
        for path, r in self._res.items():
            if path in self._pending or verified.get(path) == r.rid:
                continue
            try:
                size = os.stat(os.path.join(self.root, path)).st_size
            except FileNotFoundError:
                continue
            if size != self._spaces[r.ns].disk.files[r.fid].nbytes:
                records.append({"op": "size", "rid": r.rid, "bytes": size})
        self._append(records)

    def close(self) -> None:
        """Journal pending reads, write the ledger's snapshot (:meth:`save_snapshot`: the
        next start loads it) and release the lease (the tier is shut down)."""
        with contextlib.suppress(OSError):
            with self._locked():
                self._save_snapshot_locked(self.snapshot_max_bytes(), verify=True)
        self.lease.release()

    # -- the snapshot -----------------------------------------------------------

    def snapshot_max_bytes(self) -> int:
        """The most bytes the ledger's snapshot may take: a sixteenth of the ledger's
        reserve (:data:`vllm_adapter.disk.ledger_snapshot.RESERVE_SHARE`)."""
        return self.ledger_bytes // ledger_snapshot.RESERVE_SHARE

    def save_snapshot(self, max_bytes: int | None = -1, verify: bool = True) -> int | None:
        """Write the ledger's snapshot (:mod:`vllm_adapter.disk.ledger_snapshot`) of the
        journal as it is now, under the root's lock, as :meth:`close` does: its bytes, or
        None when it would pass ``max_bytes`` (default :meth:`snapshot_max_bytes`; None: no
        cap), the older one then removed.  ``verify``: every written file's size is checked
        first (a ``size`` record where it differs) and the snapshot says so.  A write that
        fails (a full disk) raises, the older one kept."""
        with self._locked():
            return self._save_snapshot_locked(
                self.snapshot_max_bytes() if max_bytes == -1 else max_bytes, verify)

    def _save_snapshot_locked(self, max_bytes: int | None, verify: bool = False) -> int | None:
        """:meth:`save_snapshot` under the lock: a fresh replay of the journal (from the
        current snapshot and the tail when it binds), encoded and written atomically."""
        ledger_snapshot.remove_partial(self.root)
        path = os.path.join(self.root, ledger_snapshot.SNAPSHOT_FILE)
        if max_bytes is not None and self._compacted_bytes > max_bytes:
            # the journal's live records alone pass the cap, and the snapshot holds as much:
            # not built only to be dropped (a compaction would pay a replay for nothing)
            self.io.unlink(path)
            return None
        if verify:
            self._reconcile_sizes()
        try:
            with open(self.ledger_path, "rb") as f:
                journal = f.read()
        except FileNotFoundError:
            journal = b""
        with self._thread_lock:
            chunkings = dict(self._chunkings)
        model = ledger_snapshot.replay(self.ledger_path, journal, chunkings,
                                       snapshot=self._use_snapshot)
        try:
            data = ledger_snapshot.encode(model, journal, verify)
        except ValueError:  # a model the snapshot cannot hold whole: none is written
            data = None
        if data is None or (max_bytes is not None and len(data) > max_bytes):
            self.io.unlink(path)  # a stale one would only take room: a start would not use it
            return None
        ledger_snapshot.write(self.root, self.owner, data, self.io)
        self.counters.add(snapshots_written=1)
        return len(data)

    # -- compaction -------------------------------------------------------------

    @property
    def compact_at(self) -> int:
        """The journal is compacted once it passes this (half the reserve)."""
        return max(COMPACT_MIN_BYTES, self.ledger_bytes // 2)

    def _compact_threshold(self) -> int:
        """:attr:`compact_at` (the journal's share of the reserve, half of it), or, when the
        live records alone pass it (:attr:`_compacted_bytes`), more: each compaction reads
        and writes every live file, so it waits until the journal has grown by half the
        live records (its cost stays linear in the records appended, and a start over a
        journal already compact does not compact it again).  The journal stays within its
        share while the live records fill at most two thirds of it; past that (files so
        small that their records fill the reserve: the budget bench's 48 KiB files) it
        may reach 1.5x the live records rather than compact every few records."""
        live = self._compacted_bytes
        return max(self.compact_at, live + live // 2)

    def _compact_if_large(self) -> None:
        if self._offset > self._compact_threshold():
            self.compact_locked()

    def compact(self) -> None:
        with self._locked():
            self.compact_locked()

    def compact_locked(self) -> None:
        """Rewrite the journal as the live files, least recently used first (same model).
        When even that passes half the reserve, files are evicted by the rule until it fits."""
        while True:
            records = self._snapshot()
            size = sum(len(encode(r)) for r in records)
            if size <= self.compact_at or not self._res or self.ledger_bytes == 0:
                break
            victims = self._plan_evictions(partial=True) or []
            if not victims:
                break
            per_file = size / max(1, len(self._res))
            need = int((size - self.compact_at) / per_file) + 1
            self._evict(victims[:need])
        tmp = f"{self.ledger_path}.{self.owner}.compact"
        try:
            with open(tmp, "wb") as out:
                for r in records:
                    out.write(encode(r))
            self.io.replace(tmp, self.ledger_path)
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            return  # the long journal stays valid; the next acquisition tries again
        self.counters.add(compactions=1)
        self._sync()  # a new inode: replayed whole, the structures pruned to the live files
        with contextlib.suppress(OSError):  # the next start replays the journal whole
            self._save_snapshot_locked(self.snapshot_max_bytes())

    def _snapshot(self) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = [{"op": "budget", "bytes": self._recorded_budget
                                          if self._recorded_budget is not None else self.budget}]
        entries = []
        for path, r in self._res.items():
            f = self._spaces[r.ns].disk.files[r.fid]
            entries.append((f.last_use, path, r, f))
        for _, path, r, f in sorted(entries, key=lambda e: e[0]):
            space = self._spaces[r.ns]
            records.append({
                "op": "add", "rid": r.rid, "ns": r.ns, "path": path, "bytes": f.nbytes,
                "keys": hex_keys(f.keys), "owner": r.owner,
                "fragment": fragment_json(space.structure.fragment(f.keys)),
            })
            if f.ready:
                records.append({"op": "done", "rid": r.rid, "ok": True})
        return records
