"""Hypothesis strategies for plan-lane workloads and the configs they run on."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from hypothesis import strategies as st

from conformance.protocol import trace as T


@dataclass(frozen=True)
class PlanCase:
    """A geometry x knob x retention the plan lane runs random workloads on."""

    fixture: str
    knob: str
    builder: str
    builder_args: tuple[Any, ...]
    extra_config: tuple[tuple[str, Any], ...]
    retention: int | None
    num_gpu_blocks: int = 1024
    num_cpu_chunks: int = 64
    max_len: int = 520
    """Longest shared prefix drawn; 512-token chunks need longer prompts to hit."""

    def __str__(self) -> str:
        tier = f"/cpu={self.num_cpu_chunks}" if self.num_cpu_chunks != 64 else ""
        return f"{self.fixture}/{self.knob}/retention={self.retention}{tier}"


@lru_cache(maxsize=64)
def driver_for(case: PlanCase) -> Any:
    from conformance.harness import driver as D

    if case.builder == "fixture":
        from conformance.harness.fixture_runs import fixture_driver

        name, connector, module = case.builder_args
        return fixture_driver(
            name,
            dict(case.extra_config),
            num_gpu_blocks=case.num_gpu_blocks,
            num_cpu_chunks=4096,
            connector=connector,
            connector_module_path=module,
        )
    kvc = getattr(D, case.builder)(*case.builder_args, num_blocks=case.num_gpu_blocks)
    return D.VllmDriver.from_kv_cache_config(
        kvc,
        extra_config=dict(case.extra_config),
        prefix_cache_retention_interval=case.retention,
        num_gpu_blocks=case.num_gpu_blocks,
        num_cpu_chunks=case.num_cpu_chunks,
    )


@st.composite
def workloads(draw: st.DrawFn, max_requests: int = 4, max_len: int = 520) -> T.WorkloadSpec:
    base = draw(st.lists(st.integers(0, 30), min_size=max_len, max_size=max_len))
    n = draw(st.integers(1, max_requests))
    requests = []
    for i in range(n):
        cut = draw(st.integers(0, max_len))
        tail = draw(st.lists(st.integers(31, 60), max_size=80))
        prompt = tuple(base[:cut]) + tuple(tail)
        if not prompt:
            prompt = (1,)
        requests.append(
            T.RequestSpec(
                f"r{i}",
                prompt,
                max_tokens=draw(st.integers(1, 6)),
                arrival_step=draw(st.integers(0, 12)),
            )
        )
    # Early resets clear only the GPU prefix cache.  A connector reset while requests
    # run triggers vLLM bug "connector-reset-stale-swa-blocks" (deviations/vllm.toml,
    # reproduced as a strict xfail in the faults lane), which would mask everything
    # else; connector resets happen at the late reset, once the early requests are done.
    resets = tuple(
        T.ResetSpec(step=s, reset_connector=False)
        for s in sorted(draw(st.sets(st.integers(1, 20), max_size=2)))
    )
    if draw(st.integers(0, 3)):
        # Most workloads end with a repeat after a GPU-only prefix-cache reset, so the
        # offload tier (not the GPU cache) serves it: loads are exercised, not left to luck.
        late = 300
        source = draw(st.sampled_from(requests))
        extra = tuple(draw(st.lists(st.integers(61, 90), max_size=40)))
        requests.append(T.RequestSpec("repeat", source.prompt + extra, max_tokens=2,
                                      arrival_step=late + 1))
        resets += (T.ResetSpec(step=late, reset_connector=draw(st.integers(0, 3)) == 0),)
    aborts = tuple(
        T.AbortSpec(step=draw(st.integers(1, 15)), req_id=r.req_id)
        for r in requests
        if draw(st.integers(0, 5)) == 0
    )
    return T.WorkloadSpec(
        requests=tuple(requests),
        max_num_batched_tokens=draw(st.sampled_from((64, 96, 128, 256, 512, 2048))),
        resets=resets,
        aborts=aborts,
        default_delay_steps=draw(st.sampled_from((0, 0, 1, 2))),
    )
