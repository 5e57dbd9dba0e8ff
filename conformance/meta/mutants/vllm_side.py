"""vLLM-side mutants: single-line faults in vLLM's own offloading config, scheduler and worker.

Each is the kind of bug the upstream trackers keep reporting (anchors.md section
3.2), applied in process by :meth:`Mutant.apply` (a monkeypatched copy of one
function with one line edited; site-packages is never touched).  The modules come
from ``conformance.harness.vllm_harness_api.MUTATION_TARGETS`` (the harness's vLLM importer).  Every
edit applies on 0.33.0 and 0.34.0; where the line differs, the edit carries one
alternative per release and ``releases`` says so.
"""

from __future__ import annotations

import types

from conformance.meta.mutants.source import (
    BLOCK_HASH,
    CAPACITY,
    EAGLE,
    LAST_TOKEN,
    ORDER_KEYS,
    PADDING,
    STRIDE,
    SWA_EDGE,
    Edit,
    LineEdit,
    Mutant,
    one,
)


def _module(short: str) -> types.ModuleType:
    from conformance.harness import vllm_harness_api as V

    return V.MUTATION_TARGETS[short]


def _config() -> types.ModuleType:
    return _module("offloading.config")


def _sched() -> types.ModuleType:
    return _module("offloading.scheduler")


def _worker() -> types.ModuleType:
    return _module("offloading.worker")


def _cpu_spec() -> types.ModuleType:
    return _module("kv_offload.cpu.spec")


def _cpu_manager() -> types.ModuleType:
    return _module("kv_offload.cpu.manager")


def _fs_tier() -> types.ModuleType:
    from conformance.harness import vllm_harness_api as V

    return V.fs_tier_module


FS_STORE = "fs-tier store failures"
"""A file-tier store that failed (full disk, I/O error, read-only root, a cut write)."""


def _m(name: str, bug_class: str, fault: str, module: object, target: str,
       edits: tuple[Edit, ...], releases: str = "", equivalent: str | None = None) -> Mutant:
    edit = LineEdit(module, target, edits)  # type: ignore[arg-type]
    return Mutant(name, bug_class, fault, edit, "vllm", equivalent, releases)


_CFG, _SCH = "build_offloading_config", "OffloadingConnectorScheduler"
_FROM_SPEC = "SchedulerOffloadConfig.from_spec"
_STORE, _LOAD = f"{_SCH}._build_store_jobs", f"{_SCH}.update_state_after_alloc"
_LOOKUP = f"{_SCH}._lookup_complete_chunks"

MUTANTS: tuple[Mutant, ...] = (
    # -- 1. block-size and hash asserts at boot ---------------------------------
    _m("hash_unit_from_scheduler_block", BLOCK_HASH,
       "tokens_per_hash taken from the scheduler block size, not the hash size (vllm#42992)",
       _config, _CFG, one("_, tokens_per_hash = resolve_kv_cache_block_sizes(",
                          "tokens_per_hash, _ = resolve_kv_cache_block_sizes(")),
    _m("uniform_block_assert_relaxed", BLOCK_HASH,
       "block_size accepted on groups with different block sizes (one picked arbitrarily)",
       _config, _CFG, one("assert len(unique_tokens_per_block) == 1, (",
                          "assert len(unique_tokens_per_block) >= 1, (")),
    _m("block_size_remainder_dropped", BLOCK_HASH,
       "a block_size that is no multiple of the GPU block is floored instead of rejected",
       _config, _CFG, one("if tokens_per_chunk_int % tokens_per_block == 0:",
                          "if tokens_per_chunk_int >= tokens_per_block:")),
    _m("zero_blocks_per_chunk_accepted", BLOCK_HASH,
       "blocks_per_chunk=0 passes validation (<= 0 written as < 0)",
       _config, _CFG, one("if blocks_per_chunk <= 0:", "if blocks_per_chunk < 0:")),
    # -- 2. EAGLE/MTP draft groups -----------------------------------------------
    _m("eagle_group_unannotated", EAGLE,
       "the draft group is not flagged is_eagle_group (treated as a target-model group)",
       _sched, _FROM_SPEC, one("is_eagle_group=group_id in eagle_groups,",
                               "is_eagle_group=False,")),
    _m("eagle_lookup_no_extra_chunk", EAGLE,
       "the EAGLE window lookup does not require the extra (peeked) chunk",
       _sched, _LOOKUP, one("required_window += 1", "required_window += 0")),
    _m("eagle_store_keeps_volatile_tail", EAGLE,
       "while decoding, an EAGLE group's trailing (volatile) chunk is stored",
       _sched, "RequestOffloadState.storable_chunks",
       one("num_chunks = max(0, num_chunks - 1)", "num_chunks = max(0, num_chunks - 0)")),
    _m("window_ignores_retained_tokens", EAGLE,
       "the window in chunks drops the MTP extra_retained_tokens",
       _config, "get_sliding_window_size_in_chunks",
       one("kv_cache_spec.sliding_window - 1 + kv_cache_spec.extra_retained_tokens,",
           "kv_cache_spec.sliding_window - 1,")),
    # -- 3. group order, positional contract, key granularity --------------------
    _m("hashes_per_chunk_in_blocks", ORDER_KEYS,
       "hashes_per_chunk counted in GPU blocks, not hash units (llm-d#656 granularity)",
       _sched, _FROM_SPEC, one("// spec.tokens_per_hash", "// tokens_per_block")),
    _m("key_at_first_hash_of_chunk", ORDER_KEYS,
       "a chunk is keyed by its first hash instead of its last",
       _sched, "RequestOffloadState.update_offload_keys",
       (Edit("start = stride * (len(group_state.offload_keys) + 1) - 1",
             "start = stride * len(group_state.offload_keys)"),
        Edit("                - 1,\n                None,",
             "                - group_config.hashes_per_chunk,\n                None,")),
       releases="0.33.0 islice(...) vs 0.34.0 slice: one edit each"),
    _m("key_group_index_zero", ORDER_KEYS,
       "every key encodes group 0 ('Expected group_idx=1 but key encodes 0')",
       _sched, "RequestOffloadState.update_offload_keys",
       one("key = make_offload_key(req_block_hash, group_config.group_idx)",
           "key = make_offload_key(req_block_hash, 0)")),
    _m("groups_sorted_by_block_size", ORDER_KEYS,
       "group configs reordered by block size (breaks the positional contract, vllm#49025)",
       _sched, _FROM_SPEC,
       one("        for group in spec.config.groups:\n            group_id = group.group_id",
           "        for group in sorted(spec.config.groups, key=lambda g: g.tokens_per_block):"
           "\n            group_id = group.group_id")),
    _m("lookup_windowed_groups_first", ORDER_KEYS,
       "the lookup visits sliding-window groups before full-attention groups",
       _sched, f"{_SCH}.__init__",
       one("self._lookup_groups = self._full_attention_groups + self._sliding_window_groups",
           "self._lookup_groups = self._sliding_window_groups + self._full_attention_groups")),
    # -- 4. partial chunks at the sliding-window edge ----------------------------
    _m("window_chunks_floored", SWA_EDGE,
       "window in chunks rounded down (floor) instead of up (cdiv)",
       _config, "get_sliding_window_size_in_chunks",
       one("cdiv(kv_cache_spec.sliding_window, tokens_per_chunk),",
           "kv_cache_spec.sliding_window // tokens_per_chunk,")),
    _m("store_null_check_on_first_block", SWA_EDGE,
       "the store skips a chunk when its FIRST block left the window (not its last)",
       _sched, _STORE, one("- 1 : num_chunks * blocks_per_chunk : blocks_per_chunk",
                           "- blocks_per_chunk : num_chunks * blocks_per_chunk : blocks_per_chunk")),
    _m("store_group_sizes_count_nulls", SWA_EDGE,
       "group_sizes counts null sub-blocks the job's block_ids leave out (vllm#42945)",
       _sched, _STORE,
       (Edit("                        src_block_ids.append(block_id)\n"
             "                        num_group_blocks += 1\n                        if block_id == 0:",
             "                        src_block_ids.extend([block_id] if block_id else [])\n"
             "                        num_group_blocks += 1\n                        if block_id == 0:"),
        Edit("                        if block_id == 0:\n                            continue\n"
             "                        if start_gpu_block_idx is None:",
             "                        num_group_blocks += block_id == 0\n"
             "                        if block_id == 0:\n                            continue\n"
             "                        if start_gpu_block_idx is None:")),
       releases="0.34.0 keeps null placeholders (ids dropped), 0.33.0 skips them (count kept)"),
    _m("store_block_indices_in_chunks", SWA_EDGE,
       "a store job's block_indices holds the first chunk index, not the first block index",
       _sched, _STORE, one("block_indices.append(start_gpu_block_idx or 0)",
                           "block_indices.append(start_chunk_idx)")),
    _m("load_block_indices_from_computed", SWA_EDGE,
       "a load's block_indices starts at the computed boundary, not the first fresh block",
       _sched, _LOAD, one("block_indices.append(load_start_gpu_block_idx)",
                          "block_indices.append(first_fresh_gpu_block_idx)")),
    _m("load_first_chunk_rounded_up", SWA_EDGE,
       "an unaligned load's first chunk rounded up (skips the partial first chunk's key)",
       _sched, _LOAD, one("load_start_gpu_block_idx // self.config.blocks_per_chunk",
                          "-(-load_start_gpu_block_idx // self.config.blocks_per_chunk)")),
    # -- the last-token rule -----------------------------------------------------
    _m("last_token_not_recomputed", LAST_TOKEN,
       "with windowed groups the hit may cover the last prompt token (no -1)",
       _sched, _LOOKUP, one("max_hit_size_tokens -= 1", "max_hit_size_tokens -= 0")),
    # -- 5. capacity accounting --------------------------------------------------
    _m("capacity_row_per_group", CAPACITY,
       "the CPU tier's chunk count divided by the number of groups (vllm#56871)",
       _cpu_spec, "CPUOffloadingSpec.__init__",
       one("self.num_chunks = int(cpu_bytes_to_use) // aligned_kv_bytes_per_chunk",
           "self.num_chunks = int(cpu_bytes_to_use) // aligned_kv_bytes_per_chunk"
           " // len(config.groups)")),
    _m("free_chunks_off_by_one", CAPACITY,
       "the manager counts one free chunk less than it has (evicts a store early)",
       _cpu_manager, "CPUOffloadingManager._get_num_free_chunks",
       one("return len(self._free_list) + self._num_chunks - self._num_allocated_chunks",
           "return len(self._free_list) + self._num_chunks - self._num_allocated_chunks - 1")),
    # -- 6. stride and layout; padding ---------------------------------------------
    _m("block_stride_from_page", STRIDE,
       "the per-layer block view uses the page size as block stride (packed layouts, #46888)",
       _worker, "OffloadingConnectorWorker.register_kv_caches",
       one("(block_stride_bytes, 1),", "(page, 1),")),
    _m("byte_offset_in_elements", STRIDE,
       "a layer view's storage offset taken in elements, not bytes",
       _worker, "OffloadingConnectorWorker.register_kv_caches",
       one("byte_offset = ref.storage_offset() * elem_size",
           "byte_offset = ref.storage_offset()")),
    _m("padded_attention_page_transferred", PADDING,
       "attention refs transfer the padded page, not the real (unpadded) one (vllm#43142)",
       _worker, "OffloadingConnectorWorker.register_kv_caches",
       one("layer_kv_cache_spec.unpadded_page_size_bytes",
           "layer_kv_cache_spec.page_size_bytes")),
    # -- the fs tier's failed stores -------------------------------------------------
    _m("fs_store_failure_reported_done", FS_STORE,
       "the fs tier's store task logs and swallows the OSError: a failed store reports done",
       _fs_tier, "FileSystemTierManager.submit_store",
       one("        self._pool.enqueue_store(job_metadata.job_id, 1, [task])",
           "        def swallowing(store=task):\n"
           "            try:\n"
           "                store()\n"
           "            except OSError as exc:\n"
           "                logger.warning(\"store failed: %s\", exc)\n\n"
           "        self._pool.enqueue_store(job_metadata.job_id, 1, [swallowing])")),
)
"""Every vLLM-side mutant, in bug-class order."""

BY_NAME = {m.name: m for m in MUTANTS}
