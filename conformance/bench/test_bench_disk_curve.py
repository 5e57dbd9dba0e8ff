"""Disk-curve speed: one miss-ratio curve of 8 disk sizes in <= 10 s per model.

Times :func:`reference.disk_economics.miss_ratio_curve` -- what ``python -m vllm_adapter
config --sweep-disk`` computes per eviction rule after vLLM's planning -- on the
``block_size`` 512 chunking of the gemma-4-31B-it TP2 and DeepSeek-V4-Flash TP4
fixtures (:func:`vllm_adapter.planning.fixture_knob`), over the ``chat`` and
``agentic`` presets scaled to ~1M prompt tokens (:func:`reference.disk_economics.scaled`),
8 sizes (``peak * k / 8``, the unbounded run's peak last), the reference's rule.
Each round is a fresh call (the hashed workload, the unbounded run and its states are
not kept between calls).

The figure is the ratio of the round times to the 10-s budget (:data:`BUDGET_S`), a
geometric mean with its 95 % t-interval over rounds; the target is
:data:`TARGET` (``<= 1.0``), checked here like every other target.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import pytest

from conformance.bench import GEOMETRIES, TARGETS, env_int, record, rounded
from conformance.bench.stats import paired_interval
from conformance.testing.requires import require_vllm

require_vllm()

from reference.disk_economics import miss_ratio_curve, scaled  # noqa: E402
from reference.eviction import EvictionRule  # noqa: E402
from reference.workload import preset  # noqa: E402
from vllm_adapter.planning import fixture_knob  # noqa: E402

ROUNDS = env_int("KVCHUNK_BENCH_DISK_CURVE_ROUNDS", 3)
BUDGET_S = 10.0
"""Issue #25: one curve of 8 sizes over a 1M-token workload within 10 s per model."""
SIZES = 8
WORKLOADS = ("chat", "agentic")
TARGET = next(t for t in TARGETS if t.kind == "disk_curve")


@pytest.mark.parametrize("workload_name", WORKLOADS)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_disk_curve_speed(benchmark: Any, geometry: str, workload_name: str) -> None:
    knob = fixture_knob(geometry, "block_size", 512)
    key_bytes = {gc_.group.index: knob.file_bytes for gc_ in knob.chunking.groups}
    workload = scaled(preset(workload_name))
    times: list[float] = []
    curves: list[Any] = []

    def one() -> None:
        gc.collect()
        start = time.perf_counter()
        curve = miss_ratio_curve(knob.chunking, workload, SIZES, EvictionRule.REACHABLE,
                                 key_bytes, policy=knob.policy)
        times.append(time.perf_counter() - start)
        curves.append(curve)

    benchmark.pedantic(one, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    curve = curves[-1]
    assert len(curve) == SIZES and curve[-1].files_evicted == 0
    assert all(p.stranded_bytes == 0 for p in curve)
    interval = paired_interval(times, [BUDGET_S] * len(times), speed=False)
    info = dict(
        kind="disk_curve",
        geometry=geometry,
        label=GEOMETRIES[geometry],
        workload=workload.name,
        sizes=[p.budget_bytes for p in curve],
        hit_rate=[round(p.hit_rate, 4) for p in curve],
        budget_s=BUDGET_S,
        seconds=rounded(times, 3),
        median_s=statistics.median(times),
        ratio=interval.ratio,
        ratio_ci=[interval.low, interval.high],
        rounds=interval.rounds,
    )
    record(benchmark, **info)
    assert TARGET.applies(info)
    assert TARGET.verdict(info) != "missed", (
        f"{GEOMETRIES[geometry]} {workload_name}: {statistics.median(times):.1f} s per curve "
        f"(target {BUDGET_S:g} s)"
    )
