"""Rule mutants: single-line faults in the reference's rules (the oracle side of every lane).

One or more per rule of ``docs/semantics.md`` section 8 (windows, stores, hits:
``tests/test_semantics_coverage.py`` holds every listed rule to a mutant), plus keys
``(group, chunk)``, knob resolution, the fast path's slot layout
(``reference.transfer_fast``) and the byte-layout spec (``reference.transfer``:
block placement, chunks of a job, tensor regions).  Each replaces one reference
function by a copy with one edit (:mod:`conformance.meta.mutants.source`); the lanes compare the
reference against vLLM's recorded behaviour, so a wrong rule must show.

Patch targets live in :data:`TARGETS`, one row per rule, so a moved function is
re-pointed in one place (``reference.rules`` is the declarative core; the
planner and knobs import from it).
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable

from conformance.meta.mutants.source import (
    BLOCK_HASH,
    CAPACITY,
    EAGLE,
    LAST_TOKEN,
    ORDER_KEYS,
    STRIDE,
    SWA_EDGE,
    Edit,
    LineEdit,
    Mutant,
    one,
)


def _mod(name: str) -> Callable[[], types.ModuleType]:
    return lambda: importlib.import_module(name)


TARGETS: dict[str, tuple[str, str]] = {
    # rule: (module, function or Class.method)
    "window in chunks": ("reference.rules", "window_in_chunks"),
    "eagle extra chunk": ("reference.rules", "eagle_extra_chunks"),
    "storable chunks": ("reference.rules", "storable_chunk_count"),
    "computed after a step": ("reference.rules", "computed_after_step"),
    "needed chunks for a hit": ("reference.rules", "needed_chunks"),
    "hit limit (last token)": ("reference.rules", "hit_limit"),
    "store mask window": ("reference.rules", "window_blocks_before_boundary"),
    "reachable blocks": ("reference.rules", "reachable_block_mask"),
    "chunk accepted": ("reference.rules", "chunk_accepted"),
    "store horizon": ("reference.rules", "store_horizon"),
    "reconsidered chunks": ("reference.rules", "reconsider_from"),
    "hit": ("reference.rules", "hit"),
    "offloadable tokens": ("reference.rules", "offloadable_tokens"),
    "final tail blocks": ("reference.rules", "final_tail_blocks"),
    "stored chunks": ("reference.rules", "storable_chunks"),
    "offered under the prompt horizon": ("reference.rules", "offered_under_prompt_horizon"),
    "loaded chunks": ("reference.rules", "loaded_chunks"),
    "group holds": ("reference.rules", "group_holds"),
    "at least one chunk": ("reference.rules", "at_least_one_chunk"),
    "aligned to chunks": ("reference.rules", "aligned_to_chunks"),
    "lookup deferred": ("reference.rules", "lookup_deferred"),
    "first kept block": ("reference.rules", "first_kept_block"),
    "full-attention end": ("reference.rules", "full_attention_end"),
    "shared-prefix junction": ("reference.rules", "shared_prefix_junction"),
    "GPU prefix hit": ("reference.rules", "gpu_prefix_hit"),
    "pinned junction": ("reference.rules", "pinned_junction"),
    "key bytes": ("reference.keys", "make_key"),
    "chunk keys": ("reference.keys", "group_keys"),
    "resolution": ("reference.knobs", "resolve"),
    "block_size knob": ("reference.knobs", "_blocks_for_block_size"),
    "slot layout": ("reference.transfer_fast", "plan_copies"),
    "sub-slot layout": ("reference.transfer_fast", "plan_copies"),
    "spec: block placement": ("reference.transfer", "place"),
    "spec: chunks of a job": ("reference.transfer", "chunks_of"),
    "spec: tensor region": ("reference.transfer", "TransferLayout.region_offset"),
    "eviction unit": ("reference.eviction", "eviction_unit"),
    "eviction order": ("reference.eviction", "passed_windows_unit"),
    "window siblings": ("reference.eviction", "Disk.arrives_stranded"),
    "prefix-closed head": ("reference.eviction", "prefix_closed_head"),
    "unit recency": ("reference.eviction", "unit_last_use"),
    "stranded": ("reference.eviction", "Disk.stranded_among"),
}
"""Where each rule lives now (re-point here when the reference moves a function)."""


def _r(name: str, bug_class: str, fault: str, rule: str, edits: tuple[Edit, ...],
       equivalent: str | None = None) -> Mutant:
    module, target = TARGETS[rule]
    return Mutant(name, bug_class, fault, LineEdit(_mod(module), target, edits), "reference",
                  equivalent)


_LAST_TOKEN_OLD = (
    "    if windowed and rule is LastTokenRule.REQUEST_END:\n        limit -= 1\n"
    "    for cap in caps:\n        if cap is not None:\n"
    "            limit = min(limit, computed + cap)\n    if windowed:\n"
    "        if rule is LastTokenRule.AFTER_CAPS:\n            limit -= 1\n"
)

MUTANTS: tuple[Mutant, ...] = (
    _r("rule_window_floored", SWA_EDGE, "window in chunks rounded down instead of up",
       "window in chunks", one("cdiv(group.sliding_window, tokens_per_chunk)",
                               "group.sliding_window // tokens_per_chunk")),
    _r("rule_window_ignores_unaligned_end", SWA_EDGE,
       "an unaligned hit end does not reach one chunk further left",
       "window in chunks", one("pad = -end_tokens % tokens_per_chunk", "pad = 0")),
    _r("rule_window_ignores_retained", EAGLE, "the window drops extra_retained_tokens (MTP)",
       "window in chunks", one("group.sliding_window - 1 + group.extra_retained_tokens + pad",
                               "group.sliding_window - 1 + pad")),
    _r("rule_eagle_no_extra_chunk", EAGLE, "an EAGLE group needs no chunk past the hit",
       "eagle extra chunk", one("return 1 if group.is_eagle else 0", "return 0")),
    _r("rule_storable_ignores_allocation", SWA_EDGE,
       "storable chunks not capped by the blocks allocated", "storable chunks",
       one("return min(n, num_blocks // gc.blocks_per_chunk, num_keys)",
           "return min(n, num_keys)")),
    _r("rule_storable_eagle_tail", EAGLE, "an EAGLE group's volatile last chunk is storable",
       "storable chunks", one("n = max(0, n - 1)", "n = max(0, n - 0)")),
    _r("rule_finished_stores_last_token", LAST_TOKEN,
       "a finished request stores its last sampled (uncommitted) token", "computed after a step",
       one("return min(num_computed, max(num_prompt, num_tokens - 1))",
           "return min(num_computed, num_tokens)")),
    _r("rule_needed_window_one_short", SWA_EDGE, "a windowed hit needs one chunk less",
       "needed chunks for a hit",
       one("return range(max(first, stop - window - eagle_extra_chunks(gc.group)), stop)",
           "return range(max(first, stop - window + 1 - eagle_extra_chunks(gc.group)), stop)")),
    _r("rule_last_token_kept", LAST_TOKEN,
       "with windowed groups the hit may end at the last token (no -1, either rule)",
       "hit limit (last token)",
       one(_LAST_TOKEN_OLD, _LAST_TOKEN_OLD.replace("limit -= 1", "limit -= 0"))),
    _r("rule_store_mask_window_one_short", SWA_EDGE,
       "a boundary's store mask keeps one block less of the window", "store mask window",
       one("return cdiv(window - 1, group.tokens_per_block) + eagle_extra_chunks(group)",
           "return cdiv(window - 1, group.tokens_per_block) - 1 + eagle_extra_chunks(group)")),
    _r("rule_mask_window_one_block_short", SWA_EDGE,
       "a segment's reachable window tail is one block shorter", "reachable blocks",
       one("if i >= shift and (i - shift) % per_segment >= per_segment - need:",
           "if i >= shift and (i - shift) % per_segment > per_segment - need:")),
    _r("rule_mask_boundary_ignores_eagle_shift", EAGLE,
       "a reachable boundary's window is not shifted by an EAGLE group's extra chunk",
       "reachable blocks",
       one("end = round_down(boundary, alignment_tokens) // tpb + shift",
           "end = round_down(boundary, alignment_tokens) // tpb")),
    _r("rule_chunk_checks_first_block", SWA_EDGE,
       "a chunk is refused when its first block is null, not its last", "chunk accepted",
       one("if blocks[-1] == 0:", "if blocks[0] == 0:")),
    _r("rule_chunk_accepted_unreachable", SWA_EDGE,
       "a chunk no hit can use is still stored", "chunk accepted",
       one("return any(reachable) and not any(", "return not any(")),
    _r("rule_horizon_at_prompt_when_finished", SWA_EDGE,
       "a finished request's final boundary is its prompt's last chunk, not its last",
       "store horizon", one("        return num_chunks\n", "        return prompt_chunks\n")),
    _r("rule_horizon_off_by_one", SWA_EDGE,
       "the prompt horizon ends one chunk before the prompt's last chunk is stored",
       "store horizon",
       one("return prompt_chunks if num_chunks <= prompt_chunks else None",
           "return prompt_chunks if num_chunks < prompt_chunks else None")),
    _r("rule_reconsider_from_end", SWA_EDGE,
       "a finished request re-offers from its end, not its last segment's start",
       "reconsidered chunks",
       one("return (end_block - end_block % tail) // gc.blocks_per_chunk",
           "return end_block // gc.blocks_per_chunk")),
    _r("rule_offload_prompt_only_ignored", LAST_TOKEN,
       "offload_prompt_only does not cap the offloadable tokens at the prompt",
       "offloadable tokens",
       one("return min(n, num_prompt_tokens) if prompt_only else n", "return n")),
    _r("rule_final_tail_for_eagle", EAGLE,
       "an EAGLE sliding-window group gets a final tail segment (re-offered chunks)",
       "final tail blocks",
       one("if alignment_tokens is None or g.is_eagle or g.kind",
           "if alignment_tokens is None or g.kind")),
    _r("rule_stored_horizon_in_chunks", STRIDE,
       "the store mask's final boundary passed in chunks, not blocks", "stored chunks",
       one("None if horizon is None else horizon * bpc,", "horizon,")),
    _r("rule_offered_mask_from_chunk_0", SWA_EDGE,
       "chunks already offered read the prompt mask from chunk 0, not from start",
       "offered under the prompt horizon",
       one("mask is None or any(mask[(k - start) * bpc : (k - start + 1) * bpc])",
           "mask is None or any(mask[k * bpc : (k + 1) * bpc])")),
    _r("rule_load_reads_eagle_peek", EAGLE, "a load reads an EAGLE group's peek chunk too",
       "loaded chunks",
       one("return range(chunks.start, chunks.stop - eagle_extra_chunks(gc.group))",
           "return range(chunks.start, chunks.stop)")),
    _r("rule_holds_last_key_unusable", ORDER_KEYS,
       "a group's last keyed chunk never serves a hit (< num_keys, not <=)", "group holds",
       one("return chunks.stop <= num_keys and", "return chunks.stop < num_keys and")),
    _r("rule_one_chunk_exclusive", SWA_EDGE,
       "a hit of exactly one chunk is refused (> tokens_per_chunk, not >=)",
       "at least one chunk",
       one("return end - computed >= gc.tokens_per_chunk",
           "return end - computed > gc.tokens_per_chunk")),
    _r("rule_aligned_to_any_group", ORDER_KEYS,
       "with max_load_tokens a hit may end on a chunk end of any one group, not all",
       "aligned to chunks",
       one("return all(end % gc.tokens_per_chunk == 0 for gc in groups)",
           "return any(end % gc.tokens_per_chunk == 0 for gc in groups)")),
    _r("rule_deferred_by_peek_loading", EAGLE,
       "a lookup waits for another request's load of a chunk it only peeks at",
       "lookup deferred",
       one("or any(being_loaded(p, k) for k in loaded_chunks(gc, computed, end, rule))",
           "or any(being_loaded(p, k) for k in needed_chunks(gc, computed, end, rule))")),
    _r("rule_kept_blocks_whole_window", SWA_EDGE,
       "a window keeps blocks from W tokens before the hit end, not W - 1", "first kept block",
       one("hit_end - (g.sliding_window - 1 + g.extra_retained_tokens)",
           "hit_end - (g.sliding_window + g.extra_retained_tokens)")),
    _r("rule_full_end_without_windows", SWA_EDGE,
       "the full-attention end is reported when no windowed group follows", "full-attention end",
       one("if kinds != {True, False}:", "if True not in kinds:")),
    _r("rule_junction_at_hit_end", SWA_EDGE,
       "a hit that reaches the full-attention end still pins it as a junction",
       "shared-prefix junction",
       one("return full_end if full_end > computed + hit_tokens else None",
           "return full_end if full_end >= computed + hit_tokens else None")),
    _r("rule_gpu_hit_reaches_last_token", LAST_TOKEN,
       "the GPU prefix hit may cover the request's last token", "GPU prefix hit",
       one("return round_down(min(prefix_tokens, prompt_tokens - 1), gpu_alignment)",
           "return round_down(min(prefix_tokens, prompt_tokens), gpu_alignment)")),
    _r("rule_gpu_hit_unaligned", STRIDE,
       "the GPU prefix hit is not rounded to the groups' common block end", "GPU prefix hit",
       one("return round_down(min(prefix_tokens, prompt_tokens - 1), gpu_alignment)",
           "return min(prefix_tokens, prompt_tokens - 1)")),
    _r("rule_gpu_pin_under_dense", SWA_EDGE,
       "the GPU hit is pinned as a junction under dense retention too", "pinned junction",
       one("if gpu_hit and retention_interval is not None:", "if gpu_hit:")),
    _r("rule_gpu_pin_replaces_offload_junction", SWA_EDGE,
       "the GPU hit replaces a later offload junction instead of the later of the two",
       "pinned junction", one("junction = max(junction, gpu_hit)", "junction = gpu_hit")),
    _r("rule_hit_windowed_from_limit", SWA_EDGE,
       "the windowed groups search from the hit limit, not the full groups' end", "hit",
       one("end = _largest_end(groups, windowed, num_keys, held, computed, end, align, rule)",
           "end = _largest_end(groups, windowed, num_keys, held, computed, limit, align, rule)")),
    _r("rule_key_drops_group", ORDER_KEYS, "keys no longer encode the group (not injective)",
       "key bytes", one('group_index.to_bytes(GROUP_ID_BYTES, "big", signed=False)',
                        '(0).to_bytes(GROUP_ID_BYTES, "big", signed=False)')),
    _r("rule_key_first_hash", ORDER_KEYS, "a chunk is keyed by its first hash, not its last",
       "chunk keys", one("block_hashes[hpc - 1 :: hpc]", "block_hashes[0::hpc]")),
    _r("rule_hashes_per_chunk_in_blocks", ORDER_KEYS,
       "hashes per chunk counted in blocks, not hash units", "resolution",
       one("hashes_per_chunk=tpc // tph,", "hashes_per_chunk=b,")),
    _r("rule_alignment_over_all_groups", SWA_EDGE,
       "the alignment span taken over every group, not the full-attention ones", "resolution",
       one("full_spans = {gc.tokens_per_chunk for gc in chunkings if gc.window_in_chunks is None}",
           "full_spans = {gc.tokens_per_chunk for gc in chunkings}")),
    _r("rule_block_size_floored", BLOCK_HASH,
       "block_size tokens floored to whole blocks instead of rejected", "block_size knob",
       one("    if tokens % tpb:", "    if False:")),
    _r("rule_slot_regions_overlap", STRIDE,
       "a tensor's region in a slot ignores blocks_per_chunk (regions overlap)", "slot layout",
       one("piece = _Piece(group_blocks, group_slots, group_subs, starts[t] * b, b, ref.nbytes)",
           "piece = _Piece(group_blocks, group_slots, group_subs, starts[t], b, ref.nbytes)")),
    _r("rule_sub_slot_stride_of_tensor0", STRIDE,
       "every tensor's sub-slots strided by tensor 0's page size", "sub-slot layout",
       one("_tensor_copies(t, layout.page_bytes[t], pieces[t])",
           "_tensor_copies(t, layout.page_bytes[0], pieces[t])")),
    _r("spec_sub_slots_reversed", STRIDE,
       "the spec places a chunk's blocks in its sub-slots last to first", "spec: block placement",
       one("return position // blocks_per_chunk, position % blocks_per_chunk",
           "return position // blocks_per_chunk, "
           "blocks_per_chunk - 1 - position % blocks_per_chunk")),
    _r("spec_last_chunk_past_the_blocks", STRIDE,
       "the spec's chunks of a job end at the block after the last (one chunk too many "
       "when the job ends on a chunk end)", "spec: chunks of a job",
       one("last_chunk, _ = place(first + n - 1, blocks_per_chunk)",
           "last_chunk, _ = place(first + n, blocks_per_chunk)")),
    _r("spec_regions_ignore_blocks_per_chunk", STRIDE,
       "the spec's tensor regions in a slot ignore blocks_per_chunk (regions overlap)",
       "spec: tensor region",
       one("return sum(self.page_bytes[:tensor]) * self.blocks_per_chunk[group]",
           "return sum(self.page_bytes[:tensor])")),
    _r("rule_eviction_takes_a_prefix", CAPACITY,
       "a file goes even when full-attention chunks that stay need it (a non-leaf: the "
       "chunks after it in their prefix are stranded)", "eviction unit",
       one("return None  # a full-attention chunk that stays would lose its parent",
           "pass  # a full-attention chunk that stays would lose its parent")),
    _r("rule_eviction_any_windows_first", CAPACITY,
       "the rule's first step takes any window file, not only those of boundaries one prefix "
       "went on past: the windows of the latest boundary, where the next hit ends, go first",
       "eviction order",
       one("        if not f.ready or f.pins or not _passed_by_one_prefix(disk, f.keys):",
           "        if not f.ready or f.pins:")),
    _r("rule_window_sibling_always_to_come", CAPACITY,
       "admission (window_siblings) takes a sibling window chunk that ends before the store's "
       "keys to be still to come: window chunks whose earlier siblings never arrive are "
       "admitted and stranded", "window siblings",
       one("return end is None or last is None or end > last", "return True")),
    _r("rule_unit_recency_by_leaf", CAPACITY,
       "the rule takes leaves' units by their least recently used file (in effect the leaf's "
       "own use), not their most recently used: a tip's unit whose window file a new "
       "session's hit at a shared junction has just read goes first, and the junction's "
       "windows with it", "unit recency",
       one("return max(disk.files[fid].last_use for fid in unit)",
           "return min(disk.files[fid].last_use for fid in unit)")),
    _r("rule_stranded_ignores_window_siblings", CAPACITY,
       "a window key counts loadable when its boundary's full-attention keys are reachable, "
       "its sibling window keys unchecked: a boundary with a gap on a window group counts "
       "whole, so its window chunks stay on an idle disk, stranded, and a unit leaves them",
       "stranded",
       one(") and all(k in self.file_of for k in s.windows_at[boundary])", ") and True")),
    _r("rule_head_without_windows", CAPACITY,
       "a prefix-closed head leaves out the window keys that make its boundaries whole (no hit "
       "can end at them)", "prefix-closed head",
       one("chosen.update(w for w in windows if any(whole(b) for b in s.serves.get(w, ())))",
           "pass")),
)
"""Every rule mutant, in rule order."""

BY_NAME = {m.name: m for m in MUTANTS}
