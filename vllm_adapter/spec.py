"""``ReferenceOffloadingSpec``: vLLM's CPU tier (0.33.0 and 0.34.0) with the reference's byte copies.

Selected like any out-of-tree offloading spec::

    "kv_connector_extra_config": {
        "spec_name": "ReferenceOffloadingSpec",
        "spec_module_path": "vllm_adapter.spec",
        "num_cpu_chunks": 64            # or "cpu_bytes_to_use": <bytes>
    }

Scheduler side (:meth:`ReferenceOffloadingSpec.get_manager`)
    vLLM's own ``CPUOffloadingManager`` (LRU or ARC, ``store_threshold``,
    ``max_tracker_size``, events), built exactly as ``CPUOffloadingSpec`` builds
    it.  Its chunk count is ``num_cpu_chunks`` when given (it wins over
    ``cpu_bytes_to_use``), else ``CPUOffloadingSpec``'s formula:
    ``cpu_bytes_to_use // round_up(worker_kv_bytes_per_block * world_size *
    blocks_per_chunk, BLOCK_SIZE_ALIGNMENT)`` -- so for the same extra config the
    manager hands out the same chunk ids as the stock CPU tier.

Worker side (:meth:`ReferenceOffloadingSpec.get_worker`)
    :class:`ReferenceOffloadingWorker`: the copies are
    :func:`reference.transfer_fast.gather` (store, GPU -> CPU) and
    :func:`reference.transfer_fast.scatter` (load, CPU -> GPU), the fast
    implementation of :mod:`reference.transfer`'s layout, over the canonical
    tensors vLLM's ``OffloadingConnectorWorker.register_kv_caches`` builds.  It
    runs on a CPU-only host with CPU "GPU" tensors (vLLM's ``CPUOffloadingWorker``
    refuses non-CUDA platforms) and on CUDA tensors (the pool is then pinned).
    Transfers run synchronously inside ``submit_*``; their results are reported
    by the next ``get_finished``.  The GPU side of a job arrives as vLLM's
    connector worker passes it: a ``GPULoadStoreSpec`` (0.33.0) or
    ``DevicePointers`` resolved over the same canonical tensors (0.34.0), turned
    back into block ids by ``vllm_api.gpu_blocks``.  0.34.0's store jobs may
    list the null block (id 0) as a placeholder, several times; its (zeroed)
    page is copied into the sub-slots it holds, as vLLM's worker does.

The mapping (:func:`transfer_layout`) mirrors ``CPUOffloadingWorker`` /
``SingleDirectionOffloadingHandler._fill_direct_ops`` (the direct layout):

* canonical tensor ``t`` (``CanonicalKVCaches.tensors[t]``, a ``(num_blocks,
  page)`` int8 view whose row stride is the block stride) -> reference tensor
  ``t`` with ``page_bytes[t] = tensors[t].page_size_bytes`` (padded page);
* ``group_data_refs[g]`` (one ``CanonicalKVCacheRef(tensor_idx, unpadded
  page_size_bytes)`` per layer, in layer order; layers aliasing one tensor all
  point at it) -> ``group_refs[g] = (TensorRef(tensor_idx, page_size_bytes), ...)``;
* one ``blocks_per_chunk`` for every group (vLLM's global value).

Packed layouts (DeepSeek-V4: block-outermost, one block of all layers' pages)
arrive already folded by vLLM: one canonical tensor whose page is the packed
block stride and one ref per group covering the whole packed block; the mapping
above needs nothing special for them.

The chunk pool is one uint8 ``[num_chunks, slot_bytes]`` tensor (a
:class:`reference.store.ChunkStore` pool); slot ``c`` is CPU chunk ``c``, laid
out as :mod:`reference.transfer` states (``TransferLayout.sub_slot_offset``):
vLLM's shared-region layout for one worker, except that vLLM rounds its row
stride up to ``BLOCK_SIZE_ALIGNMENT`` and interleaves the other ranks' slots
(this pool is per worker and unpadded).

Not supported (``ValueError`` at construction): ``canonical_layout`` (the
canonical per-layer host format with parallelism mappings).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from reference.geometry import cpu_row_bytes
from reference.store import ChunkStore
from reference.transfer import TensorRef, TransferLayout, chunks_of
from reference.transfer_fast import checked_plan, gather, scatter
from vllm_adapter import vllm_api as V

__all__ = [
    "NUM_CPU_CHUNKS",
    "ReferenceOffloadingSpec",
    "ReferenceOffloadingWorker",
    "canonical_gpu_tensors",
    "transfer_layout",
]

NUM_CPU_CHUNKS = "num_cpu_chunks"
CPU_BYTES_TO_USE = "cpu_bytes_to_use"


# ---------------------------------------------------------------------------
# Canonical tensors -> reference layout
# ---------------------------------------------------------------------------


def transfer_layout(kv_caches: Any, blocks_per_chunk: int) -> TransferLayout:
    """The reference :class:`TransferLayout` of vLLM's ``CanonicalKVCaches``.

    ``page_bytes[t]`` is canonical tensor ``t``'s (padded) page; group ``g``'s
    refs are ``group_data_refs[g]`` as ``TensorRef(tensor_idx, page_size_bytes)``
    (unpadded bytes, copied from the start of each row, as vLLM's direct copies
    do); every group gets ``blocks_per_chunk``.
    """
    if not kv_caches.tensors:
        raise ValueError("CanonicalKVCaches has no tensors; there is nothing to offload")
    pages = tuple(int(t.page_size_bytes) for t in kv_caches.tensors)
    refs = tuple(
        tuple(TensorRef(int(r.tensor_idx), int(r.page_size_bytes)) for r in group)
        for group in kv_caches.group_data_refs
    )
    return TransferLayout.uniform(pages, refs, int(blocks_per_chunk))


def canonical_gpu_tensors(kv_caches: Any) -> list[torch.Tensor]:
    """uint8 ``(num_blocks, page)`` views of the canonical tensors (no copies).

    Same reshaping as ``CPUOffloadingWorker``: ``view(int8).view(-1, page)``,
    then reinterpreted as uint8 for :mod:`reference.transfer`.  The row stride
    stays the block stride (larger than the page for padded or aliased views).
    """
    out = []
    for t in kv_caches.tensors:
        page = int(t.page_size_bytes)
        view = t.tensor.view(torch.int8).view((-1, page)).view(torch.uint8)
        out.append(view)
    return out


# ---------------------------------------------------------------------------
# Worker
# ---------------------------------------------------------------------------


class ReferenceOffloadingWorker(V.OffloadingWorker):
    """An ``OffloadingWorker`` whose copies are :mod:`reference.transfer_fast`'s gather/scatter.

    ``kv_caches`` are vLLM's canonical tensors; the pool is ``num_chunks``
    slots of ``layout.slot_bytes`` bytes on the CPU, pinned when the tensors
    live on CUDA (``pin_memory`` overrides), or ``pool`` when given (a strided
    ``[num_chunks, slot_bytes]`` view, e.g. of vLLM's shared region: see
    :mod:`vllm_adapter.tiering`).  Every ``submit_*`` copies before
    returning; the job's ``TransferResult`` (with bytes and seconds) comes out
    of the next :meth:`get_finished`.  ``wait`` has nothing to wait for.
    """

    def __init__(
        self,
        kv_caches: Any,
        blocks_per_chunk: int,
        num_chunks: int,
        *,
        pin_memory: bool | None = None,
        pool: torch.Tensor | None = None,
    ) -> None:
        self.kv_caches = kv_caches
        """vLLM's ``CanonicalKVCaches`` (0.34.0's device pointers are resolved over them)."""
        self.layout = transfer_layout(kv_caches, blocks_per_chunk)
        self.gpu_tensors = canonical_gpu_tensors(kv_caches)
        devices = {t.device for t in self.gpu_tensors}
        if len(devices) != 1:
            raise ValueError(f"canonical tensors span several devices: {sorted(map(str, devices))}")
        (self.device,) = devices
        if pin_memory is None:
            pin_memory = self.device.type == "cuda"
        self.chunk_store: ChunkStore | None = None
        if pool is None:
            # Only the pool of this ChunkStore is used: vLLM's manager keeps the books.
            self.chunk_store = ChunkStore(
                int(num_chunks), self.layout.slot_bytes, pin_memory=pin_memory
            )
            assert self.chunk_store.pool is not None
            pool = self.chunk_store.pool
        elif tuple(pool.shape) != (int(num_chunks), self.layout.slot_bytes):
            raise ValueError(
                f"pool must be [num_chunks={num_chunks}, slot_bytes={self.layout.slot_bytes}] "
                f"bytes, got shape {tuple(pool.shape)}"
            )
        self.pool: torch.Tensor = pool
        """uint8 ``[num_chunks, slot_bytes]`` (rows may be strided, as in vLLM's shared
        region): the CPU tier's bytes (slot id = CPU chunk id)."""
        self._group_bytes = tuple(sum(r.nbytes for r in refs) for refs in self.layout.group_refs)
        self._finished: list[Any] = []
        self.num_stores = 0
        self.num_loads = 0

    @property
    def num_chunks(self) -> int:
        return int(self.pool.shape[0])

    @property
    def in_flight(self) -> set[int]:
        """Jobs copied but not yet reported by :meth:`get_finished`."""
        return {r.job_id for r in self._finished}

    def _job_bytes(self, group_sizes: Sequence[int]) -> int:
        return sum(int(n) * b for n, b in zip(group_sizes, self._group_bytes, strict=True))

    def gpu_blocks(self, gpu_side: Any) -> Any:
        """The block ids, group sizes and block indices of a ``submit_*`` GPU-side argument.

        Accepts what vLLM passes (a ``GPULoadStoreSpec`` on 0.33.0,
        ``DevicePointers`` resolved over :attr:`kv_caches` on 0.34.0; see
        ``vllm_api.gpu_blocks``) and an already decoded ``vllm_api.GpuBlocks``
        (what worker wrappers such as the faults lane's forward).
        """
        if isinstance(gpu_side, V.GpuBlocks):
            return gpu_side
        return V.gpu_blocks(gpu_side, self.kv_caches)

    def _pieces(
        self, block_ids: torch.Tensor, sizes: list[int], firsts: list[int], slot_ids: torch.Tensor
    ) -> list[tuple[torch.Tensor, list[int], list[int], torch.Tensor]]:
        """The job as calls whose block ids are distinct (what :mod:`reference.transfer` takes).

        vLLM 0.34.0 keeps null GPU blocks (block id 0, the zeroed null page)
        inside a stored chunk as placeholders, so the blocks after them keep
        their sub-slots (0.33.0 dropped them); one store job can then list block
        0 several times.  Reading a row twice is fine for a store, so such a
        job is cut, per group, into runs holding block 0 at most once; each
        run keeps its own ``block_indices`` and chunk ids, so every block still
        lands in the sub-slot vLLM's worker writes (block 0's bytes included).
        Any other job, or one whose ids do not add up, is one call (and the
        reference's validation reports what is wrong with it).
        """
        whole = [(block_ids, sizes, firsts, slot_ids)]
        if int((block_ids == 0).sum()) < 2:
            return whole
        bpcs = self.layout.blocks_per_chunk
        spans = [chunks_of(f, n, b) for n, f, b in zip(sizes, firsts, bpcs, strict=True)]
        if sum(sizes) != block_ids.numel() or sum(map(len, spans)) != slot_ids.numel():
            return whole
        out = []
        block_cursor = slot_cursor = 0
        for g, (n, first, b, span) in enumerate(zip(sizes, firsts, bpcs, spans, strict=True)):
            if n == 0:
                continue
            ids = block_ids[block_cursor : block_cursor + n]
            slots = slot_ids[slot_cursor : slot_cursor + len(span)]
            starts = [0]
            seen_null = False
            for k, block in enumerate(ids.tolist()):
                if block == 0:
                    if seen_null:
                        starts.append(k)
                    seen_null = True
            for s, e in zip(starts, starts[1:] + [n], strict=True):
                piece_sizes = [0] * len(sizes)
                piece_sizes[g] = e - s
                piece_firsts = list(firsts)
                piece_firsts[g] = first + s
                piece = chunks_of(first + s, e - s, b)
                lo, hi = piece.start - span.start, piece.stop - span.start
                out.append((ids[s:e], piece_sizes, piece_firsts, slots[lo:hi]))
            block_cursor += n
            slot_cursor += len(span)
        return out

    def _run(self, job_id: int, gpu_side: Any, cpu_spec: Any, store: bool) -> bool:
        gpu = self.gpu_blocks(gpu_side)
        slot_ids = torch.from_numpy(cpu_spec.block_ids.astype("int64", copy=False))
        block_ids = torch.from_numpy(gpu.block_ids.astype("int64", copy=False))
        group_sizes = [int(n) for n in gpu.group_sizes]
        block_indices = [int(i) for i in gpu.block_indices]
        start = time.perf_counter()
        pieces = (
            self._pieces(block_ids, group_sizes, block_indices, slot_ids)
            if store
            else [(block_ids, group_sizes, block_indices, slot_ids)]
        )
        if len(pieces) > 1:  # validate every call before the first write
            for ids, sizes, firsts, slots in pieces:
                checked_plan(self.layout, self.gpu_tensors, self.pool, ids, sizes, firsts, slots)
        copy = gather if store else scatter
        for ids, sizes, firsts, slots in pieces:
            copy(self.layout, self.gpu_tensors, self.pool, ids, sizes, firsts, slots)
        if not store and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        elapsed = time.perf_counter() - start
        self._finished.append(
            V.TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=self._job_bytes(group_sizes),
                transfer_time=elapsed,
            )
        )
        if store:
            self.num_stores += 1
        else:
            self.num_loads += 1
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """GPU -> CPU: :func:`reference.transfer_fast.gather` into the chunks ``dst_spec`` names.

        ``src_spec`` is the GPU side as vLLM passes it (``GPULoadStoreSpec`` on
        0.33.0, ``DevicePointers`` on 0.34.0, where the parameter is named
        ``device_ptrs``), or a ``vllm_api.GpuBlocks``.
        """
        return self._run(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        """CPU -> GPU: :func:`reference.transfer_fast.scatter` from the chunks ``src_spec`` names.

        ``dst_spec``: the GPU side, as for :meth:`submit_store`.
        """
        return self._run(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[Any]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return None

    def shutdown(self) -> None:
        self._finished.clear()


# ---------------------------------------------------------------------------
# Spec
# ---------------------------------------------------------------------------


def _count(key: str, value: Any) -> int:
    """``value`` as vLLM's ``int(value)`` would take it: an int or a decimal string, >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"'{key}' in kv_connector_extra_config must be an integer, got {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise ValueError(
            f"'{key}' in kv_connector_extra_config must be an integer, got {value!r}"
        ) from None
    if n < 0:
        raise ValueError(f"'{key}' in kv_connector_extra_config must be >= 0, got {value!r}")
    return n


class ReferenceOffloadingSpec(V.OffloadingSpec):
    """vLLM's CPU tier semantics (manager) over the reference's byte copies (worker)."""

    BLOCK_SIZE_ALIGNMENT: int = V.CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        # The manager is CPUOffloadingManager: it reports CPUOffloadingSpec's metrics.
        return V.CPUOffloadingSpec.build_metric_definitions(extra_config)

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return V.CPUOffloadingInfo.config_info_keys()

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if config.canonical_layout:
            raise ValueError(
                "ReferenceOffloadingSpec implements vLLM's direct CPU layout only; "
                "remove 'canonical_layout' from kv_connector_extra_config"
            )
        extra = self.extra_config
        world_size = int(config.parallel.world_size)
        # Same arithmetic as CPUOffloadingSpec (one copy per worker: no replicated layout).
        bytes_per_chunk = 0
        if config.worker_kv_bytes_per_block > 0 and world_size > 0:
            bytes_per_chunk = cpu_row_bytes(
                int(config.worker_kv_bytes_per_block), world_size, int(self.blocks_per_chunk),
                int(self.BLOCK_SIZE_ALIGNMENT),
            )
        if extra.get(NUM_CPU_CHUNKS) is not None:
            num_chunks = _count(NUM_CPU_CHUNKS, extra[NUM_CPU_CHUNKS])
        elif extra.get(CPU_BYTES_TO_USE):
            cpu_bytes = _count(CPU_BYTES_TO_USE, extra[CPU_BYTES_TO_USE])
            num_chunks = cpu_bytes // bytes_per_chunk if bytes_per_chunk else 0
        else:
            raise ValueError(
                f"ReferenceOffloadingSpec needs '{NUM_CPU_CHUNKS}' (CPU chunk slots) or "
                f"'{CPU_BYTES_TO_USE}' (bytes, sized like CPUOffloadingSpec) in "
                "kv_connector_extra_config"
            )
        self.num_chunks: int = num_chunks
        self.kv_bytes_per_chunk: int = bytes_per_chunk
        self.cpu_info = V.CPUOffloadingInfo.from_config(config, num_chunks, bytes_per_chunk)
        self.eviction_policy: str = extra.get("eviction_policy", "lru")
        self.cache_policy_module_path: str | None = extra.get("cache_policy_module_path")
        self._manager: Any = None
        self._worker: ReferenceOffloadingWorker | None = None

    def get_manager(self) -> Any:
        """vLLM's ``CPUOffloadingManager``, configured as ``CPUOffloadingSpec.get_manager`` does."""
        if self._manager is None:
            self._manager = V.CPUOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
                info=self.cpu_info,
            )
        return self._manager

    def get_worker(self, kv_caches: Any) -> ReferenceOffloadingWorker:
        """A :class:`ReferenceOffloadingWorker` over ``kv_caches`` (built once)."""
        if self._worker is None:
            self._worker = ReferenceOffloadingWorker(
                kv_caches, self.blocks_per_chunk, self.num_chunks
            )
        return self._worker


count_option = _count
"""A count option of ``kv_connector_extra_config`` (public name of :func:`_count`)."""
