"""reference.store: vLLM's CPU-manager semantics, by example, against a model, and against vLLM."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from reference.store import ChunkStore, LookupResult, StorePlan
from reference.transfer import TensorRef, TransferLayout, gather, scatter

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
KEYS = [bytes([i]) * 4 + i.to_bytes(4, "big") for i in range(8)]
A, B, C, D, E, F, G, H = KEYS


def stored(store: ChunkStore, keys: list[bytes]) -> StorePlan:
    """prepare_store + complete_store, asserting the store accepted the offer."""
    plan = store.prepare_store(keys)
    assert plan is not None
    store.complete_store(plan.keys_to_store)
    return plan


def snapshot(store: ChunkStore) -> tuple[Any, ...]:
    return (
        store.lru_order(),
        tuple((k, store.lookup(k), store.slot_of(k), store.ref_count(k)) for k in KEYS),
        store.num_free_slots,
        store.generation,
    )


# ---------------------------------------------------------------------------
# Examples: vLLM's documented behaviour
# ---------------------------------------------------------------------------


def test_fresh_slots_first_then_last_freed_first() -> None:
    store = ChunkStore(4)
    assert stored(store, [A, B, C, D]).slot_ids == (0, 1, 2, 3)
    # full: evict the two least recent (A then B), so free = [0, 1]; pop() gives 1 first
    plan = store.prepare_store([E, F])
    assert plan == StorePlan((E, F), (1, 0), (A, B))
    store.complete_store([E], success=False)  # frees slot 1 again
    store.complete_store([F])
    plan = store.prepare_store([G, H])  # 1 free (slot 1), evict C (slot 2): free = [1, 2]
    assert plan == StorePlan((G, H), (2, 1), (C,))


def test_fresh_ids_are_used_before_freed_ones() -> None:
    store = ChunkStore(3)
    stored(store, [A])
    assert store.prepare_store([B]) == StorePlan((B,), (1,), ())
    store.complete_store([B], success=False)
    # slot 1 is free, but fresh slot 2 comes first
    assert store.prepare_store([C, D]) == StorePlan((C, D), (2, 1), ())


def test_touch_makes_first_key_most_recent() -> None:
    store = ChunkStore(3)
    stored(store, [A, B, C])
    assert store.lru_order() == (A, B, C)  # offer order: A least recent
    store.touch([A, B, H])  # H absent: ignored
    assert store.lru_order() == (C, B, A)
    assert store.prepare_store([D]) == StorePlan((D,), (2,), (C,))
    assert store.prepare_store([E]) == StorePlan((E,), (1,), (B,))


def test_offered_keys_are_never_evicted_by_their_own_offer() -> None:
    store = ChunkStore(2)
    stored(store, [A, B])
    plan = store.prepare_store([A, C])  # A is least recent but offered: B goes
    assert plan == StorePlan((C,), (1,), (B,))
    assert store.lookup(A) is HIT


def test_held_keys_are_dropped_and_empty_offer_is_not_none() -> None:
    store = ChunkStore(2)
    stored(store, [A])
    assert store.prepare_store([B]) == StorePlan((B,), (1,), ())
    # store is full and B is still pending: an offer of only held keys is an empty plan
    assert store.prepare_store([A, B]) == StorePlan((), (), ())
    assert store.prepare_store([]) == StorePlan((), (), ())


def test_pending_and_loading_entries_are_not_evicted_and_none_changes_nothing() -> None:
    store = ChunkStore(3)
    stored(store, [A, B])
    assert store.prepare_store([C]) == StorePlan((C,), (2,), ())  # C pending
    assert store.prepare_load([A]) == (0,)  # A pinned
    before = snapshot(store)
    assert store.prepare_store([D, E]) is None  # needs 2, only B is evictable
    assert snapshot(store) == before
    assert store.prepare_store([D]) == StorePlan((D,), (1,), (B,))
    store.complete_load([A])
    assert store.prepare_store([E]) == StorePlan((E,), (0,), (A,))


def test_failed_store_is_visible_to_nobody() -> None:
    store = ChunkStore(2)
    plan = store.prepare_store([A, B])
    assert plan is not None and store.lookup(A) is PENDING
    with pytest.raises(ValueError):
        store.prepare_load([A])
    store.complete_store([A], success=False)
    store.complete_store([B])
    assert store.lookup(A) is MISS and store.lookup(B) is HIT
    with pytest.raises(ValueError):
        store.prepare_load([A])
    store.complete_store([A, B])  # neither pending: ignored
    assert store.lookup(A) is MISS
    assert store.prepare_store([C]) == StorePlan((C,), (0,), ())  # A's slot reused


def test_ref_counts_per_occurrence() -> None:
    store = ChunkStore(1)
    stored(store, [A])
    assert store.prepare_load([A, A]) == (0, 0)
    assert store.ref_count(A) == 2 and store.num_pinned == 1
    store.complete_load([A])
    assert store.prepare_store([B]) is None
    with pytest.raises(ValueError):
        store.complete_load([A, A])
    store.complete_load([A])
    assert store.prepare_store([B]) == StorePlan((B,), (0,), (A,))


def test_reset_forgets_everything_and_restarts_slot_ids() -> None:
    store = ChunkStore(3)
    stored(store, [A, B])
    store.prepare_store([C])
    store.prepare_load([A])
    store.reset()
    assert all(store.lookup(k) is MISS for k in KEYS)
    assert store.num_entries == 0 and store.num_free_slots == 3 and store.generation == 1
    store.complete_store([C])  # a pre-reset completion: ignored
    assert store.lookup(C) is MISS
    with pytest.raises(ValueError):
        store.complete_load([A])
    assert store.prepare_store([D, E]) == StorePlan((D, E), (0, 1), ())
    store.check_invariants()


def test_misuse_raises_and_changes_nothing() -> None:
    store = ChunkStore(2)
    stored(store, [A])
    store.prepare_store([B])
    before = snapshot(store)
    for call in (
        lambda: store.prepare_store([C, C]),
        lambda: store.prepare_store(["C"]),  # type: ignore[list-item]  # not bytes
        lambda: store.prepare_load([A, B]),  # B pending
        lambda: store.prepare_load([A, C]),  # C absent
        lambda: store.complete_load([A]),  # not loading
    ):
        with pytest.raises(ValueError):
            call()
        assert snapshot(store) == before
    with pytest.raises(ValueError):
        ChunkStore(-1)


def test_counters() -> None:
    store = ChunkStore(4)
    stored(store, [A, B])
    store.prepare_store([C])
    store.prepare_load([A])
    assert (store.num_entries, store.num_ready, store.num_pending_stores) == (3, 2, 1)
    assert (store.num_pinned, store.num_evictable, store.num_free_slots) == (1, 1, 1)


def test_zero_slots() -> None:
    store = ChunkStore(0)
    assert store.prepare_store([A]) is None
    assert store.prepare_store([]) == StorePlan((), (), ())


def test_pool_with_transfer_round_trip() -> None:
    layout = TransferLayout.uniform((16, 8), [[TensorRef(0, 16), TensorRef(1, 8)]], 2)
    store = ChunkStore(3, layout.slot_bytes)
    assert store.pool is not None
    assert store.pool.shape == (3, layout.slot_bytes) and store.pool.dtype == torch.uint8
    gpu = [torch.randint(0, 256, (6, p), dtype=torch.uint8) for p in layout.page_bytes]
    plan = store.prepare_store([A, B])
    assert plan is not None
    gather(layout, gpu, store.pool, [4, 5, 1], [3], [1], list(plan.slot_ids))
    store.complete_store(plan.keys_to_store)
    dst = [torch.zeros_like(g) for g in gpu]
    scatter(layout, dst, store.pool, [2, 3, 0], [3], [1], list(store.prepare_load([A, B])))
    store.complete_load([A, B])
    for g, d in zip(gpu, dst, strict=True):
        assert torch.equal(d[[2, 3, 0]], g[[4, 5, 1]])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_pinned_pool() -> None:
    store = ChunkStore(2, 64, pin_memory=True)
    assert store.pool is not None and store.pool.is_pinned()


# ---------------------------------------------------------------------------
# Rule-based: the store against a plain model
# ---------------------------------------------------------------------------


@dataclass
class ModelEntry:
    slot: int
    ready: bool
    refs: int
    stamp: int


@dataclass
class Model:
    """What the store should hold: entries with a recency stamp, and a slot allocator."""

    num_slots: int
    entries: dict[bytes, ModelEntry] = field(default_factory=dict)
    clock: int = 0
    fresh: int = 0
    freed: list[int] = field(default_factory=list)
    failed: set[bytes] = field(default_factory=set)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def evictable(self, exclude: set[bytes]) -> list[bytes]:
        """Evictable keys, least recent first."""
        keys = [k for k, e in self.entries.items() if e.ready and e.refs == 0 and k not in exclude]
        return sorted(keys, key=lambda k: self.entries[k].stamp)

    def take_slot(self) -> int:
        if self.fresh < self.num_slots:
            self.fresh += 1
            return self.fresh - 1
        return self.freed.pop()


class StoreMachine(RuleBasedStateMachine):
    store: ChunkStore
    model: Model

    @initialize(num_slots=st.integers(0, 5))
    def start(self, num_slots: int) -> None:
        self.store = ChunkStore(num_slots)
        self.model = Model(num_slots)

    @rule(keys=st.lists(st.sampled_from(KEYS), unique=True, max_size=5))
    def prepare_store(self, keys: list[bytes]) -> None:
        m = self.model
        before = snapshot(self.store)
        plan = self.store.prepare_store(keys)
        to_store = [k for k in keys if k not in m.entries]
        free = m.num_slots - len(m.entries)
        candidates = m.evictable(exclude=set(keys))
        need = max(0, len(to_store) - free)
        if to_store and need > len(candidates):
            event("model: store refused")
            assert plan is None
            assert snapshot(self.store) == before  # all or nothing
            return
        assert plan is not None
        event(f"model: store evicted {len(plan.evicted_keys)}")
        assert plan.keys_to_store == tuple(to_store)
        assert plan.evicted_keys == tuple(candidates[:need])
        for k in plan.evicted_keys:
            m.freed.append(m.entries.pop(k).slot)
        expected_slots = tuple(m.take_slot() for _ in to_store)
        assert plan.slot_ids == expected_slots
        live = {e.slot for e in m.entries.values()}
        assert not live & set(plan.slot_ids)
        for k, s in zip(to_store, expected_slots, strict=True):
            m.entries[k] = ModelEntry(s, ready=False, refs=0, stamp=m.tick())
            m.failed.discard(k)

    def pending(self) -> list[bytes]:
        return sorted(k for k, e in self.model.entries.items() if not e.ready)

    @precondition(lambda self: self.pending())
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        keys = data.draw(st.lists(st.sampled_from(self.pending()), min_size=1, unique=True))
        self._complete_store(keys, success)

    @rule(keys=st.lists(st.sampled_from(KEYS), unique=True, max_size=4), success=st.booleans())
    def complete_store_any_keys(self, keys: list[bytes], success: bool) -> None:
        """Keys that are not pending are ignored."""
        self._complete_store(keys, success)

    def _complete_store(self, keys: list[bytes], success: bool) -> None:
        self.store.complete_store(keys, success=success)
        for k in keys:
            e = self.model.entries.get(k)
            if e is None or e.ready:
                continue
            if success:
                e.ready = True
            else:
                del self.model.entries[k]
                self.model.freed.append(e.slot)
                self.model.failed.add(k)

    def ready(self) -> list[bytes]:
        return sorted(k for k, e in self.model.entries.items() if e.ready)

    @precondition(lambda self: self.ready())
    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(self.ready()), min_size=1, max_size=4))
        self._prepare_load(keys)

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=4))
    def prepare_load_any_keys(self, keys: list[bytes]) -> None:
        """Loading a key that is not ready raises, and changes nothing."""
        self._prepare_load(keys)

    def _prepare_load(self, keys: list[bytes]) -> None:
        if all(k in self.ready() for k in keys):
            slots = self.store.prepare_load(keys)
            assert slots == tuple(self.model.entries[k].slot for k in keys)
            for k in keys:
                self.model.entries[k].refs += 1
        else:
            before = snapshot(self.store)
            with pytest.raises(ValueError):
                self.store.prepare_load(keys)
            assert snapshot(self.store) == before

    @precondition(lambda self: any(e.refs for e in self.model.entries.values()))
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        pinned = sorted(k for k, e in self.model.entries.items() if e.refs)
        keys = data.draw(st.lists(st.sampled_from(pinned), min_size=1, unique=True))
        self.store.complete_load(keys)
        for k in keys:
            self.model.entries[k].refs -= 1

    @rule(keys=st.lists(st.sampled_from(KEYS), max_size=5))
    def touch(self, keys: list[bytes]) -> None:
        self.store.touch(keys)
        for k in reversed(keys):
            if k in self.model.entries:
                self.model.entries[k].stamp = self.model.tick()

    @rule()
    def reset(self) -> None:
        self.store.reset()
        self.model = Model(self.model.num_slots, failed=self.model.failed)

    @invariant()
    def agrees_with_model(self) -> None:
        store, m = self.store, self.model
        store.check_invariants()
        for k in KEYS:
            e = m.entries.get(k)
            expected = MISS if e is None else HIT if e.ready else PENDING
            assert store.lookup(k) is expected
            assert store.slot_of(k) == (None if e is None else e.slot)
            assert store.ref_count(k) == (0 if e is None else e.refs)
            if k in m.failed:
                assert expected is MISS  # a failed store is never loadable
        assert store.lru_order() == tuple(sorted(m.entries, key=lambda k: m.entries[k].stamp))
        slots = [e.slot for e in m.entries.values()]
        assert len(slots) == len(set(slots))
        assert store.num_entries == len(m.entries)
        assert store.num_pinned == sum(e.refs > 0 for e in m.entries.values())
        assert store.num_pending_stores == sum(not e.ready for e in m.entries.values())
        assert store.num_free_slots == m.num_slots - len(m.entries)


StoreMachine.TestCase.settings = settings(
    settings.default, max_examples=max(10, settings.default.max_examples // 2)
)
test_store_against_model = StoreMachine.TestCase


# ---------------------------------------------------------------------------
# Differential: the same operations on vLLM's CPUOffloadingManager
# ---------------------------------------------------------------------------

_HAVE_VLLM = importlib.util.find_spec("vllm") is not None
MOSTLY = st.sampled_from([True, True, True, False])
# Weighted so that entries complete (become evictable) and stores evict often enough to compare.
OPS = (
    ["store"] * 6
    + ["complete"] * 6
    + ["fail", "load", "load", "unload", "unload", "touch", "touch", "lookup", "reset"]
)


@pytest.mark.vllm
@pytest.mark.skipif(not _HAVE_VLLM, reason="vllm is not importable")
@given(num_slots=st.integers(0, 6), data=st.data())
def test_matches_vllm_cpu_manager(num_slots: int, data: st.DataObject) -> None:
    """vLLM's manager with the "lru" policy, constructed on CPU as ``CPUOffloadingSpec`` does.

    Request contexts carry no key positions, so vLLM ranks keys position-free,
    which is what the reference models (see reference.store's docstring).
    """
    from vllm.v1.kv_offload.base import LookupResult as VLookup
    from vllm.v1.kv_offload.base import OffloadKey, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    vllm = CPUOffloadingManager(num_chunks=num_slots, cache_policy="lru")
    ref = ChunkStore(num_slots)
    contexts = [ReqContext(req_id=f"req-{i}") for i in range(3)]
    to_ref = {VLookup.MISS: MISS, VLookup.HIT: HIT, VLookup.HIT_PENDING: PENDING}

    def ctx() -> ReqContext:
        return contexts[data.draw(st.integers(0, len(contexts) - 1), label="request")]

    def slot_ids(spec: Any) -> tuple[int, ...]:
        return tuple(int(s) for s in spec.block_ids)  # a CPULoadStoreSpec

    def keys_where(pred: Any) -> list[bytes]:
        return [k for k in KEYS if pred(k)]

    def vllm_touch(keys: list[bytes], req_context: ReqContext) -> None:
        okeys = [OffloadKey(k) for k in keys]
        if hasattr(vllm, "touch"):  # vLLM 0.33.0
            vllm.touch(okeys, req_context)
            return
        # vLLM 0.34.0 removed OffloadingManager.touch (and CachePolicy.touch); the
        # scheduler never called it.  The same re-ranking (walk the keys in reverse,
        # each becoming most recent) is what remains of it: the LRU policy's
        # on_request_finished for one key group without recorded positions, which
        # the manager calls at request end with the request's keys.
        vllm._policy.on_request_finished([okeys], set(), set(), req_context)

    # In-flight jobs, completed whole, as the scheduler does (plus stray completions).
    store_jobs: list[tuple[bytes, ...]] = []
    load_jobs: list[tuple[bytes, ...]] = []

    def pop_job(jobs: list[tuple[bytes, ...]]) -> tuple[bytes, ...]:
        return jobs.pop(data.draw(st.integers(0, len(jobs) - 1), label="job"))

    for _ in range(data.draw(st.integers(5, 30), label="steps")):
        op = data.draw(st.sampled_from(OPS), label="op")
        if op == "store":
            # mostly keys not held yet, as the scheduler offers them
            fresh = keys_where(lambda k: ref.lookup(k) is MISS)
            pool = fresh if fresh and data.draw(MOSTLY, label="fresh only") else KEYS
            keys = data.draw(st.lists(st.sampled_from(pool), unique=True, min_size=1, max_size=4))
            out = vllm.prepare_store([OffloadKey(k) for k in keys], ctx())
            plan = ref.prepare_store(keys)
            event(
                "store refused"
                if plan is None
                else f"store evicted {len(plan.evicted_keys)}, stored {len(plan.keys_to_store)}"
            )
            if out is None or plan is None:
                assert out is None and plan is None
            else:
                assert tuple(out.keys_to_store) == plan.keys_to_store
                assert slot_ids(out.store_spec) == plan.slot_ids
                assert tuple(out.evicted_keys) == plan.evicted_keys
                if plan.keys_to_store:
                    store_jobs.append(plan.keys_to_store)
        elif op in ("complete", "fail"):
            if store_jobs and data.draw(MOSTLY, label="whole job"):
                keys = list(pop_job(store_jobs))
            else:  # any keys: those not pending are ignored
                keys = data.draw(st.lists(st.sampled_from(KEYS), unique=True, max_size=4))
            vllm.complete_store([OffloadKey(k) for k in keys], ctx(), success=op == "complete")
            ref.complete_store(keys, success=op == "complete")
        elif op == "load":
            ready = keys_where(lambda k: ref.lookup(k) is HIT)
            if not ready:
                continue
            keys = data.draw(st.lists(st.sampled_from(ready), min_size=1, max_size=4))
            spec = vllm.prepare_load([OffloadKey(k) for k in keys], ctx())
            assert slot_ids(spec) == ref.prepare_load(keys)
            load_jobs.append(tuple(keys))
        elif op == "unload":
            if not load_jobs:
                continue
            keys = list(pop_job(load_jobs))
            vllm.complete_load([OffloadKey(k) for k in keys], ctx())
            ref.complete_load(keys)
        elif op == "touch":
            keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=5))
            vllm_touch(keys, ctx())
            ref.touch(keys)
        elif op == "reset":
            # the scheduler drops pre-reset jobs' completions
            vllm.reset_cache()
            ref.reset()
            store_jobs.clear()
            load_jobs.clear()
        for k in KEYS:
            assert to_ref[vllm.lookup(OffloadKey(k), ctx())] is ref.lookup(k), k
        assert vllm._num_evictable_cache_chunks == ref.num_evictable
        assert vllm._num_write_pending_chunks == ref.num_pending_stores
        ref.check_invariants()


def test_evict_drops_only_ready_unpinned_entries() -> None:
    store = ChunkStore(2)
    plan = store.prepare_store([b"a", b"b"])
    assert plan is not None
    with pytest.raises(ValueError, match="not evictable"):
        store.evict(b"a")  # still pending
    store.complete_store([b"a", b"b"])
    store.prepare_load([b"b"])
    with pytest.raises(ValueError, match="not evictable"):
        store.evict(b"b")  # pinned by a load
    store.evict(b"a")
    assert store.lookup(b"a") is LookupResult.MISS
    with pytest.raises(ValueError, match="not held"):
        store.evict(b"a")
    store.check_invariants()
    again = store.prepare_store([b"c"])
    assert again is not None and again.slot_ids == plan.slot_ids[:1]  # the freed slot
