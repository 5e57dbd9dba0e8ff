"""CPU tests of the CUDA lanes' CPU side: :mod:`conformance.harness.gpu_copy`, :mod:`conformance.harness.e2e`.

vLLM's CUDA worker cannot run here; ``EmulatedVllmWorker`` (``tests/emulated_worker.py``)
stands in for it (vLLM's own descriptor code, ``memmove`` as copy engine) over
a real ``SharedOffloadRegion`` in ``/dev/shm`` with the numbers of a real
``CPUOffloadingSpec``, so the differential, the layout helpers and the failure
messages are exercised end to end.
"""

from __future__ import annotations

import gc
import os
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conformance.testing.requires import require_vllm

require_vllm()

from emulated_worker import EmulatedVllmWorker  # noqa: E402

from conformance.harness import e2e as E  # noqa: E402
from conformance.harness import gpu_copy as G  # noqa: E402
from reference.transfer import TensorRef, TransferLayout  # noqa: E402
from reference.transfer_fast import plan_copies  # noqa: E402

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parent.parent
KVCHUNK = "KvchunkOffloadingConnector"
KVCHUNK_MODULE = "vllm_adapter.connector"
CUDA_AVAILABLE = torch.cuda.is_available()
needs_shm = pytest.mark.skipif(
    G.shm_free_bytes() < (256 << 20), reason="needs /dev/shm (256 MiB free)"
)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def _driver(name: str, extra: dict[str, int], kvchunk: bool, nb: int, nc: int) -> Any:
    from conformance.harness.fixture_runs import fixture_driver

    return fixture_driver(
        name,
        extra,
        num_gpu_blocks=nb,
        num_cpu_chunks=nc,
        connector=KVCHUNK if kvchunk else "OffloadingConnector",
        connector_module_path=KVCHUNK_MODULE if kvchunk else None,
    )


class _Rig:
    """The lane's setup on CPU: emulated vLLM worker over a real shared region (or private tensors)."""

    def __init__(
        self,
        name: str,
        extra: dict[str, int],
        kvchunk: bool,
        nb: int,
        nc: int,
        *,
        shared: bool = True,
        mutate: Any = None,
        seed: int = 0,
    ) -> None:
        from conformance.harness import vllm_harness_api as V
        from conformance.harness.kvdata import SyntheticModelRunner
        from vllm_adapter.spec import ReferenceOffloadingWorker

        self.nb, self.nc = nb, nc
        self.driver = _driver(name, extra, kvchunk, nb, nc)
        kvc, vc = self.driver.worker_kv_cache_config, self.driver.vllm_config
        self.runner = SyntheticModelRunner(kvc, vc, check_loads=False)
        self.kv = G.canonical_kv_caches(vc, kvc, self.runner.kv_caches)
        world = G.cpu_offloading_spec(vc, kvc, nc).config.parallel.world_size
        self.spec = G.cpu_offloading_spec(vc, kvc, nc, rank=world - 1)
        self.pages = [int(t.page_size_bytes) for t in self.kv.tensors]
        b = self.spec.blocks_per_chunk
        region = None
        if shared:
            region = V.SharedOffloadRegion(
                engine_id=self.spec.config.engine_id,
                num_chunks=nc,
                rank=0 if self.spec.replicated_layout else self.spec.config.parallel.rank,
                kv_bytes_per_chunk=self.spec.kv_bytes_per_chunk,
                cpu_page_size=self.spec.cpu_page_size_per_worker,
                barrier=lambda: None,  # unlinks the /dev/shm file at once, as vLLM does
            )
            views = [region.create_next_worker_view(p * b) for p in self.pages]
        else:
            views = [torch.zeros((nc, p * b), dtype=torch.int8) for p in self.pages]
        self.worker = EmulatedVllmWorker(self.kv, b, views, mmap_region=region, mutate=mutate)
        self.tier, self.problems = G.vllm_worker_tier(self.worker, self.spec, self.pages)
        self.ref = ReferenceOffloadingWorker(self.kv, b, nc, pin_memory=False)
        self.diff = G.CopyDifferential(self.kv, self.ref, self.worker, self.tier, seed=seed)

    def random_jobs(self, count: int, seed: int = 0) -> list[G.Job]:
        return G.random_jobs(
            random.Random(seed),
            num_groups=self.diff.layout.num_groups,
            blocks_per_chunk=self.spec.blocks_per_chunk,
            num_gpu_blocks=self.nb,
            num_chunks=self.nc,
            count=count,
        )

    def close(self) -> None:
        worker = self.worker
        del self.diff, self.tier, self.worker
        gc.collect()
        worker.shutdown()


@pytest.fixture
def rigs() -> Any:
    made: list[_Rig] = []

    def make(*args: Any, **kwargs: Any) -> _Rig:
        rig = _Rig(*args, **kwargs)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


def _layouts() -> list[TransferLayout]:
    return [
        TransferLayout.uniform((64,), ((TensorRef(0, 64),),), 1),
        TransferLayout.uniform(
            (64, 32), ((TensorRef(0, 48), TensorRef(1, 32)), (TensorRef(0, 64),)), 2
        ),
        TransferLayout.uniform(
            (128, 64, 64),
            ((TensorRef(2, 64),), (TensorRef(0, 100), TensorRef(1, 64)), (TensorRef(1, 8),)),
            4,
        ),
    ]


# ---------------------------------------------------------------------------
# Jobs and sub-slots
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layout", _layouts(), ids=lambda lay: f"bpc{lay.blocks_per_chunk[0]}-{lay.num_groups}g"
)
def test_job_sub_slots_are_the_reference_plan(layout: TransferLayout) -> None:
    jobs = G.random_jobs(
        random.Random(7),
        num_groups=layout.num_groups,
        blocks_per_chunk=layout.blocks_per_chunk[0],
        num_gpu_blocks=200,
        num_chunks=40,
        count=200,
    )
    assert {j.kind for j in jobs} == {"store", "load"}
    for job in jobs:
        mine = {
            (c.tensor, c.block_id, c.chunk, c.sub_slot, c.nbytes)
            for c in G.job_sub_slots(layout, job)
        }
        plan = plan_copies(layout, job.block_ids, job.group_sizes, job.block_indices, job.chunk_ids)
        theirs = {
            (t.tensor_index, int(b), int(s), int(j), int(n))
            for t in plan
            for b, s, j, n in zip(t.block_ids, t.slot_ids, t.sub_slots, t.nbytes, strict=True)
        }
        assert mine == theirs, job.describe()
        assert 0 not in job.block_ids
        assert len(set(job.block_ids)) == len(job.block_ids)
        assert len(set(job.chunk_ids)) == len(job.chunk_ids)


def test_job_sub_slots_rejects_ids_left_over() -> None:
    layout = _layouts()[1]
    job = G.Job("store", (1, 2, 3), (2, 0), (0, 0), (5, 6))
    with pytest.raises(ValueError, match="unconsumed"):
        G.job_sub_slots(layout, job)
    with pytest.raises(ValueError, match="kind"):
        G.Job("copy", (), (), (), ())


def test_job_specs_are_vllm_specs() -> None:
    from conformance.harness import vllm_harness_api as V

    job = G.Job("load", (4, 5, 6), (1, 2), (3, 8), (9, 2, 3))
    src, dst = job.specs()
    assert isinstance(src, V.CPULoadStoreSpec) and isinstance(dst, V.GPULoadStoreSpec)
    assert list(dst.block_ids) == [4, 5, 6] and list(dst.group_sizes) == [1, 2]
    assert list(dst.block_indices) == [3, 8] and list(src.block_ids) == [9, 2, 3]
    src, dst = dataclass_replace_kind(job, "store").specs()
    assert isinstance(src, V.GPULoadStoreSpec) and isinstance(dst, V.CPULoadStoreSpec)


def test_job_specs_with_kv_caches_are_what_the_connector_worker_passes() -> None:
    """With the workers' canonical tensors, the GPU side is vLLM's worker argument.

    0.33.0: the ``GPULoadStoreSpec``; 0.34.0: ``DevicePointers`` resolved over the
    tensors, which decode back to the job's blocks.
    """
    from conformance.harness import vllm_harness_api as V

    buf = torch.zeros(16 * 96, dtype=torch.int8)
    kv = V.CanonicalKVCaches(
        tensors=[V.CanonicalKVCacheTensor(tensor=buf.view(16, 96), page_size_bytes=96)],
        group_data_refs=[[V.CanonicalKVCacheRef(0, 80)], [V.CanonicalKVCacheRef(0, 96)]],
    )
    job = G.Job("load", (4, 5, 6), (1, 2), (3, 8), (9, 2, 3))
    src, dst = job.specs(kv)
    assert isinstance(src, V.CPULoadStoreSpec)
    want = V.DevicePointers if V.WORKER_TAKES_DEVICE_POINTERS else V.GPULoadStoreSpec
    assert isinstance(dst, want)
    got = V.gpu_blocks(dst, kv)
    assert (got.block_ids.tolist(), got.group_sizes, got.block_indices) == (
        [4, 5, 6],
        (1, 2),
        (3, 8),
    )
    gpu, _ = dataclass_replace_kind(job, "store").specs(kv)
    assert isinstance(gpu, want)


def dataclass_replace_kind(job: G.Job, kind: str) -> G.Job:
    import dataclasses

    return dataclasses.replace(job, kind=kind)


# ---------------------------------------------------------------------------
# vLLM's CPU layout
# ---------------------------------------------------------------------------

GEOMETRIES = [
    ("synthetic-full-swa", {"blocks_per_chunk": 2}, False, 160, 64),
    ("synthetic-full-mamba-align", {"blocks_per_chunk": 4}, False, 96, 48),
    ("gemma-4-31B-it-tp2", {"block_size": 512}, True, 32, 4),
    ("deepseek-v4-flash-tp4", {"block_size": 512}, True, 32, 8),
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: g[0])
def test_layout_formula_is_cpu_offloading_spec_arithmetic(geometry: tuple[Any, ...]) -> None:
    """Design notes 1.7 / 6.2, stated independently, against a real CPUOffloadingSpec."""
    name, extra, kvchunk, nb, nc = geometry
    driver = _driver(name, extra, kvchunk, nb, nc)
    kvc, vc = driver.worker_kv_cache_config, driver.vllm_config
    world = G.cpu_offloading_spec(vc, kvc, nc).config.parallel.world_size
    for rank in range(world):
        spec = G.cpu_offloading_spec(vc, kvc, nc, rank=rank)
        assert spec.num_chunks == nc
        pages = [1000 + 24 * t for t in range(3)]  # any pages that fit in the worker area
        if sum(pages) > spec.config.worker_kv_bytes_per_block:
            pages = [spec.config.worker_kv_bytes_per_block]
        want = G.VllmCpuLayout.from_numbers(
            pages,
            blocks_per_chunk=spec.blocks_per_chunk,
            num_chunks=nc,
            worker_kv_bytes_per_block=spec.config.worker_kv_bytes_per_block,
            world_size=world,
            rank=rank,
            replicated=spec.replicated_layout,
        )
        assert G.VllmCpuLayout.for_spec(spec, pages) == want
        assert want.row_stride % 4096 == 0
    if kvchunk:
        from vllm_adapter.fixtures import load_fixture

        # kvchunk's block_size 512, by the fixture's scheduler block (tokens): gemma 16 blocks
        # per chunk with vLLM 0.33.0's 32-token blocks, 4 with 0.34.0's 128-token ones (0.34.0
        # plans gemma-4 with 64-token kernel blocks, 0.33.0 with 16); DeepSeek-V4 2 (256).
        block = int(load_fixture(name)["resolved"]["scheduler_block_size"])
        want_b = {
            ("gemma-4-31B-it-tp2", 32): 16,
            ("gemma-4-31B-it-tp2", 128): 4,
            ("deepseek-v4-flash-tp4", 256): 2,
        }
        assert (name, block) in want_b, f"no expected blocks_per_chunk for {name} at {block}"
        assert spec.blocks_per_chunk == want_b[name, block]


def test_layout_rejects_areas_past_the_worker_slot() -> None:
    with pytest.raises(ValueError, match="past this worker's area"):
        G.VllmCpuLayout((64, 64), 2, 4, row_stride=4096, worker_offset=0, cpu_page_size=200)
    with pytest.raises(ValueError, match="row stride"):
        G.VllmCpuLayout((64,), 1, 4, row_stride=100, worker_offset=64, cpu_page_size=64)
    lay = G.VllmCpuLayout((64, 32), 2, 3, row_stride=4096, worker_offset=1024, cpu_page_size=1024)
    assert lay.sub_slot_offset(2, 1, 1) == 2 * 4096 + 1024 + 128 + 32
    assert lay.unused_ranges() == [(0, 1024), (1024 + 192, 4096)]


@needs_shm
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: g[0])
def test_vllm_region_views_sit_where_the_layout_says(geometry: tuple[Any, ...], rigs: Any) -> None:
    rig = rigs(*geometry)
    assert rig.problems == []
    assert isinstance(rig.tier, G.RegionTier)
    lay = rig.tier.layout
    assert lay.worker_offset == rig.spec.config.parallel.rank * rig.spec.cpu_page_size_per_worker
    # Tensors' byte offsets inside a row: packed one after another from the worker offset.
    for t, page in enumerate(rig.pages):
        assert (
            lay.tensor_offset(t)
            == lay.worker_offset + sum(rig.pages[:t]) * rig.spec.blocks_per_chunk
        )
        assert (
            lay.sub_slot_offset(1, t, 0) - lay.sub_slot_offset(0, t, 0)
            == rig.spec.kv_bytes_per_chunk
        )
        assert page > 0


def test_tiers_read_the_formula_offsets() -> None:
    layout = TransferLayout.uniform((64, 32), ((TensorRef(0, 48), TensorRef(1, 32)),), 2)
    pool = torch.zeros((3, layout.slot_bytes), dtype=torch.uint8)
    ref = G.ReferenceTier(pool, layout)
    vl = G.VllmCpuLayout((64, 32), 2, 3, row_stride=1024, worker_offset=512, cpu_page_size=256)
    region = torch.zeros(3 * 1024, dtype=torch.int8)
    vt = G.RegionTier(region, vl)
    flat = pool.view(-1)
    for c in range(3):
        for t in range(2):
            for j in range(2):
                marker = 1 + c * 4 + t * 2 + j
                flat[c * layout.slot_bytes + layout.sub_slot_offset(0, t, j)] = marker
                region[vl.sub_slot_offset(c, t, j)] = marker
    for t in range(2):
        chunks = torch.tensor([0, 1, 2, 2]).long()
        subs = torch.tensor([1, 0, 0, 1]).long()
        assert torch.equal(ref.rows(t, chunks, subs, 1), vt.rows(t, chunks, subs, 1))
        assert ref.rows(t, chunks, subs, 1)[:, 0].tolist() == [
            2 + 2 * t,
            5 + 2 * t,
            9 + 2 * t,
            10 + 2 * t,
        ]
    other = torch.zeros((3, 64 * 2), dtype=torch.int8), torch.zeros((3, 32 * 2), dtype=torch.int8)
    tt = G.TensorsTier(other, (64, 32), 2)
    G.copy_tier(ref, tt)
    assert G.compare_tiers(tt, ref, "copy")[1] == []


# ---------------------------------------------------------------------------
# Comparisons and their messages
# ---------------------------------------------------------------------------


def test_compare_sub_slots_names_group_chunk_sub_slot_and_byte() -> None:
    layout = TransferLayout.uniform(
        (64, 32), ((TensorRef(0, 48), TensorRef(1, 32)), (TensorRef(0, 64),)), 2
    )
    pool_a = torch.randint(0, 256, (4, layout.slot_bytes), dtype=torch.uint8)
    pool_b = pool_a.clone()
    a, b = G.ReferenceTier(pool_a, layout), G.ReferenceTier(pool_b, layout)
    a.name = "vLLM"
    job = G.Job("store", (10, 11, 12), (2, 1), (1, 4), (3, 0, 2))
    copies = G.job_sub_slots(layout, job)
    compared, failures = G.compare_sub_slots(a, b, copies, "store job 1")
    assert failures == [] and compared == 2 * (48 + 32) + 64
    # Group 0's second block (position 2) sits in chunk 0, sub-slot 0; corrupt byte 40 of tensor 0 there.
    b.area(0)[0, 0, 40] ^= 0xFF
    # Bytes past nbytes (48) of that sub-slot are not compared.
    b.area(0)[0, 0, 50] ^= 0xFF
    compared, failures = G.compare_sub_slots(a, b, copies, "store job 1")
    assert len(failures) == 1
    msg = failures[0]
    for part in (
        "store job 1",
        "group 0",
        "chunk 0",
        "sub-slot 0",
        "tensor 0",
        "GPU block 11",
        "block position 2",
        "byte offset 40",
        "1 of 48 bytes",
    ):
        assert part in msg, msg


def test_compare_tiers_finds_bytes_written_outside_the_worker_area() -> None:
    vl = G.VllmCpuLayout((64,), 2, 2, row_stride=4096, worker_offset=1024, cpu_page_size=1024)
    layout = TransferLayout.uniform((64,), ((TensorRef(0, 64),),), 2)
    ref = G.ReferenceTier(torch.zeros((2, layout.slot_bytes), dtype=torch.uint8), layout)
    region = torch.zeros(vl.total_bytes, dtype=torch.uint8)
    vt = G.RegionTier(region, vl)
    assert G.compare_tiers(vt, ref, "end") == (2 * 2 * 64, [])
    region[4096 + 1024 + 200] = 7  # slack of rank's slot in chunk 1
    region[100] = 1  # another rank's slot in chunk 0
    _, failures = G.compare_tiers(vt, ref, "end")
    assert len(failures) == 2
    assert (
        "outside this worker's tensor areas" in failures[0]
        and "chunk 0 row byte 100" in failures[0]
    )
    assert "chunk 1 row byte 1224" in failures[1]
    vt.area(0)[1, 1, 3] = 9
    _, failures = G.compare_tiers(vt, ref, "end")
    assert "chunk 1 sub-slot 1 byte offset 3" in failures[0]


# ---------------------------------------------------------------------------
# The differential on CPU (emulated vLLM copies)
# ---------------------------------------------------------------------------


@needs_shm
@pytest.mark.parametrize(
    "geometry, shared",
    [
        (("synthetic-full-swa", {"blocks_per_chunk": 2}, False, 160, 64), True),
        (("synthetic-full-swa", {"block_size": 256}, True, 160, 64), False),
        (("synthetic-full-mamba-align", {"blocks_per_chunk": 2}, False, 96, 48), True),
        (("synthetic-eagle", {"blocks_per_chunk": 2}, False, 160, 64), True),
    ],
    ids=lambda v: v[0] if isinstance(v, tuple) else ("shared" if v else "private"),
)
def test_emulated_vllm_copies_match_the_reference(
    geometry: tuple[Any, ...], shared: bool, rigs: Any
) -> None:
    rig = rigs(*geometry, shared=shared)
    jobs = G.record_jobs(rig.driver, prompt_len=600, budget=128, origin=geometry[0])
    assert {j.kind for j in jobs} == {"store", "load"}
    step = None
    for job in jobs:
        if job.step != step:
            rig.diff.randomize_gpu()
            step = job.step
        rig.diff.run(job)
    rig.diff.randomize_cpu()
    for job in rig.random_jobs(30):
        rig.diff.run(job)
    stats = rig.diff.finish()
    assert not stats.failures, stats.describe()
    assert stats.stores > 5 and stats.loads > 5 and stats.gpu_rows_loaded > 0, stats.describe()
    assert stats.sub_slot_bytes_compared > 0 and stats.tier_bytes_compared > 0


@needs_shm
@pytest.mark.parametrize("geometry", GEOMETRIES[2:], ids=lambda g: g[0])
def test_emulated_vllm_copies_match_on_real_model_geometry(
    geometry: tuple[Any, ...], rigs: Any
) -> None:
    """gemma-4 (10 shared tensors, 16 blocks per chunk) and DeepSeek-V4 (one packed tensor), random jobs."""
    rig = rigs(*geometry)
    rig.diff.randomize_cpu()
    for k, job in enumerate(rig.random_jobs(6, seed=3)):
        if k % 2 == 0:
            rig.diff.randomize_gpu()
        rig.diff.run(job)
    stats = rig.diff.finish()
    assert not stats.failures, stats.describe()
    assert stats.stores and stats.loads, stats.describe()


def _swap_first_two(field: str, when_store: bool):  # noqa: ANN202
    def mutate(worker: Any, src: Any, dst: Any, sizes: Any, n: int, gpu_to_cpu: bool) -> None:
        if gpu_to_cpu == when_store and n >= 2 and sizes[0] == sizes[1]:
            arr = dst if field == "dst" else src
            arr[[0, 1]] = arr[[1, 0]]

    return mutate


def _short_store(worker: Any, src: Any, dst: Any, sizes: Any, n: int, gpu_to_cpu: bool) -> None:
    if gpu_to_cpu and n:
        sizes[0] -= 8


def _load_into_null_block(
    worker: Any, src: Any, dst: Any, sizes: Any, n: int, gpu_to_cpu: bool
) -> None:
    if not gpu_to_cpu and n:
        dst[0] = worker.gpu_tensors[0].data_ptr()  # block 0: never a destination


MUTATIONS = {
    "store_swapped_sub_slots": (_swap_first_two("dst", True), "sub-slot"),
    "store_8_bytes_short": (_short_store, "byte offset"),
    "load_swapped_sources": (_swap_first_two("src", False), "-> GPU block"),
    "load_into_another_block": (
        _load_into_null_block,
        "not a destination of this load (stray write by vLLM)",
    ),
}


@needs_shm
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_differential_catches_broken_vllm_copies(mutation: str, rigs: Any) -> None:
    mutate, expected = MUTATIONS[mutation]
    rig = rigs("synthetic-full-swa", {"blocks_per_chunk": 2}, False, 160, 64, mutate=mutate)
    rig.diff.randomize_cpu()
    for job in rig.random_jobs(12, seed=5):
        rig.diff.randomize_gpu()
        rig.diff.run(job)
    stats = rig.diff.finish()
    assert stats.failures, f"{mutation} went unnoticed: {stats.describe()}"
    assert any(expected in f for f in stats.failures), "\n".join(stats.failures)


# ---------------------------------------------------------------------------
# The lanes' own cases
# ---------------------------------------------------------------------------


def test_gpu_copy_lane_recorded_cases_store_and_load() -> None:
    """Every recorded-jobs case of the lane has stores and loads to compare (recorded on CPU)."""
    from conformance.lanes.test_gpu_copy import RECORDED

    for case in RECORDED:
        jobs = G.record_jobs(case.driver(), prompt_len=case.prompt_len, budget=case.budget)
        kinds = [j.kind for j in jobs]
        assert "store" in kinds and "load" in kinds, f"{case}: {kinds}"
        for job in jobs:
            assert (
                max(job.chunk_ids) < case.num_cpu_chunks
                and max(job.block_ids) < case.num_gpu_blocks
            )


def test_e2e_cases_keep_every_layer_kind() -> None:
    import json

    from conformance.harness import vllm_harness_api as V

    seen = set()
    for case in E.E2E_CASES:
        seen.add(case.model_dir)
        full = json.loads((E.MODELS_DIR / case.model_dir / "config.json").read_text())
        mc = V.ModelConfig(
            model=str(E.MODELS_DIR / case.model_dir),
            skip_tokenizer_init=True,
            hf_overrides=case.overrides(),
            max_model_len=4096,
        )
        text = mc.hf_text_config
        n = text.num_hidden_layers
        assert n == case.overrides()["num_hidden_layers"] < (full.get("num_hidden_layers") or 0)
        assert hash(case)
        assert len(text.layer_types) == n
        if case.model_dir == E.GEMMA4_TEXT:
            assert (
                set(text.layer_types)
                == set(full["layer_types"])
                == {"sliding_attention", "full_attention"}
            )
        else:
            assert set(text.layer_types) == {
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
            }
            assert (
                set(text.mlp_layer_types) == {"hash_moe", "moe"} and len(text.mlp_layer_types) == n
            )
    assert seen == {E.GEMMA4_TEXT, E.DSV4}
    knobs = {(c.model_dir, c.kvchunk, c.extra) for c in E.E2E_CASES}
    assert (E.GEMMA4_TEXT, True, (("block_size", 512),)) in knobs
    assert (E.DSV4, True, (("block_size", 512),)) in knobs
    assert any(not kvchunk and extra[0][0] == "blocks_per_chunk" for _, kvchunk, extra in knobs)


def test_e2e_engine_kwargs_are_engine_args() -> None:
    import dataclasses

    from conformance.harness import vllm_harness_api as V

    names = {f.name for f in dataclasses.fields(V.EngineArgs)}
    for case in E.E2E_CASES:
        kwargs = case.engine_kwargs(1 << 30)
        assert set(kwargs) <= names, set(kwargs) - names
        assert kwargs["load_format"] == "dummy" and kwargs["tensor_parallel_size"] == 1
        ktc = V.KVTransferConfig(**kwargs["kv_transfer_config"])
        extra = ktc.kv_connector_extra_config
        assert extra["spec_name"] == "CPUOffloadingSpec" and extra["cpu_bytes_to_use"] == 1 << 30
        if case.kvchunk:
            assert ktc.kv_connector == KVCHUNK and ktc.kv_connector_module_path == KVCHUNK_MODULE
        else:
            assert ktc.kv_connector == "OffloadingConnector"
        prompts = case.prompts(vocab_size=262144)
        assert len(prompts) == case.num_prompts and all(len(p) == case.prompt_len for p in prompts)
        half = case.prompt_len // 2
        assert prompts[1][:half] == prompts[0][:half] and prompts[1] != prompts[0]
        assert prompts == case.prompts(vocab_size=262144)


def test_metric_helpers() -> None:
    from types import SimpleNamespace as NS

    metrics = [
        NS(name="vllm:external_prefix_cache_hits", value=3, labels={"engine": "0"}),
        NS(name="vllm:external_prefix_cache_hits", value=4, labels={"engine": "1"}),
        NS(name="vllm:kv_offload_load_bytes", value=10, labels={}),
        NS(name="vllm:kv_offload_cpu_cache_usage_perc", value=0.5, labels={}),
        NS(name="vllm:histogram", values=[1], labels={}),
    ]
    assert E.metric_total(metrics, "vllm:external_prefix_cache_hits") == 7
    assert E.metric_total(metrics, "vllm:nope") is None
    assert E.offload_byte_counters(metrics) == {"vllm:kv_offload_load_bytes": 10}


def test_cuda_skip_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert G.cuda_skip_reason() == "needs CUDA (torch.cuda.is_available() is False)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert G.cuda_skip_reason() is None


@pytest.mark.skipif(CUDA_AVAILABLE, reason="checks the CPU-only behaviour")
def test_gpu_lanes_collect_and_skip_with_the_reason_on_cpu() -> None:
    lanes = ROOT / "conformance" / "lanes"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-rs",
            "-p",
            "conformance.plugin",
            "-p",
            "no:cacheprovider",
            str(lanes / "test_gpu_copy.py"),
            str(lanes / "test_e2e.py"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    from conformance.lanes.test_gpu_copy import RANDOM, RECORDED

    expected = len(RECORDED) + len(RANDOM) + len(E.E2E_CASES)
    assert re.search(rf"\b{expected} skipped\b", out), out[-3000:]
    assert not re.search(r"\d+ (passed|failed|error)", out), out[-3000:]
    assert out.count("needs CUDA (torch.cuda.is_available() is False)") >= 2, out[-3000:]
