"""gpu_copy lane (CUDA only): vLLM's CUDA copy path vs the reference copies, byte for byte.

On the same CUDA KV tensors (allocated by vLLM's ``allocate_kv_cache`` for a
fixture's worker-view ``KVCacheConfig``, shrunk; canonical tensors built by
vLLM's own ``register_kv_caches``):

* vLLM's real ``CPUOffloadingWorker``, made by a real ``CPUOffloadingSpec``'s
  ``create_worker`` (shared ``/dev/shm`` region, rank ``world_size - 1`` so the
  per-rank offset is exercised) -- or, in the ``private`` cases, with private
  pinned CPU tensors;
* :class:`vllm_adapter.spec.ReferenceOffloadingWorker` (reference gather/scatter).

Both get identical store/load jobs, with the GPU side as vLLM's connector worker
passes it (the ``GPULoadStoreSpec`` on 0.33.0, ``DevicePointers`` resolved over
the shared canonical tensors on 0.34.0): the jobs vLLM's scheduler dispatched for a
small workload on the same geometry (recorded on CPU with
:func:`conformance.harness.gpu_copy.record_jobs`; the GPU KV bytes are re-randomised at every
recorded step), or random jobs over randomised, identical CPU tiers.  After
each store the written sub-slots must be byte-identical; after each load the
whole KV memory; at the end every sub-slot of both tiers (and nothing written
outside this worker's area of the shared region).  See :class:`conformance.harness.gpu_copy.CopyDifferential`.

Without CUDA every case skips with :data:`conformance.harness.gpu_copy.CUDA_SKIP_REASON`.
"""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass
from typing import Any

import pytest

from conformance.testing.requires import require_vllm

require_vllm()

from conformance.harness import gpu_copy as G  # noqa: E402
from conformance.harness.cases import DSV4, GEMMA  # noqa: E402
from conformance.harness.fixture_runs import FixtureCase  # noqa: E402


@dataclass(frozen=True)
class CopyCase(FixtureCase):
    shared_region: bool = True
    """vLLM's CPU tier in its shared /dev/shm region (True) or private CPU tensors."""

    @property
    def knob(self) -> str:
        return super().knob + ("" if self.shared_region else ", private CPU tensors")

    def __str__(self) -> str:
        return super().__str__() + ("" if self.shared_region else "-private")


RECORDED = [
    CopyCase(GEMMA, (("block_size", 512),), True, 384, 24, 640),
    CopyCase(DSV4, (("block_size", 512),), True, 256, 96, 1100),
    CopyCase("synthetic-full-swa", (("blocks_per_chunk", 2),), False, 160, 64, 600, 128),
    CopyCase("synthetic-full-swa", (("block_size", 256),), True, 160, 64, 600, 128),
    CopyCase("synthetic-full-mamba-align", (("blocks_per_chunk", 2),), False, 96, 48, 600, 128),
    CopyCase("synthetic-eagle", (("blocks_per_chunk", 2),), False, 160, 64, 600, 128),
]
RANDOM = [
    *RECORDED,
    CopyCase(GEMMA, (("block_size", 512),), True, 384, 24, 640, shared_region=False),
    CopyCase(
        "synthetic-full-swa",
        (("blocks_per_chunk", 2),),
        False,
        160,
        64,
        600,
        128,
        shared_region=False,
    ),
]


def _require_cuda() -> None:
    reason = G.cuda_skip_reason()
    if reason is not None:
        pytest.skip(reason)


class _Setup:
    """Both workers over one set of CUDA KV tensors, and the differential."""

    def __init__(self, case: CopyCase, seed: int) -> None:
        import torch

        from conformance.harness.kvdata import SyntheticModelRunner
        from vllm_adapter.spec import ReferenceOffloadingWorker

        self.driver = case.driver()
        worker_kvc = self.driver.worker_kv_cache_config
        vllm_config = self.driver.vllm_config
        self.runner = SyntheticModelRunner(
            worker_kvc, vllm_config, device=torch.device("cuda"), check_loads=False
        )
        self.kv = G.canonical_kv_caches(vllm_config, worker_kvc, self.runner.kv_caches)
        probe = G.cpu_offloading_spec(vllm_config, worker_kvc, case.num_cpu_chunks)
        rank = probe.config.parallel.world_size - 1
        self.spec = G.cpu_offloading_spec(vllm_config, worker_kvc, case.num_cpu_chunks, rank=rank)
        if case.shared_region:
            need = self.spec.num_chunks * self.spec.kv_bytes_per_chunk
            free = G.shm_free_bytes()
            if free < need + (64 << 20):
                pytest.skip(
                    f"vLLM's shared CPU region needs {need} bytes in /dev/shm, {free} free "
                    "(the private-tensor cases still run)"
                )
        self.vllm_worker = G.create_vllm_worker(
            self.spec, self.kv, shared_region=case.shared_region
        )
        self.ref_worker = ReferenceOffloadingWorker(
            self.kv, self.spec.blocks_per_chunk, self.spec.num_chunks
        )
        pages = [int(t.page_size_bytes) for t in self.kv.tensors]
        self.tier, problems = G.vllm_worker_tier(self.vllm_worker, self.spec, pages)
        assert not problems, (
            "vLLM's CPU layout is not where the notes (section 6.2) say:\n" + "\n".join(problems)
        )
        self.diff = G.CopyDifferential(
            self.kv, self.ref_worker, self.vllm_worker, self.tier, seed=seed
        )

    def close(self) -> None:
        import torch

        vllm_worker, ref_worker = self.vllm_worker, self.ref_worker
        # Drop the views into vLLM's region first, so its cleanup can unmap it.
        del self.diff, self.tier, self.vllm_worker, self.ref_worker
        gc.collect()
        vllm_worker.shutdown()
        ref_worker.shutdown()
        del vllm_worker, ref_worker, self.kv, self.runner
        gc.collect()
        torch.cuda.empty_cache()


def _record(stats: G.CopyStats, record_property: Any) -> None:
    record_property("counter:gpu_copy_stores", stats.stores)
    record_property("counter:gpu_copy_loads", stats.loads)
    record_property(
        "counter:gpu_copy_bytes_compared",
        stats.sub_slot_bytes_compared + stats.tier_bytes_compared + stats.gpu_bytes_compared,
    )
    record_property("counter:gpu_copy_mismatches", len(stats.failures))


@pytest.mark.gpu_copy
@pytest.mark.parametrize("case", RECORDED, ids=str)
def test_recorded_jobs_copy_the_same_bytes(case: CopyCase, record_property: Any) -> None:
    record_property("fixture", case.fixture)
    record_property("knob", case.knob + ", recorded jobs")
    _require_cuda()
    setup = _Setup(case, seed=1)
    try:
        jobs = G.record_jobs(
            setup.driver,
            prompt_len=case.workload_prompt_len,
            budget=case.workload_budget,
            origin=str(case),
        )
        assert any(j.kind == "store" for j in jobs) and any(j.kind == "load" for j in jobs), (
            f"the recorded workload must store and load: {len(jobs)} jobs"
        )
        step = None
        for job in jobs:
            if job.step != step:  # fresh KV bytes for every engine step
                setup.diff.randomize_gpu()
                step = job.step
            setup.diff.run(job)
        stats = setup.diff.finish()
        _record(stats, record_property)
        assert stats.gpu_rows_loaded > 0, f"the loads changed no GPU row: {stats.describe()}"
        assert not stats.failures, stats.describe()
    finally:
        setup.close()


@pytest.mark.gpu_copy
@pytest.mark.parametrize("case", RANDOM, ids=str)
def test_random_jobs_copy_the_same_bytes(case: CopyCase, record_property: Any) -> None:
    record_property("fixture", case.fixture)
    record_property("knob", case.knob + ", random jobs")
    _require_cuda()
    setup = _Setup(case, seed=2)
    try:
        setup.diff.randomize_cpu()
        rng = random.Random(f"{case}-random")
        jobs = G.random_jobs(
            rng,
            num_groups=setup.diff.layout.num_groups,
            blocks_per_chunk=setup.spec.blocks_per_chunk,
            num_gpu_blocks=case.num_gpu_blocks,
            num_chunks=case.num_cpu_chunks,
            count=40,
        )
        for k, job in enumerate(jobs):
            if k % 4 == 0:
                setup.diff.randomize_gpu()
            setup.diff.run(job)
        stats = setup.diff.finish()
        _record(stats, record_property)
        assert stats.stores and stats.loads, stats.describe()
        assert not stats.failures, stats.describe()
    finally:
        setup.close()
