"""Canonical tensors as views of ONE buffer (vLLM's real layouts): the bundled host path.

vLLM hands the worker per-layer views that share a backing allocation:
layer-outermost (gemma-4: equally spaced views), block-outermost (packed,
interleaved per block) or spaced with gaps.  reference.transfer_fast merges equally
spaced views into one copy per chunk; this checks that path against the spec's
copies (reference.transfer.job_copies), including bytes around the views.
"""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from test_transfer import Job, expected_gather, spec_copies

import reference.transfer_fast as TM
from reference.transfer import TensorRef, TransferLayout
from reference.transfer_fast import gather, scatter


@st.composite
def shared_cases(draw):
    nt = draw(st.integers(1, 5))
    page = draw(st.integers(1, 8)) * 8
    # some tensors may have a different page (breaks bundles)
    pages = [page if draw(st.integers(0, 4)) else draw(st.integers(1, 8)) * 8 for _ in range(nt)]
    ng = draw(st.integers(1, 3))
    refs = []
    for _ in range(ng):
        ts = draw(st.lists(st.sampled_from(range(nt)), min_size=1, unique=True))
        if draw(st.booleans()):
            ts = list(range(nt))  # every tensor, the vLLM case
        rr = []
        for t in ts:
            nb = pages[t] if draw(st.integers(0, 3)) else draw(st.integers(1, pages[t]))
            rr.append(TensorRef(t, nb))
        refs.append(tuple(rr))
    bpc = tuple(draw(st.integers(1, 4)) for _ in range(ng))
    layout = TransferLayout(tuple(pages), tuple(refs), bpc)
    sizes, indices, chunks = [], [], []
    for b in bpc:
        n = draw(st.integers(0, 9))
        skip = draw(st.integers(0, b - 1))
        sizes.append(n)
        indices.append(skip + b * draw(st.integers(0, 2)))
        chunks.append(-(-(n + skip) // b) if n else 0)
    num_blocks = sum(sizes) + draw(st.integers(1, 4))  # never an empty cache
    num_slots = sum(chunks) + draw(st.integers(0, 3))
    block_ids = draw(st.permutations(range(num_blocks)))[: sum(sizes)]
    slot_ids = draw(st.permutations(range(num_slots)))[: sum(chunks)]
    kind = draw(st.sampled_from(["outer", "interleaved", "gapped"]))
    return layout, Job(tuple(block_ids), tuple(sizes), tuple(indices), tuple(slot_ids)), num_blocks, num_slots, kind, draw(st.integers(0, 2**31-1)), draw(st.sampled_from([8 << 20, 1, 100]))

def make(layout, num_blocks, num_slots, kind, gen):
    pages = layout.page_bytes
    P = max(pages)
    nt = len(pages)
    if kind == "outer":   # layer-outermost: tensor t at t*num_blocks*P
        buf = torch.randint(0, 256, (nt * num_blocks * P + 16,), dtype=torch.uint8, generator=gen)
        gpu = [buf.as_strided((num_blocks, pages[t]), (P, 1), 8 + t * num_blocks * P) for t in range(nt)]
    elif kind == "interleaved":  # block-outermost: block b holds every tensor's page
        buf = torch.randint(0, 256, (num_blocks * nt * P + 16,), dtype=torch.uint8, generator=gen)
        gpu = [buf.as_strided((num_blocks, pages[t]), (nt * P, 1), 8 + t * P) for t in range(nt)]
    else:  # spaced with gaps
        gap = 24
        span = num_blocks * (P + 8) + gap
        buf = torch.randint(0, 256, (nt * span + 16,), dtype=torch.uint8, generator=gen)
        gpu = [buf.as_strided((num_blocks, pages[t]), (P + 8, 1), t * span) for t in range(nt)]
    pool_full = torch.randint(0, 256, (num_slots, layout.slot_bytes + 16), dtype=torch.uint8, generator=gen)
    pool = pool_full[:, 8 : 8 + layout.slot_bytes]
    return gpu, buf, pool, pool_full

@given(shared_cases())
def test_shared_buffer_views_round_trip(case) -> None:  # type: ignore[no-untyped-def]
    layout, job, nb, ns, kind, seed, batch = case
    gen = torch.Generator().manual_seed(seed)
    gpu, buf, pool, pool_full = make(layout, nb, max(ns, 1), kind, gen)
    TM.BATCH_BYTES = batch
    try:
        exp_pool = expected_gather(layout, gpu, pool, job)
        buf0 = buf.clone()
        full0 = pool_full.clone()
        gather(layout, gpu, pool, *job.args())
        assert torch.equal(pool, exp_pool)
        assert torch.equal(buf, buf0)
        assert torch.equal(pool_full[:, :8], full0[:, :8]) and torch.equal(pool_full[:, -8:], full0[:, -8:])
        # scatter into fresh contents of the same buffer
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=gen))
        before = buf.clone()
        # the copies work per view; rebuild the expected buffer by applying it sequentially
        exp_buf = before.clone()
        egpu = [exp_buf.as_strided(g.shape, g.stride(), g.storage_offset()) for g in gpu]
        for t, block, slot, offset, nbytes in spec_copies(layout, job):
            egpu[t][block, :nbytes] = pool[slot, offset:offset + nbytes]
        pool_before = pool_full.clone()
        scatter(layout, gpu, pool, *job.args())
        assert torch.equal(buf, exp_buf)
        assert torch.equal(pool_full, pool_before)
    finally:
        TM.BATCH_BYTES = 8 << 20

