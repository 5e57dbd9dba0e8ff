"""Disk eviction that never strands a chunk, and a plain per-file LRU to compare with.

A disk within a byte budget (the index the Planner talks to) and the hit rate a disk of
a given size gives are :mod:`reference.disk_economics`'s.

The disk
    Files, each a set of chunk keys (:mod:`reference.keys`) with a size in bytes and
    a last-use time.  The *eviction unit is a file*: with the ``packed`` layout one
    or two files per store (one :class:`~reference.plan.Planner` store job: the keys
    one GPU->CPU store of one request carries in one step, every group; its
    full-attention keys in one file and its window keys in another,
    :func:`reference.packed.store_job_files`), with the ``per_chunk`` layout one file
    per key (vLLM's file tier).

What the disk index records (:meth:`PrefixStructure.observe`)
    Keys alone do not say which chunk a key depends on: a key is the block hash at
    its chunk's end plus the group, and a hash does not name its parent.  So the
    index records, from the block hashes of every request whose chunks it stores
    (the scheduler-side connector holds them when it builds a store job, and a
    packed file's header can carry them per section): for each full-attention key,
    the key of the chunk before it in its prefix (its *parent*); for each
    *boundary* (a prefix ending at a multiple of the alignment span ``A``,
    :attr:`~reference.knobs.Chunking.alignment_tokens`, named by the block hash at
    its end), the keys a lookup ending there needs, :func:`reference.rules.needed_chunks`
    of every group from token 0.

Reachability (:meth:`Disk.stranded`)
    A chunk on disk is *reachable* when a lookup with an empty GPU prefix cache (a
    restarted engine, another engine on the same root: the disk on its own) could
    load it, stated from the rules:

    * a full-attention chunk is reachable iff every earlier chunk of its group in its
      prefix is on disk (:func:`~reference.rules.needed_chunks` of a full group is
      every chunk from 0 to the hit's end);
    * a window chunk (any group with :func:`~reference.rules.window_in_chunks`) is
      reachable iff some boundary it serves is *whole*: every chunk a hit ending at
      that boundary needs is on disk and its full-attention chunks are reachable.
      Hits end at boundaries under sparse retention (vLLM's default), where windows
      are kept only before ``round_down(prompt - 1, A)`` and junctions
      (:func:`~reference.rules.reachable_block_mask`); a window chunk that serves
      no boundary (dense retention's final tail) counts as stranded.

    ``stranded`` = the keys on disk that are not reachable.  A full-attention chunk
    whose later boundary has no window on disk yet is *not* stranded: a later store
    completes that boundary without rewriting it.

The rule (:meth:`Disk.evictable`, :meth:`Disk.evict_for`)
    A file may be evicted when its removal strands no full-attention chunk that
    stays (no full-attention key outside it has its parent in it: a *leaf* of the
    prefix structure); window chunks go with the boundary they serve: the files of
    window chunks its removal strands go with it (its *unit*), under the same
    condition.  Among the evictable units the least recently used goes: a unit's use is
    its most recently used file's (:func:`unit_last_use`; after the window files of
    boundaries one prefix went on past, :func:`passed_windows_unit`).  The rule
    also never admits a key that would be stranded on arrival (its parent is not on
    disk, or it serves no boundary that is whole or one store from whole): it is dropped
    from the store plan.  A window key admitted while its boundary was one store away
    leaves once no store is pending and the boundary is not whole (the store was refused,
    or is a later turn's: :meth:`reference.disk_economics.BudgetedIndex.idle`), so an idle
    disk strands nothing (a tier drops them as each request that stored them finishes:
    :meth:`vllm_adapter.disk.ledger.RootLedger.drop_finished`).

A store that does not fit (:class:`Overflow`)
    Refused whole (the rule's default: nothing is written), or, as an option, the longest
    prefix-closed head of it that fits once the rule has evicted what it may
    (:func:`prefix_closed_head`, :meth:`Disk.freeable`).  ``docs/semantics.md`` section 10
    gives what each option costs on a small disk (``scripts/disk_ablation.py``).

Plain LRU (:attr:`EvictionRule.LRU`)
    Evicts the least recently used file, whatever depends on it, and admits every
    key: the baseline (vLLM's per-file tier with an external evictor).  Its
    stranded bytes are :meth:`Disk.stranded_bytes`.

Not modelled: Mamba-align groups (their states are stored only at hand-offs) and
chunkings without an alignment span (full groups of different spans); both are a
``ValueError``.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from reference.keys import split_key
from reference.prefix_structure import PrefixStructure

__all__ = [
    "Bookkeeping",
    "Disk",
    "EvictionRule",
    "Layout",
    "Overflow",
    "PrefixStructure",
    "eviction_unit",
    "evictable",
    "passed_windows_unit",
    "prefix_closed_head",
    "stranded",
    "unit_last_use",
]


class EvictionRule(Enum):
    """Which file a full disk gives up."""

    REACHABLE = "reachable"
    """The rule: the least recently used file whose removal strands nothing that stays."""
    LRU = "lru"
    """Plain per-file LRU: the least recently used file (the baseline)."""


class Overflow(Enum):
    """What a store that does not fit after eviction gets (:func:`prefix_closed_head`)."""

    REFUSE = "refuse"
    """Refused whole: nothing is written (the Planner offers it again next step)."""
    HEAD = "head"
    """The longest prefix-closed head of it that fits is admitted; the rest is left out."""


class Layout(Enum):
    """What one file holds (the eviction unit)."""

    PACKED = "packed"
    """The keys of one store job: its full-attention keys, or its window keys
    (:func:`reference.packed.store_job_files`; all of them in one file with
    ``BudgetedIndex(windows_apart=False)``, an ablation)."""
    PER_CHUNK = "per_chunk"
    """One key."""


# ---------------------------------------------------------------------------
# The disk: files, reachability, the rule
# ---------------------------------------------------------------------------


@dataclass
class _File:
    keys: tuple[bytes, ...]
    nbytes: int
    last_use: int
    ready: bool = False
    pins: int = 0


Bookkeeping = tuple[int, dict[int, int], list[tuple[int, int, int]], list[int], list[int]]
"""A :class:`Disk`'s own bookkeeping beside its files (:meth:`Disk.bookkeeping`): the next
file id, each file's dependents, the leaf heap, the recency order and the window-only
files' order."""


class Disk:
    """Files on disk over a :class:`PrefixStructure`; the rule and the baseline."""

    passed_windows_first = True
    """The rule's first step (:func:`passed_windows_unit`); off only in ablations."""
    unit_recency = True
    """Among leaves, units go in the order of their most recently used file (a unit's
    recency is its newest file's, not its leaf's); False: the leaf's (an ablation)."""

    def __init__(self, structure: PrefixStructure) -> None:
        self.structure = structure
        self.files: dict[int, _File] = {}
        self.file_of: dict[bytes, int] = {}
        """Key -> the file holding it (pending stores included)."""
        self.bytes = 0
        self.peak_bytes = 0
        """The most bytes ever on disk (pending stores included)."""
        self.clock = 0
        self._next_id = 0
        self._dependents: dict[int, int] = {}
        """File -> full-attention keys in other files whose parent it holds."""
        self._leaves: list[tuple[int, int, int]] = []
        """Heap of (order, file, last use) for files that were leaves then (checked when
        popped): the order is the file's last use, or its unit's newest file's once seen."""
        self._recency: OrderedDict[int, None] = OrderedDict()
        """Every file, least recently used first."""
        self._windows_only: OrderedDict[int, None] = OrderedDict()
        """Files that hold window keys only (window-only store jobs, per-chunk window files,
        windows apart), least recently used first: the candidates of
        :func:`passed_windows_unit`, which scans only these."""

    # -- state --------------------------------------------------------------

    @staticmethod
    def file_record(keys: tuple[bytes, ...], nbytes: int, last_use: int, ready: bool,
                    pins: int) -> _File:
        """One entry of :attr:`files`, as :meth:`add` makes it (a restored disk's)."""
        return _File(keys, nbytes, last_use, ready, pins)

    def bookkeeping(self) -> Bookkeeping:
        """This disk's state beyond :attr:`files`, :attr:`file_of`, :attr:`bytes`,
        :attr:`peak_bytes` and :attr:`clock`, as plain values (a snapshot of a disk keeps
        it: ``vllm_adapter.disk.ledger_snapshot``)."""
        return (self._next_id, dict(self._dependents), list(self._leaves),
                list(self._recency), list(self._windows_only))

    def restore_bookkeeping(self, state: Bookkeeping) -> None:
        """:meth:`bookkeeping`'s inverse (the files restored first)."""
        next_id, dependents, leaves, recency, windows_only = state
        self._next_id = next_id
        self._dependents = dependents
        self._leaves = leaves
        self._recency = OrderedDict.fromkeys(recency)
        self._windows_only = OrderedDict.fromkeys(windows_only)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def add(self, keys: Sequence[bytes], nbytes: int, ready: bool = False) -> int:
        """A new file holding ``keys`` (none already on disk)."""
        fid = self._next_id
        self._next_id += 1
        self.files[fid] = _File(tuple(keys), nbytes, self.tick(), ready)
        self._recency[fid] = None
        s = self.structure
        full = [k for k in keys if s.is_full(k)]
        if keys and not full:
            self._windows_only[fid] = None
        self._dependents[fid] = 0
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        for key in keys:
            self.file_of[key] = fid
        for key in full:
            parent = s.parent.get(key)
            if parent is not None and self.file_of.get(parent, fid) != fid:
                self._dependents[self.file_of[parent]] += 1
            for child in s.children.get(key, ()):
                if self.file_of.get(child, fid) != fid:
                    self._dependents[fid] += 1
        self._push_if_leaf(fid)
        return fid

    def remove(self, fid: int) -> None:
        f = self.files.pop(fid)
        self.bytes -= f.nbytes
        s = self.structure
        for key in f.keys:
            if not s.is_full(key):
                continue
            parent = s.parent.get(key)
            if parent is not None and parent in self.file_of and self.file_of[parent] != fid:
                owner = self.file_of[parent]
                self._dependents[owner] -= 1
                self._push_if_leaf(owner)
        for key in f.keys:
            del self.file_of[key]
        del self._dependents[fid]
        del self._recency[fid]
        self._windows_only.pop(fid, None)

    def touch(self, fid: int) -> None:
        self.files[fid].last_use = self.tick()
        self._recency.move_to_end(fid)
        if fid in self._windows_only:
            self._windows_only.move_to_end(fid)
        self._push_if_leaf(fid)

    def _push_if_leaf(self, fid: int) -> None:
        if self._dependents[fid] == 0:
            use = self.files[fid].last_use
            heapq.heappush(self._leaves, (use, fid, use))

    # -- reachability ---------------------------------------------------------

    def _full_reachable(self, key: bytes, memo: dict[bytes, bool]) -> bool:
        """Every earlier full-attention chunk of the key's group in its prefix is on disk
        (and the key's prefix is recorded)."""
        parent = self.structure.parent
        chain: list[bytes] = []
        ok = True
        node: bytes | None = key
        while node is not None:
            if node in memo:
                ok = memo[node]
                break
            chain.append(node)
            node = parent.get(node)
        for n in reversed(chain):
            ok = ok and n in self.file_of and n in parent
            memo[n] = ok
        return memo[key]

    def stranded(self, *, pending_windows: bool = False) -> frozenset[bytes]:
        """Keys on disk that no lookup can load (see the module docstring): a
        full-attention key with an earlier chunk of its group missing from its prefix;
        a window key no boundary of which is whole (every key a hit ending there needs
        on disk, its full-attention keys reachable).  ``pending_windows``: leave out the
        window keys :meth:`arrives_stranded` admits as pending (a boundary they serve
        can still be completed)."""
        s = self.structure
        if pending_windows:
            return frozenset(k for k in self.stranded() if s.is_full(k) or not any(
                self._completable(b) for b in s.serves.get(k, ())))
        return self.stranded_among(self.file_of)

    def stranded_among(self, keys: Iterable[bytes]) -> frozenset[bytes]:
        """Of ``keys``, those on disk that no lookup can load (:meth:`stranded`'s test, each
        key judged alone: the work grows with ``keys`` and their prefixes, not the disk)."""
        s = self.structure
        memo: dict[bytes, bool] = {}
        whole: dict[bytes, bool] = {}

        def is_whole(boundary: bytes) -> bool:
            if boundary not in whole:
                whole[boundary] = all(
                    self._full_reachable(k, memo) for k in s.full_at[boundary]
                ) and all(k in self.file_of for k in s.windows_at[boundary])
            return whole[boundary]

        out = set()
        for key in keys:
            if key not in self.file_of:
                continue
            if s.is_full(key):
                if not self._full_reachable(key, memo):
                    out.add(key)
            elif not any(is_whole(b) for b in s.serves.get(key, ())):
                out.add(key)
        return frozenset(out)

    def _completable(self, boundary: bytes) -> bool:
        """Each full-attention key of ``boundary`` is on disk, or absent with its parent on
        disk or none (one store completes it)."""
        s = self.structure
        return all(
            k in self.file_of or (k in s.parent and (
                s.parent[k] is None or s.parent[k] in self.file_of))
            for k in s.full_at[boundary])

    def stranded_bytes(self, key_bytes: Mapping[int, int]) -> int:
        return sum(key_bytes[split_key(k)[1]] for k in self.stranded())

    # -- the rule -------------------------------------------------------------

    def _whole_without(self, boundary: bytes, gone: set[bytes]) -> bool:
        """``boundary`` is whole with ``gone`` removed (its full chain intact by the
        rule's invariant: nothing on disk is stranded)."""
        s = self.structure
        return all(k in self.file_of and k not in gone for k in s.full_at[boundary]) and all(
            k in self.file_of and k not in gone for k in s.windows_at[boundary]
        )

    def unit(self, fid: int) -> tuple[int, ...] | None:
        return eviction_unit(self, fid)

    def lru_order(self) -> tuple[int, ...]:
        """Every file, least recently used first."""
        return tuple(self._recency)

    def _next_unit(self) -> tuple[int, ...] | None:
        """The rule's next unit: first the least recently used unit of window files whose
        boundaries one prefix went on past (a hit ends at such a boundary only when what
        follows it is lost; a boundary where prefixes branched, as a shared system prompt,
        is where new sessions' hits end: it stays), then :meth:`evictable`'s first unit,
        from the heap of leaves."""
        passed = passed_windows_unit(self) if self.passed_windows_first else None
        if passed is not None:
            return passed
        skipped: list[tuple[int, int, int]] = []
        found = None
        while self._leaves:
            entry = heapq.heappop(self._leaves)
            order, fid, use = entry
            f = self.files.get(fid)
            if f is None or f.last_use != use or self._dependents[fid]:
                continue  # stale: used since, or no longer a leaf (pushed again when it is)
            unit = self.unit(fid)
            if unit is None:
                skipped.append(entry)
                continue
            newest = unit_last_use(self, unit) if self.unit_recency else use
            if newest > order:  # the unit holds a file used since its leaf: it waits for that
                heapq.heappush(self._leaves, (newest, fid, use))
                continue
            found = unit
            skipped.append(entry)
            break
        for entry in skipped:
            heapq.heappush(self._leaves, entry)
        return found

    def _lru_file(self) -> tuple[int, ...] | None:
        """Plain LRU: the least recently used file not being written or read."""
        for fid in self._recency:
            f = self.files[fid]
            if f.ready and not f.pins:
                return (fid,)
        return None

    def next_victim(self, rule: EvictionRule) -> tuple[int, ...] | None:
        """The unit ``rule`` evicts next (its files), or None when nothing may go; nothing
        changes (a ledger that shares this model across engines removes the unit itself,
        with :meth:`remove`, once its removal is recorded)."""
        if rule is EvictionRule.LRU:
            return self._lru_file()
        unit = self._next_unit()
        if unit is not None:
            self._push_if_leaf(unit[0])  # _next_unit popped it from the heap of leaves
        return unit

    def restore(self, fid: int, file: _File) -> None:
        """Put back a file that :meth:`remove` took (``file``: what ``files[fid]`` was),
        with its id and use time."""
        self._restore(fid, file)

    def resize(self, fid: int, nbytes: int) -> None:
        """File ``fid`` holds ``nbytes`` (its size on disk was found to differ)."""
        f = self.files[fid]
        self.bytes += nbytes - f.nbytes
        f.nbytes = nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def keep_keys(self, fid: int, keys: Sequence[bytes]) -> None:
        """File ``fid`` now holds only ``keys`` (a subset of its keys: the others became
        unservable), with its size, use time and state unchanged."""
        f = self.files[fid]
        if set(keys) - set(f.keys):
            raise ValueError("keep_keys keeps a subset of the file's keys")
        self.remove(fid)
        self._restore(fid, _File(tuple(keys), f.nbytes, f.last_use, f.ready, f.pins))

    def evict_for(
        self, needed_bytes: int, budget: int, rule: EvictionRule
    ) -> list[tuple[int, tuple[bytes, ...]]] | None:
        """Evict by ``rule`` until ``needed_bytes`` more fit in ``budget``: the evicted
        files (id, keys), or None, with nothing evicted, when nothing evictable makes
        them fit."""
        removed: list[tuple[int, _File]] = []
        while self.bytes + needed_bytes > budget:
            unit = self._next_unit() if rule is EvictionRule.REACHABLE else self._lru_file()
            if unit is None:
                self._undo(removed)  # a refused store changes nothing
                return None
            for fid in unit:
                removed.append((fid, self.files[fid]))
                self.remove(fid)
        return [(fid, f.keys) for fid, f in removed]

    def freeable(self, wanted: int, rule: EvictionRule) -> int:
        """Bytes ``rule`` could evict now, counted up to ``wanted`` (it stops once that
        many are freed); nothing changes.  Files being written or read, and what they
        depend on, are kept, as :meth:`evict_for` keeps them."""
        removed: list[tuple[int, _File]] = []
        freed = 0
        while freed < wanted:
            unit = self._next_unit() if rule is EvictionRule.REACHABLE else self._lru_file()
            if unit is None:
                break
            for fid in unit:
                removed.append((fid, self.files[fid]))
                freed += self.files[fid].nbytes
                self.remove(fid)
        self._undo(removed)
        return freed

    def _undo(self, removed: list[tuple[int, _File]]) -> None:
        for fid, f in reversed(removed):
            self._restore(fid, f)

    def _restore(self, fid: int, f: _File) -> None:
        """Put an evicted file back with its id and use time (undoing :meth:`evict_for`)."""
        new = self.add(f.keys, f.nbytes, f.ready)
        self.files[fid] = self.files.pop(new)
        self.files[fid].last_use = f.last_use
        if new in self._windows_only:
            del self._windows_only[new]
            self._windows_only[fid] = None
            for later in [k for k in self._windows_only if self.files[k].last_use > f.last_use]:
                self._windows_only.move_to_end(later)
        self._dependents[fid] = self._dependents.pop(new)
        del self._recency[new]
        self._recency[fid] = None
        for later in [k for k in self._recency if self.files[k].last_use > f.last_use]:
            self._recency.move_to_end(later)
        for key in f.keys:
            self.file_of[key] = fid
        self._push_if_leaf(fid)

    def arrives_stranded(self, keys: Sequence[bytes], *, pending_windows: bool = False,
                         window_siblings: bool = False) -> set[bytes]:
        """Keys of a new file that would be stranded on arrival: a full-attention key
        whose parent is neither on disk nor in the file, a window key with no boundary
        whole once the file is on disk (in any order).

        ``pending_windows``: a window key is also admitted when a boundary it serves can
        still be completed by later stores (each of its full-attention keys present, or
        absent with its parent present or none): chunked prefill stores a boundary's
        window chunks in steps before its full-attention chunk (vLLM does; the
        reference's Planner stores a boundary's keys together).  Such a key counts as
        stranded (:meth:`stranded`) until its boundary is whole.

        ``window_siblings`` (with ``pending_windows``): such a boundary is judged by every
        key it needs, window chunks included: each of its window keys must be on disk
        (or pending: reserved by a store in flight), in the file, or still to come, one
        ending after every key of the file whose end is known
        (:attr:`PrefixStructure.end_token`; stores of a request come in prefix order, so
        a sibling ending no later than the file's last key will never arrive: vLLM's
        CPU tier cascades only the chunks it newly stored, not the ones it still held).
        A sibling whose end is unknown may still come."""
        s = self.structure
        incoming = set(keys)
        bad: set[bytes] = set()
        changed = True
        while changed:  # to a fixpoint: the keys may come in any order (vLLM 0.33 uses a set)
            changed = False
            for key in keys:
                if key in bad or not s.is_full(key):
                    continue
                parent = s.parent.get(key, b"")
                if parent == b"" or (parent is not None and (parent in bad or (
                        parent not in self.file_of and parent not in incoming))):
                    bad.add(key)
                    changed = True

        def have(k: bytes) -> bool:
            return (k in incoming and k not in bad) or k in self.file_of

        last = max((s.end_token[k] for k in keys if k in s.end_token), default=None)

        def may_come(k: bytes) -> bool:
            end = s.end_token.get(k)
            return end is None or last is None or end > last

        def completable(b: bytes) -> bool:
            def one_store_away(k: bytes) -> bool:
                parent = s.parent.get(k, b"")
                return parent is None or (parent != b"" and have(parent))
            if window_siblings and not all(have(k) or may_come(k) for k in s.windows_at[b]):
                return False
            return all(have(k) or one_store_away(k) for k in s.full_at[b])

        changed = True
        while changed:  # with window_siblings, to a fixpoint: a dropped sibling drops its boundary
            changed = False
            for key in keys:
                if key in bad or s.is_full(key):
                    continue
                if not any(
                    all(have(k) for k in s.full_at[b]) and all(have(k) for k in s.windows_at[b])
                    or (pending_windows and completable(b))
                    for b in s.serves.get(key, ())
                ):
                    bad.add(key)
                    changed = window_siblings
        return bad


def _passed_by_one_prefix(disk: Disk, keys: Sequence[bytes]) -> bool:
    """Every boundary the window ``keys`` serve was passed by one prefix only: its
    full-attention keys have, on disk, exactly one child between them (the prefix went on
    past it, and no other prefix branched off there)."""
    s = disk.structure
    boundaries = {b for k in keys for b in s.serves.get(k, ())}
    return bool(boundaries) and all(
        sum(c in disk.file_of for k in s.full_at.get(b, ()) for c in s.children.get(k, ()))
        == 1 for b in boundaries)


def passed_windows_unit(disk: Disk) -> tuple[int, ...] | None:
    """The unit the rule takes before any other (:meth:`Disk._next_unit`): the least
    recently used unit of window files only whose boundaries were each passed by one
    prefix; None when there is none.  A hit ends at such a boundary only when what follows
    it is lost; a boundary where prefixes branched (a shared system prompt, where new
    sessions' hits end) keeps its windows."""
    s = disk.structure
    for fid in disk._windows_only:
        f = disk.files[fid]
        if not f.ready or f.pins or not _passed_by_one_prefix(disk, f.keys):
            continue
        unit = disk.unit(fid)
        if unit is not None and not any(
                s.is_full(k) for other in unit for k in disk.files[other].keys):
            return unit
    return None


def eviction_unit(disk: Disk, fid: int) -> tuple[int, ...] | None:
    """The eviction rule: the files that go when file ``fid`` goes, or None when it may
    not go.  It may go when its removal strands no full-attention chunk that stays (no
    full-attention key outside the unit has its parent in it: a leaf of the prefix
    structure); window chunks go with the boundary they serve (the files of the window
    keys its removal strands join the unit, under the same condition).  Files being
    written or read never go."""
    s = disk.structure
    files = [fid]
    gone: set[bytes] = set()
    whole: dict[bytes, bool] = {}
    """Boundary -> whole without ``gone`` (valid until ``gone`` grows)."""

    def whole_without(boundary: bytes) -> bool:
        if boundary not in whole:
            whole[boundary] = disk._whole_without(boundary, gone)
        return whole[boundary]

    todo = [fid]
    while todo:
        f = disk.files[todo.pop()]
        if not f.ready or f.pins:
            return None
        gone.update(f.keys)
        whole.clear()
        broken: set[bytes] = set()
        for key in f.keys:
            if s.is_full(key):
                broken.add(split_key(key)[0])  # a boundary is named by its end's hash
            else:
                broken.update(s.serves.get(key, ()))
        for key in f.keys:
            if not s.is_full(key):
                continue
            if any(c in disk.file_of and c not in gone and disk.file_of[c] not in files
                   for c in s.children.get(key, ())):
                return None  # a full-attention chunk that stays would lose its parent
        for boundary in broken:
            if boundary not in s.windows_at:
                continue
            for w in s.windows_at[boundary]:
                owner = disk.file_of.get(w)
                if owner is None or owner in files:
                    continue
                if not any(whole_without(b) for b in s.serves[w]):
                    files.append(owner)
                    todo.append(owner)
    return tuple(files)


def prefix_closed_head(
    disk: Disk, keys: Sequence[bytes], fits: Callable[[tuple[bytes, ...]], bool],
) -> tuple[bytes, ...]:
    """What a store that does not fit admits under :attr:`Overflow.HEAD`: the longest
    prefix-closed head of ``keys`` (a store's keys, none on disk) that ``fits``.

    The head of depth ``i`` holds the store's full-attention keys of its first ``i``
    boundaries (a key's depth: how many of its ancestors the store carries; a key whose
    parent is neither on disk nor in the store is in no head), and the window keys that
    make a boundary whole with them and the disk (a window key pending for a later
    boundary is left out: the rest of the store does not come).  The head returned is the
    deepest that ``fits``, in the store's order, or ``()`` when none with a key does;
    ``fits`` need not be monotone (heads are tried deepest first): a deeper head can free
    more, as when its later boundaries are whole on its own window keys, so that a window
    file on disk serves no boundary that stays and may go, while a shorter head's last
    boundary needs that file."""
    s = disk.structure
    incoming = set(keys)
    depth: dict[bytes, int] = {}

    def depth_of(key: bytes) -> int:
        """The key's depth in the store, -1 when its prefix is broken."""
        chain: list[bytes] = []
        node: bytes | None = key
        while True:
            if node is None:  # the chain's first key is chunk 0
                base = 0
                break
            if node in depth:
                base = depth[node] + 1 if depth[node] >= 0 else -1
                break
            if node not in incoming:  # the parent of the chain's first key
                base = 0 if node in disk.file_of else -1
                break
            chain.append(node)
            parent = s.parent.get(node, b"")
            if parent == b"":  # no recorded prefix
                base = -1
                break
            node = parent
        for n in reversed(chain):
            depth[n] = base
            if base >= 0:
                base += 1
        return depth[key]

    full = [k for k in keys if s.is_full(k)]
    for k in full:
        depth_of(k)
    levels = 1 + max((depth[k] for k in full), default=-1)
    windows = [k for k in keys if not s.is_full(k)]

    def head(i: int) -> tuple[bytes, ...]:
        chosen = {k for k in full if 0 <= depth[k] < i}

        def whole(b: bytes) -> bool:
            return all(k in chosen or k in disk.file_of for k in s.full_at[b]) and all(
                k in incoming or k in disk.file_of for k in s.windows_at[b])

        chosen.update(w for w in windows if any(whole(b) for b in s.serves.get(w, ())))
        return tuple(k for k in keys if k in chosen)

    tried: set[tuple[bytes, ...]] = set()
    for i in range(levels, 0, -1):
        candidate = head(i)
        if candidate and candidate not in tried:
            tried.add(candidate)
            if fits(candidate):
                return candidate
    return ()


def unit_last_use(disk: Disk, unit: Sequence[int]) -> int:
    """When a unit was last used: its most recently used file's use time.  The rule takes
    leaves' units in this order (:meth:`Disk._next_unit`), not by the leaf's own use: a
    unit can hold a file read since its leaf was (a window file a request wrote at a
    shared prefix's junction holds that junction's windows beside the windows of the
    boundary its prompt ends at; every new session's hit reads it)."""
    return max(disk.files[fid].last_use for fid in unit)


def evictable(disk: Disk) -> list[tuple[int, ...]]:
    """Every unit the rule may evict now (:func:`eviction_unit` of each file), least
    recently used unit first (:func:`unit_last_use`; ties: the least recently used file's
    first); after :func:`passed_windows_unit`, the rule evicts the first."""
    units = (eviction_unit(disk, fid) for fid in disk.lru_order())
    found = [u for u in units if u is not None]
    return sorted(found, key=lambda u: unit_last_use(disk, u)) if disk.unit_recency else found


def stranded(disk: Disk) -> frozenset[bytes]:
    """:meth:`Disk.stranded`: the keys on disk no lookup can load."""
    return disk.stranded()
