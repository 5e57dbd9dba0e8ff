"""Moving blocks between the GPU KV cache and chunk slots: gather (store) and scatter (load).

This is vLLM 0.33.0's CPU tier data path (``v1/kv_offload/cpu/gpu_worker.py``,
``_fill_direct_ops`` / ``compute_sub_block_ptrs``) stated as tensor operations,
generalised to one ``blocks_per_chunk`` per group.

The GPU side
    A list of *canonical tensors*: uint8 ``[num_blocks, page_bytes_t]`` views of
    the paged KV cache, one row per block.  Several groups' layers may share one
    canonical tensor.  Group ``g`` reads/writes the tensors named by its
    :class:`TensorRef` s, copying bytes ``[0, nbytes)`` of each block row (the
    unpadded page; ``nbytes <= page_bytes_t``).

The chunk pool (the CPU tier)
    One uint8 tensor ``[num_slots, slot_bytes]``; one slot holds one chunk of one
    group.  Inside a slot holding a chunk of group ``g`` (``B = B_g`` blocks per
    chunk), tensor ``t`` owns ``B`` consecutive page-sized *sub-slots*::

        sub-slot j of tensor t starts at  sum(page_bytes[:t]) * B  +  j * page_bytes[t]

    and ``slot_bytes = max_g(B_g) * sum(page_bytes)``.  With one ``B`` for every
    group this is exactly vLLM's per-worker CPU chunk layout (notes section 6.2).
    Bytes of tensors a group does not use, bytes past ``nbytes``, and sub-slots
    of blocks a job does not list are never written.

A job (one :class:`reference.jobs.StoreJob` / ``LoadJob`` worth of ids)
    ``block_ids`` (flat, group-major), ``group_sizes[g]``, ``block_indices[g]``
    and ``slot_ids`` (flat, one per chunk, group-major).  A group with
    ``n = group_sizes[g] > 0`` and ``skip = block_indices[g] % B_g`` consumes the
    next ``n`` block ids and the next ``cdiv(n + skip, B_g)`` slot ids; its block
    ``k`` lives in slot ``slot_ids[(k + skip) // B_g]``, sub-slot
    ``(k + skip) % B_g``.  Groups with ``n == 0`` consume nothing.  Every id must
    be consumed (vLLM asserts the same).

:func:`plan_copies` is that mapping and nothing else; :func:`gather` and
:func:`scatter` execute it one block row at a time, as plainly as it can be
written.  Both validate everything before the first write
(:mod:`reference.transfer_checks`), so a rejected call leaves every tensor
untouched.  :mod:`reference.transfer_fast` is the same copies made fast
(bundled views, ``np.take``, word-wide copies); ``tests/test_transfer_fast.py``
proves it byte for byte equal to this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from reference.mathutil import cdiv
from reference.transfer_checks import (
    check_layout,
    check_tensors,
    ids_tensor,
    require_distinct,
    small_ints,
)

# ---------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorRef:
    """One layer of a group: which canonical tensor it lives in, how many bytes per block."""

    tensor_index: int
    nbytes: int
    """Unpadded bytes of one block of this layer; copied from the start of the row."""


@dataclass(frozen=True)
class TransferLayout:
    """Canonical tensors' page sizes, each group's refs and each group's blocks per chunk.

    ``group_refs[g]`` and ``blocks_per_chunk[g]`` are indexed by the group's
    position in offloading order (the position in a job's ``group_sizes``), not
    by its original KV-cache group index.
    """

    page_bytes: tuple[int, ...]
    group_refs: tuple[tuple[TensorRef, ...], ...]
    blocks_per_chunk: tuple[int, ...]
    _tensor_starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pages = tuple(self.page_bytes)
        refs = tuple(tuple(r) for r in self.group_refs)
        bpc = tuple(self.blocks_per_chunk)
        object.__setattr__(self, "page_bytes", pages)
        object.__setattr__(self, "group_refs", refs)
        object.__setattr__(self, "blocks_per_chunk", bpc)
        check_layout(pages, refs, bpc)
        object.__setattr__(self, "_tensor_starts", tuple(sum(pages[:t]) for t in range(len(pages))))

    @classmethod
    def uniform(
        cls,
        page_bytes: Sequence[int],
        group_refs: Sequence[Sequence[TensorRef]],
        blocks_per_chunk: int,
    ) -> TransferLayout:
        """vLLM 0.33.0's case: every group has the same blocks per chunk."""
        return cls(
            tuple(page_bytes),
            tuple(tuple(r) for r in group_refs),
            (blocks_per_chunk,) * len(group_refs),
        )

    @property
    def num_tensors(self) -> int:
        return len(self.page_bytes)

    @property
    def num_groups(self) -> int:
        return len(self.group_refs)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one chunk slot: room for the largest chunk of any group."""
        return max(self.blocks_per_chunk) * sum(self.page_bytes)

    def region_offset(self, group: int, tensor: int) -> int:
        """Byte offset, inside a slot holding a chunk of ``group``, of ``tensor``'s sub-slots."""
        return self._tensor_starts[tensor] * self.blocks_per_chunk[group]

    def sub_slot_offset(self, group: int, tensor: int, sub_slot: int) -> int:
        """Byte offset, inside a slot of ``group``, of ``tensor``'s sub-slot ``sub_slot``."""
        if not 0 <= sub_slot < self.blocks_per_chunk[group]:
            raise ValueError(
                f"sub-slot {sub_slot} out of range for group {group} "
                f"({self.blocks_per_chunk[group]} blocks per chunk)"
            )
        return self.region_offset(group, tensor) + sub_slot * self.page_bytes[tensor]


# ---------------------------------------------------------------------------
# The mapping
# ---------------------------------------------------------------------------


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


IdsLike = Sequence[int] | torch.Tensor


# Kept whole (62 lines): the mapping reads top to bottom as the module docstring states it.
def plan_copies(
    layout: TransferLayout,
    block_ids: IdsLike,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slot_ids: IdsLike,
) -> tuple[TensorCopies, ...]:
    """The copies one job makes, per canonical tensor (index ``t`` of the result is tensor ``t``).

    Validates the job's ids (counts, consumption, negatives, duplicates) but
    knows nothing of tensor sizes; :func:`gather` / :func:`scatter` check ranges.
    """
    blocks = ids_tensor("block_ids", block_ids)
    slots = ids_tensor("slot_ids", slot_ids)
    sizes = small_ints("group_sizes", group_sizes)
    firsts = small_ints("block_indices", block_indices)
    if len(sizes) != layout.num_groups or len(firsts) != layout.num_groups:
        raise ValueError(
            f"the layout has {layout.num_groups} groups, but the job gives "
            f"{len(sizes)} group_sizes and {len(firsts)} block_indices; "
            f"give one of each per offloaded group (0 for groups with nothing to move)"
        )

    skips = [first % b for first, b in zip(firsts, layout.blocks_per_chunk, strict=True)]
    chunks = [
        cdiv(n + skip, b) if n else 0
        for n, skip, b in zip(sizes, skips, layout.blocks_per_chunk, strict=True)
    ]
    if sum(sizes) != blocks.numel():
        raise ValueError(
            f"group_sizes {list(sizes)} sum to {sum(sizes)}, but {blocks.numel()} "
            f"block ids were given; every block id must belong to exactly one group"
        )
    if sum(chunks) != slots.numel():
        raise ValueError(
            f"group_sizes {list(sizes)} with block_indices {list(firsts)} span "
            f"{chunks} chunks ({sum(chunks)} in all), but {slots.numel()} slot ids were "
            f"given; every chunk needs exactly one slot id"
        )
    require_distinct("block_ids", blocks)
    require_distinct("slot_ids", slots)

    pieces: list[list[_Piece]] = [[] for _ in layout.page_bytes]
    block_cursor = slot_cursor = 0
    for g, (n, skip, num_chunks) in enumerate(zip(sizes, skips, chunks, strict=True)):
        if n == 0:
            continue
        b = layout.blocks_per_chunk[g]
        group_blocks = blocks[block_cursor : block_cursor + n]
        position = torch.arange(skip, skip + n, dtype=torch.int64)
        group_slots = slots[slot_cursor : slot_cursor + num_chunks][position // b]
        group_subs = position % b
        for ref in layout.group_refs[g]:
            t = ref.tensor_index
            region = layout.region_offset(g, t)
            pieces[t].append(_Piece(group_blocks, group_slots, group_subs, region, b, ref.nbytes))
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


# ---------------------------------------------------------------------------
# Execution: one copy per row of the plan
# ---------------------------------------------------------------------------


def gather(
    layout: TransferLayout,
    gpu_tensors: Sequence[torch.Tensor],
    pool: torch.Tensor,
    block_ids: IdsLike,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slot_ids: IdsLike,
) -> None:
    """Store direction: copy the listed blocks into their sub-slots of ``pool``.

    For every canonical tensor and every block the job lists for it, bytes
    ``[0, nbytes)`` of the block's row go to ``[offset, offset + nbytes)`` of its
    slot.  ``gpu_tensors`` are only read.  Any devices work; every copy is
    complete when this returns.
    """
    plan = plan_copies(layout, block_ids, group_sizes, block_indices, slot_ids)
    check_tensors(layout, gpu_tensors, pool, plan)
    for copies in plan:
        rows = gpu_tensors[copies.tensor_index]
        for block, slot, offset, nbytes in _each_copy(copies):
            pool[slot, offset : offset + nbytes] = rows[block, :nbytes]


def scatter(
    layout: TransferLayout,
    gpu_tensors: Sequence[torch.Tensor],
    pool: torch.Tensor,
    block_ids: IdsLike,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slot_ids: IdsLike,
) -> None:
    """Load direction: copy sub-slots of ``pool`` into the listed blocks.

    The exact reverse of :func:`gather`: bytes ``[offset, offset + nbytes)`` of
    the slot go to ``[0, nbytes)`` of the block's row; the rest of the row is
    left alone.  ``pool`` is only read.
    """
    plan = plan_copies(layout, block_ids, group_sizes, block_indices, slot_ids)
    check_tensors(layout, gpu_tensors, pool, plan)
    for copies in plan:
        rows = gpu_tensors[copies.tensor_index]
        for block, slot, offset, nbytes in _each_copy(copies):
            rows[block, :nbytes] = pool[slot, offset : offset + nbytes]


def _each_copy(copies: TensorCopies) -> list[tuple[int, int, int, int]]:
    """``(block id, slot id, byte offset in the slot, nbytes)`` of every row of ``copies``."""
    return list(
        zip(
            copies.block_ids.tolist(),
            copies.slot_ids.tolist(),
            copies.slot_offsets.tolist(),
            copies.nbytes.tolist(),
            strict=True,
        )
    )
