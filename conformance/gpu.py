"""CPU-side helpers of the two CUDA lanes (``gpu_copy`` and ``e2e``).

Everything here runs without a GPU; the lanes (``conformance/lanes/test_gpu_copy.py``,
``test_e2e.py``) add the CUDA parts.  ``tests/test_gpu_helpers.py`` tests it on CPU.

gpu_copy: vLLM's CUDA copy path vs the reference copies
-------------------------------------------------------

The lane puts vLLM's real (0.33.0 or 0.34.0) ``CPUOffloadingWorker`` (``CPUOffloadingSpec``'s
worker: CUDA copy kernels into the shared ``/dev/shm`` region, or into private
pinned tensors) and :class:`vllm_adapter.spec.ReferenceOffloadingWorker`
(:mod:`reference.transfer` gather/scatter into a ``[num_chunks, slot_bytes]``
pool) over the *same* canonical KV tensors, feeds both the same store / load
specs (:class:`Job`: random ones, and ones recorded from a driver run with
:func:`record_jobs`), and compares (:class:`CopyDifferential`):

* after a store, every sub-slot the job writes (:func:`job_sub_slots`), bytes
  ``[0, nbytes)``, in vLLM's CPU layout and in the reference pool;
* after a load, the whole KV memory (vLLM's result and the reference's, from
  the same starting bytes);
* at the end (and after every job when the tiers are small), every sub-slot of
  every chunk, and that vLLM wrote nothing outside this worker's tensor areas
  of the shared region (row padding, other ranks' slots).

Both tiers start zeroed, so sub-slots no job wrote (leading nulls of a
windowed chunk, skipped sub-slots of a Mamba-align chunk) are zero in both.

vLLM's CPU layout (design notes section 6.2, :class:`VllmCpuLayout`): in the
shared region, sub-slot ``j`` of chunk ``c`` of canonical tensor ``t`` on worker
rank ``r`` starts at ``c * kv_bytes_per_chunk + r * cpu_page_size_per_worker +
sum(page[:t]) * bpc + j * page[t]``; ``kv_bytes_per_chunk`` is rounded up to
the host page size.  The reference pool is the same without the rank offset
and the padding (``c * slot_bytes + sum(page[:t]) * bpc + j * page[t]``).

On CPU, :class:`EmulatedVllmWorker` stands in for the CUDA worker: vLLM's own
descriptor code (``SingleDirectionOffloadingHandler._fill_direct_ops`` /
``compute_sub_block_ptrs``, called unchanged) computes every copy's addresses
and ``ctypes.memmove`` executes them.  It exists to test this module; the lane
never uses it.

e2e: engine arguments, prompts and metrics for ``vllm.LLM`` (:class:`E2ECase`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import random
import shutil
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from reference.mathutil import cdiv
from reference.transfer import TransferLayout
from vllm_adapter import vllm_api as V

__all__ = [
    "CUDA_SKIP_REASON",
    "CopyDifferential",
    "E2ECase",
    "EmulatedVllmWorker",
    "Job",
    "ReferenceTier",
    "RegionTier",
    "SubSlot",
    "TensorsTier",
    "VllmCpuLayout",
    "canonical_kv_caches",
    "cpu_offloading_spec",
    "cuda_skip_reason",
    "job_sub_slots",
    "random_jobs",
    "record_jobs",
    "shm_free_bytes",
]

CUDA_SKIP_REASON = "needs CUDA (torch.cuda.is_available() is False)"


def cuda_skip_reason() -> str | None:
    """``None`` when CUDA is usable, else the lanes' skip reason."""
    return None if torch.cuda.is_available() else CUDA_SKIP_REASON


# ---------------------------------------------------------------------------
# Jobs
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One store (GPU -> CPU) or load (CPU -> GPU) job, as the worker receives it.

    ``block_ids`` / ``group_sizes`` / ``block_indices`` are the
    ``GPULoadStoreSpec`` (group-major, one entry per offloaded group);
    ``chunk_ids`` the ``CPULoadStoreSpec`` (CPU chunk slots, group-major).
    """

    kind: str
    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    chunk_ids: tuple[int, ...]
    origin: str = "random"
    step: int = -1

    def __post_init__(self) -> None:
        if self.kind not in ("store", "load"):
            raise ValueError(f"kind must be 'store' or 'load', got {self.kind!r}")

    def gpu_spec(self) -> Any:
        return V.GPULoadStoreSpec(
            list(self.block_ids),
            group_sizes=list(self.group_sizes),
            block_indices=list(self.block_indices),
        )

    def cpu_spec(self) -> Any:
        return V.CPULoadStoreSpec(list(self.chunk_ids))

    def specs(self, kv_caches: Any = None) -> tuple[Any, Any]:
        """``(src, dst)`` as ``submit_store`` / ``submit_load`` take them (fresh objects).

        The GPU side is what vLLM's connector worker passes for this job over
        ``kv_caches`` (the workers' ``CanonicalKVCaches``): the
        ``GPULoadStoreSpec`` on 0.33.0, ``DevicePointers`` resolved over
        ``kv_caches`` on 0.34.0 (``vllm_api.worker_gpu_arg``), which then
        needs ``kv_caches``.  Without it, the ``GPULoadStoreSpec``.
        """
        gpu = self.gpu_spec()
        if kv_caches is not None:
            gpu = V.worker_gpu_arg(gpu, kv_caches)
        if self.kind == "store":
            return gpu, self.cpu_spec()
        return self.cpu_spec(), gpu

    def describe(self) -> str:
        where = self.origin if self.step < 0 else f"{self.origin}, step {self.step}"
        return (
            f"{self.kind} [{where}] group_sizes={list(self.group_sizes)} "
            f"block_indices={list(self.block_indices)} chunks={list(self.chunk_ids)}"
        )


def jobs_from_dispatched(dispatched: Iterable[Any], origin: str) -> list[Job]:
    """:class:`Job` s from :attr:`conformance.vllm_driver.DriverSession.dispatched`, in order."""
    return [
        Job(
            kind=d.kind,
            block_ids=tuple(d.block_ids),
            group_sizes=tuple(d.group_sizes),
            block_indices=tuple(d.block_indices),
            chunk_ids=tuple(d.cpu_chunk_ids),
            origin=f"{origin} {d.req_id}",
            step=int(d.step),
        )
        for d in dispatched
    ]


def random_jobs(
    rng: random.Random,
    *,
    num_groups: int,
    blocks_per_chunk: int,
    num_gpu_blocks: int,
    num_chunks: int,
    count: int,
    kinds: Sequence[str] = ("store", "load"),
    max_chunks_per_group: int = 3,
) -> list[Job]:
    """``count`` valid jobs: distinct GPU blocks (never block 0) and distinct chunks per job.

    Each group moves 0..``max_chunks_per_group`` chunks' worth of blocks,
    starting at a random ``block_indices`` (so partial first chunks, skipped
    sub-slots and partial last chunks all occur); at least one group moves
    something.  The first jobs take each of ``kinds`` once, then kinds are random.
    """
    b = blocks_per_chunk
    if num_gpu_blocks < 2 or num_chunks < 1:
        raise ValueError("need at least 2 GPU blocks and 1 chunk")
    jobs = []
    for k in range(count):
        sizes, firsts, chunks_per_group = [], [], []
        for _g in range(num_groups):
            n = rng.choice([0, 1, rng.randint(1, max_chunks_per_group * b)])
            first = rng.randrange(0, 6 * b)
            sizes.append(n)
            firsts.append(first)
            chunks_per_group.append(cdiv(n + first % b, b) if n else 0)
        if not any(sizes):
            g = rng.randrange(num_groups)
            sizes[g] = rng.randint(1, b + 1)
            chunks_per_group[g] = cdiv(sizes[g] + firsts[g] % b, b)
        # Trim to what the pools hold.
        while sum(sizes) > num_gpu_blocks - 1 or sum(chunks_per_group) > num_chunks:
            g = max(range(num_groups), key=lambda i: sizes[i])
            sizes[g] -= 1
            chunks_per_group[g] = cdiv(sizes[g] + firsts[g] % b, b) if sizes[g] else 0
        blocks = rng.sample(range(1, num_gpu_blocks), sum(sizes))
        chunks = rng.sample(range(num_chunks), sum(chunks_per_group))
        jobs.append(
            Job(
                kind=kinds[k] if k < len(kinds) else rng.choice(list(kinds)),
                block_ids=tuple(blocks),
                group_sizes=tuple(sizes),
                block_indices=tuple(firsts),
                chunk_ids=tuple(chunks),
            )
        )
    return jobs


def record_jobs(
    driver: Any, *, prompt_len: int, budget: int, seed: int = 0, origin: str = ""
) -> list[Job]:
    """The store and load jobs vLLM's scheduler dispatches for a small workload, in order.

    Runs on CPU through :class:`conformance.vllm_driver.VllmDriver` (real
    ``Scheduler`` + connector, no bytes moved): two requests sharing a prefix
    (chunked prefill, stores), then after GPU prefix-cache resets the prompts
    again (one extended), a late-diverging prompt and several requests at
    once (loads), like the data lane's workload.
    """
    from conformance.trace import RequestSpec

    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(100, 30000) for _ in range(n))

    p = tokens(prompt_len)
    q = p[: prompt_len // 2] + tokens(prompt_len - prompt_len // 2)
    longer = p + tokens(prompt_len // 3)
    diverging = p[: prompt_len - prompt_len // 8] + tokens(prompt_len // 4)
    s = driver.session(max_num_batched_tokens=budget, record=False)

    def reset() -> None:
        if not s.reset_prefix_cache():
            raise RuntimeError("GPU prefix-cache reset refused")

    s.add_request(RequestSpec("a", p, max_tokens=3))
    s.add_request(RequestSpec("b", q, max_tokens=3))
    s.run_until_idle()
    for name, prompt in (("a2", longer), ("b2", q), ("c", diverging)):
        reset()
        s.add_request(RequestSpec(name, prompt, max_tokens=2))
        s.run_until_idle()
    reset()
    for name, prompt in (("a4", p), ("b4", q), ("c4", diverging)):
        s.add_request(RequestSpec(name, prompt, max_tokens=2))
    s.run_until_idle()
    return jobs_from_dispatched(s.dispatched, origin or "recorded")


# ---------------------------------------------------------------------------
# Which sub-slots a job touches
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SubSlot:
    """One copy of a job: a block of one group's layer (ref) <-> one CPU sub-slot."""

    group: int
    """Offloaded-group position (index into the job's ``group_sizes``)."""
    position: int
    """The block's index in the request (``block_indices[group] + k``)."""
    block_id: int
    tensor: int
    chunk: int
    sub_slot: int
    nbytes: int

    def describe(self) -> str:
        return (
            f"group {self.group} chunk {self.chunk} sub-slot {self.sub_slot} "
            f"(tensor {self.tensor}, GPU block {self.block_id}, block position {self.position})"
        )


def job_sub_slots(layout: TransferLayout, job: Job) -> list[SubSlot]:
    """Every copy ``job`` makes, as vLLM's ``_fill_direct_ops`` / ``transfer_async`` enumerate them.

    Group ``g`` with ``n`` blocks and ``skip = block_indices[g] % bpc`` takes the
    next ``n`` block ids and ``cdiv(n + skip, bpc)`` chunk ids; block ``k`` goes
    to chunk ``(k + skip) // bpc``, sub-slot ``(k + skip) % bpc``, once per ref
    of the group.  Raises ``ValueError`` when the ids are not consumed exactly.
    """
    if len(job.group_sizes) != layout.num_groups or len(job.block_indices) != layout.num_groups:
        raise ValueError(
            f"job has {len(job.group_sizes)} group_sizes / {len(job.block_indices)} block_indices, "
            f"layout has {layout.num_groups} groups"
        )
    out: list[SubSlot] = []
    cb = cc = 0
    for g, (n, first) in enumerate(zip(job.group_sizes, job.block_indices, strict=True)):
        if n == 0:
            continue
        b = layout.blocks_per_chunk[g]
        skip = first % b
        nch = cdiv(n + skip, b)
        blocks = job.block_ids[cb : cb + n]
        chunks = job.chunk_ids[cc : cc + nch]
        if len(blocks) != n or len(chunks) != nch:
            raise ValueError(f"{job.describe()}: ids run out in group {g}")
        for k in range(n):
            p = k + skip
            for ref in layout.group_refs[g]:
                out.append(
                    SubSlot(
                        g, first + k, blocks[k], ref.tensor_index, chunks[p // b], p % b, ref.nbytes
                    )
                )
        cb += n
        cc += nch
    if cb != len(job.block_ids) or cc != len(job.chunk_ids):
        raise ValueError(
            f"{job.describe()}: {len(job.block_ids) - cb} block ids and "
            f"{len(job.chunk_ids) - cc} chunk ids left unconsumed"
        )
    return out


# ---------------------------------------------------------------------------
# CPU tiers: vLLM's layout and the reference pool, as comparable sub-slot views
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmCpuLayout:
    """Where vLLM's direct layout (0.33.0 and 0.34.0 alike) puts one worker's chunks in the shared region."""

    page_bytes: tuple[int, ...]
    """Canonical tensors' (padded) pages, ``CanonicalKVCaches.tensors[t].page_size_bytes``."""
    blocks_per_chunk: int
    num_chunks: int
    row_stride: int
    """Bytes per chunk row of the whole region: ``kv_bytes_per_chunk`` (all ranks, page-aligned)."""
    worker_offset: int
    """This worker's first byte in each row: ``rank * cpu_page_size`` (0 for the replicated layout)."""
    cpu_page_size: int
    """This worker's bytes per row: ``worker_kv_bytes_per_block * blocks_per_chunk``."""

    def __post_init__(self) -> None:
        end = self.tensor_offset(len(self.page_bytes))
        if end > self.worker_offset + self.cpu_page_size:
            raise ValueError(
                f"tensor areas end at byte {end} of a row, past this worker's area "
                f"[{self.worker_offset}, {self.worker_offset + self.cpu_page_size})"
            )
        if self.worker_offset + self.cpu_page_size > self.row_stride:
            raise ValueError(
                f"worker area ends at {self.worker_offset + self.cpu_page_size} > row stride {self.row_stride}"
            )

    def tensor_offset(self, t: int) -> int:
        """Byte offset, in a row, of tensor ``t``'s ``blocks_per_chunk`` sub-slots."""
        return self.worker_offset + sum(self.page_bytes[:t]) * self.blocks_per_chunk

    def sub_slot_offset(self, chunk: int, t: int, j: int) -> int:
        """Byte offset, in the region, of sub-slot ``j`` of ``chunk`` for tensor ``t``."""
        return chunk * self.row_stride + self.tensor_offset(t) + j * self.page_bytes[t]

    @property
    def total_bytes(self) -> int:
        return self.num_chunks * self.row_stride

    def unused_ranges(self) -> list[tuple[int, int]]:
        """Byte ranges of a row this worker's tensor areas do not cover (other ranks, slack, padding)."""
        start, end = self.tensor_offset(0), self.tensor_offset(len(self.page_bytes))
        return [(a, b) for a, b in ((0, start), (end, self.row_stride)) if b > a]

    @classmethod
    def from_numbers(
        cls,
        page_bytes: Sequence[int],
        *,
        blocks_per_chunk: int,
        num_chunks: int,
        worker_kv_bytes_per_block: int,
        world_size: int = 1,
        rank: int = 0,
        replicated: bool = False,
        alignment: int = mmap.PAGESIZE,
    ) -> VllmCpuLayout:
        """``CPUOffloadingSpec``'s arithmetic (design notes section 1.7), stated independently."""
        copies = 1 if replicated else world_size
        raw = worker_kv_bytes_per_block * copies * blocks_per_chunk
        return cls(
            page_bytes=tuple(int(p) for p in page_bytes),
            blocks_per_chunk=blocks_per_chunk,
            num_chunks=num_chunks,
            row_stride=cdiv(raw, alignment) * alignment,
            worker_offset=(0 if replicated else rank)
            * worker_kv_bytes_per_block
            * blocks_per_chunk,
            cpu_page_size=worker_kv_bytes_per_block * blocks_per_chunk,
        )

    @classmethod
    def for_spec(cls, spec: Any, page_bytes: Sequence[int]) -> VllmCpuLayout:
        """The layout a real ``CPUOffloadingSpec`` gives its worker's region."""
        rank = 0 if spec.replicated_layout else int(spec.config.parallel.rank)
        return cls(
            page_bytes=tuple(int(p) for p in page_bytes),
            blocks_per_chunk=int(spec.blocks_per_chunk),
            num_chunks=int(spec.num_chunks),
            row_stride=int(spec.kv_bytes_per_chunk),
            worker_offset=rank * int(spec.cpu_page_size_per_worker),
            cpu_page_size=int(spec.cpu_page_size_per_worker),
        )


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


class _Tier(ABC):
    """A CPU tier seen as ``area(t)``: uint8 ``[num_chunks, bpc, page_t]`` views (writable)."""

    name = "tier"
    page_bytes: tuple[int, ...]
    blocks_per_chunk: int
    num_chunks: int

    @abstractmethod
    def area(self, t: int) -> torch.Tensor:
        """Tensor ``t``'s sub-slots, uint8 ``[num_chunks, bpc, page_t]``."""

    def rows(self, t: int, chunks: torch.Tensor, subs: torch.Tensor, nbytes: int) -> torch.Tensor:
        """uint8 ``[n, nbytes]``: bytes ``[0, nbytes)`` of sub-slots ``(chunks[i], subs[i])`` of tensor ``t``."""
        return self.area(t)[chunks, subs, :nbytes]

    def unused_nonzero(self) -> list[str]:
        """Bytes outside every tensor area that are not zero (none for a tier without slack)."""
        return []


class ReferenceTier(_Tier):
    """The reference pool ``[num_chunks, slot_bytes]`` under a uniform :class:`TransferLayout`."""

    name = "reference"

    def __init__(self, pool: torch.Tensor, layout: TransferLayout) -> None:
        if len(set(layout.blocks_per_chunk)) != 1:
            raise ValueError("vLLM 0.33.0 has one blocks_per_chunk for every group")
        self.pool = _u8(pool)
        self.layout = layout
        self.page_bytes = layout.page_bytes
        self.blocks_per_chunk = layout.blocks_per_chunk[0]
        self.num_chunks = int(pool.shape[0])

    def area(self, t: int) -> torch.Tensor:
        page, b = self.page_bytes[t], self.blocks_per_chunk
        return self.pool.as_strided(
            (self.num_chunks, b, page),
            (self.pool.stride(0), page, 1),
            self.pool.storage_offset() + self.layout.region_offset(0, t),
        )


class RegionTier(_Tier):
    """vLLM's shared region (flat bytes) under a :class:`VllmCpuLayout`."""

    name = "vLLM"

    def __init__(self, base: torch.Tensor, layout: VllmCpuLayout) -> None:
        base = _u8(base)
        if base.ndim != 1 or base.numel() < layout.total_bytes:
            raise ValueError(
                f"region has {base.numel()} bytes, the layout needs {layout.total_bytes}"
            )
        self.base = base
        self.layout = layout
        self.page_bytes = layout.page_bytes
        self.blocks_per_chunk = layout.blocks_per_chunk
        self.num_chunks = layout.num_chunks

    def area(self, t: int) -> torch.Tensor:
        page, b = self.page_bytes[t], self.blocks_per_chunk
        return self.base.as_strided(
            (self.num_chunks, b, page),
            (self.layout.row_stride, page, 1),
            self.base.storage_offset() + self.layout.tensor_offset(t),
        )

    def unused_nonzero(self) -> list[str]:
        rows = self.base[: self.layout.total_bytes].view(self.num_chunks, self.layout.row_stride)
        out = []
        for a, b in self.layout.unused_ranges():
            part = rows[:, a:b]
            n = int(torch.count_nonzero(part))
            if n:
                where = part.nonzero()[0].tolist()
                out.append(
                    f"{n} non-zero bytes outside this worker's tensor areas of the shared region "
                    f"(row bytes [{a}, {b})); first at chunk {where[0]} row byte {a + where[1]}"
                )
        return out

    def check_views(self, views: Sequence[torch.Tensor]) -> list[str]:
        """Problems with vLLM's per-tensor views (``create_next_worker_view``) vs this layout."""
        problems = []
        if len(views) != len(self.page_bytes):
            return [f"{len(views)} CPU views for {len(self.page_bytes)} canonical tensors"]
        base_ptr = self.base.data_ptr()
        for t, v in enumerate(views):
            want_shape = (self.num_chunks, self.page_bytes[t] * self.blocks_per_chunk)
            offset = v.data_ptr() - base_ptr
            if offset != self.layout.tensor_offset(t):
                problems.append(
                    f"tensor {t}: vLLM's CPU view starts at region byte {offset}, "
                    f"layout says {self.layout.tensor_offset(t)}"
                )
            if tuple(v.shape) != want_shape:
                problems.append(
                    f"tensor {t}: view shape {tuple(v.shape)}, layout says {want_shape}"
                )
            if v.shape[0] > 1 and v.stride(0) * v.element_size() != self.layout.row_stride:
                problems.append(
                    f"tensor {t}: view row stride {v.stride(0) * v.element_size()}, "
                    f"layout says {self.layout.row_stride}"
                )
        return problems


class TensorsTier(_Tier):
    """vLLM's private CPU tensors (no shared region): tensor ``t`` is ``[num_chunks, page_t * bpc]``."""

    name = "vLLM"

    def __init__(
        self, tensors: Sequence[torch.Tensor], page_bytes: Sequence[int], blocks_per_chunk: int
    ) -> None:
        self.tensors = [_u8(t) for t in tensors]
        self.page_bytes = tuple(int(p) for p in page_bytes)
        self.blocks_per_chunk = blocks_per_chunk
        self.num_chunks = int(self.tensors[0].shape[0]) if self.tensors else 0
        for t, (x, page) in enumerate(zip(self.tensors, self.page_bytes, strict=True)):
            if tuple(x.shape) != (self.num_chunks, page * blocks_per_chunk):
                raise ValueError(f"CPU tensor {t} has shape {tuple(x.shape)}")

    def area(self, t: int) -> torch.Tensor:
        x, page, b = self.tensors[t], self.page_bytes[t], self.blocks_per_chunk
        return x.as_strided((self.num_chunks, b, page), (x.stride(0), page, 1), x.storage_offset())


def copy_tier(src: _Tier, dst: _Tier) -> None:
    """Every sub-slot (whole pages) of ``src`` into ``dst`` (same tensors, chunks, bpc)."""
    if (src.page_bytes, src.blocks_per_chunk, src.num_chunks) != (
        dst.page_bytes,
        dst.blocks_per_chunk,
        dst.num_chunks,
    ):
        raise ValueError("tiers of different shapes")
    for t in range(len(src.page_bytes)):
        dst.area(t).copy_(src.area(t))


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """(index of the first differing element, number of differing elements)."""
    bad = a != b
    n = int(bad.sum())
    first = tuple(int(i) for i in bad.nonzero()[0].tolist()) if n else ()
    return first, n


def compare_sub_slots(
    vllm_tier: _Tier, ref_tier: _Tier, copies: Sequence[SubSlot], what: str, limit: int = 8
) -> tuple[int, list[str]]:
    """Compare bytes ``[0, nbytes)`` of the listed sub-slots; ``(bytes compared, failure messages)``.

    Each message names the job (``what``), group, chunk, sub-slot, tensor, GPU
    block, the first differing byte offset and both bytes there.
    """
    batches: dict[tuple[int, int], list[SubSlot]] = {}
    for c in copies:
        batches.setdefault((c.tensor, c.nbytes), []).append(c)
    compared = 0
    failures: list[str] = []
    for (t, nbytes), items in batches.items():
        chunks = torch.tensor([c.chunk for c in items], dtype=torch.int64)
        subs = torch.tensor([c.sub_slot for c in items], dtype=torch.int64)
        got = vllm_tier.rows(t, chunks, subs, nbytes)
        want = ref_tier.rows(t, chunks, subs, nbytes)
        compared += got.numel()
        if torch.equal(got, want):
            continue
        bad_rows = (got != want).any(dim=1).nonzero().flatten().tolist()
        for i in bad_rows:
            if len(failures) >= limit:
                break
            (col,), n = _first_difference(got[i], want[i])
            failures.append(
                f"{what}: {items[i].describe()}: {n} of {nbytes} bytes differ, first at byte "
                f"offset {col} ({vllm_tier.name} 0x{int(got[i, col]):02x}, "
                f"{ref_tier.name} 0x{int(want[i, col]):02x})"
            )
    return compared, failures


def compare_tiers(
    vllm_tier: _Tier, ref_tier: _Tier, what: str, limit: int = 8
) -> tuple[int, list[str]]:
    """Every sub-slot of every chunk (whole pages), plus vLLM's bytes outside its areas."""
    compared = 0
    failures: list[str] = []
    for t in range(len(ref_tier.page_bytes)):
        got, want = vllm_tier.area(t), ref_tier.area(t)
        compared += got.numel()
        if torch.equal(got, want):
            continue
        (chunk, sub, col), n = _first_difference(got, want)
        failures.append(
            f"{what}: tensor {t}: {n} bytes differ over the whole tier, first at chunk {chunk} "
            f"sub-slot {sub} byte offset {col} ({vllm_tier.name} 0x{int(got[chunk, sub, col]):02x}, "
            f"{ref_tier.name} 0x{int(want[chunk, sub, col]):02x})"
        )
    failures += [f"{what}: {m}" for m in vllm_tier.unused_nonzero()]
    return compared, failures[:limit]


def shm_free_bytes(path: str = "/dev/shm") -> int:
    """Free bytes of the shared-memory filesystem vLLM's region lives in (0 when absent)."""
    try:
        return int(shutil.disk_usage(path).free)
    except OSError:
        return 0


# ---------------------------------------------------------------------------
# vLLM objects
# ---------------------------------------------------------------------------


class _CaptureSpec:
    """Stands in for an OffloadingSpec: keeps the ``CanonicalKVCaches`` vLLM's worker builds."""

    replicated_layout = False

    def __init__(self) -> None:
        self.config = SimpleNamespace(canonical_layout=False, parallel=SimpleNamespace(rank=0))
        self.kv_caches: Any = None

    def get_worker(self, kv_caches: Any) -> None:
        self.kv_caches = kv_caches


def canonical_kv_caches(
    vllm_config: Any, kv_cache_config: Any, kv_caches: dict[str, torch.Tensor]
) -> Any:
    """``CanonicalKVCaches`` exactly as ``OffloadingConnectorWorker.register_kv_caches`` builds them.

    vLLM's own ``register_kv_caches`` runs over ``kv_caches`` (layer name ->
    tensor, any device) with a stand-in spec whose ``get_worker`` keeps its
    argument; ``kv_cache_config`` is the worker view.
    """
    spec = _CaptureSpec()
    V.OffloadingConnectorWorker(spec, vllm_config, kv_cache_config).register_kv_caches(kv_caches)
    if spec.kv_caches is None:  # pragma: no cover - vLLM always builds a worker
        raise RuntimeError("register_kv_caches built no worker")
    return spec.kv_caches


def cpu_offloading_spec(
    vllm_config: Any,
    kv_cache_config: Any,
    num_chunks: int,
    *,
    rank: int | None = None,
    engine_id: str | None = None,
) -> Any:
    """A real ``CPUOffloadingSpec`` with exactly ``num_chunks`` chunk slots.

    Its ``OffloadingConfig`` is vLLM's ``build_offloading_config`` of the
    (kvchunk-translated, if the config names ``KvchunkOffloadingConnector``)
    ``vllm_config`` and the worker-view ``kv_cache_config``, with
    ``cpu_bytes_to_use`` set to ``num_chunks`` rows, the worker ``rank``
    replaced when given, and a fresh ``engine_id`` (the ``/dev/shm`` file name).
    Building it needs no GPU; only its ``create_worker`` does.
    """
    from vllm_adapter.connector import translate_extra_config

    if vllm_config.kv_transfer_config.kv_connector == "KvchunkOffloadingConnector":
        vllm_config = translate_extra_config(vllm_config, kv_cache_config)
    config = V.build_offloading_config(vllm_config, kv_cache_config)
    parallel = config.parallel
    if rank is not None:
        if not 0 <= rank < parallel.world_size:
            raise ValueError(f"rank {rank} outside world size {parallel.world_size}")
        parallel = dataclasses.replace(parallel, rank=rank)
    extra = dict(config.extra_config)
    extra["spec_name"] = "CPUOffloadingSpec"
    extra.pop("spec_module_path", None)
    extra["cpu_bytes_to_use"] = 1 << 50
    config = dataclasses.replace(
        config,
        parallel=parallel,
        engine_id=engine_id or f"kvchunk-gpu-copy-{uuid.uuid4().hex[:12]}",
        extra_config=extra,
    )
    probe = V.CPUOffloadingSpec(config)
    if probe.kv_bytes_per_chunk <= 0:
        raise ValueError("CPUOffloadingSpec sized no chunk (worker_kv_bytes_per_block is 0)")
    extra = {**extra, "cpu_bytes_to_use": int(num_chunks) * int(probe.kv_bytes_per_chunk)}
    spec = V.CPUOffloadingSpec(dataclasses.replace(config, extra_config=extra))
    assert spec.num_chunks == num_chunks, (spec.num_chunks, num_chunks)
    return spec


def create_vllm_worker(spec: Any, kv_caches: Any, *, shared_region: bool = True) -> Any:
    """vLLM's ``CPUOffloadingWorker`` (CUDA only) as ``CPUOffloadingSpec`` builds it.

    ``shared_region=True``: ``spec.create_worker`` unchanged, with the
    cross-worker barrier (a collective over vLLM's world group, which this
    single process does not have) replaced by a no-op for the call; the region
    file is then unlinked by the worker's ``shutdown``.  ``False``: the
    private pinned-tensor path (``mmap_region=None``).
    """
    if not shared_region:
        return V.CPUOffloadingWorker(
            kv_caches=kv_caches,
            blocks_per_chunk=spec.blocks_per_chunk,
            num_cpu_chunks=spec.num_chunks,
        )
    module = V.cpu_offloading_spec_module
    saved = module._all_workers_barrier
    module._all_workers_barrier = lambda: None
    try:
        return spec.create_worker(kv_caches)
    finally:
        module._all_workers_barrier = saved


def vllm_worker_tier(worker: Any, spec: Any, page_bytes: Sequence[int]) -> tuple[_Tier, list[str]]:
    """The CPU tier of a real (or emulated) vLLM worker, and layout problems found.

    With a shared region: a :class:`RegionTier` over the whole region under
    :meth:`VllmCpuLayout.for_spec`, and the worker's own CPU views checked
    against it.  Without: a :class:`TensorsTier` over its private tensors.
    """
    views = V.cpu_worker_views(worker)
    region = getattr(worker, "_mmap_region", None)
    if region is None:
        return TensorsTier(views, page_bytes, int(spec.blocks_per_chunk)), []
    layout = VllmCpuLayout.for_spec(spec, page_bytes)
    problems = []
    if region._row_stride != layout.row_stride:
        problems.append(f"region row stride {region._row_stride}, layout says {layout.row_stride}")
    tier = RegionTier(region.base_tensor, layout)
    return tier, problems + tier.check_views(views)


# ---------------------------------------------------------------------------
# CPU emulation of vLLM's copy path (tests of this module only)
# ---------------------------------------------------------------------------


class EmulatedVllmWorker:
    """vLLM's direct-layout copies on CPU: vLLM's descriptor code, ``memmove`` as the copy engine.

    ``SingleDirectionOffloadingHandler.transfer_async``'s per-group loop
    (restated: it needs CUDA streams) calls vLLM's own ``_fill_direct_ops``
    (and through it ``compute_sub_block_ptrs``) unchanged; each descriptor is
    then executed with ``ctypes.memmove``.  Both releases' loops are here:
    0.33.0's takes the ``GPULoadStoreSpec`` and computes GPU addresses from the
    GPU tensors; 0.34.0's takes ``DevicePointers`` (resolved by the caller, as
    vLLM's connector worker does) and walks them with ``iter_pointer_groups``.  ``cpu_tensors`` are vLLM's CPU
    views (e.g. from a real ``SharedOffloadRegion.create_next_worker_view``).
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


# ---------------------------------------------------------------------------
# The differential
# ---------------------------------------------------------------------------


def _flat_bytes(storage: Any, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


@dataclass
class CopyStats:
    stores: int = 0
    loads: int = 0
    sub_slot_bytes_compared: int = 0
    tier_bytes_compared: int = 0
    gpu_bytes_compared: int = 0
    gpu_rows_loaded: int = 0
    """Destination rows whose bytes a load changed (the loads did something)."""
    failures: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (
            f"{self.stores} stores, {self.loads} loads; compared {self.sub_slot_bytes_compared} "
            f"written sub-slot bytes, {self.tier_bytes_compared} tier bytes, "
            f"{self.gpu_bytes_compared} GPU bytes; {self.gpu_rows_loaded} GPU rows changed by loads; "
            f"{len(self.failures)} failures" + "".join(f"\n  {f}" for f in self.failures[:8])
        )


class CopyDifferential:
    """Run jobs through vLLM's worker and the reference worker on the same KV tensors; compare.

    ``kv_caches`` is the ``CanonicalKVCaches`` both workers were built on;
    ``ref_worker`` a :class:`vllm_adapter.spec.ReferenceOffloadingWorker`;
    ``vllm_worker`` anything with vLLM's ``OffloadingWorker`` methods
    (``CPUOffloadingWorker`` on CUDA, :class:`EmulatedVllmWorker` on CPU) and
    ``vllm_tier`` its CPU bytes.  ``full_check_bytes``: compare the whole tiers
    after every job while they are at most this big (else only in :meth:`finish`).
    """

    def __init__(
        self,
        kv_caches: Any,
        ref_worker: Any,
        vllm_worker: Any,
        vllm_tier: _Tier,
        *,
        seed: int = 0,
        full_check_bytes: int = 64 << 20,
        max_failures: int = 16,
    ) -> None:
        from vllm_adapter.spec import canonical_gpu_tensors

        self.kv_caches = kv_caches
        self.layout: TransferLayout = ref_worker.layout
        self.ref_worker = ref_worker
        self.vllm_worker = vllm_worker
        self.ref_tier = ReferenceTier(ref_worker.pool, self.layout)
        self.vllm_tier = vllm_tier
        if (vllm_tier.page_bytes, vllm_tier.blocks_per_chunk, vllm_tier.num_chunks) != (
            self.ref_tier.page_bytes,
            self.ref_tier.blocks_per_chunk,
            self.ref_tier.num_chunks,
        ):
            raise ValueError(
                f"tiers differ: vLLM pages {vllm_tier.page_bytes} x{vllm_tier.blocks_per_chunk} "
                f"{vllm_tier.num_chunks} chunks, reference {self.ref_tier.page_bytes} "
                f"x{self.ref_tier.blocks_per_chunk} {self.ref_tier.num_chunks} chunks"
            )
        self.views = canonical_gpu_tensors(kv_caches)
        self.device = self.views[0].device
        storages: dict[int, Any] = {}
        for v in self.views:
            storages.setdefault(v.untyped_storage().data_ptr(), v.untyped_storage())
        self.flats = [_flat_bytes(s, self.device) for s in storages.values()]
        self._storage_index = {s.data_ptr(): k for k, s in enumerate(storages.values())}
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.cpu_generator = torch.Generator().manual_seed(seed + 1)
        self.full_check = (
            sum(p * self.ref_tier.blocks_per_chunk for p in self.layout.page_bytes)
            * self.ref_tier.num_chunks
            <= full_check_bytes
        )
        self.max_failures = max_failures
        self.stats = CopyStats()
        self._next_job_id = 1

    # -- setup -----------------------------------------------------------------

    def randomize_gpu(self) -> None:
        for f in self.flats:
            f.random_(0, 256, generator=self.generator)

    def randomize_cpu(self) -> None:
        """Random bytes in every sub-slot of the reference pool, copied into vLLM's tier."""
        self.ref_tier.pool.random_(0, 256, generator=self.cpu_generator)
        copy_tier(self.ref_tier, self.vllm_tier)

    # -- helpers ---------------------------------------------------------------

    def _fail(self, messages: Iterable[str]) -> None:
        for m in messages:
            if len(self.stats.failures) < self.max_failures:
                self.stats.failures.append(m)

    def _drain(self, worker: Any, name: str, job_id: int, what: str) -> int | None:
        results = worker.get_finished()
        ids = [r.job_id for r in results]
        if ids != [job_id]:
            self._fail([f"{what}: {name} worker reported jobs {ids}, expected [{job_id}]"])
        for r in results:
            if not r.success:
                self._fail([f"{what}: {name} worker reported failure for job {r.job_id}"])
        sizes = [r.transfer_size for r in results if r.job_id == job_id]
        return sizes[0] if sizes else None

    def _view_on(self, flats: Sequence[torch.Tensor], t: int) -> torch.Tensor:
        v = self.views[t]
        k = self._storage_index[v.untyped_storage().data_ptr()]
        return flats[k].as_strided(v.shape, v.stride(), v.storage_offset())

    # -- jobs ------------------------------------------------------------------

    def run(self, job: Job) -> None:
        job_id = self._next_job_id
        self._next_job_id += 1
        copies = job_sub_slots(self.layout, job)
        what = f"job {job_id} {job.describe()}"
        if job.kind == "store":
            self._store(job_id, job, copies, what)
        else:
            self._load(job_id, job, copies, what)
        if self.full_check:
            self.check_tiers(f"after {what}")

    def _store(self, job_id: int, job: Job, copies: list[SubSlot], what: str) -> None:
        self.stats.stores += 1
        self.vllm_worker.submit_store(job_id, *job.specs(self.kv_caches))
        self.ref_worker.submit_store(job_id, *job.specs(self.kv_caches))
        self.vllm_worker.wait({job_id})
        size_v = self._drain(self.vllm_worker, "vLLM", job_id, what)
        size_r = self._drain(self.ref_worker, "reference", job_id, what)
        if size_v != size_r:
            self._fail([f"{what}: transfer_size vLLM {size_v} != reference {size_r}"])
        compared, failures = compare_sub_slots(self.vllm_tier, self.ref_tier, copies, what)
        self.stats.sub_slot_bytes_compared += compared
        self._fail(failures)

    def _load(self, job_id: int, job: Job, copies: list[SubSlot], what: str) -> None:
        self.stats.loads += 1
        before = [f.clone() for f in self.flats]
        self.vllm_worker.submit_load(job_id, *job.specs(self.kv_caches))
        self.vllm_worker.wait({job_id})
        size_v = self._drain(self.vllm_worker, "vLLM", job_id, what)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        after_vllm = [f.clone() for f in self.flats]
        for f, b in zip(self.flats, before, strict=True):
            f.copy_(b)
        self.ref_worker.submit_load(job_id, *job.specs(self.kv_caches))
        size_r = self._drain(self.ref_worker, "reference", job_id, what)
        if size_v != size_r:
            self._fail([f"{what}: transfer_size vLLM {size_v} != reference {size_r}"])
        # Now self.flats hold the reference's result.
        dest: dict[tuple[int, int], SubSlot] = {(c.tensor, c.block_id): c for c in copies}
        failures = []
        for t in range(len(self.views)):
            got, want = self._view_on(after_vllm, t), self._view_on(self.flats, t)
            self.stats.gpu_bytes_compared += got.numel()
            old = self._view_on(before, t)
            rows = sorted({c.block_id for c in copies if c.tensor == t})
            if rows:
                idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
                self.stats.gpu_rows_loaded += int(
                    (want.index_select(0, idx) != old.index_select(0, idx)).any(1).sum()
                )
            if torch.equal(got, want):
                continue
            bad = (got != want).any(dim=1).nonzero().flatten().tolist()
            for r in bad[:4]:
                (col,), n = _first_difference(got[r], want[r])
                c = dest.get((t, r))
                if c is not None:
                    where = f"{c.describe()} -> GPU block {r}"
                else:
                    who = "vLLM" if not torch.equal(got[r], old[r]) else "reference"
                    where = f"tensor {t} GPU block {r}, not a destination of this load (stray write by {who})"
                failures.append(
                    f"{what}: {where}: {n} bytes differ, first at byte offset {col} "
                    f"(vLLM 0x{int(got[r, col]):02x}, reference 0x{int(want[r, col]):02x})"
                )
        for k, (got_flat, want_flat) in enumerate(zip(after_vllm, self.flats, strict=True)):
            if not failures and not torch.equal(got_flat, want_flat):
                (pos,), n = _first_difference(got_flat, want_flat)
                failures.append(
                    f"{what}: {n} KV bytes outside the canonical rows differ (KV buffer {k}, "
                    f"first at byte {pos})"
                )
        self._fail(failures)

    def check_tiers(self, what: str) -> None:
        compared, failures = compare_tiers(self.vllm_tier, self.ref_tier, what)
        self.stats.tier_bytes_compared += compared
        self._fail(failures)

    def finish(self, what: str = "at the end") -> CopyStats:
        self.check_tiers(what)
        return self.stats


# ---------------------------------------------------------------------------
# e2e
# ---------------------------------------------------------------------------

MODELS_DIR = Path(__file__).resolve().parent.parent / "vllm_adapter" / "models"
KVCHUNK_CONNECTOR = "KvchunkOffloadingConnector"
KVCHUNK_MODULE = "vllm_adapter.connector"


def _gemma4_overrides(num_layers: int) -> dict[str, Any]:
    import json

    cfg = json.loads((MODELS_DIR / "gemma-4-31B-it-text" / "config.json").read_text())
    return {"num_hidden_layers": num_layers, "layer_types": cfg["layer_types"][:num_layers]}


def _dsv4_overrides(num_layers: int) -> dict[str, Any]:
    import json

    cfg = json.loads((MODELS_DIR / "DeepSeek-V4-Flash" / "config.json").read_text())
    names = {
        0: "sliding_attention",
        4: "compressed_sparse_attention",
        128: "heavily_compressed_attention",
    }
    ratios = cfg["compress_ratios"][:num_layers]
    n_hash = min(num_layers, int(cfg.get("num_hash_layers", 3)))
    return {
        "num_hidden_layers": num_layers,
        "layer_types": [names[r] for r in ratios],
        "mlp_layer_types": ["hash_moe"] * n_hash + ["moe"] * (num_layers - n_hash),
    }


def _frozen(overrides: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in overrides.items())


@dataclass(frozen=True)
class E2ECase:
    """One engine configuration of the e2e lane."""

    fixture: str
    """Report label: the model and its reduction."""
    model_dir: str
    extra: tuple[tuple[str, int], ...]
    kvchunk: bool
    hf_overrides: tuple[tuple[str, Any], ...]
    engine: tuple[tuple[str, Any], ...] = ()
    prompt_len: int = 1600
    num_prompts: int = 2
    max_tokens: int = 8
    needs_sm: tuple[int, int] | None = None
    """Minimum CUDA compute capability (DeepSeek-V4's FlashMLA kernels: sm90)."""

    @property
    def knob(self) -> str:
        (key, value), *_ = self.extra
        return f"{key}={value}" + (
            f" ({KVCHUNK_CONNECTOR})" if self.kvchunk else " (OffloadingConnector)"
        )

    def __str__(self) -> str:
        (key, value), *_ = self.extra
        return f"{self.model_dir}-{key}{value}-{'kvchunk' if self.kvchunk else 'stock'}"

    def overrides(self) -> dict[str, Any]:
        """``hf_overrides`` (list values are kept as tuples in the case, for hashing)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.hf_overrides}

    def kv_transfer_config(self, cpu_bytes: int) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "kv_connector": KVCHUNK_CONNECTOR if self.kvchunk else "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                **dict(self.extra),
                "spec_name": "CPUOffloadingSpec",
                "cpu_bytes_to_use": int(cpu_bytes),
            },
        }
        if self.kvchunk:
            cfg["kv_connector_module_path"] = KVCHUNK_MODULE
        return cfg

    def engine_kwargs(self, cpu_bytes: int) -> dict[str, Any]:
        """``vllm.LLM(**kwargs)``: dummy weights, token-id prompts, HMA + prefix caching on, TP=1."""
        return {
            "model": str(MODELS_DIR / self.model_dir),
            "load_format": "dummy",
            "skip_tokenizer_init": True,
            "generation_config": "vllm",
            "hf_overrides": self.overrides(),
            "tensor_parallel_size": 1,
            "enforce_eager": True,
            "enable_prefix_caching": True,
            "disable_hybrid_kv_cache_manager": False,
            "max_model_len": 4096,
            "max_num_seqs": 8,
            "gpu_memory_utilization": 0.85,
            "kv_cache_memory_bytes": 8 << 30,
            "seed": 0,
            "disable_log_stats": False,
            "kv_transfer_config": self.kv_transfer_config(cpu_bytes),
            **dict(self.engine),
        }

    def prompts(self, vocab_size: int, seed: int = 0) -> list[list[int]]:
        """Token-id prompts: the second shares the first half of the first."""
        rng = random.Random(seed)
        hi = max(1100, min(vocab_size, 100_000) - 100)
        first = [rng.randrange(1000, hi) for _ in range(self.prompt_len)]
        out = [first]
        for _ in range(1, self.num_prompts):
            half = self.prompt_len // 2
            out.append(
                first[:half] + [rng.randrange(1000, hi) for _ in range(self.prompt_len - half)]
            )
        return out


GEMMA4_TEXT = "gemma-4-31B-it-text"
DSV4 = "DeepSeek-V4-Flash"
E2E_CASES = [
    # 12 of 60 layers: 10 sliding (5 groups of 2) + 2 full, the same six KV groups as the full model.
    E2ECase(
        "gemma-4-31B-it (12 layers, TP1)",
        GEMMA4_TEXT,
        (("block_size", 512),),
        True,
        _frozen(_gemma4_overrides(12)),
    ),
    E2ECase(
        "gemma-4-31B-it (12 layers, TP1)",
        GEMMA4_TEXT,
        (("blocks_per_chunk", 2),),
        False,
        _frozen(_gemma4_overrides(12)),
    ),
    # 4 of 43 layers: sliding, sliding, c4 (sparse + indexer), c128: every KV group kind.
    E2ECase(
        "DeepSeek-V4-Flash (4 layers, TP1)",
        DSV4,
        (("block_size", 512),),
        True,
        _frozen(_dsv4_overrides(4)),
        engine=(("kv_cache_dtype", "fp8"), ("block_size", 256)),
        needs_sm=(9, 0),
    ),
]


def metric_total(metrics: Iterable[Any], name: str) -> int | None:
    """Sum of a counter's values over its label sets (``None`` when the engine has no such metric)."""
    values = [m.value for m in metrics if getattr(m, "name", None) == name and hasattr(m, "value")]
    return int(sum(values)) if values else None


def offload_byte_counters(metrics: Iterable[Any]) -> dict[str, int]:
    """Every counter whose name mentions offloading and bytes (informative)."""
    out: dict[str, int] = {}
    for m in metrics:
        name = str(getattr(m, "name", ""))
        if "offload" in name and "bytes" in name and hasattr(m, "value"):
            out[name] = out.get(name, 0) + int(m.value)
    return out
