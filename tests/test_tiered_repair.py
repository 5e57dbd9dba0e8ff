"""Repair (issue #31 item 3, a candidate rule with vLLM's CPU tier in front): the CPU->disk
cascade also offers the disk a store's missing ancestors the CPU tier holds
(:meth:`reference.tiered_index.TieredIndex.missing_ancestors`), in prefix order before the
store's keys.  An option of the reference's tiered engine, off by default.

A hand-built chain of four 32-token chunks (a full-attention group and a 48-token window:
a boundary needs its last two window chunks), its first chunk on disk, the next two held
by the CPU tier only: a store of the fourth chunk's keys is offered exactly the ancestors
stated by hand; with repair off the cascade is vLLM's (nothing else written)."""

from __future__ import annotations

import hashlib

import pytest
from test_tiered_curve import drawn

from reference.disk_economics import BudgetedIndex
from reference.eviction import EvictionRule, Layout
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.keys import make_key
from reference.knobs import BlocksPerChunk, Chunking, resolve
from reference.tiered_curve import tiered_miss_ratio_curve
from reference.tiered_index import TieredIndex

KEY_BYTES = 100


def _chunking() -> Chunking:
    groups = (KVGroup(0, GroupKind.FULL, 16),
              KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=48))
    return resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(2))


CHUNKING = _chunking()
HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(8)]
"""Eight 16-token hash units: four 32-token chunks, a boundary at the end of each."""
F = [make_key(HASHES[2 * i + 1], 0) for i in range(4)]
"""The full-attention chunks' keys."""
W = [make_key(HASHES[2 * i + 1], 1) for i in range(4)]
"""The window chunks' keys."""


def _index(repair: bool, on_disk: list[bytes], held: list[bytes]) -> TieredIndex:
    disk = BudgetedIndex(CHUNKING, KEY_BYTES, 10**6, EvictionRule.REACHABLE, Layout.PACKED)
    disk.observe(HASHES)
    index = TieredIndex(disk, repair=repair)  # an unbounded CPU tier: a set of keys
    if on_disk:
        plan = disk.prepare_store(on_disk)
        assert plan is not None and set(plan.keys_to_store) == set(on_disk)
        disk.complete_store(plan.keys_to_store)
    index.cpu.update([*on_disk, *held])
    return index


def test_the_chain_is_as_stated() -> None:
    s = _index(False, [], []).disk.structure
    assert [s.parent[k] for k in F] == [None, F[0], F[1], F[2]]
    boundary = [HASHES[2 * i + 1] for i in range(4)]
    assert [s.full_at[b] for b in boundary] == [(f,) for f in F]
    assert [s.windows_at[b] for b in boundary] == [
        {W[0]}, {W[0], W[1]}, {W[1], W[2]}, {W[2], W[3]}]


def test_repair_offers_exactly_the_missing_ancestors_the_cpu_tier_holds() -> None:
    """Disk: chunk 0 (F0, W0).  CPU tier: chunks 0-2.  A store of chunk 3 (F3, W3) needs,
    from token 0, F0-F2 (F3's parent chain) and W2 (boundary 3's other window chunk): F1,
    F2 and W2 are missing on disk and held, in prefix order (W1 serves only boundaries 1
    and 2: not an ancestor of boundary 3's lookup)."""
    index = _index(True, [F[0], W[0]], [F[1], W[1], F[2], W[2]])
    assert index.missing_ancestors([F[3], W[3]]) == (F[1], F[2], W[2])
    # a full key alone: its parent chain; not boundary 3's W2, as W3 is nowhere (the
    # boundary cannot be made whole: W2 would arrive stranded)
    assert index.missing_ancestors([F[3]]) == (F[1], F[2])
    # keys already on disk or in the store are never offered again
    assert index.missing_ancestors([F[2], W[2], F[3], W[3]]) == (F[1], W[1])
    # the cascade writes them, then the store: nothing dropped, the boundary whole
    index.complete_store([F[3], W[3]])
    on_disk = set(index.disk.disk.file_of)
    assert on_disk == {F[0], W[0], F[1], F[2], W[2], F[3], W[3]}
    assert index.keys_repaired == 3 and index.bytes_repaired == 3 * KEY_BYTES
    assert index.disk.keys_dropped == 0 and index.disk.stranded_bytes() == 0
    assert index.disk.bytes_written == 7 * KEY_BYTES


def test_an_ancestor_the_cpu_tier_does_not_hold_repairs_nothing_it_would_strand() -> None:
    """F1 is neither on disk nor held: F3's chain cannot be made whole, nor boundary 3, so
    nothing is offered (F2 and W2 would arrive stranded)."""
    index = _index(True, [F[0], W[0]], [F[2], W[2]])
    assert index.missing_ancestors([F[3], W[3]]) == ()
    # boundary 3's windows are repairable on their own? no: its full chain needs F1
    index = _index(True, [F[0], W[0], F[1]], [F[2]])  # W2 missing everywhere
    assert index.missing_ancestors([F[3], W[3]]) == (F[2],)  # F3's chain; boundary 3 lacks W2


def test_with_repair_off_the_cascade_is_vllms() -> None:
    """The same store without repair: F3 arrives with no parent on disk and is dropped by
    admission (W3 with it); nothing is written, nothing repaired."""
    index = _index(False, [F[0], W[0]], [F[1], W[1], F[2], W[2]])
    written = index.disk.bytes_written
    index.complete_store([F[3], W[3]])
    assert set(index.disk.disk.file_of) == {F[0], W[0]}
    assert index.keys_repaired == index.bytes_repaired == 0
    assert index.disk.keys_dropped == 2 and index.disk.bytes_written == written


@pytest.mark.parametrize("seed", range(6))
def test_repair_off_is_the_default_curve_and_on_strands_nothing(seed: int) -> None:
    """On drawn multi-turn workloads with a small CPU tier in front: ``repair=False`` is the
    default curve exactly, nothing repaired; ``repair=True`` strands nothing under the rule
    and counts its repairs within the bytes written."""
    from test_tiered_curve import CHUNKING as C
    from test_tiered_curve import KEY_BYTES as KB

    w = drawn(seed)
    default = tiered_miss_ratio_curve(C, w, 4, 3, EvictionRule.REACHABLE, KB, Layout.PACKED)
    sizes = [e.budget_bytes or 0 for e in default]
    off = tiered_miss_ratio_curve(C, w, sizes, 3, EvictionRule.REACHABLE, KB, Layout.PACKED,
                                  repair=False)
    assert off == default
    assert all(e.keys_repaired == e.bytes_repaired == 0 for e in off)
    on = tiered_miss_ratio_curve(C, w, sizes, 3, EvictionRule.REACHABLE, KB, Layout.PACKED,
                                 repair=True)
    for e in on:
        assert e.stranded_bytes == 0
        assert e.bytes_repaired == e.keys_repaired * KB <= e.bytes_written
