"""Benchmarks (``nox -s bench`` / ``python -m conformance.bench``): what each figure means.

Every figure is measured on the page geometries of gemma-4-31B-it (TP2) and
DeepSeek-V4-Flash (TP4), as vLLM 0.33.0 lays them out (the stored fixtures in
``vllm_adapter/fixtures``), for ``blocks_per_chunk`` in :data:`BLOCKS_PER_CHUNK`,
and reported as a ratio against a baseline measured in the same process, in
the same rounds: absolute times on shared CI machines are noise.

Protocol (:func:`measure`): one untimed warm-up of every variant, then
``rounds`` rounds interleaved in one process (``B A B A ... B``: each round
runs every baseline, then the candidate; the baselines run once more at the
end).  Round ``i`` pairs its candidate with the mean of the baseline runs just
before and just after it, so a slow drift of a shared machine cancels; a
figure's ratio is the geometric mean of the per-round ratios with a 95 %
paired t-interval (:mod:`conformance.bench.stats`).  A target is "met" when
the whole interval is on its side, "missed" when the whole interval is on the
wrong side, "inconclusive" when it straddles the target (rerun); only "missed"
fails ``nox -s bench``, and only when it repeats: a figure whose first batch
missed is measured again at once (:meth:`Measured.ratio_fields`), and a miss the second
batch does not repeat is "inconclusive".  Medians of the raw times are reported too.  Objects
alive when a measurement starts are frozen out of the garbage collector (a
full collection of a process holding vLLM takes ~0.3 s), and it is off while
anything is timed; the load average at start and end is recorded.

The benchmarks (``conformance/bench/test_*.py``; each records its numbers in
``benchmark.extra_info``, which :mod:`conformance.bench.__main__` turns into
``reports/bench.json``, ``reports/bench.md`` and ``reports/bench-throughput.png``):

``transfer``
    :func:`reference.transfer_fast.gather` (store) and ``scatter`` (load) of one
    group's job -- random, non-contiguous block ids, every layer of the group
    -- over the canonical KV tensors vLLM's own ``register_kv_caches`` builds
    from the fixture, vs one contiguous torch copy of the same number of bytes
    between the same two buffers (the memcpy limit).  Target: >= 0.8 for
    ``blocks_per_chunk >= 4``, both directions, both geometries.
``oracle``
    The reference oracle's cost per scheduler step on long prompts
    (``conformance/bench/test_bench_oracle.py``): kvchunk's knob resolution
    and planning (``replay`` + comparison) of a trace of 32k-token multi-turn
    requests, vs vLLM's real ``Scheduler`` + stock ``OffloadingConnector``
    running the same requests.  Target: <= 1.0 (the conformance lanes must not
    be bounded by their own oracle) for ``blocks_per_chunk >= 4``.  It replaces a kvchunk-vs-stock connector
    figure that compared identical code after ``__init__``.
``files``
    File economics (``conformance/bench/test_bench_files.py``): files per
    million tokens and bytes per file of each knob, measured files/s and GB/s
    at each file size, and a shared-file-system model.  Informational.
``disk``
    Chunk files as vLLM's file-system tier writes them (one file per chunk per
    group, ``FileMapper`` names, its ``batch_store_block`` / ``batch_load_block``
    I/O on its ``DualQueueThreadPool``), written then read back, vs one
    sequential file of the same bytes.  Informational.
``sweep``
    ``python -m vllm_adapter config --sweep`` after vLLM's planning
    (``conformance/bench/test_bench_sweep.py``): 8 ``blocks_per_chunk`` values, each
    served through the default ~1M-token workload preset by ``reference.economics``.
    Target: the round times over a 10-s budget <= 1.0 (a ratio against a constant:
    the interval is the times' own).
``suite``
    Plan-lane examples per second on the fixture geometries: the whole example
    (hypothesis draw, vLLM run, reference replay, comparison) and the oracle
    alone, vs vLLM's run of the same examples.  Informational.
``packed``
    kvchunk's packed file tier (per store job a file of its full-attention keys and one
    of its window keys) vs vLLM's per-chunk fs tier
    on the store and load jobs of the ``chat`` and ``agentic`` presets at
    ``block_size`` 512 (``conformance/bench/test_bench_packed.py``): files written,
    file opens for reads and bytes written (exact ratios; targets <= 1/4, <= 1/2,
    <= 1.05), and the wall time to store and load the workload on the disk as it
    is (>= 0.95; the packed stores and loads split across the pool as the tier splits
    them; beside it, timed in the same rounds and without a target, kvchunk's own
    checksummed per-chunk tier as a second baseline: packed vs it is the layout alone,
    it vs vLLM's the integrity alone) and on an emulated metadata-bound file system
    (:mod:`conformance.bench.metafs`: a FUSE passthrough whose metadata requests queue at
    one server of 2,000 or 10,000 operations/s shared by every client thread; data
    passes straight through): at 2,000 operations/s stores >= 8 and loads >= 3; the
    10,000 operations/s rows carry no target (there the packed tier runs at the
    emulator's own data-path floor, so a target would judge the emulator).  Each of
    those rows also records both
    tiers' metadata operations per million prompt tokens (counted by the mount), the
    files the reference predicts, and the highest ratio the mount allows (``bound``:
    each tier's time is at least ``max(ops / rate, its time on the unthrottled
    mount)``; the bound is the per-chunk tier's over the packed tier's, the speed-up when
    both run at their lower bound); a target above a row's bound is a wrong target, not a
    miss, and that row is not checked.
``gpu``
    CUDA only: vLLM's ``CPUOffloadingWorker`` store/load and the reference
    worker vs pinned ``cudaMemcpyAsync`` of the same bytes.  Target: >= 0.8 for
    ``blocks_per_chunk >= 4``.  Skipped (and said so) without CUDA.

Environment: ``KVCHUNK_BENCH_THREADS`` (torch intra-op threads, default 1:
both sides of every ratio are single-stream copies, and a 2-core runner shared
with other jobs makes OpenMP's 2-thread copies mostly scheduling noise),
``KVCHUNK_BENCH_ROUNDS`` (default 9; ``KVCHUNK_BENCH_ORACLE_ROUNDS`` 7,
``KVCHUNK_BENCH_DISK_ROUNDS`` 3,
``KVCHUNK_BENCH_PACKED_ROUNDS`` 3 (``KVCHUNK_BENCH_PACKED_DISK_ROUNDS`` 9 on the plain disk), ``KVCHUNK_BENCH_PACKED_TOKENS`` 150000,
``KVCHUNK_BENCH_PACKED_MB`` 256, ``KVCHUNK_BENCH_PACKED_FLOOR_PASSES`` 2,
``KVCHUNK_BENCH_SUITE_ROUNDS`` 3,
``KVCHUNK_BENCH_SWEEP_ROUNDS`` 3),
``KVCHUNK_BENCH_DISK_MB`` (MiB per disk configuration, default 256),
``KVCHUNK_BENCH_DIR`` (where the disk benchmark writes; default a fresh
directory in the checkout), ``KVCHUNK_BENCH_SUITE_EXAMPLES`` (default 12).
The whole run took 166 s on a 2-core runner alone (load average 2-3; 16 of 16 transfer
figures met) and 1561 s beside a CI run and two test jobs (load average 4-7; 6 met,
10 inconclusive, 0 missed).
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from conformance.bench.stats import RatioInterval, Verdict, classify, paired_interval
from conformance.harness import cases

GEOMETRIES: dict[str, str] = {name: cases.LABELS[name] for name in cases.MODEL_FIXTURES}
"""Fixture name -> label: the real models of :data:`conformance.harness.cases.FIXTURES`."""

BLOCKS_PER_CHUNK: tuple[int, ...] = cases.BENCH_BLOCKS_PER_CHUNK

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
    where: tuple[tuple[str, Any], ...] = ()
    """Further ``(field, value)`` a figure must have (e.g. its direction and rate)."""
    field: str = "ratio"
    """The figure's ratio this target judges: ``field``, ``field_ci`` (and a second
    batch's ``confirm_field``, ``confirm_field_ci``).  A figure without a second field is
    not that target's (e.g. a plain-disk row measured where ``fio`` is not installed has
    no ``limit_ratio``)."""

    def matches(self, info: dict[str, Any]) -> bool:
        """Is ``info`` a figure of this target (its kind and ``where``), checked or not?"""
        return (info.get("kind") == self.kind and (self.field == "ratio" or self.field in info)
                and all(info.get(k) == v for k, v in self.where))

    def applies(self, info: dict[str, Any]) -> bool:
        return (
            self.matches(info)
            and info.get("target_checked", True)
            and int(info.get("blocks_per_chunk", 0)) >= self.min_blocks_per_chunk
        )

    def _classify(self, ratio: float, ci: Sequence[float]) -> Verdict:
        interval = RatioInterval(float(ratio), float(ci[0]), float(ci[1]), 0)
        return classify(interval, min_ratio=self.min_ratio, max_ratio=self.max_ratio)

    def verdict(self, info: dict[str, Any]) -> Verdict:
        """``met`` / ``missed`` / ``inconclusive`` of a figure's recorded interval(s).

        A miss must repeat: a figure whose first batch missed was measured again
        (``confirm_ratio_ci``, :meth:`Measured.ratio_fields`), and it is "missed" only when
        the second batch misses too; a miss the second batch does not repeat is
        "inconclusive".  (A figure recorded without a second batch keeps its miss.)
        """
        f = self.field
        first = self._classify(info[f], info[f"{f}_ci"])
        if first != "missed" or f"confirm_{f}_ci" not in info:
            return first
        again = self._classify(info[f"confirm_{f}"], info[f"confirm_{f}_ci"])
        return "missed" if again == "missed" else "inconclusive"

    def explain(self, info: dict[str, Any]) -> str:
        """The ratio, its interval(s) and where it stands against the target."""
        bound = (
            f">= {self.min_ratio}" if self.min_ratio is not None else f"<= {self.max_ratio}"
        )
        f = self.field
        text = f"{self.verdict(info)}: {_ci_text(info[f], info[f'{f}_ci'])}"
        if f"confirm_{f}_ci" in info:
            again = _ci_text(info[f"confirm_{f}"], info[f"confirm_{f}_ci"])
            text += f", missed once, then {again} when measured again"
        return f"{text} vs {bound}"


SHARE_OF_BOUND = 0.9
"""The target proposed for a row whose target lies above its bound (the speed-up the
emulated mount allows, both tiers at their lower bound: a wrong target, not checked): the
measured speed-up reaches this share of that bound."""


def proposed_target(info: dict[str, Any]) -> tuple[float, Verdict]:
    """A wrong target's replacement for one row (``target_above_bound``): its value,
    :data:`SHARE_OF_BOUND` x the row's ``bound``, and the row's verdict against it (its
    ``ratio`` and interval; reported, not checked)."""
    goal = SHARE_OF_BOUND * float(info["bound"])
    lo, hi = info["ratio_ci"]
    interval = RatioInterval(float(info["ratio"]), float(lo), float(hi), 0)
    return goal, classify(interval, min_ratio=goal)


def _ci_text(ratio: float, ci: Sequence[float]) -> str:
    return f"{float(ratio):.3f} [{float(ci[0]):.3f}, {float(ci[1]):.3f}]"


TARGETS: tuple[Target, ...] = (
    Target(
        "transfer",
        "reference gather/scatter >= 0.8 x memcpy for blocks_per_chunk >= 4",
        0.8,
        None,
        4,
    ),
    Target(
        "oracle",
        "reference oracle time per step <= 1.0 x vLLM scheduler + stock connector "
        "(32k prompts) for blocks_per_chunk >= 4",
        None,
        1.0,
        4,
    ),
    Target(
        "sweep",
        "config --sweep (8 knob values, ~1M-token preset) within 10 s after vLLM's planning",
        None,
        1.0,
        0,
    ),
    Target(
        "disk_checksum",
        "kvchunk's checksummed fs tier >= 0.95 x vLLM's plain fs tier (files per second) "
        "for blocks_per_chunk >= 4",
        0.95,
        None,
        4,
    ),
    Target(
        "packed_files_written",
        "packed fs tier files written <= 1/4 x vLLM's per-chunk tier (chat, agentic; "
        "block_size 512)",
        None,
        0.25,
        0,
    ),
    Target(
        "packed_read_opens",
        "packed fs tier file opens for reads <= 1/2 x vLLM's per-chunk tier (chat, agentic; "
        "block_size 512)",
        None,
        0.5,
        0,
    ),
    Target(
        "packed_bytes_written",
        "packed fs tier bytes written <= 1.05 x vLLM's per-chunk tier (chat, agentic; "
        "block_size 512)",
        None,
        1.05,
        0,
    ),
    Target(
        "packed_time_metadata",
        "packed fs tier stores >= 8 x faster than vLLM's per-chunk tier on an emulated "
        "metadata-bound file system of 2,000 operations/s (wall time; chat, agentic; "
        "block_size 512; a row whose bound is below 8 is a wrong target, not checked)",
        8.0,
        None,
        0,
        (("direction", "store"), ("ops_per_s", 2000)),
    ),
    Target(
        "packed_time_metadata",
        "packed fs tier loads >= 3 x faster than vLLM's per-chunk tier on an emulated "
        "metadata-bound file system of 2,000 operations/s (wall time; chat, agentic; "
        "block_size 512; a row whose bound is below 3 is a wrong target, not checked)",
        3.0,
        None,
        0,
        (("direction", "load"), ("ops_per_s", 2000)),
    ),
    Target(
        "packed_time",
        "packed fs tier >= 0.95 x vLLM's per-chunk tier on the plain disk (store and load "
        "wall time; chat, agentic; block_size 512)",
        0.95,
        None,
        0,
    ),
    Target(
        "packed_time",
        "packed fs tier >= 0.9 x the disk's own limit on the plain disk (fio on the same "
        "directory: the packed tier's bytes, file size, I/O size, threads and O_DIRECT; "
        "store and load; chat, agentic; block_size 512)",
        0.9,
        None,
        0,
        field="limit_ratio",
    ),
    Target(
        "disk_curve",
        "`--sweep-disk`, the disk alone (8 disk sizes, ~1M-token chat/agentic, the rule and "
        "LRU) within 10 s per curve (issue #31)",
        None,
        1.0,
        0,
        (("series", "disk only"),),
    ),
    Target(
        "disk_curve",
        "`--sweep-disk --cpu-bytes`, both series (the disk alone and with vLLM's CPU tier in "
        "front, the rule and LRU) within 20 s per curve (issue #31)",
        None,
        1.0,
        0,
        (("series", "both"),),
    ),
    Target(
        "budget_restart",
        "a packed tier's start over a full root (list, ledger, index) <= 2 s per 100k files, "
        "cold page cache (issue #30)",
        None,
        1.0,
        0,
        (("index", "snapshot"),),
    ),
    Target(
        "budget_eviction",
        "packed store throughput with the disk budget full (every store evicts) >= 0.95 x "
        "with it empty (files/s, reserve + write + complete; >= 512 files of real section "
        "sizes: DeepSeek-V4 TP4's, gemma-4's scaled; issue #30)",
        0.95,
        None,
        0,
        (("sizes", "real"),),
    ),
    Target(
        "gpu",
        "vLLM CPU-offloading worker >= 0.8 x pinned cudaMemcpyAsync for blocks_per_chunk >= 4",
        0.8,
        None,
        4,
    ),
)


def target_of(info: dict[str, Any]) -> Target | None:
    """The target a figure belongs to (its kind and ``where``), whether checked or not."""
    return next((t for t in TARGETS if t.matches(info)), None)


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
    again: Callable[[], Measured] | None = field(default=None, repr=False, compare=False)
    """A fresh batch of the same variants (:func:`measure` sets it; see :meth:`ratio_fields`)."""

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

    def interval(self, baseline: str, *, speed: bool) -> RatioInterval:
        """The paired 95 % t-interval of the ratio (:func:`~conformance.bench.stats.paired_interval`)."""
        pairs = self.paired(baseline)
        return paired_interval([c for c, _ in pairs], [b for _, b in pairs], speed=speed)

    def ratio_fields(
        self, baseline: str, *, speed: bool, about: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """``ratio`` (geometric mean), ``ratio_ci`` [low, high], ``ratio_median``, ``rounds``;
        with ``about`` (what :meth:`Target.applies` reads: ``kind``, ``blocks_per_chunk``,
        ``target_checked``), a second batch's ``confirm_ratio``/``confirm_ratio_ci`` where
        a target missed.

        The rounds of one batch are not independent samples of a shared machine: a
        state (another job's phase, a memory-bandwidth neighbour) lasts seconds, i.e.
        several rounds, so one batch's interval is narrower than the truth and a
        noise spike can put it wholly on the wrong side.  A real regression misses in
        every batch; a state that happened to last one batch does not repeat, so a
        miss is re-measured once (:attr:`again`, a fresh batch later in time) and
        stands only if it repeats (:meth:`Target.verdict`).
        """
        iv = self.interval(baseline, speed=speed)
        fields: dict[str, Any] = {
            "ratio": iv.ratio,
            "ratio_ci": [iv.low, iv.high],
            "ratio_median": self.ratio(baseline, speed=speed),
            "rounds": iv.rounds,
        }
        row = {**(about or {}), **fields}
        missed = about is not None and any(
            t.applies(row) and t.verdict(row) == "missed" for t in TARGETS
        )
        if missed and self.again is not None:
            second = self.again().interval(baseline, speed=speed)
            fields["confirm_ratio"] = second.ratio
            fields["confirm_ratio_ci"] = [second.low, second.high]
        return fields


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
    result = Measured(
        [], {name: [] for name in baselines}, lambda: interleaved(candidate, baselines, rounds)
    )

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


def interleaved(candidate: Variant, baselines: dict[str, Variant], rounds: int = ROUNDS) -> Measured:
    """:func:`measure`'s protocol (``B A B A ... B``) without pytest-benchmark: a second batch
    (:attr:`Measured.again`)."""
    gc.collect()
    gc.freeze()
    result = Measured([], {name: [] for name in baselines})
    for _ in range(rounds):
        for name, v in baselines.items():
            result.baselines[name].append(_timed(v))
        result.candidate.append(_timed(candidate))
    for name, v in baselines.items():
        result.baselines[name].append(_timed(v))
    return result


def record(benchmark: Any, **info: Any) -> None:
    """Put ``info`` in the benchmark's ``extra_info`` (what the reports are built from)."""
    benchmark.extra_info.update(info)


def rounded(values: Sequence[float], digits: int = 6) -> list[float]:
    return [round(v, digits) for v in values]
