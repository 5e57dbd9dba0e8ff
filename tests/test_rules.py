"""reference.rules: each rule pinned by hand, and the Planner proved equal to the rules.

Hand examples derive their expected values from the rule's statement (worked in the
comments) or from vLLM-verified tables in the design notes, never from the code.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace

from hypothesis import Phase, assume, event, given, settings
from hypothesis import strategies as st

from conformance.harness.strategies import geometries
from reference import rules
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.keys import group_keys, prefix_block_hashes
from reference.knobs import (
    BlocksPerChunk,
    Chunking,
    GroupChunking,
    PerGroupBlocksPerChunk,
    resolve,
    supports_partial_tail,
)
from reference.plan import (
    LastTokenRule,
    NullBlockRule,
    Planner,
    Policy,
    ScheduledRequest,
    WindowRule,
)
from reference.store import ChunkStore, LookupResult

SW = GroupKind.SLIDING_WINDOW


def _gc(group: KVGroup, bpc: int) -> GroupChunking:
    tpc = group.tokens_per_block * bpc
    return GroupChunking(group, bpc, tpc, tpc, rules.window_in_chunks(group, tpc))


def _sw(window: int, tpb: int = 16, extra: int = 0, eagle: bool = False) -> KVGroup:
    return KVGroup(1, SW, tpb, sliding_window=window, extra_retained_tokens=extra, is_eagle=eagle)


# ---------------------------------------------------------------------------
# Rules by hand
# ---------------------------------------------------------------------------


def test_window_in_chunks() -> None:
    whole = rules.WindowRule.WHOLE_WINDOW
    # W=128, span 32: the 127 tokens before the end lie in cdiv(127, 32) = 4 chunks.
    assert rules.window_in_chunks(_sw(128), 32) == 4
    assert rules.window_in_chunks(_sw(128), 32, rule=whole) == 4  # max(cdiv(128,32), 4)
    # W=129: the 128 tokens before the end are 4 chunks; vLLM's rule asks cdiv(129,32)=5.
    assert rules.window_in_chunks(_sw(129), 32) == 4
    assert rules.window_in_chunks(_sw(129), 32, rule=whole) == 5
    # W=1 attends to no earlier token: no chunk at an aligned end (the store keeps none);
    # an end 1 short of a chunk end needs the chunk it lies in.  vLLM asks cdiv(1, 32) = 1.
    assert rules.window_in_chunks(_sw(1), 32) == 0
    assert rules.window_in_chunks(_sw(1), 32, 31) == 1
    assert rules.window_in_chunks(_sw(1), 32, rule=whole) == 1
    # Extra retained 40 tokens: cdiv(128-1+40, 32) = cdiv(167,32) = 6.
    assert rules.window_in_chunks(_sw(128, extra=40), 32) == 6
    # End 250 is 6 short of a chunk end: cdiv(127+6, 32) = 5; end 255 pads 1: cdiv(128,32)=4.
    assert rules.window_in_chunks(_sw(128), 32, 250) == 5
    assert rules.window_in_chunks(_sw(128), 32, 255) == 4
    chunked = KVGroup(2, GroupKind.CHUNKED_LOCAL, 16, attention_chunk_size=100)
    assert rules.window_in_chunks(chunked, 32) == 4  # cdiv(100, 32)
    assert rules.window_in_chunks(KVGroup(3, GroupKind.MAMBA, 16), 64) == 1
    assert rules.window_in_chunks(KVGroup(0, GroupKind.FULL, 16), 64) is None


def test_window_blocks_before_boundary() -> None:
    # W + extra - 1 tokens before the boundary: cdiv(127, 16) = 8 blocks; EAGLE one more.
    assert rules.window_blocks_before_boundary(_sw(128)) == 8
    assert rules.window_blocks_before_boundary(_sw(128, eagle=True)) == 9
    # W=17 at 16 tokens/block: 16 tokens before the boundary, one block; the intended
    # lookup asks the same one chunk, vLLM's cdiv(17, 16) = 2 chunks of one block.
    assert rules.window_blocks_before_boundary(_sw(17)) == 1
    assert rules.window_in_chunks(_sw(17), 16) == 1
    assert rules.window_in_chunks(_sw(17), 16, rule=rules.WindowRule.WHOLE_WINDOW) == 2


def test_hit_limit_last_token_rules() -> None:
    end, after = LastTokenRule.REQUEST_END, LastTokenRule.AFTER_CAPS
    # 200 tokens, a 128-token cap: the cap is a legal end (REQUEST_END), loses one (AFTER_CAPS).
    assert rules.hit_limit(200, 0, (128, None), True, end, None) == 128
    assert rules.hit_limit(200, 0, (128, None), True, after, None) == 127
    # Uncapped, both stop one short of the request's end; no windowed group: no token lost.
    assert rules.hit_limit(200, 0, (None, None), True, end, None) == 199
    assert rules.hit_limit(200, 0, (None, None), True, after, None) == 199
    assert rules.hit_limit(200, 0, (128, None), False, after, None) == 128
    # Caps count from the GPU hit: 64 + 100 = 164; Mamba-align span 64 rounds 199 down to 192.
    assert rules.hit_limit(200, 64, (100, None), False, end, None) == 164
    assert rules.hit_limit(200, 0, (None, None), True, end, 64) == 192


def test_needed_chunks() -> None:
    full = _gc(KVGroup(0, GroupKind.FULL, 32), 2)  # 64-token chunks
    assert rules.needed_chunks(full, 0, 200) == range(0, 4)  # every chunk up to token 199
    assert rules.needed_chunks(full, 128, 200) == range(2, 4)  # from the GPU hit's chunk on
    sw = _gc(_sw(128), 2)  # 32-token chunks, window 4
    assert rules.needed_chunks(sw, 0, 256) == range(4, 8)
    assert rules.needed_chunks(sw, 0, 250) == range(3, 8)  # unaligned: 5 chunks (above)
    assert rules.needed_chunks(sw, 160, 256) == range(5, 8)  # clipped at the GPU hit
    eagle = _gc(_sw(128, eagle=True), 2)
    assert rules.needed_chunks(eagle, 0, 256) == range(4, 9)  # the window plus a peek


def test_loaded_chunks() -> None:
    full = _gc(KVGroup(0, GroupKind.FULL, 32), 2)  # 64-token chunks
    # A load reads what the hit needs: every chunk from the GPU hit's on, up to token 199.
    assert rules.loaded_chunks(full, 64, 200) == range(1, 4)
    sw = _gc(_sw(128), 2)  # 32-token chunks, window 4
    assert rules.loaded_chunks(sw, 0, 256) == range(4, 8)
    # An EAGLE group's peek (chunk 8 past the end 256) proves chunk 7 complete; it is
    # needed but not read.
    eagle = _gc(_sw(128, eagle=True), 2)
    assert rules.loaded_chunks(eagle, 0, 256) == range(4, 8)
    eagle_full = _gc(KVGroup(0, GroupKind.FULL, 32, is_eagle=True), 2)
    assert rules.loaded_chunks(eagle_full, 0, 128) == range(0, 2)


def test_lookup_deferred() -> None:
    """A hit waits for a needed chunk still being written, or a loaded chunk being loaded."""
    full = _gc(KVGroup(0, GroupKind.FULL, 32), 2)  # 64-token chunks
    eagle = _gc(_sw(128, eagle=True), 2)  # 32-token chunks, window 4 plus the peek
    groups = (full, eagle)

    def deferred(pending: set[tuple[int, int]], loading: set[tuple[int, int]]) -> bool:
        return rules.lookup_deferred(
            groups, 0, 256, lambda g, k: (g, k) in pending, lambda g, k: (g, k) in loading
        )

    assert not deferred(set(), set())
    # A hit ending at 256 needs full chunks 0..3, window chunks 4..7 and the peek 8.
    assert deferred({(0, 2)}, set())
    assert deferred({(1, 4)}, set())
    assert deferred({(1, 8)}, set())  # the peek must be readable too
    assert deferred(set(), {(0, 0)})
    assert deferred(set(), {(1, 7)})
    # Chunks the hit does not need never defer it: past its end, before the window,
    # and a peek another request loads (this hit does not load it).
    assert not deferred({(0, 4), (1, 3), (1, 9)}, set())
    assert not deferred(set(), {(0, 4), (1, 3), (1, 8)})
    # From a GPU hit at 128, the full group's chunks 0 and 1 are on the GPU already.
    assert not rules.lookup_deferred(
        groups, 128, 256, lambda g, k: (g, k) == (0, 1), lambda g, k: (g, k) == (0, 0)
    )


def test_eagle_extra_chunks_and_final_tail_blocks() -> None:
    assert rules.eagle_extra_chunks(_sw(128, eagle=True)) == 1  # the peek past the hit
    assert rules.eagle_extra_chunks(_sw(128)) == 0
    # 64-token alignment segments of 16-token blocks: 4 blocks; none when not whole,
    # without alignment, for EAGLE or for a group that is not a sliding window.
    assert rules.final_tail_blocks(_gc(_sw(33), 1), 64) == 4
    assert rules.final_tail_blocks(_gc(_sw(33), 1), 40) is None
    assert rules.final_tail_blocks(_gc(_sw(33), 1), None) is None
    assert rules.final_tail_blocks(_gc(_sw(33, eagle=True), 1), 64) is None
    assert rules.final_tail_blocks(_gc(KVGroup(0, GroupKind.FULL, 16), 1), 64) is None


def test_offered_under_prompt_horizon() -> None:
    # W=33 at 16 tokens per block needs 2 blocks before a boundary; dense, 64-token
    # segments: blocks 2, 3 of each segment.  The 100-token prompt ends at block 6, a
    # final segment of 2 blocks (4, 5) whose tail is kept too.  One block per chunk.
    sw = _gc(_sw(33), 1)
    state = rules.StoreState(tuple(range(1, 9)), 8, 128, 100, 100, True)
    assert rules.offered_under_prompt_horizon(sw, state, 0, 8, 64, None) == {2, 3, 4, 5, 6, 7}
    assert rules.offered_under_prompt_horizon(sw, state, 5, 7, 64, None) == {5, 6}
    full = _gc(KVGroup(0, GroupKind.FULL, 16), 1)  # every block reachable
    assert rules.offered_under_prompt_horizon(full, state, 0, 3, 64, None) == {0, 1, 2}


def test_group_holds_minimum_and_alignment() -> None:
    full = _gc(KVGroup(0, GroupKind.FULL, 32), 2)  # 64-token chunks
    missing_2 = lambda k: k != 2  # noqa: E731
    assert rules.group_holds(full, 4, missing_2, 0, 128)  # chunks 0, 1
    assert not rules.group_holds(full, 4, missing_2, 0, 192)  # needs chunk 2
    assert rules.group_holds(full, 4, missing_2, 192, 256)  # chunk 2 is on the GPU
    assert not rules.group_holds(full, 4, lambda k: True, 0, 300)  # chunk 4 is not keyed
    assert rules.at_least_one_chunk(full, 0, 64)
    assert not rules.at_least_one_chunk(full, 0, 63)
    assert not rules.at_least_one_chunk(full, 64, 127)
    sw = _gc(_sw(128), 2)  # 32-token chunks
    assert rules.aligned_to_chunks((full, sw), 128)
    assert not rules.aligned_to_chunks((full, sw), 96)  # a chunk end of sw only
    assert rules.aligned_to_chunks((sw,), 96)


def test_first_kept_block() -> None:
    # W=128: the 127 tokens before the end 300 start at token 173, in block 173 // 16 = 10.
    assert rules.first_kept_block(_gc(_sw(128), 2), 300) == 10
    assert rules.first_kept_block(_gc(_sw(128), 2), 50) == 0
    # End 303: the 127 tokens before it start at token 176, the first of block 11.
    assert rules.first_kept_block(_gc(_sw(128), 2), 303) == 11
    # Chunked-local 100: the attention chunk holding token 250 starts at 200, block 12.
    chunked = KVGroup(2, GroupKind.CHUNKED_LOCAL, 16, attention_chunk_size=100)
    assert rules.first_kept_block(_gc(chunked, 1), 250) == 12
    # Mamba: the last state block of a 100-token hit is block 6 (tokens 96..99).
    assert rules.first_kept_block(_gc(KVGroup(3, GroupKind.MAMBA, 16), 1), 100) == 6
    assert rules.first_kept_block(_gc(KVGroup(0, GroupKind.FULL, 16), 1), 300) == 0


def test_full_attention_end_and_junction() -> None:
    """Design note 5.3's groups (FA tpc 128 + SW128 tpc 32, 300 tokens, limit 299)."""
    groups = (_gc(KVGroup(0, GroupKind.FULL, 64), 2), _gc(_sw(128), 2))
    num_keys = (2, 9)

    def end(missing: set[tuple[int, int]], gs: tuple[GroupChunking, ...] = groups) -> int | None:
        return rules.full_attention_end(gs, num_keys, lambda g, k: (g, k) not in missing, 0,
                                        299, False)

    assert end(set()) == 256  # the FA group's two keyed chunks
    assert end({(0, 1)}) == 128
    assert end({(0, 0)}) is None  # less than one FA chunk
    assert end({(1, 6)}) == 256  # windowed groups do not decide it
    assert end(set(), groups[:1]) is None  # no windowed group follows
    # A hit the windows cut to 192 short of the FA end 256 pins 256 under sparse or
    # periodic retention; dense retention keeps every window already.
    assert rules.shared_prefix_junction(256, 0, 192, 0) == 256
    assert rules.shared_prefix_junction(256, 0, 192, 64) == 256
    assert rules.shared_prefix_junction(256, 0, 192, None) is None
    assert rules.shared_prefix_junction(256, 0, 256, 0) is None  # not cut short
    assert rules.shared_prefix_junction(None, 0, 192, 0) is None


def test_hit_on_the_vllm_verified_table() -> None:
    """Design note 5.3 (vLLM 0.33.0, verified): FA tpc 128 + SW128 tpc 32, 300 tokens."""
    groups = (_gc(KVGroup(0, GroupKind.FULL, 64), 2), _gc(_sw(128), 2))
    num_keys = (300 // 128, 300 // 32)
    limit = rules.hit_limit(300, 0, (None, None), True, LastTokenRule.REQUEST_END, None)
    table = {(): 256, ((1, 3),): 256, ((1, 6),): 192, ((1, 7),): 224, ((0, 1),): 128,
             ((0, 1), (1, 2)): 64}
    for missing, expected in table.items():
        hit = rules.hit(groups, num_keys, lambda g, k, m=missing: (g, k) not in m, 0, limit, False)
        assert hit == expected, missing


def test_store_rules() -> None:
    gc = _gc(KVGroup(0, GroupKind.FULL, 16), 2)  # 32-token chunks
    # 100 offloadable tokens: 3 complete chunks, capped by blocks (4 // 2) and keys.
    assert rules.storable_chunk_count(gc, 100, 100, False, 8, 9) == 3
    assert rules.storable_chunk_count(gc, 100, 100, False, 4, 9) == 2
    assert rules.storable_chunk_count(gc, 100, 100, False, 8, 1) == 1
    eagle = _gc(KVGroup(0, GroupKind.FULL, 16, is_eagle=True), 2)
    assert rules.storable_chunk_count(eagle, 100, 80, False, 8, 9) == 2  # decoding: last waits
    assert rules.storable_chunk_count(eagle, 100, 80, True, 8, 9) == 3
    # Offload-prompt-only off, 100-token prompt, 160 tokens, finished: 159 offloadable
    # (the design note's example: chunks 0..3 of 32 tokens).
    after = rules.computed_after_step(160, 0, 100, 160, True, False)
    assert rules.offloadable_tokens(after, 160, 100, None, False) == 159
    assert rules.offloadable_tokens(after, 160, 100, None, True) == 100
    assert rules.computed_after_step(40, 30, 100, 100, False, True) == 40  # aborted
    assert rules.computed_after_step(40, 30, 100, 100, False, False) == 70


def test_chunk_acceptance_and_masks() -> None:
    assert rules.chunk_accepted((5, 6), None)
    assert not rules.chunk_accepted((0, 6), None)  # a reachable null block
    assert not rules.chunk_accepted((5, 0), (True, True))  # the last block is null
    assert rules.chunk_accepted((0, 6), (False, True))  # the null block is unreachable
    assert not rules.chunk_accepted((5, 6), (False, False))  # nothing can serve a hit
    # W=33 at 16 tokens/block needs cdiv(32,16)=2 blocks; dense, 64-token segments of 4
    # blocks: the last two blocks of each segment.
    sw = _gc(_sw(33), 1)
    expected = [False, False, True, True] * 2
    assert rules.reachable_block_mask(sw, 0, 8, 64, None, (), None) == expected
    # Sparse: only the window before the boundary 99 -> 64: blocks 2 and 3.
    assert rules.reachable_block_mask(sw, 0, 8, 64, 0, (99,), None) == expected[:4] + [False] * 4
    full = _gc(KVGroup(0, GroupKind.FULL, 16), 1)
    assert rules.reachable_block_mask(full, 0, 8, 64, 0, (99,), None) is None


def test_store_horizon_and_reconsider() -> None:
    sw = _gc(_sw(33), 2)  # 32-token chunks, 64-token alignment: 4 blocks per segment
    assert rules.store_horizon(sw, 5, 3, True, None) == 5  # finished: its last chunk
    assert rules.store_horizon(sw, 2, 3, False, None) == 3  # storing the prompt
    assert rules.store_horizon(sw, 5, 3, False, None) is None  # decoding
    assert rules.store_horizon(sw, 5, 3, True, 0) is None  # sparse retention
    # Finished at chunk 5 (block 10) off the prompt horizon 3: the last segment starts at
    # block 8 = chunk 4.
    assert rules.reconsider_from(sw, 5, 3, True, None, 64) == 4
    assert rules.reconsider_from(sw, 3, 3, True, None, 64) is None


# ---------------------------------------------------------------------------
# The Planner equals the rules
# ---------------------------------------------------------------------------


class _Answers:
    """A store that answers each key as told (keys not told: MISS)."""

    def __init__(self, answers: dict[bytes, LookupResult]) -> None:
        self.answers = answers

    def lookup(self, key: bytes) -> LookupResult:
        return self.answers.get(key, LookupResult.MISS)


def _answering(keys: list[list[bytes]], answers: list[list[LookupResult]]) -> _Answers:
    pairs = zip(keys, answers, strict=True)
    return _Answers({k: a for ks, ans in pairs for k, a in zip(ks, ans, strict=True)})


def _held_store(keys: list[list[bytes]], held: list[list[bool]]) -> _Answers:
    hit, miss = LookupResult.HIT, LookupResult.MISS
    return _answering(keys, [[hit if h else miss for h in hs] for hs in held])


_POLICY_SWITCHES: dict[str, st.SearchStrategy[object]] = {
    "retention_interval": st.sampled_from((0, None, 64)),
    "offload_prompt_only": st.booleans(),
    "prefix_caching": st.booleans(),
    "last_token": st.sampled_from(list(LastTokenRule)),
    "window": st.sampled_from(list(WindowRule)),
    "null_blocks_in_store": st.sampled_from(list(NullBlockRule)),
    "offload_junctions": st.booleans(),
    "reload_after_failed_load": st.booleans(),
}
"""A strategy for every switch of :class:`Policy` (a new switch must be added here)."""

policies = st.fixed_dictionaries(_POLICY_SWITCHES).map(lambda kw: Policy(**kw))  # type: ignore[arg-type]


def test_policies_draw_every_switch() -> None:
    assert set(_POLICY_SWITCHES) == {f.name for f in fields(Policy)}


def _chunking_outcome(draw: st.DrawFn, retention: int | None = 0) -> Chunking | str:
    """A drawn chunking, or why the draw is filtered out."""
    geometry = draw(geometries(max_groups=4, hash_divides_blocks=draw(st.booleans())))
    if draw(st.booleans()):
        knob: BlocksPerChunk | PerGroupBlocksPerChunk = BlocksPerChunk(draw(st.integers(1, 4)))
    else:
        values = {g.index: draw(st.integers(1, 4)) for g in geometry.groups}
        knob = PerGroupBlocksPerChunk.of(values)
    try:
        chunking = resolve(geometry, knob, retention)
    except ValueError:
        return "the knob does not resolve"
    if supports_partial_tail(chunking):
        return "a partial-tail geometry (the boundary rules' cases, not these)"
    return chunking


@st.composite
def _chunkings(draw: st.DrawFn, retention: int | None = 0) -> Chunking:
    outcome = _chunking_outcome(draw, retention)
    event(f"chunking: {outcome if isinstance(outcome, str) else 'kept'}")
    assume(isinstance(outcome, Chunking))
    assert isinstance(outcome, Chunking)
    return outcome


CHUNKINGS_KEPT_FLOOR = 0.5
"""The share of drawn chunkings the rules' properties must keep (observed: 75 of 100 draws at
retention 0 and at None)."""


def test_chunkings_are_mostly_kept() -> None:
    """A fixed batch of draws per retention the properties use: at least CHUNKINGS_KEPT_FLOOR
    are kept, so a filter that starts rejecting most draws fails here instead of leaving the
    rule properties to a handful of examples."""
    for retention in (0, None):
        kept: list[bool] = []

        @settings(max_examples=100, derandomize=True, database=None, phases=[Phase.generate])
        @given(st.composite(_chunking_outcome)(retention))
        def record(outcome: Chunking | str) -> None:
            kept.append(isinstance(outcome, Chunking))  # noqa: B023 (run at once, below)

        record()
        assert len(kept) >= 50, len(kept)
        assert sum(kept) >= CHUNKINGS_KEPT_FLOOR * len(kept), (
            f"retention {retention}: {sum(kept)} of {len(kept)} chunkings kept"
        )


_ANSWERS = st.sampled_from(
    (LookupResult.HIT,) * 6 + (LookupResult.HIT_PENDING, LookupResult.MISS, LookupResult.MISS)
)


@given(_chunkings(), st.integers(1, 400), st.data())
def test_planner_lookup_equals_rules(chunking: Chunking, n: int, data: st.DataObject) -> None:
    """Under every policy and any store answers (pending included), the Planner's lookup is
    :func:`rules.hit` over the chunks held (HIT or HIT_PENDING), and None exactly when a
    chunk that hit needs is still pending."""
    hashes = prefix_block_hashes(list(range(n)), chunking.tokens_per_hash)
    step = math.lcm(*(gc.group.tokens_per_block for gc in chunking.groups))
    computed = data.draw(st.integers(0, (n - 1) // step)) * step
    keys = [group_keys(hashes, gc) for gc in chunking.groups]
    answers = [[data.draw(_ANSWERS) for _ in ks] for ks in keys]
    budget = data.draw(st.none() | st.integers(0, 400))
    max_load = data.draw(st.none() | st.integers(0, 400))
    policy = data.draw(policies)
    planner = Planner(chunking, _answering(keys, answers), policy)  # type: ignore[arg-type]
    planner.new_request("r", n, max_load_tokens=max_load)
    got = planner.lookup("r", hashes, n, computed, budget)
    windowed = any(gc.window_in_chunks is not None for gc in chunking.groups)
    limit = rules.hit_limit(
        n, computed, (budget, max_load), windowed, policy.last_token, chunking.mamba_align_tokens
    )
    want = rules.hit(
        chunking.groups, [len(k) for k in keys],
        lambda g, k: answers[g][k] is not LookupResult.MISS, computed, limit,
        max_load is not None, policy.window,
    )
    pending = want > 0 and any(
        answers[g][k] is LookupResult.HIT_PENDING
        for g, gc in enumerate(chunking.groups)
        for k in rules.needed_chunks(gc, computed, computed + want, policy.window)
    )
    assert got == (None if pending else want)


def test_two_eagle_groups_each_peek_at_the_hit_end() -> None:
    """Two EAGLE groups: the second shrinks the hit to 128; the first must then show its
    peek past 128 (chunk 4), which is missing, so nothing hits.  vLLM's incremental loop
    answers 128 here: a group that peeked at a larger end is not asked again (the peek
    guards the hit's end, so the rules' 0 is intended; recorded through vLLM as deviation
    ``eagle-peek-skipped-after-another-eagle-group-shrinks-the-hit``)."""
    geometry = Geometry(
        groups=(
            KVGroup(0, SW, 8, sliding_window=1, is_eagle=True),
            KVGroup(1, GroupKind.CHUNKED_LOCAL, 32, attention_chunk_size=1, is_eagle=True),
        ),
        tokens_per_hash=4,
    )
    chunking = resolve(geometry, PerGroupBlocksPerChunk.of({0: 4, 1: 4}), 0)
    hashes = prefix_block_hashes(list(range(256)), 4)
    keys = [group_keys(hashes, gc) for gc in chunking.groups]
    held = [[k != 4 for k in range(len(keys[0]))], [True] * len(keys[1])]
    store = _held_store(keys, held)
    planner = Planner(chunking, store)  # type: ignore[arg-type]
    planner.new_request("r", 256)
    assert planner.lookup("r", hashes, 256, 0) == 0
    limit = rules.hit_limit(256, 0, (), True, LastTokenRule.REQUEST_END, None)
    assert rules.hit(chunking.groups, [8, 2], lambda g, k: held[g][k], 0, limit, False) == 0
    # With chunk 4 held the same hit reaches 128 (group 1 holds two 128-token chunks,
    # the last one its peek).
    held[0][4] = True
    planner = Planner(chunking, _held_store(keys, held))  # type: ignore[arg-type]
    planner.new_request("r", 256)
    assert planner.lookup("r", hashes, 256, 0) == 128


@given(st.integers(1, 300), st.data())
def test_planner_store_job_equals_rules(n: int, data: st.DataObject) -> None:
    retention = data.draw(st.sampled_from((0, None)))
    policy = replace(data.draw(policies), retention_interval=retention)
    chunking = data.draw(_chunkings(retention))
    hashes = tuple(prefix_block_hashes(list(range(n)), chunking.tokens_per_hash))
    width = max(g.index for g in chunking.geometry.groups) + 1
    tables: list[tuple[int, ...]] = [() for _ in range(width)]
    next_id = 1
    for gc in chunking.groups:
        count = -(-n // gc.group.tokens_per_block)
        nulls = gc.window_in_chunks is not None and data.draw(st.booleans())
        ids = []
        for _ in range(count):
            ids.append(0 if nulls and data.draw(st.booleans()) else next_id)
            next_id += 1
        tables[gc.group.index] = tuple(ids)
    scheduled = data.draw(st.integers(1, n))
    finished = data.draw(st.booleans())
    info = ScheduledRequest(
        req_id="r", num_prompt_tokens=n, num_tokens=n,
        num_computed_tokens=scheduled if finished else 0,
        num_scheduled_tokens=0 if finished else scheduled, block_hashes=hashes,
        new_block_ids=tuple(tables), is_full_table=True, is_finished=finished,
    )
    planner = Planner(chunking, ChunkStore(10_000), policy)
    planner.new_request("r", n)
    jobs = planner.step([info])
    offered = [job.keys for _, job in jobs]
    # The rules: every group's storable chunks from chunk 0, group-major.
    after = rules.computed_after_step(
        info.num_computed_tokens, info.num_scheduled_tokens, n, n, finished, False
    )
    boundaries = () if retention is None else (n - 1,)
    want: list[bytes] = []
    for gc in chunking.groups:
        state = rules.StoreState(
            tables[gc.group.index], len(group_keys(hashes, gc)),
            rules.offloadable_tokens(after, n, n, None, policy.offload_prompt_only), n, n,
            finished, boundaries,
        )
        chunks = rules.storable_chunks(gc, state, 0, chunking.alignment_tokens, retention)
        want.extend(group_keys(hashes, gc)[k] for k in chunks)
    assert offered == ([tuple(want)] if want else [])



# ---------------------------------------------------------------------------
# Invariants of the rules themselves (conformance/protocol/invariants.py checks the same
# properties on traces, reference and vLLM alike; these draw what vLLM cannot run:
# groups below the hash unit, per-group knobs, any window).
# ---------------------------------------------------------------------------


@given(_chunkings(retention=None), st.integers(1, 400), st.data())
def test_rules_hit_invariants(chunking: Chunking, n: int, data: st.DataObject) -> None:
    """A hit needs only held chunks; more held chunks never shorten it; keys are injective."""
    hashes = prefix_block_hashes(list(range(n)), chunking.tokens_per_hash)
    keys = [group_keys(hashes, gc) for gc in chunking.groups]
    every = [k for ks in keys for k in ks]
    assert len(set(every)) == len(every), "two (group, chunk) pairs share a key"
    step = math.lcm(*(gc.group.tokens_per_block for gc in chunking.groups))
    computed = data.draw(st.integers(0, (n - 1) // step)) * step
    windowed = any(gc.window_in_chunks is not None for gc in chunking.groups)
    limit = rules.hit_limit(n, computed, (None, None), windowed, LastTokenRule.AFTER_CAPS,
                            chunking.mamba_align_tokens)
    often = st.sampled_from((True, True, True, False))
    held = [[data.draw(often) for _ in ks] for ks in keys]
    more = [[h or data.draw(st.booleans()) for h in hs] for hs in held]
    num_keys = [len(k) for k in keys]

    def hit(holding: list[list[bool]]) -> int:
        return rules.hit(chunking.groups, num_keys, lambda g, k: holding[g][k], computed, limit,
                         False)

    h = hit(held)
    for g, gc in enumerate(chunking.groups):
        if h == 0:
            break
        needed = rules.needed_chunks(gc, computed, computed + h)
        missing = [k for k in needed if k >= num_keys[g] or not held[g][k]]
        assert not missing, f"group {gc.group.index}: a {h}-token hit needs unheld chunks {missing}"
    assert hit(more) >= h, f"holding more chunks shortened the hit: {hit(more)} < {h}"


@given(_chunkings(), st.integers(1, 400), st.integers(0, 400), st.booleans(), st.data())
def test_full_group_end_bisection_equals_the_scan(
    chunking: Chunking, n: int, computed: int, align: bool, data: st.DataObject
) -> None:
    """The bisection that finds a full group's largest end equals scanning every end."""
    full = [gc for gc in chunking.groups if gc.window_in_chunks is None]
    assume(full)
    gc = full[0]
    num_keys = n // gc.tokens_per_chunk
    held = [data.draw(st.sampled_from((True, True, True, False))) for _ in range(num_keys)]
    limit = data.draw(st.integers(0, n))
    scanned = rules._largest_end(
        (gc,), (0,), (num_keys,), lambda _, k: held[k], computed, limit, align,
        rules.WindowRule.TOKENS_BEFORE_END,
    )
    bisected = rules._largest_prefix_end(
        gc, num_keys, lambda k: held[k], computed, limit, align,
        rules.WindowRule.TOKENS_BEFORE_END,
    )
    assert bisected == scanned


def test_eviction_rule_takes_leaves_and_the_windows_they_serve() -> None:
    """reference.eviction's rule (docs/semantics.md §10): a file goes only when no
    full-attention chunk that stays depends on it; the window chunk a boundary needs
    goes with it."""
    from reference import eviction

    groups = (KVGroup(0, GroupKind.FULL, 16), KVGroup(1, SW, 16, sliding_window=24))
    chunking = resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(2))
    chain = prefix_block_hashes(list(range(1, 97)), 16)  # 3 chunks of 32 tokens
    full, window = (group_keys(chain, gc) for gc in chunking.groups)
    structure = eviction.PrefixStructure(chunking)
    structure.observe(chain)
    disk = eviction.Disk(structure)
    # One file per key: chunk 0, chunk 1, chunk 2 and the window chunk the hit ending at
    # chunk 2's end needs (a 24-token window: cdiv(23, 32) = 1 chunk, the last one).
    f0, f1, f2, fw = (disk.add([k], 1, ready=True) for k in (*full, window[2]))
    units = eviction.evictable(disk)
    assert eviction.eviction_unit(disk, f0) is None  # chunks 1 and 2 need it
    assert eviction.eviction_unit(disk, f1) is None
    assert eviction.eviction_unit(disk, f2) == (f2, fw)  # the boundary's window goes too
    assert eviction.eviction_unit(disk, fw) == (fw,)  # chunk 2 stays a full-attention chunk
    assert units == [(f2, fw), (fw,)]  # least recently used first
    for unit in units:  # evicting any unit strands nothing that stays
        kept = eviction.Disk(structure)
        for fid, key in ((f0, full[0]), (f1, full[1]), (f2, full[2]), (fw, window[2])):
            if fid not in unit:
                kept.add([key], 1, ready=True)
        assert eviction.stranded(kept) == frozenset()
    disk.remove(f1)  # what plain LRU may do: chunk 2 and its window lose their prefix
    assert eviction.stranded(disk) == {full[2], window[2]}


def test_eviction_takes_first_the_windows_of_a_boundary_one_prefix_passed() -> None:
    """Issue #31: a boundary one prefix went on past serves a hit only when what follows it
    is lost, so its window file goes before any other unit, older ones included; a boundary
    where prefixes branched (a shared system prompt, where new sessions' hits end) keeps
    its windows, and the rule's least-recently-used order applies.  (Stated from the rule:
    ``docs/semantics.md`` section 10.)"""
    from reference import eviction
    from reference.disk_economics import BudgetedIndex

    groups = (KVGroup(0, GroupKind.FULL, 16), KVGroup(1, SW, 16, sliding_window=24))
    chunking = resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(2))
    index = BudgetedIndex(chunking, 100, 4000, eviction.EvictionRule.REACHABLE,
                          windows_apart=True)

    def keys_of(tokens: list[int]) -> tuple[list[bytes], list[bytes]]:
        chain = prefix_block_hashes(tokens, 16)
        index.observe(chain)
        full, window = (group_keys(chain, gc) for gc in chunking.groups)
        return full, window

    def store(keys: list[bytes]) -> None:
        plan = index.prepare_store(keys)
        assert plan is not None and not plan.evicted_keys
        index.complete_store(plan.keys_to_store)

    old_full, old_window = keys_of(list(range(1000, 1064)))
    store([old_full[0], old_full[1], old_window[1]])  # another prefix, least recently used
    a = list(range(1, 97))
    full, window = keys_of(a)
    store([full[0], full[1], window[1]])
    assert index.disk.files[index.disk.file_of[window[1]]].keys == (window[1],), "windows apart"
    disk = index.disk
    oldest = disk.next_victim(eviction.EvictionRule.REACHABLE)
    assert oldest is not None and disk.file_of[old_full[1]] in oldest, "LRU before any pass"
    assert eviction.passed_windows_unit(disk) is None
    store([full[2], window[2]])  # the prefix goes on past boundary 1: its windows go first
    assert eviction.passed_windows_unit(disk) == (disk.file_of[window[1]],)
    assert disk.next_victim(eviction.EvictionRule.REACHABLE) == (disk.file_of[window[1]],)
    branch, _ = keys_of(a[:64] + list(range(500, 532)))
    store([branch[2]])  # another prefix branches off at boundary 1: its windows stay
    victim = disk.next_victim(eviction.EvictionRule.REACHABLE)
    assert victim is not None and disk.file_of[window[1]] not in victim
    assert disk.file_of[old_full[1]] in victim, "the rule's LRU order at a branch point"
    assert not disk.stranded()


def test_eviction_takes_units_by_their_most_recently_used_file() -> None:
    """Issue #31: a unit goes when its most recently used file is the oldest
    (``eviction.unit_last_use``), not its leaf.  A request that branched off a shared prefix
    wrote one window file with the junction's window and the window of the boundary its
    prompt ends at; the leaf of its tip is old, but a new session's hit at the junction has
    just read that window file.  Taking the tip's unit would take the junction's window
    every later session needs, so another prefix's older unit goes first.  (Stated from the
    rule: ``docs/semantics.md`` section 10.)"""
    from reference import eviction

    groups = (KVGroup(0, GroupKind.FULL, 16), KVGroup(1, SW, 16, sliding_window=24))
    chunking = resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(2))
    shared = list(range(1, 33))  # chunk 0: the junction (a 24-token window: 1 chunk)
    a = prefix_block_hashes(shared + list(range(100, 132)), 16)
    b = prefix_block_hashes(shared + list(range(200, 232)), 16)
    structure = eviction.PrefixStructure(chunking)
    structure.observe(a)
    structure.observe(b)
    (p0, a1), (w0, wa1) = (group_keys(a, gc) for gc in chunking.groups)
    (_, b1), (_, wb1) = (group_keys(b, gc) for gc in chunking.groups)

    def disk_of(unit_recency: bool) -> tuple[eviction.Disk, dict[str, int]]:
        disk = eviction.Disk(structure)
        disk.unit_recency = unit_recency
        f = {name: disk.add(keys, 1, ready=True) for name, keys in (
            ("p", [p0]), ("a", [a1]), ("wa", [w0, wa1]), ("b", [b1]), ("wb", [wb1]))}
        disk.touch(f["wa"])  # a new session's hit at the junction reads the window file
        return disk, f

    disk, f = disk_of(True)
    assert eviction.passed_windows_unit(disk) is None  # the junction branched: no pass
    assert eviction.eviction_unit(disk, f["a"]) == (f["a"], f["wa"])  # the tip's unit
    assert eviction.unit_last_use(disk, (f["a"], f["wa"])) == disk.files[f["wa"]].last_use
    victim = disk.next_victim(eviction.EvictionRule.REACHABLE)
    assert victim is not None and f["wa"] not in victim, "the junction's window stays"
    assert set(victim) <= {f["b"], f["wb"]}  # the other prefix's older unit
    assert eviction.evictable(disk)[0] == victim
    for fid in victim:
        disk.remove(fid)
    assert not disk.stranded() and w0 in disk.file_of  # the junction stays whole
    # By the leaf's own use (the rule before the fix), the junction's window goes.
    disk, f = disk_of(False)
    assert disk.next_victim(eviction.EvictionRule.REACHABLE) == (f["a"], f["wa"])


def test_gpu_prefix_hit() -> None:
    """The engine's GPU hit (docs/semantics.md §8 "GPU hit"): a held shared prefix, never
    the request's last token, ending where every group's blocks end; nothing not held."""
    # lcm of 64- and 256-token blocks: 256.  A 700-token prefix ends inside a block of
    # every group: the hit stops at the last whole multiple, 512.
    assert rules.gpu_prefix_hit(700, 1000, 256, True) == 512
    assert rules.gpu_prefix_hit(700, 1000, 256, False) == 0
    assert rules.gpu_prefix_hit(512, 1000, 256, True) == 512  # aligned: all of it
    # A prompt that is the prefix itself: its last token is computed, so the hit
    # ends a block earlier.
    assert rules.gpu_prefix_hit(512, 512, 256, True) == 256
    assert rules.gpu_prefix_hit(512, 513, 256, True) == 512
    assert rules.gpu_prefix_hit(200, 1000, 256, True) == 0  # shorter than one aligned span
    for prefix, prompt, align in ((700, 1000, 256), (100, 64, 16), (48, 49, 16)):
        got = rules.gpu_prefix_hit(prefix, prompt, align, True)
        assert got % align == 0 and got <= min(prefix, prompt - 1) < got + align


def test_pinned_junction() -> None:
    """§8 "pinned junction": the later of the offload junction and, unless retention is
    dense, the GPU hit; 0 when neither."""
    assert rules.pinned_junction(None, 0, 0) == 0
    assert rules.pinned_junction(768, 0, 0) == 768  # the offload side's junction alone
    assert rules.pinned_junction(None, 512, 0) == 512  # the GPU pins what it serves
    assert rules.pinned_junction(None, 512, 1024) == 512  # periodic retention too
    assert rules.pinned_junction(None, 512, None) == 0  # dense keeps every window already
    assert rules.pinned_junction(768, 512, 0) == 768  # the later of the two
    assert rules.pinned_junction(256, 512, 0) == 512
    assert rules.pinned_junction(768, 512, None) == 768
