"""reference.transfer (the spec): the block <-> chunk-slot byte mapping and its executor.

The mapping (``job_copies``) is checked against what any correct layout must
do -- each listed block copied once per layer of its group, blocks filling
chunks in request order, no two copies sharing a byte, everything inside the
slot -- and against hand-computed offsets (notes section 6.3).  The spec's
gather/scatter are checked to write exactly the bytes the mapping names and
nothing else, and to reject bad calls before any write.  The fast path
(reference.transfer_fast) is compared with the spec in tests/test_transfer_fast.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reference.transfer import (
    TensorRef,
    TransferLayout,
    chunks_of,
    gather,
    job_copies,
    place,
    scatter,
)

# ---------------------------------------------------------------------------
# Jobs, and what the mapping says a job does
# ---------------------------------------------------------------------------

Copy = tuple[int, int, int, int, int]
"""(tensor, gpu block id, slot id, byte offset in slot, nbytes)."""


@dataclass(frozen=True)
class Job:
    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    slot_ids: tuple[int, ...]

    def args(self) -> tuple[list[int], list[int], list[int], list[int]]:
        return (
            list(self.block_ids),
            list(self.group_sizes),
            list(self.block_indices),
            list(self.slot_ids),
        )


def spec_copies(layout: TransferLayout, job: Job) -> list[Copy]:
    """The spec's copies of ``job`` as plain tuples."""
    return [
        (c.tensor, c.block_id, c.slot_id, c.offset, c.nbytes)
        for c in job_copies(layout, *job.args())
    ]


def expected_gather(
    layout: TransferLayout, gpu: list[torch.Tensor], pool: torch.Tensor, job: Job
) -> torch.Tensor:
    """The pool after a store of ``job``: each copy's bytes, written one by one."""
    out = pool.clone()
    for t, block, slot, offset, nbytes in spec_copies(layout, job):
        out[slot, offset : offset + nbytes] = gpu[t][block, :nbytes]
    return out


def expected_scatter(
    layout: TransferLayout, gpu: list[torch.Tensor], pool: torch.Tensor, job: Job
) -> list[torch.Tensor]:
    """The canonical tensors after a load of ``job``."""
    out = [g.clone() for g in gpu]
    for t, block, slot, offset, nbytes in spec_copies(layout, job):
        out[t][block, :nbytes] = pool[slot, offset : offset + nbytes]
    return out


# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> TransferLayout:
    num_tensors = draw(st.integers(1, 4))
    pages = tuple(draw(st.integers(1, 64)) * 8 for _ in range(num_tensors))
    num_groups = draw(st.integers(1, 4))
    group_refs = []
    for _ in range(num_groups):
        tensors = draw(st.lists(st.sampled_from(range(num_tensors)), min_size=1, unique=True))
        refs = []
        for t in tensors:
            nbytes = draw(
                st.one_of(
                    st.just(pages[t]),
                    st.integers(1, pages[t] // 8).map(lambda w: w * 8),
                    st.integers(1, pages[t]),
                )
            )
            refs.append(TensorRef(t, nbytes))
        group_refs.append(tuple(refs))
    bpc = tuple(draw(st.integers(1, 5)) for _ in range(num_groups))
    return TransferLayout(pages, tuple(group_refs), bpc)


@dataclass(frozen=True)
class Case:
    layout: TransferLayout
    job: Job
    num_blocks: int
    num_slots: int
    seed: int


@st.composite
def cases(draw: st.DrawFn, max_blocks_per_group: int = 12) -> Case:
    layout = draw(layouts())
    sizes, indices, chunks = [], [], []
    for b in layout.blocks_per_chunk:
        n = draw(st.integers(0, max_blocks_per_group))
        skip = draw(st.integers(0, b - 1))
        index = skip + b * draw(st.integers(0, 3))
        if n == 0:
            index = draw(st.sampled_from([0, index]))  # ignored; vLLM writes 0 or the end
        sizes.append(n)
        indices.append(index)
        chunks.append(-(-(n + skip) // b) if n else 0)
    num_blocks = sum(sizes) + draw(st.integers(0, 6))
    num_slots = sum(chunks) + draw(st.integers(0, 4))
    block_ids = draw(st.permutations(range(num_blocks)))[: sum(sizes)]
    slot_ids = draw(st.permutations(range(num_slots)))[: sum(chunks)]
    job = Job(tuple(block_ids), tuple(sizes), tuple(indices), tuple(slot_ids))
    return Case(layout, job, num_blocks, num_slots, draw(st.integers(0, 2**31 - 1)))


def random_bytes(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)


@dataclass
class Tensors:
    gpu: list[torch.Tensor]
    pool: torch.Tensor
    backing: list[torch.Tensor]
    """Storage the views above live in (gpu..., pool); bytes outside the views stay untouched."""
    gpu_starts: list[int]
    pool_start: int

    def snapshot(self) -> list[torch.Tensor]:
        return [b.clone() for b in self.backing]

    def unchanged_since(self, snap: list[torch.Tensor]) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.backing, snap, strict=True))


def make_tensors(case: Case, gen: torch.Generator, padded: bool, device: str = "cpu") -> Tensors:
    """Random canonical tensors and pool; with ``padded``, strided views into wider rows."""
    layout = case.layout
    gpu, backing, starts = [], [], []
    for page in layout.page_bytes:
        pad = 8 * int(torch.randint(1, 4, (1,), generator=gen)) if padded else 0
        full = random_bytes((case.num_blocks, page + pad), gen).to(device)
        start = 8 * int(torch.randint(0, pad // 8 + 1, (1,), generator=gen)) if padded else 0
        backing.append(full)
        starts.append(start)
        gpu.append(full[:, start : start + page])
    slot_bytes = layout.slot_bytes
    pool_start = 8 if padded else 0
    full_pool = random_bytes((case.num_slots, slot_bytes + 2 * pool_start), gen)
    backing.append(full_pool)
    pool = full_pool[:, pool_start : pool_start + slot_bytes]
    return Tensors(gpu, pool, backing, starts, pool_start)


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------


@given(cases())
def test_each_listed_block_is_copied_once_per_layer_of_its_group(case: Case) -> None:
    layout, job = case.layout, case.job
    copies = job_copies(layout, *job.args())
    want: Counter[tuple[int, int, int]] = Counter()
    cursor = 0
    for g, n in enumerate(job.group_sizes):
        for block in job.block_ids[cursor : cursor + n]:
            want.update((g, r.tensor_index, block) for r in layout.group_refs[g])
        cursor += n
    assert Counter((c.group, c.tensor, c.block_id) for c in copies) == want
    nbytes = {(g, r.tensor_index): r.nbytes for g, refs in enumerate(layout.group_refs) for r in refs}
    assert all(c.nbytes == nbytes[c.group, c.tensor] for c in copies)


@given(cases())
def test_blocks_fill_chunks_in_request_order(case: Case) -> None:
    """Positions p and p' share a chunk iff p // B == p' // B; chunks take the group's slot ids in order."""
    layout, job = case.layout, case.job
    copies = job_copies(layout, *job.args())
    slot_cursor = 0
    for g, (n, first) in enumerate(zip(job.group_sizes, job.block_indices, strict=True)):
        b = layout.blocks_per_chunk[g]
        mine = [c for c in copies if c.group == g]
        assert [c.position for c in mine] == [
            p for p in range(first, first + n) for _ in layout.group_refs[g]
        ]
        num_chunks = (first + n - 1) // b - first // b + 1 if n else 0
        slots = job.slot_ids[slot_cursor : slot_cursor + num_chunks]
        for c in mine:
            assert c.sub_slot == c.position % b
            assert c.slot_id == slots[c.position // b - first // b]
        assert sorted({c.slot_id for c in mine}) == sorted(slots)  # every chunk used
        slot_cursor += num_chunks
    assert slot_cursor == len(job.slot_ids)


@given(cases())
def test_copies_never_share_a_byte_and_stay_inside_the_slot(case: Case) -> None:
    layout = case.layout
    written: dict[int, set[int]] = {}
    for c in job_copies(layout, *case.job.args()):
        assert 0 <= c.offset and c.offset + c.nbytes <= layout.slot_bytes
        # the sub-slot is a page of its tensor: the copy stays inside it
        assert c.nbytes <= layout.page_bytes[c.tensor]
        span = set(range(c.offset, c.offset + c.nbytes))
        assert not span & written.setdefault(c.slot_id, set()), c
        written[c.slot_id] |= span


@given(st.integers(0, 200), st.integers(0, 40), st.integers(1, 9))
def test_chunks_of_are_the_chunks_of_first_and_last_block(first: int, n: int, b: int) -> None:
    span = chunks_of(first, n, b)
    assert list(span) == sorted({place(p, b)[0] for p in range(first, first + n)})
    assert all(0 <= place(p, b)[1] < b for p in range(first, first + n))


def _pool_backing_with(ts: Tensors, case: Case, before: torch.Tensor, pool: torch.Tensor):
    """The pool's backing storage as ``before``, with the pool view's bytes set to ``pool``."""
    out = before.clone()
    out[:, ts.pool_start : ts.pool_start + case.layout.slot_bytes] = pool
    return out


def _gpu_backing_with(ts: Tensors, t: int, before: torch.Tensor, rows: torch.Tensor):
    out = before.clone()
    start = ts.gpu_starts[t]
    out[:, start : start + rows.shape[1]] = rows
    return out


@given(cases(), st.booleans())
def test_gather_writes_exactly_the_mapped_bytes(case: Case, padded: bool) -> None:
    gen = torch.Generator().manual_seed(case.seed)
    ts = make_tensors(case, gen, padded)
    expected_pool = expected_gather(case.layout, ts.gpu, ts.pool, case.job)
    before = ts.snapshot()
    gather(case.layout, ts.gpu, ts.pool, *case.job.args())
    # every pool byte is the mapping's, padding around the pool view and the sources untouched
    assert torch.equal(ts.backing[-1], _pool_backing_with(ts, case, before[-1], expected_pool))
    assert all(torch.equal(a, b) for a, b in zip(ts.backing[:-1], before[:-1], strict=True))


@given(cases(), st.booleans())
def test_scatter_writes_exactly_the_mapped_bytes(case: Case, padded: bool) -> None:
    gen = torch.Generator().manual_seed(case.seed)
    ts = make_tensors(case, gen, padded)
    expected = expected_scatter(case.layout, ts.gpu, ts.pool, case.job)
    before = ts.snapshot()
    scatter(case.layout, ts.gpu, ts.pool, *case.job.args())
    for t, rows in enumerate(expected):
        assert torch.equal(ts.backing[t], _gpu_backing_with(ts, t, before[t], rows))
    assert torch.equal(ts.backing[-1], before[-1])


@given(cases(), st.booleans())
def test_round_trip_restores_listed_bytes_only(case: Case, padded: bool) -> None:
    """gather, then scatter the same job into a different cache: exactly the listed bytes move."""
    gen = torch.Generator().manual_seed(case.seed)
    src = make_tensors(case, gen, padded)
    gather(case.layout, src.gpu, src.pool, *case.job.args())
    dst = [random_bytes(tuple(g.shape), gen) for g in src.gpu]
    expected = [d.clone() for d in dst]
    for t, block, _slot, _offset, nbytes in spec_copies(case.layout, case.job):
        expected[t][block, :nbytes] = src.gpu[t][block, :nbytes]
    scatter(case.layout, dst, src.pool, *case.job.args())
    assert all(torch.equal(a, b) for a, b in zip(dst, expected, strict=True))


# ---------------------------------------------------------------------------
# Invalid inputs: ValueError, and nothing written
# ---------------------------------------------------------------------------

Mutation = Callable[[Case, Tensors], tuple[Job, list[torch.Tensor], torch.Tensor] | None]


def _job(case: Case, **changes: tuple[int, ...]) -> Job:
    fields = {
        "block_ids": case.job.block_ids,
        "group_sizes": case.job.group_sizes,
        "block_indices": case.job.block_indices,
        "slot_ids": case.job.slot_ids,
    }
    fields.update(changes)
    return Job(**fields)


def _with_gpu(ts: Tensors, t: int, tensor: torch.Tensor) -> list[torch.Tensor]:
    gpu = list(ts.gpu)
    gpu[t] = tensor
    return gpu


def _ok(case: Case, ts: Tensors, job: Job) -> tuple[Job, list[torch.Tensor], torch.Tensor]:
    return job, list(ts.gpu), ts.pool


MUTATIONS: dict[str, Mutation] = {
    "gpu dtype int8": lambda c, ts: (c.job, _with_gpu(ts, 0, ts.gpu[0].view(torch.int8)), ts.pool),
    "pool dtype int8": lambda c, ts: (c.job, list(ts.gpu), ts.pool.view(torch.int8)),
    "gpu 1-D": lambda c, ts: (c.job, _with_gpu(ts, 0, ts.backing[0].view(-1)), ts.pool),
    "pool 3-D": lambda c, ts: (c.job, list(ts.gpu), ts.backing[-1].unsqueeze(0)),
    "gpu row width": lambda c, ts: (
        c.job,
        _with_gpu(ts, 0, torch.zeros(c.num_blocks, c.layout.page_bytes[0] + 8, dtype=torch.uint8)),
        ts.pool,
    ),
    "pool row width": lambda c, ts: (
        c.job,
        list(ts.gpu),
        torch.zeros(c.num_slots, c.layout.slot_bytes + 8, dtype=torch.uint8),
    ),
    "gpu rows overlap": lambda c, ts: (
        (
            c.job,
            _with_gpu(
                ts, 0, ts.gpu[0].as_strided(ts.gpu[0].shape, (c.layout.page_bytes[0] // 2, 1))
            ),
            ts.pool,
        )
        if c.num_blocks > 1
        else None
    ),
    "too few gpu tensors": lambda c, ts: (c.job, list(ts.gpu)[:-1], ts.pool),
    "gpu tensors on two devices": lambda c, ts: (
        (
            c.job,
            _with_gpu(ts, -1, torch.empty_like(ts.gpu[-1], device="meta")),
            ts.pool,
        )
        if c.layout.num_tensors >= 2
        else None
    ),
    "block id out of range": lambda c, ts: (
        _ok(c, ts, _job(c, block_ids=(*c.job.block_ids[:-1], c.num_blocks)))
        if c.job.block_ids
        else None
    ),
    "negative block id": lambda c, ts: (
        _ok(c, ts, _job(c, block_ids=(*c.job.block_ids[:-1], -1))) if c.job.block_ids else None
    ),
    "duplicate block id": lambda c, ts: (
        _ok(c, ts, _job(c, block_ids=(*c.job.block_ids[:-1], c.job.block_ids[0])))
        if len(c.job.block_ids) >= 2
        else None
    ),
    "slot id out of range": lambda c, ts: (
        _ok(c, ts, _job(c, slot_ids=(*c.job.slot_ids[:-1], c.num_slots)))
        if c.job.slot_ids
        else None
    ),
    "duplicate slot id": lambda c, ts: (
        _ok(c, ts, _job(c, slot_ids=(*c.job.slot_ids[:-1], c.job.slot_ids[0])))
        if len(c.job.slot_ids) >= 2
        else None
    ),
    "extra block id": lambda c, ts: _ok(c, ts, _job(c, block_ids=(*c.job.block_ids, c.num_blocks))),
    "missing block id": lambda c, ts: (
        _ok(c, ts, _job(c, block_ids=c.job.block_ids[:-1])) if c.job.block_ids else None
    ),
    "extra slot id": lambda c, ts: _ok(c, ts, _job(c, slot_ids=(*c.job.slot_ids, c.num_slots))),
    "missing slot id": lambda c, ts: (
        _ok(c, ts, _job(c, slot_ids=c.job.slot_ids[:-1])) if c.job.slot_ids else None
    ),
    "group_sizes too long": lambda c, ts: _ok(c, ts, _job(c, group_sizes=(*c.job.group_sizes, 0))),
    "block_indices too short": lambda c, ts: _ok(
        c, ts, _job(c, block_indices=c.job.block_indices[:-1])
    ),
    "negative group size": lambda c, ts: _ok(
        c, ts, _job(c, group_sizes=(-1, *c.job.group_sizes[1:]))
    ),
    "negative block index": lambda c, ts: _ok(
        c, ts, _job(c, block_indices=(-1, *c.job.block_indices[1:]))
    ),
    "float block ids": lambda c, ts: (
        _ok(c, ts, _job(c, block_ids=tuple(float(b) for b in c.job.block_ids)))
        if c.job.block_ids
        else None
    ),
}


def check_rejected(direction: Callable[..., None], mutation: str, case: Case) -> bool:
    """Apply ``mutation`` to a valid case: ValueError, and every tensor bitwise unchanged.

    Returns False when the mutation does not apply to this case (e.g. needs two blocks).
    """
    ts = make_tensors(case, torch.Generator().manual_seed(case.seed), padded=False)
    mutated = MUTATIONS[mutation](case, ts)
    if mutated is None:
        return False
    job, gpu, pool = mutated
    snap = ts.snapshot()
    given_tensors = [t for t in [*gpu, pool] if t.device.type != "meta"]
    given_before = [t.clone() for t in given_tensors]
    with pytest.raises(ValueError):
        direction(case.layout, gpu, pool, *job.args())
    assert ts.unchanged_since(snap)
    assert all(torch.equal(a, b) for a, b in zip(given_tensors, given_before, strict=True))
    return True


FIXED_CASE = Case(
    TransferLayout((8, 16), ((TensorRef(0, 8),), (TensorRef(1, 9), TensorRef(0, 3))), (2, 3)),
    Job(block_ids=(3, 1, 2), group_sizes=(1, 2), block_indices=(1, 4), slot_ids=(0, 1)),
    num_blocks=5,
    num_slots=3,
    seed=0,
)


def test_fixed_case_is_valid() -> None:
    """The unmutated case is accepted, so in the test below each mutation is the cause."""
    ts = make_tensors(FIXED_CASE, torch.Generator().manual_seed(0), padded=False)
    gather(FIXED_CASE.layout, ts.gpu, ts.pool, *FIXED_CASE.job.args())
    scatter(FIXED_CASE.layout, ts.gpu, ts.pool, *FIXED_CASE.job.args())


@pytest.mark.parametrize("direction", [gather, scatter], ids=["gather", "scatter"])
@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_each_invalid_input_raises_and_writes_nothing(
    direction: Callable[..., None], mutation: str
) -> None:
    assert check_rejected(direction, mutation, FIXED_CASE)


@given(
    case=cases(max_blocks_per_group=6),
    mutation=st.sampled_from(sorted(MUTATIONS)),
    direction=st.sampled_from([gather, scatter]),
)
def test_invalid_input_raises_and_writes_nothing(
    case: Case, mutation: str, direction: Callable[..., None]
) -> None:
    check_rejected(direction, mutation, case)


# ---------------------------------------------------------------------------
# Layout
# ---------------------------------------------------------------------------


def test_layout_offsets_per_group_blocks_per_chunk() -> None:
    layout = TransferLayout(
        (64, 32, 8),
        ((TensorRef(0, 64), TensorRef(1, 30)), (TensorRef(1, 32), TensorRef(2, 8))),
        (2, 3),
    )
    assert layout.slot_bytes == 3 * (64 + 32 + 8)
    assert layout.region_offset(0, 1) == 2 * 64
    assert layout.region_offset(1, 1) == 3 * 64
    assert layout.region_offset(1, 2) == 3 * 96
    assert layout.sub_slot_offset(1, 1, 2) == 3 * 64 + 2 * 32
    with pytest.raises(ValueError):
        layout.sub_slot_offset(0, 1, 2)


def test_uniform_layout_is_vllm_chunk_layout() -> None:
    """One B for all groups: tensor t's region is sum(page[:t]) * B, slot = B * sum(page)."""
    layout = TransferLayout.uniform((128, 64), [[TensorRef(0, 128)], [TensorRef(1, 60)]], 4)
    assert layout.blocks_per_chunk == (4, 4)
    assert layout.slot_bytes == 4 * 192
    assert [layout.region_offset(g, t) for g in (0, 1) for t in (0, 1)] == [0, 512, 0, 512]


@pytest.mark.parametrize(
    ("pages", "refs", "bpc"),
    [
        ((), ((TensorRef(0, 8),),), (1,)),
        ((0,), ((TensorRef(0, 8),),), (1,)),
        ((8,), (), ()),
        ((8,), ((TensorRef(0, 8),),), (1, 1)),
        ((8,), ((TensorRef(0, 8),),), (0,)),
        ((8,), ((),), (1,)),
        ((8,), ((TensorRef(1, 8),),), (1,)),
        ((8,), ((TensorRef(0, 9),),), (1,)),
        ((8,), ((TensorRef(0, 0),),), (1,)),
        ((8,), ((TensorRef(0, 8), TensorRef(0, 4)),), (1,)),
    ],
)
def test_layout_rejects_nonsense(
    pages: tuple[int, ...], refs: tuple[tuple[TensorRef, ...], ...], bpc: tuple[int, ...]
) -> None:
    with pytest.raises(ValueError):
        TransferLayout(pages, refs, bpc)


# ---------------------------------------------------------------------------
# Worked example (notes section 6.3), verified against vLLM's _fill_direct_ops
# ---------------------------------------------------------------------------


def test_notes_worked_example() -> None:
    page = 64
    layout = TransferLayout.uniform((page,), [[TensorRef(0, page)], [TensorRef(0, page)]], 2)
    # block b holds the byte value b everywhere
    gpu = torch.arange(40, dtype=torch.uint8).repeat_interleave(page).view(40, page).clone()
    pool = torch.full((6, layout.slot_bytes), 255, dtype=torch.uint8)

    store = Job((1, 2, 3, 4, *range(14, 22)), (4, 8), (0, 8), tuple(range(6)))
    gather(layout, [gpu], pool, *store.args())
    chunks = [[int(pool[c, j * page]) for j in range(2)] for c in range(6)]
    assert chunks == [[1, 2], [3, 4], [14, 15], [16, 17], [18, 19], [20, 21]]
    assert bool((pool.view(6, 2, page) == pool.view(6, 2, page)[:, :, :1]).all())

    dst = torch.zeros_like(gpu)
    load = Job((30, 29, 28, *range(13, 5, -1)), (3, 8), (1, 8), tuple(range(6)))
    scatter(layout, [dst], pool, *load.args())
    expected = torch.zeros(40, dtype=torch.uint8)
    expected[30], expected[29], expected[28] = 2, 3, 4  # c0.sub1, c1.sub0, c1.sub1
    for k, block in enumerate(range(13, 5, -1)):
        expected[block] = 14 + k  # b13..b6 <- c2..c5
    assert torch.equal(dst, expected[:, None].expand(40, page))


def test_store_with_leading_null_leaves_first_sub_slot_unwritten() -> None:
    """A chunk whose first block is skipped (null): its sub-slot 0 keeps the old bytes."""
    layout = TransferLayout.uniform((8,), [[TensorRef(0, 8)]], 4)
    gpu = torch.arange(10, dtype=torch.uint8).repeat_interleave(8).view(10, 8).clone()
    pool = torch.full((2, layout.slot_bytes), 99, dtype=torch.uint8)
    gather(layout, [gpu], pool, [5, 6, 7], [3], [1], [1])
    assert pool[1].view(4, 8)[:, 0].tolist() == [99, 5, 6, 7]
    assert bool((pool[0] == 99).all())


def test_ids_may_be_tensors() -> None:
    layout = TransferLayout.uniform((16,), [[TensorRef(0, 16)]], 2)
    gpu = torch.arange(4, dtype=torch.uint8).repeat_interleave(16).view(4, 16).clone()
    pool = torch.zeros(2, layout.slot_bytes, dtype=torch.uint8)
    gather(
        layout, [gpu], pool, torch.tensor([3, 1], dtype=torch.int32), [2], [0], torch.tensor([1])
    )
    assert pool[1, ::16].tolist() == [3, 1]


# ---------------------------------------------------------------------------
# Devices
# ---------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
@given(case=cases())
def test_cuda_matches_the_mapping(pinned: bool, case: Case) -> None:
    """Cache on the GPU; pool in pinned or pageable host memory, then on the GPU too."""
    gen = torch.Generator().manual_seed(case.seed)
    cpu = make_tensors(case, gen, padded=False)
    expected_pool = expected_gather(case.layout, cpu.gpu, cpu.pool, case.job)
    gpu = [g.cuda() for g in cpu.gpu]
    pool = cpu.pool.pin_memory() if pinned else cpu.pool.clone()
    gather(case.layout, gpu, pool, *case.job.args())
    assert torch.equal(pool, expected_pool)
    dst = [torch.zeros_like(g) for g in gpu]
    scatter(case.layout, dst, pool, *case.job.args())
    torch.cuda.synchronize()
    zeros = [torch.zeros_like(g) for g in cpu.gpu]
    expected = expected_scatter(case.layout, zeros, expected_pool, case.job)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(dst, expected, strict=True))
    pool_dev = cpu.pool.cuda()
    gather(case.layout, gpu, pool_dev, *case.job.args())
    assert torch.equal(pool_dev.cpu(), expected_pool)
    dst = [torch.zeros_like(g) for g in gpu]
    scatter(case.layout, dst, pool_dev, *case.job.args())
    assert all(torch.equal(a.cpu(), b) for a, b in zip(dst, expected, strict=True))
