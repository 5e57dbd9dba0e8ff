"""Disk eviction that never strands a chunk, a plain per-file LRU to compare with, and
the hit rate a disk of a given size gives.

The disk
    Files, each a set of chunk keys (:mod:`reference.keys`) with a size in bytes and
    a last-use time.  The *eviction unit is a file*: with the ``packed`` layout one
    file per store (one :class:`~reference.plan.Planner` store job: the keys one
    GPU->CPU store of one request carries in one step, every group), with the
    ``per_chunk`` layout one file per key (vLLM's file tier).

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
    condition.  Among the evictable files the least recently used goes.  The rule
    also never admits a key that would be stranded on arrival (its parent is not on
    disk, or it serves no boundary that is whole or one store from whole): it is dropped
    from the store plan.

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
import pickle
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from reference.economics import MILLION, _Engine, hashed
from reference.keys import split_key
from reference.knobs import Chunking
from reference.plan import Planner, Policy
from reference.prefix_structure import PrefixStructure
from reference.rules import WindowRule
from reference.store import LookupResult, StorePlan
from reference.workload import GpuCache, Workload, WorkloadRequest, requests

__all__ = [
    "BudgetedIndex",
    "Disk",
    "DiskEconomics",
    "EvictionRule",
    "Layout",
    "PrefixStructure",
    "disk_economics",
    "eviction_unit",
    "evictable",
    "miss_ratio_curve",
    "scaled",
    "stranded",
]


class EvictionRule(Enum):
    """Which file a full disk gives up."""

    REACHABLE = "reachable"
    """The rule: the least recently used file whose removal strands nothing that stays."""
    LRU = "lru"
    """Plain per-file LRU: the least recently used file (the baseline)."""


class Layout(Enum):
    """What one file holds (the eviction unit)."""

    PACKED = "packed"
    """Every key of one store job."""
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


class Disk:
    """Files on disk over a :class:`PrefixStructure`; the rule and the baseline."""

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
        self._leaves: list[tuple[int, int]] = []
        """Heap of (last use, file) for files that were leaves then (checked when popped)."""
        self._recency: OrderedDict[int, None] = OrderedDict()
        """Every file, least recently used first."""

    # -- state --------------------------------------------------------------

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def add(self, keys: Sequence[bytes], nbytes: int, ready: bool = False) -> int:
        """A new file holding ``keys`` (none already on disk)."""
        fid = self._next_id
        self._next_id += 1
        self.files[fid] = _File(tuple(keys), nbytes, self.tick(), ready)
        self._recency[fid] = None
        self._dependents[fid] = 0
        self.bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        s = self.structure
        for key in keys:
            self.file_of[key] = fid
        for key in keys:
            if not s.is_full(key):
                continue
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

    def touch(self, fid: int) -> None:
        self.files[fid].last_use = self.tick()
        self._recency.move_to_end(fid)
        self._push_if_leaf(fid)

    def _push_if_leaf(self, fid: int) -> None:
        if self._dependents[fid] == 0:
            heapq.heappush(self._leaves, (self.files[fid].last_use, fid))

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
        memo: dict[bytes, bool] = {}
        whole: dict[bytes, bool] = {}

        def is_whole(boundary: bytes) -> bool:
            if boundary not in whole:
                whole[boundary] = all(
                    self._full_reachable(k, memo) for k in s.full_at[boundary]
                ) and all(k in self.file_of for k in s.windows_at[boundary])
            return whole[boundary]

        out = set()
        for key in self.file_of:
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
        """:meth:`evictable`'s first unit, from the heap of leaves."""
        skipped: list[tuple[int, int]] = []
        found = None
        while self._leaves:
            entry = heapq.heappop(self._leaves)
            use, fid = entry
            f = self.files.get(fid)
            if f is None or f.last_use != use or self._dependents[fid]:
                continue  # stale: used since, or no longer a leaf (pushed again when it is)
            found = self.unit(fid)
            if found is not None:
                break
            skipped.append(entry)
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
                for fid, f in reversed(removed):  # a refused store changes nothing
                    self._restore(fid, f)
                return None
            for fid in unit:
                removed.append((fid, self.files[fid]))
                self.remove(fid)
        return [(fid, f.keys) for fid, f in removed]

    def _restore(self, fid: int, f: _File) -> None:
        """Put an evicted file back with its id and use time (undoing :meth:`evict_for`)."""
        new = self.add(f.keys, f.nbytes, f.ready)
        self.files[fid] = self.files.pop(new)
        self.files[fid].last_use = f.last_use
        self._dependents[fid] = self._dependents.pop(new)
        del self._recency[new]
        self._recency[fid] = None
        for later in [k for k in self._recency if self.files[k].last_use > f.last_use]:
            self._recency.move_to_end(later)
        for key in f.keys:
            self.file_of[key] = fid
        self._push_if_leaf(fid)

    def arrives_stranded(self, keys: Sequence[bytes], *, pending_windows: bool = False) -> set[bytes]:
        """Keys of a new file that would be stranded on arrival: a full-attention key
        whose parent is neither on disk nor in the file, a window key with no boundary
        whole once the file is on disk (in any order).

        ``pending_windows``: a window key is also admitted when a boundary it serves can
        still be completed by later stores (each of its full-attention keys present, or
        absent with its parent present or none): chunked prefill stores a boundary's
        window chunks in steps before its full-attention chunk (vLLM does; the
        reference's Planner stores a boundary's keys together).  Such a key counts as
        stranded (:meth:`stranded`) until its boundary is whole."""
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

        def completable(b: bytes) -> bool:
            def one_store_away(k: bytes) -> bool:
                parent = s.parent.get(k, b"")
                return parent is None or (parent != b"" and have(parent))
            return all(have(k) or one_store_away(k) for k in s.full_at[b])

        for key in keys:
            if s.is_full(key):
                continue
            if not any(
                all(have(k) for k in s.full_at[b]) and all(have(k) for k in s.windows_at[b])
                or (pending_windows and completable(b))
                for b in s.serves.get(key, ())
            ):
                bad.add(key)
        return bad


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
    todo = [fid]
    while todo:
        f = disk.files[todo.pop()]
        if not f.ready or f.pins:
            return None
        gone.update(f.keys)
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
                if not any(disk._whole_without(b, gone) for b in s.serves[w]):
                    files.append(owner)
                    todo.append(owner)
    return tuple(files)


def evictable(disk: Disk) -> list[tuple[int, ...]]:
    """Every unit the rule may evict now (:func:`eviction_unit` of each file), least
    recently used file first; the rule evicts the first."""
    units = (eviction_unit(disk, fid) for fid in disk.lru_order())
    return [u for u in units if u is not None]


def stranded(disk: Disk) -> frozenset[bytes]:
    """:meth:`Disk.stranded`: the keys on disk no lookup can load."""
    return disk.stranded()


# ---------------------------------------------------------------------------
# The index the Planner talks to
# ---------------------------------------------------------------------------


class BudgetedIndex:
    """A disk tier's index within ``budget_bytes`` (``reference.plan.ChunkIndex``).

    ``key_bytes``: bytes per key, per group index (or one size).  A file's size is the
    sum of its keys'.  A store reserves its bytes when prepared (pending files count and
    are never evicted), evicting by ``rule`` first; when it still does not fit it is
    refused (None: the Planner retries next step), changing nothing.  A lookup hit and
    a load refresh their files' use time; files being loaded are not evicted.
    Call :meth:`observe` with each request's block hashes before its lookup.
    """

    def __init__(
        self,
        chunking: Chunking,
        key_bytes: Mapping[int, int] | int,
        budget_bytes: int,
        rule: EvictionRule = EvictionRule.REACHABLE,
        layout: Layout = Layout.PACKED,
        window_rule: WindowRule = WindowRule.TOKENS_BEFORE_END,
    ) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
        self.key_bytes = (
            {gc.group.index: key_bytes for gc in chunking.groups}
            if isinstance(key_bytes, int) else dict(key_bytes)
        )
        missing = [gc.group.index for gc in chunking.groups if gc.group.index not in self.key_bytes]
        if missing:
            raise ValueError(f"key_bytes has no size for group(s) {missing}; give one per group index")
        self.budget = budget_bytes
        self.rule = rule
        self.layout = layout
        self.structure = PrefixStructure(chunking, window_rule)
        self.disk = Disk(self.structure)
        self.files_written = 0
        self.files_evicted = 0
        self.files_read = 0
        self.stores_refused = 0
        self.keys_dropped = 0
        """Keys left out of a store because they would arrive stranded (the rule only)."""

    def observe(self, block_hashes: Sequence[bytes]) -> None:
        self.structure.observe(block_hashes)

    def _size(self, keys: Iterable[bytes]) -> int:
        return sum(self.key_bytes[split_key(k)[1]] for k in keys)

    # -- ChunkIndex -----------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        fid = self.disk.file_of.get(key)
        if fid is None:
            return LookupResult.MISS
        f = self.disk.files[fid]
        if not f.ready:
            return LookupResult.HIT_PENDING
        self.disk.touch(fid)
        return LookupResult.HIT

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        """Room for the offered keys not on disk, evicting by the rule first; None (and
        nothing changed) when they do not fit.  Under the rule, keys that would be
        stranded on arrival are left out of the plan; a window key whose boundary is one
        store away is admitted (:meth:`Disk.arrives_stranded` ``pending_windows``: the
        Planner's chunked prefill stores a boundary's window chunks first)."""
        new = list(dict.fromkeys(k for k in keys if k not in self.disk.file_of))
        unknown = [k for k in new if self.structure.is_full(k) and k not in self.structure.parent]
        if unknown:
            raise ValueError(
                f"prepare_store: key {unknown[0].hex()} has no recorded prefix; call "
                "observe(block_hashes) with the request's block hashes first"
            )
        if self.rule is EvictionRule.REACHABLE and new:
            bad = self.disk.arrives_stranded(new, pending_windows=True)
            self.keys_dropped += len(bad)
            new = [k for k in new if k not in bad]
        if not new:
            return StorePlan((), (), ())
        files = [new] if self.layout is Layout.PACKED else [[k] for k in new]
        added = [self.disk.add(f, self._size(f)) for f in files]  # pending: protected
        evicted = self.disk.evict_for(0, self.budget, self.rule)
        if evicted is None:
            for fid in added:
                self.disk.remove(fid)
            self.stores_refused += 1
            return None
        self.files_evicted += len(evicted)
        victims = tuple(k for _, ks in evicted for k in ks)
        return StorePlan(tuple(new), tuple(range(len(new))), victims)

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        fids = dict.fromkeys(self.disk.file_of[k] for k in keys if k in self.disk.file_of)
        for fid in fids:
            f = self.disk.files[fid]
            if f.ready:
                continue
            if success:
                f.ready = True
                self.files_written += 1
                self.disk.touch(fid)
            else:
                self.disk.remove(fid)
        if not success and self.rule is EvictionRule.REACHABLE:
            self._drop_stranded()

    def _drop_stranded(self) -> None:
        """After a failed store, the files it strands go too (a failed store leaves no
        trace; files being read stay until their load completes)."""
        while True:
            stranded = self.disk.stranded()
            fids = {self.disk.file_of[k] for k in stranded}
            fids = {fid for fid in fids if not self.disk.files[fid].pins}
            if not fids:
                return
            for fid in fids:
                self.disk.remove(fid)
                self.files_evicted += 1

    def prepare_load(self, keys: Sequence[bytes]) -> object:
        fids = dict.fromkeys(self.disk.file_of[k] for k in keys)
        for fid in fids:
            f = self.disk.files[fid]
            if not f.ready:
                raise ValueError(f"prepare_load: a key of file {fid} is still being stored")
            f.pins += 1
            self.disk.touch(fid)
        self.files_read += len(fids)
        return None

    def complete_load(self, keys: Sequence[bytes]) -> None:
        for fid in dict.fromkeys(self.disk.file_of[k] for k in keys):
            self.disk.files[fid].pins -= 1

    def reset(self) -> None:
        self.disk = Disk(self.structure)

    # -- what an operator reads ---------------------------------------------------

    def stranded_bytes(self) -> int:
        return self.disk.stranded_bytes(self.key_bytes)


# ---------------------------------------------------------------------------
# What hit rate from a disk of this size
# ---------------------------------------------------------------------------


def scaled(workload: Workload, prompt_tokens: int = MILLION) -> Workload:
    """``workload`` with a cold GPU cache and as many sessions as give about
    ``prompt_tokens`` prompt tokens: sessions over time, turn by turn round-robin, so a
    session's next turn comes back after every other session's (its reuse distance
    grows with the sessions), and every reused token must come from the disk."""
    per_session = sum(len(r.prompt) for r in requests(workload)) / workload.sessions
    sessions = max(1, round(prompt_tokens / per_session))
    return replace(
        workload, name=f"{workload.name} ({sessions} sessions, cold GPU)", sessions=sessions,
        gpu_cache=GpuCache.COLD,
    )


@dataclass(frozen=True)
class DiskEconomics:
    """One workload served over a disk of ``budget_bytes`` (totals; per million prompt
    tokens with :meth:`per_million`)."""

    workload: str
    rule: EvictionRule
    layout: Layout
    budget_bytes: int | None
    """None: unbounded (the chunk-granularity baseline)."""
    prompt_tokens: int
    offload_hit_tokens: int
    """Tokens served from the disk."""
    files_read: int
    files_written: int
    files_evicted: int
    recomputed_for_space_tokens: int
    """Tokens the unbounded disk served that this one did not (chunk granularity, what
    the unbounded disk also recomputes, is not counted)."""
    stranded_bytes: int
    """Bytes on disk at the end that no lookup can load."""
    bytes_on_disk: int

    def per_million(self, count: int) -> float:
        return count * MILLION / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the disk, as a fraction of all prompt tokens."""
        return self.offload_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _start(
    chunking: Chunking, policy: Policy, max_num_batched_tokens: int, index: BudgetedIndex,
) -> _Engine:
    """An engine over ``index`` with a cold GPU cache (see :func:`scaled`)."""
    engine = _Engine(chunking, policy, max_num_batched_tokens)
    engine.index = index
    engine.planner = Planner(chunking, index, policy)
    engine.gpu_cache = GpuCache.COLD
    return engine


def _serve_from(
    engine: _Engine, index: BudgetedIndex,
    reqs: Sequence[tuple[WorkloadRequest, Sequence[bytes]]],
) -> None:
    for req, all_hashes in reqs:
        index.observe(all_hashes)
        engine.serve(req, all_hashes)


SNAPSHOTS = 32
"""States of the unbounded run a curve keeps (evenly spaced in requests): a bounded run
starts from the latest one it shares (see :func:`miss_ratio_curve`)."""


def miss_ratio_curve(
    chunking: Chunking,
    workload: Workload,
    sizes: Sequence[int] | int,
    rule: EvictionRule = EvictionRule.REACHABLE,
    key_bytes: Mapping[int, int] | int = 1,
    layout: Layout = Layout.PACKED,
    policy: Policy = Policy(),  # noqa: B008  (a frozen dataclass)
) -> tuple[DiskEconomics, ...]:
    """:func:`disk_economics` at each of ``sizes`` (bytes; an int ``n``: ``n`` sizes evenly
    spaced up to the unbounded run's peak bytes, ``peak * k // n`` for ``k`` = 1..n, the
    last one the unbounded run itself).  The workload is hashed once
    and served once over an unbounded disk (the baseline for tokens recomputed for lack
    of space).  A disk of ``size`` bytes behaves exactly as the unbounded one until a
    store would take it past ``size`` (nothing is evicted nor refused before), so:

    * a size at least that run's peak bytes is that run;
    * a smaller size continues from the latest state of the unbounded run, taken before a
      request, whose peak bytes are at most ``size`` (:data:`SNAPSHOTS` states are kept,
      evenly spaced in requests; a pickled copy: the run's objects are plain data).

    The GPU cache is cold (see :func:`scaled`)."""
    reqs = hashed(list(requests(workload)), chunking.tokens_per_hash)
    budget_of_run = workload.max_num_batched_tokens

    def new_index(size: int) -> BudgetedIndex:
        return BudgetedIndex(chunking, key_bytes, size, rule, layout, policy.window)

    def result(engine: _Engine, index: BudgetedIndex, size: int | None,
               baseline_served: int) -> DiskEconomics:
        t = engine.tally
        return DiskEconomics(
            workload=workload.name, rule=rule, layout=layout, budget_bytes=size,
            prompt_tokens=t.prompt_tokens, offload_hit_tokens=t.offload_hit,
            files_read=index.files_read, files_written=index.files_written,
            files_evicted=index.files_evicted,
            recomputed_for_space_tokens=baseline_served - (t.gpu_hit + t.offload_hit),
            stranded_bytes=index.stranded_bytes(), bytes_on_disk=index.disk.bytes,
        )

    # The unbounded run, keeping (peak bytes so far, requests served, state) snapshots.
    index = new_index(2**62)
    engine = _start(chunking, policy, budget_of_run, index)
    stride = max(1, -(-len(reqs) // SNAPSHOTS))
    snapshots: list[tuple[int, int, bytes]] = []
    for i, (req, all_hashes) in enumerate(reqs):
        if i and i % stride == 0:
            snapshots.append((index.disk.peak_bytes, i,
                              pickle.dumps((engine, index), pickle.HIGHEST_PROTOCOL)))
        index.observe(all_hashes)
        engine.serve(req, all_hashes)
    peak = index.disk.peak_bytes
    served = engine.tally.gpu_hit + engine.tally.offload_hit
    unbounded = result(engine, index, None, served)
    if isinstance(sizes, int):
        if sizes < 1:
            raise ValueError(f"miss_ratio_curve: sizes must be >= 1 points, got {sizes}")
        sizes = [max(1, peak * k // sizes) for k in range(1, sizes + 1)]

    out = []
    for size in sizes:
        if size >= peak:
            out.append(replace(unbounded, budget_bytes=size))
            continue
        start = next((s for s in reversed(snapshots) if s[0] <= size), None)
        if start is None:
            index = new_index(size)
            engine = _start(chunking, policy, budget_of_run, index)
            first = 0
        else:
            engine, index = pickle.loads(start[2])
            index.budget = size
            first = start[1]
        _serve_from(engine, index, reqs[first:])
        out.append(result(engine, index, size, served))
    return tuple(out)


def disk_economics(
    chunking: Chunking,
    workload: Workload,
    budget_bytes: int,
    rule: EvictionRule = EvictionRule.REACHABLE,
    key_bytes: Mapping[int, int] | int = 1,
    layout: Layout = Layout.PACKED,
    policy: Policy = Policy(),  # noqa: B008  (a frozen dataclass)
) -> DiskEconomics:
    """Serve ``workload`` (GPU cache cold) over a disk of ``budget_bytes`` evicting by
    ``rule``: hits, files read, written and evicted, tokens recomputed for lack of space,
    stranded bytes at the end."""
    (one,) = miss_ratio_curve(chunking, workload, (budget_bytes,), rule, key_bytes, layout, policy)
    return one
