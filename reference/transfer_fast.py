"""A fast implementation of :mod:`reference.transfer`'s layout, proved equal to it by tests.

``tests/test_transfer_fast.py`` checks, byte for byte, that this module writes
exactly what the spec's copy-at-a-time gather/scatter writes, on drawn
layouts (packed ones included), dtypes, shared and overlapping buffers, and
devices, and that both reject the same calls.  Nothing here calls the spec's
mapping (:func:`reference.transfer.place`, :func:`reference.transfer.chunks_of`,
``TransferLayout.region_offset`` / ``sub_slot_offset``): :func:`plan_copies`
computes it again, vectorised, so a mistake in either shows as a disagreement.
Both share the input checks of :mod:`reference.transfer_checks`.

:func:`gather` and :func:`scatter` take the same arguments as
:func:`reference.transfer.gather` / :func:`reference.transfer.scatter`,
validate everything (:func:`checked_plan`) before the first write, and write
the same bytes.  This is the path vLLM's worker (:mod:`vllm_adapter.spec`) and
the benchmarks use.

Plan (:func:`plan_copies`)
    Per canonical tensor, one int64 row per block copy, in
    :class:`TensorCopies`, partitioned into :class:`CopyRun` s of one copy shape.

Host path (:mod:`reference.transfer_host`, every tensor on the CPU)
    One op per run of consecutive sub-slots, straight between block rows and
    sub-slots; equally spaced views of one buffer bundled into one op.

Device path (:mod:`reference.transfer_device`, any devices)
    Batched ``index_select`` into a temporary, then ``index_put_`` /
    ``index_copy_``, in the widest word every size, offset and address allows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from reference.transfer import IdsLike, TransferLayout
from reference.transfer_checks import (
    check_consumed,
    check_group_counts,
    check_tensors,
    ids_tensor,
    require_distinct,
    small_ints,
)
from reference.transfer_device import device_gather, device_scatter
from reference.transfer_host import host_gather, host_scatter

__all__ = [
    "BATCH_BYTES",
    "CopyRun",
    "TensorCopies",
    "checked_plan",
    "device_gather",
    "device_scatter",
    "gather",
    "host_gather",
    "host_scatter",
    "plan_copies",
    "scatter",
]

BATCH_BYTES = 8 << 20
"""About this many bytes move per op and canonical tensor (at least one row).

Host path: the most one segment op moves.  Device path: the size of the one
temporary per batch, so memory stays bounded whatever the job size, and small
enough for the allocators to reuse instead of faulting in fresh pages.
"""


# -- the plan ---------------------------------------------------------------------


@dataclass(frozen=True)
class CopyRun:
    """Rows ``[start, stop)`` of a :class:`TensorCopies` that share one copy shape.

    All of them copy ``nbytes`` bytes between a block row and a sub-slot of a
    slot whose tensor region starts at ``region_offset`` and holds
    ``blocks_per_chunk`` sub-slots.
    """

    start: int
    stop: int
    region_offset: int
    blocks_per_chunk: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class TensorCopies:
    """Every copy a job makes for one canonical tensor; row ``i`` is one block.

    Row ``i`` moves bytes ``[0, nbytes[i])`` of row ``block_ids[i]`` of the
    canonical tensor to/from bytes ``[slot_offsets[i], slot_offsets[i] + nbytes[i])``
    of slot ``slot_ids[i]``; ``sub_slots[i]`` is the sub-slot index behind that
    offset.  Rows are group-major (offloading order), then in block order (a group
    refers to a tensor at most once); ``runs`` partitions them.  All tensors are
    int64 on the CPU.
    """

    tensor_index: int
    page_bytes: int
    block_ids: torch.Tensor
    slot_ids: torch.Tensor
    sub_slots: torch.Tensor
    slot_offsets: torch.Tensor
    nbytes: torch.Tensor
    runs: tuple[CopyRun, ...]

    @property
    def num_copies(self) -> int:
        return int(self.block_ids.numel())


def plan_copies(
    layout: TransferLayout,
    block_ids: IdsLike,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slot_ids: IdsLike,
) -> tuple[TensorCopies, ...]:
    """The copies one job makes, per canonical tensor (index ``t`` of the result is tensor ``t``).

    Group ``g`` with ``n`` blocks and ``skip = block_indices[g] % B`` (its first
    block's sub-slot) spans ``cdiv(n + skip, B)`` chunks; its block ``k`` goes
    to chunk ``(k + skip) // B``, sub-slot ``(k + skip) % B``, at byte
    ``starts[t] * B + sub_slot * page_bytes[t]`` of the slot.  Validates the
    job's ids (counts, consumption, negatives, duplicates) but knows nothing of
    tensor sizes; :func:`checked_plan` checks ranges.
    """
    blocks = ids_tensor("block_ids", block_ids)
    slots = ids_tensor("slot_ids", slot_ids)
    sizes = small_ints("group_sizes", group_sizes)
    firsts = small_ints("block_indices", block_indices)
    check_group_counts(layout, sizes, firsts)
    bpcs = layout.blocks_per_chunk
    skips = [first % b for first, b in zip(firsts, bpcs, strict=True)]
    chunks = [
        -(-(n + skip) // b) if n else 0 for n, skip, b in zip(sizes, skips, bpcs, strict=True)
    ]
    check_consumed(sizes, firsts, chunks, blocks.numel(), slots.numel())
    require_distinct("block_ids", blocks)
    require_distinct("slot_ids", slots)

    starts = list(accumulate(layout.page_bytes, initial=0))
    pieces: list[list[_Piece]] = [[] for _ in layout.page_bytes]
    block_cursor = slot_cursor = 0
    for g, (n, skip, num_chunks, b) in enumerate(zip(sizes, skips, chunks, bpcs, strict=True)):
        if n == 0:
            continue
        group_blocks = blocks[block_cursor : block_cursor + n]
        position = torch.arange(skip, skip + n, dtype=torch.int64)
        group_slots = slots[slot_cursor : slot_cursor + num_chunks][position // b]
        group_subs = position % b
        for ref in layout.group_refs[g]:
            t = ref.tensor_index
            piece = _Piece(group_blocks, group_slots, group_subs, starts[t] * b, b, ref.nbytes)
            pieces[t].append(piece)
        block_cursor += n
        slot_cursor += num_chunks
    return tuple(
        _tensor_copies(t, layout.page_bytes[t], pieces[t]) for t in range(layout.num_tensors)
    )


@dataclass(frozen=True, eq=False)
class _Piece:
    """One (group, ref) share of a tensor's copies."""

    block_ids: torch.Tensor
    slot_ids: torch.Tensor
    sub_slots: torch.Tensor
    region_offset: int
    blocks_per_chunk: int
    nbytes: int


def _tensor_copies(t: int, page: int, pieces: list[_Piece]) -> TensorCopies:
    if not pieces:
        empty = torch.empty(0, dtype=torch.int64)
        return TensorCopies(t, page, empty, empty, empty, empty, empty, ())
    runs: list[CopyRun] = []
    start = 0
    for piece in pieces:
        stop = start + int(piece.block_ids.numel())
        shape = (piece.region_offset, piece.blocks_per_chunk, piece.nbytes)
        if runs and (runs[-1].region_offset, runs[-1].blocks_per_chunk, runs[-1].nbytes) == shape:
            runs[-1] = replace(runs[-1], stop=stop)  # same copy shape: extend the run
        else:
            runs.append(CopyRun(start, stop, *shape))
        start = stop
    block_ids = torch.cat([p.block_ids for p in pieces])
    slot_ids = torch.cat([p.slot_ids for p in pieces])
    sub_slots = torch.cat([p.sub_slots for p in pieces])
    regions = torch.cat([torch.full_like(p.block_ids, p.region_offset) for p in pieces])
    nbytes = torch.cat([torch.full_like(p.block_ids, p.nbytes) for p in pieces])
    return TensorCopies(
        tensor_index=t,
        page_bytes=page,
        block_ids=block_ids,
        slot_ids=slot_ids,
        sub_slots=sub_slots,
        slot_offsets=regions + sub_slots * page,
        nbytes=nbytes,
        runs=tuple(runs),
    )


def checked_plan(
    layout: TransferLayout,
    gpu_tensors: Sequence[torch.Tensor],
    pool: torch.Tensor,
    block_ids: IdsLike,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slot_ids: IdsLike,
) -> tuple[TensorCopies, ...]:
    """:func:`plan_copies`, once the tensors and the pool fit it (else ``ValueError``)."""
    plan = plan_copies(layout, block_ids, group_sizes, block_indices, slot_ids)
    top_blocks = {c.tensor_index: int(c.block_ids.max()) for c in plan if c.num_copies}
    top_slots = [int(c.slot_ids.max()) for c in plan if c.num_copies]
    check_tensors(layout, gpu_tensors, pool, top_blocks, max(top_slots, default=None))
    return plan


# -- entry points -------------------------------------------------------------------


def gather(
    layout: TransferLayout,
    gpu_tensors: Sequence[torch.Tensor],
    pool: torch.Tensor,
    block_ids: IdsLike,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slot_ids: IdsLike,
) -> None:
    """:func:`reference.transfer.gather`, fast: the same bytes written, the same calls rejected.

    ``gpu_tensors`` are only read.  Any devices work; with the cache on a GPU and
    the pool in host memory, device-to-host copies go through pinned staging and
    are complete when this returns.
    """
    plan = checked_plan(
        layout, gpu_tensors, pool, block_ids, group_sizes, block_indices, slot_ids
    )
    if _all_on_host(gpu_tensors, pool):
        host_gather(plan, gpu_tensors, pool, BATCH_BYTES)
    else:
        device_gather(plan, gpu_tensors, pool, BATCH_BYTES)


def scatter(
    layout: TransferLayout,
    gpu_tensors: Sequence[torch.Tensor],
    pool: torch.Tensor,
    block_ids: IdsLike,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slot_ids: IdsLike,
) -> None:
    """:func:`reference.transfer.scatter`, fast: the same bytes written, the same calls rejected.

    ``pool`` is only read.  Host-to-device copies are issued ``non_blocking`` on
    the current stream (from pinned staging), so they are ordered before later
    work on that stream.
    """
    plan = checked_plan(
        layout, gpu_tensors, pool, block_ids, group_sizes, block_indices, slot_ids
    )
    if _all_on_host(gpu_tensors, pool):
        host_scatter(plan, gpu_tensors, pool, BATCH_BYTES)
    else:
        device_scatter(plan, gpu_tensors, pool, BATCH_BYTES)


def _all_on_host(gpu_tensors: Sequence[torch.Tensor], pool: torch.Tensor) -> bool:
    return pool.device.type == "cpu" and all(t.device.type == "cpu" for t in gpu_tensors)
