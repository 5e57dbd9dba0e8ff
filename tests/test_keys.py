"""Keys: a key names exactly its prefix and its group."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from conformance.harness.strategies import geometries
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.keys import chunk_key, group_keys, make_key, prefix_block_hashes, split_key
from reference.knobs import BlocksPerChunk, resolve

tokens = st.lists(st.integers(0, 3), min_size=0, max_size=300)


@given(geometries(), st.integers(1, 4), tokens, tokens)
def test_key_names_exactly_its_prefix_and_group(
    geometry: Geometry, b: int, a: list[int], z: list[int]
) -> None:
    chunking = resolve(geometry, BlocksPerChunk(b))
    tph = geometry.tokens_per_hash
    ha, hz = prefix_block_hashes(a, tph), prefix_block_hashes(z, tph)
    for gc in chunking.groups:
        ka, kz = group_keys(ha, gc), group_keys(hz, gc)
        assert len(ka) == len(a) // gc.tokens_per_chunk  # only complete chunks
        for i, key in enumerate(ka):
            assert key == chunk_key(ha, gc, i)
            assert split_key(key)[1] == gc.group.index
            end = (i + 1) * gc.tokens_per_chunk
            if i < len(kz):
                assert (key == kz[i]) == (a[:end] == z[:end])
        for other in chunking.groups:
            if other.group.index != gc.group.index:
                assert not set(ka) & set(group_keys(ha, other))


def test_keys_worked_example() -> None:
    # notes §2.2: FA tpb 64 + SW(128) tpb 16, tph 16, bpc 2, 300 tokens -> 18 hashes.
    g = Geometry((KVGroup(0, GroupKind.FULL, 64), KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=128)), 16)
    c = resolve(g, BlocksPerChunk(2))
    h = [bytes([k]) * 32 for k in range(18)]
    assert group_keys(h, c.groups[0]) == [make_key(h[7], 0), make_key(h[15], 0)]
    assert group_keys(h, c.groups[1]) == [make_key(h[k], 1) for k in range(1, 18, 2)]
    assert make_key(h[7], 1)[-4:] == b"\x00\x00\x00\x01"
