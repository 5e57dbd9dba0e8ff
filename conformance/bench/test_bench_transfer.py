"""Transfer: :mod:`reference.transfer_fast` gather/scatter vs one contiguous copy of the same bytes.

The KV tensors are the canonical tensors vLLM 0.33.0's own ``register_kv_caches``
builds for the fixture's worker-view config (``NUM_BLOCKS`` blocks, allocated by
vLLM's ``allocate_kv_cache`` through :class:`conformance.harness.kvdata.SyntheticModelRunner`):
gemma-4-31B-it TP2 gives 10 tensors of 131072-byte pages (one buffer, shared by
its 6 groups), DeepSeek-V4-Flash TP4 one tensor of 1002240-byte packed blocks.
A job moves ``JOB_BLOCKS`` random, non-contiguous blocks of one group (every
layer of it) to/from randomly chosen chunk slots; the limit is one contiguous
``copy_`` of the same number of bytes between the same two buffers, at random
offsets.  Every measured job is checked byte for byte first.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from conformance.bench import (
    CASES,
    GEOMETRIES,
    THREADS,
    Measured,
    Variant,
    case_id,
    measure,
    record,
    rounded,
)
from conformance.testing.requires import require_vllm
from reference.mathutil import cdiv
from reference.transfer import TransferLayout
from reference.transfer_fast import gather, scatter

require_vllm()

NUM_BLOCKS = 1024
"""GPU blocks of the benchmark KV cache (gemma: 1.25 GiB, DeepSeek-V4: 0.93 GiB)."""
JOB_BLOCKS = 64
"""Blocks per measured job (gemma: 80 MiB, DeepSeek-V4: 61 MiB)."""
DIRECTIONS = ("gather", "scatter")


@dataclass(eq=False)
class KvGeometry:
    name: str
    base_layout: TransferLayout
    tensors: list[torch.Tensor]
    flat: torch.Tensor
    """1-D bytes of the largest storage behind the tensors (the limit copy's KV side)."""
    owner: Any
    """Keeps vLLM's allocation alive."""

    def layout(self, blocks_per_chunk: int) -> TransferLayout:
        return TransferLayout.uniform(
            self.base_layout.page_bytes, self.base_layout.group_refs, blocks_per_chunk
        )

    @property
    def group(self) -> int:
        """The group with the most bytes per block (ties: the first)."""
        sizes = [sum(r.nbytes for r in refs) for refs in self.base_layout.group_refs]
        return sizes.index(max(sizes))

    def block_bytes(self) -> int:
        return sum(r.nbytes for r in self.base_layout.group_refs[self.group])


def _flat(storage: Any) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))


@functools.lru_cache(maxsize=1)
def kv_geometry(name: str) -> KvGeometry:
    """vLLM's canonical KV tensors for fixture ``name``, every page touched and row-tagged."""
    from conformance.harness.fixture_runs import fixture_driver
    from conformance.harness.kvdata import SyntheticModelRunner

    driver = fixture_driver(
        name, {"blocks_per_chunk": 1}, num_gpu_blocks=NUM_BLOCKS, num_cpu_chunks=1
    )
    runner = SyntheticModelRunner(
        driver.worker_kv_cache_config, driver.vllm_config, check_loads=False
    )
    session = driver.session(model_runner=runner, record=False)
    worker = session.worker_connector.connector_worker.worker
    tensors = list(worker.gpu_tensors)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
    flats = [_flat(s) for s in storages.values()]
    for f in flats:
        f.fill_(0x5A)  # fault every page in: untouched pages would read as the shared zero page
    for t, tensor in enumerate(tensors):
        tags = torch.arange(tensor.shape[0], dtype=torch.int64) + (t << 32)
        tensor[:, :8] = tags.view(torch.uint8).view(-1, 8)
    return KvGeometry(
        name, worker.layout, tensors, max(flats, key=lambda f: f.numel()), (runner, session)
    )


@dataclass(eq=False)
class TransferJob:
    layout: TransferLayout
    group: int
    block_ids: torch.Tensor
    group_sizes: list[int]
    block_indices: list[int]
    slot_ids: torch.Tensor
    pool: torch.Tensor
    nbytes: int

    def args(self) -> tuple[Any, ...]:
        return (self.block_ids, self.group_sizes, self.block_indices, self.slot_ids)


def make_job(kv: KvGeometry, blocks_per_chunk: int, seed: int) -> TransferJob:
    layout = kv.layout(blocks_per_chunk)
    gen = torch.Generator().manual_seed(seed)
    g = kv.group
    chunks = cdiv(JOB_BLOCKS, blocks_per_chunk)
    ids = torch.randperm(NUM_BLOCKS, generator=gen)[:JOB_BLOCKS]
    slots = torch.randperm(2 * chunks, generator=gen)[:chunks]
    sizes = [0] * layout.num_groups
    sizes[g] = JOB_BLOCKS
    pool = torch.empty((2 * chunks, layout.slot_bytes), dtype=torch.uint8)
    pool.fill_(0xA5)
    return TransferJob(
        layout, g, ids, sizes, [0] * layout.num_groups, slots, pool, JOB_BLOCKS * kv.block_bytes()
    )


def check_job(kv: KvGeometry, job: TransferJob) -> list[str]:
    """Every copied byte range of ``job``: KV row == its sub-slot (empty when all agree)."""
    bad = []
    b = job.layout.blocks_per_chunk[job.group]
    for k, block in enumerate(job.block_ids.tolist()):
        slot = int(job.slot_ids[k // b])
        for ref in job.layout.group_refs[job.group]:
            off = job.layout.sub_slot_offset(job.group, ref.tensor_index, k % b)
            row = kv.tensors[ref.tensor_index][block, : ref.nbytes]
            if not np.array_equal(job.pool[slot, off : off + ref.nbytes].numpy(), row.numpy()):
                bad.append(f"block {block} (tensor {ref.tensor_index}) vs slot {slot} offset {off}")
    return bad


def verify(kv: KvGeometry, job: TransferJob) -> None:
    """Gather, check; scramble the job's KV rows, scatter, check again."""
    gather(job.layout, kv.tensors, job.pool, *job.args())
    bad = check_job(kv, job)
    assert not bad, f"gather wrote wrong bytes: {bad[:3]}"
    for ref in job.layout.group_refs[job.group]:
        kv.tensors[ref.tensor_index][job.block_ids, :8] = 0
    scatter(job.layout, kv.tensors, job.pool, *job.args())
    bad = check_job(kv, job)
    assert not bad, f"scatter wrote wrong bytes: {bad[:3]}"


PARAMS = [(g, b, d) for g, b in CASES for d in DIRECTIONS]


@pytest.mark.parametrize(
    "geometry,blocks_per_chunk,direction",
    PARAMS,
    ids=[f"{case_id((g, b))}-{d}" for g, b, d in PARAMS],
)
def test_transfer(benchmark: Any, geometry: str, blocks_per_chunk: int, direction: str) -> None:
    torch.set_num_threads(THREADS)
    kv = kv_geometry(geometry)
    job = make_job(kv, blocks_per_chunk, seed=blocks_per_chunk)
    verify(kv, job)
    rng = random.Random(blocks_per_chunk)
    pool_flat = job.pool.view(-1)
    n = job.nbytes

    def limit(_: Any) -> None:
        src = rng.randrange(0, kv.flat.numel() - n + 1) & ~4095
        dst = rng.randrange(0, pool_flat.numel() - n + 1) & ~4095
        if direction == "gather":
            pool_flat[dst : dst + n].copy_(kv.flat[src : src + n])
        else:
            kv.flat[src : src + n].copy_(pool_flat[dst : dst + n])

    copy = gather if direction == "gather" else scatter

    def candidate(_: Any) -> None:
        copy(job.layout, kv.tensors, job.pool, *job.args())

    m: Measured = measure(benchmark, Variant(candidate), {"memcpy": Variant(limit)})
    cand, base = m.median(), m.median("memcpy")
    record(
        benchmark,
        kind="transfer",
        geometry=geometry,
        label=GEOMETRIES[geometry],
        blocks_per_chunk=blocks_per_chunk,
        direction=direction,
        bytes=n,
        job_blocks=JOB_BLOCKS,
        group=job.group,
        num_tensors=len(job.layout.group_refs[job.group]),
        page_bytes=list(job.layout.page_bytes),
        threads=torch.get_num_threads(),
        **m.ratio_fields(
            "memcpy", speed=True,
            about={"kind": "transfer", "blocks_per_chunk": blocks_per_chunk},
        ),
        ratio_of_medians=base / cand,
        candidate_gbps=n / cand / 1e9,
        limit_gbps=n / base / 1e9,
        candidate_s=rounded(m.candidate),
        baseline_s=rounded(m.baselines["memcpy"]),
    )
