"""Sweep speed: ``python -m vllm_adapter config --sweep`` must answer within 10 s.

Times :func:`vllm_adapter.planning.run_sweep` -- what ``--sweep`` computes after
vLLM's planning: :data:`~vllm_adapter.planning.SWEEP_POINTS` ``blocks_per_chunk``
values (1..128) resolved as the connector resolves them, each served through
the default workload preset (:data:`vllm_adapter.planning.DEFAULT_WORKLOAD`, ~1M
prompt tokens) by :func:`reference.economics.economics`, plus the disk model --
on the gemma-4-31B-it TP2 and DeepSeek-V4-Flash TP4 fixtures.  vLLM's import and
KV planning (once per CLI process) are not in the figure.  Every round is a fresh
run (the CLI's per-process results are dropped first).

The figure is the ratio of the round times to the 10-s budget (:data:`BUDGET_S`),
a geometric mean with its 95 % t-interval over rounds (the budget is a constant, so
the interval is the times' own); the target (:data:`conformance.bench.TARGETS`) is
``<= 1.0``: met, missed or inconclusive like every other target.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import pytest

from conformance.bench import GEOMETRIES, env_int, record, rounded
from conformance.bench.stats import paired_interval
from conformance.testing.requires import require_vllm

require_vllm()

from reference.workload import preset  # noqa: E402
from vllm_adapter import fixtures as fx  # noqa: E402
from vllm_adapter.planning import (  # noqa: E402
    DEFAULT_WORKLOAD,
    SWEEP_POINTS,
    forget_served,
    run_sweep,
)

ROUNDS = env_int("KVCHUNK_BENCH_SWEEP_ROUNDS", 3)
BUDGET_S = 10.0
"""The operator waits at most this long for a sweep (issue #16)."""
KNOB = "blocks_per_chunk"


def _sweep_seconds(vllm_config: Any, sched: Any, workload: Any) -> tuple[float, Any]:
    forget_served()
    gc.collect()
    start = time.perf_counter()
    result = run_sweep(vllm_config, sched, KNOB, workload)
    return time.perf_counter() - start, result


@pytest.mark.parametrize("geometry", list(GEOMETRIES))
def test_sweep_speed(benchmark: Any, geometry: str) -> None:
    data = fx.load_fixture(geometry)
    vllm_config = fx.make_vllm_config(data, {})
    sched = fx.rebuild_kv_cache_config(data, "scheduler")
    workload = preset(DEFAULT_WORKLOAD)
    times: list[float] = []
    results: list[Any] = []

    def one() -> None:
        seconds, result = _sweep_seconds(vllm_config, sched, workload)
        times.append(seconds)
        results.append(result)

    benchmark.pedantic(one, rounds=ROUNDS, iterations=1, warmup_rounds=0)
    sweep = results[-1]
    assert len(sweep.points) == SWEEP_POINTS, sweep.skipped
    interval = paired_interval(times, [BUDGET_S] * len(times), speed=False)
    record(
        benchmark,
        kind="sweep",
        geometry=geometry,
        label=GEOMETRIES[geometry],
        workload=workload.name,
        knob=KNOB,
        points=[next(iter(p.knob.values())) for p in sweep.points],
        budget_s=BUDGET_S,
        seconds=rounded(times, 3),
        median_s=statistics.median(times),
        ratio=interval.ratio,
        ratio_ci=[interval.low, interval.high],
        rounds=interval.rounds,
        files_written_per_million=[round(p.traffic.files_written_per_million, 1)
                                   for p in sweep.points],
    )
