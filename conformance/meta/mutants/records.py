"""The mutation score's records: the open gaps, the last measured score, catcher hints.

Data, not logic (:mod:`conformance.meta.mutation` runs the mutants).  ``KNOWN_GAPS``:
each survivor and the check it lacks (``test_mutant_is_caught`` makes it a strict
xfail, so closing a gap fails until its record goes).  ``EXPECTED_CATCHERS``: the
check whose assertion caught each mutant on the last full run, tried first (a speed-up only:
a stale hint costs time, never an outcome).  Regenerate both from
``python -m conformance.meta.mutation`` output.
"""

from __future__ import annotations

KNOWN_GAPS: dict[str, str] = {
    "eagle_lookup_no_extra_chunk": "vLLM's own CPU manager asserts ('Chunk ... not found in "
                                   "cache') while the mutated lookup's load is prepared, before "
                                   "any recorded answer differs: a crash of vLLM, not a "
                                   "divergence a check asserts",
    "window_ignores_retained_tokens": "the same vLLM assertion ('Chunk ... not found in cache') "
                                      "stops the recorded run before any answer differs",
    "store_group_sizes_count_nulls": "vLLM's own GPULoadStoreSpec asserts sum(group_sizes) == "
                                     "len(block_ids) when the mutated store job is built: the "
                                     "trace ends in vLLM's crash, never reaching a comparison",
    "padded_attention_page_transferred": "vLLM's worker asserts in register_kv_caches (page "
                                         "sizes) before any byte moves, so the data lane's byte "
                                         "checks never run",
}
"""Mutants no check's assertion catches on 0.34.0 and 0.33.0 (00:56 UTC run), and why: each
only crashes vLLM's own code (an ``assert`` inside vLLM), which does not count."""

MEASURED_SCORE = ("the committed reports/conformance-<release>.md, 'Score (caught by "
                  "assertion / non-equivalent mutants)'")
"""Where the last measured score is, quoted by ``test_mutation_score``'s message when it
fails: the committed reports hold the figure (the README's sentence is generated from them),
so no second copy of it can drift here."""

EXPECTED_CATCHERS: dict[str, str] = {
    'hash_unit_from_scheduler_block':
        'config::test_resolution_agrees[synthetic-full-swa blocks_per_chunk=2]',
    'uniform_block_assert_relaxed':
        'config::test_config_deviation_is_a_vllm_rejection[synthetic-full-swa block_size=512]',
    'block_size_remainder_dropped':
        'config::test_resolution_agrees[synthetic-full-mamba-align block_size=100]',
    'zero_blocks_per_chunk_accepted':
        'config::test_vllm_rejects_the_knob_cleanly[synthetic-full-swa blocks_per_chunk=0]',
    'eagle_group_unannotated':
        'config::test_resolution_agrees[synthetic-eagle blocks_per_chunk=2]',
    'eagle_store_keeps_volatile_tail':
        'plan::test_plans_agree_at_the_edges[fa64+eagle-sw128@16 decode stores/blocks_per_chunk=1 offload_prompt_only=False/retention=0]/workload4',
    'hashes_per_chunk_in_blocks':
        'config::test_resolution_agrees[synthetic-full-swa blocks_per_chunk=2]',
    'key_at_first_hash_of_chunk':
        'plan::test_plans_agree[fa64+sw40@16/blocks_per_chunk=2/retention=0]/workload0',
    'key_group_index_zero':
        'plan::test_plans_agree[fa64+sw40@16/blocks_per_chunk=2/retention=0]/workload0',
    'groups_sorted_by_block_size':
        'plan::test_plans_agree[fa64+sw40@16/blocks_per_chunk=2/retention=0]/workload0',
    'lookup_windowed_groups_first':
        'plan::test_plans_agree[fa64+eagle-sw128@16/blocks_per_chunk=2/retention=0]/workload0',
    'window_chunks_floored':
        'plan::test_plans_agree_at_the_edges[fa64+sw33@16/blocks_per_chunk=2/retention=0]/workload0',
    'store_null_check_on_first_block':
        'plan::test_plans_agree_at_the_edges[fa64+sw16@16/blocks_per_chunk=4/retention=0]/workload3',
    'store_block_indices_in_chunks':
        'plan::test_plans_agree[fa64+sw40@16/blocks_per_chunk=2/retention=0]/workload0',
    'load_block_indices_from_computed':
        'plan::test_plans_agree[fa64+sw40@16/blocks_per_chunk=2/retention=0]/workload0',
    'load_first_chunk_rounded_up':
        'plan::test_plans_agree[fa64+sw40@16/blocks_per_chunk=2/retention=0]/workload0',
    'last_token_not_recomputed':
        'plan::test_plans_agree[fa64+sw128@16/blocks_per_chunk=2/retention=None]/workload0',
    'capacity_row_per_group':
        'plan::test_tier_holds_what_it_was_sized_for[fa64+sw40@16/blocks_per_chunk=2/retention=0]',
    'free_chunks_off_by_one':
        'plan::test_full_tier_evicts_what_capacity_requires[full@16 full tier/blocks_per_chunk=4/retention=0/cpu=4]/workload0',
    'block_stride_from_page':
        'data::test_synthetic_loads_carry_the_stored_bytes[synthetic-full-swa-2layer-bpc2-planned-BLHNC]',
    'byte_offset_in_elements':
        'data::test_synthetic_loads_carry_the_stored_bytes[synthetic-full-swa-2layer-bpc2-planned]',
    'rule_window_floored':
        'plan::test_plans_agree_at_the_edges[fa64+sw33@16/blocks_per_chunk=2/retention=0]/workload0',
    'rule_window_ignores_unaligned_end':
        'plan::test_edge_workloads_agree[fa64+sw32+mtp1@16/blocks_per_chunk=2/retention=0]/workload5',
    'rule_window_ignores_retained':
        'plan::test_plans_agree_at_the_edges[fa64+sw32+mtp2@16/blocks_per_chunk=2/retention=0]/workload5',
    'rule_eagle_no_extra_chunk':
        'plan::test_plans_agree_at_the_edges[fa64+eagle-sw128@16 decode stores/blocks_per_chunk=1 offload_prompt_only=False/retention=0]/workload0',
    'rule_storable_ignores_allocation':
        'tests::tests/test_rules.py::test_store_rules',
    'rule_storable_eagle_tail':
        'plan::test_plans_agree_at_the_edges[fa64+eagle-sw128@16 decode stores/blocks_per_chunk=1 offload_prompt_only=False/retention=0]/workload4',
    'rule_finished_stores_last_token':
        'tests::tests/test_rules.py::test_store_rules',
    'rule_needed_window_one_short':
        'plan::test_plans_agree[fa64+sw40@16/blocks_per_chunk=2/retention=0]/workload5',
    'rule_last_token_kept':
        'plan::test_plans_agree[fa64+sw128@16/blocks_per_chunk=2/retention=None]/workload0',
    'rule_store_mask_window_one_short':
        'plan::test_plans_agree[fa64+sw40@16/blocks_per_chunk=2/retention=0]/workload0',
    'rule_mask_window_one_block_short':
        'plan::test_edge_workloads_agree[fa64+sw40@16/blocks_per_chunk=2/retention=None]/workload0',
    'rule_mask_boundary_ignores_eagle_shift':
        'plan::test_plans_agree_at_the_edges[fa64+eagle-sw128@16 decode stores/blocks_per_chunk=1 offload_prompt_only=False/retention=0]/workload0',
    'rule_chunk_checks_first_block':
        'plan::test_plans_agree_at_the_edges[fa64+sw16@16/blocks_per_chunk=4/retention=0]/workload3',
    'rule_chunk_accepted_unreachable':
        'plan::test_plans_agree[fa64+sw40@16/blocks_per_chunk=2/retention=0]/workload0',
    'rule_horizon_at_prompt_when_finished':
        'tests::tests/test_rules.py::test_store_horizon_and_reconsider',
    'rule_horizon_off_by_one':
        'plan::test_edge_workloads_agree[fa64+sw40@16/blocks_per_chunk=2/retention=None]/workload0',
    'rule_reconsider_from_end':
        'tests::tests/test_rules.py::test_store_horizon_and_reconsider',
    'rule_hit_windowed_from_limit':
        'tests::tests/test_rules.py::test_hit_on_the_vllm_verified_table',
    'rule_offload_prompt_only_ignored':
        'tests::tests/test_rules.py::test_store_rules',
    'rule_final_tail_for_eagle':
        'tests::tests/test_rules.py::test_eagle_extra_chunks_and_final_tail_blocks',
    'rule_stored_horizon_in_chunks':
        'plan::test_edge_workloads_agree[fa64+sw40@16/blocks_per_chunk=2/retention=None]/workload0',
    'rule_offered_mask_from_chunk_0':
        'tests::tests/test_rules.py::test_offered_under_prompt_horizon',
    'rule_load_reads_eagle_peek':
        'tests::tests/test_rules.py::test_loaded_chunks',
    'rule_holds_last_key_unusable':
        'plan::test_plans_agree[fa64+sw40@16/blocks_per_chunk=2/retention=0]/workload0',
    'rule_one_chunk_exclusive':
        'plan::test_plans_agree[fa64+sw40@16/blocks_per_chunk=2/retention=0]/workload0',
    'rule_aligned_to_any_group':
        'tests::tests/test_rules.py::test_group_holds_minimum_and_alignment',
    'rule_deferred_by_peek_loading':
        'tests::tests/test_rules.py::test_lookup_deferred',
    'rule_kept_blocks_whole_window':
        'tests::tests/test_rules.py::test_first_kept_block',
    'rule_full_end_without_windows':
        'tests::tests/test_rules.py::test_full_attention_end_and_junction',
    'rule_junction_at_hit_end':
        'tests::tests/test_rules.py::test_full_attention_end_and_junction',
    'spec_sub_slots_reversed':
        'tests::tests/test_transfer_catches.py::check_fast_equals_spec',
    'spec_last_chunk_past_the_blocks':
        'tests::tests/test_transfer_catches.py::check_fast_equals_spec',
    'spec_regions_ignore_blocks_per_chunk':
        'tests::tests/test_transfer_catches.py::check_fast_equals_spec',
    'rule_key_drops_group':
        'plan::test_plans_agree[fa64+sw40@16/blocks_per_chunk=2/retention=0]/workload1',
    'rule_key_first_hash':
        'tests::tests/test_rules.py::test_planner_lookup_equals_rules',
    'rule_hashes_per_chunk_in_blocks':
        'config::test_resolution_agrees[synthetic-full-swa blocks_per_chunk=2]',
    'rule_alignment_over_all_groups':
        'config::test_resolution_agrees[synthetic-full-swa blocks_per_chunk=2]',
    'rule_block_size_floored':
        'config::test_resolution_agrees[synthetic-full-mamba-align block_size=100]',
    'rule_slot_regions_overlap':
        'data::test_synthetic_loads_carry_the_stored_bytes[synthetic-full-swa-2layer-bpc2]',
    'rule_sub_slot_stride_of_tensor0':
        'data::test_synthetic_loads_carry_the_stored_bytes[synthetic-unequal-pages-bpc2]',
    'fs_store_failure_reported_done':
        'faults::test_failed_store_is_never_advertised[vllm-enospc]',
}
"""Each caught mutant's catching check (``Check.test_id``) on the last full run: tried
first, so a caught mutant costs one check."""
