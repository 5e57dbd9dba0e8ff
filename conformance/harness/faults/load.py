"""Load: >= 1,000 requests over a handful of shared documents through the faulty data path.

Small GPU and CPU pools, periodic GPU prefix-cache resets, jobs delayed at
random; the fault suite's checks, plus RSS and bookkeeping sizes sampled over
the run (memory must stay bounded).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import psutil

from conformance.harness.faults.scenarios import (
    FaultSession,
    drain_and_check,
    fault_session,
    play,
    random_tokens,
)
from conformance.harness.faults.worker import FaultPlan, FaultStats


def _rss_kib() -> int:
    """This process's resident set size, KiB."""
    return psutil.Process().memory_info().rss // 1024


@dataclass
class LoadReport:
    stats: FaultStats
    requests: int
    steps: int
    seconds: float
    rss_growth_kib: int
    """RSS at the end minus RSS a quarter into the run (after warm-up)."""
    peak_bookkeeping: dict[str, int]
    final_bookkeeping: dict[str, int]


def _bookkeeping(fs: FaultSession) -> dict[str, int]:
    s = fs.session
    cs = s.connector_scheduler
    policy = getattr(cs.manager, "_policy", None)
    return {
        "scheduler_requests": len(s.scheduler.requests),
        "connector_req_status": len(cs._req_status),
        "connector_jobs": len(cs._jobs),
        "connector_block_fences": len(cs._block_id_to_pending_jobs),
        "cpu_chunks_held": len(getattr(policy, "chunks", ())),
        "lru_ranks": len(getattr(policy, "_ranks", ())),
        "lru_heap": len(getattr(policy, "_heap", ())),
        "worker_pending": len(fs.worker.pending),
        "runner_hash_cache": len(fs.runner._hashes),
    }


def load_requests(num_requests: int, prompt_len: int, rng: random.Random, *, num_docs: int = 8,
                  per_step: int = 2) -> list[Any]:
    """Heavy prefix sharing: every prompt is a prefix of one of ``num_docs`` documents plus a
    short tail."""
    from conformance.protocol.trace import RequestSpec

    docs = [random_tokens(rng, prompt_len) for _ in range(num_docs)]
    out = []
    for i in range(num_requests):
        doc = docs[min(int(rng.expovariate(0.5)), num_docs - 1)]
        cut = rng.randint(prompt_len // 2, prompt_len)
        out.append(RequestSpec(f"q{i}", doc[:cut] + random_tokens(rng, rng.randint(1, 8)),
                               max_tokens=rng.randint(1, 3), arrival_step=i // per_step))
    return out


def run_load_trace(driver: Any, *, num_requests: int, prompt_len: int, plan: FaultPlan,
                   budget: int = 256, reset_every: int = 40) -> LoadReport:
    """``num_requests`` requests at capacity pressure through the data path, measured."""
    fs = fault_session(driver, plan, budget=budget, check_foreign=False)
    rng = random.Random(plan.seed + 7)
    requests = load_requests(num_requests, prompt_len, rng)
    peak: dict[str, int] = {}
    marks: dict[str, int] = {}
    quarter = requests[-1].arrival_step // 4

    def on_step(n: int) -> None:
        if n % 16 == 0:
            for k, v in _bookkeeping(fs).items():
                peak[k] = max(peak.get(k, 0), v)
            fs.session.dispatched.clear()  # the driver's own log of every job: not the system's
        if n == quarter:
            marks["rss"] = _rss_kib()

    start = time.perf_counter()
    steps = play(fs, requests, rng=rng, reset_every=reset_every, max_steps=100 * num_requests,
                 on_step=on_step)
    seconds = time.perf_counter() - start
    growth = _rss_kib() - marks.get("rss", _rss_kib())
    final = _bookkeeping(fs)
    drain_and_check(fs)
    return LoadReport(fs.stats, len(requests), steps, seconds, growth, peak, final)
