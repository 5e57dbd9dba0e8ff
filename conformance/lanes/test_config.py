"""Lane 1 (config): knob resolution, vLLM's real config path against the reference.

For every fixture and knob: where vLLM's ``build_offloading_config`` and
``SchedulerOffloadConfig`` accept the knob, the reference resolves it to the
same values field by field; where vLLM raises a ValueError, so does the
reference.  For knobs only kvchunk accepts, the kvchunk connector's scheduler
runs exactly what the reference resolved.  Known disagreements are strict
xfails from ``conformance/deviations/vllm-<release>.toml`` (the installed release).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from conformance import cases, deviations
from reference.knobs import Chunking, resolve_extra_config
from vllm_adapter.names import KVCHUNK_CONNECTOR, KVCHUNK_CONNECTOR_MODULE, STOCK_CONNECTOR

pytestmark = [pytest.mark.config]

V = pytest.importorskip("vllm_adapter.vllm_api")
from vllm_adapter import fixtures as F  # noqa: E402
from vllm_adapter.geometry import (  # noqa: E402
    VllmRejected,
    geometry_from_vllm,
    retention_interval_from,
    vllm_blocks_per_chunk,
)

ConfigCase = cases.Case
CASES = cases.config_cases()
"""Every fixture vLLM plans x every knob of :data:`conformance.cases.CONFIG_KNOBS`."""


@cache
def _fixture(name: str) -> dict[str, Any]:
    return F.load_fixture(name)


def _reference(case: ConfigCase) -> tuple[Chunking | None, str]:
    fx = _fixture(case.fixture)
    vllm_config = F.make_vllm_config(fx, case.knob.extra)
    kvc = F.rebuild_kv_cache_config(fx, "scheduler")
    geometry = geometry_from_vllm(kvc, vllm_config)
    try:
        return resolve_extra_config(geometry, case.knob.extra, retention_interval_from(vllm_config)), ""
    except ValueError as err:
        return None, str(err)


def _scheduler_config(case: ConfigCase, connector: str, module: str | None) -> Any:
    sched = F.build_scheduler(_fixture(case.fixture), case.knob.extra, connector=connector,
                              connector_module_path=module)
    return sched.connector.connector_scheduler.config


def _assert_same(chunking: Chunking, config: Any) -> None:
    """Field by field: SchedulerOffloadConfig against the reference Chunking."""
    assert config.tokens_per_hash == chunking.tokens_per_hash
    assert config.blocks_per_chunk == chunking.uniform_blocks_per_chunk
    assert config.alignment_tokens == chunking.alignment_tokens
    got = [(g.group_idx, g.tokens_per_block, g.tokens_per_chunk, g.hashes_per_chunk,
            g.sliding_window_size_in_chunks, g.is_eagle_group) for g in config.kv_group_configs]
    want = [(gc.group.index, gc.group.tokens_per_block, gc.tokens_per_chunk, gc.hashes_per_chunk,
             gc.window_in_chunks, gc.group.is_eagle) for gc in chunking.groups]
    assert got == want


@pytest.mark.parametrize("case", CASES, ids=str)
def test_resolution_agrees(case: ConfigCase, backend: Any, request: pytest.FixtureRequest) -> None:
    if backend.name != "vllm" and backend.planner is not None:
        pytest.skip("the config lane compares vLLM's own config path; backends plug in at the plan lane")
    dev = deviations.find("vllm", "config", str(case))
    if dev is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=dev.xfail_reason()))
    fx = _fixture(case.fixture)
    kvc = F.rebuild_kv_cache_config(fx, "scheduler")
    chunking, error = _reference(case)
    try:
        vllm = vllm_blocks_per_chunk(kvc, F.make_vllm_config(fx, case.knob.extra))
    except VllmRejected as rejected:
        # vLLM said no: the reference must say no too, with a ValueError naming the knob.
        assert chunking is None, f"vLLM rejects ({rejected}), the reference accepts"
        knob = case.knob.items[0][0]
        assert f"'{knob}'" in error, error
        return
    assert chunking is not None, f"vLLM accepts, the reference rejects: {error}"
    assert vllm.blocks_per_chunk == chunking.uniform_blocks_per_chunk
    assert vllm.tokens_per_hash == chunking.tokens_per_hash
    assert vllm.sliding_window_size_in_chunks == {gc.group.index: gc.window_in_chunks for gc in chunking.groups}
    _assert_same(chunking, _scheduler_config(case, STOCK_CONNECTOR, None))


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.knob.extra.get("block_size") == 512], ids=str
)
def test_kvchunk_connector_runs_what_the_reference_resolved(case: ConfigCase) -> None:
    chunking, error = _reference(case)
    if chunking is None:
        with pytest.raises(ValueError):
            _scheduler_config(case, KVCHUNK_CONNECTOR, KVCHUNK_CONNECTOR_MODULE)
        return
    _assert_same(chunking, _scheduler_config(case, KVCHUNK_CONNECTOR, KVCHUNK_CONNECTOR_MODULE))


def deviation_holds(case: ConfigCase) -> None:
    """A config deviation fails the way it says: vLLM rejects a knob the reference resolves.

    The strict xfail in :func:`test_resolution_agrees` passes on *any* failure;
    this pins the failure, so a vLLM that starts accepting the knob (and
    resolves it some other way than the reference) cannot hide behind it.
    """
    chunking, error = _reference(case)
    assert chunking is not None, f"the reference rejects {case}: {error}"
    fx = _fixture(case.fixture)
    with pytest.raises(VllmRejected):
        vllm_blocks_per_chunk(F.rebuild_kv_cache_config(fx, "scheduler"),
                              F.make_vllm_config(fx, case.knob.extra))


@pytest.mark.parametrize(
    "case", [c for c in CASES if deviations.find("vllm", "config", str(c)) is not None], ids=str
)
def test_config_deviation_is_a_vllm_rejection(case: ConfigCase) -> None:
    deviation_holds(case)


CLEAN_REJECTIONS = [c for c in CASES if str(c.knob) in ("blocks_per_chunk=0", "block_size=100")
                    and c.fixture == "synthetic-full-mamba-align" or str(c.knob) == "blocks_per_chunk=0"]
"""Knobs vLLM refuses by validation: a zero chunk, a block_size off the (uniform) block size."""


def vllm_rejects_cleanly(case: ConfigCase) -> None:
    """vLLM refuses the knob with a ValueError naming it (not a crash further down)."""
    fx = _fixture(case.fixture)
    knob = case.knob.items[0][0]
    with pytest.raises(VllmRejected) as rejected:
        vllm_blocks_per_chunk(F.rebuild_kv_cache_config(fx, "scheduler"),
                              F.make_vllm_config(fx, case.knob.extra))
    assert rejected.value.kind == "ValueError" and f"'{knob}'" in rejected.value.message, (
        f"{case}: vLLM rejected with {rejected.value}")


@pytest.mark.parametrize("case", CLEAN_REJECTIONS, ids=str)
def test_vllm_rejects_the_knob_cleanly(case: ConfigCase) -> None:
    vllm_rejects_cleanly(case)
