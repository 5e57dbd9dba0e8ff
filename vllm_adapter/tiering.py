"""``ReferenceTieringOffloadingSpec``: vLLM's tiered offloading with the reference's byte copies.

Selected like any out-of-tree offloading spec::

    "kv_connector_extra_config": {
        "spec_name": "ReferenceTieringOffloadingSpec",
        "spec_module_path": "vllm_adapter.tiering",
        "cpu_bytes_to_use": <bytes>,     # as TieringOffloadingSpec (required by it)
        "num_cpu_chunks": 8,             # optional: CPU chunk count, wins over the bytes
        "secondary_tiers": [{"type": "fs", "root_dir": "/path"}]
    }

Scheduler side: everything is vLLM's ``TieringOffloadingSpec`` -- its
``TieringOffloadingManager``, the CPU primary tier
(``CPUPrimaryTierOffloadingManager``) over the scheduler's ``SharedOffloadRegion``
view, the secondary tiers (the file-system tier: ``FileMapper`` names,
``batch_store_block`` / ``batch_load_block``, ``DualQueueThreadPool``) reading
and writing that region's rows.

Worker side (:meth:`ReferenceTieringOffloadingSpec.create_worker`): where
vLLM's ``CPUOffloadingWorker`` runs (CUDA), vLLM's own worker; elsewhere (it
refuses non-CUDA platforms) a :class:`RegionOffloadingWorker`: the reference
transfer (:class:`vllm_adapter.spec.ReferenceOffloadingWorker`) whose pool is
this worker's part of the same ``SharedOffloadRegion``, in vLLM's layout -- row
``c`` is chunk ``c`` (``kv_bytes_per_chunk`` bytes, rounded up to
``BLOCK_SIZE_ALIGNMENT``, every rank's slots interleaved), this rank's slot at
``rank * cpu_page_size_per_worker`` (0 for the replicated layout).  So the
bytes the reference gathers are the bytes the file tier writes to disk, and the
bytes it promotes from disk are the bytes the reference scatters back.

``num_cpu_chunks`` (optional) sets the CPU tier's chunk count directly (the
region and the manager alike), as :class:`~vllm_adapter.spec.ReferenceOffloadingSpec`
does, so a test can size the tier in chunks; without it the count is
``TieringOffloadingSpec``'s (``cpu_bytes_to_use // kv_bytes_per_chunk``).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_adapter import vllm_api as V
from vllm_adapter.spec import NUM_CPU_CHUNKS, ReferenceOffloadingWorker, _count, transfer_layout

__all__ = ["RegionOffloadingWorker", "ReferenceTieringOffloadingSpec", "region_pool"]


def region_pool(
    base: torch.Tensor, *, num_chunks: int, row_stride: int, worker_offset: int, slot_bytes: int
) -> torch.Tensor:
    """One worker's chunk slots in vLLM's shared region: a uint8 ``[num_chunks, slot_bytes]`` view.

    Row ``c`` starts at ``c * row_stride + worker_offset`` of the flat region
    ``base`` (no copy: writes go to the region).
    """
    if worker_offset + slot_bytes > row_stride:
        raise ValueError(
            f"the worker's slot [{worker_offset}, {worker_offset + slot_bytes}) does not fit "
            f"a {row_stride}-byte region row"
        )
    flat = base.view(torch.uint8)
    if flat.numel() < num_chunks * row_stride:
        raise ValueError(
            f"the region has {flat.numel()} bytes, {num_chunks} rows of {row_stride} need more"
        )
    return flat.as_strided(
        (num_chunks, slot_bytes), (row_stride, 1), flat.storage_offset() + worker_offset
    )


class RegionOffloadingWorker(ReferenceOffloadingWorker):
    """The reference worker over this rank's slots of a ``SharedOffloadRegion`` (which it owns)."""

    def __init__(self, kv_caches: Any, blocks_per_chunk: int, region: Any, rank: int) -> None:
        slot_bytes = transfer_layout(kv_caches, blocks_per_chunk).slot_bytes
        cpu_page_size = int(region.cpu_page_size)
        if slot_bytes > cpu_page_size:
            raise ValueError(
                f"the canonical tensors need {slot_bytes} bytes per chunk, more than the "
                f"{cpu_page_size} bytes per worker (cpu_page_size_per_worker) the region has"
            )
        pool = region_pool(
            region.base_tensor,
            num_chunks=int(region.num_chunks),
            row_stride=int(region.total_size_bytes) // max(1, int(region.num_chunks)),
            worker_offset=rank * cpu_page_size,
            slot_bytes=slot_bytes,
        )
        super().__init__(kv_caches, blocks_per_chunk, int(region.num_chunks), pool=pool)
        self.region = region
        """vLLM's ``SharedOffloadRegion`` (worker side) whose bytes :attr:`pool` views."""

    def shutdown(self) -> None:
        super().shutdown()
        del self.pool  # the region's mapping can close only once no view exports it
        self.region.cleanup()


class ReferenceTieringOffloadingSpec(V.TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec``; the GPU<->CPU worker is the reference without CUDA."""

    _worker: Any
    """The worker :meth:`get_worker` built (``None`` until then; set by vLLM's base spec)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if self.extra_config.get(NUM_CPU_CHUNKS) is not None:
            self.num_chunks = _count(NUM_CPU_CHUNKS, self.extra_config[NUM_CPU_CHUNKS])
            self.cpu_info = V.CPUOffloadingInfo.from_config(
                config, self.num_chunks, self.kv_bytes_per_chunk
            )

    def _region(self) -> tuple[Any, int]:
        """The worker-side ``SharedOffloadRegion`` and this worker's rank slot in each row."""
        rank = 0 if self.replicated_layout else int(self.config.parallel.rank)
        region = V.SharedOffloadRegion(
            engine_id=self.config.engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        return region, rank

    def create_worker(self, kv_caches: Any) -> Any:
        """vLLM's ``CPUOffloadingWorker`` on CUDA; the region-backed reference worker elsewhere."""
        on_cuda = all(t.tensor.device.type == "cuda" for t in kv_caches.tensors)
        if on_cuda and V.cuda_offloading_platform():
            return super().create_worker(kv_caches)
        if self.config.canonical_layout:
            raise ValueError(
                "ReferenceTieringOffloadingSpec implements vLLM's direct CPU layout only; "
                "remove 'canonical_layout' from kv_connector_extra_config"
            )
        region, rank = self._region()
        try:
            return RegionOffloadingWorker(kv_caches, self.blocks_per_chunk, region, rank)
        except Exception:
            region.cleanup()
            raise

    def get_worker(self, kv_caches: Any) -> Any:
        """The worker of :meth:`create_worker`, built once (no CUDA-only platform check)."""
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker
