"""KV-cache geometry fixtures: stored JSON == what the installed vLLM derives now, rebuilt
objects are real and equal, the headline facts hold, and a real Scheduler builds from each
fixture.  Fixtures are stored per vLLM release (``vllm_adapter/fixtures/<version>/``); the
tests under "(e)" read every stored release's JSON (no second vLLM needed) and pin down
what is identical across releases and what differs.

Expectations in ``test_headline_*`` are the models' published geometry (their
``config.json`` in ``vllm_adapter/models/``: gemma-4's 1024-token sliding window and
DeepSeek-V4's {64, 64, 256, 4, 8} tokens per block, as docs/semantics.md §7 uses them);
the values they are compared with are
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

from conformance.testing.requires import require_vllm

require_vllm()

from vllm_adapter import fixtures as F  # noqa: E402
from vllm_adapter import vllm_tools_api as V  # noqa: E402
from vllm_adapter.derive import RECIPES, Derivation, derive_live  # noqa: E402
from vllm_adapter.release_list import SUPPORTED_RELEASES  # noqa: E402

pytestmark = pytest.mark.vllm

ALL = sorted(RECIPES)
MODELS = ["gemma-4-31B-it-tp2", "deepseek-v4-flash-tp4"]
RESOLVABLE = [n for n in ALL if n != "synthetic-sub-hash"]


@functools.cache
def _derived(name: str) -> Derivation:
    return derive_live(RECIPES[name])


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
        f"{name}: stored fixture differs from vLLM's derivation: "
        + "; ".join(F.fixture_differences(stored, derived)[:8])
        + " (`python -m vllm_adapter.fixtures regenerate --check` for a diff)"
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


# Gemma-4 TP2 is planned without --block-size, so its blocks follow vLLM's
# CacheConfig.DEFAULT_BLOCK_SIZE (FlashAttention keeps the default, see
# Platform.update_block_size_for_backend).  vLLM 0.34.0 raised that default from 16 to
# 64: sliding groups 16 -> 64 tokens/block, the full group 32 -> 128, pages 128 -> 512 KiB.
# DEFAULT_BLOCK_SIZE -> (sliding tokens/block, full tokens/block, page bytes).
GEMMA_BY_DEFAULT_BLOCK = {16: (16, 32, 131072), 64: (64, 128, 524288)}


def test_headline_gemma() -> None:
    fixture = F.load_fixture("gemma-4-31B-it-tp2")
    vllm_config = F.make_vllm_config(fixture, {"blocks_per_chunk": 1})
    sliding, full, page = GEMMA_BY_DEFAULT_BLOCK[V.CacheConfig.DEFAULT_BLOCK_SIZE]
    for view in ("scheduler", "worker"):
        kv = F.rebuild_kv_cache_config(fixture, view)
        specs = [g.kv_cache_spec for g in kv.kv_cache_groups]
        assert [type(s).__name__ for s in specs] == ["SlidingWindowSpec"] * 5 + [
            "FullAttentionSpec"
        ]
        assert _group_tokens_per_block(kv, vllm_config) == [sliding] * 5 + [full]
        assert {s.page_size_bytes for s in specs} == {page}
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
        assert V.resolve_kv_cache_block_sizes(kv, vllm_config) == (full, sliding)
        assert kv.kv_tp_replicas == 1
        assert kv.kv_cache_layout == "LBHNC"
        assert kv.num_blocks == 40 * (1 << 30) // (10 * page)  # 32768 / 8192
    kv = F.rebuild_kv_cache_config(fixture)
    assert V.resolve_cache_hit_alignment_tokens(kv, vllm_config, full, sliding) == full
    assert vllm_config.cache_config.block_size == sliding


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
    """Upstream behaviour that kvchunk replaces, unchanged in 0.33.0 and 0.34.0.

    ``build_offloading_config`` asserts ``len(unique_tokens_per_block) == 1`` whenever
    ``kv_connector_extra_config["block_size"]`` is set: Gemma-4 has {16, 32} (0.34.0:
    {64, 128}), DeepSeek-V4 {64, 256, 4, 8} tokens per block.
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


# --- (e) fixtures per vLLM release ---------------------------------------------------------


def test_fixtures_are_read_from_the_installed_releases_directory() -> None:
    assert F.fixtures_dir() == F.FIXTURES_ROOT / V.VLLM_VERSION
    assert F.fixture_path("synthetic-full-swa").parent == F.fixtures_dir()
    assert F.load_fixture("synthetic-full-swa")["vllm_version"] == V.VLLM_VERSION


def test_a_release_without_fixtures_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(V, "VLLM_VERSION", "0.0.1")
    for call in (F.fixture_names, lambda: F.load_fixture("synthetic-full-swa")):
        with pytest.raises(F.MissingFixturesError, match=r"vLLM 0\.0\.1") as err:
            call()
        assert "python -m vllm_adapter.fixtures regenerate" in str(err.value)


VERSIONS = F.stored_versions()
# What may differ between two stored releases besides the geometry itself:
# descriptive text, and fields a release added to vLLM's dataclasses.
DESCRIPTIVE = {"vllm_version", "provenance[*]"}
ADDED_FIELDS = {
    # 0.34.0: AttentionSpec.kv_head_major_slots (default False),
    # SlidingWindowMLASpec.non_causal_multi_token_decode (default False),
    # MambaSpec.state_alignment (default 1), and KVCacheConfig.needs_kv_cache_zeroing
    # (0.33.0 computed it as a property; 0.34.0 stores it, settled across workers).
    ("0.33.0", "0.34.0"): {
        "kv_head_major_slots": False,
        "non_causal_multi_token_decode": False,
        "state_alignment": 1,
        "needs_kv_cache_zeroing": None,  # any value: not a new knob, a stored property
    },
}
# Fixtures whose engine config takes vLLM's default cache block size (no --block-size):
# their blocks scale with it.  0.34.0 raised CacheConfig.DEFAULT_BLOCK_SIZE 16 -> 64.
BLOCK_SCALE = {("0.33.0", "0.34.0"): {"gemma-4-31B-it-tp2": 4}}
SCALED_BY_BLOCK = {
    "block_size", "tokens_per_block", "page_size_bytes", "scheduler_bytes_per_block",
    "worker_bytes_per_block", "block_stride", "hash_block_size", "tokens_per_hash",
    "scheduler_block_size", "cache_hit_alignment_tokens", "cache_config_block_size",
    "cache_config_block_size_after_backend", "cache_config_block_size_initial",
}  # fmt: skip


def _leaf_diffs(a: object, b: object, path: str = "") -> list[tuple[str, object, object]]:
    """``(path, old, new)`` per differing JSON leaf; list indices as ``[*]``; absent = ``...``."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in [*a, *(k for k in b if k not in a)]:
            sub = f"{path}.{key}" if path else key
            out += _leaf_diffs(a.get(key, ...), b.get(key, ...), sub)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for x, y in zip(a, b, strict=True) for d in _leaf_diffs(x, y, f"{path}[*]")]
    return [] if a == b else [(path, a, b)]


def test_every_release_stores_every_recipe() -> None:
    assert VERSIONS == list(SUPPORTED_RELEASES)
    for version in VERSIONS:
        assert F.fixture_names(version) == ALL, version


@pytest.mark.parametrize("old,new", list(zip(VERSIONS, VERSIONS[1:], strict=False)))
@pytest.mark.parametrize("name", ALL)
def test_geometry_across_stored_releases(name: str, old: str, new: str) -> None:
    """Between two stored releases, a fixture differs only in:

    * descriptive text (``vllm_version``, ``provenance``);
    * fields the newer release added to vLLM's dataclasses, at their neutral defaults
      (:data:`ADDED_FIELDS`);
    * for fixtures on vLLM's default cache block size, the block-size scale
      (:data:`BLOCK_SCALE`): tokens per block, page and block bytes, strides, hash and
      alignment tokens times the scale, ``num_blocks`` divided by it.

    Everything else is identical: the groups and their order, layer names, spec classes,
    kinds, sliding windows, tokens per state, prefix-cacheability, EAGLE flags, offloaded
    group ids, cache dtype, KV-cache layout, TP replicas, the rejected geometry's error.
    """
    if (old, new) not in ADDED_FIELDS:
        pytest.fail(f"document what differs between the stored fixtures of {old} and {new}")
    a, b = F.load_fixture(name, old), F.load_fixture(name, new)
    assert (a["vllm_version"], b["vllm_version"]) == (old, new)
    added = ADDED_FIELDS[(old, new)]
    scale = BLOCK_SCALE[(old, new)].get(name, 1)
    initial = "cache_config_block_size_initial"
    assert b["resolved"][initial] == a["resolved"][initial] * scale
    unexplained = []
    for path, x, y in _leaf_diffs(a, b):
        field = path.rsplit(".", 1)[-1]
        if path in DESCRIPTIVE:
            continue
        if x is ... and field in added:
            assert added[field] is None or y == added[field], (path, y)
            continue
        if field in SCALED_BY_BLOCK and isinstance(x, int) and y == x * scale != x:
            continue
        if field == "num_blocks" and isinstance(y, int) and y * scale == x != y:
            continue
        unexplained.append((path, x, y))
    assert unexplained == [], f"{name}: {old} -> {new} differs beyond the documented changes"
