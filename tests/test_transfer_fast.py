"""reference.transfer_fast writes exactly the bytes reference.transfer (the spec) writes.

The fast path plans its copies itself (it never calls the spec's mapping), so
a mistake on either side shows here: its plan is compared with the spec's
copies, and its writes with the spec's, byte for byte.  Every drawn case builds the same random KV cache and chunk pool twice, runs the
spec's per-row gather/scatter on one copy and the fast path on the other, and
compares every byte of every backing buffer: the views' bytes and the bytes
around them.  Cases cover several groups with different ``tokens_per_block`` and
``blocks_per_chunk`` (shared strategies), 1/2/4/8-byte cache dtypes (which
decide the fast path's word width), partial pages, padded rows, and canonical
tensors laid out as vLLM lays them out: separate allocations, or views of one
buffer that are equally spaced (bundled by the fast path), interleaved per
block, gapped, unevenly spaced, aliased, or overlapping (which the fast path's proofs must
refuse to bundle), and packed (vLLM's folded block-outermost cache: one canonical
tensor whose page is the packed block, one ref per group).  Jobs skip leading sub-slots, leave groups empty and may
list the null block 0; repeated ids are rejected by both, before any write.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_transfer import FIXED_CASE, MUTATIONS, Job, check_rejected, spec_copies

import reference.transfer as spec
import reference.transfer_fast as fast
from conformance.harness.strategies import geometries
from reference.transfer import IdsLike, TensorRef, TransferLayout
from reference.transfer_fast import TensorCopies

Executor = Callable[
    [TransferLayout, Sequence[torch.Tensor], torch.Tensor, IdsLike, Sequence[int], Sequence[int],
     IdsLike],
    None,
]
Path = Callable[[tuple[TensorCopies, ...], Sequence[torch.Tensor], torch.Tensor], None]

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
DTYPES = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.int64}
"""Cache dtype by element size; the canonical tensors are uint8 views of it, as in vLLM."""
ARRANGEMENTS = ("separate", "outer", "interleaved", "gapped", "uneven", "aliased", "overlapping")


def _checked(path: Path) -> Executor:
    """``path`` behind the same validation as the public functions."""

    def run(
        layout: TransferLayout,
        gpu_tensors: Sequence[torch.Tensor],
        pool: torch.Tensor,
        block_ids: IdsLike,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        slot_ids: IdsLike,
    ) -> None:
        plan = fast.checked_plan(
            layout, gpu_tensors, pool, block_ids, group_sizes, block_indices, slot_ids
        )
        path(plan, gpu_tensors, pool)

    return run


FAST: dict[tuple[str, str], Executor] = {
    ("gather", "dispatch"): fast.gather,
    ("scatter", "dispatch"): fast.scatter,
    # The device path works on any device; on the CPU this is its only coverage.
    ("gather", "device path"): _checked(
        lambda plan, gpu, pool: fast.device_gather(plan, gpu, pool, fast.BATCH_BYTES)
    ),
    ("scatter", "device path"): _checked(
        lambda plan, gpu, pool: fast.device_scatter(plan, gpu, pool, fast.BATCH_BYTES)
    ),
}
PATHS = {"cpu": ("dispatch", "device path"), "cuda": ("dispatch",)}
POOLS = {"cpu": ("cpu",), "cuda": ("cpu", "pinned", "cuda")}


@contextmanager
def batch_bytes(n: int) -> Iterator[None]:
    """Run with the fast path moving at most ``n`` bytes per op (1: one row at a time)."""
    saved = fast.BATCH_BYTES
    fast.BATCH_BYTES = n
    try:
        yield
    finally:
        fast.BATCH_BYTES = saved


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    layout: TransferLayout
    job: Job
    num_blocks: int
    num_slots: int
    element_bytes: int
    arrangement: str
    row_pad: int
    """Extra bytes per row of the canonical tensors and of the pool."""
    base: int
    """Byte offset of the first view inside its buffer."""
    seed: int
    batch_bytes: int


@st.composite
def layouts(draw: st.DrawFn, element_bytes: int) -> TransferLayout:
    """A layout from a shared geometry: per-layer tensors, or vLLM's hybrid shared tensors."""
    geometry = draw(geometries(max_groups=4))
    pages = [
        g.tokens_per_block * element_bytes * draw(st.integers(1, 3)) for g in geometry.groups
    ]
    pad = element_bytes * draw(st.sampled_from((0, 0, 1, 4)))

    def nbytes(page: int) -> int:  # mostly the unpadded page, sometimes any prefix of it
        return draw(st.one_of(st.just(page), st.just(page), st.integers(1, page)))

    copied = [nbytes(p) for p in pages]  # the same for every layer of a group, as in vLLM

    kind = draw(st.sampled_from(("shared", "per layer", "packed")))
    if kind == "packed":  # one tensor, each block packing every group's page
        page = pad + max(copied)
        return TransferLayout(
            (page,),
            tuple((TensorRef(0, n),) for n in copied),
            tuple(draw(st.integers(1, 5)) for _ in geometry.groups),
        )
    if kind == "shared":  # layer l of every group lives in canonical tensor l
        num_tensors = max(g.num_layers for g in geometry.groups)
        page_bytes = [
            pad + max(p for g, p in zip(geometry.groups, pages, strict=True) if g.num_layers > t)
            for t in range(num_tensors)
        ]
        refs = [
            tuple(TensorRef(t, n) for t in range(g.num_layers))
            for g, n in zip(geometry.groups, copied, strict=True)
        ]
    else:  # one canonical tensor per (group, layer)
        page_bytes, refs = [], []
        for g, p, n in zip(geometry.groups, pages, copied, strict=True):
            first = len(page_bytes)
            page_bytes += [p + pad] * g.num_layers
            refs.append(tuple(TensorRef(first + k, n) for k in range(g.num_layers)))
    bpc = tuple(draw(st.integers(1, 5)) for _ in geometry.groups)
    return TransferLayout(tuple(page_bytes), tuple(refs), bpc)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    element_bytes = draw(st.sampled_from(sorted(DTYPES)))
    layout = draw(layouts(element_bytes))
    sizes, indices, chunks = [], [], []
    for b in layout.blocks_per_chunk:
        n = draw(st.integers(0, 8))
        skip = draw(st.integers(0, b - 1))  # leading sub-slots of a null / skipped block
        sizes.append(n)
        indices.append(skip + b * draw(st.integers(0, 3)))
        chunks.append(-(-(n + skip) // b) if n else 0)
    num_blocks = sum(sizes) + draw(st.integers(1, 4))
    num_slots = sum(chunks) + draw(st.integers(1, 3))
    block_ids = draw(st.permutations(range(num_blocks)))[: sum(sizes)]  # may include block 0
    slot_ids = draw(st.permutations(range(num_slots)))[: sum(chunks)]
    return Case(
        layout=layout,
        job=Job(tuple(block_ids), tuple(sizes), tuple(indices), tuple(slot_ids)),
        num_blocks=num_blocks,
        num_slots=num_slots,
        element_bytes=element_bytes,
        arrangement=draw(st.sampled_from(ARRANGEMENTS)),
        row_pad=element_bytes * draw(st.sampled_from((0, 0, 1, 3))),
        base=draw(st.sampled_from((0, element_bytes, 2 * element_bytes, 1))),
        seed=draw(st.integers(0, 2**31 - 1)),
        batch_bytes=draw(st.sampled_from((fast.BATCH_BYTES, 1, 100, 1000))),
    )


# ---------------------------------------------------------------------------
# Buffers
# ---------------------------------------------------------------------------


@dataclass
class Buffers:
    backing: list[torch.Tensor]
    """Flat uint8 views of every allocation (the cache buffers, then the pool's)."""
    gpu: list[torch.Tensor]
    gpu_backing: list[int]
    """Which backing buffer canonical tensor ``t`` is a view of."""
    pool: torch.Tensor


def _offsets(case: Case, stride: int) -> tuple[list[int], int]:
    """Each canonical tensor's byte offset in one shared buffer, and the buffer's size."""
    nt, rows, base = case.layout.num_tensors, case.num_blocks, case.base
    if case.arrangement == "outer":  # layer-outermost: equally spaced, bundled
        starts = [base + t * rows * stride for t in range(nt)]
    elif case.arrangement == "interleaved":  # block-outermost: stride is nt rows
        starts = [base + t * stride // nt for t in range(nt)]
    elif case.arrangement == "gapped":
        starts = [base + t * (rows * stride + 24) for t in range(nt)]
    elif case.arrangement == "uneven":  # growing gaps: never equally spaced past two tensors
        gap = 4 * case.element_bytes
        starts = [base + t * rows * stride + t * (t - 1) * gap for t in range(nt)]
    elif case.arrangement == "aliased":  # odd tensors are the even ones' bytes again
        starts = [base + (t // 2) * rows * stride for t in range(nt)]
    else:  # overlapping: tensor t+1 starts half a page into tensor t
        step = max(case.element_bytes, min(case.layout.page_bytes) // 2)
        starts = [base + t * step for t in range(nt)]
    return starts, max(starts) + rows * stride


def _allocation(
    nbytes: int, case: Case, device: str, gen: torch.Generator, pin: bool = False
) -> torch.Tensor:
    """A random buffer of the case's cache dtype, as flat uint8 bytes."""
    e = case.element_bytes
    data = torch.randint(0, 256, (-(-nbytes // e) * e,), dtype=torch.uint8, generator=gen)
    buf = torch.empty(data.numel() // e, dtype=DTYPES[e], device=device, pin_memory=pin)
    flat = buf.view(torch.uint8)
    flat.copy_(data)
    return flat


def build(case: Case, device: str, pool_at: str) -> Buffers:
    """The case's cache and pool, with the same bytes on every call."""
    gen = torch.Generator().manual_seed(case.seed)
    pages, rows = case.layout.page_bytes, case.num_blocks
    backing: list[torch.Tensor] = []
    if case.arrangement == "separate":
        gpu, owner = [], []
        for page in pages:
            stride = page + case.row_pad
            backing.append(_allocation(case.base + rows * stride, case, device, gen))
            gpu.append(backing[-1].as_strided((rows, page), (stride, 1), case.base))
            owner.append(len(backing) - 1)
    else:
        stride = max(pages) + case.row_pad
        if case.arrangement == "interleaved":
            stride *= case.layout.num_tensors
        starts, size = _offsets(case, stride)
        backing.append(_allocation(size, case, device, gen))
        gpu = [
            backing[0].as_strided((rows, p), (stride, 1), s)
            for p, s in zip(pages, starts, strict=True)
        ]
        owner = [0] * len(pages)
    slot_bytes, pool_stride = case.layout.slot_bytes, case.layout.slot_bytes + case.row_pad
    pool_device = "cuda" if pool_at == "cuda" else "cpu"
    flat = _allocation(
        case.base + case.num_slots * pool_stride, case, pool_device, gen, pool_at == "pinned"
    )
    backing.append(flat)
    pool = flat.as_strided((case.num_slots, slot_bytes), (pool_stride, 1), case.base)
    return Buffers(backing, gpu, owner, pool)


def addressed(case: Case, bufs: Buffers, direction: str) -> list[torch.Tensor]:
    """Per backing buffer, the bytes ``direction`` may write (per the spec's copies)."""
    masks = [torch.zeros(b.numel(), dtype=torch.bool) for b in bufs.backing]
    for t, block, slot, offset, nbytes in spec_copies(case.layout, case.job):
        if direction == "gather":
            pool = bufs.pool
            at = pool.storage_offset() + slot * pool.stride(0) + offset
            masks[-1][at : at + nbytes] = True
        else:
            view = bufs.gpu[t]
            at = view.storage_offset() + block * view.stride(0)
            masks[bufs.gpu_backing[t]][at : at + nbytes] = True
    return masks


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    i = int((a != b).nonzero()[0])
    return f"byte {i}: {int(a[i])} vs {int(b[i])} ({int((a != b).sum())} bytes differ)"


def _outcome(
    executor: Executor, layout: TransferLayout, bufs: Buffers, args: tuple[list[int], ...]
) -> Exception | None:
    """What ``executor`` raised on the call (asserted on by :func:`compare`), or None."""
    try:
        executor(layout, bufs.gpu, bufs.pool, *args)  # type: ignore[arg-type]
    except Exception as error:  # compared below: only a ValueError is a rejection
        return error
    return None


def compare(direction: str, executor: Executor, case: Case, device: str, pool_at: str) -> None:
    """Run the spec and ``executor`` on identical buffers; AssertionError at the first difference.

    Both must accept the call, or both reject it with ``ValueError`` and write
    nothing.  Also: bytes the job does not address are unchanged in every buffer.
    """
    expected, actual = build(case, device, pool_at), build(case, device, pool_at)
    before = [b.cpu().clone() for b in actual.backing]
    args = case.job.args()
    want_error = _outcome(getattr(spec, direction), case.layout, expected, args)
    with batch_bytes(case.batch_bytes):
        got_error = _outcome(executor, case.layout, actual, args)
    if want_error is not None or got_error is not None:
        assert isinstance(want_error, ValueError) and isinstance(got_error, ValueError), (
            f"vs the spec: a call must be accepted by both or rejected (ValueError) by both; "
            f"the spec raised {want_error!r}, the fast path {got_error!r}"
        )
    if device == "cuda":
        torch.cuda.synchronize()
    if want_error is None:
        masks = addressed(case, actual, direction)
    else:  # rejected: nothing may change
        masks = [torch.zeros(b.numel(), dtype=torch.bool) for b in actual.backing]
    for k, (want, got, old, mask) in enumerate(
        zip(expected.backing, actual.backing, before, masks, strict=True)
    ):
        want, got = want.cpu(), got.cpu()
        assert torch.equal(got, want), f"buffer {k}, vs the spec: {_first_difference(got, want)}"
        outside = ~mask
        assert torch.equal(got[outside], old[outside]), (
            f"buffer {k}: a byte no copy addresses changed: "
            f"{_first_difference(got[outside], old[outside])}"
        )


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("direction", ["gather", "scatter"])
@pytest.mark.parametrize("device", DEVICES)
@given(case=cases(), data=st.data())
def test_fast_path_writes_the_spec_bytes(
    device: str, direction: str, case: Case, data: st.DataObject
) -> None:
    path = data.draw(st.sampled_from(PATHS[device]), label="path")
    pool_at = data.draw(st.sampled_from(POOLS[device]), label="pool")
    compare(direction, FAST[(direction, path)], case, device, pool_at)


def planned_copies(layout: TransferLayout, job: Job) -> list[tuple[int, int, int, int, int]]:
    """The fast plan's rows as ``(tensor, block id, slot id, offset, nbytes)``, checked for shape."""
    plan = fast.plan_copies(layout, *job.args())
    assert [c.tensor_index for c in plan] == list(range(layout.num_tensors))
    rows: list[tuple[int, int, int, int, int]] = []
    for c in plan:
        assert c.page_bytes == layout.page_bytes[c.tensor_index]
        n = c.num_copies
        for name in ("block_ids", "slot_ids", "sub_slots", "slot_offsets", "nbytes"):
            tensor = getattr(c, name)
            assert tensor.dtype == torch.int64 and tensor.shape == (n,), name
        # runs partition the rows, and agree with the per-row tensors
        bounds = [0, *(r.stop for r in c.runs)]
        assert [(r.start, r.stop) for r in c.runs] == list(zip(bounds, bounds[1:], strict=False))
        assert bounds[-1] == n and all(r.start < r.stop for r in c.runs)
        for r in c.runs:
            rows_ = slice(r.start, r.stop)
            assert bool((c.nbytes[rows_] == r.nbytes).all())
            expected = r.region_offset + c.sub_slots[rows_] * c.page_bytes
            assert torch.equal(c.slot_offsets[rows_], expected)
            assert bool((c.sub_slots[rows_] < r.blocks_per_chunk).all())
        rows += zip(
            [c.tensor_index] * n,
            c.block_ids.tolist(),
            c.slot_ids.tolist(),
            c.slot_offsets.tolist(),
            c.nbytes.tolist(),
            strict=True,
        )
    return rows


@given(case=cases())
def test_fast_plan_is_the_spec_copies(case: Case) -> None:
    """Same copies (as a multiset: the fast plan orders them per tensor)."""
    assert sorted(planned_copies(case.layout, case.job)) == sorted(
        spec_copies(case.layout, case.job)
    )


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_fast_path_rejects_what_the_spec_rejects(mutation: str) -> None:
    """Repeated ids, ids out of range, bad tensors...: ValueError, and nothing written."""
    for direction in (spec.gather, spec.scatter, fast.gather, fast.scatter):
        assert check_rejected(direction, mutation, FIXED_CASE)
