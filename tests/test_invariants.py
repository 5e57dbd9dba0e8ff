"""conformance.protocol.invariants: each check on small hand-built traces, holding and violated.

One full-attention group, 16 tokens a block, one block a chunk (a chunk = 16 tokens,
one hash unit): request ``a`` stores a 48-token prompt (3 chunks), the GPU prefix cache
is reset, ``b`` sends the same prompt and loads it.  Expected values follow from the
rules' statements (worked in comments), not from the code.
"""

from __future__ import annotations

from dataclasses import replace

from conformance.protocol import invariants as I
from conformance.protocol import trace as T
from conformance.protocol.replay import recorded_answers
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.jobs import LoadJob, StoreJob
from reference.keys import make_key, prefix_block_hashes
from reference.knobs import resolve_extra_config

PROMPT = tuple(range(48))
HASHES = tuple(prefix_block_hashes(PROMPT, 16))
KEYS = tuple(make_key(h, 0) for h in HASHES)
CONFIG = T.TraceConfig(
    connector="hand", groups=(T.TraceGroup(0, "FullAttentionSpec", GroupKind.FULL, 16, True),),
    tokens_per_hash=16, scheduler_block_size=16, blocks_per_chunk=1,
    extra_config=(("blocks_per_chunk", 1),), prefix_cache_retention_interval=0,
    num_gpu_blocks=64, num_cpu_chunks=64, max_num_batched_tokens=2048, max_model_len=4096,
)


def _meta(step: int, offers: tuple[T.StoreOffer, ...] = (), jobs: tuple[T.StoreJobRecord, ...] = (),
          finished: tuple[str, ...] = ()) -> T.BuildMeta:
    return T.BuildMeta(step, (), finished, (), (), (), (), offers, jobs, (), ())


def _request(step: int, req_id: str, hit: int, load: T.LoadJobRecord | None) -> list[T.Record]:
    blocks = tuple(T.BlockRef(10 * step + i, False, False) for i in range(3))
    return [
        T.NewRequest(step, req_id, 48, None, PROMPT),
        T.Lookup(step, req_id, 48, 48, HASHES, 0, None, False, hit, hit > 0),
        T.Alloc(step, req_id, (blocks,), hit, load),
    ]


def _load(job_id: int, req_id: str, keys: tuple[bytes, ...]) -> T.LoadJobRecord:
    n = len(keys)
    return T.LoadJobRecord(job_id, LoadJob(req_id, 0, 16 * n, keys, tuple(range(n)), (n,), (0,)))


def _trace(b_hit: int = 48, b_keys: tuple[bytes, ...] = KEYS, between: tuple[T.Record, ...] = (),
           after: tuple[T.Record, ...] = ()) -> T.Trace:
    """``a`` stores PROMPT (job 0, done), finishes; GPU reset; ``between``; ``b`` loads."""
    store = T.StoreJobRecord(0, StoreJob("a", KEYS, (1, 2, 3), (3,), (0,)))
    records: list[T.Record] = [
        *_request(0, "a", 0, None),
        _meta(0, (T.StoreOffer("a", KEYS, KEYS),), (store,)),
        T.JobsDone(1, (T.JobDone(0),)),
        T.RequestFinished(1, "a", "finished_length_capped", 48, 49, HASHES),
        _meta(2, finished=("a",)),
        T.ResetPrefixCache(3, False, False, True, False),
        *between,
        *_request(4, "b", b_hit, _load(1, "b", b_keys) if b_hit else None),
        _meta(4),
        *after,
    ]
    return T.Trace(CONFIG, tuple(records))


def _check(trace: T.Trace) -> list[str]:
    return I.all_violations(trace, recorded_answers(trace))


def test_a_stored_prompt_reloaded_whole_holds_every_invariant() -> None:
    trace = _trace()
    assert _check(trace) == []
    # The promise was checked: b extends a's stored prompt; full attention only, so
    # the last token is not held back and every 16-token chunk end counts: 48.
    [promise] = I.promises(trace, recorded_answers(trace))
    assert (promise.lookup.req_id, promise.source, promise.promised, promise.end) == ("b", "a", 48, 48)


def test_a_hit_short_of_the_promise_is_named() -> None:
    [v] = I.promised_hit_violations(*_with_answers(_trace(b_hit=32, b_keys=KEYS[:2])))
    assert v.startswith("promised-hit: [step 4] b") and "hit 32 tokens" in v
    assert "a's stored 48-token prompt promises an end at 48" in v


def test_no_promise_after_an_eviction() -> None:
    evict = _meta(3, (T.StoreOffer("x", (), (), (KEYS[2],)),))
    trace = _trace(b_hit=32, b_keys=KEYS[:2], between=(evict,))
    assert I.promises(trace, recorded_answers(trace)) == []


def test_a_load_of_an_unstored_evicted_or_reset_key_is_named() -> None:
    stranger = make_key(b"\x07" * 32, 0)
    [v] = I.load_reads_stored_violations(*_with_answers(_trace(b_keys=(*KEYS[:2], stranger))))
    assert v == f"load-reads-stored: [step 4] load of b reads {T.short_key(stranger)}, never stored"
    evict = _meta(3, (T.StoreOffer("x", (), (), (KEYS[1],)),))
    [v] = I.load_reads_stored_violations(*_with_answers(_trace(between=(evict,))))
    assert v.endswith(f"reads {T.short_key(KEYS[1])}, evicted at step 3")
    reset = T.ResetPrefixCache(3, False, True, True, True)
    vs = I.load_reads_stored_violations(*_with_answers(_trace(between=(reset,))))
    assert vs == [f"load-reads-stored: [step 4] load of b reads {T.short_key(k)}, connector "
                  "reset at step 3" for k in KEYS]


def test_a_load_of_a_key_still_being_stored_is_named() -> None:
    trace = _trace()
    done = next(i for i, r in enumerate(trace.records) if isinstance(r, T.JobsDone))
    late = replace(trace, records=trace.records[:done] + trace.records[done + 1:])
    vs = I.load_reads_stored_violations(late, recorded_answers(late))
    assert len(vs) == 3 and all(v.endswith("still being stored") for v in vs)


def test_a_later_hit_ending_earlier_on_more_stored_keys_is_named() -> None:
    # c sends the same prompt after b, nothing removed, and ends at 32, before b's 48.
    later = (T.ResetPrefixCache(5, False, False, True, False), *_request(6, "c", 32, _load(2, "c", KEYS[:2])))
    [v] = I.monotonic_hit_violations(*_with_answers(_trace(after=later)))
    assert v == ("monotonic-hit: [step 6] c (48 tokens) ends at 32, before b (48 tokens, step 4) "
                 "at 48, though it holds 0 more keys and extends its prefix")


def test_one_key_for_two_chunks_or_two_keys_for_one_chunk_is_named() -> None:
    # b's load reads chunk 0's key again for chunk 1 (positions name chunks 0, 1, 2).
    [v] = I.injective_key_violations(*_with_answers(_trace(b_keys=(KEYS[0], KEYS[0], KEYS[2]))))
    assert v == (f"injective-keys: [step 4] {T.short_key(KEYS[0])} names group 0 chunk-end "
                 f"{HASHES[1][:4].hex()} and group 0 chunk-end {HASHES[0][:4].hex()}")
    # c reads chunk 2 under another key than b did.
    other = make_key(b"\x09" * 32, 0)
    later = (*_request(6, "c", 48, _load(2, "c", (*KEYS[:2], other))),)
    vs = I.injective_key_violations(*_with_answers(_trace(after=later)))
    assert f"injective-keys: [step 6] group 0 chunk 2 read as {T.short_key(other)} and as " \
           f"{T.short_key(KEYS[2])}" in vs


def test_a_key_serving_two_groups_is_named() -> None:
    two = replace(CONFIG, groups=(*CONFIG.groups, T.TraceGroup(1, "FullAttentionSpec", GroupKind.FULL, 16, True)))
    load = T.LoadJobRecord(1, LoadJob("b", 0, 16, (KEYS[0], KEYS[0]), (4, 5), (1, 1), (0, 0)))
    blocks = (tuple(T.BlockRef(i, False, False) for i in range(3)),) * 2
    new, lookup, _ = _request(4, "b", 16, None)
    trace = T.Trace(two, (new, lookup, T.Alloc(4, "b", blocks, 16, load)))
    vs = I.injective_key_violations(trace, recorded_answers(trace))
    assert f"injective-keys: [step 4] load of b: {T.short_key(KEYS[0])} serves group 1 and group 0" in vs


def test_promised_end_by_hand() -> None:
    # FA 64 tokens a block + SW 128 at 16, 2 blocks a chunk: spans 128 and 32, alignment 128.
    geometry = Geometry((KVGroup(0, GroupKind.FULL, 64),
                         KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=128)), 16)
    for retention in (0, None):
        chunking = resolve_extra_config(geometry, {"blocks_per_chunk": 2}, retention)
        # 300 tokens: the last recomputed, 299 -> 256; the window's 127 tokens before 256
        # are chunks 4-7 (< 300 // 32 = 9 complete), the full group's 0-1 (< 2): 256.
        assert I.promised_end(chunking, retention, 300, 300, 0, None) == 256
        # 256 tokens: 255 -> 128 (chunk end 256 would include the last token).
        assert I.promised_end(chunking, retention, 256, 256, 0, None) == 128
        # A GPU hit of 200: 256 is less than a 128-token chunk past it, no promise.
        assert I.promised_end(chunking, retention, 300, 300, 200, None) == 0
        # A step budget of 200 tokens caps the hit at 200 -> 128 dense; sparse keeps
        # only the window before 256, so nothing is promised.
        assert I.promised_end(chunking, retention, 300, 300, 0, 200) == (0 if retention == 0 else 128)
        # Mamba-style state ends: only an end a state was handed off at is promised.
        assert I.promised_end(chunking, retention, 300, 300, 0, None, {128}) == (0 if retention == 0 else 128)


def _with_answers(trace: T.Trace) -> tuple[T.Trace, list]:  # type: ignore[type-arg]
    return trace, recorded_answers(trace)
