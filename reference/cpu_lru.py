"""vLLM's CPU tier with its LRU as the release runs it: request-scoped recency.

:class:`reference.store.ChunkStore` states vLLM's CPU manager with *position-free* ranks
(what the manager does when no key position is known).  The scheduler always records
key positions, so the release ranks keys by request: this module states that order,
for a CPU tier in front of a disk (:mod:`reference.tiered_index`).  It mirrors
``CPUOffloadingManager`` (``v1/kv_offload/cpu/manager.py``) with the ``"lru"`` policy
(``cpu/policies/lru.py``), vLLM 0.33.0 and 0.34.0 alike (0.34.0 only removed the
``touch`` the scheduler never called):

Entries
    A key holds one of ``num_slots`` slots.  It is *pending* from :meth:`CpuLru.prepare_store`
    until :meth:`CpuLru.complete_store` (a failed store frees it), then *ready*; a ready
    entry is pinned while loads (or cascade reads) from it are in flight.  Only ready,
    unpinned entries are evictable.  Slot ids are not modelled (only how many are free).

Ranks (the eviction order: the smallest rank goes first, ties by key bytes)
    A request gets a *request rank* the first time it touches the tier (a store it
    offers, a load, a promotion), from a counter every rank is drawn from.  A key it
    inserts ranks ``(request_rank, -position)`` (``position``: the key's end token, which
    the scheduler records for every key: ``(chunk index + 1) * tokens_per_chunk``), so
    within a live request tails go before heads.  A ready key a request reuses (a load,
    or a store offer of a key already held) is raised to that rank if it ranked lower.
    When the request finishes, every key it touched is re-ranked in one sweep: ordered
    head to tail across its groups (by position, ties by group index), walked from the
    tail, each key taking the next counter value, so the head ends the most recent
    (``on_request_finished``).  A lookup does not touch a rank.  Reads that cascade a
    key to the disk pin it without touching its rank.

Stores
    :meth:`CpuLru.prepare_store` records the offered keys that are new or ready as the
    request's (before any refusal, as vLLM does), then evicts the least ranked evictable
    entries not offered, or refuses the whole store (None, nothing evicted) when too few
    can go.

``store_threshold``, the ARC policy, events and slot ids are not modelled.
``tests/test_cpu_lru.py`` drives vLLM's own manager and this one with the same calls.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from reference.keys import split_key
from reference.store import LookupResult, StorePlan

__all__ = ["CpuLru", "RequestContext"]

Rank = tuple[int, int]


@dataclass
class RequestContext:
    """One request as the CPU tier sees it (vLLM's ``ReqContext`` and the policy's and
    manager's per-request state): its keys' end-token positions, its rank, the keys it
    touched per group."""

    positions: Mapping[bytes, int] = field(default_factory=dict)
    """Each key's end token (a key without one ranks position-free: the next counter
    value, as vLLM does)."""
    rank: int | None = None
    generation: int = -1
    """The tier's reset count when :attr:`rank` and :attr:`seen` were taken."""
    groups: dict[int, list[bytes]] = field(default_factory=dict)
    """Keys touched, per group index, in the order first touched."""
    seen: set[bytes] = field(default_factory=set)
    finished: bool = False


@dataclass(slots=True)
class _Entry:
    ready: bool = False
    pins: int = 0


class CpuLru:
    """A CPU tier of ``num_slots`` chunk slots, evicting by vLLM's request-scoped LRU."""

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
        self.num_slots = num_slots
        self._entries: dict[bytes, _Entry] = {}
        self._ranks: dict[bytes, Rank] = {}
        self._evictable: set[bytes] = set()
        self._heap: list[tuple[Rank, bytes]] = []
        self._next_rank = 0
        self.generation = 0
        """How many times :meth:`reset` ran."""
        self.evicted = 0
        """Entries evicted so far."""

    # -- queries ----------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        e = self._entries.get(key)
        if e is None:
            return LookupResult.MISS
        return LookupResult.HIT if e.ready else LookupResult.HIT_PENDING

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - len(self._entries)

    def eviction_order(self) -> tuple[bytes, ...]:
        """The evictable keys, the first to go first."""
        return tuple(sorted(self._evictable, key=lambda k: (self._ranks[k], k)))

    # -- request-scoped recency ---------------------------------------------------

    def _state(self, ctx: RequestContext) -> RequestContext:
        if ctx.generation != self.generation:  # a request from before a reset starts over
            ctx.generation = self.generation
            ctx.rank = None
            ctx.groups = {}
            ctx.seen = set()
            ctx.finished = False
        return ctx

    def _request_rank(self, ctx: RequestContext) -> int:
        if ctx.rank is None:
            self._next_rank += 1
            ctx.rank = self._next_rank
        return ctx.rank

    def _push(self, key: bytes) -> None:
        heapq.heappush(self._heap, (self._ranks[key], key))
        if len(self._heap) >= max(64, 2 * len(self._evictable)):
            self._heap = [(self._ranks[k], k) for k in self._evictable]
            heapq.heapify(self._heap)

    def _record(self, keys: Iterable[bytes], ctx: RequestContext) -> None:
        """``_record_request_cache_access``: keys first touched by the request join its
        groups, and the policy's ``on_request_access`` raises the held ones to the
        request's rank."""
        ctx = self._state(ctx)
        new = []
        for key in keys:
            if key in ctx.seen:
                continue
            if ctx.finished:
                raise ValueError("a key touched after its request finished")
            ctx.groups.setdefault(split_key(key)[1], []).append(key)
            ctx.seen.add(key)
            new.append(key)
        if not new:
            return
        rank = self._request_rank(ctx)
        for key in new:
            position = ctx.positions.get(key)
            if position is None or key not in self._entries:
                continue
            r = (rank, -position)
            if self._ranks[key] >= r:
                continue
            self._ranks[key] = r
            if key in self._evictable:
                self._push(key)

    def on_request_finished(self, ctx: RequestContext) -> None:
        """The request's keys re-ranked head to tail, the head the most recent."""
        if ctx.generation != self.generation or ctx.finished:
            return
        ctx.finished = True
        keys: list[bytes] = []
        for group in sorted(ctx.groups):
            ks = ctx.groups[group]
            if all(k in ctx.positions for k in ks):
                ks = sorted(ks, key=ctx.positions.__getitem__)
            keys.extend(ks)
        if all(k in ctx.positions for k in keys):
            keys.sort(key=ctx.positions.__getitem__)
        for key in reversed(keys):
            if key not in self._entries:
                continue
            self._next_rank += 1
            self._ranks[key] = (self._next_rank, 0)
            if key in self._evictable:
                self._push(key)

    # -- store ------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[bytes], ctx: RequestContext) -> StorePlan | None:
        """Slots for the offered keys not held, evicting the least ranked evictable
        entries not offered; None (nothing evicted) when too few can go."""
        keys = list(keys)
        to_store = [k for k in keys if k not in self._entries]
        ready = {k for k in keys if k in self._entries and self._entries[k].ready}
        recorded = set(to_store) | ready
        self._record((k for k in keys if k in recorded), ctx)
        if not to_store:
            return StorePlan((), (), ())
        need = len(to_store) - self.num_free_slots
        victims: list[bytes] = []
        if need > 0:
            if need > len(self._evictable):
                return None
            evicted = self._evict(need, set(keys))
            if evicted is None:
                return None
            victims = evicted
        rank = None
        for key in to_store:
            self._entries[key] = _Entry()
            position = ctx.positions.get(key)
            if position is None:
                self._next_rank += 1
                self._ranks[key] = (self._next_rank, 0)
            else:
                if rank is None:
                    rank = self._request_rank(self._state(ctx))
                self._ranks[key] = (rank, -position)
        return StorePlan(tuple(to_store), tuple(range(len(to_store))), tuple(victims))

    def _evict(self, n: int, protected: set[bytes]) -> list[bytes] | None:
        selected: list[tuple[Rank, bytes]] = []
        chosen: set[bytes] = set()
        deferred: list[tuple[Rank, bytes]] = []
        while self._heap and len(selected) < n:
            entry = heapq.heappop(self._heap)
            rank, key = entry
            if key not in self._evictable or self._ranks.get(key) != rank or key in chosen:
                continue
            if key in protected:
                deferred.append(entry)
                continue
            selected.append(entry)
            chosen.add(key)
        if len(selected) < n:
            for entry in (*selected, *deferred):
                heapq.heappush(self._heap, entry)
            return None
        for entry in deferred:
            heapq.heappush(self._heap, entry)
        for _, key in selected:
            self._evictable.discard(key)
            del self._entries[key]
            del self._ranks[key]
        self.evicted += len(selected)
        return [key for _, key in selected]

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Pending keys become ready (evictable at their rank), or are dropped."""
        for key in keys:
            e = self._entries.get(key)
            if e is None or e.ready:
                continue
            if success:
                e.ready = True
                self._evictable.add(key)
                self._push(key)
            else:
                del self._entries[key]
                self._ranks.pop(key, None)

    # -- load -------------------------------------------------------------------

    def prepare_load(self, keys: Sequence[bytes], ctx: RequestContext | None) -> None:
        """Pin ready keys for a load (a GPU load records them as the request's; a cascade
        read, ``ctx`` None, does not)."""
        for key in keys:
            e = self._entries.get(key)
            if e is None or not e.ready:
                state = "not held" if e is None else "still being stored"
                raise ValueError(f"prepare_load: key {key.hex()} is {state}")
        for key in keys:
            e = self._entries[key]
            if e.pins == 0:
                self._evictable.discard(key)
            e.pins += 1
        if ctx is not None:
            self._record(keys, ctx)

    def complete_load(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            e = self._entries[key]
            if e.pins <= 0:
                raise ValueError(f"complete_load: key {key.hex()} has no load in flight")
            e.pins -= 1
            if e.pins == 0:
                self._evictable.add(key)
                self._push(key)

    def reset(self) -> None:
        """``reset_cache``: every entry forgotten; requests start over."""
        self._entries.clear()
        self._ranks.clear()
        self._evictable.clear()
        self._heap.clear()
        self._next_rank = 0
        self.generation += 1
