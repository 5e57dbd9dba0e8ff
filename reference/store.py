"""An in-memory, capacity-bounded LRU chunk store: vLLM 0.33.0's CPU manager, stated plainly.

It mirrors ``CPUOffloadingManager`` (``v1/kv_offload/cpu/manager.py``) with the
``"lru"`` policy (``cpu/policies/lru.py``): which keys get slots, which slot ids,
which entries are evicted, and what lookups see.

Entries
    A key (``bytes``, see :mod:`reference.keys`) maps to one slot id in
    ``[0, num_slots)``.  An entry is *pending* from :meth:`ChunkStore.prepare_store`
    until :meth:`ChunkStore.complete_store`, then *ready*.  A ready entry has a
    ref count: the loads in flight from it (:meth:`ChunkStore.prepare_load` /
    :meth:`ChunkStore.complete_load`).  Only ready entries with ref count 0 can
    be evicted; pending entries cannot be loaded.

Slot allocation (``_allocate_chunks``)
    Fresh ids ``0, 1, 2, ...`` are handed out first, in offer order; after that,
    ids freed by evictions and failed stores are reused last-freed-first (a LIFO
    stack).  Victims of one ``prepare_store`` are freed least recent first, so
    the first new key gets the slot of the *most* recent victim.

Recency (LRU)
    An inserted key becomes the most recent, keys of one offer in offer order.
    :meth:`ChunkStore.touch` makes keys most recent with ``keys[0]`` ending as
    *the* most recent (vLLM walks them in reverse: a prefix's head outlives its
    tail).  Completing a store or a load does not change recency, nor does a
    load itself.

What is not modelled
    * vLLM 0.33.0's LRU is request-scoped when the scheduler has recorded key
      positions (it always does): a key inserted or accessed by an active request
      gets rank ``(request_rank, -end_token)``, where ``request_rank`` is fixed at
      the request's first access, and the request's keys are re-ranked like a
      :meth:`touch` (head most recent) by ``on_request_finished``.  The scheduler
      never calls ``touch`` itself.  This store models the position-free ranks
      (what the manager does when no position is known); a caller can emulate
      request end with ``touch(keys_in_prefix_order)``.
    * ``store_threshold`` (``kv_connector_extra_config["store_threshold"]``,
      default 0 = off; >= 2 admits a key only after that many offers), offloading
      events (only ``evicted_keys`` is reported), the ARC policy, stats.

vLLM asserts where this store raises ``ValueError``; every check happens before
any change, so a rejected call changes nothing.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only the optional pool needs torch; the planner and corpus replay do not
    import torch


class LookupResult(Enum):
    """What :meth:`ChunkStore.lookup` sees: vLLM's ``LookupResult`` without tiering's ``RETRY``."""

    MISS = "miss"
    """Not held (never stored, evicted, failed, or reset)."""
    HIT = "hit"
    """Held and its store completed: loadable."""
    HIT_PENDING = "hit_pending"
    """Held but its store has not completed: not loadable yet, not to be stored again."""


@dataclass(frozen=True)
class StorePlan:
    """The result of a successful :meth:`ChunkStore.prepare_store`.

    ``slot_ids[i]`` is where ``keys_to_store[i]`` goes; ``evicted_keys`` were
    dropped (least recent first) to make room.  vLLM's ``PrepareStoreOutput``.
    """

    keys_to_store: tuple[bytes, ...]
    slot_ids: tuple[int, ...]
    evicted_keys: tuple[bytes, ...]


@dataclass(slots=True)
class _Entry:
    slot: int
    ready: bool = False
    ref_count: int = 0

    @property
    def evictable(self) -> bool:
        return self.ready and self.ref_count == 0


class ChunkStore:
    """Key -> slot bookkeeping with vLLM's CPU-manager semantics; optionally owns the pool.

    With ``slot_bytes`` given, :attr:`pool` is a zeroed uint8 ``[num_slots,
    slot_bytes]`` tensor on ``device`` (pinned host memory with ``pin_memory``),
    ready for :func:`reference.transfer.gather` / :func:`reference.transfer.scatter`.
    The store never touches its contents: a reused slot keeps its previous bytes
    until overwritten, as in vLLM.
    """

    def __init__(
        self,
        num_slots: int,
        slot_bytes: int | None = None,
        *,
        device: torch.device | str = "cpu",
        pin_memory: bool = False,
    ) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
            raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
        self.num_slots = num_slots
        self.pool: torch.Tensor | None = None
        if slot_bytes is not None:
            if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0:
                raise ValueError(f"slot_bytes must be an int > 0, got {slot_bytes!r}")
            import torch

            self.pool = torch.zeros(
                (num_slots, slot_bytes), dtype=torch.uint8, device=device, pin_memory=pin_memory
            )
        self.generation = 0
        """How many times :meth:`reset` ran."""
        # Recency order: the first entry is the least recently used.
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        # Slots 0 .. _num_fresh-1 have been handed out since the last reset.
        self._num_fresh = 0
        # Slots freed since, reused last-freed-first.
        self._free: list[int] = []

    # -- queries ------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        entry = self._entries.get(_key(key))
        if entry is None:
            return LookupResult.MISS
        return LookupResult.HIT if entry.ready else LookupResult.HIT_PENDING

    def slot_of(self, key: bytes) -> int | None:
        """The slot a held key occupies (pending or ready), else None."""
        entry = self._entries.get(_key(key))
        return None if entry is None else entry.slot

    def ref_count(self, key: bytes) -> int:
        """Loads in flight from ``key`` (0 when not held)."""
        entry = self._entries.get(_key(key))
        return 0 if entry is None else entry.ref_count

    def lru_order(self) -> tuple[bytes, ...]:
        """Every held key, least recently used first (eviction considers them in this order)."""
        return tuple(self._entries)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_ready(self) -> int:
        return sum(e.ready for e in self._entries.values())

    @property
    def num_pending_stores(self) -> int:
        return sum(not e.ready for e in self._entries.values())

    @property
    def num_pinned(self) -> int:
        """Entries with loads in flight (ref count > 0)."""
        return sum(e.ref_count > 0 for e in self._entries.values())

    @property
    def num_evictable(self) -> int:
        return sum(e.evictable for e in self._entries.values())

    @property
    def num_free_slots(self) -> int:
        return self.num_slots - self._num_fresh + len(self._free)

    # -- store --------------------------------------------------------------

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        """Allocate slots for the offered keys that are not held yet, evicting if needed.

        Held keys (ready or pending) are dropped from the plan; the rest keep
        offer order.  When the free slots do not suffice, the least recent
        evictable entries go, never one of the offered keys.  Returns None, and
        changes nothing, when that still leaves too few slots.  An offer of only
        held keys returns an empty plan (not None), even when the store is full.
        """
        offered = _distinct_keys("prepare_store", keys)
        to_store = [k for k in offered if k not in self._entries]
        if not to_store:
            return StorePlan((), (), ())

        shortfall = len(to_store) - self.num_free_slots
        victims: list[bytes] = []
        if shortfall > 0:
            protected = set(offered)
            for key, entry in self._entries.items():
                if len(victims) == shortfall:
                    break
                if entry.evictable and key not in protected:
                    victims.append(key)
            if len(victims) < shortfall:
                return None

        for key in victims:
            self._free.append(self._entries.pop(key).slot)
        slots = [self._allocate_slot() for _ in to_store]
        for key, slot in zip(to_store, slots, strict=True):
            self._entries[key] = _Entry(slot)
        return StorePlan(tuple(to_store), tuple(slots), tuple(victims))

    def complete_store(self, keys: Iterable[bytes], success: bool = True) -> None:
        """Finish stores: on success the keys become loadable; on failure they are dropped.

        A failed key is visible to nobody and its slot is freed (in ``keys``
        order).  Keys not pending (absent, or already ready) are ignored, as in
        vLLM.
        """
        for key in _keys("complete_store", keys):
            entry = self._entries.get(key)
            if entry is None or entry.ready:
                continue
            if success:
                entry.ready = True
            else:
                del self._entries[key]
                self._free.append(entry.slot)

    def _allocate_slot(self) -> int:
        """A fresh slot id while any is left, else the most recently freed one."""
        if self._num_fresh < self.num_slots:
            self._num_fresh += 1
            return self._num_fresh - 1
        return self._free.pop()

    # -- load ---------------------------------------------------------------

    def prepare_load(self, keys: Sequence[bytes]) -> tuple[int, ...]:
        """Pin ready keys for a load (ref count + 1 each, per occurrence) and return their slots."""
        keys = _keys("prepare_load", keys)
        for key in keys:
            entry = self._entries.get(key)
            if entry is None or not entry.ready:
                state = "not held" if entry is None else "still being stored"
                raise ValueError(f"prepare_load: key {key.hex()} is {state}; only HITs load")
        slots = []
        for key in keys:
            entry = self._entries[key]
            entry.ref_count += 1
            slots.append(entry.slot)
        return tuple(slots)

    def complete_load(self, keys: Iterable[bytes]) -> None:
        """Unpin keys whose load finished (ref count - 1 each, per occurrence)."""
        counts = Counter(_keys("complete_load", keys))
        for key, n in counts.items():
            entry = self._entries.get(key)
            if entry is None or entry.ref_count < n:
                have = 0 if entry is None else entry.ref_count
                raise ValueError(
                    f"complete_load: key {key.hex()} has {have} loads in flight, "
                    f"cannot complete {n}"
                )
        for key, n in counts.items():
            self._entries[key].ref_count -= n

    # -- recency and reset --------------------------------------------------

    def evict(self, key: bytes) -> None:
        """Drop one ready, unpinned entry now (an eviction decided elsewhere)."""
        key = _key(key)
        entry = self._entries.get(key)
        if entry is None or not entry.evictable:
            state = "not held" if entry is None else "not evictable (pending or pinned)"
            raise ValueError(f"evict: key {key.hex()} is {state}")
        del self._entries[key]
        self._free.append(entry.slot)


    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark held keys most recently used, ``keys[0]`` the most recent; others are ignored."""
        for key in reversed(_keys("touch", keys)):
            if key in self._entries:
                self._entries.move_to_end(key)

    def reset(self) -> None:
        """Prefix-cache reset: forget every entry, whatever its state, and restart slot ids at 0.

        vLLM's ``reset_cache`` clears unconditionally; its scheduler then drops
        the completions of pre-reset jobs and fences in-flight loads before new
        stores reuse slots.  Here a pre-reset ``complete_store`` is ignored and a
        pre-reset ``complete_load`` raises.  Pool bytes are kept.
        """
        self._entries.clear()
        self._free.clear()
        self._num_fresh = 0
        self.generation += 1

    # -- reliability --------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
        live = [e.slot for e in self._entries.values()]
        handed_out = live + self._free
        if not 0 <= self._num_fresh <= self.num_slots:
            raise AssertionError(f"fresh counter {self._num_fresh} outside 0..{self.num_slots}")
        if sorted(handed_out) != list(range(self._num_fresh)):
            raise AssertionError(
                f"live slots {sorted(live)} and free slots {sorted(self._free)} must "
                f"partition 0..{self._num_fresh - 1}"
            )
        for key, entry in self._entries.items():
            if entry.ref_count < 0:
                raise AssertionError(f"{key.hex()} has ref count {entry.ref_count}")
            if not entry.ready and entry.ref_count:
                raise AssertionError(f"{key.hex()} is being loaded before its store completed")
        if self.pool is not None and self.pool.shape[0] != self.num_slots:
            raise AssertionError("pool rows != num_slots")


def _key(key: object) -> bytes:
    if not isinstance(key, bytes):
        raise ValueError(f"keys are bytes, got {type(key).__name__} {key!r}")
    return key


def _keys(where: str, keys: Iterable[bytes]) -> list[bytes]:
    """A list of keys; a clear ValueError for None, a single key, a str or a non-iterable."""
    if keys is None or isinstance(keys, (bytes, bytearray, str)):
        raise ValueError(
            f"{where}: keys must be a sequence of bytes keys, got {type(keys).__name__} {keys!r}"
        )
    try:
        items = list(keys)
    except TypeError:
        raise ValueError(
            f"{where}: keys must be a sequence of bytes keys, got {type(keys).__name__}"
        ) from None
    return [_key(k) for k in items]


def _distinct_keys(where: str, keys: Iterable[bytes]) -> list[bytes]:
    out = _keys(where, keys)
    if len(set(out)) != len(out):
        repeated = sorted({k.hex() for k in out if out.count(k) > 1})
        raise ValueError(f"{where}: keys must be distinct, repeated: {repeated}")
    return out
