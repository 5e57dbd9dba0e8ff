"""Lane 1 (config): knob resolution, vLLM's real config path against the reference.

For every fixture and knob: where vLLM's ``build_offloading_config`` and
``SchedulerOffloadConfig`` accept the knob, the reference resolves it to the
same values field by field; where vLLM raises a ValueError, so does the
reference.  For knobs only kvchunk accepts, the kvchunk connector's scheduler
runs exactly what the reference resolved.  Known disagreements are strict
xfails from ``conformance/deviations/vllm-<release>.toml`` (the installed release).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest

from conformance import deviations
from reference.knobs import Chunking, resolve_extra_config

pytestmark = [pytest.mark.config]

V = pytest.importorskip("vllm_adapter.vllm_api")
from vllm_adapter import fixtures as F  # noqa: E402
from vllm_adapter.geometry import (  # noqa: E402
    VllmRejected,
    geometry_from_vllm,
    retention_interval_from,
    vllm_blocks_per_chunk,
)

FIXTURES = ["gemma-4-31B-it-tp2", "deepseek-v4-flash-tp4", "synthetic-full-swa",
            "synthetic-eagle", "synthetic-full-mamba-align"]
KNOBS: list[dict[str, Any]] = [
    {"blocks_per_chunk": 1}, {"blocks_per_chunk": 2}, {"blocks_per_chunk": 4},
    {"blocks_per_chunk": 16}, {"block_size": 512}, {"block_size": 256}, {"block_size": 100},
    {"blocks_per_chunk": 0}, {"blocks_per_chunk": "8"},
]


@dataclass(frozen=True)
class ConfigCase:
    fixture: str
    knob_items: tuple[tuple[str, Any], ...]

    @property
    def knob(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.knob_items)

    def __str__(self) -> str:
        return f"{self.fixture} {self.knob}"


CASES = [ConfigCase(f, tuple(k.items())) for f in FIXTURES for k in KNOBS]


@cache
def _fixture(name: str) -> dict[str, Any]:
    return F.load_fixture(name)


def _reference(case: ConfigCase) -> tuple[Chunking | None, str]:
    fx = _fixture(case.fixture)
    vllm_config = F.make_vllm_config(fx, dict(case.knob_items))
    kvc = F.rebuild_kv_cache_config(fx, "scheduler")
    geometry = geometry_from_vllm(kvc, vllm_config)
    try:
        return resolve_extra_config(geometry, dict(case.knob_items), retention_interval_from(vllm_config)), ""
    except ValueError as err:
        return None, str(err)


def _scheduler_config(case: ConfigCase, connector: str, module: str | None) -> Any:
    sched = F.build_scheduler(_fixture(case.fixture), dict(case.knob_items), connector=connector,
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
        vllm = vllm_blocks_per_chunk(kvc, F.make_vllm_config(fx, dict(case.knob_items)))
    except VllmRejected as rejected:
        # vLLM said no: the reference must say no too, with a ValueError naming the knob.
        assert chunking is None, f"vLLM rejects ({rejected}), the reference accepts"
        knob = case.knob_items[0][0]
        assert f"'{knob}'" in error, error
        return
    assert chunking is not None, f"vLLM accepts, the reference rejects: {error}"
    assert vllm.blocks_per_chunk == chunking.uniform_blocks_per_chunk
    assert vllm.tokens_per_hash == chunking.tokens_per_hash
    assert vllm.sliding_window_size_in_chunks == {gc.group.index: gc.window_in_chunks for gc in chunking.groups}
    _assert_same(chunking, _scheduler_config(case, "OffloadingConnector", None))


@pytest.mark.parametrize(
    "case", [c for c in CASES if dict(c.knob_items).get("block_size") == 512], ids=str
)
def test_kvchunk_connector_runs_what_the_reference_resolved(case: ConfigCase) -> None:
    chunking, error = _reference(case)
    if chunking is None:
        with pytest.raises(ValueError):
            _scheduler_config(case, "KvchunkOffloadingConnector", "vllm_adapter.connector")
        return
    _assert_same(chunking, _scheduler_config(case, "KvchunkOffloadingConnector", "vllm_adapter.connector"))
