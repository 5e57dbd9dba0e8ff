"""Suite speed: plan-lane examples per second on the fixture geometries.

One plan-lane case per geometry and ``blocks_per_chunk`` (the lane's fixture
driver: vLLM's real ``Scheduler`` + stock ``OffloadingConnector``, 512 GPU
blocks), ``EXAMPLES`` workloads drawn by the lane's own strategy
(:func:`conformance.harness.workloads.workloads`, derandomized).  First the whole lane
example runs as the lane runs it (hypothesis draw, vLLM run, reference replay,
comparison), which also records the traces; then, measured: the oracle alone
(``replay`` + ``recorded_answers`` + ``first_divergence`` over the traces) vs
vLLM's run of the same workloads (``VllmDriver.run``).  The ratio is the
oracle's throughput over vLLM's (> 1: the oracle is not what bounds the lane).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from conformance.bench import CASES, GEOMETRIES, Variant, case_id, env_int, measure, record, rounded
from conformance.testing.requires import require_vllm

require_vllm()

from hypothesis import Phase, given, settings  # noqa: E402

from conformance.harness.strategies import SLOW_EXAMPLE_CHECKS  # noqa: E402
from conformance.harness.workloads import PlanCase, driver_for, workloads  # noqa: E402
from conformance.protocol.replay import first_divergence, recorded_answers, replay  # noqa: E402
from vllm_adapter.names import STOCK_CONNECTOR  # noqa: E402

EXAMPLES = env_int("KVCHUNK_BENCH_SUITE_EXAMPLES", 12)
ROUNDS = env_int("KVCHUNK_BENCH_SUITE_ROUNDS", 3)


def plan_case(geometry: str, blocks_per_chunk: int) -> PlanCase:
    return PlanCase(
        geometry,
        f"blocks_per_chunk={blocks_per_chunk}",
        "fixture",
        (geometry, STOCK_CONNECTOR, None),
        (("blocks_per_chunk", blocks_per_chunk),),
        0,
        512,
    )


def oracle(traces: list[Any]) -> int:
    """The lane's check of each trace; the answers compared."""
    answers = 0
    for trace in traces:
        expected = replay(trace)
        div = first_divergence(expected, recorded_answers(trace))
        assert div is None, div.explain(trace)
        answers += len(expected)
    return answers


@pytest.mark.parametrize("geometry,blocks_per_chunk", CASES, ids=[case_id(c) for c in CASES])
def test_plan_lane_speed(benchmark: Any, geometry: str, blocks_per_chunk: int) -> None:
    driver = driver_for(plan_case(geometry, blocks_per_chunk))
    drawn: list[Any] = []
    traces: list[Any] = []

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=SLOW_EXAMPLE_CHECKS,
    )
    @given(workloads())
    def lane_example(workload: Any) -> None:
        trace = driver.run(workload)
        oracle([trace])
        drawn.append(workload)
        traces.append(trace)

    start = time.perf_counter()
    lane_example()
    lane_s = time.perf_counter() - start
    stores = sum(
        len(r.store_jobs) for t in traces for r in t.records if type(r).__name__ == "BuildMeta"
    )
    loads = sum(
        1 for t in traces for r in t.records if type(r).__name__ == "Alloc" and r.load is not None
    )

    def run_vllm(_: Any) -> None:
        for w in drawn:
            driver.run(w)

    m = measure(
        benchmark,
        Variant(lambda _: oracle(traces)),
        {"vllm": Variant(run_vllm)},
        rounds=ROUNDS,
        warmup=0,
    )
    n = len(drawn)
    record(
        benchmark,
        kind="suite",
        geometry=geometry,
        label=GEOMETRIES[geometry],
        blocks_per_chunk=blocks_per_chunk,
        examples=n,
        answers=oracle(traces),
        store_jobs=stores,
        load_jobs=loads,
        **m.ratio_fields("vllm", speed=True),
        lane_examples_per_s=n / lane_s,
        oracle_examples_per_s=n / m.median(),
        vllm_examples_per_s=n / m.median("vllm"),
        candidate_s=rounded(m.candidate),
        baseline_s=rounded(m.baselines["vllm"]),
    )
