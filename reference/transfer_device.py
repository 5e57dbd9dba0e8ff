"""The fast path's device half: batched indexed copies on any devices.

Per canonical tensor and batch of about ``batch_bytes``: ``index_select``
into a temporary (pinned host staging when crossing devices), then
``index_put_`` / ``index_copy_``, in the widest word (8, 4, 2 or 1 bytes) that
every size, offset and address allows.  Called by :mod:`reference.transfer_fast`
with a validated plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from reference.transfer_fast import CopyRun, TensorCopies

__all__ = ["device_gather", "device_scatter"]


def device_gather(
    plan: tuple[TensorCopies, ...],
    gpu_tensors: Sequence[torch.Tensor],
    pool: torch.Tensor,
    batch_bytes: int,
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
        for start, stop in _batches(copies.num_copies, width * word, batch_bytes):
            rows = _moved(src_words.index_select(0, ids[start:stop]), pool.device)
            for run, lo, hi in _runs_within(copies.runs, start, stop):
                target = _sub_slot_view(pool_words, run, copies.page_bytes, word)
                target.index_put_(
                    (slots[lo:hi], subs[lo:hi]),
                    rows[lo - start : hi - start, : run.nbytes // word],
                )


def device_scatter(
    plan: tuple[TensorCopies, ...],
    gpu_tensors: Sequence[torch.Tensor],
    pool: torch.Tensor,
    batch_bytes: int,
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
        for start, stop in _batches(copies.num_copies, width * word, batch_bytes):
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


# -- device path helpers --------------------------------------------------------


def _batches(num_rows: int, row_bytes: int, batch_bytes: int) -> list[tuple[int, int]]:
    step = max(1, batch_bytes // row_bytes)
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
