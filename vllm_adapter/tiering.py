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

The region's ``/dev/shm`` name (``vllm_offload_<engine_id>.mmap``) is unlinked as
soon as every opener has mapped it (:func:`region_mapped`), so an engine killed
with ``SIGKILL`` leaves no region behind: a mapping outlives its name, and the
kernel frees the memory with the last mapping.  vLLM's ``CPUOffloadingSpec``
does the same with a barrier of its workers; ``TieringOffloadingSpec`` (0.33.0
and 0.34.0) never unlinks while the engine runs (deviation
``tiering-region-outlives-sigkill``).  Its openers are the scheduler side
(``get_manager``, opener 0) and each worker (``create_worker``, opener
``1 + rank``).  vLLM's engine core maps the workers' first (every worker
registers its KV caches before the scheduler is built), kvchunk's driver the
scheduler side's first.  An opener that maps before another must keep the name
(a later opener that found none would create a second region), so the last
opener, whichever it is, unlinks it.  Each opener holds an open-file-description
lock on byte ``opener`` of the region file (released by the kernel when its
process dies) and, once it holds its own, checks the others'.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
from typing import Any

import torch

from vllm_adapter import vllm_api as V
from vllm_adapter.spec import NUM_CPU_CHUNKS, ReferenceOffloadingWorker, _count, transfer_layout

__all__ = [
    "SCHEDULER_OPENER",
    "RegionOffloadingWorker",
    "ReferenceTieringOffloadingSpec",
    "region_mapped",
    "region_pool",
    "worker_opener",
]

SCHEDULER_OPENER = 0
"""The scheduler side's opener number (its lock byte in the region file)."""

_FLOCK = struct.Struct("hhqqi4x")
"""Linux ``struct flock`` (64-bit ``off_t``): type, whence, start, len, pid."""


def worker_opener(rank: int) -> int:
    """The opener number (lock byte) of the worker of engine rank ``rank``."""
    return 1 + rank


def _lock(fd: int, command: int, lock_type: int, byte: int) -> int:
    """``fcntl`` one open-file-description byte lock; the lock type it answers."""
    answer = fcntl.fcntl(fd, command, _FLOCK.pack(lock_type, os.SEEK_SET, byte, 1, 0))
    return int(_FLOCK.unpack(answer)[0])


def region_mapped(region: Any, *, opener: int, openers: int) -> bool:
    """Record that ``opener`` (of ``openers``) has mapped ``region``; unlink its name once all have.

    Each opener takes a shared lock on byte ``opener`` of the region file through
    the region's own descriptor: it lasts while the region is open, and the
    kernel drops it when the process dies, however it dies.  Once an opener holds
    its lock it looks for the others'; if every one is held, every opener has
    mapped the file, and its name (with any segment files) is unlinked.  Two
    openers finishing at once may both unlink: the second finds nothing.  An
    opener missing (a worker on another node, a driver without workers) keeps
    the name, as vLLM does.  True when this call unlinked the name.
    """
    if not 0 <= opener < openers:
        raise ValueError(f"opener {opener} is not one of the region's {openers} openers")
    fd = getattr(region, "fd", None)
    if fd is None or not hasattr(fcntl, "F_OFD_SETLK"):
        return False  # a closed region, or no open-file-description locks (not Linux)
    _lock(fd, fcntl.F_OFD_SETLK, fcntl.F_RDLCK, opener)
    for other in range(openers):
        if other != opener and _lock(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, other) == fcntl.F_UNLCK:
            return False
    _unlink_region(str(region.mmap_path))
    return True


def _unlink_region(path: str) -> None:
    """Unlink a region's file and its segment files (``<path>.1``, ``<path>.2``, ...)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    segment = 1
    while os.path.exists(f"{path}.{segment}"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{path}.{segment}")
        segment += 1


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

    @property
    def region_openers(self) -> int:
        """How many openers map the region: the scheduler side and each worker."""
        return 1 + int(self.config.parallel.world_size)

    def get_manager(self) -> Any:
        """vLLM's ``TieringOffloadingManager``; its region's name goes once every opener mapped it."""
        if self._manager is not None:
            return self._manager
        manager = super().get_manager()
        region = V.scheduler_region(self)
        if region is not None:
            region_mapped(region, opener=SCHEDULER_OPENER, openers=self.region_openers)
        return manager

    def create_worker(self, kv_caches: Any) -> Any:
        """vLLM's ``CPUOffloadingWorker`` on CUDA; the region-backed reference worker elsewhere.

        Either way, the region's name goes once every opener has mapped it.
        """
        on_cuda = all(t.tensor.device.type == "cuda" for t in kv_caches.tensors)
        if on_cuda and V.cuda_offloading_platform():
            worker = super().create_worker(kv_caches)
            region = V.worker_region(worker)
        else:
            worker = self._reference_worker(kv_caches)
            region = worker.region
        if region is not None:
            opener = worker_opener(int(self.config.parallel.rank))
            region_mapped(region, opener=opener, openers=self.region_openers)
        return worker

    def _reference_worker(self, kv_caches: Any) -> RegionOffloadingWorker:
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
