"""CPU tiers as comparable sub-slot views: vLLM's layout and the reference pool.

vLLM's CPU layout (design notes section 6.2, :class:`VllmCpuLayout`): in the
shared region, sub-slot ``j`` of chunk ``c`` of canonical tensor ``t`` on worker
rank ``r`` starts at ``c * kv_bytes_per_chunk + r * cpu_page_size_per_worker +
sum(page[:t]) * bpc + j * page[t]``; ``kv_bytes_per_chunk`` is rounded up to
the host page size.  The reference pool is the same without the rank offset
and the padding (``c * slot_bytes + sum(page[:t]) * bpc + j * page[t]``).
"""

from __future__ import annotations

import mmap
import shutil
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from reference.geometry import cpu_row_bytes
from reference.transfer import TransferLayout

from .slots import SubSlot

__all__ = [
    "ReferenceTier",
    "RegionTier",
    "TensorsTier",
    "Tier",
    "VllmCpuLayout",
    "compare_sub_slots",
    "compare_tiers",
    "copy_tier",
    "shm_free_bytes",
]


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
        return cls(
            page_bytes=tuple(int(p) for p in page_bytes),
            blocks_per_chunk=blocks_per_chunk,
            num_chunks=num_chunks,
            row_stride=cpu_row_bytes(worker_kv_bytes_per_block, copies, blocks_per_chunk, alignment),
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


class Tier(ABC):
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


class ReferenceTier(Tier):
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


class RegionTier(Tier):
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


class TensorsTier(Tier):
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


def copy_tier(src: Tier, dst: Tier) -> None:
    """Every sub-slot (whole pages) of ``src`` into ``dst`` (same tensors, chunks, bpc)."""
    if (src.page_bytes, src.blocks_per_chunk, src.num_chunks) != (
        dst.page_bytes,
        dst.blocks_per_chunk,
        dst.num_chunks,
    ):
        raise ValueError("tiers of different shapes")
    for t in range(len(src.page_bytes)):
        dst.area(t).copy_(src.area(t))


def first_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """(index of the first differing element, number of differing elements)."""
    bad = a != b
    n = int(bad.sum())
    first = tuple(int(i) for i in bad.nonzero()[0].tolist()) if n else ()
    return first, n


def compare_sub_slots(
    vllm_tier: Tier, ref_tier: Tier, copies: Sequence[SubSlot], what: str, limit: int = 8
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
            (col,), n = first_difference(got[i], want[i])
            failures.append(
                f"{what}: {items[i].describe()}: {n} of {nbytes} bytes differ, first at byte "
                f"offset {col} ({vllm_tier.name} 0x{int(got[i, col]):02x}, "
                f"{ref_tier.name} 0x{int(want[i, col]):02x})"
            )
    return compared, failures


def compare_tiers(
    vllm_tier: Tier, ref_tier: Tier, what: str, limit: int = 8
) -> tuple[int, list[str]]:
    """Every sub-slot of every chunk (whole pages), plus vLLM's bytes outside its areas."""
    compared = 0
    failures: list[str] = []
    for t in range(len(ref_tier.page_bytes)):
        got, want = vllm_tier.area(t), ref_tier.area(t)
        compared += got.numel()
        if torch.equal(got, want):
            continue
        (chunk, sub, col), n = first_difference(got, want)
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
