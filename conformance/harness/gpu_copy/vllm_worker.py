"""vLLM's own objects for the gpu_copy lane: canonical KV caches, the CPU spec, its worker."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch

from conformance.harness import vllm_harness_api as V
from vllm_adapter.names import CPU_SPEC, KVCHUNK_CONNECTOR

from .tiers import RegionTier, TensorsTier, Tier, VllmCpuLayout

__all__ = [
    "canonical_kv_caches",
    "cpu_offloading_spec",
    "create_vllm_worker",
    "vllm_worker_tier",
]


class _CaptureSpec:
    """Stands in for an OffloadingSpec: keeps the ``CanonicalKVCaches`` vLLM's worker builds."""

    replicated_layout = False

    def __init__(self) -> None:
        self.config = SimpleNamespace(canonical_layout=False, parallel=SimpleNamespace(rank=0))
        self.kv_caches: Any = None

    def get_worker(self, kv_caches: Any) -> None:
        self.kv_caches = kv_caches


def canonical_kv_caches(
    vllm_config: Any, kv_cache_config: Any, kv_caches: dict[str, torch.Tensor]
) -> Any:
    """``CanonicalKVCaches`` exactly as ``OffloadingConnectorWorker.register_kv_caches`` builds them.

    vLLM's own ``register_kv_caches`` runs over ``kv_caches`` (layer name ->
    tensor, any device) with a stand-in spec whose ``get_worker`` keeps its
    argument; ``kv_cache_config`` is the worker view.
    """
    spec = _CaptureSpec()
    V.OffloadingConnectorWorker(spec, vllm_config, kv_cache_config).register_kv_caches(kv_caches)
    if spec.kv_caches is None:  # pragma: no cover - vLLM always builds a worker
        raise RuntimeError("register_kv_caches built no worker")
    return spec.kv_caches


def cpu_offloading_spec(
    vllm_config: Any,
    kv_cache_config: Any,
    num_chunks: int,
    *,
    rank: int | None = None,
    engine_id: str | None = None,
) -> Any:
    """A real ``CPUOffloadingSpec`` with exactly ``num_chunks`` chunk slots.

    Its ``OffloadingConfig`` is vLLM's ``build_offloading_config`` of the
    (kvchunk-translated, if the config names ``KvchunkOffloadingConnector``)
    ``vllm_config`` and the worker-view ``kv_cache_config``, with
    ``cpu_bytes_to_use`` set to ``num_chunks`` rows, the worker ``rank``
    replaced when given, and a fresh ``engine_id`` (the ``/dev/shm`` file name).
    Building it needs no GPU; only its ``create_worker`` does.
    """
    from vllm_adapter.connector import translate_extra_config

    if vllm_config.kv_transfer_config.kv_connector == KVCHUNK_CONNECTOR:
        vllm_config = translate_extra_config(vllm_config, kv_cache_config)
    config = V.build_offloading_config(vllm_config, kv_cache_config)
    parallel = config.parallel
    if rank is not None:
        if not 0 <= rank < parallel.world_size:
            raise ValueError(f"rank {rank} outside world size {parallel.world_size}")
        parallel = dataclasses.replace(parallel, rank=rank)
    extra = dict(config.extra_config)
    extra["spec_name"] = CPU_SPEC
    extra.pop("spec_module_path", None)
    extra["cpu_bytes_to_use"] = 1 << 50
    config = dataclasses.replace(
        config,
        parallel=parallel,
        engine_id=engine_id or f"kvchunk-gpu-copy-{uuid.uuid4().hex[:12]}",
        extra_config=extra,
    )
    probe = V.CPUOffloadingSpec(config)
    if probe.kv_bytes_per_chunk <= 0:
        raise ValueError("CPUOffloadingSpec sized no chunk (worker_kv_bytes_per_block is 0)")
    extra = {**extra, "cpu_bytes_to_use": int(num_chunks) * int(probe.kv_bytes_per_chunk)}
    spec = V.CPUOffloadingSpec(dataclasses.replace(config, extra_config=extra))
    assert spec.num_chunks == num_chunks, (spec.num_chunks, num_chunks)
    return spec


def create_vllm_worker(spec: Any, kv_caches: Any, *, shared_region: bool = True) -> Any:
    """vLLM's ``CPUOffloadingWorker`` (CUDA only) as ``CPUOffloadingSpec`` builds it.

    ``shared_region=True``: ``spec.create_worker`` unchanged, with the
    cross-worker barrier (a collective over vLLM's world group, which this
    single process does not have) replaced by a no-op for the call; the region
    file is then unlinked by the worker's ``shutdown``.  ``False``: the
    private pinned-tensor path (``mmap_region=None``).
    """
    if not shared_region:
        return V.CPUOffloadingWorker(
            kv_caches=kv_caches,
            blocks_per_chunk=spec.blocks_per_chunk,
            num_cpu_chunks=spec.num_chunks,
        )
    module = V.cpu_offloading_spec_module
    saved = module._all_workers_barrier
    module._all_workers_barrier = lambda: None
    try:
        return spec.create_worker(kv_caches)
    finally:
        module._all_workers_barrier = saved


def vllm_worker_tier(worker: Any, spec: Any, page_bytes: Sequence[int]) -> tuple[Tier, list[str]]:
    """The CPU tier of a real (or emulated) vLLM worker, and layout problems found.

    With a shared region: a :class:`RegionTier` over the whole region under
    :meth:`VllmCpuLayout.for_spec`, and the worker's own CPU views checked
    against it.  Without: a :class:`TensorsTier` over its private tensors.
    """
    views = V.cpu_worker_views(worker)
    region = getattr(worker, "_mmap_region", None)
    if region is None:
        return TensorsTier(views, page_bytes, int(spec.blocks_per_chunk)), []
    layout = VllmCpuLayout.for_spec(spec, page_bytes)
    problems = []
    if region._row_stride != layout.row_stride:
        problems.append(f"region row stride {region._row_stride}, layout says {layout.row_stride}")
    tier = RegionTier(region.base_tensor, layout)
    return tier, problems + tier.check_views(views)
