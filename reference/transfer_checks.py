"""What :mod:`reference.transfer` accepts: layouts, job ids, canonical tensors and pools.

Every rejected input is a ``ValueError`` raised before the first write, so a
rejected call leaves every tensor untouched.  :mod:`reference.transfer_fast`
runs the same checks, so both executors accept exactly the same calls; each
passes in what it computed itself (chunk counts, ids per tensor), so a wrong
count in either shows as a disagreement.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from reference.transfer import IdsLike, TensorRef, TransferLayout


def check_layout(
    pages: tuple[int, ...],
    refs: tuple[tuple[TensorRef, ...], ...],
    bpc: tuple[int, ...],
) -> None:
    """A :class:`reference.transfer.TransferLayout`'s fields make sense together."""
    if not pages:
        raise ValueError("a transfer layout needs at least one canonical tensor")
    for t, page in enumerate(pages):
        if not is_int(page) or page <= 0:
            raise ValueError(f"page_bytes[{t}] must be a positive int, got {page!r}")
    if not refs:
        raise ValueError("a transfer layout needs at least one group")
    if len(bpc) != len(refs):
        raise ValueError(
            f"blocks_per_chunk has {len(bpc)} entries but group_refs has {len(refs)} "
            f"groups; give one blocks_per_chunk per group"
        )
    for g, (group, b) in enumerate(zip(refs, bpc, strict=True)):
        if not is_int(b) or b <= 0:
            raise ValueError(f"blocks_per_chunk[{g}] must be a positive int, got {b!r}")
        if not group:
            raise ValueError(f"group {g} has no tensor refs; every group copies something")
        seen: set[int] = set()
        for ref in group:
            t = ref.tensor_index
            if not is_int(t) or not 0 <= t < len(pages):
                raise ValueError(
                    f"group {g} refers to canonical tensor {t!r}, but there are "
                    f"{len(pages)} tensors (0..{len(pages) - 1})"
                )
            if t in seen:
                raise ValueError(f"group {g} refers to canonical tensor {t} twice")
            seen.add(t)
            if not is_int(ref.nbytes) or not 0 < ref.nbytes <= pages[t]:
                raise ValueError(
                    f"group {g}'s ref to tensor {t} copies {ref.nbytes!r} bytes per "
                    f"block; it must be in 1..page_bytes[{t}] = {pages[t]}"
                )


def check_group_counts(
    layout: TransferLayout, group_sizes: tuple[int, ...], block_indices: tuple[int, ...]
) -> None:
    """A job gives one size and one first block index per group of the layout."""
    if len(group_sizes) != layout.num_groups or len(block_indices) != layout.num_groups:
        raise ValueError(
            f"the layout has {layout.num_groups} groups, but the job gives "
            f"{len(group_sizes)} group_sizes and {len(block_indices)} block_indices; "
            f"give one of each per offloaded group (0 for groups with nothing to move)"
        )


def check_consumed(
    group_sizes: tuple[int, ...],
    block_indices: tuple[int, ...],
    chunks: Sequence[int],
    num_block_ids: int,
    num_slot_ids: int,
) -> None:
    """A job consumes exactly its ids (``chunks[g]``: how many chunks group ``g`` spans)."""
    if sum(group_sizes) != num_block_ids:
        raise ValueError(
            f"group_sizes {list(group_sizes)} sum to {sum(group_sizes)}, but {num_block_ids} "
            f"block ids were given ({_left(sum(group_sizes), num_block_ids)}); "
            f"every block id must belong to exactly one group"
        )
    if sum(chunks) != num_slot_ids:
        raise ValueError(
            f"group_sizes {list(group_sizes)} with block_indices {list(block_indices)} span "
            f"{list(chunks)} chunks ({sum(chunks)} in all), but {num_slot_ids} slot ids were "
            f"given ({_left(sum(chunks), num_slot_ids)}); every chunk needs exactly one slot id"
        )


def _left(needed: int, given: int) -> str:
    return f"{given - needed} unconsumed" if given > needed else f"{needed - given} missing"


def check_tensors(
    layout: TransferLayout,
    gpu_tensors: Sequence[torch.Tensor],
    pool: torch.Tensor,
    top_blocks: Mapping[int, int],
    top_slot: int | None,
) -> None:
    """The canonical tensors and the pool fit ``layout`` and the job's ids.

    ``top_blocks[t]``: the highest block id the job copies for canonical tensor
    ``t`` (tensors it does not touch absent); ``top_slot``: its highest slot id
    (None for a job with no slots).
    """
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
    for t, top in sorted(top_blocks.items()):
        rows = gpu_tensors[t].shape[0]
        if top >= rows:
            raise ValueError(
                f"block id {top} is out of range for gpu_tensors[{t}] ({rows} blocks)"
            )
    if top_slot is not None and top_slot >= pool.shape[0]:
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


def ids_tensor(name: str, values: IdsLike) -> torch.Tensor:
    """Ids (a sequence of ints or an integer tensor) as a flat int64 CPU tensor, all ``>= 0``."""
    if isinstance(values, torch.Tensor):
        ids = values
    else:
        seq = _sequence(name, values)
        if any(not is_int(v) for v in seq):
            bad = next(v for v in seq if not is_int(v))
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


def small_ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    """``values`` as a tuple of ints, each ``>= 0``."""
    out = tuple(_sequence(name, values))
    for i, v in enumerate(out):
        if not is_int(v):
            raise ValueError(f"{name}[{i}] must be an int, got {v!r}")
        if v < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {v}")
    return tuple(int(v) for v in out)


def require_distinct(name: str, ids: torch.Tensor) -> None:
    unique, counts = torch.unique(ids, return_counts=True)
    if bool((counts > 1).any()):
        repeated = unique[counts > 1][:5].tolist()
        raise ValueError(f"{name} lists {repeated} more than once; ids in a job must be distinct")


def is_int(v: object) -> bool:
    """An integer that is not a bool (NumPy integers included)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)
