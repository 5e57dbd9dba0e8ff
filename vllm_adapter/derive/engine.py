"""Stand-ins for the parts of a GPU engine the derivation cannot build on CPU.

* :func:`collect_runner_specs`: the GPU model runner's own ``get_kv_cache_spec``
  over the layers registered in ``static_forward_context`` (no runner is built);
* :class:`StandInExecutor` / :class:`StandInEngineCore`: answer the calls vLLM's
  unmodified ``EngineCore._initialize_kv_caches`` makes, reporting the same
  per-layer specs for every TP rank and an assumed per-GPU KV budget
  (:func:`initialize_kv_caches`);
* :func:`plan_until_resolution`: the engine core's planning calls up to the one
  that rejected a geometry, to store the plan vLLM had made by then.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from vllm_adapter import vllm_tools_api as V

__all__ = [
    "StandInEngineCore",
    "StandInExecutor",
    "WorkerReport",
    "collect_runner_specs",
    "current_config",
    "customize_attention_spec",
    "initialize_kv_caches",
    "plan_until_resolution",
]


@contextlib.contextmanager
def current_config(vllm_config: Any) -> Iterator[None]:
    """vLLM's ``set_current_vllm_config`` (layer constructors and planning read it)."""
    with V.set_current_vllm_config(vllm_config):
        yield


def customize_attention_spec(backend: Any, spec: Any) -> Any:
    """The runner's ``customize_attention_spec`` (backend packing + kernel-block alignment)."""
    return V.load_runner_api().customize_attention_spec(backend, spec)


def collect_runner_specs(vllm_config: Any) -> tuple[dict[str, Any], str]:
    """The GPU model runner's own ``get_kv_cache_spec`` over ``static_forward_context``."""
    api = V.load_runner_api()
    if V.uses_v2_model_runner(vllm_config):
        return api.v2_get_kv_cache_spec(
            vllm_config
        ), "v2 (vllm.v1.worker.gpu.attn_utils.get_kv_cache_spec)"
    runner = SimpleNamespace(vllm_config=vllm_config, shared_kv_cache_layers={})
    return api.v1_runner_cls().get_kv_cache_spec(runner), "v1 (GPUModelRunner.get_kv_cache_spec)"


@dataclass(frozen=True)
class WorkerReport:
    """What every TP rank's worker reports to the engine core (all ranks alike)."""

    specs: dict[str, Any]
    """Per-layer ``KVCacheSpec``, in layer order."""
    layouts: list[str]
    """Supported KV-cache layouts."""
    tensor_parallel_size: int
    kv_budget_bytes_per_gpu: int

    def specs_per_rank(self) -> list[dict[str, Any]]:
        return [dict(self.specs) for _ in range(self.tensor_parallel_size)]


class StandInExecutor:
    """Answers the executor calls ``EngineCore._initialize_kv_caches`` makes."""

    def __init__(self, report: WorkerReport) -> None:
        self._report = report
        self.worker_kv_cache_configs: list[Any] | None = None
        self.layout_set: tuple[str, int] | None = None

    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        return self._report.specs_per_rank()

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [list(self._report.layouts) for _ in range(self._report.tensor_parallel_size)]

    def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int) -> None:
        self.layout_set = (layout_name, cp_kv_cache_interleave_size)

    def determine_available_memory(self) -> list[int]:
        return [self._report.kv_budget_bytes_per_gpu] * self._report.tensor_parallel_size

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        self.worker_kv_cache_configs = kv_cache_configs

    def compile_or_warm_up_model(self) -> None:
        return None


class StandInEngineCore:
    """The ``self`` that ``EngineCore._initialize_kv_caches`` is called with."""

    def __init__(self, executor: StandInExecutor) -> None:
        self.model_executor = executor
        self.available_gpu_memory_for_kv_cache = -1

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        return []


def initialize_kv_caches(vllm_config: Any, report: WorkerReport) -> tuple[Any, list[Any]]:
    """vLLM's ``EngineCore._initialize_kv_caches``, unmodified, on the stand-in engine core.

    Returns the scheduler-view ``KVCacheConfig`` and the one handed to each rank's
    worker; raises what vLLM raises (``ValueError`` for a geometry it refuses).
    """
    executor = StandInExecutor(report)
    with current_config(vllm_config):
        scheduler = V.EngineCore._initialize_kv_caches(StandInEngineCore(executor), vllm_config)
    workers = executor.worker_kv_cache_configs
    assert workers is not None and len(workers) == report.tensor_parallel_size
    return scheduler, list(workers)


def plan_until_resolution(vllm_config: Any, report: WorkerReport) -> tuple[Any, list[Any]]:
    """The engine core's planning calls that precede ``resolve_kv_cache_block_sizes``."""
    tp = report.tensor_parallel_size
    specs_per_rank = report.specs_per_rank()
    with current_config(vllm_config):
        V.resolve_kv_cache_layout(
            vllm_config,
            [list(report.layouts)] * tp,
            [s for d in specs_per_rank for s in d.values()],
        )
        groups = V.get_global_kv_cache_groups(vllm_config, specs_per_rank)
        configs = V.get_kv_cache_configs(
            vllm_config, specs_per_rank, [report.kv_budget_bytes_per_gpu] * tp, groups
        )
        for cfg in configs:
            cfg.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
        sched = V.generate_scheduler_kv_cache_config(configs)
        participating = [
            g.kv_cache_spec.block_size
            for g in sched.kv_cache_groups
            if g.kv_cache_spec.prefix_cacheable
        ]
        vllm_config.cache_config.block_size = min(
            participating or [g.kv_cache_spec.block_size for g in sched.kv_cache_groups]
        )
    return sched, configs
