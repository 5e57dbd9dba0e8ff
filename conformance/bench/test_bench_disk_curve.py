"""Disk-curve speed: what ``python -m vllm_adapter config --sweep-disk`` computes after
vLLM's planning, per curve, within 10 s for the disk alone and 20 s with both series
(issue #31).

Times :func:`vllm_adapter.planning.disk_sweep` -- the CLI's own sweep (``--sweep-disk``
renders it): 8 disk sizes, the rule and plain LRU, over the workload scaled to ~1M prompt
tokens (:func:`reference.disk_economics.scaled`) -- on the ``block_size`` 512 chunking of the
gemma-4-31B-it TP2 and DeepSeek-V4-Flash TP4 fixtures
(:func:`vllm_adapter.planning.fixture_knob`), over the ``chat`` and ``agentic`` presets,
as two series:

* ``disk only``: ``--sweep-disk`` (the disk alone, both rules), budget 10 s;
* ``both``: ``--sweep-disk --cpu-bytes C`` (the disk alone, and again with vLLM's CPU tier
  of ``C`` in front, :data:`conformance.harness.cases.CURVE_CPU_BYTES`; both rules), budget
  20 s.

The CPU tier's slots and the packed tier's load split are the CLI's
(:meth:`vllm_adapter.planning.CpuRow.chunks_in`, :func:`vllm_adapter.disk.tier.configured_load_split`
with vLLM's default pool).  Each round is a fresh call (the hashed workload, the unbounded
run and its states are not kept between calls).  The figure is the ratio of the round
times to the series' budget (:data:`BUDGETS_S`), a geometric mean with its 95 %
t-interval over rounds; the targets are ``<= 1.0``, checked here like every other target.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import pytest

from conformance.bench import GEOMETRIES, TARGETS, env_int, record, rounded
from conformance.bench.stats import paired_interval
from conformance.harness.cases import CURVE_CPU_BYTES
from conformance.testing.requires import require_vllm

require_vllm()

from reference.disk_economics import scaled  # noqa: E402
from reference.workload import preset  # noqa: E402
from vllm_adapter.disk.tier import configured_load_split  # noqa: E402
from vllm_adapter.planning import DISK_SWEEP_POINTS, disk_sweep, fixture_knob  # noqa: E402
from vllm_adapter.units import parse_bytes  # noqa: E402

ROUNDS = env_int("KVCHUNK_BENCH_DISK_CURVE_ROUNDS", 3)
BUDGETS_S = {"disk only": 10.0, "both": 20.0}
"""Issue #31: ``--sweep-disk`` within 10 s per curve, both series together within 20 s."""
SIZES = 8
WORKLOADS = ("chat", "agentic")


@pytest.mark.parametrize("series", list(BUDGETS_S))
@pytest.mark.parametrize("workload_name", WORKLOADS)
@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_disk_curve_speed(benchmark: Any, geometry: str, workload_name: str, series: str) -> None:
    knob = fixture_knob(geometry, "block_size", 512)
    key_bytes = {gc_.group.index: knob.row.row_bytes() for gc_ in knob.chunking.groups}
    cpu_bytes = parse_bytes(CURVE_CPU_BYTES[geometry]) if series == "both" else None
    cpu_chunks = knob.row.chunks_in(cpu_bytes) if cpu_bytes is not None else None
    workload = preset(workload_name)
    budget_s = BUDGETS_S[series]
    times: list[float] = []
    results: list[Any] = []

    def one() -> None:
        gc.collect()
        start = time.perf_counter()
        big = scaled(workload, gpu_cache=workload.gpu_cache)
        result = disk_sweep(knob.chunking, big, knob.policy, key_bytes, cpu_chunks,
                            configured_load_split({}))
        times.append(time.perf_counter() - start)
        results.append((big, result))

    benchmark.pedantic(one, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    big, result = results[-1]
    assert len(result.sizes) == SIZES == DISK_SWEEP_POINTS
    assert result.rule[-1].files_evicted == 0, "the last size is not the unbounded peak"
    assert all(p.stranded_bytes == 0 for p in result.rule)
    assert (result.cpu_rule is not None) == (series == "both")
    interval = paired_interval(times, [budget_s] * len(times), speed=False)
    info = dict(
        kind="disk_curve",
        series=series,
        geometry=geometry,
        label=GEOMETRIES[geometry],
        workload=big.name,
        cpu_bytes=cpu_bytes,
        sizes=list(result.sizes),
        hit_rate=[round(p.hit_rate, 4) for p in result.rule],
        lru_hit_rate=[round(p.hit_rate, 4) for p in result.lru],
        budget_s=budget_s,
        seconds=rounded(times, 3),
        median_s=statistics.median(times),
        ratio=interval.ratio,
        ratio_ci=[interval.low, interval.high],
        rounds=interval.rounds,
    )
    record(benchmark, **info)
    target = next(t for t in TARGETS if t.kind == "disk_curve" and t.applies(info))
    assert target.verdict(info) != "missed", (
        f"{GEOMETRIES[geometry]} {workload_name} ({series}): {statistics.median(times):.1f} s "
        f"per curve (target {budget_s:g} s)"
    )
