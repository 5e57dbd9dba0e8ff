"""Where each chunk's bytes live: the byte layout of a chunk slot, stated once, plainly.

This is vLLM 0.33.0's CPU tier data path (``v1/kv_offload/cpu/gpu_worker.py``,
``_fill_direct_ops`` / ``compute_sub_block_ptrs``) stated block by block,
generalised to one ``blocks_per_chunk`` per group.  It is the specification;
:mod:`reference.transfer_fast` is a separate, fast implementation of it, and
``tests/test_transfer_fast.py`` proves the two write the same bytes.

The GPU side
    A list of *canonical tensors*: uint8 ``[num_blocks, page_bytes_t]`` views of
    the paged KV cache, one row per block.  Several groups' layers may share one
    canonical tensor (a packed, block-outermost cache is one canonical tensor
    whose page is the whole packed block).  Group ``g`` reads/writes the tensors
    named by its :class:`TensorRef` s, copying bytes ``[0, nbytes)`` of each
    block row (the unpadded page; ``nbytes <= page_bytes_t``).

The chunk pool (the CPU tier)
    One uint8 tensor ``[num_slots, slot_bytes]``; one slot holds one chunk of one
    group.  :meth:`TransferLayout.sub_slot_offset` says where a block's bytes
    go inside the slot; :func:`place` and :func:`chunks_of` say which chunk and
    sub-slot a block takes; :func:`job_copies` applies them to one job.  Bytes
    of tensors a group does not use, bytes past ``nbytes``, and sub-slots of
    blocks a job does not list are never written.

A job (one :class:`reference.jobs.StoreJob` / ``LoadJob`` worth of ids)
    ``block_ids`` (flat, group-major), ``group_sizes[g]``, ``block_indices[g]``
    (the request position of the group's first listed block) and ``slot_ids``
    (flat, one per chunk the group's blocks touch, group-major).  Groups with
    ``group_sizes[g] == 0`` consume nothing.  Every id must be consumed (vLLM
    asserts the same).

:func:`gather` and :func:`scatter` execute :func:`job_copies` one copy at a
time, as plainly as it can be written.  Both validate everything before the
first write (:mod:`reference.transfer_checks`), so a rejected call leaves every
tensor untouched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from reference.transfer_checks import (
    check_consumed,
    check_group_counts,
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

    def __post_init__(self) -> None:
        pages = tuple(self.page_bytes)
        refs = tuple(tuple(r) for r in self.group_refs)
        bpc = tuple(self.blocks_per_chunk)
        object.__setattr__(self, "page_bytes", pages)
        object.__setattr__(self, "group_refs", refs)
        object.__setattr__(self, "blocks_per_chunk", bpc)
        check_layout(pages, refs, bpc)

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
        """Byte offset, inside a slot holding a chunk of ``group``, of ``tensor``'s sub-slots.

        Each canonical tensor owns ``blocks_per_chunk`` page-sized sub-slots, in
        tensor order; with one ``blocks_per_chunk`` for every group this is
        exactly vLLM's per-worker CPU chunk layout (notes section 6.2).
        """
        return sum(self.page_bytes[:tensor]) * self.blocks_per_chunk[group]

    def sub_slot_offset(self, group: int, tensor: int, sub_slot: int) -> int:
        """Byte offset, inside a slot of ``group``, of ``tensor``'s sub-slot ``sub_slot``."""
        if not 0 <= sub_slot < self.blocks_per_chunk[group]:
            raise ValueError(
                f"sub-slot {sub_slot} out of range for group {group} "
                f"({self.blocks_per_chunk[group]} blocks per chunk)"
            )
        return self.region_offset(group, tensor) + sub_slot * self.page_bytes[tensor]


# ---------------------------------------------------------------------------
# The mapping: which chunk and sub-slot a block takes
# ---------------------------------------------------------------------------


def place(position: int, blocks_per_chunk: int) -> tuple[int, int]:
    """``(chunk, sub_slot)`` of the block at ``position`` in the request (both counted from 0).

    A request's blocks fill its chunks in order, ``blocks_per_chunk`` at a time.
    """
    return position // blocks_per_chunk, position % blocks_per_chunk


def chunks_of(first: int, n: int, blocks_per_chunk: int) -> range:
    """The request's chunks holding its blocks ``first .. first + n - 1`` (none for ``n == 0``)."""
    if n == 0:
        return range(0)
    first_chunk, _ = place(first, blocks_per_chunk)
    last_chunk, _ = place(first + n - 1, blocks_per_chunk)
    return range(first_chunk, last_chunk + 1)


@dataclass(frozen=True)
class BlockCopy:
    """One copy of a job: a block of one layer (ref) <-> its sub-slot.

    Bytes ``[0, nbytes)`` of row ``block_id`` of canonical tensor ``tensor``
    <-> bytes ``[offset, offset + nbytes)`` of slot ``slot_id``.
    """

    group: int
    """Offloaded-group position (index into the job's ``group_sizes``)."""
    position: int
    """The block's position in the request (``block_indices[group] + k``)."""
    tensor: int
    block_id: int
    slot_id: int
    sub_slot: int
    offset: int
    nbytes: int


IdsLike = Sequence[int] | torch.Tensor


def job_copies(
    layout: TransferLayout,
    block_ids: IdsLike,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slot_ids: IdsLike,
) -> list[BlockCopy]:
    """Every copy one job makes: group by group, block by block, then each ref of the group.

    Group ``g``'s blocks are the next ``group_sizes[g]`` block ids; they sit at
    request positions ``block_indices[g]``, ``block_indices[g] + 1``, ...; the
    chunks they take (:func:`chunks_of`) are the next slot ids, one per chunk,
    in order.  Raises ``ValueError`` when the counts do not add up; repeated
    ids are allowed here (:func:`gather` / :func:`scatter` reject them).
    """
    blocks = ids_tensor("block_ids", block_ids).tolist()
    slots = ids_tensor("slot_ids", slot_ids).tolist()
    sizes = small_ints("group_sizes", group_sizes)
    firsts = small_ints("block_indices", block_indices)
    check_group_counts(layout, sizes, firsts)
    spans = [
        chunks_of(first, n, b)
        for n, first, b in zip(sizes, firsts, layout.blocks_per_chunk, strict=True)
    ]
    check_consumed(sizes, firsts, [len(span) for span in spans], len(blocks), len(slots))
    copies = []
    next_block = next_slot = 0
    for g, (n, first, span) in enumerate(zip(sizes, firsts, spans, strict=True)):
        group_blocks = blocks[next_block : next_block + n]
        slot_of_chunk = dict(zip(span, slots[next_slot : next_slot + len(span)], strict=True))
        for position, block_id in enumerate(group_blocks, start=first):
            chunk, sub_slot = place(position, layout.blocks_per_chunk[g])
            for ref in layout.group_refs[g]:
                t = ref.tensor_index
                offset = layout.sub_slot_offset(g, t, sub_slot)
                copies.append(
                    BlockCopy(g, position, t, block_id, slot_of_chunk[chunk], sub_slot, offset,
                              ref.nbytes)
                )
        next_block += n
        next_slot += len(span)
    return copies


# ---------------------------------------------------------------------------
# Execution: one copy at a time
# ---------------------------------------------------------------------------


def checked_copies(
    layout: TransferLayout,
    gpu_tensors: Sequence[torch.Tensor],
    pool: torch.Tensor,
    block_ids: IdsLike,
    group_sizes: Sequence[int],
    block_indices: Sequence[int],
    slot_ids: IdsLike,
) -> list[BlockCopy]:
    """:func:`job_copies` tensor by tensor, once the ids are distinct and fit the tensors.

    The order matters only where canonical tensors overlap in memory: a load
    then leaves the bytes of the later tensor.  Raises ``ValueError`` before
    anything is written.
    """
    copies = job_copies(layout, block_ids, group_sizes, block_indices, slot_ids)
    require_distinct("block_ids", ids_tensor("block_ids", block_ids))
    require_distinct("slot_ids", ids_tensor("slot_ids", slot_ids))
    top_blocks: dict[int, int] = {}
    for c in copies:
        top_blocks[c.tensor] = max(top_blocks.get(c.tensor, 0), c.block_id)
    top_slot = max((c.slot_id for c in copies), default=None)
    check_tensors(layout, gpu_tensors, pool, top_blocks, top_slot)
    return sorted(copies, key=lambda c: c.tensor)


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

    For every copy of :func:`job_copies`, bytes ``[0, nbytes)`` of the block's
    row go to ``[offset, offset + nbytes)`` of its slot.  ``gpu_tensors`` are
    only read.  Any devices work; every copy is complete when this returns.
    """
    for c in checked_copies(
        layout, gpu_tensors, pool, block_ids, group_sizes, block_indices, slot_ids
    ):
        rows = gpu_tensors[c.tensor]
        pool[c.slot_id, c.offset : c.offset + c.nbytes] = rows[c.block_id, : c.nbytes]


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
    for c in checked_copies(
        layout, gpu_tensors, pool, block_ids, group_sizes, block_indices, slot_ids
    ):
        rows = gpu_tensors[c.tensor]
        rows[c.block_id, : c.nbytes] = pool[c.slot_id, c.offset : c.offset + c.nbytes]
