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
:func:`scatter` execute it.  Both validate everything before the first write, so
a rejected call leaves every tensor untouched.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from reference.mathutil import cdiv

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
        if not pages:
            raise ValueError("a transfer layout needs at least one canonical tensor")
        for t, page in enumerate(pages):
            if not _is_int(page) or page <= 0:
                raise ValueError(f"page_bytes[{t}] must be a positive int, got {page!r}")
        if not refs:
            raise ValueError("a transfer layout needs at least one group")
        if len(bpc) != len(refs):
            raise ValueError(
                f"blocks_per_chunk has {len(bpc)} entries but group_refs has {len(refs)} "
                f"groups; give one blocks_per_chunk per group"
            )
        for g, (group, b) in enumerate(zip(refs, bpc, strict=True)):
            if not _is_int(b) or b <= 0:
                raise ValueError(f"blocks_per_chunk[{g}] must be a positive int, got {b!r}")
            if not group:
                raise ValueError(f"group {g} has no tensor refs; every group copies something")
            seen: set[int] = set()
            for ref in group:
                t = ref.tensor_index
                if not _is_int(t) or not 0 <= t < len(pages):
                    raise ValueError(
                        f"group {g} refers to canonical tensor {t!r}, but there are "
                        f"{len(pages)} tensors (0..{len(pages) - 1})"
                    )
                if t in seen:
                    raise ValueError(f"group {g} refers to canonical tensor {t} twice")
                seen.add(t)
                if not _is_int(ref.nbytes) or not 0 < ref.nbytes <= pages[t]:
                    raise ValueError(
                        f"group {g}'s ref to tensor {t} copies {ref.nbytes!r} bytes per "
                        f"block; it must be in 1..page_bytes[{t}] = {pages[t]}"
                    )
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
    blocks = _ids_tensor("block_ids", block_ids)
    slots = _ids_tensor("slot_ids", slot_ids)
    sizes = _small_ints("group_sizes", group_sizes)
    firsts = _small_ints("block_indices", block_indices)
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
    _require_distinct("block_ids", blocks)
    _require_distinct("slot_ids", slots)

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
# Execution
# ---------------------------------------------------------------------------

BATCH_BYTES = 8 << 20
"""Rows are moved in batches of about this many bytes per canonical tensor.

Host path (every tensor on the CPU): no temporaries at all; each copy op moves
the rows of one chunk that land in consecutive sub-slots (at most this many
bytes), straight from block rows into the slot or back.  Device path: one
temporary per batch (plus a host staging copy when crossing devices) keeps
memory bounded whatever the job size, and small enough for the allocators to
reuse instead of faulting in fresh pages on every call.
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
    """Store direction: copy the listed blocks into their sub-slots of ``pool``.

    ``gpu_tensors`` are only read.  Any devices work; with the cache on a GPU and
    the pool in host memory, device-to-host copies go through pinned staging and
    are complete when this returns.
    """
    plan = plan_copies(layout, block_ids, group_sizes, block_indices, slot_ids)
    _check_tensors(layout, gpu_tensors, pool, plan)
    if _all_on_host(gpu_tensors, pool):
        for bundle in _bundles(plan, gpu_tensors):
            _gather_host(bundle, pool)
        return
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

    ``pool`` is only read.  Host-to-device copies are issued ``non_blocking`` on
    the current stream (from pinned staging), so they are ordered before later
    work on that stream.
    """
    plan = plan_copies(layout, block_ids, group_sizes, block_indices, slot_ids)
    _check_tensors(layout, gpu_tensors, pool, plan)
    if _all_on_host(gpu_tensors, pool):
        for bundle in _bundles(plan, gpu_tensors):
            _scatter_host(bundle, pool)
        return
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


# -- host path: every tensor on the CPU ---------------------------------------
#
# No temporaries: every op copies straight between block rows and sub-slots, one
# op per *segment* (the rows of one chunk that land in consecutive sub-slots).
# Canonical tensors that are equally spaced views of one buffer (vLLM's
# layer-outermost layouts: gemma-4's 10 tensors) and make the same copies are
# *bundled*: one 3-D view ``[tensors, blocks, page]`` stands for all of them,
# and one op per segment moves the bytes of every tensor (their sub-slot
# regions are equally spaced too), so ops stay large when pages are small.


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


def _all_on_host(gpu_tensors: Sequence[torch.Tensor], pool: torch.Tensor) -> bool:
    return pool.device.type == "cpu" and all(t.device.type == "cpu" for t in gpu_tensors)


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


def _gather_host(bundle: _Bundle, pool: torch.Tensor) -> None:
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


def _scatter_host(bundle: _Bundle, pool: torch.Tensor) -> None:
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


# -- device path ----------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _check_tensors(
    layout: TransferLayout,
    gpu_tensors: Sequence[torch.Tensor],
    pool: torch.Tensor,
    plan: tuple[TensorCopies, ...],
) -> None:
    if len(gpu_tensors) != layout.num_tensors:
        raise ValueError(
            f"the layout has {layout.num_tensors} canonical tensors, "
            f"but {len(gpu_tensors)} gpu_tensors were given"
        )
    devices = {t.device for t in gpu_tensors if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise ValueError(
            f"gpu_tensors must all be on one device, got {sorted(str(d) for d in devices)}"
        )
    for t, (tensor, page) in enumerate(zip(gpu_tensors, layout.page_bytes, strict=True)):
        _check_rows(f"gpu_tensors[{t}]", tensor, page)
    _check_rows("pool", pool, layout.slot_bytes)
    for copies in plan:
        if copies.num_copies == 0:
            continue
        rows = gpu_tensors[copies.tensor_index].shape[0]
        top = int(copies.block_ids.max())
        if top >= rows:
            raise ValueError(
                f"block id {top} is out of range for gpu_tensors[{copies.tensor_index}] "
                f"({rows} blocks)"
            )
        top_slot = int(copies.slot_ids.max())
        if top_slot >= pool.shape[0]:
            raise ValueError(
                f"slot id {top_slot} is out of range for the pool ({pool.shape[0]} slots)"
            )


def _check_rows(name: str, tensor: torch.Tensor, width: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type == "meta":
        raise ValueError(f"{name} is on the meta device: it holds no bytes to copy")
    if tensor.dtype != torch.uint8:
        raise ValueError(f"{name} has dtype {tensor.dtype}; it must be torch.uint8")
    if tensor.ndim != 2:
        raise ValueError(
            f"{name} must be 2-D [rows, {width}] bytes, got shape {tuple(tensor.shape)}"
        )
    if tensor.shape[1] != width:
        raise ValueError(f"{name} rows are {tensor.shape[1]} bytes wide; the layout says {width}")
    if tensor.stride(1) != 1:
        raise ValueError(f"{name} must have contiguous rows (stride {tensor.stride()})")
    if tensor.shape[0] > 1 and tensor.stride(0) < width:
        raise ValueError(f"{name} rows overlap: row stride {tensor.stride(0)} < {width} bytes")


def _sequence(name: str, values: object) -> list[Any]:
    """``values`` as a list; a clear ValueError for None, a str/bytes or a non-iterable."""
    if values is None or isinstance(values, (str, bytes, bytearray)) or not isinstance(
        values, Iterable
    ):
        raise ValueError(f"{name} must be a sequence of ints, got {type(values).__name__}")
    try:
        return list(values)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {type(values).__name__}") from None


def _ids_tensor(name: str, values: IdsLike) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        ids = values
    else:
        seq = _sequence(name, values)
        if any(not _is_int(v) for v in seq):
            bad = next(v for v in seq if not _is_int(v))
            raise ValueError(f"{name} must hold integers, got {bad!r}")
        try:
            ids = torch.as_tensor(seq, dtype=torch.int64) if seq else torch.empty(0, dtype=torch.int64)
        except (OverflowError, RuntimeError, TypeError, ValueError):
            raise ValueError(f"{name} holds an id outside the int64 range: {seq!r}"[:200]) from None
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise ValueError(f"{name} must hold integers, got dtype {ids.dtype}")
    if ids.ndim != 1:
        raise ValueError(f"{name} must be a flat list, got shape {tuple(ids.shape)}")
    ids = ids.to("cpu", torch.int64)
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {int(ids.min())}")
    return ids


def _small_ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    out = tuple(_sequence(name, values))
    for i, v in enumerate(out):
        if not _is_int(v):
            raise ValueError(f"{name}[{i}] must be an int, got {v!r}")
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")
    return tuple(int(v) for v in out)


def _require_distinct(name: str, ids: torch.Tensor) -> None:
    unique, counts = torch.unique(ids, return_counts=True)
    if bool((counts > 1).any()):
        repeated = unique[counts > 1][:5].tolist()
        raise ValueError(f"{name} lists {repeated} more than once; ids in a job must be distinct")


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)
