"""A CPU stand-in for vLLM's CUDA ``CPUOffloadingWorker``, for tests of :mod:`conformance.harness.gpu_copy`.

vLLM's own descriptor code (``SingleDirectionOffloadingHandler._fill_direct_ops``
/ ``compute_sub_block_ptrs``, called unchanged) computes every copy's addresses
and ``ctypes.memmove`` executes them.  The gpu_copy lane never uses it; tests
import it as ``from emulated_worker import EmulatedVllmWorker`` (pytest puts
``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from conformance.harness import vllm_harness_api as V
from reference.mathutil import cdiv

__all__ = ["EmulatedVllmWorker"]


class EmulatedVllmWorker:
    """vLLM's direct-layout copies on CPU: vLLM's descriptor code, ``memmove`` as the copy engine.

    ``SingleDirectionOffloadingHandler.transfer_async``'s per-group loop
    (restated: it needs CUDA streams) calls vLLM's own ``_fill_direct_ops``
    (and through it ``compute_sub_block_ptrs``) unchanged; each descriptor is
    then executed with ``ctypes.memmove``.  Both releases' loops are here:
    0.33.0's takes the ``GPULoadStoreSpec`` and computes GPU addresses from the
    GPU tensors; 0.34.0's takes ``DevicePointers`` (resolved by the caller, as
    vLLM's connector worker does) and walks them with ``iter_pointer_groups``.
    ``cpu_tensors`` are vLLM's CPU views (e.g. from a real
    ``SharedOffloadRegion.create_next_worker_view``).
    ``mutate(worker, all_src, all_dst, all_sizes, num_ops, gpu_to_cpu)`` (tests)
    may rewrite the descriptors before they run.
    """

    def __init__(
        self,
        kv_caches: Any,
        blocks_per_chunk: int,
        cpu_tensors: Sequence[torch.Tensor],
        *,
        mmap_region: Any | None = None,
        mutate: Callable[..., None] | None = None,
    ) -> None:
        self.gpu_tensors = [
            t.tensor.view(torch.int8).view((-1, t.page_size_bytes)) for t in kv_caches.tensors
        ]
        self.cpu_tensors = list(cpu_tensors)
        self.refs = kv_caches.group_data_refs
        self.blocks_per_chunk = blocks_per_chunk
        self._mmap_region = mmap_region
        self._store_handler = SimpleNamespace(
            dst_tensors=self.cpu_tensors, cpu_tensors=self.cpu_tensors
        )
        self._done: list[Any] = []
        self.mutate = mutate

    def _transfer(self, job_id: int, src_spec: Any, dst_spec: Any, gpu_to_cpu: bool) -> bool:
        if V.WORKER_TAKES_DEVICE_POINTERS:
            gpu_side, cpu_spec = (src_spec, dst_spec) if gpu_to_cpu else (dst_spec, src_spec)
            return self._transfer_pointers(job_id, gpu_side, cpu_spec, gpu_to_cpu)
        b = self.blocks_per_chunk
        handler = SimpleNamespace(
            layer_refs_per_group=self.refs,
            src_tensors=self.gpu_tensors if gpu_to_cpu else self.cpu_tensors,
            dst_tensors=self.cpu_tensors if gpu_to_cpu else self.gpu_tensors,
            src_blocks_per_chunk=1 if gpu_to_cpu else b,
            dst_blocks_per_chunk=b if gpu_to_cpu else 1,
        )
        gpu_spec = src_spec if gpu_to_cpu else dst_spec
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        n_ops = sum(int(n) * len(r) for n, r in zip(gpu_spec.group_sizes, self.refs, strict=True))
        all_src = np.zeros(n_ops, dtype=np.int64)
        all_dst = np.zeros(n_ops, dtype=np.int64)
        all_sizes = np.zeros(n_ops, dtype=np.int64)
        src_off = dst_off = op_idx = total = 0
        for g, (n, first) in enumerate(
            zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True)
        ):
            if n == 0:
                continue
            src_skip = first % handler.src_blocks_per_chunk
            dst_skip = first % handler.dst_blocks_per_chunk
            dst_end = dst_off + cdiv(n + dst_skip, handler.dst_blocks_per_chunk)
            src_end = src_off + cdiv(n + src_skip, handler.src_blocks_per_chunk)
            assert dst_end <= len(dst_blocks) and src_end <= len(src_blocks)
            op_idx, nbytes = V.SingleDirectionOffloadingHandler._fill_direct_ops(
                handler,
                g,
                group_src=src_blocks[src_off:src_end],
                group_dst=dst_blocks[dst_off:dst_end],
                group_size=int(n),
                src_skip_count=src_skip,
                dst_skip_count=dst_skip,
                all_src=all_src,
                all_dst=all_dst,
                all_sizes=all_sizes,
                op_idx=op_idx,
            )
            total += nbytes
            src_off, dst_off = src_end, dst_end
        assert src_off == len(src_blocks) and dst_off == len(dst_blocks)
        return self._execute(job_id, all_src, all_dst, all_sizes, op_idx, total, gpu_to_cpu)

    def _transfer_pointers(
        self, job_id: int, device_ptrs: Any, cpu_spec: Any, gpu_to_cpu: bool
    ) -> bool:
        """vLLM 0.34.0's ``transfer_async`` loop over pre-resolved device pointers."""
        handler = SimpleNamespace(
            layer_refs_per_group=self.refs,
            cpu_tensors=self.cpu_tensors,
            blocks_per_chunk=self.blocks_per_chunk,
            gpu_to_cpu=gpu_to_cpu,
        )
        cpu_blocks = cpu_spec.block_ids
        n_ops = sum(
            int(n) * len(r) for n, r in zip(device_ptrs.group_block_counts, self.refs, strict=True)
        )
        all_src = np.zeros(n_ops, dtype=np.int64)
        all_dst = np.zeros(n_ops, dtype=np.int64)
        all_sizes = np.zeros(n_ops, dtype=np.int64)
        cpu_off = op_idx = total = 0
        for g in V.iter_pointer_groups(device_ptrs, self.blocks_per_chunk):
            cpu_end = cpu_off + g.n_chunks
            assert cpu_end <= len(cpu_blocks)
            op_idx, nbytes = V.SingleDirectionOffloadingHandler._fill_direct_ops(
                handler,
                g.group_idx,
                device_ptrs=device_ptrs,
                dev_ptr_offset=g.dev_ptr_offset,
                cpu_block_ids=cpu_blocks[cpu_off:cpu_end],
                group_size=g.group_size,
                cpu_skip_count=g.skip,
                all_src=all_src,
                all_dst=all_dst,
                all_sizes=all_sizes,
                op_idx=op_idx,
            )
            total += nbytes
            cpu_off = cpu_end
        assert cpu_off == len(cpu_blocks)
        return self._execute(job_id, all_src, all_dst, all_sizes, op_idx, total, gpu_to_cpu)

    def _execute(
        self,
        job_id: int,
        all_src: np.ndarray,
        all_dst: np.ndarray,
        all_sizes: np.ndarray,
        op_idx: int,
        total: int,
        gpu_to_cpu: bool,
    ) -> bool:
        if self.mutate is not None:
            self.mutate(self, all_src, all_dst, all_sizes, op_idx, gpu_to_cpu)
        for s, d, n in zip(all_src[:op_idx], all_dst[:op_idx], all_sizes[:op_idx], strict=True):
            ctypes.memmove(int(d), int(s), int(n))
        self._done.append(V.TransferResult(job_id=job_id, success=True, transfer_size=total))
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, True)

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        return self._transfer(job_id, src_spec, dst_spec, False)

    def wait(self, job_ids: set[int]) -> None:
        return None

    def get_finished(self) -> list[Any]:
        done, self._done = self._done, []
        return done

    def shutdown(self) -> None:
        self.cpu_tensors.clear()  # as vLLM's handlers do, so the region can be unmapped
        self._store_handler.dst_tensors = []
        if self._mmap_region is not None:
            self._mmap_region.cleanup()
            self._mmap_region = None
