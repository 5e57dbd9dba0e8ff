"""Benchmarks (``nox -s bench`` / ``python -m conformance.bench``): what each figure means.

Every figure is measured on the page geometries of gemma-4-31B-it (TP2) and
DeepSeek-V4-Flash (TP4), as vLLM 0.33.0 lays them out (the stored fixtures in
``vllm_adapter/fixtures``), for ``blocks_per_chunk`` in :data:`BLOCKS_PER_CHUNK`,
and reported as a ratio against a baseline measured in the same process, in
the same rounds: absolute times on shared CI machines are noise.

Protocol (:func:`measure`): one untimed warm-up of every variant, then
``rounds`` rounds; in each round every baseline runs, then the candidate
(pytest-benchmark times the candidate; the baselines are timed by hand, with
the garbage collector off, right before it), and the baselines run once more
at the end.  The ratio of a round compares its candidate with the mean of the
baseline runs just before and just after it (a slow drift of a shared machine
cancels); a figure's ratio is the median over rounds (the connector's, whose
runs are short, is that of the fastest runs; see its module).  Medians of the
raw times are reported too.  Objects alive when a measurement starts are
frozen out of the garbage collector (a full collection of a process holding
vLLM takes ~0.3 s), and it is off while anything is timed.

The benchmarks (``conformance/bench/test_*.py``; each records its numbers in
``benchmark.extra_info``, which :mod:`conformance.bench.__main__` turns into
``reports/bench.json``, ``reports/bench.md`` and ``reports/bench-throughput.png``):

``transfer``
    :func:`reference.transfer.gather` (store) and ``scatter`` (load) of one
    group's job -- random, non-contiguous block ids, every layer of the group
    -- over the canonical KV tensors vLLM's own ``register_kv_caches`` builds
    from the fixture, vs one contiguous torch copy of the same number of bytes
    between the same two buffers (the memcpy limit).  Target: >= 0.8 for
    ``blocks_per_chunk >= 4``, both directions, both geometries.
``connector``
    Wall time per scheduler step of vLLM's real ``Scheduler`` with kvchunk's
    ``KvchunkOffloadingConnector`` vs the stock ``OffloadingConnector`` on the
    same extra config and the same requests (``conformance.vllm_driver``,
    worker side emulated identically).  Target: <= 1.05.  Each connector vs no
    connector is informational.
``disk``
    Chunk files as vLLM's file-system tier writes them (one file per chunk per
    group, ``FileMapper`` names, its ``batch_store_block`` / ``batch_load_block``
    I/O on its ``DualQueueThreadPool``), written then read back, vs one
    sequential file of the same bytes.  Informational.
``suite``
    Plan-lane examples per second on the fixture geometries: the whole example
    (hypothesis draw, vLLM run, reference replay, comparison) and the oracle
    alone, vs vLLM's run of the same examples.  Informational.
``gpu``
    CUDA only: vLLM's ``CPUOffloadingWorker`` store/load and the reference
    worker vs pinned ``cudaMemcpyAsync`` of the same bytes.  Target: >= 0.8 for
    ``blocks_per_chunk >= 4``.  Skipped (and said so) without CUDA.

Environment: ``KVCHUNK_BENCH_THREADS`` (torch intra-op threads, default 1:
both sides of every ratio are single-stream copies, and a 2-core runner shared
with other jobs makes OpenMP's 2-thread copies mostly scheduling noise),
``KVCHUNK_BENCH_ROUNDS`` (default 9; ``KVCHUNK_BENCH_CONNECTOR_ROUNDS`` 15,
``KVCHUNK_BENCH_DISK_ROUNDS`` 3, ``KVCHUNK_BENCH_SUITE_ROUNDS`` 3),
``KVCHUNK_BENCH_DISK_MB`` (MiB per disk configuration, default 256),
``KVCHUNK_BENCH_DIR`` (where the disk benchmark writes; default a fresh
directory in the checkout), ``KVCHUNK_BENCH_SUITE_EXAMPLES`` (default 12).
The whole run takes about 2 minutes on a 2-core runner (plus vLLM's import).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

GEOMETRIES: dict[str, str] = {
    "gemma-4-31B-it-tp2": "gemma-4-31B-it TP2",
    "deepseek-v4-flash-tp4": "DeepSeek-V4-Flash TP4",
}
"""Fixture name -> label."""

BLOCKS_PER_CHUNK: tuple[int, ...] = (1, 2, 4, 8, 16, 32)

CASES: list[tuple[str, int]] = [(g, b) for g in GEOMETRIES for b in BLOCKS_PER_CHUNK]
"""(fixture, blocks_per_chunk), geometry-major (one geometry's buffers live at a time)."""


def case_id(case: tuple[str, int]) -> str:
    return f"{case[0]}-bpc{case[1]}"


@dataclass(frozen=True)
class Target:
    """A target a figure's ratio must meet (checked by ``python -m conformance.bench``)."""

    kind: str
    text: str
    min_ratio: float | None = None
    max_ratio: float | None = None
    min_blocks_per_chunk: int = 1

    def applies(self, info: dict[str, Any]) -> bool:
        return (
            info.get("kind") == self.kind
            and info.get("target_checked", True)
            and int(info.get("blocks_per_chunk", 0)) >= self.min_blocks_per_chunk
        )

    def miss(self, ratio: float) -> str | None:
        """Why ``ratio`` misses, or ``None``."""
        if self.min_ratio is not None and ratio < self.min_ratio:
            return f"{ratio:.3f} < {self.min_ratio} (short by {self.min_ratio - ratio:.3f})"
        if self.max_ratio is not None and ratio > self.max_ratio:
            return f"{ratio:.3f} > {self.max_ratio} (over by {ratio - self.max_ratio:.3f})"
        return None


TARGETS: tuple[Target, ...] = (
    Target(
        "transfer",
        "reference gather/scatter >= 0.8 x memcpy for blocks_per_chunk >= 4",
        0.8,
        None,
        4,
    ),
    Target(
        "connector", "kvchunk connector step time <= 1.05 x stock OffloadingConnector", None, 1.05
    ),
    Target(
        "gpu",
        "vLLM CPU-offloading worker >= 0.8 x pinned cudaMemcpyAsync for blocks_per_chunk >= 4",
        0.8,
        None,
        4,
    ),
)


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


THREADS = env_int("KVCHUNK_BENCH_THREADS", 1)
ROUNDS = env_int("KVCHUNK_BENCH_ROUNDS", 9)
DISK_MB = env_int("KVCHUNK_BENCH_DISK_MB", 256)


# ---------------------------------------------------------------------------
# Paired measurement
# ---------------------------------------------------------------------------


@dataclass
class Variant:
    """Something to time: ``run(prepare())``; ``prepare`` is never timed."""

    run: Callable[[Any], object]
    prepare: Callable[[], Any] = lambda: None


@dataclass
class Measured:
    """Seconds per round: the candidate's, and each baseline's (one more, run after the last round)."""

    candidate: list[float]
    baselines: dict[str, list[float]]

    def median(self, name: str | None = None) -> float:
        return statistics.median(self.candidate if name is None else self.baselines[name])

    def paired(self, baseline: str) -> list[tuple[float, float]]:
        """``(candidate, baseline)`` per round; the baseline is the mean of the runs just
        before and just after the candidate's, so a slow drift of the machine cancels."""
        b = self.baselines[baseline]
        return [(c, (b[i] + b[i + 1]) / 2) for i, c in enumerate(self.candidate)]

    def ratio(self, baseline: str, *, speed: bool) -> float:
        """Median over rounds of ``baseline / candidate`` (``speed``) or ``candidate / baseline``."""
        return statistics.median(b / c if speed else c / b for c, b in self.paired(baseline))

    def min_ratio(self, baseline: str, *, speed: bool) -> float:
        """The same ratio of the fastest runs (noise from other jobs only ever adds time)."""
        c, b = min(self.candidate), min(self.baselines[baseline])
        return b / c if speed else c / b


def _timed(variant: Variant) -> float:
    state = variant.prepare()
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        variant.run(state)
        return time.perf_counter() - start
    finally:
        gc.enable()


def measure(
    benchmark: Any,
    candidate: Variant,
    baselines: dict[str, Variant],
    *,
    rounds: int = ROUNDS,
    warmup: int = 1,
) -> Measured:
    """Time ``candidate`` with pytest-benchmark, each round right after its baselines."""
    # Park everything alive now outside the collector: a full collection of a
    # process holding vLLM and torch takes ~0.3 s, the rounds' collections then ~0.
    gc.collect()
    gc.freeze()
    for _ in range(warmup):
        for v in (*baselines.values(), candidate):
            v.run(v.prepare())
    result = Measured([], {name: [] for name in baselines})

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        for name, v in baselines.items():
            result.baselines[name].append(_timed(v))
        state = candidate.prepare()
        gc.collect()
        return (state,), {}

    def target(state: Any) -> None:
        start = time.perf_counter()
        candidate.run(state)
        result.candidate.append(time.perf_counter() - start)

    benchmark.pedantic(target, setup=setup, rounds=rounds, iterations=1, warmup_rounds=0)
    for name, v in baselines.items():
        result.baselines[name].append(_timed(v))
    return result


def record(benchmark: Any, **info: Any) -> None:
    """Put ``info`` in the benchmark's ``extra_info`` (what the reports are built from)."""
    benchmark.extra_info.update(info)


def rounded(values: Sequence[float], digits: int = 6) -> list[float]:
    return [round(v, digits) for v in values]
