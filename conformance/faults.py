"""Reliability: config fuzzing, fault injection through the data path, leak checks, load.

Three parts, used by ``conformance/lanes/test_faults.py`` (which records the
counters of the report's Reliability table) and ``tests/test_config_fuzz.py``.

Config fuzzing (:func:`check_extra_config`)
    One ``kv_connector_extra_config`` on one fixture geometry, judged against
    the reference.  The kvchunk connector is built through vLLM's
    ``KVConnectorFactory`` (scheduler role, the fixture's scheduler-view
    ``KVCacheConfig``).  Where :func:`reference.knobs.resolve_extra_config`
    accepts the knob, the connector must run exactly that chunking
    (``kvchunk_chunking`` and vLLM's ``SchedulerOffloadConfig``, field by field)
    unless vLLM 0.33.0 cannot execute it (unequal per-group values, a group
    whose block is not a whole number of hash units) or another key is
    malformed -- then a ``ValueError`` naming the knob (or that key).  Where the
    reference rejects the knob, a ``ValueError`` naming the knob.  Anything
    else (an ``AssertionError``, a ``TypeError``, a ``ValueError`` that names no
    key, a wrong resolution) is *unclean*.

Fault injection (:class:`FaultyWorker`, :class:`FaultRunner`, :func:`run_fault_scenario`)
    The driver's runner path (vLLM's real ``Scheduler``, ``OffloadingConnector``
    scheduler and worker halves, ``CPUOffloadingManager``) with
    :class:`vllm_adapter.spec.ReferenceOffloadingWorker` doing the copies,
    wrapped by :class:`FaultyWorker`, which decides each job's fate:

    * *delayed*: the copy runs when the job is due, ``0 .. max_delay`` steps
      after submission, at the worker's ``get_finished`` -- after that step's
      forward pass -- or earlier when vLLM ``wait`` s for it (a flush, a sync
      load).  Every job is executed this lazily, so a block vLLM reuses before
      flushing a store, or a request run before its load finished, shows.
    * *failed store* (``store_lost``): vLLM 0.33.0 cannot represent one --
      ``OffloadingConnectorWorker.get_finished`` asserts
      ``TransferResult.success`` -- so a failed store is a *lost* one: the
      worker drops the copy, fills the destination CPU chunks with poison and
      never reports the job.  vLLM keeps its keys write-pending
      (``ref_cnt == -1``, ``LookupResult.HIT_PENDING``): never loadable, which
      the suite checks on every load job and at the end.  The price is
      liveness: a lookup that meets a pending key is deferred, so every
      request sharing that prefix (and the request itself, if preempted) waits
      until a connector reset drops the key -- :func:`play` detects the stall
      and resets (``lost_store_stall_resets``).  The job, its chunks and its
      request's connector state stay allocated until such a reset; after it the
      job waits in vLLM's reset fence forever (``has_pending_push_work()``
      stays True, the engine never idles).  That residue is accounted
      (``lost_store_*`` counters), not counted as a leak.
    * *rank-partial store* (world size > 1): a random non-empty proper subset
      of the ranks loses the job; the others report it.  vLLM sums the reports
      (:meth:`DriverSession._rank_reports`), the job never reaches
      ``world_size`` and stays pending like a lost one (chunks poisoned).
    * *failed load* (``load_failed``; with world size > 1 a random non-empty
      subset of ranks fails it): the copy is not made, the destination blocks
      keep their poison, the job is reported done and its request named in
      ``KVConnectorOutput.failed_recving`` -- vLLM's
      ``kv_load_failure_policy="recompute"`` path resets the request and
      recomputes.  Only asynchronous loads can fail (a sync load's request
      already runs that step; vLLM has no per-request failure report for it).

    The scenario adds the rest through vLLM's own mechanisms: a tiny CPU pool
    (``prepare_store`` refuses: *cpu_full*), evictions while loads pin chunks,
    small GPU pools (preemption with transfers in flight), aborts of requests
    with jobs in flight, and GPU / connector prefix-cache resets mid-flight.
    Two reset patterns hit vLLM bugs (both in 0.33.0; the first still in 0.34.0)
    and are steered around (:func:`_reset`;
    deviations ``connector-reset-stale-swa-blocks`` and ``connector-reset-twice``,
    reproduced by strict-xfail tests in the lane): a connector reset while
    requests keep running on a geometry with a sliding-window group, and two
    resets between one step and the next.

    Checks (:class:`FaultRunner`): every executed load is compared block by
    block with the synthetic expected bytes (:mod:`conformance.kvdata`), with
    no byte outside its destination rows changed; in every forward pass
    (after its writes: vLLM lets a request hit blocks another request of the
    same batch is filling) every complete, non-null block the request's table
    holds in a non-Mamba group must hold its expected bytes -- checked against
    a shadow of what each block holds, and byte by byte on small KV memories
    (*reads*: this covers loads
    finished late, failed loads recomputed, stale blocks after resets); no load
    job may name a key whose store was lost.  After the trace drains
    (:func:`leak_report`): every GPU block free with ref count 0 (free count
    back to its baseline), no request state left in the scheduler, the
    connector scheduler and the worker beyond what lost stores account for,
    every CPU chunk in vLLM's manager with ref count 0 (or -1 for a lost
    store's key) and the manager's counters consistent; then a connector
    reset must leave the manager empty.

Load (:func:`run_load_trace`)
    >= 1,000 requests over a handful of shared documents, small GPU and CPU
    pools, periodic GPU prefix-cache resets, jobs delayed at random; the same
    checks, plus RSS and bookkeeping sizes sampled over the run.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import torch
from hypothesis import strategies as st

from conformance.kvdata import SyntheticModelRunner, _flat_bytes, prefix_hashes
from reference.knobs import BLOCK_SIZE, BLOCKS_PER_CHUNK, Chunking, resolve_extra_config

__all__ = [
    "CONFIG_FIXTURES",
    "ConfigTarget",
    "ConfigVerdict",
    "FaultPlan",
    "FaultRunner",
    "FaultScenario",
    "FaultStats",
    "FaultyWorker",
    "check_cli",
    "check_extra_config",
    "cli_cases",
    "check_reference_only",
    "config_target",
    "extra_configs",
    "leak_report",
    "run_fault_scenario",
    "run_load_trace",
    "sub_hash_geometry",
]

KNOBS = (BLOCK_SIZE, BLOCKS_PER_CHUNK)
KVCHUNK = "KvchunkOffloadingConnector"
KVCHUNK_MODULE = "vllm_adapter.connector"

# ---------------------------------------------------------------------------
# Config fuzzing
# ---------------------------------------------------------------------------

CONFIG_FIXTURES = (
    "gemma-4-31B-it-tp2",
    "deepseek-v4-flash-tp4",
    "synthetic-full-swa",
    "synthetic-eagle",
    "synthetic-full-mamba-align",
    "synthetic-sub-hash",
)
"""Every stored fixture geometry (``vllm_adapter/fixtures``)."""

_HUGE = [2**31, 2**32 + 16, 2**63, 2**64, 10**30, 10**400]

# Knob values: what JSON -- and careless Python callers -- can carry.
_scalar = st.one_of(
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
_group_key = st.one_of(
    st.integers(-2, 8),
    st.integers(-2, 8).map(str),
    st.sampled_from(["default", " 1", "1 ", "01", "x", "", "²", "٣", "default "]),
    st.none(),
    st.booleans(),
)
_nested = st.recursive(
    _scalar, lambda inner: st.dictionaries(_group_key, inner, max_size=3) | st.lists(inner, max_size=2),
    max_leaves=6,
)
_knob_value = st.one_of(_scalar, st.dictionaries(_group_key, _nested, max_size=4), _nested)

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
    "spec_name": st.sampled_from(["CPUOffloadingSpec", 3, None, ["CPUOffloadingSpec"]]),
}
"""vLLM's other offloading keys, with values that may be wrong (the kvchunk connector checks them)."""

_unknown_key = st.sampled_from(["foo", "blocksize", "block_sizes", "blocks_per_chunks",
                                "kvchunk", "BLOCK_SIZE", "chunk_tokens", ""])
_json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
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
        extra[BLOCK_SIZE] = draw(_scalar | _nested)
    for key in draw(st.lists(st.sampled_from(sorted(OTHER_KEYS)), max_size=2, unique=True)):
        extra[key] = draw(OTHER_KEYS[key])
    for key in draw(st.lists(_unknown_key, max_size=2, unique=True)):
        extra[key] = draw(_json_value)
    return extra


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
    vc = F.make_vllm_config(fx, {}, connector=KVCHUNK, connector_module_path=KVCHUNK_MODULE)
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
    """``accepted`` (ran as the reference resolved), ``rejected`` (a clean ValueError) or ``unclean``."""
    detail: str = ""

    @property
    def clean(self) -> bool:
        return self.outcome != "unclean"


def _names_key(message: str, keys: Iterable[Any]) -> bool:
    return any(isinstance(k, str) and k and k in message for k in keys)


def _quotes_knob(message: str) -> bool:
    return any(f"'{k}'" in message for k in KNOBS)


def _scheduler_config_mismatch(chunking: Chunking, config: Any) -> str | None:
    """Where vLLM's ``SchedulerOffloadConfig`` differs from the reference chunking (None: nowhere)."""
    want = (chunking.tokens_per_hash, chunking.uniform_blocks_per_chunk, chunking.alignment_tokens)
    got = (config.tokens_per_hash, config.blocks_per_chunk, config.alignment_tokens)
    if got != want:
        return f"(tokens_per_hash, blocks_per_chunk, alignment_tokens): vLLM {got}, reference {want}"
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


def _build_connector(target: ConfigTarget, vllm_config: Any) -> Any:
    from vllm_adapter import vllm_api as V

    return V.KVConnectorFactory.create_connector(
        config=vllm_config, role=V.KVConnectorRole.SCHEDULER, kv_cache_config=target.kv_cache_config
    )


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
        # vLLM rejects the engine config whatever the extra config says.
        if error is None:
            return ConfigVerdict("unclean", f"vLLM rejects the geometry ({target.geometry_error}), "
                                            "yet the connector was built")
        if str(error) != target.geometry_error:
            return ConfigVerdict("unclean", f"expected the geometry's own error, got {error}")
        return ConfigVerdict("rejected", "geometry")

    try:
        chunking: Chunking | None = resolve_extra_config(target.geometry, full, target.retention)
        ref_error: ValueError | None = None
    except ValueError as e:
        chunking, ref_error = None, e
    except Exception as e:  # noqa: BLE001
        return ConfigVerdict("unclean", f"reference raised {type(e).__name__}: {e}")

    if chunking is None:
        assert ref_error is not None
        if not _quotes_knob(str(ref_error)):
            return ConfigVerdict("unclean", f"the reference's error names no knob: {ref_error}")
        if error is None:
            return ConfigVerdict("unclean", f"the reference rejects ({ref_error}), the connector accepts")
        if not _quotes_knob(str(error)):
            return ConfigVerdict("unclean", f"the connector's error names no knob: {error}")
        return ConfigVerdict("rejected", "knob")

    # The reference accepts.  What vLLM 0.33.0 cannot run must be refused, naming the knob.
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
        return ConfigVerdict("unclean", "the connector's kvchunk_chunking differs from the reference")
    mismatch = _scheduler_config_mismatch(chunking, connector.connector_scheduler.config)
    if mismatch is not None:
        return ConfigVerdict("unclean", f"vLLM runs another chunking: {mismatch}")
    return ConfigVerdict("accepted")


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


def check_reference_only(geometry: Any, extra: Mapping[str, Any], retention: int | None = 0) -> ConfigVerdict:
    """The reference alone: a chunking whose every chunk ends on a hash boundary, or a clean error."""
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
        if gc.tokens_per_chunk % tph or gc.tokens_per_chunk != gc.blocks_per_chunk * gc.group.tokens_per_block:
            return ConfigVerdict("unclean", f"{gc.group.describe()}: {gc.tokens_per_chunk}-token chunks")
    return ConfigVerdict("accepted")


# ---------------------------------------------------------------------------
# Config fuzzing: the CLI (python -m vllm_adapter config)
# ---------------------------------------------------------------------------

CLI_FIXTURES = ("gemma-4-31B-it-tp2", "deepseek-v4-flash-tp4")
"""The fixtures of real models (the CLI plans model directories, not hand-made groups)."""

CLI_PREFIX = "python -m vllm_adapter config: error: "

_cli_text = st.one_of(
    _scalar.map(str),
    st.sampled_from(["", "512", "16", "2", " 4 ", "+8", "0", "-1", "1e3", "0x10", "abc", "²",
                     "٥١٢", "8.0", "99999999999999999999999999", "1_000"]),
)
_cli_bytes = st.sampled_from(["25GiB", "16MiB", "1.5GB", "1", "0", "-1", "abc", "1e3", "4096",
                              "10TiB", "0.5KiB", "1.5B", "99999999999999999999999999"])


@st.composite
def cli_cases(draw: Any) -> tuple[str, list[str], dict[str, str]]:
    """``(fixture, extra argv, knob)``: the knob flags and ``--cpu-bytes`` / ``--chunk-bytes`` as text."""
    fixture = draw(st.sampled_from(CLI_FIXTURES))
    argv: list[str] = []
    knob: dict[str, str] = {}
    for flag, key in (("--block-size", BLOCK_SIZE), ("--blocks-per-chunk", BLOCKS_PER_CHUNK)):
        if draw(st.booleans()) and (not knob or draw(st.integers(0, 3)) == 0):
            knob[key] = draw(_cli_text)
            argv += [flag, knob[key]]
    if draw(st.integers(0, 5)) == 0:
        argv += ["--chunk-bytes", draw(_cli_bytes)]
    if draw(st.booleans()):
        argv += ["--cpu-bytes", draw(_cli_bytes)]
    return fixture, argv, knob


@cache
def _cli_base_argv(fixture: str) -> tuple[str, ...]:
    from vllm_adapter import fixtures as F

    fx = F.load_fixture(fixture)
    ea = fx["engine_args"]
    argv = ["config", "--model", str(F.model_dir_path(fx)),
            "--tensor-parallel-size", str(ea["tensor_parallel_size"])]
    if ea.get("block_size") is not None:
        argv += ["--block-size-gpu", str(ea["block_size"])]
    if ea.get("kv_cache_dtype", "auto") != "auto":
        argv += ["--kv-cache-dtype", str(ea["kv_cache_dtype"])]
    if ea.get("disable_hybrid_kv_cache_manager"):
        argv.append("--no-hybrid")
    for key, flag in (("prefix_match_unit", "--prefix-match-unit"),
                      ("mamba_cache_mode", "--mamba-cache-mode"),
                      ("max_model_len", "--max-model-len")):
        if ea.get(key) is not None:
            argv += [flag, str(ea[key])]
    return (*argv, "--format", "json")


def check_cli(case: tuple[str, list[str], dict[str, str]]) -> ConfigVerdict:
    """Run the CLI in-process: exit 0 with the reference's resolution, or 2 with one error line."""
    import io
    import json

    from vllm_adapter import cli

    fixture, argv, knob = case
    out, err = io.StringIO(), io.StringIO()
    try:
        code = cli.main([*_cli_base_argv(fixture), *argv], stdout=out, stderr=err)
    except BaseException as e:  # noqa: BLE001 - nothing may escape main
        return ConfigVerdict("unclean", f"main raised {type(e).__name__}: {e}")
    lines = err.getvalue().splitlines()
    if code == 2:
        if len(lines) != 1 or not lines[0].startswith(CLI_PREFIX) or out.getvalue():
            return ConfigVerdict("unclean", f"exit 2 but stderr {lines!r}, stdout "
                                            f"{out.getvalue()[:80]!r}")
        if "--chunk-bytes" in argv or len(knob) > 1:
            return ConfigVerdict("rejected", lines[0])
        target = config_target(fixture)
        try:
            chunking = resolve_extra_config(target.geometry, knob, target.retention)
        except ValueError:
            return ConfigVerdict("rejected", lines[0])
        tph = chunking.tokens_per_hash
        if any(gc.group.tokens_per_block % tph for gc in chunking.groups):
            return ConfigVerdict("rejected", lines[0])
        if "--cpu-bytes" in argv and "--cpu-bytes" in lines[0]:
            return ConfigVerdict("rejected", lines[0])
        return ConfigVerdict("unclean", f"the reference accepts {knob}, the CLI says {lines[0]}")
    if code != 0:
        return ConfigVerdict("unclean", f"exit {code}: {lines!r}")
    doc = json.loads(out.getvalue())
    target = config_target(fixture)
    if "--chunk-bytes" in argv:
        want = int(argv[argv.index("--chunk-bytes") + 1]) if argv[argv.index("--chunk-bytes") + 1].isdecimal() else None
        if want is not None and doc["cpu_tier"]["chunk_bytes_per_worker"] < want:
            return ConfigVerdict("unclean", f"--chunk-bytes {want}: chunks of "
                                            f"{doc['cpu_tier']['chunk_bytes_per_worker']} bytes")
        return ConfigVerdict("accepted")
    try:
        chunking = resolve_extra_config(target.geometry, knob, target.retention)
    except ValueError as e:
        return ConfigVerdict("unclean", f"the CLI accepts {knob}, the reference rejects: {e}")
    got = (doc["knob"]["blocks_per_chunk"], doc["vllm"]["tokens_per_hash"],
           [g["tokens_per_chunk"] for g in doc["groups"]])
    want_ = (chunking.uniform_blocks_per_chunk, chunking.tokens_per_hash,
             [gc.tokens_per_chunk for gc in chunking.groups])
    if got != want_:
        return ConfigVerdict("unclean", f"the CLI resolves {knob} to {got}, the reference {want_}")
    cpu = doc["cpu_tier"]
    if cpu["cpu_bytes_to_use"] is not None and cpu["num_chunks"] != cpu["cpu_bytes_to_use"] // cpu["slot_bytes"]:
        return ConfigVerdict("unclean", f"cpu tier arithmetic: {cpu}")
    return ConfigVerdict("accepted")


# ---------------------------------------------------------------------------
# Fault injection: the worker
# ---------------------------------------------------------------------------

POISON = 0xE7
"""Fills lost stores' CPU chunks and failed (or not yet finished) loads' GPU blocks."""

FAULT_TYPES = (
    "delayed_jobs",
    "store_lost",
    "store_rank_partial",
    "load_failed",
    "load_rank_partial",
    "cpu_full",
    "evictions_with_loads_pending",
    "preemptions_in_flight",
    "aborts_in_flight",
    "resets_in_flight",
    "connector_resets",
)
"""Fault kinds counted by the suite (``fault:<type>`` counters)."""


@dataclass(frozen=True)
class FaultPlan:
    """Per-job fault probabilities (seeded): the :class:`FaultyWorker`'s dice."""

    seed: int = 0
    max_delay: int = 0
    """Each job finishes ``0 .. max_delay`` steps after submission (uniform)."""
    p_store_lost: float = 0.0
    p_load_fail: float = 0.0
    p_rank_partial: float = 0.0
    """World size > 1: share of the failures above that hit a random subset of ranks only."""


@dataclass
class FaultStats:
    """What the fault suite injected and saw; every field becomes a counter."""

    injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_TYPES, 0))
    jobs_submitted: int = 0
    loads_executed: int = 0
    loaded_blocks_checked: int = 0
    corrupted_loads: int = 0
    foreign_bytes_changed: int = 0
    blocks_read_checked: int = 0
    corrupted_reads: int = 0
    recomputed_blocks_checked: int = 0
    failed_store_loaded: int = 0
    lost_store_keys_checked: int = 0
    lost_store_jobs_retained: int = 0
    lost_store_stall_resets: int = 0
    """Connector resets the suite made because requests waited forever on a lost store's key."""
    leaks: int = 0
    failures: list[str] = field(default_factory=list)

    def merge(self, other: FaultStats) -> None:
        for k, v in other.injected.items():
            self.injected[k] = self.injected.get(k, 0) + v
        for name in _STAT_FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for text in other.failures:
            self.fail(text)

    def count(self, kind: str, n: int = 1) -> None:
        self.injected[kind] += n

    def fail(self, text: str) -> None:
        if len(self.failures) < 12:
            self.failures.append(text)

    def counters(self) -> dict[str, int]:
        out = {f"fault:{k}": v for k, v in self.injected.items()}
        for name in _STAT_FIELDS:
            out[f"faults_{name}"] = int(getattr(self, name))
        return out

    def describe(self) -> str:
        inj = ", ".join(f"{k} {v}" for k, v in self.injected.items() if v)
        return (
            f"injected: {inj or 'nothing'}; {self.loads_executed} loads executed, "
            f"{self.loaded_blocks_checked} loaded blocks checked ({self.corrupted_loads} corrupted, "
            f"{self.foreign_bytes_changed} foreign bytes changed), {self.blocks_read_checked} reads "
            f"checked ({self.corrupted_reads} corrupted, {self.recomputed_blocks_checked} after a "
            f"failed load), {self.failed_store_loaded} loads of lost-store keys, {self.leaks} leaks, "
            f"{self.lost_store_jobs_retained} lost store jobs retained, "
            f"{self.lost_store_stall_resets} stall resets"
            + "".join(f"\n  {f}" for f in self.failures)
        )


_STAT_FIELDS = (
    "jobs_submitted", "loads_executed", "loaded_blocks_checked", "corrupted_loads",
    "foreign_bytes_changed", "blocks_read_checked", "corrupted_reads", "recomputed_blocks_checked",
    "failed_store_loaded", "lost_store_keys_checked", "lost_store_jobs_retained",
    "lost_store_stall_resets", "leaks",
)


@dataclass(eq=False)
class _Job:
    job_id: int
    store: bool
    src: Any
    dst: Any
    due: int
    fate: str = "ok"
    """ok | lost | partial (stores); ok | fail (loads)."""
    ranks: int = 0
    """Ranks that report the job (partial stores)."""
    req_id: str | None = None
    tokens: tuple[int, ...] = ()
    keys: frozenset[bytes] = frozenset()


class FaultyWorker:
    """An ``OffloadingWorker`` around the spec's real one that injects faults (module doc).

    Installed by ``VllmDriver.session(worker_wrapper=...)``; ``inner`` is the
    :class:`vllm_adapter.spec.ReferenceOffloadingWorker` ``register_kv_caches``
    built.  Copies are the inner worker's, made when a job is due.
    """

    def __init__(
        self, session: Any, inner: Any, plan: FaultPlan, runner: FaultRunner, stats: FaultStats
    ) -> None:
        self.session = session
        self.inner = inner
        self.plan = plan
        self.runner = runner
        self.stats = stats
        self.rng = random.Random(plan.seed)
        self.world_size = int(session.vllm_config.parallel_config.world_size)
        self.pending: dict[int, _Job] = {}
        self.lost: dict[int, _Job] = {}
        self.lost_keys: set[bytes] = set()
        self._results: list[Any] = []
        self._failed: set[int] = set()
        self._ranks: dict[int, int] = {}
        self.failed_load_reqs: set[str] = set()

    # -- the OffloadingWorker interface --------------------------------------

    def _delay(self) -> int:
        return self.rng.randint(0, self.plan.max_delay) if self.plan.max_delay else 0

    def _job_keys(self, job_id: int) -> frozenset[bytes]:
        status = self.session.connector_scheduler._jobs.get(job_id)
        return frozenset(status.keys) if status is not None else frozenset()

    def _gpu_side(self, gpu_side: Any) -> Any:
        """The GPU side of a job as ``vllm_api.GpuBlocks`` (block ids, group sizes, indices).

        vLLM passes a ``GPULoadStoreSpec`` (0.33.0) or ``DevicePointers`` (0.34.0);
        the inner worker decodes either and takes the result back when the job runs,
        and the runner's checks read its ``block_ids`` / ``group_sizes`` /
        ``block_indices`` whatever the release.
        """
        return self.inner.gpu_blocks(gpu_side)

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        self.stats.jobs_submitted += 1
        src_spec = self._gpu_side(src_spec)
        job = _Job(job_id, True, src_spec, dst_spec, self.session.step_no + self._delay())
        job.keys = self._job_keys(job_id)
        status = self.session.connector_scheduler._jobs.get(job_id)
        job.req_id = None if status is None else status.req_id
        if job.due > self.session.step_no:
            self.stats.count("delayed_jobs")
        if self.rng.random() < self.plan.p_store_lost:
            if self.world_size > 1 and self.rng.random() < self.plan.p_rank_partial:
                job.fate, job.ranks = "partial", self.rng.randint(1, self.world_size - 1)
                self.stats.count("store_rank_partial")
            else:
                job.fate = "lost"
                self.stats.count("store_lost")
            self._lose(job)
            if job.fate == "lost":
                return True
        self.pending[job_id] = job
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        self.stats.jobs_submitted += 1
        s = self.session
        dst_spec = self._gpu_side(dst_spec)
        job = _Job(job_id, False, src_spec, dst_spec, s.step_no + (0 if expedited else self._delay()))
        job.req_id = s.load_req.get(job_id)
        if job.req_id is not None and job.req_id in s.scheduler.requests:
            job.tokens = tuple(s.scheduler.requests[job.req_id].all_token_ids)
        job.keys = self._job_keys(job_id)
        if job.keys & self.lost_keys:
            self.stats.failed_store_loaded += len(job.keys & self.lost_keys)
            self.stats.fail(f"load job {job_id} ({job.req_id}) reads keys whose store was lost")
        if job.due > s.step_no:
            self.stats.count("delayed_jobs")
        if not expedited and self.rng.random() < self.plan.p_load_fail:
            job.fate = "fail"
            partial = self.world_size > 1 and self.rng.random() < self.plan.p_rank_partial
            self.stats.count("load_rank_partial" if partial else "load_failed")
        # Until the copy is made the destination holds poison: a read shows it.
        self.runner.poison_gpu(dst_spec)
        self.pending[job_id] = job
        if expedited:
            self.wait({job_id})
        return True

    def get_finished(self) -> list[Any]:
        now = self.session.step_no
        for job_id in sorted(j for j, job in self.pending.items() if job.due <= now):
            self._execute(self.pending.pop(job_id))
        done = list(self.inner.get_finished()) + self._results
        self._results = []
        return done

    def wait(self, job_ids: set[int]) -> None:
        for job_id in sorted(job_ids):
            job = self.pending.pop(job_id, None)
            if job is not None:
                self._execute(job)

    def shutdown(self) -> None:
        self.pending.clear()
        self.inner.shutdown()

    # -- driver hooks --------------------------------------------------------

    @property
    def in_flight(self) -> set[int]:
        """Jobs that will still be reported (lost ones will not)."""
        return set(self.pending) | set(self.inner.in_flight) | {r.job_id for r in self._results}

    def reporting_ranks(self, job_id: int, world_size: int) -> int:
        return self._ranks.pop(job_id, world_size)

    def take_failed_loads(self) -> set[int]:
        out, self._failed = self._failed, set()
        return out

    # -- execution -----------------------------------------------------------

    def _lose(self, job: _Job) -> None:
        """The copy never happens: the destination chunks hold poison, the keys are never loadable."""
        slots = torch.from_numpy(job.dst.block_ids.astype("int64", copy=False))
        if slots.numel():
            self.inner.pool.index_fill_(0, slots, POISON)
        self.lost[job.job_id] = job
        self.lost_keys |= job.keys

    def _execute(self, job: _Job) -> None:
        from vllm_adapter import vllm_api as V

        if job.store:
            if job.fate == "partial":
                # Some ranks lost it: what reaches the CPU tier is garbage; the rest report it.
                self._ranks[job.job_id] = job.ranks
                self._results.append(V.TransferResult(job_id=job.job_id, success=True))
                return
            self.inner.submit_store(job.job_id, job.src, job.dst)
            self.lost_keys -= job.keys  # stored again after a reset dropped the lost copy
            return
        self.stats.loads_executed += 1
        if job.fate == "fail":
            # No copy: the blocks keep their poison.  vLLM 0.34.0's worker takes the
            # failure itself (failed_jobs; failed_recving for the request).  0.33.0's
            # cannot: every rank reports the job done and the driver names the request
            # in failed_recving (take_failed_loads).
            if V.SUPPORTS_FAILED_TRANSFERS:
                self._results.append(V.TransferResult(job_id=job.job_id, success=False))
            else:
                self._results.append(V.TransferResult(job_id=job.job_id, success=True))
                self._failed.add(job.job_id)
            if job.req_id is not None:
                self.failed_load_reqs.add(job.req_id)
            return
        snapshot = self.runner.snapshot() if self.runner.check_foreign else None
        self.inner.submit_load(job.job_id, job.src, job.dst)
        self.runner.check_loaded(self, job, snapshot)


# ---------------------------------------------------------------------------
# Fault injection: the model runner and its checks
# ---------------------------------------------------------------------------


BYTE_CHECK_LIMIT = 64 << 20
"""KV memories up to this size get every read compared byte by byte (and every load's foreign
bytes checked); larger ones (the real-model fixtures) rely on the shadow for reads."""

_POISONED = ("poison",)
_CORRUPT = ("corrupt",)


class FaultRunner(SyntheticModelRunner):
    """:class:`conformance.kvdata.SyntheticModelRunner` with checks for lazy, faulty workers.

    Loads are checked byte by byte when the :class:`FaultyWorker` executes them
    (not in the step they are submitted).  Reads are checked against a
    *shadow*: ``block id -> (group, position, prefix hash)`` of what each block
    holds, updated by everything that writes KV bytes (this runner's forward
    pass, executed loads, poison) -- vLLM itself never writes them.  With
    ``check_read_bytes`` every read is also compared byte by byte, which keeps
    the shadow honest.
    """

    def __init__(self, kv_cache_config: Any, vllm_config: Any, stats: FaultStats, *,
                 check_foreign: bool | None = None, check_read_bytes: bool | None = None) -> None:
        super().__init__(kv_cache_config, vllm_config, check_loads=False)
        self.fault_stats = stats
        small = sum(s.nbytes() for s in self._storages) <= BYTE_CHECK_LIMIT
        self.check_foreign = small if check_foreign is None else check_foreign
        self.check_read_bytes = small if check_read_bytes is None else check_read_bytes
        self.worker: FaultyWorker | None = None
        self.shadow: dict[int, tuple[Any, ...]] = {}

    # -- bytes ---------------------------------------------------------------

    def _write(self, layer: Any, block_ids: list[int], positions: list[int],
               hashes: list[int]) -> None:
        super()._write(layer, block_ids, positions, hashes)
        for b, i, h in zip(block_ids, positions, hashes, strict=True):
            self.shadow[b] = (layer.group_id, i, h)

    def poison_gpu(self, gpu_spec: Any) -> None:
        for gid, block_ids, _ in self._job_blocks(gpu_spec):
            idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
            for layer in self.group_layers.get(gid, ()):
                layer.pages.index_fill_(0, idx, POISON)
            for b in block_ids:
                self.shadow[b] = _POISONED

    def snapshot(self) -> list[torch.Tensor]:
        return [_flat_bytes(s, self.device).clone() for s in self._storages]

    def _expected(self, layer: Any, positions: list[int], hashes: Sequence[int]) -> torch.Tensor:
        tpb = layer.tokens_per_block
        return layer.rows(positions, [hashes[(i + 1) * tpb] for i in positions])

    def check_loaded(self, worker: FaultyWorker, job: _Job, snapshot: list[torch.Tensor] | None) -> None:
        """The blocks ``job`` loaded hold the expected bytes of its request; nothing else moved."""
        st_ = self.fault_stats
        hashes = prefix_hashes(job.tokens)
        storage_index = {s.data_ptr(): k for k, s in enumerate(self._storages)}
        for gid, block_ids, positions in self._job_blocks(job.dst):
            st_.loaded_blocks_checked += len(block_ids)
            layers = self.group_layers[gid]
            idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
            if snapshot is not None:
                self._forgive(worker.inner, gid, idx, snapshot, storage_index)
            tpb = layers[0].tokens_per_block
            if (positions[-1] + 1) * tpb > len(job.tokens):
                st_.corrupted_loads += len(block_ids)
                st_.fail(f"load job {job.job_id} ({job.req_id}) group {gid} loads position "
                         f"{positions[-1]}, past the request's {len(job.tokens)} tokens")
                for b in block_ids:
                    self.shadow[b] = _CORRUPT
                continue
            bad = torch.zeros(len(block_ids), dtype=torch.bool, device=self.device)
            for layer in layers:
                wrong = (layer.data.index_select(0, idx)
                         != self._expected(layer, positions, hashes)).any(dim=1)
                bad |= wrong
            flags = bad.tolist()
            for b, i, wrong in zip(block_ids, positions, flags, strict=True):
                self.shadow[b] = _CORRUPT if wrong else (gid, i, hashes[(i + 1) * tpb])
            if any(flags):
                k = flags.index(True)
                st_.fail(f"load job {job.job_id} ({job.req_id}) group {gid}: block {block_ids[k]} "
                         f"at position {positions[k]} holds wrong bytes")
            st_.corrupted_loads += sum(flags)
        if snapshot is None:
            return
        for before, storage in zip(snapshot, self._storages, strict=True):
            after = _flat_bytes(storage, self.device)
            if not torch.equal(before, after):
                n = int((before != after).sum())
                st_.foreign_bytes_changed += n
                st_.fail(f"load job {job.job_id}: {n} bytes outside its blocks changed")

    # -- driver hooks --------------------------------------------------------

    def before_start_load_kv(self, session: Any, so: Any) -> None:
        self.stats.steps += 1
        self._snapshots = None
        cs = session.connector_scheduler
        for req_id in so.preempted_req_ids or ():
            status = cs._req_status.get(req_id)
            if status is not None and status.transfer_jobs:
                self.fault_stats.count("preemptions_in_flight")

    def execute_model(self, session: Any, so: Any) -> None:
        # Writes first: vLLM caches a block when it is *scheduled*, so another request
        # of the same batch may attend to it in the very forward pass that fills it.
        super().execute_model(session, so)
        self.check_reads(session, so)
        live = session.scheduler.requests
        for req_id in [r for r in self._hashes if r not in live]:
            del self._hashes[req_id]

    def check_reads(self, session: Any, so: Any) -> None:
        """Every complete, non-null block a scheduled request attends to holds its expected bytes.

        Called after the step's writes: the blocks of positions before the
        request's first token of this step (loaded, prefix-cache hits, computed
        earlier or by another request of this batch).
        """
        st_ = self.fault_stats
        failed = self.worker.failed_load_reqs if self.worker is not None else set()
        for req_id, n in so.num_scheduled_tokens.items():
            req = session.scheduler.requests[req_id]
            before = int(req.num_computed_tokens) - int(n)
            if before <= 0:
                continue
            tokens = req.all_token_ids
            hashes = self.hashes(req_id, tokens[:before])
            table = session.block_ids(req_id)
            for gid, layers in self.group_layers.items():
                if layers[0].is_mamba:
                    continue
                tpb = layers[0].tokens_per_block
                chosen = [(b, i) for i, b in enumerate(table[gid][: before // tpb]) if b != 0]
                if not chosen:
                    continue
                st_.blocks_read_checked += len(chosen)
                if req_id in failed:
                    st_.recomputed_blocks_checked += len(chosen)
                wrong = [
                    (b, i) for b, i in chosen
                    if self.shadow.get(b) != (gid, i, hashes[(i + 1) * tpb])
                ]
                if self.check_read_bytes:
                    idx = torch.tensor([b for b, _ in chosen], dtype=torch.int64, device=self.device)
                    positions = [i for _, i in chosen]
                    bad = torch.zeros(len(chosen), dtype=torch.bool, device=self.device)
                    for layer in layers:
                        bad |= (layer.data.index_select(0, idx)
                                != self._expected(layer, positions, hashes)).any(dim=1)
                    by_bytes = {chosen[k] for k, x in enumerate(bad.tolist()) if x}
                    if by_bytes != set(wrong):
                        st_.fail(f"step {session.step_no}: the shadow ({sorted(wrong)}) and the "
                                 f"bytes ({sorted(by_bytes)}) disagree for {req_id} group {gid}")
                    wrong = sorted(set(wrong) | by_bytes)
                if wrong:
                    b, i = wrong[0]
                    st_.fail(f"step {session.step_no}: {req_id} reads group {gid} block {b} at "
                             f"position {i} holding {self.shadow.get(b)!r}")
                st_.corrupted_reads += len(wrong)


# ---------------------------------------------------------------------------
# Leak checks
# ---------------------------------------------------------------------------


def _manager_chunks(mgr: Any) -> dict[bytes, Any] | None:
    return getattr(getattr(mgr, "_policy", None), "chunks", None)


def leak_report(session: Any, worker: FaultyWorker, baseline_free: int) -> list[str]:
    """What is still held after the trace drained, beyond what lost stores account for.

    Lost (and rank-partial) store jobs legitimately keep their vLLM job, their
    write-pending chunks, their request's connector state and their deferred
    GPU-block fences; everything else must be back at baseline.
    """
    leaks: list[str] = []
    sched = session.scheduler
    kvm = sched.kv_cache_manager
    pool = kvm.block_pool
    if pool.get_num_free_blocks() != baseline_free:
        leaks.append(f"GPU block pool: {pool.get_num_free_blocks()} free, baseline {baseline_free}")
    held = [b.block_id for b in pool.blocks if not b.is_null and b.ref_cnt != 0]
    if held:
        leaks.append(f"GPU blocks with ref counts: {held[:8]}")
    if sched.requests:
        leaks.append(f"scheduler still holds requests {sorted(sched.requests)[:5]}")
    for i, mgr in enumerate(kvm.coordinator.single_type_managers):
        left = [r for r, blocks in mgr.req_to_blocks.items() if blocks]
        if left:
            leaks.append(f"KV group manager {i} still maps {left[:5]} to blocks")
    for name in ("finished_recving_kv_req_ids", "failed_recving_kv_req_ids"):
        if getattr(sched, name, None):
            leaks.append(f"scheduler.{name} = {sorted(getattr(sched, name))[:5]}")

    cs = session.connector_scheduler
    lost = set(worker.lost)
    lost_reqs = {worker.lost[j].req_id for j in lost}
    if set(cs._jobs) - lost:
        leaks.append(f"connector jobs pending: {sorted(set(cs._jobs) - lost)[:8]}")
    if set(cs._req_status) - lost_reqs:
        leaks.append(f"connector request state left: {sorted(set(cs._req_status) - lost_reqs)[:5]}")
    fenced = {j for jobs in cs._block_id_to_pending_jobs.values() for j in jobs} - lost
    if fenced:
        leaks.append(f"GPU-block fences on jobs {sorted(fenced)[:8]}")
    if set(cs._reset_fence) - lost:
        leaks.append(f"reset fence waits on {sorted(set(cs._reset_fence) - lost)[:8]}")
    if cs._chunks_being_loaded:
        leaks.append(f"{len(cs._chunks_being_loaded)} chunks still marked being loaded")
    for name in ("_current_batch_load_jobs", "_current_batch_sync_loads",
                 "_current_batch_allocated_block_ids"):
        if getattr(cs, name):
            leaks.append(f"connector {name} not empty")

    cw = session.worker_connector.connector_worker
    if cw._load_jobs or cw._unsubmitted_store_jobs:
        leaks.append(f"worker connector: loads {sorted(cw._load_jobs)}, unsubmitted stores "
                     f"{[j for j, *_ in cw._unsubmitted_store_jobs]}")
    if worker.pending or worker.inner.in_flight:
        leaks.append(f"worker jobs never finished: {sorted(worker.pending)[:8]}")

    mgr = cs.manager
    chunks = _manager_chunks(mgr)
    if chunks is not None:
        pinned = [k for k, c in chunks.items() if c.ref_cnt > 0]
        pending = [k for k, c in chunks.items() if c.ref_cnt < 0]
        if pinned:
            leaks.append(f"{len(pinned)} CPU chunks still pinned by loads (ref_cnt > 0)")
        stray = [k for k in pending if k not in worker.lost_keys]
        if stray:
            leaks.append(f"{len(stray)} CPU chunks write-pending without a lost store")
        ready = len(chunks) - len(pending)
        if mgr._num_write_pending_chunks != len(pending):
            leaks.append(f"manager counts {mgr._num_write_pending_chunks} write-pending chunks, "
                         f"holds {len(pending)}")
        if mgr._num_evictable_cache_chunks != ready:
            leaks.append(f"manager counts {mgr._num_evictable_cache_chunks} evictable chunks, "
                         f"{ready} are ready with no load")
        if mgr._num_allocated_chunks - len(mgr._free_list) != len(chunks):
            leaks.append(f"manager: {mgr._num_allocated_chunks} allocated - "
                         f"{len(mgr._free_list)} free != {len(chunks)} held")
        evictable = getattr(mgr._policy, "_evictable", None)
        if evictable is not None and set(evictable) != {k for k, c in chunks.items() if c.ref_cnt == 0}:
            leaks.append("LRU policy's evictable set differs from the ref counts")
    return leaks


def final_reset_report(session: Any, worker: FaultyWorker, baseline_free: int) -> list[str]:
    """A GPU + connector reset after the drain must leave the CPU tier and the pool empty."""
    leaks: list[str] = []
    if not session.reset_prefix_cache(reset_connector=True):
        leaks.append("the final prefix-cache reset failed (GPU blocks still in use)")
    session.step()  # delivers the reset's flush to the worker
    cs = session.connector_scheduler
    mgr = cs.manager
    chunks = _manager_chunks(mgr)
    if chunks:
        leaks.append(f"{len(chunks)} CPU chunks survive a connector reset")
    if mgr._num_allocated_chunks or mgr._free_list or mgr._num_write_pending_chunks:
        leaks.append("the manager's pool counters survive a connector reset")
    if cs._jobs or cs._req_status:
        leaks.append(f"connector state survives a reset: jobs {sorted(cs._jobs)[:5]}, "
                     f"requests {sorted(cs._req_status)[:5]}")
    if set(cs._reset_fence) - set(worker.lost):
        leaks.append(f"reset fence waits on reported jobs {sorted(set(cs._reset_fence) - set(worker.lost))}")
    pool = session.scheduler.kv_cache_manager.block_pool
    if pool.get_num_free_blocks() != baseline_free:
        leaks.append(f"GPU block pool after reset: {pool.get_num_free_blocks()} free, "
                     f"baseline {baseline_free}")
    return leaks


# ---------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------

_SYNTHETIC = {
    "synthetic-full": "full_attention_kv_cache_config",
    "synthetic-full-swa": "full_swa_kv_cache_config",
    "synthetic-full-mamba-align": "full_mamba_align_kv_cache_config",
    "synthetic-eagle": "swa_eagle_kv_cache_config",
}


@dataclass(frozen=True)
class FaultScenario:
    """One fault-injection run: a geometry, pools, a workload shape and the worker's dice."""

    name: str
    fixture: str
    plan: FaultPlan
    blocks_per_chunk: int = 2
    num_gpu_blocks: int = 120
    num_cpu_chunks: int = 48
    num_requests: int = 24
    num_docs: int = 3
    doc_len: int = 320
    spacing: int = 2
    budget: int = 128
    p_abort: float = 0.0
    reset_every: int = 0
    p_connector_reset: float = 0.0
    world_size: int | None = None
    """Override the engine's world size (synthetic geometries); None keeps the fixture's."""
    planned: bool = False
    max_steps: int = 4000
    block_tokens_base: int | None = None
    """The fixture's scheduler block size (tokens) ``doc_len`` and ``budget`` were sized
    for; when the release plans other blocks (vLLM 0.34.0: gemma-4 at 64 tokens, 0.33.0:
    16) both scale with them, so the workload spans the same blocks.  None: absolute."""

    def scaled(self) -> FaultScenario:
        """This scenario with ``doc_len`` and ``budget`` scaled to the fixture's blocks."""
        if self.block_tokens_base is None:
            return self
        from vllm_adapter import fixtures as fx

        block = int(fx.load_fixture(self.fixture)["resolved"]["scheduler_block_size"])
        scale = max(1, block // self.block_tokens_base)
        return replace(
            self, doc_len=self.doc_len * scale, budget=self.budget * scale, block_tokens_base=None
        )

    @property
    def knob(self) -> str:
        return f"blocks_per_chunk={self.blocks_per_chunk}, {self.name}"

    def __str__(self) -> str:
        return f"{self.fixture}-{self.name}"


def replace_seed(sc: FaultScenario, seed: int) -> FaultScenario:
    """The same scenario under other dice."""
    import dataclasses

    return dataclasses.replace(sc, plan=dataclasses.replace(sc.plan, seed=seed))


def scenario_driver(sc: FaultScenario) -> Any:
    """The scenario's :class:`~conformance.vllm_driver.VllmDriver` (reference spec, recompute policy)."""
    import copy

    from conformance import vllm_driver as D
    from conformance.kvdata import REFERENCE_SPEC, fixture_driver, with_planned_tensors

    extra = {BLOCKS_PER_CHUNK: sc.blocks_per_chunk}
    if sc.fixture in _SYNTHETIC:
        kvc = getattr(D, _SYNTHETIC[sc.fixture])(num_blocks=sc.num_gpu_blocks)
        driver = D.VllmDriver.from_kv_cache_config(
            kvc,
            extra_config={**REFERENCE_SPEC, **extra},
            prefix_cache_retention_interval=0,
            num_gpu_blocks=sc.num_gpu_blocks,
            num_cpu_chunks=sc.num_cpu_chunks,
            kv_load_failure_policy="recompute",
        )
        if sc.planned:
            driver = D.VllmDriver(with_planned_tensors(driver.kv_cache_config, driver.vllm_config),
                                  driver.vllm_config)
    else:
        driver = fixture_driver(sc.fixture, extra, num_gpu_blocks=sc.num_gpu_blocks,
                                num_cpu_chunks=sc.num_cpu_chunks)
        driver.vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
    if sc.world_size is not None:
        pc = copy.copy(driver.vllm_config.parallel_config)
        pc.world_size = sc.world_size
        driver.vllm_config.parallel_config = pc
    return driver


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, 30000) for _ in range(n))


@dataclass
class FaultSession:
    """A session wired for faults: the driver session, runner, worker, stats and baseline."""

    session: Any
    runner: FaultRunner
    worker: FaultyWorker
    stats: FaultStats
    baseline_free: int


def fault_session(driver: Any, plan: FaultPlan, *, budget: int | None = None,
                  stats: FaultStats | None = None, check_foreign: bool | None = None) -> FaultSession:
    stats = stats or FaultStats()
    runner = FaultRunner(driver.worker_kv_cache_config, driver.vllm_config, stats,
                         check_foreign=check_foreign)
    box: dict[str, FaultyWorker] = {}

    def wrap(session: Any, inner: Any) -> FaultyWorker:
        box["w"] = FaultyWorker(session, inner, plan, runner, stats)
        return box["w"]

    s = driver.session(model_runner=runner, max_num_batched_tokens=budget, record=False,
                       worker_wrapper=wrap)
    worker = box["w"]
    runner.worker = worker
    mgr = s.connector_scheduler.manager
    orig = mgr.prepare_store

    def prepare_store(keys: Any, req_context: Any) -> Any:
        out = orig(keys, req_context)
        if out is None:
            stats.count("cpu_full")
        elif out.evicted_keys and any(not j.store for j in worker.pending.values()):
            stats.count("evictions_with_loads_pending")
        return out

    mgr.prepare_store = prepare_store
    baseline = s.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    return FaultSession(s, runner, worker, stats, baseline)


STALL_STEPS = 24
"""Steps without progress (and no transfer pending) after which :func:`play` calls it a stall."""


def _progress(s: Any) -> tuple[int, int]:
    reqs = s.scheduler.requests.values()
    return len(reqs), sum(int(r.num_computed_tokens) + r.num_output_tokens for r in reqs)


def _has_jobs_in_flight(fs: FaultSession, req_id: str) -> bool:
    status = fs.session.connector_scheduler._req_status.get(req_id)
    return bool(status is not None and status.transfer_jobs)


def _loads_waiting(fs: FaultSession) -> bool:
    return any(not j.store for j in fs.worker.pending.values()) or bool(
        fs.session.scheduler.kv_holding_waiting
    )


def _reset(fs: FaultSession, *, connector: bool, running: bool) -> None:
    """One prefix-cache reset, steering clear of vLLM 0.33.0's known bugs.

    A connector reset while requests keep running (``reset_running_requests=False``)
    re-offloads them from chunk 0 with stale sliding-window block ids
    (deviation ``connector-reset-stale-swa-blocks``): on geometries with a
    sliding-window group it is made a full reset, or skipped while loads wait
    (vLLM refuses to preempt those).  Callers never reset twice between two
    steps (deviation ``connector-reset-twice``).
    """
    s = fs.session
    if running and _loads_waiting(fs):
        running = False  # vLLM raises: requests waiting for remote KV cannot be preempted
    if connector and not running and s.connector_scheduler._sliding_window_groups:
        if _loads_waiting(fs):
            connector = False
        else:
            running = True
    in_flight = bool(fs.worker.in_flight)
    s.reset_prefix_cache(reset_connector=connector, reset_running_requests=running)
    if connector:
        fs.stats.count("connector_resets")
    if in_flight and (connector or running):
        fs.stats.count("resets_in_flight")


def play(fs: FaultSession, requests: Sequence[Any], *, rng: random.Random, p_abort: float = 0.0,
         reset_every: int = 0, p_connector_reset: float = 0.0, max_steps: int = 4000,
         on_step: Any = None) -> int:
    """Run ``requests`` (``RequestSpec`` s with arrival steps) with random aborts and resets; steps taken."""
    s = fs.session
    arrivals: dict[int, list[Any]] = {}
    for r in requests:
        arrivals.setdefault(r.arrival_step, []).append(r)
    aborts: dict[int, list[str]] = {}
    for r in requests:
        if rng.random() < p_abort:
            aborts.setdefault(r.arrival_step + rng.randint(0, 8), []).append(r.req_id)
    last_event = max([*arrivals, *aborts, 0])
    start = s.step_no
    idle_since, last_progress = 0, None
    while True:
        n = s.step_no - start
        reset_done = False
        progress = _progress(s)
        if progress != last_progress or fs.worker.pending:
            idle_since, last_progress = n, progress
        elif n - idle_since >= STALL_STEPS and s.scheduler.has_unfinished_requests():
            if not fs.worker.lost:
                raise RuntimeError(f"no progress for {STALL_STEPS} steps at step {n} with "
                                   f"nothing lost: {sorted(s.scheduler.requests)[:8]}")
            # Requests whose prefix (or own job) waits on a lost store wait forever
            # (the key stays HIT_PENDING, the lookup is deferred): a connector reset
            # is the only way out vLLM 0.33.0 has.
            _reset(fs, connector=True, running=True)
            fs.stats.lost_store_stall_resets += 1
            idle_since, reset_done = n, True
        for r in arrivals.get(n, ()):
            s.add_request(r)
        for req_id in aborts.get(n, ()):
            req = s.scheduler.requests.get(req_id)
            if req is None or req.is_finished():
                continue
            if _has_jobs_in_flight(fs, req_id):
                fs.stats.count("aborts_in_flight")
            s.abort(req_id)
        if (reset_every and n % reset_every == reset_every - 1 and n <= last_event
                and not reset_done):
            _reset(fs, connector=rng.random() < p_connector_reset, running=rng.random() < 0.5)
        if n >= last_event and not s.has_work():
            break
        if n >= max_steps:
            raise RuntimeError(f"still busy after {max_steps} steps")
        s.step()
        if on_step is not None:
            on_step(n)
    return s.step_no - start


def scenario_requests(sc: FaultScenario, rng: random.Random) -> list[Any]:
    from conformance.trace import RequestSpec

    docs = [_tokens(rng, sc.doc_len) for _ in range(sc.num_docs)]
    out = []
    for i in range(sc.num_requests):
        doc = rng.choice(docs)
        cut = rng.randint(sc.doc_len // 4, sc.doc_len)
        prompt = doc[:cut] + _tokens(rng, rng.randint(1, max(1, sc.doc_len // 4)))
        out.append(RequestSpec(f"r{i}", prompt, max_tokens=rng.randint(2, 4),
                               arrival_step=i * sc.spacing + rng.randint(0, 1)))
    return out


def drain_and_check(fs: FaultSession) -> None:
    """Leak checks after the drain and after a final connector reset; counted into ``fs.stats``."""
    st_ = fs.stats
    leaks = leak_report(fs.session, fs.worker, fs.baseline_free)
    cs = fs.session.connector_scheduler
    st_.lost_store_jobs_retained += len(set(fs.worker.lost) & set(cs._jobs))
    chunks = _manager_chunks(cs.manager) or {}
    for key in fs.worker.lost_keys:
        st_.lost_store_keys_checked += 1
        chunk = chunks.get(key)
        if chunk is not None and chunk.is_ready:
            st_.failed_store_loaded += 1
            st_.fail(f"key {key.hex()[:16]} of a lost store is ready (loadable)")
    leaks += final_reset_report(fs.session, fs.worker, fs.baseline_free)
    st_.leaks += len(leaks)
    for text in leaks:
        st_.fail(f"leak: {text}")


def run_fault_scenario(sc: FaultScenario, driver: Any | None = None) -> FaultStats:
    """Play the scenario's random workload through the faulty data path; the stats it counted."""
    driver = driver or scenario_driver(sc)
    sc = sc.scaled()
    fs = fault_session(driver, sc.plan, budget=sc.budget)
    rng = random.Random(sc.plan.seed + 1)
    play(fs, scenario_requests(sc, rng), rng=rng, p_abort=sc.p_abort, reset_every=sc.reset_every,
         p_connector_reset=sc.p_connector_reset, max_steps=sc.max_steps)
    drain_and_check(fs)
    return fs.stats


# ---------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------


def _rss_kib() -> int:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:  # pragma: no cover - not Linux
        pass
    return 0


@dataclass
class LoadReport:
    stats: FaultStats
    requests: int
    steps: int
    seconds: float
    rss_growth_kib: int
    """RSS at the end minus RSS a quarter into the run (after warm-up)."""
    peak_bookkeeping: dict[str, int]
    final_bookkeeping: dict[str, int]


def _bookkeeping(fs: FaultSession) -> dict[str, int]:
    s = fs.session
    cs = s.connector_scheduler
    policy = getattr(cs.manager, "_policy", None)
    return {
        "scheduler_requests": len(s.scheduler.requests),
        "connector_req_status": len(cs._req_status),
        "connector_jobs": len(cs._jobs),
        "connector_block_fences": len(cs._block_id_to_pending_jobs),
        "cpu_chunks_held": len(getattr(policy, "chunks", ())),
        "lru_ranks": len(getattr(policy, "_ranks", ())),
        "lru_heap": len(getattr(policy, "_heap", ())),
        "worker_pending": len(fs.worker.pending),
        "runner_hash_cache": len(fs.runner._hashes),
    }


def load_requests(num_requests: int, prompt_len: int, rng: random.Random, *, num_docs: int = 8,
                  per_step: int = 2) -> list[Any]:
    """Heavy prefix sharing: every prompt is a prefix of one of ``num_docs`` documents plus a short tail."""
    from conformance.trace import RequestSpec

    docs = [_tokens(rng, prompt_len) for _ in range(num_docs)]
    out = []
    for i in range(num_requests):
        doc = docs[min(int(rng.expovariate(0.5)), num_docs - 1)]
        cut = rng.randint(prompt_len // 2, prompt_len)
        out.append(RequestSpec(f"q{i}", doc[:cut] + _tokens(rng, rng.randint(1, 8)),
                               max_tokens=rng.randint(1, 3), arrival_step=i // per_step))
    return out


def run_load_trace(driver: Any, *, num_requests: int, prompt_len: int, plan: FaultPlan,
                   budget: int = 256, reset_every: int = 40) -> LoadReport:
    """``num_requests`` requests at capacity pressure through the data path, measured."""
    fs = fault_session(driver, plan, budget=budget, check_foreign=False)
    rng = random.Random(plan.seed + 7)
    requests = load_requests(num_requests, prompt_len, rng)
    peak: dict[str, int] = {}
    marks: dict[str, int] = {}
    quarter = requests[-1].arrival_step // 4

    def on_step(n: int) -> None:
        if n % 16 == 0:
            for k, v in _bookkeeping(fs).items():
                peak[k] = max(peak.get(k, 0), v)
            fs.session.dispatched.clear()  # the driver's own log of every job: not the system's
        if n == quarter:
            marks["rss"] = _rss_kib()

    start = time.perf_counter()
    steps = play(fs, requests, rng=rng, reset_every=reset_every, max_steps=100 * num_requests,
                 on_step=on_step)
    seconds = time.perf_counter() - start
    growth = _rss_kib() - marks.get("rss", _rss_kib())
    final = _bookkeeping(fs)
    drain_and_check(fs)
    return LoadReport(fs.stats, len(requests), steps, seconds, growth, peak, final)


# ---------------------------------------------------------------------------
# Mutations: broken workers the checks must catch
# ---------------------------------------------------------------------------


def install_mutation(monkeypatch: Any, mutation: str) -> None:
    """Break :class:`FaultyWorker` the way a buggy transfer engine would (meta tests).

    ``report_lost_store``: a failed store (poisoned chunks) is reported as done,
    so its keys become loadable.  ``skip_flush_wait``: ``wait`` returns without
    making the named copies, so delayed stores copy blocks vLLM already reused.
    ``report_load_early``: a load is reported when submitted and copied only
    when due, so its request runs before its blocks arrive.
    """
    from vllm_adapter import vllm_api as V

    if mutation == "report_lost_store":
        real_lose = FaultyWorker._lose

        def lose(self: FaultyWorker, job: _Job) -> None:
            real_lose(self, job)
            if job.fate == "lost":
                del self.lost[job.job_id]
                self.lost_keys -= job.keys
                job.fate = "poisoned"
                self.pending[job.job_id] = job

        real_execute = FaultyWorker._execute

        def execute(self: FaultyWorker, job: _Job) -> None:
            if job.store and job.fate == "poisoned":
                self._results.append(V.TransferResult(job_id=job.job_id, success=True))
                return
            real_execute(self, job)

        monkeypatch.setattr(FaultyWorker, "_lose", lose)
        monkeypatch.setattr(FaultyWorker, "_execute", execute)
    elif mutation == "skip_flush_wait":
        monkeypatch.setattr(FaultyWorker, "wait", lambda self, job_ids: None)
    elif mutation == "report_load_early":
        real_submit = FaultyWorker.submit_load
        real_execute = FaultyWorker._execute

        def submit_load(self: FaultyWorker, job_id: int, src: Any, dst: Any,
                        expedited: bool = False) -> bool:
            ok = real_submit(self, job_id, src, dst, expedited)
            job = self.pending.get(job_id)
            if job is not None and job.fate == "ok":
                job.fate = "early"
                job.due += 2
                self._results.append(V.TransferResult(job_id=job_id, success=True))
            return ok

        def execute(self: FaultyWorker, job: _Job) -> None:
            if not job.store and job.fate == "early":
                self.inner.submit_load(job.job_id, job.src, job.dst)
                self.inner._finished = [r for r in self.inner._finished if r.job_id != job.job_id]
                return
            real_execute(self, job)

        monkeypatch.setattr(FaultyWorker, "submit_load", submit_load)
        monkeypatch.setattr(FaultyWorker, "_execute", execute)
    else:
        raise ValueError(f"unknown mutation {mutation!r}")
