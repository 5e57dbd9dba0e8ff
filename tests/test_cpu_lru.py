"""reference.cpu_lru: vLLM's CPU tier with request-scoped LRU, by example and against vLLM."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from reference.cpu_lru import CpuLru, RequestContext
from reference.store import LookupResult

HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
SPAN = 16
"""Tokens per chunk of every group here."""
GROUPS = (0, 1)
CHUNKS = 4


def key(chunk: int, group: int, branch: int = 0) -> bytes:
    """Chunk ``chunk`` of ``group`` on prefix ``branch`` (its end token: (chunk + 1) * SPAN)."""
    return bytes([branch, chunk]) * 4 + group.to_bytes(4, "big")


KEYS = [key(c, g, b) for b in (0, 1) for c in range(CHUNKS) for g in GROUPS]
POSITION = {k: (k[1] + 1) * SPAN for k in KEYS}


def ctx() -> RequestContext:
    return RequestContext(positions=POSITION)


def stored(lru: CpuLru, keys: list[bytes], c: RequestContext) -> tuple[bytes, ...]:
    plan = lru.prepare_store(keys, c)
    assert plan is not None
    lru.complete_store(plan.keys_to_store)
    return plan.evicted_keys


# ---------------------------------------------------------------------------
# Examples: the release's order
# ---------------------------------------------------------------------------


def test_a_live_request_evicts_its_tail_before_its_head() -> None:
    lru = CpuLru(4)
    r = ctx()
    stored(lru, [key(0, 0), key(1, 0), key(2, 0), key(3, 0)], r)
    # (rank, -position): the deepest key goes first while the request lives
    assert lru.eviction_order() == (key(3, 0), key(2, 0), key(1, 0), key(0, 0))
    assert stored(lru, [key(0, 0, 1)], ctx()) == (key(3, 0),)


def test_a_finished_request_keeps_its_head_longest_across_groups() -> None:
    lru = CpuLru(8)
    r = ctx()
    stored(lru, [key(c, g) for c in range(2) for g in GROUPS], r)
    lru.on_request_finished(r)
    # head to tail by position, ties by group; walked from the tail: the head ranks last
    assert lru.eviction_order() == (key(1, 1), key(1, 0), key(0, 1), key(0, 0))


def test_a_lookup_does_not_touch_a_rank_and_a_load_does() -> None:
    lru = CpuLru(2)
    first, second = ctx(), ctx()
    stored(lru, [key(0, 0)], first)
    lru.on_request_finished(first)
    stored(lru, [key(0, 0, 1)], second)
    lru.on_request_finished(second)
    assert lru.lookup(key(0, 0)) is HIT
    assert lru.eviction_order()[0] == key(0, 0)  # the lookup left it oldest
    third = ctx()
    lru.prepare_load([key(0, 0)], third)
    lru.complete_load([key(0, 0)])
    # the load ranked it with the third request, newer than the second's finish
    assert lru.eviction_order() == (key(0, 0, 1), key(0, 0))


def test_a_cascade_read_pins_without_touching_the_rank() -> None:
    lru = CpuLru(2)
    a, b = ctx(), ctx()
    stored(lru, [key(0, 0)], a)
    lru.on_request_finished(a)
    stored(lru, [key(0, 0, 1)], b)
    lru.on_request_finished(b)
    lru.prepare_load([key(0, 0)], None)  # a cascade to the disk
    assert lru.prepare_store([key(1, 0, 1)], ctx()).evicted_keys == (key(0, 0, 1),)  # type: ignore[union-attr]
    assert lru.prepare_store([key(2, 0, 1)], ctx()) is None  # the pinned one cannot go
    lru.complete_load([key(0, 0)])
    assert lru.eviction_order()[0] == key(0, 0)


def test_a_refused_store_changes_nothing_but_what_the_request_touched() -> None:
    lru = CpuLru(1)
    a = ctx()
    plan = lru.prepare_store([key(0, 0)], a)
    assert plan is not None  # pending: not evictable
    assert lru.prepare_store([key(1, 0)], ctx()) is None
    assert lru.lookup(key(0, 0)) is PENDING and lru.lookup(key(1, 0)) is MISS


def test_an_empty_tier_refuses_every_store() -> None:
    lru = CpuLru(0)
    assert lru.prepare_store([key(0, 0)], ctx()) is None
    assert lru.prepare_store([], ctx()) is not None


# ---------------------------------------------------------------------------
# Differential: the same calls on vLLM's CPUOffloadingManager ("lru")
# ---------------------------------------------------------------------------

_HAVE_VLLM = importlib.util.find_spec("vllm") is not None
OPS = ["store"] * 6 + ["complete"] * 5 + ["fail", "load", "load", "unload", "unload",
                                            "cascade", "finish", "finish", "reset"]


@pytest.mark.vllm
@pytest.mark.skipif(not _HAVE_VLLM, reason="vllm is not importable")
@given(num_slots=st.integers(0, 8), data=st.data())
def test_matches_vllm_cpu_manager_with_key_positions(num_slots: int, data: st.DataObject) -> None:
    """vLLM's manager with the "lru" policy, each request's context carrying its keys'
    end-token positions as the scheduler records them: the same plans, evictions (in
    order) and lookups, request after request."""
    from vllm.v1.kv_offload.base import LookupResult as VLookup
    from vllm.v1.kv_offload.base import OffloadKey, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    vllm = CPUOffloadingManager(num_chunks=num_slots, cache_policy="lru")
    ref = CpuLru(num_slots)
    to_ref = {VLookup.MISS: MISS, VLookup.HIT: HIT, VLookup.HIT_PENDING: PENDING}
    live: list[tuple[ReqContext, RequestContext]] = []
    made = 0

    def request() -> tuple[ReqContext, RequestContext]:
        nonlocal made
        if not live or data.draw(st.integers(0, 3), label="new request") == 0:
            made += 1
            v = ReqContext(req_id=f"r{made}")
            for k, p in POSITION.items():
                v.set_offload_key_position(OffloadKey(k), p)
            live.append((v, ctx()))
        return live[data.draw(st.integers(0, len(live) - 1), label="request")]

    store_jobs: list[tuple[Any, tuple[bytes, ...]]] = []
    loads: list[tuple[Any, tuple[bytes, ...]]] = []
    for _ in range(data.draw(st.integers(5, 40), label="steps")):
        op = data.draw(st.sampled_from(OPS), label="op")
        if op == "store":
            v, r = request()
            keys = data.draw(st.lists(st.sampled_from(KEYS), unique=True, min_size=1, max_size=4))
            out = vllm.prepare_store([OffloadKey(k) for k in keys], v)
            plan = ref.prepare_store(keys, r)
            event("refused" if plan is None else f"evicted {len(plan.evicted_keys)}")
            if out is None or plan is None:
                assert out is None and plan is None
            else:
                assert tuple(out.keys_to_store) == plan.keys_to_store
                assert tuple(out.evicted_keys) == plan.evicted_keys
                if plan.keys_to_store:
                    store_jobs.append((v, plan.keys_to_store))
        elif op in ("complete", "fail") and store_jobs:
            v, job = store_jobs.pop(data.draw(st.integers(0, len(store_jobs) - 1)))
            vllm.complete_store([OffloadKey(k) for k in job], v, success=op == "complete")
            ref.complete_store(job, success=op == "complete")
        elif op in ("load", "cascade"):
            ready = [k for k in KEYS if ref.lookup(k) is HIT]
            if not ready:
                continue
            keys = data.draw(st.lists(st.sampled_from(ready), unique=True, min_size=1, max_size=3))
            if op == "load":
                v, r = request()
                vllm.prepare_load([OffloadKey(k) for k in keys], v)
                ref.prepare_load(keys, r)
            else:  # the tiering manager's cascade read: record_access=False
                v = ReqContext(req_id="cascade")
                vllm._prepare_load([OffloadKey(k) for k in keys], v, record_access=False)
                ref.prepare_load(keys, None)
            loads.append((v, tuple(keys)))
        elif op == "unload" and loads:
            v, job = loads.pop(data.draw(st.integers(0, len(loads) - 1)))
            vllm.complete_load([OffloadKey(k) for k in job], v)
            ref.complete_load(job)
        elif op == "finish" and live:
            v, r = live.pop(data.draw(st.integers(0, len(live) - 1)))
            vllm.on_request_finished(v)
            ref.on_request_finished(r)
        elif op == "reset":
            vllm.reset_cache()
            ref.reset()
            store_jobs.clear()
            loads.clear()
        for k in KEYS:
            assert to_ref[vllm.lookup(OffloadKey(k), ReqContext(req_id="q"))] is ref.lookup(k), k
        assert vllm._num_evictable_cache_chunks == ref.num_evictable
        # the order the next evictions take
        order = sorted(vllm._policy._evictable, key=lambda k: (vllm._policy._ranks[k], k))
        assert tuple(bytes(k) for k in order) == ref.eviction_order()
