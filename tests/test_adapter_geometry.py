"""vllm_adapter.geometry: vLLM's KV-cache metadata -> reference Geometry.

Every expectation is computed with vLLM's own resolvers (``get_offloading_group_ids``,
``resolve_dcp_kv_block_size``, ``resolve_kv_cache_block_sizes``,
``get_sliding_window_size_in_chunks`` / ``build_offloading_config``), not typed in.

The small builders at the top (``base_vllm_config``, ``kv_config``, ``engine_config``,
``build_scheduler``) are shared with ``tests/test_connector.py``.  They follow vLLM's
upstream ``tests/v1/kv_connector/unit/offloading_connector/utils.py``: a ModelConfig
from a local directory holding only a ``config.json`` (``skip_tokenizer_init=True``),
hand-made ``KVCacheConfig`` groups, and the engine core's post-processing
(``cache_config.block_size`` = min prefix-cacheable block size, ``hash_block_size`` /
``cache_hit_alignment_tokens`` on the KV-cache config, HMA on).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import functools
import json
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from conformance.testing.requires import require_vllm

require_vllm()

import torch  # noqa: E402

from reference.geometry import GroupKind  # noqa: E402
from reference.knobs import window_in_chunks  # noqa: E402
from reference.rules import WindowRule  # noqa: E402

WHOLE = WindowRule.WHOLE_WINDOW
"""vLLM's config field ``sliding_window_size_in_chunks`` (reference.rules.WindowRule)."""
from conformance.harness import vllm_harness_api as V  # noqa: E402
from vllm_adapter.cli.sizing import release_policy  # noqa: E402
from vllm_adapter.geometry import (  # noqa: E402
    VllmRejected,
    geometry_from_vllm,
    retention_interval_from,
    vllm_blocks_per_chunk,
    with_extra_config,
)
from vllm_adapter.releases import RELEASES, rules_for  # noqa: E402

pytestmark = pytest.mark.vllm

CONNECTOR_MODULE = "vllm_adapter.connector"
KVCHUNK = "KvchunkOffloadingConnector"
STOCK = "OffloadingConnector"
CPU_BYTES = 1 << 24

_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "torch_dtype": "float16",
}

# ---------------------------------------------------------------------------
# Builders (shared with test_connector.py)
# ---------------------------------------------------------------------------


@functools.cache
def base_vllm_config() -> Any:
    """One VllmConfig (no connector) for every test; per-test configs are shallow copies."""
    model_dir = Path(tempfile.mkdtemp(prefix="kvchunk-tiny-llama-"))
    atexit.register(shutil.rmtree, model_dir, True)
    (model_dir / "config.json").write_text(json.dumps(_TINY_LLAMA))
    vllm_config = V.VllmConfig(
        model_config=V.ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=8192
        ),
        scheduler_config=V.SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=1024,
            max_model_len=8192,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=V.CacheConfig(block_size=16, enable_prefix_caching=True),
        device_config=V.DeviceConfig("cpu"),
    )
    # The CPU platform turns HMA off; these hybrids are the GPU engine's HMA layouts.
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return vllm_config


def fa(block_size: int, **kw: Any) -> Any:
    return V.FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float16, **kw
    )


def sw(block_size: int, window: int, **kw: Any) -> Any:
    return V.SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=2,
        head_size=16,
        dtype=torch.float16,
        sliding_window=window,
        **kw,
    )


def mla(block_size: int, **kw: Any) -> Any:
    return V.MLAAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float16, **kw
    )


def sw_mla(block_size: int, window: int, **kw: Any) -> Any:
    return V.SlidingWindowMLASpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=32,
        dtype=torch.float16,
        sliding_window=window,
        **kw,
    )


def chunked_local(block_size: int, chunk: int) -> Any:
    return V.ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=2,
        head_size=16,
        dtype=torch.float16,
        attention_chunk_size=chunk,
    )


def mamba(block_size: int, mode: str = "align") -> Any:
    return V.MambaSpec(
        block_size=block_size, shapes=((4, 8),), dtypes=(torch.float16,), mamba_cache_mode=mode
    )


def group(spec: Any, *layers: str, **kw: Any) -> Any:
    return V.KVCacheGroupSpec(list(layers), spec, **kw)


def kv_config(*groups: Any, num_blocks: int = 2000) -> Any:
    """A KVCacheConfig of the given groups (specs or KVCacheGroupSpecs)."""
    made = [
        g if isinstance(g, V.KVCacheGroupSpec) else group(g, f"layers.{i}.attn")
        for i, g in enumerate(groups)
    ]
    return V.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=made)


def engine_config(
    kv_cache_config: Any,
    extra: Mapping[str, Any] | None = None,
    *,
    connector: str = KVCHUNK,
    dcp: int = 1,
    retention: int | None = 0,
    cpu_bytes: int | None = CPU_BYTES,
) -> Any:
    """A VllmConfig for ``kv_cache_config`` as the engine core leaves it.

    Also sets ``hash_block_size`` / ``cache_hit_alignment_tokens`` on the
    KV-cache config, as ``EngineCore._initialize_kv_caches`` does.
    """
    base = base_vllm_config()
    vllm_config = copy.copy(base)
    vllm_config.cache_config = copy.copy(base.cache_config)
    groups = kv_cache_config.kv_cache_groups
    cacheable = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    vllm_config.cache_config.block_size = min(cacheable or [g.kv_cache_spec.block_size for g in groups])
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    vllm_config.cache_config.prefix_cache_retention_interval = retention
    if dcp != 1:
        vllm_config.parallel_config = copy.copy(base.parallel_config)
        vllm_config.parallel_config.decode_context_parallel_size = dcp
    extra = dict(extra or {})
    if cpu_bytes is not None:
        extra.setdefault("cpu_bytes_to_use", cpu_bytes)
    vllm_config.kv_transfer_config = V.KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=CONNECTOR_MODULE if connector == KVCHUNK else None,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    scheduler_block, hash_block = V.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    kv_cache_config.hash_block_size = hash_block
    if not any(isinstance(g.kv_cache_spec, V.UniformTypeKVCacheSpecs) for g in groups):
        # The engine resolves this on the flattened scheduler view; a worker-view
        # UniformTypeKVCacheSpecs wrapper has no manager class to ask.
        kv_cache_config.cache_hit_alignment_tokens = V.resolve_cache_hit_alignment_tokens(
            kv_cache_config, vllm_config, scheduler_block, hash_block
        )
    return vllm_config


def build_scheduler(kv_cache_config: Any, vllm_config: Any) -> Any:
    """vLLM's real Scheduler, built as EngineCore builds it."""
    scheduler_block, hash_block = V.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    return V.Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=V.StructuredOutputManager(vllm_config),
        block_size=scheduler_block,
        hash_block_size=hash_block,
        log_stats=True,
    )


# The hand-made catalogue: name -> groups.  Windows and block sizes are small but
# mixed, like gemma-4 (full 32 / SWA 16) and DeepSeek-V4 (MLA 256 / SWA 64 / states 4, 8).
CATALOGUE: dict[str, Any] = {
    "uniform_full16": lambda: kv_config(
        group(fa(16), "layers.0.attn", "layers.1.attn"),
    ),
    "mixed_full64_swa16": lambda: kv_config(fa(64), sw(16, 128)),
    "full16_mamba64_align": lambda: kv_config(fa(16), mamba(64, "align")),
    "mla64_swmla16_extra": lambda: kv_config(
        mla(64), sw_mla(16, 128, extra_retained_tokens=40), sw_mla(4, 8)
    ),
    "full32_chunked_local32": lambda: kv_config(fa(32), chunked_local(32, 256)),
    "uniform_type_wrapper": lambda: kv_config(
        mla(64),
        group(
            V.UniformTypeKVCacheSpecs(
                block_size=16,
                kv_cache_specs={"a.swa": sw_mla(16, 64), "b.swa": sw_mla(16, 64)},
            ),
            "a.swa",
            "b.swa",
        ),
    ),
    "rswa_sink_full": lambda: kv_config(
        V.RSWASpec(
            block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float16, rswa_window=64
        ),
        V.SinkFullAttentionSpec(
            block_size=32, num_kv_heads=2, head_size=16, dtype=torch.float16, sink_len=4
        ),
        fa(32, sliding_window=128),  # HMA off: a sliding layer allocated as full attention
    ),
    "eagle_and_skipped_groups": lambda: kv_config(
        fa(32),
        group(sw_mla(16, 64, bounded_replay=True), "replay"),  # not prefix-cacheable
        group(fa(32), "no_transfer", enable_kv_transfer=False),  # not transferable
        group(sw(16, 64), "draft", is_eagle_group=True),
    ),
}


def _expected_kind(spec: Any) -> GroupKind:
    first = next(iter(V.iter_layer_specs(spec)))
    if isinstance(first, V.SlidingWindowSpec):
        return GroupKind.SLIDING_WINDOW
    if isinstance(first, V.ChunkedLocalAttentionSpec):
        return GroupKind.CHUNKED_LOCAL
    if isinstance(first, V.MambaSpec):
        return GroupKind.MAMBA_ALIGN if spec.mamba_cache_mode == "align" else GroupKind.MAMBA
    assert isinstance(first, V.FullAttentionSpec)
    return GroupKind.FULL


# ---------------------------------------------------------------------------
# (a) geometry_from_vllm against vLLM's own resolvers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CATALOGUE))
@pytest.mark.parametrize("dcp", [1, 2])
def test_geometry_matches_vllm_resolvers(name: str, dcp: int) -> None:
    kv = CATALOGUE[name]()
    vc = engine_config(kv, dcp=dcp)
    geo = geometry_from_vllm(kv, vc)

    assert tuple(g.index for g in geo.groups) == V.get_offloading_group_ids(kv)
    assert geo.tokens_per_hash == V.resolve_kv_cache_block_sizes(kv, vc)[1]
    for g in geo.groups:
        vg = kv.kv_cache_groups[g.index]
        spec = vg.kv_cache_spec
        first = next(iter(V.iter_layer_specs(spec)))
        assert g.tokens_per_block == V.resolve_dcp_kv_block_size(spec, dcp)
        assert g.kind is _expected_kind(spec)
        assert g.is_eagle is vg.is_eagle_group
        assert g.num_layers == len(vg.layer_names)
        assert g.page_bytes == first.page_size_bytes
        if g.kind is GroupKind.SLIDING_WINDOW:
            assert (g.sliding_window, g.extra_retained_tokens) == (
                first.sliding_window,
                first.extra_retained_tokens,
            )
        if g.kind is GroupKind.CHUNKED_LOCAL:
            assert g.attention_chunk_size == first.attention_chunk_size
        # The window rule, on vLLM's own function, for a few chunk spans.
        for b in (1, 2, 3, 8):
            tpc = g.tokens_per_block * b
            assert window_in_chunks(g, tpc, rule=WHOLE) == V.get_sliding_window_size_in_chunks(first, tpc)


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_geometry_matches_build_offloading_config(name: str) -> None:
    """What vLLM's real build_offloading_config resolves, group by group."""
    kv = CATALOGUE[name]()
    vc = engine_config(kv)
    geo = geometry_from_vllm(kv, vc)
    for b in (1, 4):
        got = vllm_blocks_per_chunk(kv, vc, {"blocks_per_chunk": b, "cpu_bytes_to_use": CPU_BYTES})
        assert got.blocks_per_chunk == b
        assert got.tokens_per_hash == geo.tokens_per_hash
        assert got.tokens_per_block == {g.index: g.tokens_per_block for g in geo.groups}
        assert got.sliding_window_size_in_chunks == {
            g.index: window_in_chunks(g, g.tokens_per_block * b, rule=WHOLE) for g in geo.groups
        }


def test_mixed_hybrid_geometry() -> None:
    kv = CATALOGUE["mixed_full64_swa16"]()
    geo = geometry_from_vllm(kv, engine_config(kv))
    full, swa = geo.groups
    assert (full.kind, full.tokens_per_block) == (GroupKind.FULL, 64)
    assert (swa.kind, swa.tokens_per_block, swa.sliding_window) == (
        GroupKind.SLIDING_WINDOW,
        16,
        128,
    )
    assert geo.tokens_per_hash == 16  # gcd, as vLLM resolves it (checked above)
    assert geo.name == base_vllm_config().model_config.model


def test_skipped_groups_keep_original_indices() -> None:
    kv = CATALOGUE["eagle_and_skipped_groups"]()
    geo = geometry_from_vllm(kv, engine_config(kv))
    assert [g.index for g in geo.groups] == [0, 3]
    assert [g.is_eagle for g in geo.groups] == [False, True]


def test_unsupported_cacheable_spec_is_a_value_error_naming_the_group() -> None:
    cross = V.CrossAttentionSpec(block_size=16, num_kv_heads=2, head_size=16, dtype=torch.float16)
    kv = kv_config(fa(16), cross)
    vc = engine_config(kv)
    with pytest.raises(ValueError) as info:
        geometry_from_vllm(kv, vc)
    message = str(info.value)
    assert "group 1" in message and "CrossAttentionSpec" in message and "16 tokens/block" in message
    # vLLM itself trips a bare assert on the same config.
    with pytest.raises(VllmRejected) as rejected:
        vllm_blocks_per_chunk(kv, vc)
    assert rejected.value.kind == "AssertionError"


def test_mamba_not_align_falls_back_to_lcm_hash() -> None:
    """A non-align Mamba group makes vLLM hash at the lcm, then assert tpb % tph."""
    kv = kv_config(fa(16), mamba(64, "all"))
    vc = engine_config(kv)
    geo = geometry_from_vllm(kv, vc)
    assert geo.tokens_per_hash == V.resolve_kv_cache_block_sizes(kv, vc)[1] == 64
    assert [g.kind for g in geo.groups] == [GroupKind.FULL, GroupKind.MAMBA]
    with pytest.raises(VllmRejected) as rejected:
        vllm_blocks_per_chunk(kv, vc, {"blocks_per_chunk": 4, "cpu_bytes_to_use": CPU_BYTES})
    assert rejected.value.kind == "AssertionError"
    assert "tokens_per_hash=64" in rejected.value.message


# ---------------------------------------------------------------------------
# vllm_blocks_per_chunk: vLLM's verdicts, typed
# ---------------------------------------------------------------------------


def test_vllm_block_size_on_mixed_groups_is_a_typed_assertion() -> None:
    kv = CATALOGUE["mixed_full64_swa16"]()
    vc = engine_config(kv, {"block_size": 128}, connector=STOCK)
    with pytest.raises(VllmRejected) as rejected:
        vllm_blocks_per_chunk(kv, vc)
    assert rejected.value.kind == "AssertionError"
    assert "all groups must have the same block size" in rejected.value.message


@pytest.mark.parametrize(
    ("extra", "kind"),
    [
        ({"block_size": 128, "blocks_per_chunk": 2}, "ValueError"),
        ({"blocks_per_chunk": 0}, "ValueError"),
        ({"blocks_per_chunk": "two"}, "ValueError"),
        ({"blocks_per_chunk": [2]}, "TypeError"),
        ({"block_size": 100}, "ValueError"),
    ],
)
def test_vllm_rejections_are_typed(extra: dict[str, Any], kind: str) -> None:
    kv = CATALOGUE["uniform_full16"]()
    vc = engine_config(kv, connector=STOCK)
    with pytest.raises(VllmRejected) as rejected:
        vllm_blocks_per_chunk(kv, vc, extra)
    assert rejected.value.kind == kind


def test_vllm_blocks_per_chunk_uniform_block_size() -> None:
    kv = CATALOGUE["uniform_full16"]()
    vc = engine_config(kv, {"block_size": 256}, connector=STOCK)
    got = vllm_blocks_per_chunk(kv, vc)
    assert (got.blocks_per_chunk, got.tokens_per_hash) == (16, 16)
    assert got.sliding_window_size_in_chunks == {0: None}


# ---------------------------------------------------------------------------
# Config copies, retention and policy
# ---------------------------------------------------------------------------


def test_with_extra_config_copies_shallowly_and_never_mutates() -> None:
    kv = CATALOGUE["uniform_full16"]()
    vc = engine_config(kv, {"block_size": 64})
    original_extra = dict(vc.kv_transfer_config.kv_connector_extra_config)
    new = with_extra_config(vc, {"blocks_per_chunk": 4})
    assert vc.kv_transfer_config.kv_connector_extra_config == original_extra
    assert new.kv_transfer_config.kv_connector_extra_config == {"blocks_per_chunk": 4}
    assert new.kv_transfer_config is not vc.kv_transfer_config
    assert new.kv_transfer_config.engine_id == vc.kv_transfer_config.engine_id
    assert new.kv_transfer_config.kv_connector == vc.kv_transfer_config.kv_connector
    # Sub-configs are shared, so engine-side updates stay visible to the connector.
    assert new.cache_config is vc.cache_config
    assert new.parallel_config is vc.parallel_config
    assert new.scheduler_config is vc.scheduler_config


@pytest.mark.parametrize("retention", [0, None, 256])
@pytest.mark.parametrize("version", [*sorted(RELEASES), "9.9.9"])
def test_retention_and_policy(retention: int | None, version: str) -> None:
    """An engine's policy is its release's rules (every switch) with the engine's settings;
    an unknown release runs the newest known release's rules."""
    kv = CATALOGUE["mixed_full64_swa16"]()
    vc = engine_config(kv, {"offload_prompt_only": False}, retention=retention)
    assert retention_interval_from(vc) == retention
    for prompt_only in (False, True):
        policy, known = release_policy(version, vc, prompt_only)
        assert known is (version in RELEASES)
        assert policy == dataclasses.replace(
            rules_for(version).policy,
            retention_interval=retention,
            offload_prompt_only=prompt_only,
            prefix_caching=True,
        )
