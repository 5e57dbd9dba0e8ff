"""KV-cache geometry fixtures: stored JSON == what vLLM 0.33.0 derives now, rebuilt objects
are real and equal, the headline facts hold, and a real Scheduler builds from each fixture.

Expectations in ``test_headline_*`` are the facts of
``shared/design/model-geometry-vllm-0.33.md``; the values they are compared with are
computed by vLLM (``resolve_kv_cache_block_sizes``, ``resolve_dcp_kv_block_size``,
spec properties) on objects rebuilt from the fixtures, never read from the JSON.

Cost on a 2-core CPU host: importing vLLM dominates (10-35 s depending on load);
all derivations together take ~5-10 s (DeepSeek-V4 ~5 s, mostly its module import),
each Scheduler ~0.1-1 s.
"""

from __future__ import annotations

import functools
import json

import pytest

pytest.importorskip("vllm")

from vllm_adapter import fixtures as F  # noqa: E402
from vllm_adapter import vllm_api as V  # noqa: E402
from vllm_adapter.derive import RECIPES, Derivation, derive_live  # noqa: E402

pytestmark = pytest.mark.vllm

ALL = sorted(RECIPES)
MODELS = ["gemma-4-31B-it-tp2", "deepseek-v4-flash-tp4"]
RESOLVABLE = [n for n in ALL if n != "synthetic-sub-hash"]


@functools.cache
def _derived(name: str) -> Derivation:
    return derive_live(name)


def _normalized(obj: object) -> object:
    return json.loads(json.dumps(obj))


def _group_tokens_per_block(kv_cache_config: object, vllm_config: object) -> list[int]:
    dcp = vllm_config.parallel_config.decode_context_parallel_size  # type: ignore[attr-defined]
    return [
        V.resolve_dcp_kv_block_size(g.kv_cache_spec, dcp)
        for g in kv_cache_config.kv_cache_groups  # type: ignore[attr-defined]
    ]


# --- (a) stored fixture == what vLLM derives now -------------------------------------


def test_every_recipe_has_a_stored_fixture() -> None:
    assert F.fixture_names() == ALL


@pytest.mark.parametrize("name", ALL)
def test_stored_fixture_equals_derivation(name: str) -> None:
    stored = F.load_fixture(name)
    derived = _normalized(_derived(name).fixture)
    assert stored == derived, (
        f"{name}: stored fixture differs from vLLM's derivation; "
        "run `python -m vllm_adapter.fixtures regenerate --check` for a diff"
    )
    # The files are canonical (what `regenerate` writes).
    assert F.fixture_path(name).read_text(encoding="utf-8") == F.dump_fixture(stored)


def test_regenerate_check_cli_passes() -> None:
    assert F.main(["regenerate", "--check", "synthetic-full-swa"]) == 0


# --- (b) rebuild round-trips -----------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_rebuild_equals_derived_objects(name: str) -> None:
    fixture = F.load_fixture(name)
    live = _derived(name)
    scheduler = F.rebuild_kv_cache_config(fixture, "scheduler")
    worker = F.rebuild_kv_cache_config(fixture, "worker")
    assert isinstance(scheduler, V.KVCacheConfig) and isinstance(worker, V.KVCacheConfig)
    assert scheduler == live.scheduler_kv_cache_config
    assert worker == live.worker_kv_cache_configs[0]
    assert F.rebuild_layer_specs(fixture) == live.layer_specs
    # Order-sensitive too (UniformTypeKVCacheSpecs' first member is the scheduler view).
    assert F.encode_kv_cache_config(scheduler) == fixture["scheduler_kv_cache_config"]
    assert _normalized(F.encode_kv_cache_config(worker)) == _normalized(
        F.encode_kv_cache_config(live.worker_kv_cache_configs[0])
    )
    assert list(F.rebuild_layer_specs(fixture)) == list(live.layer_specs)
    # A fresh object per call (vLLM mutates these).
    assert F.rebuild_kv_cache_config(fixture) is not scheduler


@pytest.mark.parametrize("name", ALL)
def test_rebuilt_scheduler_view_is_vllms_flattening_of_worker_view(name: str) -> None:
    fixture = F.load_fixture(name)
    worker = F.rebuild_kv_cache_config(fixture, "worker")
    assert V.generate_scheduler_kv_cache_config([worker]) == F.rebuild_kv_cache_config(
        fixture, "scheduler"
    )


# --- (c) headline facts of the geometry notes, from vLLM on rebuilt objects ------------


def test_headline_gemma() -> None:
    fixture = F.load_fixture("gemma-4-31B-it-tp2")
    vllm_config = F.make_vllm_config(fixture, {"blocks_per_chunk": 1})
    for view in ("scheduler", "worker"):
        kv = F.rebuild_kv_cache_config(fixture, view)
        specs = [g.kv_cache_spec for g in kv.kv_cache_groups]
        assert [type(s).__name__ for s in specs] == ["SlidingWindowSpec"] * 5 + [
            "FullAttentionSpec"
        ]
        assert _group_tokens_per_block(kv, vllm_config) == [16, 16, 16, 16, 16, 32]
        assert {s.page_size_bytes for s in specs} == {131072}
        assert [s.sliding_window for s in specs[:5]] == [1024] * 5
        assert [len(g.layer_names) for g in kv.kv_cache_groups] == [10] * 6
        # group i = layers 6k+i
        assert kv.kv_cache_groups[5].layer_names[0].endswith("layers.5.self_attn.attn")
        assert (
            specs[0].num_kv_heads,
            specs[0].head_size,
            specs[5].num_kv_heads,
            specs[5].head_size,
        ) == (8, 256, 2, 512)
        assert V.resolve_kv_cache_block_sizes(kv, vllm_config) == (32, 16)
        assert kv.kv_tp_replicas == 1
        assert kv.kv_cache_layout == "LBHNC"
        assert kv.num_blocks == 40 * (1 << 30) // (10 * 131072) == 32768
    kv = F.rebuild_kv_cache_config(fixture)
    assert V.resolve_cache_hit_alignment_tokens(kv, vllm_config, 32, 16) == 32
    assert vllm_config.cache_config.block_size == 16


def test_headline_deepseek_v4() -> None:
    fixture = F.load_fixture("deepseek-v4-flash-tp4")
    vllm_config = F.make_vllm_config(fixture, {"blocks_per_chunk": 1})
    kv = F.rebuild_kv_cache_config(fixture, "scheduler")
    worker = F.rebuild_kv_cache_config(fixture, "worker")
    for view in (kv, worker):
        assert _group_tokens_per_block(view, vllm_config) == [64, 64, 256, 4, 8]
        assert V.resolve_kv_cache_block_sizes(view, vllm_config) == (256, 4)
        assert [len(g.layer_names) for g in view.kv_cache_groups] == [22, 21, 62, 42, 20]
        assert view.kv_tp_replicas == 4
        assert view.kv_cache_layout == "BLHNC"
        assert view.num_blocks == 64280
        # Packed block-outermost: every tensor strides by the whole packed block.
        assert {t.block_stride for t in view.kv_cache_tensors} == {1_002_240}
    assert [type(g.kv_cache_spec).__name__ for g in kv.kv_cache_groups] == [
        "SlidingWindowMLASpec",
        "SlidingWindowMLASpec",
        "MLAAttentionSpec",
        "SlidingWindowMLASpec",
        "SlidingWindowMLASpec",
    ]
    assert all(
        isinstance(g.kv_cache_spec, V.UniformTypeKVCacheSpecs) for g in worker.kv_cache_groups
    )
    assert [g.kv_cache_spec.page_size_bytes for g in worker.kv_cache_groups] == [
        823_680,
        786_240,
        1_002_240,
        870_912,
        656_640,
    ]
    assert [V.get_kv_cache_spec_sliding_window(g.kv_cache_spec) for g in kv.kv_cache_groups] == [
        128,
        128,
        None,
        8,
        128,
    ]
    assert V.resolve_cache_hit_alignment_tokens(kv, vllm_config, 256, 4) == 256
    assert vllm_config.cache_config.block_size == 4
    assert vllm_config.cache_config.cache_dtype == "fp8_ds_mla"
    # Per-layer pages of the notes' table (fp8_ds_mla: 584 B/token padded to 576).
    pages = {
        (type(s).__name__, s.block_size, s.tokens_per_state, s.page_size_bytes)
        for s in F.rebuild_layer_specs(fixture).values()
    }
    assert pages == {
        ("SlidingWindowMLASpec", 64, 1, 37_440),
        ("MLAAttentionSpec", 256, 4, 37_440),
        ("MLAAttentionSpec", 256, 128, 1_728),
        ("MLAAttentionSpec", 256, 4, 8_640),
        ("SlidingWindowMLASpec", 4, 1, 32_832),
        ("SlidingWindowMLASpec", 4, 1, 8_640),
        ("SlidingWindowMLASpec", 8, 1, 32_832),
    }


def test_headline_synthetic() -> None:
    expected = {
        "synthetic-full-swa": ([16, 64], (64, 16)),
        "synthetic-full-mamba-align": ([64, 64], (64, 64)),
        "synthetic-eagle": ([16, 64], (64, 16)),
    }
    for name, (tokens_per_block, block_sizes) in expected.items():
        fixture = F.load_fixture(name)
        vllm_config = F.make_vllm_config(fixture, {"blocks_per_chunk": 1})
        kv = F.rebuild_kv_cache_config(fixture)
        assert _group_tokens_per_block(kv, vllm_config) == tokens_per_block, name
        assert V.resolve_kv_cache_block_sizes(kv, vllm_config) == block_sizes, name
    kv = F.rebuild_kv_cache_config(F.load_fixture("synthetic-full-mamba-align"))
    mamba = kv.kv_cache_groups[0].kv_cache_spec
    assert isinstance(mamba, V.MambaSpec) and mamba.mamba_cache_mode == "align"
    eagle = F.rebuild_kv_cache_config(F.load_fixture("synthetic-eagle"))
    assert [g.is_eagle_group for g in eagle.kv_cache_groups] == [False, True]


def test_sub_hash_unit_is_rejected_by_vllm() -> None:
    """A prefix-cacheable 4-token group under prefix_match_unit=16: vLLM refuses it."""
    fixture = F.load_fixture("synthetic-sub-hash")
    vllm_config = F.make_vllm_config(fixture, {"blocks_per_chunk": 1})
    kv = F.rebuild_kv_cache_config(fixture)
    assert _group_tokens_per_block(kv, vllm_config) == [4, 16]
    with pytest.raises(ValueError, match="prefix_match_unit=16"):
        V.resolve_kv_cache_block_sizes(kv, vllm_config)
    vllm_config.cache_config.prefix_match_unit = None  # the gcd is accepted
    assert V.resolve_kv_cache_block_sizes(kv, vllm_config) == (16, 4)


# --- (d) a real Scheduler with the stock OffloadingConnector ---------------------------


@pytest.mark.parametrize("name", RESOLVABLE)
def test_stock_scheduler_builds_with_blocks_per_chunk(name: str) -> None:
    scheduler = F.build_scheduler(F.load_fixture(name), {"blocks_per_chunk": 1})
    assert isinstance(scheduler, V.Scheduler)
    assert isinstance(scheduler.connector, V.OffloadingConnector)
    assert scheduler.kv_cache_config.kv_cache_groups


def test_stock_scheduler_rejects_sub_hash_unit() -> None:
    with pytest.raises(ValueError, match="prefix_match_unit"):
        F.build_scheduler(F.load_fixture("synthetic-sub-hash"), {"blocks_per_chunk": 1})


@pytest.mark.parametrize("name", [*MODELS, "synthetic-full-swa", "synthetic-eagle"])
def test_stock_connector_block_size_asserts_on_mixed_block_sizes(name: str) -> None:
    """Upstream 0.33.0 behaviour that kvchunk replaces.

    ``build_offloading_config`` asserts ``len(unique_tokens_per_block) == 1`` whenever
    ``kv_connector_extra_config["block_size"]`` is set: Gemma-4 has {16, 32},
    DeepSeek-V4 {64, 256, 4, 8} tokens per block.
    """
    with pytest.raises(AssertionError, match="all groups must have the same block size"):
        F.build_scheduler(F.load_fixture(name), {"block_size": 512})


def test_stock_connector_block_size_works_with_one_block_size() -> None:
    scheduler = F.build_scheduler(F.load_fixture("synthetic-full-mamba-align"), {"block_size": 512})
    assert isinstance(scheduler.connector, V.OffloadingConnector)


# --- CPU patch hygiene -----------------------------------------------------------------


def test_cpu_platform_patch_is_scoped() -> None:
    before = V.current_platform.support_hybrid_kv_cache()
    with F.cpu_platform_patches():
        assert V.current_platform.support_hybrid_kv_cache()
    assert V.current_platform.support_hybrid_kv_cache() == before
