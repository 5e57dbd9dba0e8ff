"""The fast path's host half: every tensor on the CPU, no temporaries.

One op per *segment* (the rows of one chunk that land in consecutive
sub-slots), straight between block rows and sub-slots, through NumPy's
``take`` / fancy assignment (a ``memcpy`` per row).  Canonical tensors that are
equally spaced, non-overlapping views of one buffer and make the same copies
are *bundled* into one 3-D view, so one op moves the bytes of all of them;
:func:`_bundles_with` proves from storage pointers, strides and offsets that
writing through such a view is exact.  Called by :mod:`reference.transfer_fast`
with a validated plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from reference.transfer_fast import TensorCopies

__all__ = ["host_gather", "host_scatter"]


@dataclass(frozen=True, eq=False)
class _Bundle:
    """``count`` consecutive canonical tensors with identical copies, as one strided view.

    ``view`` is ``[count, rows, page]``: element ``[k, b]`` is row ``b`` of
    tensor ``copies.tensor_index + k``; it never overlaps itself.  Run ``r``'s
    region of tensor ``k`` starts ``region_steps[r] * k`` bytes after
    ``copies.runs[r].region_offset``.
    """

    copies: TensorCopies
    view: torch.Tensor
    region_steps: tuple[int, ...]

    @property
    def count(self) -> int:
        return int(self.view.shape[0])


def host_gather(
    plan: tuple[TensorCopies, ...],
    gpu_tensors: Sequence[torch.Tensor],
    pool: torch.Tensor,
    batch_bytes: int,
) -> None:
    """Store a checked plan, every tensor on the CPU: one copy op per bundle and segment."""
    for bundle in _bundles(plan, gpu_tensors):
        _gather_bundle(bundle, pool, batch_bytes)


def host_scatter(
    plan: tuple[TensorCopies, ...],
    gpu_tensors: Sequence[torch.Tensor],
    pool: torch.Tensor,
    batch_bytes: int,
) -> None:
    """Load a checked plan, every tensor on the CPU: one copy op per bundle and segment."""
    for bundle in _bundles(plan, gpu_tensors):
        _scatter_bundle(bundle, pool, batch_bytes)


def _bundles(plan: tuple[TensorCopies, ...], tensors: Sequence[torch.Tensor]) -> list[_Bundle]:
    """The plan's non-empty tensors, consecutive ones bundled where that is exact."""
    groups: list[list[TensorCopies]] = []
    for copies in plan:
        if copies.num_copies == 0:
            continue
        if groups and _bundles_with(groups[-1], copies, tensors):
            groups[-1].append(copies)
        else:
            groups.append([copies])
    out = []
    for group in groups:
        first = group[0]
        src = tensors[first.tensor_index]
        step = (
            tensors[group[1].tensor_index].storage_offset() - src.storage_offset()
            if len(group) > 1
            else 0
        )
        view = src.as_strided(
            (len(group), src.shape[0], src.shape[1]),
            (step, src.stride(0), 1),
            src.storage_offset(),
        )
        steps = tuple(
            (group[1].runs[r].region_offset - run.region_offset) if len(group) > 1 else 0
            for r, run in enumerate(first.runs)
        )
        out.append(_Bundle(first, view, steps))
    return out


def _bundles_with(
    group: list[TensorCopies], copies: TensorCopies, tensors: Sequence[torch.Tensor]
) -> bool:
    """Whether ``copies`` can join ``group`` (all of it on the same equally spaced terms)."""
    first, last = group[0], group[-1]
    k = len(group)
    if copies.tensor_index != last.tensor_index + 1 or copies.page_bytes != first.page_bytes:
        return False
    a, b = tensors[first.tensor_index], tensors[copies.tensor_index]
    if (
        b.untyped_storage().data_ptr() != a.untyped_storage().data_ptr()
        or b.shape != a.shape
        or b.stride() != a.stride()
    ):
        return False
    step = int(tensors[group[1].tensor_index].storage_offset() if k > 1 else b.storage_offset())
    step -= int(a.storage_offset())
    if step <= 0 or int(b.storage_offset() - a.storage_offset()) != k * step:
        return False
    # The bundled view must not overlap itself (writes through it are then exact).
    if not _disjoint((k + 1, int(a.shape[0]), int(a.shape[1])), (step, a.stride(0), 1)):
        return False
    if len(copies.runs) != len(first.runs):
        return False
    for mine, theirs in zip(copies.runs, first.runs, strict=True):
        if (mine.start, mine.stop, mine.blocks_per_chunk, mine.nbytes) != (
            theirs.start,
            theirs.stop,
            theirs.blocks_per_chunk,
            theirs.nbytes,
        ):
            return False
        # Regions equally spaced, each a whole run of sub-slots apart: no overlap.
        spacing = theirs.blocks_per_chunk * first.page_bytes
        if mine.region_offset != theirs.region_offset + k * spacing:
            return False
    return (
        torch.equal(copies.block_ids, first.block_ids)
        and torch.equal(copies.slot_ids, first.slot_ids)
        and torch.equal(copies.sub_slots, first.sub_slots)
    )


def _disjoint(sizes: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """A sufficient test that a strided view's elements never share an address."""
    extent = 0
    for stride, size in sorted(zip(strides, sizes, strict=True)):
        if size == 1:
            continue
        if stride <= extent:
            return False
        extent += (size - 1) * stride
    return True


def _segments(copies: TensorCopies, batch_bytes: int) -> list[tuple[int, int, int, int, int]]:
    """``(lo, hi, slot, sub_slot, run)``: rows ``[lo, hi)`` go to consecutive sub-slots.

    Row ``lo + i`` is copied to/from sub-slot ``sub_slot + i`` of slot ``slot``,
    in the region of run ``run``.  A segment never crosses a chunk or a run and
    moves at most about ``batch_bytes`` bytes per tensor (at least one row).
    """
    n = copies.num_copies
    slots, subs = copies.slot_ids, copies.sub_slots
    new = torch.ones(n, dtype=torch.bool)
    if n > 1:
        torch.ne(slots[1:], slots[:-1], out=new[1:])
        new[1:] |= subs[1:] != subs[:-1] + 1
    run_of = torch.empty(n, dtype=torch.int64)
    for r, run in enumerate(copies.runs):
        new[run.start] = True
        run_of[run.start : run.stop] = r
    starts = new.nonzero().flatten()
    los = starts.tolist()
    his = los[1:] + [n]
    out: list[tuple[int, int, int, int, int]] = []
    for lo, hi, slot, sub, r in zip(
        los,
        his,
        slots[starts].tolist(),
        subs[starts].tolist(),
        run_of[starts].tolist(),
        strict=True,
    ):
        step = max(1, batch_bytes // copies.runs[r].nbytes)
        while hi - lo > step:
            out.append((lo, lo + step, slot, sub, r))
            lo += step
            sub += step
        out.append((lo, hi, slot, sub, r))
    return out


def _gather_bundle(bundle: _Bundle, pool: torch.Tensor, batch_bytes: int) -> None:
    """Store on the host: one indexed copy per segment, straight into the slot.

    Whole rows from a contiguous view into contiguous sub-slots go through
    NumPy's ``take(out=)`` (a ``memcpy`` per row, little overhead per call);
    anything else through torch's ``index_select(out=)`` on strided views.
    ``take`` copies a non-contiguous source whole and buffers a non-contiguous
    output, so it only gets contiguous ones; ``mode="clip"`` skips its output
    buffering (ids were range-checked already).
    """
    copies, view, count = bundle.copies, bundle.view, bundle.count
    page = copies.page_bytes
    ids = copies.block_ids
    ids_np = ids.numpy()
    view_np = view.numpy() if view.is_contiguous() else None
    pool_np = pool.numpy()
    base = pool.storage_offset()
    for lo, hi, slot, sub, r in _segments(copies, batch_bytes):
        run, rows = copies.runs[r], hi - lo
        start = run.region_offset + sub * page
        step = bundle.region_steps[r]
        if view_np is not None and run.nbytes == page and (count == 1 or step == rows * page):
            target = pool_np[slot, start : start + count * rows * page]
            np.take(
                view_np, ids_np[lo:hi], axis=1, out=target.reshape(count, rows, page), mode="clip"
            )
        else:
            strided = pool.as_strided(
                (count, rows, run.nbytes), (step, page, 1), base + slot * pool.stride(0) + start
            )
            torch.index_select(view.narrow(2, 0, run.nbytes), 1, ids[lo:hi], out=strided)


def _scatter_bundle(bundle: _Bundle, pool: torch.Tensor, batch_bytes: int) -> None:
    """Load on the host: one fancy-index assignment per segment, slot bytes straight into rows.

    NumPy's ``rows[:, ids] = sub_slots`` copies each row with one ``memcpy``-speed
    move (torch's ``index_copy_`` goes element by element), reading the slot in
    place.
    """
    copies, count = bundle.copies, bundle.count
    page = copies.page_bytes
    ids_np = copies.block_ids.numpy()
    view_np = bundle.view.numpy()
    base = pool.storage_offset()
    for lo, hi, slot, sub, r in _segments(copies, batch_bytes):
        run, rows = copies.runs[r], hi - lo
        start = base + slot * pool.stride(0) + run.region_offset + sub * page
        source = pool.as_strided(
            (count, rows, run.nbytes), (bundle.region_steps[r], page, 1), start
        )
        view_np[:, ids_np[lo:hi], : run.nbytes] = source.numpy()
