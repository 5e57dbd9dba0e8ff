"""Config fuzzing: every kv_connector_extra_config gets the reference's resolution or a clean error.

The judge is :func:`conformance.harness.fuzz.check_extra_config` (see its module for
the rules): the kvchunk connector, built through vLLM's ``KVConnectorFactory``
on each stored fixture geometry, either runs exactly what
:func:`reference.knobs.resolve_extra_config` resolves or raises a
``ValueError`` naming the knob (or the malformed key); nothing else -- no
``AssertionError``, ``TypeError``, or message that names no key.  The
reference alone is fuzzed on the geometry vLLM refuses (0.33.0 and 0.34.0: a group smaller
than the hash unit), and ``python -m vllm_adapter config`` on the real-model
fixtures (exit 0 with the reference's resolution, or exit 2 and one line).

The conformance faults lane runs the same judge and counts the verdicts for the
report; ``tests/test_connector.py`` holds the hand-picked cases.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance.testing.requires import require_vllm

require_vllm()

from hypothesis import event, given, settings  # noqa: E402

from conformance.harness import fuzz as FZ  # noqa: E402
from conformance.harness.strategies import SLOW_EXAMPLE_CHECKS  # noqa: E402

pytestmark = pytest.mark.vllm

_FUZZ = settings(suppress_health_check=SLOW_EXAMPLE_CHECKS, deadline=None)


def _target(name: str) -> FZ.ConfigTarget:
    return FZ.config_target(name)


@pytest.mark.parametrize("fixture", FZ.CONFIG_FIXTURES)
@_FUZZ
@given(extra=FZ.extra_configs())
def test_connector_resolves_as_the_reference_or_rejects_cleanly(
    fixture: str, extra: dict[str, Any]
) -> None:
    verdict = FZ.check_extra_config(_target(fixture), extra)
    event(f"{verdict.outcome}: {verdict.detail}"[:60])
    assert verdict.clean, f"{extra!r}: {verdict.detail}"


@_FUZZ
@given(extra=FZ.extra_configs())
def test_reference_on_a_group_smaller_than_the_hash_unit(extra: dict[str, Any]) -> None:
    verdict = FZ.check_reference_only(FZ.sub_hash_geometry(), extra)
    assert verdict.clean, f"{extra!r}: {verdict.detail}"


# Hand-picked members of each input class the strategy draws from, so a shrunk
# strategy cannot silently stop covering one.
CLASSES: list[tuple[str, dict[str, Any], str]] = [
    ("string", {"blocks_per_chunk": "2"}, "accepted"),
    ("junk string", {"block_size": "abc"}, "rejected"),
    ("superscript digit", {"blocks_per_chunk": "²"}, "rejected"),
    # Knob strings are ASCII digits, maybe one '+' and spaces (reference.knobs.is_integer_string),
    # although int() takes Arabic-Indic digits and underscores.
    ("arabic-indic digits", {"block_size": "٥١٢"}, "rejected"),
    ("doubled sign", {"blocks_per_chunk": "++5"}, "rejected"),
    ("underscore", {"block_size": "5_12"}, "rejected"),
    ("plus sign and spaces", {"blocks_per_chunk": " +2 "}, "accepted"),
    ("integral float", {"blocks_per_chunk": 2.0}, "accepted"),
    ("fractional float", {"blocks_per_chunk": 2.5}, "rejected"),
    ("nan", {"block_size": float("nan")}, "rejected"),
    ("inf", {"blocks_per_chunk": float("inf")}, "rejected"),
    ("bool", {"blocks_per_chunk": True}, "rejected"),
    ("negative", {"block_size": -512}, "rejected"),
    ("zero", {"blocks_per_chunk": 0}, "rejected"),
    # Chunks far longer than max_model_len (tiny-hybrid: 65536 tokens): never stored, refused.
    ("huge", {"blocks_per_chunk": 10**30}, "rejected"),
    ("huge float", {"blocks_per_chunk": 1e308}, "rejected"),
    # 64-token full blocks: 1024 blocks span max_model_len exactly, 1025 one block more.
    ("chunk as long as max_model_len", {"blocks_per_chunk": 65536 // 64}, "accepted"),
    ("chunk past max_model_len", {"blocks_per_chunk": 65536 // 64 + 1}, "rejected"),
    ("nested object", {"blocks_per_chunk": {"0": {"1": 2}}}, "rejected"),
    ("list", {"block_size": [512]}, "rejected"),
    ("both knobs", {"block_size": 512, "blocks_per_chunk": 2}, "rejected"),
    ("per-group map, missing group", {"blocks_per_chunk": {"7": 2}}, "rejected"),
    ("per-group map, group named twice", {"blocks_per_chunk": {"0": 2, 0: 2}}, "rejected"),
    ("per-group map, equal values", {"blocks_per_chunk": {"default": 2}}, "accepted"),
    ("unknown keys", {"blocks_per_chunk": 2, "blocksize": 7, "kvchunk": {"x": [1]}}, "accepted"),
    ("bad max_tracker_size", {"max_tracker_size": None}, "rejected"),
    ("bad eviction_policy", {"eviction_policy": ["lru"]}, "rejected"),
    ("unknown eviction_policy", {"eviction_policy": "LRU"}, "rejected"),
    ("bad cache policy module",
     {"eviction_policy": "custom", "cache_policy_module_path": "no_such_module_kvchunk"}, "rejected"),
    # A registered policy wins over the module path, as in vLLM's CachePolicyFactory.
    ("unused cache policy module", {"cache_policy_module_path": "no_such_module_kvchunk"}, "accepted"),
]


@pytest.mark.parametrize(("what", "extra", "outcome"), CLASSES, ids=[c[0] for c in CLASSES])
def test_input_classes_on_the_mixed_hybrid(what: str, extra: dict[str, Any], outcome: str) -> None:
    target = _target("synthetic-full-swa")
    verdict = FZ.check_extra_config(target, extra)
    assert (verdict.outcome, verdict.clean) == (outcome, True), verdict.detail
    if outcome == "rejected":
        # The judge accepts an error quoting either knob; the user needs the key they wrote.
        message = _connector_error(target, extra)
        assert any(f"'{key}'" in message for key in extra if isinstance(key, str)), (
            f"{what}: the error names none of {sorted(map(str, extra))}: {message}"
        )


def _connector_error(target: Any, extra: dict[str, Any]) -> str:
    """The connector's ValueError for ``extra`` over the fixture's CPU-spec keys."""
    from conformance.harness.vllm_harness_api import KVConnectorFactory, KVConnectorRole
    from vllm_adapter.geometry import with_extra_config

    vllm_config = with_extra_config(target.vllm_config, {**target.base_extra, **extra})
    with pytest.raises(ValueError) as info:
        KVConnectorFactory.create_connector(config=vllm_config, role=KVConnectorRole.SCHEDULER,
                                            kv_cache_config=target.kv_cache_config)
    return str(info.value)


def test_sub_hash_geometry_is_refused_by_vllm_for_every_config() -> None:
    target = _target("synthetic-sub-hash")
    assert target.geometry is None and "prefix_match_unit" in (target.geometry_error or "")
    for extra in ({}, {"blocks_per_chunk": 4}, {"block_size": 64}):
        assert FZ.check_extra_config(target, extra).outcome == "rejected"
    geometry = FZ.sub_hash_geometry()
    # kvchunk's rule: the 4-token group needs chunks spanning a 16-token hash unit.
    assert FZ.check_reference_only(geometry, {"blocks_per_chunk": 2}).outcome == "rejected"
    assert FZ.check_reference_only(geometry, {"blocks_per_chunk": {"0": 4, "1": 1}}).outcome == "accepted"


@settings(suppress_health_check=SLOW_EXAMPLE_CHECKS, deadline=None, max_examples=40)
@given(case=FZ.cli_cases())
def test_cli_resolves_as_the_reference_or_exits_2_with_one_line(
    case: tuple[str, list[str], dict[str, str]]
) -> None:
    fixture = case[0]
    _target(fixture)
    verdict = FZ.check_cli(case)
    assert verdict.clean, f"{case!r}: {verdict.detail}"


@pytest.mark.parametrize(
    ("argv", "knob", "outcome"),
    [
        (["--block-size", "512"], {"block_size": "512"}, "accepted"),
        (["--block-size", "²"], {"block_size": "²"}, "rejected"),
        (["--blocks-per-chunk", "0"], {"blocks_per_chunk": "0"}, "rejected"),
        (["--block-size", "512", "--blocks-per-chunk", "2"],
         {"block_size": "512", "blocks_per_chunk": "2"}, "rejected"),
        (["--cpu-bytes", "abc"], {}, "rejected"),
        (["--cpu-bytes", "1"], {}, "rejected"),
    ],
)
def test_cli_cases(argv: list[str], knob: dict[str, str], outcome: str) -> None:
    _target("gemma-4-31B-it-tp2")
    verdict = FZ.check_cli(("gemma-4-31B-it-tp2", argv, knob))
    assert (verdict.outcome, verdict.clean) == (outcome, True), verdict.detail


def test_strategy_draws_every_input_class() -> None:
    """The fuzzer reaches strings, floats, bools, nesting, both knobs and unknown keys."""
    seen: set[str] = set()

    @settings(max_examples=300, database=None, suppress_health_check=SLOW_EXAMPLE_CHECKS)
    @given(extra=FZ.extra_configs())
    def collect(extra: dict[str, Any]) -> None:
        for key in ("block_size", "blocks_per_chunk"):
            if key in extra:
                seen.add(type(extra[key]).__name__)
        if "block_size" in extra and "blocks_per_chunk" in extra:
            seen.add("both")
        if set(extra) - {"block_size", "blocks_per_chunk"} - set(FZ.OTHER_KEYS):
            seen.add("unknown")

    collect()
    assert {"int", "str", "float", "bool", "dict", "list", "NoneType", "both", "unknown"} <= seen
