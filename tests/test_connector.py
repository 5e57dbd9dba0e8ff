"""KvchunkOffloadingConnector inside vLLM's real Scheduler (CPU, hand-made KV configs).

(b) ``{"block_size": T}`` on a mixed-block-size hybrid builds a real Scheduler whose
    SchedulerOffloadConfig is the reference's resolution; vLLM's stock connector
    dies on the same config with its bare AssertionError.
(c) where the stock connector accepts a config, the kvchunk connector produces the
    same SchedulerOffloadConfig, field by field.
(d) every bad extra config is a ValueError naming the knob, never an AssertionError
    (hypothesis on the resolution function, a few real Scheduler builds).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from conformance.testing.requires import require_vllm

require_vllm()

from hypothesis import event, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_adapter_geometry import (  # noqa: E402
    CATALOGUE,
    CONNECTOR_MODULE,
    CPU_BYTES,
    KVCHUNK,
    STOCK,
    build_scheduler,
    engine_config,
    fa,
    kv_config,
    mamba,
)

from reference.knobs import resolve_extra_config, window_in_chunks  # noqa: E402
from reference.rules import WindowRule  # noqa: E402

WHOLE = WindowRule.WHOLE_WINDOW
"""vLLM's config field ``sliding_window_size_in_chunks`` (reference.rules.WindowRule)."""
from conformance.harness import vllm_harness_api as V  # noqa: E402
from vllm_adapter.connector import (  # noqa: E402
    KvchunkOffloadingConnector,
    resolve_for_vllm,
)
from vllm_adapter.geometry import (  # noqa: E402
    VllmRejected,
    geometry_from_vllm,
    vllm_blocks_per_chunk,
    with_extra_config,
)

pytestmark = pytest.mark.vllm

KNOBS = ("block_size", "blocks_per_chunk")


def offload_config(scheduler: Any) -> Any:
    """The scheduler-side SchedulerOffloadConfig of a Scheduler's offloading connector."""
    config = scheduler.connector.scheduler.config
    assert isinstance(config, V.SchedulerOffloadConfig)
    return config


def assert_matches_reference(config: Any, chunking: Any) -> None:
    assert config.blocks_per_chunk == chunking.uniform_blocks_per_chunk
    assert config.tokens_per_hash == chunking.tokens_per_hash
    assert config.alignment_tokens == chunking.alignment_tokens
    assert [g.group_idx for g in config.kv_group_configs] == [
        gc.group.index for gc in chunking.groups
    ]
    for g, gc in zip(config.kv_group_configs, chunking.groups, strict=True):
        assert g.tokens_per_block == gc.group.tokens_per_block
        assert g.tokens_per_chunk == gc.tokens_per_chunk
        assert g.hashes_per_chunk == gc.hashes_per_chunk
        assert g.sliding_window_size_in_chunks == gc.window_in_chunks


# ---------------------------------------------------------------------------
# (b) block_size on a mixed-block-size hybrid
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [64, 128, 512])
def test_block_size_on_mixed_hybrid_builds_a_real_scheduler(tokens: int) -> None:
    kv = CATALOGUE["mixed_full64_swa16"]()
    extra = {"block_size": tokens, "cpu_bytes_to_use": CPU_BYTES}
    vc = engine_config(kv, extra)
    scheduler = build_scheduler(kv, vc)
    connector = scheduler.connector
    assert isinstance(connector, KvchunkOffloadingConnector)

    geometry = geometry_from_vllm(kv, vc)
    expected = resolve_extra_config(geometry, extra, vc.cache_config.prefix_cache_retention_interval)
    assert connector.kvchunk_chunking == expected
    assert expected.uniform_blocks_per_chunk == tokens // 64  # the full-attention group's span
    assert_matches_reference(offload_config(scheduler), expected)
    assert connector.connector_scheduler.manager is not None

    # The caller's config is untouched; vLLM ran a shallow copy with the global knob.
    assert vc.kv_transfer_config.kv_connector_extra_config == extra
    assert scheduler.vllm_config is vc
    assert connector._vllm_config is not vc
    assert connector._vllm_config.cache_config is vc.cache_config
    assert connector._kv_transfer_config.kv_connector_extra_config == {
        "blocks_per_chunk": tokens // 64,
        "cpu_bytes_to_use": CPU_BYTES,
    }
    assert connector._kv_transfer_config.engine_id == vc.kv_transfer_config.engine_id

    # The stock connector on the same config: the upstream failure (vllm#48635).
    stock_kv = CATALOGUE["mixed_full64_swa16"]()
    with pytest.raises(AssertionError, match="all groups must have the same block size"):
        build_scheduler(stock_kv, engine_config(stock_kv, extra, connector=STOCK))


def test_kvchunk_scheduler_runs_a_request() -> None:
    """One prefill step through vLLM's own offloading scheduler, FA64 + SW128@16, 128 tokens.

    The store job is vLLM's (design notes, worked example 7.1): full chunks 0-1
    (4 blocks) and the four SWA chunks in the last window (8 blocks) -> 6 CPU chunks.
    """
    kv = CATALOGUE["mixed_full64_swa16"]()
    vc = engine_config(kv, {"block_size": 128})
    scheduler = build_scheduler(kv, vc)
    hash_fn = V.get_hash_fn_by_name("sha256")
    V.init_none_hash(hash_fn)
    request = V.Request(
        request_id="r0",
        prompt_token_ids=list(range(300)),
        sampling_params=V.SamplingParams(max_tokens=4),
        pooling_params=None,
        block_hasher=V.get_request_block_hasher(kv.hash_block_size, hash_fn),
    )
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"r0": 300}
    meta = output.kv_connector_metadata
    assert isinstance(meta, V.OffloadingConnectorMetadata)
    assert not meta.load_jobs
    (job,) = meta.store_jobs.values()
    assert list(job.src_spec.group_sizes) == [4, 8]
    assert (len(job.src_spec.block_ids), len(job.dst_spec.block_ids)) == (4 + 8, 2 + 4)


def test_worker_role_gets_the_same_blocks_per_chunk() -> None:
    kv = CATALOGUE["mixed_full64_swa16"]()
    vc = engine_config(kv, {"block_size": 512})
    worker = KvchunkOffloadingConnector(vc, V.KVConnectorRole.WORKER, kv)
    assert worker.connector_worker is not None
    assert worker.connector_worker.spec.blocks_per_chunk == 8
    assert worker.kvchunk_chunking.uniform_blocks_per_chunk == 8


# ---------------------------------------------------------------------------
# (c) same result as the stock connector wherever the stock connector works
# ---------------------------------------------------------------------------

STOCK_ACCEPTS = [
    ("uniform_full16", {"block_size": 16}),
    ("uniform_full16", {"block_size": 64}),
    ("uniform_full16", {"block_size": "256"}),
    ("uniform_full16", {"blocks_per_chunk": 1}),
    ("uniform_full16", {"blocks_per_chunk": 3}),
    ("uniform_full16", {}),
    ("mixed_full64_swa16", {"blocks_per_chunk": 2}),
    ("mixed_full64_swa16", {"blocks_per_chunk": 8}),
    ("full16_mamba64_align", {"blocks_per_chunk": 1}),
    ("full16_mamba64_align", {"blocks_per_chunk": 4}),
    ("full32_chunked_local32", {"blocks_per_chunk": 2}),
    ("eagle_and_skipped_groups", {"blocks_per_chunk": 2}),
]


@pytest.mark.parametrize(("name", "extra"), STOCK_ACCEPTS)
def test_same_scheduler_config_as_stock(name: str, extra: dict[str, Any]) -> None:
    ours_kv, stock_kv = CATALOGUE[name](), CATALOGUE[name]()
    ours = offload_config(build_scheduler(ours_kv, engine_config(ours_kv, extra)))
    stock = offload_config(
        build_scheduler(stock_kv, engine_config(stock_kv, extra, connector=STOCK))
    )
    for field in ("blocks_per_chunk", "tokens_per_hash", "alignment_tokens"):
        assert getattr(ours, field) == getattr(stock, field), field
    for o, s in zip(ours.kv_group_configs, stock.kv_group_configs, strict=True):
        for field in (
            "group_idx",
            "tokens_per_block",
            "tokens_per_chunk",
            "hashes_per_chunk",
            "sliding_window_size_in_chunks",
            "is_eagle_group",
            "requires_cow_source",
        ):
            assert getattr(o, field) == getattr(s, field), field
    # ...and every other field too (num_workers, retention, partial tail, bytes per token).
    assert ours == stock


def test_equal_per_group_values_run_as_the_global_knob() -> None:
    extra = {"blocks_per_chunk": {"0": 2, "default": 2}}
    ours_kv, stock_kv = CATALOGUE["mixed_full64_swa16"](), CATALOGUE["mixed_full64_swa16"]()
    ours = build_scheduler(ours_kv, engine_config(ours_kv, extra))
    stock = build_scheduler(
        stock_kv, engine_config(stock_kv, {"blocks_per_chunk": 2}, connector=STOCK)
    )
    assert offload_config(ours) == offload_config(stock)
    assert ours.connector.kvchunk_extra_config["blocks_per_chunk"] == 2


# ---------------------------------------------------------------------------
# (d) every mistake is a ValueError naming the knob
# ---------------------------------------------------------------------------

BAD = [
    ({"block_size": "abc"}, "'block_size'"),
    ({"block_size": 1.5}, "'block_size'"),
    ({"block_size": True}, "'block_size'"),
    ({"block_size": 0}, "'block_size'"),
    ({"block_size": -64}, "'block_size'"),
    ({"block_size": 100}, "'block_size'=100"),
    ({"blocks_per_chunk": "two"}, "'blocks_per_chunk'"),
    ({"blocks_per_chunk": 2.5}, "'blocks_per_chunk'"),
    ({"blocks_per_chunk": False}, "'blocks_per_chunk'"),
    ({"blocks_per_chunk": 0}, "'blocks_per_chunk'"),
    ({"blocks_per_chunk": -1}, "'blocks_per_chunk'"),
    ({"blocks_per_chunk": [2]}, "'blocks_per_chunk'"),
    ({"block_size": 128, "blocks_per_chunk": 2}, "'block_size' or 'blocks_per_chunk'"),
    ({"blocks_per_chunk": {"0": 2, "1": 8}}, "'blocks_per_chunk' gives the offloaded groups"),
    ({"blocks_per_chunk": {"5": 2}}, "'blocks_per_chunk' names group"),
    ({"blocks_per_chunk": {"0": 0}}, "'blocks_per_chunk'[0]"),
    ({"blocks_per_chunk": {"default": "x"}}, "'blocks_per_chunk'['default']"),
]


@pytest.mark.parametrize(("extra", "needle"), BAD)
def test_bad_extra_configs_are_value_errors(extra: dict[str, Any], needle: str) -> None:
    kv = CATALOGUE["mixed_full64_swa16"]()
    vc = engine_config(kv, extra)
    with pytest.raises(ValueError) as info:
        resolve_for_vllm(vc, kv)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "extra",
    [
        {"block_size": 100},
        {"blocks_per_chunk": {"0": 2, "1": 8}},
        {"block_size": "abc"},
        {"block_size": 128, "blocks_per_chunk": 2},
    ],
)
def test_bad_extra_configs_through_a_real_scheduler(extra: dict[str, Any]) -> None:
    kv = CATALOGUE["mixed_full64_swa16"]()
    vc = engine_config(kv, extra)
    with pytest.raises(ValueError, match="'block(s_per_chunk|_size)'"):
        build_scheduler(kv, vc)
    assert {k: v for k, v in vc.kv_transfer_config.kv_connector_extra_config.items()
            if k != "cpu_bytes_to_use"} == extra


def test_unequal_per_group_message_names_groups_and_values() -> None:
    kv = CATALOGUE["mixed_full64_swa16"]()
    with pytest.raises(ValueError) as info:
        resolve_for_vllm(engine_config(kv, {"blocks_per_chunk": {"0": 2, "1": 8}}), kv)
    message = str(info.value)
    assert "group 0 (full, 64 tokens/block) -> 2" in message
    assert "group 1 (sliding_window, window 128, 16 tokens/block) -> 8" in message
    assert "one" in message and '{"blocks_per_chunk": 2}' in message


@pytest.mark.parametrize("extra", [{"blocks_per_chunk": 4}, {"block_size": 64}])
def test_hash_rule_vllm_would_assert_is_a_value_error(extra: dict[str, Any]) -> None:
    """FA16 + non-align Mamba64: vLLM hashes at lcm=64 and asserts 16 % 64.

    The reference accepts 4 blocks per chunk (64-token full chunks end on a hash
    boundary); vLLM (0.33.0 and 0.34.0) cannot run it, so the connector says which group.
    """
    kv = kv_config(fa(16), mamba(64, "all"))
    vc = engine_config(kv, extra)
    geometry = geometry_from_vllm(kv, vc)
    assert resolve_extra_config(geometry, extra).uniform_blocks_per_chunk == 4
    with pytest.raises(ValueError) as info:
        build_scheduler(kv, vc)
    message = str(info.value)
    assert "group 0 (full, 16 tokens/block)" in message and "tokens_per_hash=64" in message
    assert f"'{next(iter(extra))}'" in message
    with pytest.raises(VllmRejected) as rejected:
        vllm_blocks_per_chunk(kv, vc, extra)
    assert rejected.value.kind == "AssertionError"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"cpu_bytes_to_use": 0}, "'cpu_bytes_to_use'"),
        ({"cpu_bytes_to_use": "lots"}, "'cpu_bytes_to_use'"),
        ({"sync_load_budget_bytes": [1]}, "'sync_load_budget_bytes'"),
        ({"store_threshold": "often"}, "'store_threshold'"),
        ({"cpu_bytes_to_use": float("inf")}, "'cpu_bytes_to_use'"),
        ({"sync_load_budget_bytes": -1}, "'sync_load_budget_bytes'"),
        ({"spec_name": 3}, "'spec_name'"),
    ],
)
def test_other_extra_config_mistakes_are_value_errors(extra: dict[str, Any], needle: str) -> None:
    kv = CATALOGUE["uniform_full16"]()
    vc = engine_config(kv, extra)
    with pytest.raises(ValueError, match=needle):
        build_scheduler(kv, vc)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"spec_name": "X", "spec_module_path": "no_such_module_kvchunk"}, "'spec_module_path'"),
        ({"spec_name": "NoSuchSpec", "spec_module_path": "vllm_adapter.connector"}, "'spec_name'"),
        # Not an OffloadingSpec: vLLM's factory asserts; the connector reports a ValueError.
        ({"spec_name": "KvchunkOffloadingConnector", "spec_module_path": "vllm_adapter.connector"},
         "AssertionError"),
    ],
)
def test_bad_spec_loading_is_a_value_error(extra: dict[str, Any], needle: str) -> None:
    kv = CATALOGUE["uniform_full16"]()
    with pytest.raises(ValueError, match=needle):
        build_scheduler(kv, engine_config(kv, extra))


def test_missing_cpu_bytes_is_a_value_error() -> None:
    kv = CATALOGUE["uniform_full16"]()
    vc = engine_config(kv, {"block_size": 64}, cpu_bytes=None)
    with pytest.raises(ValueError, match="'cpu_bytes_to_use' must be specified"):
        build_scheduler(kv, vc)


# Random extra configs: the knob values JSON (and careless Python callers) can carry.
_scalar = st.one_of(
    st.integers(1, 16),  # valid blocks per chunk
    st.integers(1, 16).map(lambda k: 64 * k),  # valid block_size on the mixed hybrid
    st.integers(-4, 1100),
    st.integers(-4, 1100).map(str),
    st.sampled_from(["", "abc", "1.5", " 64 ", "+32", "-16", "0x10", "1e3", "٣"]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.lists(st.integers(0, 4), max_size=2),
)
_group_key = st.sampled_from([0, 1, 2, 7, -1, "0", "1", "2", " 1", "default", "x", None])
_knob_value = st.one_of(_scalar, st.dictionaries(_group_key, _scalar, max_size=3))
_extra = st.fixed_dictionaries({}, optional={"block_size": _scalar, "blocks_per_chunk": _knob_value})


@given(extra=_extra)
def test_random_extra_configs_value_error_or_vllm_runs_it(extra: dict[str, Any]) -> None:
    kv = _MIXED_KV
    vc = with_extra_config(_MIXED_VC, {**extra, "cpu_bytes_to_use": CPU_BYTES})
    try:
        chunking, vllm_extra = resolve_for_vllm(vc, kv)
    except ValueError as e:
        event("kvchunk: ValueError")
        named = [k for k in KNOBS if extra.get(k) is not None]
        assert named, f"no knob was set, yet: {e}"
        assert any(f"'{k}'" in str(e) for k in named), str(e)
        return
    event("kvchunk: accepted")
    bpc = chunking.uniform_blocks_per_chunk
    assert bpc is not None and "block_size" not in vllm_extra
    assert vllm_extra["blocks_per_chunk"] == bpc
    # vLLM's own config code accepts the translation and agrees group by group.
    ran = vllm_blocks_per_chunk(kv, vc, vllm_extra)
    assert ran.blocks_per_chunk == bpc
    assert ran.sliding_window_size_in_chunks == {
        gc.group.index: window_in_chunks(gc.group, gc.tokens_per_chunk, rule=WHOLE)
        for gc in chunking.groups
    }
    # Where the stock connector also accepts the original, it means the same thing.
    try:
        stock = vllm_blocks_per_chunk(kv, vc)
    except VllmRejected as e:
        event(f"stock: {e.kind}")
        return
    event("stock: accepted")
    assert stock.blocks_per_chunk == bpc


@given(blocks=st.integers(1, 4096), as_str=st.booleans())
def test_stock_blocks_per_chunk_is_accepted_the_same_way(blocks: int, as_str: bool) -> None:
    """Whatever vLLM accepts as a positive int (or decimal string) knob, kvchunk runs as is,
    unless its longest chunk exceeds max_model_len: vLLM runs that knob and never stores a
    chunk, kvchunk refuses it."""
    extra = {"blocks_per_chunk": str(blocks) if as_str else blocks, "cpu_bytes_to_use": CPU_BYTES}
    vc = with_extra_config(_MIXED_VC, extra)
    longest = max(g.kv_cache_spec.block_size for g in _MIXED_KV.kv_cache_groups) * blocks
    if longest > vc.model_config.max_model_len:
        event("longer than max_model_len")
        with pytest.raises(ValueError, match=f"max_model_len={vc.model_config.max_model_len}"):
            resolve_for_vllm(vc, _MIXED_KV)
        assert vllm_blocks_per_chunk(_MIXED_KV, vc).blocks_per_chunk == blocks
        return
    chunking, vllm_extra = resolve_for_vllm(vc, _MIXED_KV)
    assert chunking.uniform_blocks_per_chunk == blocks
    assert vllm_extra == {"blocks_per_chunk": blocks, "cpu_bytes_to_use": CPU_BYTES}
    assert vllm_blocks_per_chunk(_MIXED_KV, vc).blocks_per_chunk == blocks


_MIXED_KV = CATALOGUE["mixed_full64_swa16"]()
_MIXED_VC = engine_config(_MIXED_KV)


# ---------------------------------------------------------------------------
# Real-model fixtures (gemma-4, DeepSeek-V4), when vllm_adapter.fixtures provides them
# ---------------------------------------------------------------------------

# Blocks per chunk for block_size 512.  The gemma-4 fixture is planned without --block-size,
# so its blocks are vLLM's CacheConfig.DEFAULT_BLOCK_SIZE (sliding) and twice that (full):
# vLLM 0.34.0 raised the default from 16 to 64, so the 512-token full chunk is 16 blocks of
# 32 tokens on 0.33.0 and 4 blocks of 128 on 0.34.0.  DeepSeek-V4 sets --block-size 256.
GEMMA_512_BY_DEFAULT_BLOCK = {16: 16, 64: 4}
REAL = [
    ("gemma-4-31B-it-tp2", GEMMA_512_BY_DEFAULT_BLOCK[V.CacheConfig.DEFAULT_BLOCK_SIZE]),
    ("deepseek-v4-flash-tp4", 2),
]


def _load_real(name: str) -> tuple[Any, Any]:
    fx = importlib.import_module("vllm_adapter.fixtures")
    return fx, fx.load_fixture(name)


@pytest.mark.parametrize(("name", "blocks"), REAL)
def test_real_model_block_size_512(name: str, blocks: int) -> None:
    """The feature request's configs: kvchunk runs them, the stock connector asserts."""
    fx, data = _load_real(name)
    extra = {"block_size": 512}
    scheduler = fx.build_scheduler(
        data, extra, connector=KVCHUNK, connector_module_path=CONNECTOR_MODULE
    )
    connector = scheduler.connector
    assert isinstance(connector, KvchunkOffloadingConnector)
    chunking = connector.kvchunk_chunking
    assert chunking.uniform_blocks_per_chunk == blocks
    assert_matches_reference(offload_config(scheduler), chunking)
    # The worker view (UniformTypeKVCacheSpecs kept) resolves to the same chunking.
    vc = fx.make_vllm_config(data, extra)
    worker_kv = fx.rebuild_kv_cache_config(data, "worker")
    worker_chunking, vllm_extra = resolve_for_vllm(vc, worker_kv)
    assert [(gc.group.index, gc.group.kind, gc.tokens_per_chunk) for gc in worker_chunking.groups] == [
        (gc.group.index, gc.group.kind, gc.tokens_per_chunk) for gc in chunking.groups
    ]
    assert vllm_blocks_per_chunk(worker_kv, vc, vllm_extra).blocks_per_chunk == blocks
    # Upstream (vllm#48635): the stock connector on the same config.
    with pytest.raises(AssertionError, match="all groups must have the same block size"):
        fx.build_scheduler(data, extra)
    with pytest.raises(VllmRejected) as rejected:
        vllm_blocks_per_chunk(fx.rebuild_kv_cache_config(data), vc)
    assert rejected.value.kind == "AssertionError"


def _stored_fixture_names() -> list[str]:
    try:
        return list(importlib.import_module("vllm_adapter.fixtures").fixture_names())
    except (ImportError, AttributeError):
        return []


@pytest.mark.parametrize("extra", [{"blocks_per_chunk": 2}, {"block_size": 512}])
@pytest.mark.parametrize("name", _stored_fixture_names())
def test_stored_fixtures_same_as_stock_where_stock_runs(name: str, extra: dict[str, Any]) -> None:
    """Every stored fixture: where vLLM's stock connector runs a config, kvchunk runs it identically;
    where it fails with an AssertionError, kvchunk runs it or says why in a ValueError."""
    fx, data = _load_real(name)
    try:
        stock: Any = offload_config(fx.build_scheduler(data, extra))
    except Exception as e:  # vLLM's verdict, compared below
        stock = e
    try:
        ours: Any = offload_config(
            fx.build_scheduler(data, extra, connector=KVCHUNK, connector_module_path=CONNECTOR_MODULE)
        )
    except ValueError as e:
        ours = e
    if isinstance(stock, V.SchedulerOffloadConfig):
        assert ours == stock
    elif isinstance(stock, AssertionError):
        if isinstance(ours, ValueError):
            assert any(f"'{k}'" in str(ours) for k in extra), str(ours)
    else:  # vLLM's own ValueError (e.g. before the connector): the same one
        assert isinstance(stock, ValueError) and isinstance(ours, ValueError)
        assert str(ours) == str(stock)
