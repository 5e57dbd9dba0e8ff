"""Config fuzzing: one ``kv_connector_extra_config`` on one fixture geometry, judged.

The kvchunk connector is built through vLLM's ``KVConnectorFactory`` (scheduler
role, the fixture's scheduler-view ``KVCacheConfig``).  Where
:func:`reference.knobs.resolve_extra_config` accepts the knob, the connector
must run exactly that chunking (``kvchunk_chunking`` and vLLM's
``SchedulerOffloadConfig``, field by field) unless vLLM 0.33.0 cannot execute
it (unequal per-group values, a group whose block is not a whole number of hash
units) or another key is malformed -- then a ``ValueError`` naming the knob (or
that key).  Where the reference rejects the knob, a ``ValueError`` naming the
knob.  Anything else (an ``AssertionError``, a ``TypeError``, a ``ValueError``
that names no key, a wrong resolution) is *unclean*.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from hypothesis import strategies as st

from conformance.harness import cases
from reference.knobs import BLOCK_SIZE, BLOCKS_PER_CHUNK, Chunking, resolve_extra_config
from vllm_adapter.names import CPU_SPEC, KVCHUNK_CONNECTOR, KVCHUNK_CONNECTOR_MODULE

KNOBS = (BLOCK_SIZE, BLOCKS_PER_CHUNK)

CONFIG_FIXTURES = tuple(f.name for f in cases.FIXTURES)
"""Every stored fixture geometry (``vllm_adapter/fixtures``)."""

# ---------------------------------------------------------------------------
# What the fuzzer draws
# ---------------------------------------------------------------------------

_HUGE = [2**31, 2**32 + 16, 2**63, 2**64, 10**30, 10**400]

knob_scalars = st.one_of(
    st.integers(1, 16),
    st.sampled_from([16, 32, 64, 128, 256, 512, 1024, 2048, 4096]),
    st.integers(-8, 2100),
    st.sampled_from([0, -1, -512, *_HUGE, *(-h for h in _HUGE)]),
    st.integers(-8, 2100).map(str),
    st.sampled_from(
        ["", " ", "abc", "1.5", "8.0", " 64 ", "+32", "-16", "0x10", "1e3", "1_000", "²", "٣",
         "٥١٢", "0", "00", "9" * 40, "nan", "inf", "true", "null", "[2]", "{}"]
    ),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([2.0, 512.0, 1.5, -2.0, 0.0, 1e308, 2.0**70]),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-2, 8), max_size=3),
)
"""Knob values: what JSON -- and careless Python callers -- can carry."""

_group_key = st.one_of(
    st.integers(-2, 8),
    st.integers(-2, 8).map(str),
    st.sampled_from(["default", " 1", "1 ", "01", "x", "", "²", "٣", "default "]),
    st.none(),
    st.booleans(),
)
_nested = st.recursive(
    knob_scalars,
    lambda inner: st.dictionaries(_group_key, inner, max_size=3) | st.lists(inner, max_size=2),
    max_leaves=6,
)
_knob_value = st.one_of(knob_scalars, st.dictionaries(_group_key, _nested, max_size=4), _nested)

OTHER_KEYS: dict[str, Any] = {
    "cpu_bytes_to_use": st.one_of(
        st.sampled_from([1 << 30, 1 << 20, 1, 0, -1, 10**40, 1e300, "1073741824", "lots",
                         float("inf"), None, True, [1]]),
        st.integers(-10, 1 << 34),
    ),
    "store_threshold": st.sampled_from([0, 1, 2, 5, -3, "2", "often", 1.5, float("nan"), True,
                                        None, 10**30]),
    "sync_load_budget_bytes": st.sampled_from([0, 1 << 20, -1, "x", 2.5, [1], None, "4096"]),
    "max_tracker_size": st.sampled_from([64_000, 1, 0, "x", 2.5, None, "100", [3], True]),
    "eviction_policy": st.sampled_from(["lru", "arc", "LRU", "bogus", 3, None, ["lru"]]),
    "cache_policy_module_path": st.sampled_from([None, "no_such_module_kvchunk", 3,
                                                 "vllm.v1.kv_offload.cpu.policies.lru"]),
    "offload_prompt_only": st.sampled_from([True, False, "no", 0, None]),
    "spec_name": st.sampled_from([CPU_SPEC, 3, None, [CPU_SPEC]]),
}
"""vLLM's other offloading keys, with values that may be wrong (the kvchunk connector checks
them)."""

_unknown_key = st.sampled_from(["foo", "blocksize", "block_sizes", "blocks_per_chunks",
                                "kvchunk", "BLOCK_SIZE", "chunk_tokens", ""])
_json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=5,
)


@st.composite
def extra_configs(draw: Any) -> dict[str, Any]:
    """A ``kv_connector_extra_config``: zero, one or both knobs, maybe other and unknown keys."""
    extra: dict[str, Any] = {}
    which = draw(st.sampled_from(["none", "bpc", "bs", "both", "bpc", "bs"]))
    if which in ("bpc", "both"):
        extra[BLOCKS_PER_CHUNK] = draw(_knob_value)
    if which in ("bs", "both"):
        extra[BLOCK_SIZE] = draw(knob_scalars | _nested)
    for key in draw(st.lists(st.sampled_from(sorted(OTHER_KEYS)), max_size=2, unique=True)):
        extra[key] = draw(OTHER_KEYS[key])
    for key in draw(st.lists(_unknown_key, max_size=2, unique=True)):
        extra[key] = draw(_json_value)
    return extra


# ---------------------------------------------------------------------------
# Targets and verdicts
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ConfigTarget:
    """One fixture: its engine config (kvchunk connector) and scheduler-view KV config."""

    name: str
    vllm_config: Any
    kv_cache_config: Any
    base_extra: Mapping[str, Any]
    geometry: Any | None
    """The reference geometry, or None when vLLM rejects the engine config itself."""
    geometry_error: str | None
    retention: int | None


@cache
def config_target(name: str) -> ConfigTarget:
    from vllm_adapter import fixtures as F
    from vllm_adapter.geometry import geometry_from_vllm, retention_interval_from

    fx = F.load_fixture(name)
    vc = F.make_vllm_config(fx, {}, connector=KVCHUNK_CONNECTOR,
                            connector_module_path=KVCHUNK_CONNECTOR_MODULE)
    kvc = F.rebuild_kv_cache_config(fx, "scheduler")
    base = dict(vc.kv_transfer_config.kv_connector_extra_config)
    try:
        geometry, error = geometry_from_vllm(kvc, vc), None
    except ValueError as e:
        geometry, error = None, str(e)
    return ConfigTarget(name, vc, kvc, base, geometry, error, retention_interval_from(vc))


@dataclass(frozen=True)
class ConfigVerdict:
    outcome: str
    """``accepted`` (ran as the reference resolved), ``rejected`` (a clean ValueError) or
    ``unclean``."""
    detail: str = ""

    @property
    def clean(self) -> bool:
        return self.outcome != "unclean"


def _names_key(message: str, keys: Iterable[Any]) -> bool:
    return any(isinstance(k, str) and k and k in message for k in keys)


def _quotes_knob(message: str) -> bool:
    """The message names a knob (``'block_size'`` or ``'blocks_per_chunk'``)."""
    return any(f"'{k}'" in message for k in KNOBS)


def _scheduler_config_mismatch(chunking: Chunking, config: Any) -> str | None:
    """Where vLLM's ``SchedulerOffloadConfig`` differs from the reference chunking (None:
    nowhere)."""
    want = (chunking.tokens_per_hash, chunking.uniform_blocks_per_chunk, chunking.alignment_tokens)
    got = (config.tokens_per_hash, config.blocks_per_chunk, config.alignment_tokens)
    if got != want:
        return (f"(tokens_per_hash, blocks_per_chunk, alignment_tokens): vLLM {got}, "
                f"reference {want}")
    got_groups = [
        (g.group_idx, g.tokens_per_block, g.tokens_per_chunk, g.hashes_per_chunk,
         g.sliding_window_size_in_chunks, g.is_eagle_group)
        for g in config.kv_group_configs
    ]
    want_groups = [
        (gc.group.index, gc.group.tokens_per_block, gc.tokens_per_chunk, gc.hashes_per_chunk,
         gc.window_in_chunks, gc.group.is_eagle)
        for gc in chunking.groups
    ]
    if got_groups != want_groups:
        return f"groups: vLLM {got_groups}, reference {want_groups}"
    return None


# ---------------------------------------------------------------------------
# The judge
# ---------------------------------------------------------------------------


def _build_connector(target: ConfigTarget, vllm_config: Any) -> Any:
    from conformance.harness import vllm_harness_api as V

    return V.KVConnectorFactory.create_connector(
        config=vllm_config, role=V.KVConnectorRole.SCHEDULER, kv_cache_config=target.kv_cache_config
    )


def _judge_refused_geometry(target: ConfigTarget, error: ValueError | None) -> ConfigVerdict:
    """vLLM rejects the engine config whatever the extra config says."""
    if error is None:
        return ConfigVerdict("unclean", f"vLLM rejects the geometry ({target.geometry_error}), "
                                        "yet the connector was built")
    if str(error) != target.geometry_error:
        return ConfigVerdict("unclean", f"expected the geometry's own error, got {error}")
    return ConfigVerdict("rejected", "geometry")


def _judge_reference_rejects(ref_error: ValueError, error: ValueError | None) -> ConfigVerdict:
    """The reference rejects the knob: so must the connector, both naming it."""
    if not _quotes_knob(str(ref_error)):
        return ConfigVerdict("unclean", f"the reference's error names no knob: {ref_error}")
    if error is None:
        return ConfigVerdict("unclean",
                             f"the reference rejects ({ref_error}), the connector accepts")
    if not _quotes_knob(str(error)):
        return ConfigVerdict("unclean", f"the connector's error names no knob: {error}")
    return ConfigVerdict("rejected", "knob")


def _judge_reference_accepts(chunking: Chunking, extra: Mapping[str, Any], connector: Any,
                             error: ValueError | None) -> ConfigVerdict:
    """The reference accepts: what vLLM 0.33.0 cannot run must be refused, naming the knob;
    anything else must run exactly the reference's chunking (or name a malformed other key)."""
    tph = chunking.tokens_per_hash
    unrunnable = chunking.uniform_blocks_per_chunk is None or any(
        gc.group.tokens_per_block % tph for gc in chunking.groups
    )
    other = [k for k in extra if k in OTHER_KEYS]
    if error is not None:
        message = str(error)
        if unrunnable and _quotes_knob(message):
            return ConfigVerdict("rejected", "not runnable by vLLM 0.33.0")
        if other and _names_key(message, other):
            return ConfigVerdict("rejected", "other key")
        return ConfigVerdict("unclean", f"the reference accepts, the connector raised: {message}")
    if unrunnable:
        return ConfigVerdict("unclean", "vLLM 0.33.0 cannot run this chunking, yet the connector "
                                        "was built")
    if connector.kvchunk_chunking != chunking:
        return ConfigVerdict("unclean",
                             "the connector's kvchunk_chunking differs from the reference")
    mismatch = _scheduler_config_mismatch(chunking, connector.connector_scheduler.config)
    if mismatch is not None:
        return ConfigVerdict("unclean", f"vLLM runs another chunking: {mismatch}")
    return ConfigVerdict("accepted")


def check_extra_config(target: ConfigTarget, extra: Mapping[str, Any]) -> ConfigVerdict:
    """Build the kvchunk connector with ``extra`` (over the fixture's CPU-spec keys) and judge it.

    Never raises: every way the connector or the reference may misbehave is an
    ``unclean`` verdict whose detail says what happened.
    """
    from vllm_adapter.geometry import with_extra_config

    full = {**target.base_extra, **extra}
    vc = with_extra_config(target.vllm_config, full)
    try:
        connector = _build_connector(target, vc)
        error: ValueError | None = None
    except ValueError as e:
        connector, error = None, e
    except Exception as e:  # noqa: BLE001 - the verdict is the point
        return ConfigVerdict("unclean", f"connector raised {type(e).__name__}: {e}")
    if target.geometry is None:
        return _judge_refused_geometry(target, error)
    try:
        chunking = resolve_extra_config(target.geometry, full, target.retention)
    except ValueError as e:
        return _judge_reference_rejects(e, error)
    except Exception as e:  # noqa: BLE001
        return ConfigVerdict("unclean", f"reference raised {type(e).__name__}: {e}")
    return _judge_reference_accepts(chunking, extra, connector, error)


# ---------------------------------------------------------------------------
# The reference alone (a geometry vLLM refuses)
# ---------------------------------------------------------------------------


def sub_hash_geometry() -> Any:
    """The synthetic-sub-hash fixture's groups as the reference sees them (tokens_per_hash 16).

    vLLM 0.33.0 rejects this engine config before offloading sees it (vllm#54413);
    the reference accepts a group smaller than the hash unit once its chunk spans one.
    """
    from reference.geometry import Geometry, GroupKind, KVGroup

    return Geometry(
        groups=(
            KVGroup(index=0, kind=GroupKind.SLIDING_WINDOW, tokens_per_block=4, page_bytes=4096,
                    num_layers=2, sliding_window=64),
            KVGroup(index=1, kind=GroupKind.FULL, tokens_per_block=16, page_bytes=4096,
                    num_layers=2),
        ),
        tokens_per_hash=16,
        name="synthetic-sub-hash",
    )


def check_reference_only(geometry: Any, extra: Mapping[str, Any],
                         retention: int | None = 0) -> ConfigVerdict:
    """The reference alone: a chunking whose every chunk ends on a hash boundary, or a clean
    error."""
    try:
        chunking = resolve_extra_config(geometry, extra, retention)
    except ValueError as e:
        if not _quotes_knob(str(e)):
            return ConfigVerdict("unclean", f"the reference's error names no knob: {e}")
        return ConfigVerdict("rejected", "knob")
    except Exception as e:  # noqa: BLE001
        return ConfigVerdict("unclean", f"reference raised {type(e).__name__}: {e}")
    tph = geometry.tokens_per_hash
    for gc in chunking.groups:
        tokens_per_chunk = gc.tokens_per_chunk
        spanned = gc.blocks_per_chunk * gc.group.tokens_per_block
        if tokens_per_chunk % tph or tokens_per_chunk != spanned:
            return ConfigVerdict("unclean",
                                 f"{gc.group.describe()}: {tokens_per_chunk}-token chunks")
    return ConfigVerdict("accepted")
