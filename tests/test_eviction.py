"""reference.eviction: the rule never strands a chunk, plain LRU does, budgets hold.

Expected values are worked by hand from the rule's statement (module docstring of
``reference/eviction.py``); reachability is checked against ``reference.rules``
directly (``needed_chunks`` and ``hit`` over the keys on disk), not through the
index's own bookkeeping.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from reference import disk_economics, eviction, rules
from reference.disk_economics import BudgetedIndex
from reference.economics import _Engine, hashed
from reference.eviction import EvictionRule, Layout
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.keys import group_keys, prefix_block_hashes
from reference.knobs import BlocksPerChunk, Chunking, resolve
from reference.plan import Planner, Policy
from reference.store import LookupResult
from reference.workload import GpuCache, WorkloadRequest

ROOT = Path(__file__).resolve().parents[1]
KEY_BYTES = 100


def _full_only() -> Chunking:
    """One full-attention group, 16-token blocks, 2 per chunk: 32-token chunks."""
    return resolve(Geometry((KVGroup(0, GroupKind.FULL, 16),), tokens_per_hash=16),
                   BlocksPerChunk(2))


def _full_swa() -> Chunking:
    """Full attention and a 24-token sliding window, 32-token chunks: a hit ending at a
    chunk end needs the window's last chunk (cdiv(24 - 1, 32) = 1)."""
    groups = (KVGroup(0, GroupKind.FULL, 16),
              KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=24))
    return resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(2))


def _chain(tokens: Sequence[int], chunking: Chunking) -> list[bytes]:
    return prefix_block_hashes(tokens, chunking.tokens_per_hash)


# ---------------------------------------------------------------------------
# Plain LRU strands a shared prefix's continuations; the rule does not
# ---------------------------------------------------------------------------


def _shared_prefix_disk(rule: EvictionRule) -> tuple[BudgetedIndex, list[bytes], list[bytes]]:
    """Chunk 0 shared (file F1), two continuations of two chunks each (F2, F3), both
    read after F1 was written, in a 5-key budget; then a new 1-key prompt arrives."""
    chunking = _full_only()
    index = BudgetedIndex(chunking, KEY_BYTES, 5 * KEY_BYTES, rule, Layout.PACKED)
    shared = list(range(1, 33))
    a = _chain(shared + list(range(100, 164)), chunking)
    b = _chain(shared + list(range(200, 264)), chunking)
    gc = chunking.groups[0]
    ka, kb = group_keys(a, gc), group_keys(b, gc)
    index.observe(a)
    index.observe(b)
    for keys in ([ka[0]], ka[1:], kb[1:]):
        plan = index.prepare_store(keys)
        assert plan is not None and plan.keys_to_store == tuple(keys)
        index.complete_store(keys)
    for key in (*ka, *kb):  # a lookup of each continuation touches F1 first, F1 stays oldest
        assert index.lookup(key) is LookupResult.HIT
    for key in (*ka[1:], *kb[1:]):
        index.lookup(key)
    c = _chain(list(range(300, 332)), chunking)
    index.observe(c)
    return index, [ka[0]], [*ka[1:], *kb[1:]]


def test_plain_lru_strands_the_continuations_of_an_evicted_shared_prefix() -> None:
    index, shared, continuations = _shared_prefix_disk(EvictionRule.LRU)
    c0 = group_keys(_chain(list(range(300, 332)), _full_only()), _full_only().groups[0])[0]
    plan = index.prepare_store([c0])
    assert plan is not None and plan.evicted_keys == tuple(shared)  # the oldest file
    index.complete_store([c0])
    # Both continuations (2 chunks each, 100 bytes a chunk) lost their chunk 0: 400 bytes.
    assert index.stranded_bytes() == 4 * KEY_BYTES
    assert index.disk.stranded() == frozenset(continuations)


def test_the_rule_evicts_a_leaf_and_strands_nothing() -> None:
    index, shared, continuations = _shared_prefix_disk(EvictionRule.REACHABLE)
    c0 = group_keys(_chain(list(range(300, 332)), _full_only()), _full_only().groups[0])[0]
    plan = index.prepare_store([c0])
    # The shared chunk is no leaf; the least recently used leaf is continuation a (F2).
    assert plan is not None and plan.evicted_keys == tuple(continuations[:2])
    index.complete_store([c0])
    assert index.stranded_bytes() == 0
    assert index.disk.bytes <= index.budget


def test_a_store_that_cannot_fit_is_refused_and_never_advertised() -> None:
    chunking = _full_only()
    index = BudgetedIndex(chunking, KEY_BYTES, 2 * KEY_BYTES, EvictionRule.REACHABLE)
    chain = _chain(list(range(1, 97)), chunking)
    keys = group_keys(chain, chunking.groups[0])
    index.observe(chain)
    assert index.prepare_store(keys) is None  # 3 keys, 2 fit: refused whole
    assert all(index.lookup(k) is LookupResult.MISS for k in keys)
    assert index.disk.bytes == 0 and index.stores_refused == 1


def test_windows_go_with_the_boundary_they_serve() -> None:
    """Per-chunk files: the full chunk at a boundary and the window chunk serving it are
    two files; evicting the full chunk (a leaf) takes the window with it."""
    chunking = _full_swa()
    index = BudgetedIndex(chunking, KEY_BYTES, 10 * KEY_BYTES, EvictionRule.REACHABLE,
                          Layout.PER_CHUNK)
    chain = _chain(list(range(1, 65)), chunking)  # 2 chunks; boundaries at 32 and 64
    full, window = (group_keys(chain, gc) for gc in chunking.groups)
    index.observe(chain)
    keys = [*full, window[1]]  # the window kept for the boundary at 64 only
    plan = index.prepare_store(keys)
    assert plan is not None and set(plan.keys_to_store) == set(keys)
    index.complete_store(keys)
    file_of = index.disk.file_of
    units = eviction.evictable(index.disk)
    # The window alone may go (chunk 1 stays reachable as a full chunk); chunk 1 takes
    # the window with it; chunk 0 is no leaf.
    assert (file_of[window[1]],) in units
    assert (file_of[full[1]], file_of[window[1]]) in units
    assert not any(file_of[full[0]] in u for u in units)


# ---------------------------------------------------------------------------
# The invariant, over drawn workloads
# ---------------------------------------------------------------------------


def _reachable_by_the_rules(chunking: Chunking, chains: Sequence[Sequence[bytes]],
                            on_disk: set[bytes]) -> set[bytes]:
    """Keys a lookup with an empty GPU cache loads, from ``reference.rules`` alone: a
    full chunk whose group's chunks from 0 are all on disk; a window chunk some hit
    ending at an alignment boundary loads (``rules.hit`` over the disk reaches it)."""
    reached: set[bytes] = set()
    groups = chunking.groups
    a = chunking.alignment_tokens
    assert a is not None
    for chain in chains:
        keys = [group_keys(chain, gc) for gc in groups]
        for p, gc in enumerate(groups):
            if gc.window_in_chunks is None:
                for k, key in enumerate(keys[p]):
                    if all(keys[p][j] in on_disk for j in rules.needed_chunks(gc, 0, (k + 1) * gc.tokens_per_chunk)):
                        reached.add(key)
        n = len(chain) * chunking.tokens_per_hash
        for end in range(a, n + 1, a):
            num_keys = [len(ks) for ks in keys]
            got = rules.hit(groups, num_keys, lambda g, k, keys=keys: keys[g][k] in on_disk, 0, end,
                            False)
            if got != end:
                continue
            for p, gc in enumerate(groups):
                reached.update(keys[p][k] for k in rules.loaded_chunks(gc, 0, end))
    return reached


_PIECES = st.lists(st.integers(1, 3), min_size=1, max_size=4)


@st.composite
def _prompts(draw: st.DrawFn) -> list[tuple[int, ...]]:
    """Prompts built from a few shared segments (shared prefixes, branches, repeats)."""
    segments = [tuple(range(1000 * s + 1, 1000 * s + 1 + draw(st.integers(16, 80))))
                for s in range(4)]
    prompts = []
    for _ in range(draw(st.integers(2, 7))):
        parts = draw(_PIECES)
        prompts.append(tuple(t for i in parts for t in segments[i]) + (9999,))
    return prompts


@given(_prompts(), st.sampled_from(list(Layout)), st.integers(1, 8),
       st.sampled_from((_full_only, _full_swa)), st.sampled_from((0, None)))
def test_the_rule_keeps_every_chunk_on_disk_reachable_within_the_budget(
    prompts: list[tuple[int, ...]], layout: Layout, budget_keys: int,
    make: object, retention: int | None,
) -> None:
    chunking = make()  # type: ignore[operator]
    policy = Policy(retention_interval=retention)
    index = BudgetedIndex(chunking, KEY_BYTES, budget_keys * KEY_BYTES, EvictionRule.REACHABLE,
                          layout)
    engine = _Engine(chunking, policy, 48)
    engine.index = index  # type: ignore[assignment]
    engine.planner = Planner(chunking, index, policy)
    engine.gpu_cache = GpuCache.COLD
    reqs = [WorkloadRequest(i, 0, p, (7,), 0) for i, p in enumerate(prompts)]
    chains = []
    for req, all_hashes in hashed(reqs, chunking.tokens_per_hash):
        index.observe(all_hashes)
        chains.append(all_hashes)
        engine.serve(req, all_hashes)  # a load of a key not on disk raises here
        on_disk = set(index.disk.file_of)
        assert index.disk.bytes <= index.budget
        assert sum(f.nbytes for f in index.disk.files.values()) == index.disk.bytes
        unreachable = on_disk - _reachable_by_the_rules(chunking, chains, on_disk)
        # Windows are kept only where a hit ends under sparse retention; dense retention's
        # final tails serve no boundary and the rule does not admit them.
        assert not unreachable, f"{len(unreachable)} chunks on disk no lookup can load"
        assert not index.disk.stranded()
        for chain in chains:  # a lookup's hit is served by what is on disk
            keys = [group_keys(chain, gc) for gc in chunking.groups]
            n = len(chain) * chunking.tokens_per_hash
            got = rules.hit(chunking.groups, [len(k) for k in keys],
                            lambda g, k, keys=keys: index.lookup(keys[g][k]) is LookupResult.HIT,
                            0, n, False)
            for p, gc in enumerate(chunking.groups):
                if got:
                    assert all(keys[p][k] in on_disk for k in rules.loaded_chunks(gc, 0, got))


def test_a_curve_counts_evictions_and_recomputation_for_space() -> None:
    """Three sessions of two turns (cold GPU): a first turn of 96 tokens stores 3 keys, the
    second (193 tokens) reads them and stores 3 more: 18 keys in all.  A disk of 18 keys
    never evicts and serves what the unbounded disk serves; a disk of 3 keys evicts and
    recomputes for lack of space."""
    chunking = _full_only()
    from reference.workload import Span, Workload

    w = Workload(name="t", description="", source="", sessions=3, turns=2, system_tokens=0,
                 turn_tokens=Span(96, 96), output_tokens=Span(1, 1))
    big, small = disk_economics.miss_ratio_curve(chunking, w, (18 * KEY_BYTES, 3 * KEY_BYTES),
                                                 EvictionRule.REACHABLE, KEY_BYTES)
    assert big.files_evicted == 0 and big.recomputed_for_space_tokens == 0
    assert small.files_evicted > 0 and small.recomputed_for_space_tokens > 0
    assert small.bytes_on_disk <= 3 * KEY_BYTES and small.stranded_bytes == 0


# ---------------------------------------------------------------------------
# The rule's row in docs/semantics.md §10 (tests/test_semantics_coverage.py holds §8,
# the rules of reference/rules.py, to the same three checks)
# ---------------------------------------------------------------------------


def test_the_eviction_rule_is_stated_tested_and_mutated() -> None:
    from conformance.meta.mutants import rules as rule_mutants

    section = (ROOT / "docs" / "semantics.md").read_text().split("\n## 10. ", 1)[1]
    section = section.split("\n## ", 1)[0]
    names = re.findall(r"^\| [^|]+ \| `eviction\.(\w+)` \|", section, re.MULTILINE)
    assert names, "§10 has no row for the eviction rule"
    tree = ast.parse((ROOT / "reference" / "eviction.py").read_text())
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    tested = set(re.findall(r"eviction\.(\w+)\(", (ROOT / "tests" / "test_rules.py").read_text()))
    mutated = {m.edit.target for m in rule_mutants.MUTANTS
               if m.edit.module().__name__ == "reference.eviction"}
    for name in names:
        assert name in functions, f"§10 names eviction.{name}, which reference/eviction.py lacks"
        assert name in tested, f"no tests/test_rules.py test calls eviction.{name}"
        assert name in mutated, f"no mutant of eviction.{name}"


def test_a_curve_equals_each_size_served_from_scratch() -> None:
    """The curve starts smaller disks from states of the unbounded run; each point must
    equal serving the whole workload afresh over a disk of that size (both rules)."""
    from reference.workload import Span, Workload, requests

    chunking = _full_swa()
    w = Workload(name="t", description="", source="", sessions=20, turns=4, system_tokens=64,
                 turn_tokens=Span(40, 120), output_tokens=Span(1, 20))
    reqs = hashed(list(requests(w)), chunking.tokens_per_hash)
    assert len(reqs) > 2 * disk_economics.SNAPSHOTS  # states are taken, and used
    for rule in EvictionRule:
        (unbounded,) = disk_economics.miss_ratio_curve(chunking, w, (2**40,), rule, KEY_BYTES)
        sizes = [unbounded.bytes_on_disk * k // 5 for k in range(1, 6)]
        curve = disk_economics.miss_ratio_curve(chunking, w, sizes, rule, KEY_BYTES)
        for size, point in zip(sizes, curve, strict=True):
            index = BudgetedIndex(chunking, KEY_BYTES, size, rule, Layout.PACKED)
            engine = _Engine(chunking, Policy(), w.max_num_batched_tokens)
            engine.index = index
            engine.planner = Planner(chunking, index, Policy())
            engine.gpu_cache = GpuCache.COLD
            for req, chain in reqs:
                index.observe(chain)
                engine.serve(req, chain)
            assert point.offload_hit_tokens == engine.tally.offload_hit, (rule, size)
            assert (point.files_read, point.files_written, point.files_evicted) == (
                index.files_read, index.files_written, index.files_evicted), (rule, size)
            assert point.bytes_on_disk == index.disk.bytes <= size
        assert curve[0].files_evicted > 0  # the smallest disk did evict
