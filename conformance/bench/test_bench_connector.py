"""Connector overhead: scheduler step wall time, kvchunk's connector vs vLLM's stock one.

Both run vLLM 0.33.0's real ``Scheduler`` on the fixture's scheduler-view
``KVCacheConfig`` (``GPU_BLOCKS`` blocks) with ``{"blocks_per_chunk": B}``,
through :class:`conformance.vllm_driver.DriverSession` (the connector's real
worker half over the driver's emulated transfer engine, jobs done at once):
``OffloadingConnector`` vs ``KvchunkOffloadingConnector``
(``kv_connector_module_path="vllm_adapter.connector"``), same CPU tier size,
same requests (:func:`workload_phases`: shared-prefix prompts prefilled in
chunks, a GPU prefix-cache reset, repeats loaded from the CPU tier; sized to
the longest chunk span).  The two must make
the same decisions (same steps, same dispatched jobs; checked).  "No connector"
is the same requests on a Scheduler without ``kv_transfer_config``
(informational: more steps, no offloading work).

A run takes tens of milliseconds, about as long as another job on a shared
2-core runner can hold the CPU, so the ratio is that of the fastest of
``ROUNDS`` runs of each (noise only ever adds time; the two connectors run the
same code after ``__init__``, so the true ratio is 1).  The median of the
per-round ratios is recorded too (``ratio_median``).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from typing import Any

import pytest

from conformance.bench import (
    CASES,
    GEOMETRIES,
    Variant,
    case_id,
    env_int,
    measure,
    record,
    rounded,
)

pytest.importorskip("vllm")

from conformance import vllm_driver as D  # noqa: E402
from conformance.trace import RequestSpec  # noqa: E402
from vllm_adapter import fixtures as fx  # noqa: E402
from vllm_adapter import vllm_api as V  # noqa: E402

GPU_BLOCKS = 8192
CPU_CHUNKS = 4096
ROUNDS = env_int("KVCHUNK_BENCH_CONNECTOR_ROUNDS", 15)
"""Runs are short (tens of ms): more rounds, and the ratio of the fastest runs (see module doc)."""
STOCK = ("OffloadingConnector", None)
KVCHUNK = ("KvchunkOffloadingConnector", "vllm_adapter.connector")


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, 30000) for _ in range(n))


def workload_phases(unit: int, seed: int = 0) -> list[list[RequestSpec]]:
    """Two phases of requests (a GPU prefix-cache reset between them), sized in ``unit`` tokens.

    ``unit`` is at least the longest chunk span, so every group stores chunks
    and the repeats of phase 2 load some; the step budget is ``unit`` tokens,
    so prompts take several prefill steps at any chunk size.
    """
    rng = random.Random(seed)
    prefix = _tokens(rng, 2 * unit)
    a = prefix + _tokens(rng, unit // 2)
    b = prefix + _tokens(rng, 3 * unit // 4)
    c = prefix[:unit] + _tokens(rng, unit)
    d = _tokens(rng, 3 * unit // 2)
    return [
        [RequestSpec(n, p, max_tokens=8) for n, p in (("a", a), ("b", b), ("c", c), ("d", d))],
        [
            RequestSpec("a2", a + _tokens(rng, unit // 4), max_tokens=8),
            RequestSpec("d2", d, max_tokens=8),
            RequestSpec("e", _tokens(rng, unit), max_tokens=8),
        ],
    ]


def run_workload(session: Any, phases: list[list[RequestSpec]]) -> int:
    """Play ``phases`` on ``session``; the steps it took."""
    for i, phase in enumerate(phases):
        if i:
            session.reset_prefix_cache()
        for spec in phase:
            session.add_request(spec)
        session.run_until_idle()
    return int(session.step_no)


class PlainSession:
    """:class:`~conformance.vllm_driver.DriverSession`'s stepping on a Scheduler with no connector."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
        sched_block, hash_block = V.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
        self.scheduler = V.Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=V.StructuredOutputManager(vllm_config),
            block_size=sched_block,
            hash_block_size=hash_block,
            log_stats=False,
        )
        hash_fn = V.get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        V.init_none_hash(hash_fn)
        self._hasher = V.get_request_block_hasher(
            hash_block, hash_fn, vllm_config.num_hash_lookahead_tokens
        )
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.step_no = 0

    def add_request(self, spec: RequestSpec) -> None:
        params = V.SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)
        self.scheduler.add_request(
            V.Request(
                request_id=spec.req_id,
                prompt_token_ids=list(spec.prompt),
                sampling_params=params,
                pooling_params=None,
                block_hasher=self._hasher,
            )
        )

    def reset_prefix_cache(self) -> bool:
        return bool(self.scheduler.reset_prefix_cache())

    def step(self) -> None:
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            req_ids = list(so.num_scheduled_tokens)
            sampled = []
            for req_id in req_ids:
                req = self.scheduler.requests[req_id]
                token = D.sampled_token(req_id, req.num_tokens, self.vocab_size)
                sampled.append([] if req.is_prefill_chunk else [token])
            out = V.model_runner_output(req_ids, sampled, None)
            self.scheduler.update_from_output(so, out)
        self.step_no += 1

    def run_until_idle(self) -> None:
        while self.scheduler.has_unfinished_requests() or self.scheduler.finished_req_ids:
            self.step()


def _scheduler_config(vllm_config: Any, budget: int) -> None:
    sc = copy.copy(vllm_config.scheduler_config)
    sc.async_scheduling = False
    sc.max_num_batched_tokens = budget
    sc.max_num_encoder_input_tokens = budget
    sc.encoder_cache_size = budget
    vllm_config.scheduler_config = sc
    vllm_config.cache_config.num_gpu_blocks = GPU_BLOCKS


def _kv_cache_config(data: Any) -> Any:
    kvc = fx.rebuild_kv_cache_config(data, "scheduler")
    kvc.num_blocks = GPU_BLOCKS
    return kvc


def unit_tokens(data: Any, blocks_per_chunk: int) -> int:
    """The workload unit: the longest chunk span of any group, at least 1024 tokens."""
    groups = _kv_cache_config(data).kv_cache_groups
    span = max(g.kv_cache_spec.block_size for g in groups) * blocks_per_chunk
    return max(1024, span)


def drivers(
    name: str, blocks_per_chunk: int
) -> tuple[D.VllmDriver, D.VllmDriver, Callable[[], PlainSession], int]:
    """Stock and kvchunk drivers (same CPU tier, ``CPU_CHUNKS`` chunks), a plain-session factory, the unit."""
    data = fx.load_fixture(name)
    unit = unit_tokens(data, blocks_per_chunk)
    extra = {"blocks_per_chunk": blocks_per_chunk}
    probe_config = fx.make_vllm_config(data, extra)
    probe = V.CPUOffloadingSpec(V.build_offloading_config(probe_config, _kv_cache_config(data)))
    cpu_bytes = int(probe.kv_bytes_per_chunk) * CPU_CHUNKS
    out = []
    for connector, module in (STOCK, KVCHUNK):
        vc = fx.make_vllm_config(
            data, extra, connector=connector, connector_module_path=module, cpu_bytes=cpu_bytes
        )
        _scheduler_config(vc, unit)
        out.append(D.VllmDriver(_kv_cache_config(data), vc))
    plain_config, _ = fx.engine_vllm_config(fx.model_dir_path(data), data["engine_args"], None)
    plain_config.cache_config.cache_dtype = data["resolved"]["cache_dtype"]
    plain_config.cache_config.block_size = data["resolved"]["cache_config_block_size"]
    _scheduler_config(plain_config, unit)
    return out[0], out[1], lambda: PlainSession(plain_config, _kv_cache_config(data)), unit


def _jobs(session: Any) -> list[tuple[Any, ...]]:
    return [
        (j.step, j.kind, j.block_ids, j.group_sizes, j.block_indices, j.cpu_chunk_ids)
        for j in session.dispatched
    ]


@pytest.mark.parametrize("geometry,blocks_per_chunk", CASES, ids=[case_id(c) for c in CASES])
def test_connector_step_time(benchmark: Any, geometry: str, blocks_per_chunk: int) -> None:
    stock, kvchunk, plain, unit = drivers(geometry, blocks_per_chunk)
    phases = workload_phases(unit)

    def run(session: Any) -> int:
        return run_workload(session, phases)

    # Same decisions first: identical steps and dispatched jobs.
    s_stock, s_kvchunk = stock.session(record=False), kvchunk.session(record=False)
    steps = run(s_stock)
    assert run(s_kvchunk) == steps
    jobs = _jobs(s_stock)
    assert _jobs(s_kvchunk) == jobs, "the two connectors dispatched different jobs"
    assert type(s_kvchunk.connector).__name__ == "KvchunkOffloadingConnector"
    loads = sum(1 for j in jobs if j[1] == "load")
    stores = len(jobs) - loads
    assert loads and stores, f"the workload must store and load (stores {stores}, loads {loads})"
    plain_steps = run(plain())

    m = measure(
        benchmark,
        Variant(run, lambda: kvchunk.session(record=False)),
        {
            "stock": Variant(run, lambda: stock.session(record=False)),
            "none": Variant(run, plain),
        },
        rounds=ROUNDS,
    )
    # Per-step times of the fastest runs: the no-connector run takes a different number of steps.
    per_step = {
        "kvchunk": min(m.candidate) / steps,
        "stock": min(m.baselines["stock"]) / steps,
        "none": min(m.baselines["none"]) / plain_steps,
    }
    record(
        benchmark,
        kind="connector",
        geometry=geometry,
        label=GEOMETRIES[geometry],
        blocks_per_chunk=blocks_per_chunk,
        unit_tokens=unit,
        steps=steps,
        steps_no_connector=plain_steps,
        store_jobs=stores,
        load_jobs=loads,
        ratio=m.min_ratio("stock", speed=False),
        ratio_median=m.ratio("stock", speed=False),
        ratio_stock_vs_none=per_step["stock"] / per_step["none"],
        ratio_kvchunk_vs_none=per_step["kvchunk"] / per_step["none"],
        step_ms={k: round(1e3 * v, 4) for k, v in per_step.items()},
        candidate_s=rounded(m.candidate),
        baseline_s={k: rounded(v) for k, v in m.baselines.items()},
    )
