"""Config lane checks: vLLM's ``build_offloading_config`` / ``SchedulerOffloadConfig``
against the reference's knob resolution (needs vLLM).

Each check takes one :class:`conformance.harness.cases.Case` (a fixture and a knob) and raises
:class:`~conformance.checks.CheckFailed` naming the case and what differed.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from conformance.checks import CheckFailed, expect, expect_equal
from conformance.harness.cases import Case
from reference.knobs import Chunking, resolve_extra_config
from vllm_adapter import fixtures as F
from vllm_adapter.geometry import (
    VllmRejected,
    geometry_from_vllm,
    retention_interval_from,
    vllm_blocks_per_chunk,
)
from vllm_adapter.names import STOCK_CONNECTOR

__all__ = ["deviation_holds", "kvchunk_connector_runs_the_reference", "reference_chunking",
           "resolution_agrees", "scheduler_config", "vllm_rejects_cleanly"]


@cache
def fixture(name: str) -> dict[str, Any]:
    return F.load_fixture(name)


def reference_chunking(case: Case) -> tuple[Chunking | None, str]:
    """The reference's resolution of the case's knob, or None and its ValueError's message."""
    fx = fixture(case.fixture)
    vllm_config = F.make_vllm_config(fx, case.knob.extra)
    geometry = geometry_from_vllm(F.rebuild_kv_cache_config(fx, "scheduler"), vllm_config)
    try:
        return resolve_extra_config(geometry, case.knob.extra,
                                    retention_interval_from(vllm_config)), ""
    except ValueError as err:
        return None, str(err)


def scheduler_config(case: Case, connector: str, module: str | None) -> Any:
    """The scheduler-side offload config the named connector builds for the case."""
    sched = F.build_scheduler(fixture(case.fixture), case.knob.extra, connector=connector,
                              connector_module_path=module)
    return sched.connector.connector_scheduler.config


def _vllm_resolution(case: Case) -> Any:
    fx = fixture(case.fixture)
    return vllm_blocks_per_chunk(F.rebuild_kv_cache_config(fx, "scheduler"),
                                 F.make_vllm_config(fx, case.knob.extra))


def same_as_reference(case: Case, chunking: Chunking, config: Any) -> None:
    """Field by field: a SchedulerOffloadConfig against the reference Chunking."""
    expect_equal(f"{case}: tokens_per_hash", config.tokens_per_hash, chunking.tokens_per_hash)
    expect_equal(f"{case}: blocks_per_chunk", config.blocks_per_chunk,
                 chunking.uniform_blocks_per_chunk)
    expect_equal(f"{case}: alignment_tokens", config.alignment_tokens, chunking.alignment_tokens)
    got = [(g.group_idx, g.tokens_per_block, g.tokens_per_chunk, g.hashes_per_chunk,
            g.sliding_window_size_in_chunks, g.is_eagle_group) for g in config.kv_group_configs]
    want = [(gc.group.index, gc.group.tokens_per_block, gc.tokens_per_chunk, gc.hashes_per_chunk,
             gc.window_in_chunks, gc.group.is_eagle) for gc in chunking.groups]
    expect_equal(f"{case}: per group (index, tokens_per_block, tokens_per_chunk, "
                 "hashes_per_chunk, window_in_chunks, is_eagle)", got, want)


def resolution_agrees(case: Case) -> None:
    """Where vLLM accepts the knob the reference resolves it to the same values, field by
    field; where vLLM rejects it the reference raises a ValueError naming the knob."""
    chunking, error = reference_chunking(case)
    try:
        vllm = _vllm_resolution(case)
    except VllmRejected as rejected:
        expect(chunking is None, f"{case}: vLLM rejects ({rejected}), the reference accepts")
        knob = case.knob.items[0][0]
        expect(f"'{knob}'" in error, f"{case}: the reference's error does not name '{knob}': "
                                     f"{error}")
        return
    if chunking is None:
        raise CheckFailed(f"{case}: vLLM accepts, the reference rejects: {error}")
    expect_equal(f"{case}: blocks_per_chunk", vllm.blocks_per_chunk,
                 chunking.uniform_blocks_per_chunk)
    expect_equal(f"{case}: tokens_per_hash", vllm.tokens_per_hash, chunking.tokens_per_hash)
    expect_equal(f"{case}: sliding_window_size_in_chunks", vllm.sliding_window_size_in_chunks,
                 {gc.group.index: gc.window_in_chunks for gc in chunking.groups})
    same_as_reference(case, chunking, scheduler_config(case, STOCK_CONNECTOR, None))


def kvchunk_connector_runs_the_reference(case: Case, connector: str, module: str) -> None:
    """kvchunk's connector runs exactly what the reference resolved, and refuses what the
    reference refuses (a ValueError)."""
    chunking, error = reference_chunking(case)
    if chunking is not None:
        same_as_reference(case, chunking, scheduler_config(case, connector, module))
        return
    try:
        scheduler_config(case, connector, module)
    except ValueError:
        return
    raise CheckFailed(f"{case}: the reference rejects ({error}), {connector} accepts")


def deviation_holds(case: Case) -> None:
    """A config deviation fails the way it says: vLLM rejects a knob the reference resolves.

    The strict xfail of :func:`resolution_agrees` passes on *any* failure; this pins
    the failure, so a vLLM that starts accepting the knob (and resolves it some other
    way than the reference) cannot hide behind it.
    """
    chunking, error = reference_chunking(case)
    expect(chunking is not None, f"the reference rejects {case}: {error}")
    try:
        vllm = _vllm_resolution(case)
    except VllmRejected:
        return
    raise CheckFailed(f"{case}: vLLM accepts the knob (blocks_per_chunk "
                      f"{vllm.blocks_per_chunk}); the deviation says it rejects it")


def vllm_rejects_cleanly(case: Case) -> None:
    """vLLM refuses the knob with a ValueError naming it (not a crash further down)."""
    knob = case.knob.items[0][0]
    try:
        vllm = _vllm_resolution(case)
    except VllmRejected as rejected:
        expect(rejected.kind == "ValueError" and f"'{knob}'" in rejected.message,
               f"{case}: vLLM rejected with {rejected}, not a ValueError naming '{knob}'")
        return
    raise CheckFailed(f"{case}: vLLM accepts the knob (blocks_per_chunk "
                      f"{vllm.blocks_per_chunk}); it must refuse it")
