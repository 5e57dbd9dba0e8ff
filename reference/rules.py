"""The offloading rules, each stated once as a small pure function.

Every function's docstring is its rule in words; ``docs/semantics.md`` ("Rules")
maps each rule to its function.  :class:`reference.plan.Planner` mirrors the
engine's call sequence and bookkeeping for replaying traces, and calls these
functions for every decision it makes.  The byte layout is stated in
:mod:`reference.transfer` (``TransferLayout``, ``job_copies``), not here.

Engine details the Planner models that the rules do not
---------------------------------------------------------
1. *Steps.*  Stores are offered once per scheduler step from the group's
   ``next_stored_chunk``; a store that cannot allocate is retried next step; a
   lookup while the request's own transfers are in flight answers "ask again
   later" (``None``).  A lookup is :func:`hit` over the chunks the store holds
   (HIT or HIT_PENDING), then :func:`lookup_deferred`.
2. *Reconsidered chunks.*  Under dense retention a request that finishes off
   its prompt horizon re-offers chunks it passed over under the prompt horizon
   (:func:`reconsider_from`); chunks it already offered are not offered twice.
3. *Null-block bookkeeping.*  Window blocks reused by the engine in the same
   step are nulled in the Planner's block tables before the store rules run.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import TYPE_CHECKING

from reference.geometry import GroupKind, KVGroup
from reference.mathutil import cdiv, round_down

if TYPE_CHECKING:
    from reference.knobs import GroupChunking


class LastTokenRule(Enum):
    """How "the last token is always recomputed" (windowed groups) bounds a hit.

    The request's final token must be computed, so a hit may end at most at
    ``num_tokens - 1``.  A tighter cap (the step's token budget,
    ``max_load_tokens``) is already a legal end and must not lose a token too.
    """

    REQUEST_END = "request_end"
    """Intended (vLLM 0.34.0): ``limit = min(num_tokens - 1, caps...)``."""
    AFTER_CAPS = "after_caps"
    """vLLM 0.33.0: ``limit = min(num_tokens, caps...) - 1``: a hit bounded by a cap
    loses one token, and with it (``round_down`` to a chunk) a whole chunk."""


class WindowRule(Enum):
    """How many chunks a sliding-window group needs before a hit's end.

    The first recomputed token (at the hit's end) attends to the ``W - 1`` tokens
    before it (plus ``extra`` retained tokens), so those are what a hit needs; the
    store keeps exactly them before every reachable boundary
    (:func:`window_blocks_before_boundary`).
    """

    TOKENS_BEFORE_END = "tokens_before_end"
    """Intended: the chunks holding the ``W - 1 + extra`` tokens before the end."""
    WHOLE_WINDOW = "whole_window"
    """vLLM 0.33.0 and 0.34.0 (``get_sliding_window_size_in_chunks``): at least
    ``cdiv(W, tpc)`` chunks.  One chunk more than the store keeps when
    ``(W - 1) % tpc == 0``, so such a window never hits (deviation
    ``swa-window-one-past-a-chunk-never-hits``)."""


# ---------------------------------------------------------------------------
# Windows
# ---------------------------------------------------------------------------


def window_in_chunks(
    group: KVGroup,
    tokens_per_chunk: int,
    end_tokens: int = 0,
    rule: WindowRule = WindowRule.TOKENS_BEFORE_END,
) -> int | None:
    """Chunks a hit ending at ``end_tokens`` needs at its end; ``None``: the whole prefix.

    Sliding window ``W`` with ``extra`` retained tokens: ``cdiv(W - 1 + extra + pad,
    tpc)`` chunks (none for a 1-token window at an aligned end), where ``pad`` is the distance from ``end_tokens``
    to the next chunk end (an unaligned end reaches one chunk further left); under
    :attr:`WindowRule.WHOLE_WINDOW` at least ``cdiv(W, tpc)``.  Chunked-local:
    ``cdiv(attention_chunk, tpc)``.  Mamba: 1.  Full attention: none.
    """
    if group.kind is GroupKind.SLIDING_WINDOW:
        assert group.sliding_window is not None
        pad = -end_tokens % tokens_per_chunk
        before = cdiv(group.sliding_window - 1 + group.extra_retained_tokens + pad, tokens_per_chunk)
        if rule is WindowRule.WHOLE_WINDOW:
            return max(cdiv(group.sliding_window, tokens_per_chunk), before)
        return before  # 0 when W - 1 + extra == 0 at an aligned end: no token before the end
    if group.kind is GroupKind.CHUNKED_LOCAL:
        assert group.attention_chunk_size is not None
        return cdiv(group.attention_chunk_size, tokens_per_chunk)
    if group.kind in (GroupKind.MAMBA, GroupKind.MAMBA_ALIGN):
        return 1
    return None


def eagle_extra_chunks(group: KVGroup) -> int:
    """An EAGLE draft group needs one chunk past the hit (it peeks one chunk further)."""
    return 1 if group.is_eagle else 0


def window_blocks_before_boundary(group: KVGroup) -> int:
    """Blocks a sliding-window hit at a boundary needs before it (store masks).

    ``cdiv(W + extra - 1, tokens_per_block)``: the boundary token itself is
    recomputed, so ``W + extra - 1`` tokens before it; EAGLE adds one block.
    """
    assert group.sliding_window is not None
    window = group.sliding_window + group.extra_retained_tokens
    return cdiv(window - 1, group.tokens_per_block) + eagle_extra_chunks(group)


def first_kept_block(gc: GroupChunking, hit_end: int) -> int:
    """First block a windowed group keeps on the GPU for a hit ending at ``hit_end``.

    The engine allocates (and a load fills) only the blocks a hit needs: a sliding
    window the ``W - 1 + extra`` tokens before the end, chunked-local the current
    attention chunk, Mamba the last state block; earlier entries are null blocks.
    Full attention keeps every block (0).
    """
    g = gc.group
    tpb = g.tokens_per_block
    if g.kind is GroupKind.SLIDING_WINDOW:
        assert g.sliding_window is not None
        return max(0, hit_end - (g.sliding_window - 1 + g.extra_retained_tokens)) // tpb
    if g.kind is GroupKind.CHUNKED_LOCAL:
        assert g.attention_chunk_size is not None
        return (hit_end // g.attention_chunk_size * g.attention_chunk_size) // tpb
    if g.kind in (GroupKind.MAMBA, GroupKind.MAMBA_ALIGN):
        return max(0, cdiv(hit_end, tpb) - 1)
    return 0


# ---------------------------------------------------------------------------
# Stores
# ---------------------------------------------------------------------------


def offloadable_tokens(
    after_step: int,
    num_tokens: int,
    num_prompt_tokens: int,
    max_offload_tokens: int | None,
    prompt_only: bool,
) -> int:
    """Tokens that may be offloaded: those computed, capped at the request's tokens,
    its ``max_offload_tokens``, and its prompt when ``offload_prompt_only``."""
    n = min(after_step, num_tokens)
    if max_offload_tokens is not None:
        n = min(n, max_offload_tokens)
    return min(n, num_prompt_tokens) if prompt_only else n


def computed_after_step(
    num_computed: int, num_scheduled: int, num_prompt: int, num_tokens: int,
    finished: bool, aborted: bool,
) -> int:
    """Tokens computed once this step ran: an aborted request its computed ones; a
    finished one all but its last sampled token (never committed), at most its
    computed ones; otherwise computed plus scheduled."""
    if aborted:
        return num_computed
    if finished:
        return min(num_computed, max(num_prompt, num_tokens - 1))
    return num_computed + num_scheduled


def storable_chunk_count(
    gc: GroupChunking, offloadable: int, num_prompt_tokens: int, finished: bool,
    num_blocks: int, num_keys: int,
) -> int:
    """Chunks ``[0, n)`` of a group that can be stored: complete within the offloadable
    tokens, all blocks allocated, keyed; an EAGLE group's last chunk waits while the
    request decodes (it is still being rewritten by the draft)."""
    n = offloadable // gc.tokens_per_chunk
    if gc.group.is_eagle and offloadable > num_prompt_tokens and not finished:
        n = max(0, n - 1)
    return min(n, num_blocks // gc.blocks_per_chunk, num_keys)


def store_horizon(
    gc: GroupChunking, num_chunks: int, prompt_chunks: int, finished: bool,
    retention_interval: int | None,
) -> int | None:
    """The chunk end a dense store mask treats as the request's final boundary, if any.

    None under sparse retention or for EAGLE groups; a finished request's last
    storable chunk; while the prompt is being stored, the prompt's last chunk;
    a decode frontier is not a final boundary (None).
    """
    if retention_interval is not None or gc.group.is_eagle:
        return None
    if finished:
        return num_chunks
    return prompt_chunks if num_chunks <= prompt_chunks else None


def final_tail_blocks(gc: GroupChunking, alignment_tokens: int | None) -> int | None:
    """Blocks per alignment segment of a non-EAGLE sliding-window group, if whole."""
    g = gc.group
    if alignment_tokens is None or g.is_eagle or g.kind is not GroupKind.SLIDING_WINDOW:
        return None
    return None if alignment_tokens % g.tokens_per_block else alignment_tokens // g.tokens_per_block


def reconsider_from(
    gc: GroupChunking, num_chunks: int, prompt_chunks: int, finished: bool,
    retention_interval: int | None, alignment_tokens: int | None,
) -> int | None:
    """First chunk a finished request re-offers, or None.

    Under dense retention a request that finishes off its prompt horizon has a
    new final segment: the sliding-window chunks of that last alignment segment,
    passed over under the prompt horizon, become reachable and are offered again.
    """
    tail = final_tail_blocks(gc, alignment_tokens)
    if not finished or num_chunks == prompt_chunks or retention_interval is not None:
        return None
    if tail is None:
        return None
    end_block = num_chunks * gc.blocks_per_chunk
    return (end_block - end_block % tail) // gc.blocks_per_chunk


# The mask is one rule with one branch per group kind, as vLLM states it.
def reachable_block_mask(
    gc: GroupChunking,
    start_block: int,
    end_block: int,
    alignment_tokens: int | None,
    retention_interval: int | None,
    reachable_boundaries: Sequence[int],
    final_segment_end_block: int | None,
) -> list[bool] | None:
    """Which blocks of ``[start_block, end_block)`` a later hit can use; None = all.

    Full attention and chunked-local: every block.  Sliding window: the
    :func:`window_blocks_before_boundary` blocks before each segment boundary
    (segments are the alignment span when dense, the retention interval when
    sparse), the final segment's tail, and the tail before each reachable
    boundary.  Mamba (non-align): one state per segment plus one per reachable
    boundary.
    """
    g = gc.group
    tpb = g.tokens_per_block
    if g.kind is GroupKind.SLIDING_WINDOW:
        if alignment_tokens is None or alignment_tokens % tpb:
            return None  # the mask is block-granular; fall back to dense
        need = window_blocks_before_boundary(g)
        shift = eagle_extra_chunks(g)
        mask = [False] * (end_block - start_block)
        segment = (
            alignment_tokens
            if retention_interval is None
            else (None if retention_interval == 0 else retention_interval)
        )
        if segment is not None:
            per_segment = segment // tpb
            if need >= per_segment:
                return None
            for i in range(start_block, end_block):
                if i >= shift and (i - shift) % per_segment >= per_segment - need:
                    mask[i - start_block] = True
            if final_segment_end_block is not None and not g.is_eagle:
                tail = final_segment_end_block % per_segment
                if tail:
                    lo = max(final_segment_end_block - tail, final_segment_end_block - need)
                    for i in range(max(start_block, lo), min(end_block, final_segment_end_block)):
                        mask[i - start_block] = True
        if retention_interval is not None:
            for boundary in reachable_boundaries:
                end = round_down(boundary, alignment_tokens) // tpb + shift
                for j in range(max(start_block, end - need), min(end_block, end)):
                    mask[j - start_block] = True
        return mask
    if g.kind is GroupKind.MAMBA:
        if retention_interval is None or alignment_tokens is None:
            return None
        mask = [False] * (end_block - start_block)
        if retention_interval:
            per_segment = retention_interval // tpb
            if per_segment <= 1:
                return None
            first = (start_block + per_segment) // per_segment * per_segment - 1
            for i in range(first - start_block, len(mask), per_segment):
                mask[i] = True
        for boundary in reachable_boundaries:
            block = round_down(boundary, alignment_tokens) // tpb - 1
            if start_block <= block < end_block:
                mask[block - start_block] = True
        return mask
    return None


def chunk_accepted(blocks: Sequence[int], reachable: Sequence[bool] | None) -> bool:
    """A chunk is stored when its last block is present (not null, id 0), some block
    can serve a hit, and no reachable block is null (it would stay unwritten)."""
    if blocks[-1] == 0:
        return False
    if reachable is None:
        return 0 not in blocks
    return any(reachable) and not any(b == 0 and r for b, r in zip(blocks, reachable, strict=True))


@dataclass(frozen=True)
class StoreState:
    """One group of one request at a store point (for :func:`storable_chunks`)."""

    block_ids: tuple[int, ...]
    num_keys: int
    offloadable: int
    prompt_offloadable: int
    num_prompt_tokens: int
    finished: bool
    boundaries: tuple[int, ...] = ()


def storable_chunks(
    gc: GroupChunking, state: StoreState, start: int,
    alignment_tokens: int | None, retention_interval: int | None,
) -> tuple[int, ...]:
    """Chunks ``k >= start`` of a group stored at this point: those below
    :func:`storable_chunk_count` that :func:`chunk_accepted` accepts under the
    :func:`reachable_block_mask` of the :func:`store_horizon`.  Mamba-align
    groups store only from boundary hand-offs (none here)."""
    if gc.group.kind is GroupKind.MAMBA_ALIGN:
        return ()
    bpc = gc.blocks_per_chunk
    n = storable_chunk_count(
        gc, state.offloadable, state.num_prompt_tokens, state.finished,
        len(state.block_ids), state.num_keys,
    )
    horizon = store_horizon(
        gc, n, state.prompt_offloadable // gc.tokens_per_chunk, state.finished, retention_interval
    )
    mask = reachable_block_mask(
        gc, start * bpc, n * bpc, alignment_tokens, retention_interval, state.boundaries,
        None if horizon is None else horizon * bpc,
    )
    return tuple(
        k for k in range(start, n)
        if chunk_accepted(
            state.block_ids[k * bpc : (k + 1) * bpc],
            None if mask is None else mask[(k - start) * bpc : (k - start + 1) * bpc],
        )
    )


def offered_under_prompt_horizon(
    gc: GroupChunking, state: StoreState, start: int, stop: int,
    alignment_tokens: int | None, retention_interval: int | None,
) -> frozenset[int]:
    """Chunks of ``[start, stop)`` already offered while the prompt was stored: those
    with a block reachable under the prompt horizon's mask (engine detail 3)."""
    bpc = gc.blocks_per_chunk
    prompt_end = state.prompt_offloadable // gc.tokens_per_chunk * bpc
    mask = reachable_block_mask(
        gc, start * bpc, stop * bpc, alignment_tokens, retention_interval, state.boundaries,
        prompt_end,
    )
    return frozenset(
        k for k in range(start, stop)
        if mask is None or any(mask[(k - start) * bpc : (k - start + 1) * bpc])
    )


# ---------------------------------------------------------------------------
# Hits
# ---------------------------------------------------------------------------


def hit_limit(
    num_tokens: int, computed: int, caps: Sequence[int | None], windowed: bool,
    rule: LastTokenRule, mamba_align_tokens: int | None,
) -> int:
    """The furthest a hit may end: the request's tokens and every cap (each counted
    from ``computed``); with any windowed group the last token is recomputed, by
    ``rule``; hits round down to the Mamba-align span."""
    limit = num_tokens
    if windowed and rule is LastTokenRule.REQUEST_END:
        limit -= 1
    for cap in caps:
        if cap is not None:
            limit = min(limit, computed + cap)
    if windowed:
        if rule is LastTokenRule.AFTER_CAPS:
            limit -= 1
        if mamba_align_tokens is not None:
            limit = round_down(limit, mamba_align_tokens)
    return limit


def needed_chunks(
    gc: GroupChunking, computed: int, end: int, rule: WindowRule = WindowRule.TOKENS_BEFORE_END
) -> range:
    """Chunks of a group a hit from ``computed`` to ``end`` needs: full attention every
    chunk from the one holding ``computed`` up to the one holding ``end - 1``; a
    windowed group only the last :func:`window_in_chunks` of those; EAGLE groups one
    chunk more (:func:`eagle_extra_chunks`)."""
    tpc = gc.tokens_per_chunk
    first = computed // tpc
    stop = cdiv(end, tpc) + eagle_extra_chunks(gc.group)
    window = window_in_chunks(gc.group, tpc, end, rule)
    if window is None:
        return range(first, stop)
    return range(max(first, stop - window - eagle_extra_chunks(gc.group)), stop)


def group_holds(
    gc: GroupChunking, num_keys: int, held: Callable[[int], bool], computed: int, end: int,
    rule: WindowRule = WindowRule.TOKENS_BEFORE_END,
) -> bool:
    """A group can serve a hit ending at ``end`` when every one of its
    :func:`needed_chunks` is keyed (below ``num_keys``) and held in the store."""
    chunks = needed_chunks(gc, computed, end, rule)
    return chunks.stop <= num_keys and all(held(k) for k in chunks)


def at_least_one_chunk(gc: GroupChunking, computed: int, end: int) -> bool:
    """A hit is at least one chunk of every group: ``end - computed >= tokens_per_chunk``
    (each group checks the end it was asked about, see :func:`hit`)."""
    return end - computed >= gc.tokens_per_chunk


def aligned_to_chunks(groups: Sequence[GroupChunking], end: int) -> bool:
    """With ``max_load_tokens`` set, a hit ends on a chunk end of each group that
    decides it (each full group in turn, every windowed group together)."""
    return all(end % gc.tokens_per_chunk == 0 for gc in groups)


def loaded_chunks(
    gc: GroupChunking, computed: int, end: int, rule: WindowRule = WindowRule.TOKENS_BEFORE_END
) -> range:
    """Chunks of a group a hit from ``computed`` to ``end`` loads: its
    :func:`needed_chunks` without an EAGLE group's peek chunk (the peek only proves
    the chunk before it complete; the load does not read it)."""
    chunks = needed_chunks(gc, computed, end, rule)
    return range(chunks.start, chunks.stop - eagle_extra_chunks(gc.group))


def _largest_end(
    groups: Sequence[GroupChunking], positions: Sequence[int], num_keys: Sequence[int],
    held: Callable[[int, int], bool], computed: int, limit: int, align: bool, rule: WindowRule,
) -> int:
    """The largest ``end`` in ``(computed, limit]`` every group in ``positions`` holds."""
    members = [groups[p] for p in positions]
    candidates = {limit}
    for gc in members:
        candidates.update(range(gc.tokens_per_chunk, limit, gc.tokens_per_chunk))
    for end in sorted(candidates, reverse=True):
        if end <= computed:
            break
        if align and not aligned_to_chunks(members, end):
            continue
        if all(
            group_holds(groups[p], num_keys[p], partial(held, p), computed, end, rule)
            for p in positions
        ):
            return end
    return computed


def _largest_prefix_end(
    gc: GroupChunking, num_keys: int, held: Callable[[int], bool], computed: int, limit: int,
    align: bool, rule: WindowRule,
) -> int:
    """:func:`_largest_end` of one full-attention group, found by bisection: its
    :func:`needed_chunks` at a smaller end are a prefix of those at a larger one, so
    :func:`group_holds` holds up to some end and fails past it."""
    tpc = gc.tokens_per_chunk
    ends = list(range(computed // tpc * tpc + tpc, limit, tpc))  # chunk ends past computed
    if limit > computed and (not align or aligned_to_chunks((gc,), limit)):
        ends.append(limit)
    held_up_to = bisect_left(
        ends, True, key=lambda end: not group_holds(gc, num_keys, held, computed, end, rule)
    )
    return ends[held_up_to - 1] if held_up_to else computed


def _full_groups_end(
    groups: Sequence[GroupChunking], num_keys: Sequence[int], held: Callable[[int, int], bool],
    computed: int, limit: int, align: bool, rule: WindowRule,
) -> int | None:
    """The end after the full groups decide in order (``limit`` without any); None when one
    of them holds less than one chunk past ``computed``."""
    end = limit
    for p, gc in enumerate(groups):
        if gc.window_in_chunks is not None:
            continue
        end = _largest_prefix_end(gc, num_keys[p], partial(held, p), computed, end, align, rule)
        if not at_least_one_chunk(gc, computed, end):
            return None
    return end


def hit(
    groups: Sequence[GroupChunking],
    num_keys: Sequence[int],
    held: Callable[[int, int], bool],
    computed: int,
    limit: int,
    align: bool,
    rule: WindowRule = WindowRule.TOKENS_BEFORE_END,
) -> int:
    """Tokens past ``computed`` a lookup hits (``held(g, k)``: chunk ``k`` of the group at
    position ``g`` is in the store; ``limit`` from :func:`hit_limit`).

    The full groups decide first, in order: each lowers the end to the largest one it
    holds (:func:`group_holds`, :func:`aligned_to_chunks` when ``align``).  Then the
    hit ends at the largest end not past that which every windowed group holds (and
    is aligned to).  No hit (0) unless each full group's end and the hit are
    :func:`at_least_one_chunk` of the groups that decided them.
    """
    windowed = [p for p, gc in enumerate(groups) if gc.window_in_chunks is not None]
    full_end = _full_groups_end(groups, num_keys, held, computed, limit, align, rule)
    if full_end is None:
        return 0
    end = full_end
    if windowed:
        end = _largest_end(groups, windowed, num_keys, held, computed, end, align, rule)
        if not all(at_least_one_chunk(groups[p], computed, end) for p in windowed):
            return 0
    return end - computed


def lookup_deferred(
    groups: Sequence[GroupChunking],
    computed: int,
    end: int,
    pending: Callable[[int, int], bool],
    being_loaded: Callable[[int, int], bool],
    rule: WindowRule = WindowRule.TOKENS_BEFORE_END,
) -> bool:
    """A lookup whose :func:`hit` ends at ``end`` (past ``computed``) answers "ask again
    later" instead: when a chunk the hit needs (:func:`needed_chunks`) is still being
    written (``pending(g, k)``: the store answered HIT_PENDING, held but not readable
    yet), or a chunk it loads (:func:`loaded_chunks`) is being loaded for another
    request (``being_loaded(g, k)``: that load fills the GPU prefix cache, which then
    serves the chunk; loading it twice would waste the transfer).

    Only the chunks of the final hit count.  :func:`hit` counts pending chunks as
    held, so waiting never buys a longer hit, and a hit of 0 is never deferred
    (there is nothing to wait for)."""
    return any(
        any(pending(p, k) for k in needed_chunks(gc, computed, end, rule))
        or any(being_loaded(p, k) for k in loaded_chunks(gc, computed, end, rule))
        for p, gc in enumerate(groups)
    )


def full_attention_end(
    groups: Sequence[GroupChunking],
    num_keys: Sequence[int],
    held: Callable[[int, int], bool],
    computed: int,
    limit: int,
    align: bool,
    rule: WindowRule = WindowRule.TOKENS_BEFORE_END,
) -> int | None:
    """Where the full-attention groups alone would end a hit (the first phase of
    :func:`hit`), when windowed groups follow them; None without both kinds, or when
    a full group holds less than one chunk past ``computed``."""
    kinds = {gc.window_in_chunks is None for gc in groups}
    if kinds != {True, False}:
        return None
    return _full_groups_end(groups, num_keys, held, computed, limit, align, rule)


def shared_prefix_junction(
    full_end: int | None, computed: int, hit_tokens: int, retention_interval: int | None,
) -> int | None:
    """A junction the request's stores must keep: under sparse or periodic retention,
    when windowed groups cut a hit short of :func:`full_attention_end`, that end becomes
    a reachable boundary (a store-mask boundary, like the prompt's last token), so the
    next request sharing the prefix finds the window there.  Without it, a shared
    prefix whose windows were never stored at its end is recomputed by every request.
    None: no junction (dense retention keeps every window already)."""
    if retention_interval is None or full_end is None:
        return None
    return full_end if full_end > computed + hit_tokens else None


# ---------------------------------------------------------------------------
# The engine's GPU prefix cache (reference/economics.py)
# ---------------------------------------------------------------------------


def gpu_prefix_hit(
    prefix_tokens: int, prompt_tokens: int, gpu_alignment: int, prefix_held: bool,
) -> int:
    """The GPU prefix cache's hit for a request whose first ``prefix_tokens`` are a
    shared prefix (a system prompt): 0 unless the GPU cache holds that prefix
    (``prefix_held``: an earlier request computed it and the cache kept it); else the
    prefix, at most ``prompt_tokens - 1`` (the request's last token is always
    computed), rounded down to ``gpu_alignment`` (the least common multiple of the
    groups' tokens per block: a GPU hit ends where every group's blocks end)."""
    if not prefix_held:
        return 0
    return round_down(min(prefix_tokens, prompt_tokens - 1), gpu_alignment)


def pinned_junction(
    offload_junction: int | None, gpu_hit: int, retention_interval: int | None,
) -> int:
    """The shared-prefix boundary a request's stores keep (0: none): the offload side's
    :func:`shared_prefix_junction`, and, under sparse or periodic retention, the GPU hit
    (the GPU cache pins the shared prefix it serves, so the windows at its end are
    stored and a request that finds the prefix only offloaded can hit there); the later
    of the two.  Dense retention keeps every window already: no GPU pin."""
    junction = offload_junction or 0
    if gpu_hit and retention_interval is not None:
        junction = max(junction, gpu_hit)
    return junction
