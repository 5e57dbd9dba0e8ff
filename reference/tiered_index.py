"""vLLM's CPU tier in front of a budgeted disk, in the order vLLM's tiering manager drives them.

The intent the eviction-economics lane (``conformance/harness/eviction_econ.py``) holds
kvchunk's tier to, and the second series of ``--sweep-disk``
(:mod:`reference.tiered_curve`): :class:`TieredIndex` is the chunk index
(``reference.plan.ChunkIndex``) a :class:`PromotingPlanner` talks to, a CPU tier in front
of a :class:`reference.disk_economics.BudgetedIndex` (the disk: its files, its byte
budget, its eviction rule, its prefix structure), in the order vLLM's
``TieringOffloadingManager`` drives a secondary tier:

* **the CPU tier**: unbounded (a set of keys: it holds every key it is given; the
  lane's large CPU tier), or ``num_slots`` slots evicting by vLLM's request-scoped LRU
  (:class:`reference.cpu_lru.CpuLru`), with each request's key positions and its end
  (:meth:`TieredIndex.begin_request`, :meth:`TieredIndex.end_request`, which
  :class:`PromotingEngine` calls) as the scheduler reports them.  A store the CPU tier
  cannot make room for is refused (the Planner offers it again next step).
* **stores**: a key the CPU tier does not hold is stored there (the Planner's store
  job); when the job completes, its keys (the newly stored ones: vLLM hands the
  secondary tier one ``TransferJob`` per GPU->CPU store) are cascaded to the disk as one
  store (:meth:`BudgetedIndex.prepare_store`: keys already on disk left out, keys that
  would arrive stranded left out under the rule, the layout's files, evicting by the
  rule first, refused when nothing evictable makes it fit: a refused cascade is not
  offered again), completed at once (:meth:`BudgetedIndex.complete_store`).  Stores
  reserve in job order, each one written before the next reserves (a file being
  written cannot be evicted: stores that overlap are not modelled).  A key the CPU tier
  already holds is not stored again, so it is not cascaded again either, even when the
  disk has evicted it meanwhile.  ``repair`` (an option, off by default; measured and not
  kept, ``docs/semantics.md`` section 10): the cascade also offers, before the job's keys,
  their ancestors the disk lacks and the CPU tier holds (:meth:`TieredIndex.missing_ancestors`).
* **lookups**: a key the CPU tier holds is a hit there (or HIT_PENDING while its store
  or promotion is in flight; the disk is not asked, and no rank changes); any other
  key is looked up on the disk (:meth:`BudgetedIndex.lookup`: a hit refreshes its
  file's use time).
* **promotions**: a key the disk holds is promoted to the CPU tier *when a lookup finds
  it*, whatever hit the request ends with: ``TieringOffloadingManager.lookup`` reserves
  a CPU slot (a bounded tier evicts for it, or answers MISS when it cannot) and answers
  HIT_PENDING, before the connector has asked the other groups.  So a full-attention
  chunk whose boundary's window chunks are gone is read although the windows cut the
  hit (the windows-apart layout keeps such a chunk as the prefix of a deeper boundary).
  The promotions a lookup starts land before the next step
  (:meth:`TieredIndex.finish_promotions`: a read per distinct file of the batch, use
  times refreshed; the keys are then held by the CPU tier, and are not cascaded back).
  A lookup whose hit needs a chunk being promoted is deferred and asked again once they
  landed (:class:`PromotingPlanner`; with a bounded CPU tier a promotion may evict a
  chunk the lookup found before, so it is asked again until it is not deferred, at most
  :data:`MAX_LOOKUP_ROUNDS` times, then served with no offload hit: vLLM would ask every
  step).  With a bounded CPU tier a promotion may also evict a chunk the same lookup
  found HIT in the CPU tier and that the hit needs (the full-attention scan promotes
  chunks past the hit the windows then cut): vLLM's ``prepare_load`` asserts on it; the
  model asks such a lookup again, as if deferred
  (:attr:`TieredIndex.hits_evicted_by_promotions`).  A lookup that is not deferred (the
  windows cut the hit short of the promoted chunks)
  registers no shared-prefix junction when its full-attention scan started a promotion
  (vLLM's ``full_attention_hit_boundary`` is 0 when that scan deferred;
  :class:`PromotingEngine`).
* **loads**: the keys of a load job are pinned in the CPU tier for the load (with
  promotions at lookup, a load job finds its keys there); an unbounded tier reads a key
  it does not hold from the disk (:meth:`BudgetedIndex.prepare_load`: a read per
  distinct file of the job) and then holds it.
* **resets**: the CPU tier is emptied (vLLM's ``reset_cache``); the disk keeps its
  files, its use times and its prefix structure.

What :mod:`reference.tiered_index` leaves to the caller: the disk's prefix structure is
fed each request's whole hash chain before its lookup (:meth:`BudgetedIndex.observe`),
and the GPU prefix cache is whatever the engine's ``gpu_cache`` says.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from reference.cpu_lru import CpuLru, RequestContext
from reference.disk_economics import BudgetedIndex
from reference.economics import Engine
from reference.keys import split_key
from reference.knobs import Chunking
from reference.plan import Planner, Policy
from reference.rules import needed_chunks
from reference.store import LookupResult, StorePlan
from reference.workload import WorkloadRequest

__all__ = ["MAX_LOOKUP_ROUNDS", "KeyPositions", "PromotingEngine", "PromotingPlanner", "TieredIndex"]

MAX_LOOKUP_ROUNDS = 8
"""How many times :class:`PromotingPlanner` asks a deferred lookup again (promotions landed
in between) before the request is served with no offload hit (a bounded CPU tier
smaller than the hit: its promotions evict each other)."""


class KeyPositions(Mapping[bytes, int]):
    """A request's keys' end-token positions, as vLLM's scheduler records them: a chunk's
    key is the block hash at its last hash unit (:func:`reference.keys.chunk_key`), so its
    end token is that unit's end (``(chunk index + 1) * tokens_per_chunk``)."""

    def __init__(self, all_hashes: Sequence[bytes], tokens_per_hash: int) -> None:
        self._unit = {h: i for i, h in enumerate(all_hashes)}
        self._tph = tokens_per_hash

    def __getitem__(self, key: bytes) -> int:
        i = self._unit.get(split_key(key)[0])
        if i is None:
            raise KeyError(key)
        return (i + 1) * self._tph

    def __iter__(self) -> Iterator[bytes]:
        raise TypeError("KeyPositions answers per key; it does not list its keys")

    def __len__(self) -> int:
        return len(self._unit)


class TieredIndex:
    """A CPU tier in front of a budgeted disk (``reference.plan.ChunkIndex``; the order of
    events in the module docstring): a disk hit starts a promotion (HIT_PENDING until
    :meth:`finish_promotions`).  ``cpu``: None, a CPU tier that holds every key it is
    given; else a bounded one (vLLM's request-scoped LRU)."""

    def __init__(self, disk: BudgetedIndex, cpu: CpuLru | None = None, *,
                 repair: bool = False) -> None:
        """``repair``: the cascade also offers the disk a store's missing ancestors the CPU
        tier holds (:meth:`missing_ancestors`), before the store's keys (an option
        measured by ``scripts/disk_ablation.py --repair``; off: vLLM's cascade)."""
        self.disk = disk
        self.lru = cpu
        self.repair = repair
        self.keys_repaired = 0
        """Ancestors the cascade wrote to the disk from the CPU tier (``repair``)."""
        self.bytes_repaired = 0
        """Their bytes (written beyond the cascade's own)."""
        self.cpu: set[bytes] = set()
        """The unbounded CPU tier's keys (unused with a bounded one)."""
        self._pending: set[bytes] = set()
        self.promoting: dict[bytes, None] = {}
        """Keys a lookup found on the disk, being promoted to the CPU tier (in lookup order)."""
        self.request: RequestContext | None = None
        """The request being served (a bounded CPU tier ranks its keys by it)."""
        self.probing = False
        """Lookups answer without starting promotions (:meth:`PromotingEngine._junction`)."""
        self.keys_promoted = 0
        """Keys read from the disk into the CPU tier."""
        self.promotions_refused = 0
        """Disk hits a bounded CPU tier had no slot for (answered MISS)."""
        self.cpu_stores_refused = 0
        """GPU->CPU stores a bounded CPU tier had no room for (offered again next step)."""
        self.keys_cascaded = 0
        """Keys handed to the disk by the CPU->disk cascade (newly stored chunks)."""
        self.lookups_abandoned = 0
        """Lookups still deferred after :data:`MAX_LOOKUP_ROUNDS` (served with no offload hit)."""
        self.hits_evicted_by_promotions = 0
        """Lookups whose hit lost a chunk the CPU tier had answered HIT for to a promotion the
        same lookup started (asked again, as if deferred; vLLM's ``prepare_load`` asserts)."""

    # -- the request being served (a bounded CPU tier's recency) -------------------------

    def begin_request(self, chunking: Chunking, all_hashes: Sequence[bytes]) -> None:
        """The request whose calls follow: its keys' end-token positions, as the scheduler
        records them."""
        if self.lru is None:
            return
        self.request = RequestContext(positions=KeyPositions(all_hashes, chunking.tokens_per_hash))

    def end_request(self) -> None:
        """The request finished (vLLM's ``on_request_finished``, after its last stores)."""
        if self.lru is not None and self.request is not None:
            self.lru.on_request_finished(self.request)
        self.request = None

    def _ctx(self) -> RequestContext:
        if self.request is None:
            self.request = RequestContext()  # positions unknown: ranked position-free
        return self.request

    # -- ChunkIndex ------------------------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        if self.lru is not None:
            return self._lookup_bounded(key)
        if key in self._pending or key in self.promoting:
            return LookupResult.HIT_PENDING
        if key in self.cpu:
            return LookupResult.HIT
        found = self.disk.lookup(key)
        if found is LookupResult.HIT:  # vLLM's tiering manager promotes it now
            self.promoting[key] = None
            return LookupResult.HIT_PENDING
        return found

    def _lookup_bounded(self, key: bytes) -> LookupResult:
        assert self.lru is not None
        held = self.lru.lookup(key)
        if held is not LookupResult.MISS or self.probing:
            return held
        found = self.disk.lookup(key)
        if found is not LookupResult.HIT:
            return found
        if self.lru.prepare_store([key], self._ctx()) is None:  # no CPU slot for it
            self.promotions_refused += 1
            return LookupResult.MISS
        self.promoting[key] = None
        return LookupResult.HIT_PENDING

    def finish_promotions(self) -> None:
        """The promotions lookups started land (vLLM flushes them at the step's end, one
        load job per request; the lane drains the tier's I/O after every step): a read
        per distinct file, then the CPU tier holds the keys."""
        keys = list(self.promoting)
        self.promoting.clear()
        if keys:
            self.disk.prepare_load(keys)
            self.disk.complete_load(keys)
            self.keys_promoted += len(keys)
            if self.lru is None:
                self.cpu.update(keys)
            else:
                self.lru.complete_store(keys, True)  # no cascade: a promotion is no store

    def promoting_full(self) -> bool:
        """Whether a full-attention key is being promoted."""
        return any(self.disk.structure.is_full(k) for k in self.promoting)

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        self.finish_promotions()
        if self.lru is not None:
            plan = self.lru.prepare_store(keys, self._ctx())
            if plan is None:
                self.cpu_stores_refused += 1
            return plan
        new = tuple(dict.fromkeys(k for k in keys if k not in self.cpu and k not in self._pending))
        self._pending.update(new)
        return StorePlan(new, tuple(range(len(new))), ())

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        self.finish_promotions()
        if self.lru is not None:
            self.lru.complete_store(keys, success)
        else:
            self._pending.difference_update(keys)
        if not success:
            return
        if self.lru is None:
            self.cpu.update(keys)
        self.keys_cascaded += len(keys)
        ancestors = self.missing_ancestors(keys) if self.repair else ()
        # the cascade: one store of the job's keys (with repair, its missing ancestors first)
        plan = self.disk.prepare_store([*ancestors, *keys])
        if plan is not None and plan.keys_to_store:
            self.disk.complete_store(plan.keys_to_store, True)
            repaired = set(ancestors).intersection(plan.keys_to_store)
            self.keys_repaired += len(repaired)
            self.bytes_repaired += self.disk._size(repaired)

    def held(self, key: bytes) -> bool:
        """The CPU tier holds ``key`` (stored or promoted, not in flight)."""
        if self.lru is None:
            return key in self.cpu
        return self.lru.lookup(key) is LookupResult.HIT

    def missing_ancestors(self, keys: Sequence[bytes]) -> tuple[bytes, ...]:
        """What repair writes before a cascade of ``keys``: the keys a lookup from token 0
        needs before them, per group, that the disk lacks and the CPU tier holds, in prefix
        order (end token, then group).  The needed keys are, for each full-attention key of
        ``keys``, every earlier chunk of its group in its prefix (its parent chain); for
        each boundary ``keys`` end (their full-attention keys') or serve (their window
        keys'), the parent chains of its full-attention keys and its window keys.  A chain
        or a boundary is repaired only when every key it needs is on disk, in ``keys`` or
        held by the CPU tier (else the repaired keys would arrive stranded)."""
        s = self.disk.structure
        on_disk = self.disk.disk.file_of
        incoming = set(keys)

        def available(k: bytes) -> bool:
            return k in on_disk or k in incoming or self.held(k)

        def chain(key: bytes) -> list[bytes] | None:
            """``key``'s earlier chunks of its group (None: its prefix is not recorded)."""
            out: list[bytes] = []
            node = s.parent.get(key, b"")
            while node:
                out.append(node)
                node = s.parent.get(node, b"")
            return None if node == b"" else out

        wanted: dict[bytes, None] = {}

        def want(needed: list[bytes]) -> None:
            if all(available(k) for k in needed):
                wanted.update(dict.fromkeys(needed))

        boundaries: dict[bytes, None] = {}
        for key in keys:
            if s.is_full(key):
                links = chain(key)
                if links is not None:
                    want(links)
                boundary = split_key(key)[0]
                if boundary in s.full_at:
                    boundaries[boundary] = None
            else:
                boundaries.update(dict.fromkeys(s.serves.get(key, ())))
        for b in boundaries:
            needed: list[bytes] = [*s.windows_at[b]]
            for k in s.full_at[b]:
                links = chain(k)
                if links is None:
                    break
                needed += [k, *links]
            else:
                want(needed)
        missing = [k for k in wanted if k not in on_disk and k not in incoming]
        return tuple(sorted(missing, key=lambda k: (s.end_token.get(k, 0), split_key(k)[1])))

    def prepare_load(self, keys: Sequence[bytes]) -> object:
        self.finish_promotions()
        if self.lru is not None:
            self.lru.prepare_load(list(dict.fromkeys(keys)), self._ctx())
            return None
        from_disk = [k for k in dict.fromkeys(keys) if k not in self.cpu]
        if from_disk:
            self.disk.prepare_load(from_disk)
            self.disk.complete_load(from_disk)
            self.cpu.update(from_disk)
        return None

    def complete_load(self, keys: Sequence[bytes]) -> None:
        if self.lru is not None:
            self.lru.complete_load(list(dict.fromkeys(keys)))
        return None

    def reset(self) -> None:
        """The CPU tier is reset; the disk keeps its files."""
        self.finish_promotions()
        self.cpu.clear()
        self._pending.clear()
        if self.lru is not None:
            self.lru.reset()


class PromotingPlanner(Planner):
    """:class:`~reference.plan.Planner` over a :class:`TieredIndex`: a lookup starts after
    the promotions of the step before landed, and one deferred on the promotions it
    started is asked again once they landed (vLLM's scheduler asks again next step), at
    most :data:`MAX_LOOKUP_ROUNDS` times."""

    store: TieredIndex

    def lookup(self, req_id: str, *args: Any, **kwargs: Any) -> int | None:
        self.store.finish_promotions()
        out = self._asked(req_id, *args, **kwargs)
        rounds = 1
        while out is None and self.store.promoting:
            if rounds == MAX_LOOKUP_ROUNDS:
                self.store.lookups_abandoned += 1
                return 0
            self.store.finish_promotions()
            out = self._asked(req_id, *args, **kwargs)
            rounds += 1
        return out

    def _asked(self, req_id: str, *args: Any, **kwargs: Any) -> int | None:
        """One lookup; with a bounded CPU tier, deferred (None) when a chunk of its hit is no
        longer held: a promotion the same lookup started evicted it after the CPU tier
        answered HIT for it (vLLM's ``prepare_load`` would assert on it)."""
        out = super().lookup(req_id, *args, **kwargs)
        lru = self.store.lru
        if not out or lru is None:
            return out
        req = self._requests[req_id]
        computed = req.computed_tokens
        for gc, state in zip(self.chunking.groups, req.groups, strict=True):
            for k in needed_chunks(gc, computed, computed + out, self.policy.window):
                if lru.lookup(state.keys[k]) is not LookupResult.HIT:
                    self.store.hits_evicted_by_promotions += 1
                    return None
        return out


class PromotingEngine(Engine):
    """:class:`~reference.economics.Engine` over a :class:`TieredIndex` through a
    :class:`PromotingPlanner`.  A shared-prefix junction comes from a lookup whose
    full-attention scan promoted nothing: vLLM's connector proves no full-attention
    boundary (``full_attention_hit_boundary`` 0) when that scan found a chunk pending,
    and a lookup that is not deferred is not asked again.  With a bounded CPU tier the
    junction's own scan starts no promotion (vLLM's connector finds the junction within
    the lookup, not by looking up again), and each request's positions and end reach
    the CPU tier's recency."""

    index: TieredIndex

    def __init__(self, chunking: Chunking, policy: Policy, budget: int, index: TieredIndex) -> None:
        super().__init__(chunking, policy, budget, index)
        self.planner = PromotingPlanner(chunking, index, policy)

    def _junction(self, hashes: Sequence[bytes], n: int, computed: int, hit: int) -> int | None:
        if self.index.promoting_full():
            return None
        if self.index.lru is None:
            return super()._junction(hashes, n, computed, hit)
        self.index.probing = True
        try:
            return super()._junction(hashes, n, computed, hit)
        finally:
            self.index.probing = False

    def serve(self, req: WorkloadRequest, all_hashes: Sequence[bytes],
              req_id: str | None = None) -> None:
        self.index.begin_request(self.chunking, all_hashes)
        super().serve(req, all_hashes, req_id)
        self.index.end_request()
