"""Disk-curve speed: what ``python -m vllm_adapter config --sweep-disk`` computes after
vLLM's planning, per curve, within 10 s for the disk alone and 20 s with both series
(issue #31).

Times :func:`vllm_adapter.cli.disk.disk_tier` -- the CLI's own sweep: 8 disk sizes, the
rule and plain LRU, over the workload scaled to ~1M prompt tokens
(:func:`reference.disk_economics.scaled`) -- on the ``block_size`` 512 chunking of the
gemma-4-31B-it TP2 and DeepSeek-V4-Flash TP4 fixtures
(:func:`vllm_adapter.planning.fixture_knob`), over the ``chat`` and ``agentic`` presets,
as two series:

* ``disk only``: ``--sweep-disk`` (the disk alone, both rules), budget 10 s;
* ``both``: ``--sweep-disk --cpu-bytes C`` (the disk alone, and again with vLLM's CPU tier
  of ``C`` in front, :data:`conformance.harness.cases.CURVE_CPU_BYTES`; both rules), budget
  20 s.

The CPU tier's slots and the packed tier's load split are the CLI's
(:func:`vllm_adapter.cli.cpu_tier.cpu_tier`, :func:`vllm_adapter.disk.tier.configured_load_split`
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

from reference.workload import preset  # noqa: E402
from vllm_adapter.cli.cpu_tier import cpu_tier  # noqa: E402
from vllm_adapter.cli.disk import disk_tier  # noqa: E402
from vllm_adapter.disk.tier import configured_load_split  # noqa: E402
from vllm_adapter.planning import fixture_knob  # noqa: E402
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
    cpu_chunks = (cpu_tier(cpu_bytes, knob.row, 1, "").num_chunks
                  if cpu_bytes is not None else None)
    workload = preset(workload_name)
    budget_s = BUDGETS_S[series]
    times: list[float] = []
    results: list[Any] = []

    def one() -> None:
        gc.collect()
        start = time.perf_counter()
        result = disk_tier(knob.chunking, workload, knob.policy, key_bytes, None, True, None,
                           "", cpu_bytes=cpu_bytes, cpu_chunks=cpu_chunks,
                           load_split=configured_load_split({}))
        times.append(time.perf_counter() - start)
        results.append(result)

    benchmark.pedantic(one, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    result = results[-1]
    assert result is not None and result.curve is not None and len(result.curve) == SIZES
    assert result.curve[-1].rule.files_evicted_per_million == 0, "the last size is not the peak"
    assert all(p.rule.stranded_bytes == 0 for p in result.curve)
    assert (result.cpu_curve is not None) == (series == "both")
    interval = paired_interval(times, [budget_s] * len(times), speed=False)
    info = dict(
        kind="disk_curve",
        series=series,
        geometry=geometry,
        label=GEOMETRIES[geometry],
        workload=result.workload,
        cpu_bytes=cpu_bytes,
        sizes=[p.budget_bytes for p in result.curve],
        hit_rate=[round(p.rule.hit_rate, 4) for p in result.curve],
        lru_hit_rate=[round(p.lru.hit_rate, 4) for p in result.curve],
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
