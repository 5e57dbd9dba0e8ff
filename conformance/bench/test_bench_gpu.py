"""GPU (CUDA only): vLLM's CPU-offloading worker and the reference worker vs pinned cudaMemcpyAsync.

On a CUDA host: the fixture's KV cache on the GPU (vLLM's ``allocate_kv_cache``
through :class:`conformance.harness.kvdata.SyntheticModelRunner`, ``NUM_BLOCKS`` blocks),
the ``CanonicalKVCaches`` vLLM's ``register_kv_caches`` builds from it, and

* vLLM 0.33.0's real ``CPUOffloadingWorker`` (``CPUOffloadingSpec.create_worker``:
  its copy path into the shared host region), and
* :class:`vllm_adapter.spec.ReferenceOffloadingWorker` (:mod:`reference.transfer_fast`
  into a pinned pool),

each storing (GPU -> CPU) and loading (CPU -> GPU) one job of ``JOB_BLOCKS``
random blocks of one group (``submit_*`` then ``wait``), vs one
``cudaMemcpyAsync`` of the same bytes between the KV buffer and a pinned host
buffer (``copy_(non_blocking=True)`` + stream sync: the PCIe limit).  Target
(vLLM's worker): >= 0.8 for ``blocks_per_chunk >= 4``; the reference worker is
informational.  Without CUDA every case is skipped, with the reason.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from conformance.bench import (
    CASES,
    GEOMETRIES,
    Variant,
    case_id,
    measure,
    record,
    rounded,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="GPU benchmark: needs CUDA (torch.cuda.is_available() is False on this host)",
)

NUM_BLOCKS = 1024
JOB_BLOCKS = 64
WORKERS = ("vllm", "reference")
PARAMS = [(g, b, d, w) for g, b in CASES for w in WORKERS for d in ("store", "load")]


_CURRENT: dict[str, Any] = {}
"""The one live setup (``key``, ``setup``): a new one shuts the previous vLLM worker down."""


def _release() -> None:
    old = _CURRENT.pop("setup", None)
    _CURRENT.pop("key", None)
    if old is not None:
        old["workers"]["vllm"].shutdown()  # unlinks its /dev/shm region
        torch.cuda.empty_cache()


@pytest.fixture(scope="module", autouse=True)
def _release_at_end() -> Any:
    yield
    _release()


def cuda_setup(geometry: str, blocks_per_chunk: int) -> dict[str, Any]:
    """The setup for this configuration, built when the configuration changes."""
    key = f"{geometry}/{blocks_per_chunk}"
    if _CURRENT.get("key") != key:
        _release()
        _CURRENT["setup"] = _build(geometry, blocks_per_chunk)
        _CURRENT["key"] = key
    setup: dict[str, Any] = _CURRENT["setup"]
    return setup


def _build(geometry: str, blocks_per_chunk: int) -> dict[str, Any]:
    """KV cache on the GPU, its canonical tensors, and both workers over them."""
    from conformance.harness import gpu_copy as gpu
    from conformance.harness.fixture_runs import fixture_driver
    from conformance.harness.kvdata import SyntheticModelRunner
    from reference.mathutil import cdiv
    from vllm_adapter.spec import ReferenceOffloadingWorker, canonical_gpu_tensors

    num_chunks = 2 * cdiv(JOB_BLOCKS, blocks_per_chunk)
    driver = fixture_driver(
        geometry,
        {"blocks_per_chunk": blocks_per_chunk},
        num_gpu_blocks=NUM_BLOCKS,
        num_cpu_chunks=num_chunks,
    )
    runner = SyntheticModelRunner(
        driver.worker_kv_cache_config, driver.vllm_config, device="cuda", check_loads=False
    )
    kv = gpu.canonical_kv_caches(
        driver.vllm_config, driver.worker_kv_cache_config, runner.kv_caches
    )
    views = canonical_gpu_tensors(kv)
    for v in views:
        v.random_(0, 256)
    spec = gpu.cpu_offloading_spec(driver.vllm_config, driver.worker_kv_cache_config, num_chunks)
    workers = {
        "vllm": gpu.create_vllm_worker(spec, kv),
        "reference": ReferenceOffloadingWorker(kv, blocks_per_chunk, num_chunks),
    }
    return {
        "runner": runner,
        "kv": kv,
        "views": views,
        "workers": workers,
        "num_chunks": num_chunks,
    }


@pytest.mark.parametrize(
    "geometry,blocks_per_chunk,direction,worker_name",
    PARAMS,
    ids=[f"{case_id((g, b))}-{w}-{d}" for g, b, d, w in PARAMS],
)
def test_gpu_transfer(
    benchmark: Any, geometry: str, blocks_per_chunk: int, direction: str, worker_name: str
) -> None:
    from conformance.harness import gpu_copy as gpu

    setup = cuda_setup(geometry, blocks_per_chunk)
    worker = setup["workers"][worker_name]
    layout = setup["workers"]["reference"].layout
    sizes = [sum(r.nbytes for r in refs) for refs in layout.group_refs]
    g = sizes.index(max(sizes))
    rng = random.Random(blocks_per_chunk)
    chunks = -(-JOB_BLOCKS // blocks_per_chunk)
    group_sizes = [0] * layout.num_groups
    group_sizes[g] = JOB_BLOCKS
    job = gpu.Job(
        direction,
        tuple(rng.sample(range(NUM_BLOCKS), JOB_BLOCKS)),
        tuple(group_sizes),
        (0,) * layout.num_groups,
        tuple(rng.sample(range(setup["num_chunks"]), chunks)),
        origin="bench",
    )
    nbytes = JOB_BLOCKS * sizes[g]
    counter = iter(range(1, 1 << 30))

    def candidate(_: Any) -> None:
        job_id = next(counter)
        src, dst = job.specs(setup["kv"])  # DevicePointers on 0.34.0, as vLLM passes them
        submit = worker.submit_store if direction == "store" else worker.submit_load
        assert submit(job_id, src, dst)
        worker.wait({job_id})
        torch.cuda.synchronize()
        results = worker.get_finished()
        assert all(r.success for r in results)

    flat = setup["views"][0].untyped_storage()
    device_bytes = torch.empty(0, dtype=torch.uint8, device="cuda").set_(
        flat, 0, (flat.nbytes(),), (1,)
    )
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def limit(_: Any) -> None:
        start = rng.randrange(0, device_bytes.numel() - nbytes + 1) & ~4095
        if direction == "store":
            host.copy_(device_bytes[start : start + nbytes], non_blocking=True)
        else:
            device_bytes[start : start + nbytes].copy_(host, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    m = measure(benchmark, Variant(candidate), {"cudaMemcpyAsync": Variant(limit)})
    record(
        benchmark,
        kind="gpu",
        geometry=geometry,
        label=GEOMETRIES[geometry],
        blocks_per_chunk=blocks_per_chunk,
        direction=direction,
        worker=worker_name,
        target_checked=worker_name == "vllm",
        bytes=nbytes,
        device=torch.cuda.get_device_name(),
        **m.ratio_fields(
            "cudaMemcpyAsync", speed=True,
            about={"kind": "gpu", "blocks_per_chunk": blocks_per_chunk,
                   "target_checked": worker_name == "vllm"},
        ),
        candidate_gbps=nbytes / m.median() / 1e9,
        limit_gbps=nbytes / m.median("cudaMemcpyAsync") / 1e9,
        candidate_s=rounded(m.candidate),
        baseline_s=rounded(m.baselines["cudaMemcpyAsync"]),
    )
