"""CPU-side helpers of the gpu_copy lane: vLLM's CUDA copy path vs the reference copies.

Everything here runs without a GPU; the lane (``conformance/lanes/test_gpu_copy.py``)
adds the CUDA parts, and ``tests/test_gpu_helpers.py`` tests this package on CPU.
The e2e lane's cases are in :mod:`conformance.harness.e2e`.

The lane puts vLLM's real (0.33.0 or 0.34.0) ``CPUOffloadingWorker`` (``CPUOffloadingSpec``'s
worker: CUDA copy kernels into the shared ``/dev/shm`` region, or into private
pinned tensors; :mod:`.vllm_worker`) and :class:`vllm_adapter.spec.ReferenceOffloadingWorker`
(:mod:`reference.transfer_fast` gather/scatter into a ``[num_chunks, slot_bytes]``
pool) over the *same* canonical KV tensors, feeds both the same store / load
specs (:class:`Job`: random ones, and ones recorded from a driver run with
:func:`record_jobs`; :mod:`.jobs`), and compares (:class:`CopyDifferential`,
:mod:`.differential`):

* after a store, every sub-slot the job writes (:func:`job_sub_slots`,
  :mod:`.slots`), bytes ``[0, nbytes)``, in vLLM's CPU layout and in the
  reference pool (:mod:`.tiers`);
* after a load, the whole KV memory (vLLM's result and the reference's, from
  the same starting bytes);
* at the end (and after every job when the tiers are small), every sub-slot of
  every chunk, and that vLLM wrote nothing outside this worker's tensor areas
  of the shared region (row padding, other ranks' slots).

Both tiers start zeroed, so sub-slots no job wrote (leading nulls of a
windowed chunk, skipped sub-slots of a Mamba-align chunk) are zero in both.

On CPU, ``tests/emulated_worker.py``'s ``EmulatedVllmWorker`` stands in for the
CUDA worker (vLLM's own descriptor code computes every copy's addresses and
``ctypes.memmove`` executes them); it exists to test this package, and the
lane never uses it.
"""

from __future__ import annotations

import torch

from .differential import CopyDifferential, CopyStats
from .jobs import Job, jobs_from_dispatched, random_jobs, record_jobs
from .slots import SubSlot, job_sub_slots
from .tiers import (
    ReferenceTier,
    RegionTier,
    TensorsTier,
    VllmCpuLayout,
    compare_sub_slots,
    compare_tiers,
    copy_tier,
    shm_free_bytes,
)
from .vllm_worker import (
    canonical_kv_caches,
    cpu_offloading_spec,
    create_vllm_worker,
    vllm_worker_tier,
)

__all__ = [
    "CUDA_SKIP_REASON",
    "CopyDifferential",
    "CopyStats",
    "Job",
    "ReferenceTier",
    "RegionTier",
    "SubSlot",
    "TensorsTier",
    "VllmCpuLayout",
    "canonical_kv_caches",
    "compare_sub_slots",
    "compare_tiers",
    "copy_tier",
    "cpu_offloading_spec",
    "create_vllm_worker",
    "cuda_skip_reason",
    "job_sub_slots",
    "jobs_from_dispatched",
    "random_jobs",
    "record_jobs",
    "shm_free_bytes",
    "vllm_worker_tier",
]

CUDA_SKIP_REASON = "needs CUDA (torch.cuda.is_available() is False)"


def cuda_skip_reason() -> str | None:
    """``None`` when CUDA is usable, else the CUDA lanes' skip reason."""
    return None if torch.cuda.is_available() else CUDA_SKIP_REASON
