"""vllm_adapter.spec: ReferenceOffloadingSpec's sizing and its worker's mapping.

The worker's copies are checked against the installed vLLM's own direct-layout
descriptors (``SingleDirectionOffloadingHandler._fill_direct_ops`` /
``compute_sub_block_ptrs``, run by ``EmulatedVllmWorker`` of ``tests/emulated_worker.py``),
executed byte by byte with ``memmove`` on CPU tensors: the same pointers vLLM's
CUDA worker would hand to ``swap_blocks``.  Both workers get the GPU side of a
job as vLLM's connector worker passes it (``vllm_shims.worker_gpu_arg``): the
``GPULoadStoreSpec`` on 0.33.0, ``DevicePointers`` on 0.34.0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from conformance.testing.requires import require_vllm

require_vllm()

from emulated_worker import EmulatedVllmWorker  # noqa: E402

from conformance.harness import driver as D  # noqa: E402
from conformance.harness import kv_memory, kv_pattern, kvdata  # noqa: E402
from conformance.harness import vllm_harness_api as V  # noqa: E402
from conformance.protocol.trace import RequestSpec  # noqa: E402
from reference.transfer import TensorRef  # noqa: E402
from vllm_adapter import spec as S  # noqa: E402

pytestmark = pytest.mark.vllm

SPEC = {"spec_name": "ReferenceOffloadingSpec", "spec_module_path": "vllm_adapter.spec"}


# ---------------------------------------------------------------------------
# Hand-made canonical KV caches
# ---------------------------------------------------------------------------


def _canonical(
    num_blocks: int,
    pages: list[int],
    strides: list[int],
    group_refs: list[list[tuple[int, int]]],
    seed: int = 0,
    device: str = "cpu",
) -> tuple[Any, torch.Tensor]:
    """CanonicalKVCaches over one random int8 buffer; tensor t rows stride ``strides[t]``."""
    gen = torch.Generator().manual_seed(seed)
    offsets = [0]
    for t in range(len(pages)):
        offsets.append(offsets[-1] + strides[t] * num_blocks)
    buf = torch.randint(-128, 128, (offsets[-1],), generator=gen, dtype=torch.int8).to(device)
    tensors = [
        V.CanonicalKVCacheTensor(
            tensor=buf.as_strided((num_blocks, page), (stride, 1), offsets[t]),
            page_size_bytes=page,
        )
        for t, (page, stride) in enumerate(zip(pages, strides, strict=True))
    ]
    refs = [[V.CanonicalKVCacheRef(t, n) for t, n in group] for group in group_refs]
    return V.CanonicalKVCaches(tensors=tensors, group_data_refs=refs), buf


# Two tensors: t0 padded (page 96 in a 128-byte row), t1 dense; g0 uses both (t0 unpadded
# 80 bytes), g1 only t0, g2 only t1 with 40 of its 64 bytes (a padded layer sharing t1).
PAGES, STRIDES = [96, 64], [128, 64]
REFS = [[(0, 80), (1, 64)], [(0, 80)], [(1, 40)]]


def test_transfer_layout_is_the_canonical_mapping() -> None:
    kv, _ = _canonical(10, PAGES, STRIDES, REFS)
    layout = S.transfer_layout(kv, 4)
    assert layout.page_bytes == (96, 64)
    assert layout.group_refs == (
        (TensorRef(0, 80), TensorRef(1, 64)),
        (TensorRef(0, 80),),
        (TensorRef(1, 40),),
    )
    assert layout.blocks_per_chunk == (4, 4, 4)
    # vLLM's per-worker chunk: tensor t's bpc sub-slots after the earlier tensors' ones.
    assert layout.slot_bytes == 4 * (96 + 64)
    assert layout.sub_slot_offset(0, 1, 2) == 4 * 96 + 2 * 64


def test_canonical_gpu_tensors_are_views_with_the_block_stride() -> None:
    kv, buf = _canonical(10, PAGES, STRIDES, REFS)
    views = S.canonical_gpu_tensors(kv)
    assert [v.dtype for v in views] == [torch.uint8, torch.uint8]
    assert [tuple(v.shape) for v in views] == [(10, 96), (10, 64)]
    assert [v.stride(0) for v in views] == STRIDES
    assert views[0].data_ptr() == buf.data_ptr()
    assert views[1].data_ptr() == buf.data_ptr() + 128 * 10


# ---------------------------------------------------------------------------
# The worker against vLLM's own direct-copy descriptors
# ---------------------------------------------------------------------------


def _vllm_direct_copy(
    kv: Any,
    pool: torch.Tensor,
    bpc: int,
    gpu_spec: Any,
    cpu_ids: list[int],
    store: bool,
) -> None:
    """vLLM's ``transfer_async`` descriptor loop + ``_fill_direct_ops``, executed with memmove.

    The job's GPU side reaches vLLM's code as the connector worker passes it
    (pointers resolved over ``kv`` on 0.34.0).
    """
    layout = S.transfer_layout(kv, bpc)
    cpu = [
        pool[:, layout.region_offset(0, t) : layout.region_offset(0, t) + p * bpc]
        for t, p in enumerate(layout.page_bytes)
    ]
    oracle = EmulatedVllmWorker(kv, bpc, cpu)
    gpu_arg, cpu_spec = V.worker_gpu_arg(gpu_spec, kv), V.CPULoadStoreSpec(cpu_ids)
    if store:
        assert oracle.submit_store(0, gpu_arg, cpu_spec)
    else:
        assert oracle.submit_load(0, cpu_spec, gpu_arg)
    assert [r.job_id for r in oracle.get_finished()] == [0]


JOBS = [
    # (bpc, block_ids, group_sizes, block_indices, cpu chunk ids)
    (1, [3, 1, 7, 2, 9], [2, 1, 2], [0, 5, 1], [4, 0, 2, 1, 3]),
    (2, [1, 2, 3, 4, 14, 15, 16, 17], [4, 0, 4], [0, 0, 8], [0, 1, 2, 3]),
    (4, [5, 6, 7, 8, 9, 10, 11], [6, 0, 1], [1, 0, 11], [3, 0, 5]),
    (4, [2, 3, 4], [0, 3, 0], [0, 14, 0], [1, 6]),
]


_BLOCKS = 20


def _worker_and_oracle(
    bpc: int, seed: int
) -> tuple[Any, Any, Any, Any, Any, torch.Tensor, torch.Generator]:
    """Twin canonical KV caches (20 blocks) and a reference worker (8 chunks) whose pool
    holds random bytes; the oracle pool is a copy of it.  The generator (seed
    ``seed + 1``) that filled the pool is returned for further draws."""
    kv, buf = _canonical(_BLOCKS, PAGES, STRIDES, REFS, seed=seed)
    oracle_kv, oracle_buf = _canonical(_BLOCKS, PAGES, STRIDES, REFS, seed=seed)
    worker = S.ReferenceOffloadingWorker(kv, bpc, 8)
    gen = torch.Generator().manual_seed(seed + 1)
    worker.pool.copy_(torch.randint(0, 256, worker.pool.shape, generator=gen, dtype=torch.uint8))
    return kv, buf, oracle_kv, oracle_buf, worker, worker.pool.clone(), gen


@pytest.mark.parametrize(("bpc", "ids", "sizes", "firsts", "chunks"), JOBS)
def test_worker_copies_what_vllm_direct_layout_copies(
    bpc: int, ids: list[int], sizes: list[int], firsts: list[int], chunks: list[int]
) -> None:
    kv, buf, oracle_kv, oracle_buf, worker, oracle_pool, gen = _worker_and_oracle(bpc, seed=1)
    untouched = worker.pool.clone()
    gpu_spec = V.GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=firsts)
    cpu_spec = V.CPULoadStoreSpec(chunks)

    assert worker.submit_store(7, V.worker_gpu_arg(gpu_spec, kv), cpu_spec)
    _vllm_direct_copy(oracle_kv, oracle_pool, bpc, gpu_spec, chunks, store=True)
    assert torch.equal(worker.pool, oracle_pool)
    assert not torch.equal(worker.pool, untouched)
    assert torch.equal(buf, oracle_buf)  # a store only reads the GPU side

    # Load the same chunks into other GPU blocks (reversed), over fresh GPU bytes.
    fresh = torch.randint(-128, 128, buf.shape, generator=gen, dtype=torch.int8)
    buf.copy_(fresh)
    oracle_buf.copy_(fresh)
    load_spec = V.GPULoadStoreSpec(
        [_BLOCKS - 1 - b for b in ids], group_sizes=sizes, block_indices=firsts
    )
    assert worker.submit_load(8, cpu_spec, V.worker_gpu_arg(load_spec, kv))
    _vllm_direct_copy(oracle_kv, oracle_pool, bpc, load_spec, chunks, store=False)
    assert torch.equal(buf, oracle_buf)
    assert not torch.equal(buf, fresh)
    assert torch.equal(worker.pool, oracle_pool)  # a load only reads the pool

    results = worker.get_finished()
    assert [(r.job_id, r.success) for r in results] == [(7, True), (8, True)]
    group_bytes = [80 + 64, 80, 40]
    assert results[0].transfer_size == sum(n * b for n, b in zip(sizes, group_bytes, strict=True))
    assert worker.get_finished() == [] and worker.in_flight == set()
    assert (worker.num_stores, worker.num_loads) == (1, 1)


def test_worker_rejects_bad_jobs_before_copying() -> None:
    kv, buf = _canonical(10, PAGES, STRIDES, REFS)
    worker = S.ReferenceOffloadingWorker(kv, 2, 4)
    before = buf.clone()
    spec = V.worker_gpu_arg(
        V.GPULoadStoreSpec([1, 2, 3], group_sizes=[3, 0, 0], block_indices=[0, 0, 0]), kv
    )
    with pytest.raises(ValueError, match="slot id"):
        worker.submit_load(1, V.CPULoadStoreSpec([0, 9]), spec)  # chunk 9 of 4
    with pytest.raises(ValueError, match="slot ids"):
        worker.submit_load(1, V.CPULoadStoreSpec([0]), spec)  # 3 blocks need 2 chunks
    assert torch.equal(buf, before) and worker.get_finished() == []


# A 0.34.0 store job of a windowed group: null blocks (id 0) stay in their chunks as
# placeholders, several per job (the heads of its first and second chunks).
NULL_JOB = (4, [0, 0, 5, 6, 0, 7, 11, 12, 9, 10], [10, 0, 0], [4, 0, 0], [2, 6, 1])


def _device_pointers_or_skip() -> None:
    if not V.WORKER_TAKES_DEVICE_POINTERS:
        pytest.skip(
            "vLLM 0.33.0 passes workers the GPULoadStoreSpec: it has no DevicePointers "
            "and no resolve_device_pointers to invert"
        )


@pytest.mark.parametrize(("bpc", "ids", "sizes", "firsts", "chunks"), [*JOBS, NULL_JOB], ids=str)
def test_gpu_blocks_inverts_vllms_device_pointers(
    bpc: int, ids: list[int], sizes: list[int], firsts: list[int], chunks: list[int]
) -> None:
    """``vllm_shims.gpu_blocks`` gives back the job vLLM's ``resolve_device_pointers`` resolved.

    Padded rows (stride 128 for a 96-byte page), two tensors, a group with two
    refs and groups sharing a tensor; every ref of a group must name the same
    blocks.
    """
    _device_pointers_or_skip()
    kv, _ = _canonical(20, PAGES, STRIDES, REFS, seed=4)
    spec = V.GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=firsts)
    ptrs = V.resolve_device_pointers(spec, kv)
    assert isinstance(ptrs, V.DevicePointers)
    got = V.gpu_blocks(ptrs, kv)
    assert got.block_ids.dtype == np.int64
    assert got.block_ids.tolist() == ids
    assert got.group_sizes == tuple(sizes) and got.block_indices == tuple(firsts)
    # The worker decodes the same job from the pointers as from the spec.
    worker = S.ReferenceOffloadingWorker(kv, bpc, 8)
    assert worker.gpu_blocks(ptrs).block_ids.tolist() == worker.gpu_blocks(spec).block_ids.tolist()
    # g0 has two refs (tensors 0 and 1): a pointer of its second ref naming another block is caught.
    if sizes[0]:
        bad = V.DevicePointers(
            ptrs=ptrs.ptrs.copy(),
            sizes=ptrs.sizes,
            group_block_counts=ptrs.group_block_counts,
            group_data_ref_counts=ptrs.group_data_ref_counts,
            block_indices=ptrs.block_indices,
        )
        bad.ptrs[sizes[0]] += np.uint64(STRIDES[1])  # g0, ref 1, first block: one row further
        with pytest.raises(ValueError, match="different blocks"):
            V.gpu_blocks(bad, kv)


def test_gpu_blocks_takes_the_spec_itself() -> None:
    """On either release a ``GPULoadStoreSpec`` decodes to itself (0.33.0's worker argument)."""
    kv, _ = _canonical(20, PAGES, STRIDES, REFS)
    bpc, ids, sizes, firsts, _chunks = JOBS[1]
    got = V.gpu_blocks(V.GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=firsts), kv)
    assert (got.block_ids.tolist(), got.group_sizes, got.block_indices) == (
        ids,
        tuple(sizes),
        tuple(firsts),
    )
    with pytest.raises(TypeError, match="GPULoadStoreSpec"):
        V.gpu_blocks(V.CPULoadStoreSpec([1]), kv)
    arg = V.worker_gpu_arg(V.GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=firsts), kv)
    assert isinstance(
        arg, V.DevicePointers if V.WORKER_TAKES_DEVICE_POINTERS else V.GPULoadStoreSpec
    )


def test_worker_copies_null_placeholders_where_vllm_does() -> None:
    """A store job listing the null block several times (0.34.0's placeholders) lands like vLLM's.

    vLLM's worker copies block 0's page into every sub-slot that holds it, and
    every real block keeps its sub-slot; the reference worker must write the
    same bytes.  (The worker sees the job the same way on 0.33.0, whose
    scheduler never builds it.)  A load naming block 0 twice is refused before
    any write.
    """
    bpc, ids, sizes, firsts, chunks = NULL_JOB
    kv, buf, oracle_kv, _, worker, oracle_pool, _ = _worker_and_oracle(bpc, seed=5)
    spec = V.GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=firsts)
    assert worker.submit_store(3, V.worker_gpu_arg(spec, kv), V.CPULoadStoreSpec(chunks))
    _vllm_direct_copy(oracle_kv, oracle_pool, bpc, spec, chunks, store=True)
    assert torch.equal(worker.pool, oracle_pool)
    # Block 0's page really went into its sub-slots (e.g. chunk 2, sub-slots 0 and 1 of tensor 0).
    views = S.canonical_gpu_tensors(kv)
    layout = worker.layout
    for j in (0, 1):
        at = layout.sub_slot_offset(0, 0, j)
        assert torch.equal(worker.pool[2, at : at + 80], views[0][0, :80])
    (result,) = worker.get_finished()
    # Placeholders count, as vLLM's worker counts them (group_size * page bytes per ref).
    assert result.transfer_size == 10 * (80 + 64)

    before, pool_before = buf.clone(), worker.pool.clone()
    with pytest.raises(ValueError, match="more than once"):
        worker.submit_load(4, V.CPULoadStoreSpec(chunks), V.worker_gpu_arg(spec, kv))
    assert torch.equal(buf, before) and torch.equal(worker.pool, pool_before)
    assert worker.get_finished() == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_worker_on_cuda_uses_pinned_pool_and_matches_cpu() -> None:
    bpc, ids, sizes, firsts, chunks = JOBS[2]
    kv_cpu, buf_cpu = _canonical(20, PAGES, STRIDES, REFS, seed=3)
    kv_gpu, buf_gpu = _canonical(20, PAGES, STRIDES, REFS, seed=3, device="cuda")
    cpu, gpu = (
        S.ReferenceOffloadingWorker(kv_cpu, bpc, 8),
        S.ReferenceOffloadingWorker(kv_gpu, bpc, 8),
    )
    assert gpu.pool.is_pinned() and not cpu.pool.is_pinned()
    spec = V.GPULoadStoreSpec(ids, group_sizes=sizes, block_indices=firsts)
    back = V.GPULoadStoreSpec([19 - b for b in ids], group_sizes=sizes, block_indices=firsts)
    for w, kv in ((cpu, kv_cpu), (gpu, kv_gpu)):
        w.submit_store(1, V.worker_gpu_arg(spec, kv), V.CPULoadStoreSpec(chunks))
        w.submit_load(2, V.CPULoadStoreSpec(chunks), V.worker_gpu_arg(back, kv))
    torch.cuda.synchronize()
    assert torch.equal(cpu.pool, gpu.pool)
    assert torch.equal(buf_cpu, buf_gpu.cpu())


# ---------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------


def _offloading_config(extra: dict, bpc: int = 2) -> Any:
    vc, resolved = D.build_vllm_config(
        D.full_swa_kv_cache_config(num_blocks=64),
        extra_config={**SPEC, "blocks_per_chunk": bpc, **extra},
        num_gpu_blocks=64,
    )
    config = V.build_offloading_config(vc, resolved)
    # Exactly ``extra`` (build_vllm_config adds num_cpu_chunks for this spec when unsized).
    return dataclasses.replace(config, extra_config={**SPEC, "blocks_per_chunk": bpc, **extra})


@pytest.mark.parametrize("cpu_bytes", [1, 10**6, 123_456_789])
def test_spec_sizes_the_tier_like_cpu_offloading_spec(cpu_bytes: int) -> None:
    config = _offloading_config({"cpu_bytes_to_use": cpu_bytes})
    ours, theirs = S.ReferenceOffloadingSpec(config), V.CPUOffloadingSpec(config)
    assert (ours.num_chunks, ours.kv_bytes_per_chunk) == (
        theirs.num_chunks,
        theirs.kv_bytes_per_chunk,
    )
    assert ours.cpu_info == theirs.cpu_info


def test_spec_manager_is_vllms_cpu_manager() -> None:
    spec = S.ReferenceOffloadingSpec(
        _offloading_config({"num_cpu_chunks": 37, "cpu_bytes_to_use": 1 << 30})
    )
    manager = spec.get_manager()
    assert type(manager) is V.CPUOffloadingManager
    assert manager._num_chunks == 37  # num_cpu_chunks wins over cpu_bytes_to_use
    assert spec.get_manager() is manager


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({}, "num_cpu_chunks"),
        ({"num_cpu_chunks": -1}, ">= 0"),
        ({"num_cpu_chunks": 2.5}, "integer"),
        ({"num_cpu_chunks": True}, "integer"),
        ({"cpu_bytes_to_use": "lots"}, "integer"),
    ],
)
def test_spec_rejects_bad_sizing(extra: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        S.ReferenceOffloadingSpec(_offloading_config(extra))


def test_spec_rejects_canonical_layout() -> None:
    config = dataclasses.replace(_offloading_config({"num_cpu_chunks": 4}), canonical_layout=True)
    with pytest.raises(ValueError, match="canonical_layout"):
        S.ReferenceOffloadingSpec(config)


def test_spec_worker_runs_where_vllms_cpu_worker_refuses() -> None:
    config = _offloading_config({"num_cpu_chunks": 5, "cpu_bytes_to_use": 1 << 20})
    kv, _ = _canonical(64, [4096, 4096], [4096, 4096], [[(0, 4096)], [(1, 4096)]])
    worker = S.ReferenceOffloadingSpec(config).get_worker(kv)
    assert isinstance(worker, S.ReferenceOffloadingWorker) and worker.num_chunks == 5
    assert tuple(worker.pool.shape) == (5, 2 * (4096 + 4096))
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="CUDA"):
            V.CPUOffloadingSpec(config).get_worker(kv)


# ---------------------------------------------------------------------------
# Through the connector
# ---------------------------------------------------------------------------


def test_real_worker_path_dispatches_the_same_jobs() -> None:
    """The driver with the reference worker schedules exactly what it schedules with the emulated engine."""
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_swa_kv_cache_config(num_blocks=256),
        extra_config={**SPEC, "blocks_per_chunk": 2},
        num_gpu_blocks=256,
        num_cpu_chunks=64,
        max_num_batched_tokens=128,
    )
    prompt = tuple(range(1000, 1300))
    runs = []
    for runner in (None, kvdata.SyntheticModelRunner(driver.worker_kv_cache_config)):
        s = driver.session(model_runner=runner)
        s.add_request(RequestSpec("A", prompt, max_tokens=2))
        s.run_until_idle()
        assert s.reset_prefix_cache()
        s.add_request(RequestSpec("B", prompt, max_tokens=2))
        s.run_until_idle()
        runs.append(s.dispatched)
    assert runs[0] == runs[1]
    assert {d.kind for d in runs[0]} == {"store", "load"}
    assert runner is not None and runner.stats.loaded_blocks_checked == 12
    assert runner.stats.corrupted_loads == 0


def test_model_runner_session_refuses_faults() -> None:
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_attention_kv_cache_config(num_blocks=32), extra_config=SPEC, num_gpu_blocks=32
    )
    runner = kvdata.SyntheticModelRunner(driver.worker_kv_cache_config)
    with pytest.raises(ValueError, match="faults"):
        driver.session(model_runner=runner, faults=[D.JobFault(0, never=True)])


# ---------------------------------------------------------------------------
# Synthetic contents
# ---------------------------------------------------------------------------


def test_expected_bytes_depend_on_layer_position_and_prefix_only() -> None:
    h = kv_pattern.prefix_hashes([5, 6, 7, 8])
    assert h == kv_pattern.prefix_hashes([5, 6, 7, 8, 9])[:5]
    assert (
        kv_pattern.prefix_hashes([5, 6, 7, 9])[3] == h[3]
        and kv_pattern.prefix_hashes([5, 6, 7, 9])[4] != h[4]
    )
    a = kv_pattern.expected_bytes("L0", 3, h[4], 100)
    assert a.dtype == torch.uint8 and a.shape == (100,)
    assert torch.equal(a, kv_pattern.expected_bytes("L0", 3, h[4], 100))
    for other in (
        kv_pattern.expected_bytes("L1", 3, h[4], 100),
        kv_pattern.expected_bytes("L0", 2, h[4], 100),
        kv_pattern.expected_bytes("L0", 3, h[3], 100),
    ):
        # Different seeds differ in every aligned 8-byte word.
        assert bool((a[:96].view(-1, 8) != other[:96].view(-1, 8)).any(dim=1).all())
    rows = kv_pattern.expected_rows("L0", [3, 2], [h[4], h[4]], 100)
    assert torch.equal(rows[0], a)


def test_runner_places_layers_where_vllm_puts_them() -> None:
    """For planned KV tensors the runner's byte pages alias vLLM's own per-layer views."""
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_swa_kv_cache_config(num_blocks=16), extra_config=SPEC, num_gpu_blocks=16
    )
    planned = kv_memory.with_planned_tensors(driver.kv_cache_config, driver.vllm_config)
    runner = kvdata.SyntheticModelRunner(planned, driver.vllm_config)
    assert set(runner.layers) == set(runner.kv_caches)
    for name, layer in runner.layers.items():
        view = runner.kv_caches[name]
        assert layer.pages.data_ptr() == view.data_ptr()
        assert layer.pages.stride(0) == view.stride(0) * view.element_size()
    # vLLM overlays the groups: both layers start at the same byte.
    (full, swa) = runner.layers.values()
    assert full.pages.data_ptr() == swa.pages.data_ptr()
