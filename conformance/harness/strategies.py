"""Hypothesis strategies shared by the unit tests and the conformance lanes.

Pure: no vLLM import.  Geometries are drawn the way real hybrids look: a few
groups, tokens per block powers of two, hash unit dividing every block (as
vLLM's gcd rule gives), windows of arbitrary size.
"""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import HealthCheck
from hypothesis import strategies as st

from reference.geometry import Geometry, GroupKind, KVGroup
from reference.knobs import BlockSize, BlocksPerChunk, Knob, PerGroupBlocksPerChunk

SLOW_EXAMPLE_CHECKS = (HealthCheck.too_slow, HealthCheck.data_too_large)
"""The only health checks lanes suppress: one example runs vLLM's scheduler for many
steps (slow by design) and workloads draw long prompts (large by design)."""

TOKENS_PER_BLOCK = (4, 8, 16, 32, 64)
EXAMPLE_WINDOWS = (40, 100, 128, 300)
"""Windows real models use, drawn as explicit examples next to arbitrary ones."""


def windows(max_tokens: int = 600) -> st.SearchStrategy[int]:
    """A sliding window or attention chunk: the example windows, or any size (every
    residue modulo any chunk span occurs)."""
    return st.one_of(st.sampled_from(EXAMPLE_WINDOWS), st.integers(1, max_tokens))


@st.composite
def groups(draw: st.DrawFn, index: int, kinds: tuple[GroupKind, ...] | None = None) -> KVGroup:
    kind = draw(st.sampled_from(kinds or tuple(GroupKind)))
    tpb = draw(st.sampled_from(TOKENS_PER_BLOCK))
    window = chunk = None
    extra = 0
    if kind is GroupKind.SLIDING_WINDOW:
        window = draw(windows())
        extra = draw(st.sampled_from((0, 0, 0, draw(st.integers(1, 64)))))
    if kind is GroupKind.CHUNKED_LOCAL:
        chunk = draw(windows(512))
    return KVGroup(
        index=index,
        kind=kind,
        tokens_per_block=tpb,
        page_bytes=draw(st.sampled_from((16, 32, 64))),
        num_layers=draw(st.integers(1, 3)),
        sliding_window=window,
        extra_retained_tokens=extra,
        attention_chunk_size=chunk,
        is_eagle=draw(st.booleans()) if kind is not GroupKind.MAMBA_ALIGN else False,
    )


@st.composite
def geometries(
    draw: st.DrawFn,
    min_groups: int = 1,
    max_groups: int = 6,
    kinds: tuple[GroupKind, ...] | None = None,
    hash_divides_blocks: bool = True,
) -> Geometry:
    n = draw(st.integers(min_groups, max_groups))
    # Original indices need not be contiguous: some groups may not be offloaded.
    indices = sorted(draw(st.sets(st.integers(0, 8), min_size=n, max_size=n)))
    gs = tuple(draw(groups(i, kinds)) for i in indices)
    # Mamba-align groups share one block size in real models (vLLM asserts one span).
    mamba = [g.tokens_per_block for g in gs if g.kind is GroupKind.MAMBA_ALIGN]
    if mamba:
        gs = tuple(
            replace(g, tokens_per_block=mamba[0]) if g.kind is GroupKind.MAMBA_ALIGN else g
            for g in gs
        )
    gcd = math.gcd(*(g.tokens_per_block for g in gs))
    if hash_divides_blocks:
        tph = draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 32, 64) if gcd % d == 0]))
    else:
        tph = draw(st.sampled_from((4, 8, 16, 32, 64, 128)))
    return Geometry(groups=gs, tokens_per_hash=tph)


def knobs(geometry: Geometry) -> st.SearchStrategy[Knob]:
    """Any knob, valid or not for ``geometry``."""
    indices = [g.index for g in geometry.groups]
    return st.one_of(
        st.builds(BlocksPerChunk, st.integers(-2, 40)),
        st.builds(BlockSize, st.integers(-64, 4096)),
        st.builds(
            PerGroupBlocksPerChunk.of,
            st.dictionaries(st.sampled_from(indices), st.integers(-1, 20), max_size=len(indices)),
            st.integers(-1, 8),
        ),
    )
