"""An implementation of :mod:`reference.transfer`'s layout, proved equal to it by tests.

``tests/test_transfer_fast.py`` checks, byte for byte, that this module writes
exactly what the spec's per-row gather/scatter writes, on random layouts,
dtypes, shared and overlapping buffers, and devices.

:func:`gather` and :func:`scatter` take the same arguments as
:func:`reference.transfer.gather` / :func:`reference.transfer.scatter`, run
the same validation (:func:`reference.transfer.plan_copies`,
:func:`reference.transfer_checks.check_tensors`) before the first write, and
write the same bytes; only the way the bytes move differs.  This is the path
vLLM's worker (:mod:`vllm_adapter.spec`) and the benchmarks use.

Host path (:func:`host_gather` / :func:`host_scatter`, every tensor on the CPU)
    No temporaries: one op per *segment* (the rows of one chunk that land in
    consecutive sub-slots), straight between block rows and sub-slots, through
    NumPy's ``take`` / fancy assignment (a ``memcpy`` per row).  Canonical
    tensors that are equally spaced, non-overlapping views of one buffer and
    make the same copies are *bundled* into one 3-D view, so one op moves the
    bytes of all of them; :func:`_bundles_with` proves from storage pointers,
    strides and offsets that writing through such a view is exact.

Device path (:func:`device_gather` / :func:`device_scatter`, any devices)
    Batched ``index_select`` into a temporary (pinned host staging when
    crossing devices), then ``index_put_`` / ``index_copy_``, in the widest word
    (8, 4, 2 or 1 bytes) that every size, offset and address allows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from reference.transfer import CopyRun, IdsLike, TensorCopies, TransferLayout, plan_copies
from reference.transfer_checks import check_tensors

BATCH_BYTES = 8 << 20
"""About this many bytes move per op and canonical tensor (at least one row).

Host path: the most one segment op moves.  Device path: the size of the one
temporary per batch, so memory stays bounded whatever the job size, and small
enough for the allocators to reuse instead of faulting in fresh pages.
"""


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
    plan = plan_copies(layout, block_ids, group_sizes, block_indices, slot_ids)
    check_tensors(layout, gpu_tensors, pool, plan)
    if _all_on_host(gpu_tensors, pool):
        host_gather(plan, gpu_tensors, pool)
    else:
        device_gather(plan, gpu_tensors, pool)


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
    plan = plan_copies(layout, block_ids, group_sizes, block_indices, slot_ids)
    check_tensors(layout, gpu_tensors, pool, plan)
    if _all_on_host(gpu_tensors, pool):
        host_scatter(plan, gpu_tensors, pool)
    else:
        device_scatter(plan, gpu_tensors, pool)


def _all_on_host(gpu_tensors: Sequence[torch.Tensor], pool: torch.Tensor) -> bool:
    return pool.device.type == "cpu" and all(t.device.type == "cpu" for t in gpu_tensors)


# -- device path: any devices ---------------------------------------------------


def device_gather(
    plan: tuple[TensorCopies, ...], gpu_tensors: Sequence[torch.Tensor], pool: torch.Tensor
) -> None:
    """Store a checked plan through one ``index_select`` + ``index_put_`` per tensor and batch."""
    for copies in plan:
        if copies.num_copies == 0:
            continue
        src = gpu_tensors[copies.tensor_index]
        word = _word_bytes(copies, src, pool)
        width = max(run.nbytes for run in copies.runs) // word
        src_words = _as_words(src, word).narrow(1, 0, width)
        pool_words = _as_words(pool, word)
        ids = copies.block_ids.to(src.device, non_blocking=True)
        slots = copies.slot_ids.to(pool.device, non_blocking=True)
        subs = copies.sub_slots.to(pool.device, non_blocking=True)
        for start, stop in _batches(copies.num_copies, width * word):
            rows = _moved(src_words.index_select(0, ids[start:stop]), pool.device)
            for run, lo, hi in _runs_within(copies.runs, start, stop):
                target = _sub_slot_view(pool_words, run, copies.page_bytes, word)
                target.index_put_(
                    (slots[lo:hi], subs[lo:hi]),
                    rows[lo - start : hi - start, : run.nbytes // word],
                )


def device_scatter(
    plan: tuple[TensorCopies, ...], gpu_tensors: Sequence[torch.Tensor], pool: torch.Tensor
) -> None:
    """Load a checked plan through one ``index_select`` + ``index_copy_`` per tensor and batch."""
    for copies in plan:
        if copies.num_copies == 0:
            continue
        dst = gpu_tensors[copies.tensor_index]
        word = _word_bytes(copies, dst, pool)
        width = max(run.nbytes for run in copies.runs) // word
        rows_view, row_index = _sub_slot_rows(_as_words(pool, word), copies, width, word)
        dst_words = _as_words(dst, word)
        ids = copies.block_ids.to(dst.device, non_blocking=True)
        stage = pool.device.type == "cpu" and dst.device.type == "cuda"
        for start, stop in _batches(copies.num_copies, width * word):
            rows = torch.empty(
                (stop - start, width), dtype=rows_view.dtype, device=pool.device, pin_memory=stage
            )
            torch.index_select(rows_view, 0, row_index[start:stop], out=rows)
            rows = _moved(rows, dst.device)
            for run, lo, hi in _runs_within(copies.runs, start, stop):
                w = run.nbytes // word
                dst_words.narrow(1, 0, w).index_copy_(
                    0, ids[lo:hi], rows[lo - start : hi - start, :w]
                )


# -- host path: every tensor on the CPU ------------------------------------------


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
    plan: tuple[TensorCopies, ...], gpu_tensors: Sequence[torch.Tensor], pool: torch.Tensor
) -> None:
    """Store a checked plan, every tensor on the CPU: one copy op per bundle and segment."""
    for bundle in _bundles(plan, gpu_tensors):
        _gather_bundle(bundle, pool)


def host_scatter(
    plan: tuple[TensorCopies, ...], gpu_tensors: Sequence[torch.Tensor], pool: torch.Tensor
) -> None:
    """Load a checked plan, every tensor on the CPU: one copy op per bundle and segment."""
    for bundle in _bundles(plan, gpu_tensors):
        _scatter_bundle(bundle, pool)


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


def _segments(copies: TensorCopies) -> list[tuple[int, int, int, int, int]]:
    """``(lo, hi, slot, sub_slot, run)``: rows ``[lo, hi)`` go to consecutive sub-slots.

    Row ``lo + i`` is copied to/from sub-slot ``sub_slot + i`` of slot ``slot``,
    in the region of run ``run``.  A segment never crosses a chunk or a run and
    moves at most about :data:`BATCH_BYTES` bytes per tensor (at least one row).
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
        step = max(1, BATCH_BYTES // copies.runs[r].nbytes)
        while hi - lo > step:
            out.append((lo, lo + step, slot, sub, r))
            lo += step
            sub += step
        out.append((lo, hi, slot, sub, r))
    return out


def _gather_bundle(bundle: _Bundle, pool: torch.Tensor) -> None:
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
    for lo, hi, slot, sub, r in _segments(copies):
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


def _scatter_bundle(bundle: _Bundle, pool: torch.Tensor) -> None:
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
    for lo, hi, slot, sub, r in _segments(copies):
        run, rows = copies.runs[r], hi - lo
        start = base + slot * pool.stride(0) + run.region_offset + sub * page
        source = pool.as_strided(
            (count, rows, run.nbytes), (bundle.region_steps[r], page, 1), start
        )
        view_np[:, ids_np[lo:hi], : run.nbytes] = source.numpy()


# -- device path helpers --------------------------------------------------------


def _batches(num_rows: int, row_bytes: int) -> list[tuple[int, int]]:
    step = max(1, BATCH_BYTES // row_bytes)
    return [(a, min(a + step, num_rows)) for a in range(0, num_rows, step)]


def _runs_within(
    runs: tuple[CopyRun, ...], start: int, stop: int
) -> list[tuple[CopyRun, int, int]]:
    """The runs overlapping rows ``[start, stop)``, each with its overlap ``[lo, hi)``."""
    return [
        (run, max(run.start, start), min(run.stop, stop))
        for run in runs
        if run.start < stop and start < run.stop
    ]


def _moved(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``rows`` on ``device``; a device-to-host copy lands in pinned memory and is waited for."""
    if rows.device == device:
        return rows
    if rows.device.type == "cuda" and device.type == "cpu":
        staging = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        staging.copy_(rows, non_blocking=True)
        torch.cuda.current_stream(rows.device).synchronize()
        return staging
    return rows.to(device, non_blocking=True)


def _sub_slot_view(pool_words: torch.Tensor, run: CopyRun, page: int, word: int) -> torch.Tensor:
    """``[num_slots, blocks_per_chunk, nbytes]`` view of one tensor region of every slot.

    Indexing it with ``(slot, sub_slot)`` gives the first ``nbytes`` of that
    sub-slot.  Its elements never overlap (the region holds ``blocks_per_chunk``
    whole pages), so it can be written through.
    """
    return pool_words.as_strided(
        (pool_words.shape[0], run.blocks_per_chunk, run.nbytes // word),
        (pool_words.stride(0), page // word, 1),
        pool_words.storage_offset() + run.region_offset // word,
    )


def _sub_slot_rows(
    pool_words: torch.Tensor, copies: TensorCopies, width: int, word: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A read-only ``[rows, width]`` view of the pool and the row of each listed sub-slot.

    Row ``r`` of the view starts ``r * step`` bytes into the pool, where ``step``
    divides every slot and sub-slot start, so one ``index_select`` fetches the
    sub-slots of every group at once.  Its rows overlap; it is never written.
    """
    row_stride = pool_words.stride(0) * word
    step = math.gcd(row_stride, copies.page_bytes, *(r.region_offset for r in copies.runs))
    extent = (pool_words.shape[0] - 1) * row_stride + pool_words.shape[1] * word
    num_rows = (extent - width * word) // step + 1
    view = pool_words.as_strided((num_rows, width), (step // word, 1), pool_words.storage_offset())
    starts = copies.slot_ids * row_stride + copies.slot_offsets
    return view, (starts // step).to(pool_words.device, non_blocking=True)


_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _word_bytes(copies: TensorCopies, gpu: torch.Tensor, pool: torch.Tensor) -> int:
    """The widest word (8, 4, 2 or 1 bytes) every size, offset and address here is a multiple of.

    Copying words instead of bytes is the same copy, several times faster.
    """
    common = math.gcd(
        copies.page_bytes,
        gpu.stride(0),
        gpu.storage_offset(),
        gpu.data_ptr(),
        pool.stride(0),
        pool.shape[1],
        pool.storage_offset(),
        pool.data_ptr(),
        *(r.region_offset for r in copies.runs),
        *(r.nbytes for r in copies.runs),
    )
    return next(w for w in _WORD_DTYPES if common % w == 0)


def _as_words(x: torch.Tensor, word: int) -> torch.Tensor:
    return x if word == 1 else x.view(_WORD_DTYPES[word])
