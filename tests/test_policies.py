"""The reference's named policy switches (``reference.plan.Policy``), each on its smallest case.

vLLM releases differ on these rules (``conformance/protocol/versions.py``); the defaults
are the intended rules.  Each test builds the planner state by hand, so the
expected values follow from the rule's statement, not from either release.
"""

from __future__ import annotations

from reference.geometry import Geometry, GroupKind, KVGroup
from reference.keys import prefix_block_hashes
from reference.knobs import BlocksPerChunk, resolve
from reference.plan import (
    BlockRef,
    LastTokenRule,
    NullBlockRule,
    Planner,
    Policy,
    ScheduledRequest,
    WindowRule,
)
from reference.store import ChunkStore

# Full attention at 64 tokens/block, sliding window 40 at 16 tokens/block, hash unit 16.
FA64_SW40 = Geometry(
    (
        KVGroup(0, GroupKind.FULL, 64, 64),
        KVGroup(1, GroupKind.SLIDING_WINDOW, 16, 64, sliding_window=40),
    ),
    tokens_per_hash=16,
)
PROMPT = list(range(200))
HASHES = tuple(prefix_block_hashes(PROMPT, 16))


def _planner(policy: Policy, retention: int | None = 0) -> Planner:
    chunking = resolve(FA64_SW40, BlocksPerChunk(2), retention)
    return Planner(chunking, ChunkStore(64), policy)


def _prefill(planner: Planner, sw_blocks: list[int]) -> list:  # type: ignore[type-arg]
    planner.new_request("r", len(PROMPT))
    assert planner.lookup("r", HASHES, len(PROMPT), 0) == 0
    info = ScheduledRequest(
        req_id="r",
        num_prompt_tokens=len(PROMPT),
        num_tokens=len(PROMPT),
        num_computed_tokens=0,
        num_scheduled_tokens=len(PROMPT),
        block_hashes=HASHES,
        new_block_ids=((1, 2, 3, 4), tuple(sw_blocks)),
        is_full_table=True,
    )
    return [job for _, job in planner.step([info])]


def test_null_block_rule_keeps_chunk_offsets() -> None:
    """Chunk 2 of the window group (blocks 4, 5) is stored for the hit boundary 128
    (window [88, 128): blocks 5-7); its block 4 is out of every window and null."""
    table = [10 + i for i in range(13)]
    table[4] = 0
    (keep,) = _prefill(_planner(Policy(null_blocks_in_store=NullBlockRule.PLACEHOLDER)), table)
    (skip,) = _prefill(_planner(Policy(null_blocks_in_store=NullBlockRule.SKIP)), table)
    # Placeholder: both chunks 2 and 3 whole, from block 4 (the null page included).
    assert keep.group_sizes[1] == 4 and keep.block_indices[1] == 4
    assert keep.block_ids[-4:] == (0, 15, 16, 17)
    # Skip: the null page is left out and the group starts at block 5, so block 5
    # no longer sits at offset 1 of its chunk.
    assert skip.group_sizes[1] == 3 and skip.block_indices[1] == 5
    assert skip.block_ids[-3:] == (15, 16, 17)
    assert keep.keys == skip.keys


def _store_then_lookup(rule: LastTokenRule, max_num_new_tokens: int) -> int | None:
    planner = _planner(Policy(last_token=rule), retention=None)
    _prefill(planner, [10 + i for i in range(13)])
    planner.job_done(0)
    planner.request_finished("r")
    planner.new_request("again", len(PROMPT))
    return planner.lookup("again", HASHES, len(PROMPT), 0, max_num_new_tokens)


def test_last_token_rule_bounds_the_request_end_not_the_cap() -> None:
    """A 128-token cap is a legal hit end (a full-attention chunk); only the request's
    own last token must be recomputed."""
    assert _store_then_lookup(LastTokenRule.REQUEST_END, 128) == 128
    assert _store_then_lookup(LastTokenRule.AFTER_CAPS, 128) == 0  # 127 rounds down to 0 chunks
    # Uncapped, both rules stop one token short of the end: 199 -> 128.
    assert _store_then_lookup(LastTokenRule.REQUEST_END, 1000) == 128
    assert _store_then_lookup(LastTokenRule.AFTER_CAPS, 1000) == 128


def test_failed_load_retry_switch() -> None:
    for reload, expected in ((True, 128), (False, 0)):
        planner = _planner(Policy(reload_after_failed_load=reload), retention=None)
        _prefill(planner, [10 + i for i in range(13)])
        planner.job_done(0)
        planner.request_finished("r")
        planner.new_request("b", len(PROMPT))
        assert planner.lookup("b", HASHES, len(PROMPT), 0) == 128
        # The hit's window [88, 128) needs sliding-window blocks 5-7; blocks 0-4 are null.
        window = [BlockRef(0, is_null=True) if i < 5 else BlockRef(200 + i) for i in range(13)]
        blocks = [[BlockRef(100 + i) for i in range(4)], window]
        load = planner.allocated("b", blocks, 128)
        assert load is not None
        planner.job_done(planner.last_job_id, success=False)  # type: ignore[arg-type]
        assert planner.lookup("b", HASHES, len(PROMPT), 0) == expected, reload


# Full attention at 64 tokens/block, sliding window 33 = 32 + 1 at 16 tokens/block.
FA64_SW33 = Geometry(
    (
        KVGroup(0, GroupKind.FULL, 64, 64),
        KVGroup(1, GroupKind.SLIDING_WINDOW, 16, 64, sliding_window=33),
    ),
    tokens_per_hash=16,
)


def _replayed_hit(rule: WindowRule) -> int:
    """A 256-token prompt stored, then the same prompt again: the hit (no GPU cache)."""
    from conformance.harness.sim import SimEngine

    sim = SimEngine(resolve(FA64_SW33, BlocksPerChunk(2)), policy=Policy(window=rule))
    prompt = list(range(256))
    sim.run_request("a", prompt, budget=512)
    again = sim.run_request("b", prompt, budget=512)
    return 0 if again.loaded is None else again.loaded.hit_tokens


def test_window_rule_asks_only_the_tokens_before_the_end() -> None:
    """bpc 2: full chunks of 128 tokens, window chunks of 32.  The last token is
    recomputed, so the hit ends at 128; token 128 attends to tokens 96..127, one
    window chunk (chunk 3), which the store kept for that boundary (it keeps
    cdiv(33 - 1, 16) = 2 blocks before each).  vLLM's rule asks cdiv(33, 32) = 2
    chunks, chunks 2 and 3; chunk 2 was never stored, so it never hits
    (deviation swa-window-one-past-a-chunk-never-hits)."""
    assert _replayed_hit(WindowRule.TOKENS_BEFORE_END) == 128
    assert _replayed_hit(WindowRule.WHOLE_WINDOW) == 0
