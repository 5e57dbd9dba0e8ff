"""Rule mutants: single-line faults in the reference's rules (the oracle side of every lane).

One or more per reference rule: the window in chunks, storable chunks, the chunks
a hit needs, the hit limit (last-token rule), keys ``(group, chunk)``, and the
byte layout of a chunk slot.  Each replaces one reference function by a copy
with one edit (:mod:`conformance.mutants.source`); the lanes compare the
reference against vLLM's recorded behaviour, so a wrong rule must show.

Patch targets live in :data:`TARGETS`, one row per rule, so a moved function is
re-pointed in one place (``reference.rules`` is the declarative core; the
planner and knobs import from it).
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable

from conformance.mutants.source import (
    BLOCK_HASH,
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
    "key bytes": ("reference.keys", "make_key"),
    "chunk keys": ("reference.keys", "group_keys"),
    "resolution": ("reference.knobs", "resolve"),
    "block_size knob": ("reference.knobs", "_blocks_for_block_size"),
    "slot layout": ("reference.transfer", "TransferLayout.region_offset"),
    "sub-slot layout": ("reference.transfer", "plan_copies"),
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
       "window in chunks", one("cdiv(group.sliding_window, tokens_per_chunk),",
                               "group.sliding_window // tokens_per_chunk,")),
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
       one("return self._tensor_starts[tensor] * self.blocks_per_chunk[group]",
           "return self._tensor_starts[tensor]")),
    _r("rule_sub_slot_stride_of_tensor0", STRIDE,
       "every tensor's sub-slots strided by tensor 0's page size", "sub-slot layout",
       one("_tensor_copies(t, layout.page_bytes[t], pieces[t])",
           "_tensor_copies(t, layout.page_bytes[0], pieces[t])")),
)
"""Every rule mutant, in rule order."""

BY_NAME = {m.name: m for m in MUTANTS}
