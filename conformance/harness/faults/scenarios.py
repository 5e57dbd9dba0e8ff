"""Fault scenarios: a geometry, pools, a random workload and the worker's dice, played and checked.

:func:`run_fault_scenario` builds the scenario's driver (:func:`scenario_driver`),
wires a session for faults (:func:`fault_session`), plays a random workload with
aborts and prefix-cache resets (:func:`play`) and runs the leak checks
(:func:`drain_and_check`).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from conformance.harness.faults.leaks import final_reset_report, leak_report, manager_chunks
from conformance.harness.faults.runner import FaultRunner
from conformance.harness.faults.worker import FaultPlan, FaultStats, FaultyWorker
from reference.knobs import BLOCKS_PER_CHUNK
from vllm_adapter.names import REFERENCE_SPEC

_SYNTHETIC = {
    "synthetic-full": "full_attention_kv_cache_config",
    "synthetic-full-swa": "full_swa_kv_cache_config",
    "synthetic-full-mamba-align": "full_mamba_align_kv_cache_config",
    "synthetic-eagle": "swa_eagle_kv_cache_config",
}


@dataclass(frozen=True)
class FaultScenario:
    """One fault-injection run: a geometry, pools, a workload shape and the worker's dice."""

    name: str
    fixture: str
    plan: FaultPlan
    blocks_per_chunk: int = 2
    num_gpu_blocks: int = 120
    num_cpu_chunks: int = 48
    num_requests: int = 24
    num_docs: int = 3
    doc_len: int = 320
    spacing: int = 2
    budget: int = 128
    p_abort: float = 0.0
    reset_every: int = 0
    p_connector_reset: float = 0.0
    world_size: int | None = None
    """Override the engine's world size (synthetic geometries); None keeps the fixture's."""
    planned: bool = False
    max_steps: int = 4000
    block_tokens_base: int | None = None
    """The fixture's scheduler block size (tokens) ``doc_len`` and ``budget`` were sized
    for; when the release plans other blocks (vLLM 0.34.0: gemma-4 at 64 tokens, 0.33.0:
    16) both scale with them, so the workload spans the same blocks.  None: absolute."""

    def scaled(self) -> FaultScenario:
        """This scenario with ``doc_len`` and ``budget`` scaled to the fixture's blocks."""
        if self.block_tokens_base is None:
            return self
        from vllm_adapter import fixtures as fx

        block = int(fx.load_fixture(self.fixture)["resolved"]["scheduler_block_size"])
        scale = max(1, block // self.block_tokens_base)
        return replace(
            self, doc_len=self.doc_len * scale, budget=self.budget * scale, block_tokens_base=None
        )

    @property
    def knob(self) -> str:
        return f"blocks_per_chunk={self.blocks_per_chunk}, {self.name}"

    def __str__(self) -> str:
        return f"{self.fixture}-{self.name}"


def replace_seed(sc: FaultScenario, seed: int) -> FaultScenario:
    """The same scenario under other dice."""
    return replace(sc, plan=replace(sc.plan, seed=seed))


def scenario_driver(sc: FaultScenario) -> Any:
    """The scenario's :class:`~conformance.harness.driver.VllmDriver` (reference spec, recompute policy)."""
    from conformance.harness import driver as D
    from conformance.harness.fixture_runs import fixture_driver
    from conformance.harness.kv_memory import with_planned_tensors

    extra = {BLOCKS_PER_CHUNK: sc.blocks_per_chunk}
    if sc.fixture in _SYNTHETIC:
        kvc = getattr(D, _SYNTHETIC[sc.fixture])(num_blocks=sc.num_gpu_blocks)
        driver = D.VllmDriver.from_kv_cache_config(
            kvc,
            extra_config={**REFERENCE_SPEC, **extra},
            prefix_cache_retention_interval=0,
            num_gpu_blocks=sc.num_gpu_blocks,
            num_cpu_chunks=sc.num_cpu_chunks,
            kv_load_failure_policy="recompute",
        )
        if sc.planned:
            driver = D.VllmDriver(with_planned_tensors(driver.kv_cache_config, driver.vllm_config),
                                  driver.vllm_config)
    else:
        driver = fixture_driver(sc.fixture, extra, num_gpu_blocks=sc.num_gpu_blocks,
                                num_cpu_chunks=sc.num_cpu_chunks)
        driver.vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
    if sc.world_size is not None:
        pc = copy.copy(driver.vllm_config.parallel_config)
        pc.world_size = sc.world_size
        driver.vllm_config.parallel_config = pc
    return driver


def random_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, 30000) for _ in range(n))


def scenario_requests(sc: FaultScenario, rng: random.Random) -> list[Any]:
    from conformance.protocol.trace import RequestSpec

    docs = [random_tokens(rng, sc.doc_len) for _ in range(sc.num_docs)]
    out = []
    for i in range(sc.num_requests):
        doc = rng.choice(docs)
        cut = rng.randint(sc.doc_len // 4, sc.doc_len)
        prompt = doc[:cut] + random_tokens(rng, rng.randint(1, max(1, sc.doc_len // 4)))
        out.append(RequestSpec(f"r{i}", prompt, max_tokens=rng.randint(2, 4),
                               arrival_step=i * sc.spacing + rng.randint(0, 1)))
    return out


# ---------------------------------------------------------------------------
# A session wired for faults
# ---------------------------------------------------------------------------


@dataclass
class FaultSession:
    """A session wired for faults: the driver session, runner, worker, stats and baseline."""

    session: Any
    runner: FaultRunner
    worker: FaultyWorker
    stats: FaultStats
    baseline_free: int


def fault_session(
    driver: Any, plan: FaultPlan, *, budget: int | None = None, stats: FaultStats | None = None,
    check_foreign: bool | None = None,
) -> FaultSession:
    """A driver session whose worker is a :class:`FaultyWorker` and model runner a
    :class:`FaultRunner`, sharing ``stats``."""
    stats = stats or FaultStats()
    runner = FaultRunner(driver.worker_kv_cache_config, driver.vllm_config, stats,
                         check_foreign=check_foreign)
    box: dict[str, FaultyWorker] = {}

    def wrap(session: Any, inner: Any) -> FaultyWorker:
        box["w"] = FaultyWorker(session, inner, plan, runner, stats)
        return box["w"]

    s = driver.session(model_runner=runner, max_num_batched_tokens=budget, record=False,
                       worker_wrapper=wrap)
    worker = box["w"]
    runner.worker = worker
    _count_cpu_tier_pressure(s.connector_scheduler.manager, worker, stats)
    baseline = s.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
    return FaultSession(s, runner, worker, stats, baseline)


def _count_cpu_tier_pressure(mgr: Any, worker: FaultyWorker, stats: FaultStats) -> None:
    """Count ``cpu_full`` (``prepare_store`` refuses) and evictions while loads are pending."""
    orig = mgr.prepare_store

    def prepare_store(keys: Any, req_context: Any) -> Any:
        out = orig(keys, req_context)
        if out is None:
            stats.count("cpu_full")
        elif out.evicted_keys and any(not j.store for j in worker.pending.values()):
            stats.count("evictions_with_loads_pending")
        return out

    mgr.prepare_store = prepare_store


# ---------------------------------------------------------------------------
# Playing a workload
# ---------------------------------------------------------------------------

STALL_STEPS = 24
"""Steps without progress (and no transfer pending) after which :func:`play` calls it a stall."""


def _progress(s: Any) -> tuple[int, int]:
    reqs = s.scheduler.requests.values()
    return len(reqs), sum(int(r.num_computed_tokens) + r.num_output_tokens for r in reqs)


def _has_jobs_in_flight(fs: FaultSession, req_id: str) -> bool:
    status = fs.session.connector_scheduler._req_status.get(req_id)
    return bool(status is not None and status.transfer_jobs)


def _loads_waiting(fs: FaultSession) -> bool:
    return any(not j.store for j in fs.worker.pending.values()) or bool(
        fs.session.scheduler.kv_holding_waiting
    )


def _reset(fs: FaultSession, *, connector: bool, running: bool) -> None:
    """One prefix-cache reset, steering clear of vLLM 0.33.0's known bugs.

    A connector reset while requests keep running (``reset_running_requests=False``)
    re-offloads them from chunk 0 with stale sliding-window block ids
    (deviation ``connector-reset-stale-swa-blocks``): on geometries with a
    sliding-window group it is made a full reset, or skipped while loads wait
    (vLLM refuses to preempt those).  Callers never reset twice between two
    steps (deviation ``connector-reset-twice``).
    """
    s = fs.session
    if running and _loads_waiting(fs):
        running = False  # vLLM raises: requests waiting for remote KV cannot be preempted
    if connector and not running and s.connector_scheduler._sliding_window_groups:
        if _loads_waiting(fs):
            connector = False
        else:
            running = True
    in_flight = bool(fs.worker.in_flight)
    s.reset_prefix_cache(reset_connector=connector, reset_running_requests=running)
    if connector:
        fs.stats.count("connector_resets")
    if in_flight and (connector or running):
        fs.stats.count("resets_in_flight")


@dataclass
class _StallWatch:
    """Steps since the session last made progress (or had a job pending)."""

    idle_since: int = 0
    last_progress: tuple[int, int] | None = None

    def stalled(self, fs: FaultSession, n: int) -> bool:
        progress = _progress(fs.session)
        if progress != self.last_progress or fs.worker.pending:
            self.idle_since, self.last_progress = n, progress
            return False
        return n - self.idle_since >= STALL_STEPS and fs.session.scheduler.has_unfinished_requests()


def _unstall(fs: FaultSession, n: int) -> None:
    """Requests whose prefix (or own job) waits on a lost store wait forever (the key stays
    HIT_PENDING, the lookup is deferred): a connector reset is the only way out vLLM 0.33.0 has."""
    if not fs.worker.lost:
        raise RuntimeError(f"no progress for {STALL_STEPS} steps at step {n} with "
                           f"nothing lost: {sorted(fs.session.scheduler.requests)[:8]}")
    _reset(fs, connector=True, running=True)
    fs.stats.lost_store_stall_resets += 1


def _schedule(requests: Sequence[Any], rng: random.Random,
              p_abort: float) -> tuple[dict[int, list[Any]], dict[int, list[str]]]:
    """Arrivals and aborts by step (relative to the start of :func:`play`)."""
    arrivals: dict[int, list[Any]] = {}
    for r in requests:
        arrivals.setdefault(r.arrival_step, []).append(r)
    aborts: dict[int, list[str]] = {}
    for r in requests:
        if rng.random() < p_abort:
            aborts.setdefault(r.arrival_step + rng.randint(0, 8), []).append(r.req_id)
    return arrivals, aborts


def _abort(fs: FaultSession, req_id: str) -> None:
    req = fs.session.scheduler.requests.get(req_id)
    if req is None or req.is_finished():
        return
    if _has_jobs_in_flight(fs, req_id):
        fs.stats.count("aborts_in_flight")
    fs.session.abort(req_id)


def play(fs: FaultSession, requests: Sequence[Any], *, rng: random.Random, p_abort: float = 0.0,
         reset_every: int = 0, p_connector_reset: float = 0.0, max_steps: int = 4000,
         on_step: Callable[[int], None] | None = None) -> int:
    """Run ``requests`` (``RequestSpec`` s with arrival steps) with random aborts and resets;
    the steps taken."""
    s = fs.session
    arrivals, aborts = _schedule(requests, rng, p_abort)
    last_event = max([*arrivals, *aborts, 0])
    start = s.step_no
    watch = _StallWatch()
    while True:
        n = s.step_no - start
        reset_done = False
        if watch.stalled(fs, n):
            _unstall(fs, n)
            watch.idle_since, reset_done = n, True
        for r in arrivals.get(n, ()):
            s.add_request(r)
        for req_id in aborts.get(n, ()):
            _abort(fs, req_id)
        if (reset_every and n % reset_every == reset_every - 1 and n <= last_event
                and not reset_done):
            _reset(fs, connector=rng.random() < p_connector_reset, running=rng.random() < 0.5)
        if n >= last_event and not s.has_work():
            break
        if n >= max_steps:
            raise RuntimeError(f"still busy after {max_steps} steps")
        s.step()
        if on_step is not None:
            on_step(n)
    return s.step_no - start


# ---------------------------------------------------------------------------
# Checks after the drain, and the whole scenario
# ---------------------------------------------------------------------------


def drain_and_check(fs: FaultSession) -> None:
    """Leak checks after the drain and after a final connector reset; counted into ``fs.stats``."""
    st_ = fs.stats
    leaks = leak_report(fs.session, fs.worker, fs.baseline_free)
    cs = fs.session.connector_scheduler
    st_.lost_store_jobs_retained += len(set(fs.worker.lost) & set(cs._jobs))
    chunks = manager_chunks(cs.manager) or {}
    for key in fs.worker.lost_keys:
        st_.lost_store_keys_checked += 1
        chunk = chunks.get(key)
        if chunk is not None and chunk.is_ready:
            st_.failed_store_loaded += 1
            st_.fail(f"key {key.hex()[:16]} of a lost store is ready (loadable)")
    leaks += final_reset_report(fs.session, fs.worker, fs.baseline_free)
    st_.leaks += len(leaks)
    for text in leaks:
        st_.fail(f"leak: {text}")


def run_fault_scenario(sc: FaultScenario, driver: Any | None = None) -> FaultStats:
    """Play the scenario's random workload through the faulty data path; the stats it counted."""
    driver = driver or scenario_driver(sc)
    sc = sc.scaled()
    fs = fault_session(driver, sc.plan, budget=sc.budget)
    rng = random.Random(sc.plan.seed + 1)
    play(fs, scenario_requests(sc, rng), rng=rng, p_abort=sc.p_abort, reset_every=sc.reset_every,
         p_connector_reset=sc.p_connector_reset, max_steps=sc.max_steps)
    drain_and_check(fs)
    return fs.stats
