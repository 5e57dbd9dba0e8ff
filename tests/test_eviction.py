"""reference.eviction: the rule never strands a chunk, plain LRU does, budgets hold.

Expected values are worked by hand from the rule's statement (module docstring of
``reference/eviction.py``); reachability is checked against ``reference.rules``
directly (``needed_chunks`` and ``hit`` over the keys on disk), not through the
index's own bookkeeping.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from reference import disk_economics, eviction, rules
from reference.disk_economics import BudgetedIndex
from reference.economics import _Engine, hashed
from reference.eviction import EvictionRule, Layout
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.keys import group_keys, prefix_block_hashes, split_key
from reference.knobs import BlocksPerChunk, Chunking, resolve
from reference.plan import Planner, Policy
from reference.store import LookupResult
from reference.workload import GpuCache, Span, Workload, WorkloadRequest

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


# ---------------------------------------------------------------------------
# Issue #31: the counters, the ablation's options, the window-sibling admission
# ---------------------------------------------------------------------------


def _two_turns() -> Workload:
    return Workload(name="t", description="", source="", sessions=3, turns=2, system_tokens=0,
                    turn_tokens=Span(96, 96), output_tokens=Span(1, 1))


def test_a_curve_reports_refusals_drops_and_bytes_on_disk() -> None:
    """The sessions of ``test_a_curve_counts_evictions_and_recomputation_for_space``: a first
    turn of 96 tokens (3 chunks), a second of 193 (6 chunks; 3 new).  Worked by hand:

    * a disk of 2 keys: every store offers 3 keys (the Planner's one step), more than the
      disk holds whatever goes: refused; the Planner offers them again at the finishing step
      (refused again): 2 refusals per first turn, and the second turn, which hits nothing,
      offers its 6 keys twice too: 4 refusals a session, 12 in all; nothing is ever written,
      so nothing is served (recomputed for space = all the unbounded disk served);
    * plain LRU on that disk: the same (LRU cannot make room for 3 keys in 2 either);
    * the unbounded disk: no refusal, no key dropped, every key written once: 18 keys on
      disk at the end."""
    chunking = _full_only()
    w = _two_turns()
    big, = disk_economics.miss_ratio_curve(chunking, w, (10**6,), EvictionRule.REACHABLE, KEY_BYTES)
    assert (big.stores_refused, big.keys_dropped, big.bytes_on_disk) == (0, 0, 18 * KEY_BYTES)
    served = big.offload_hit_tokens
    for rule in EvictionRule:
        tiny, = disk_economics.miss_ratio_curve(chunking, w, (2 * KEY_BYTES,), rule, KEY_BYTES)
        assert tiny.stores_refused == 12, rule
        assert tiny.keys_dropped == 0 and tiny.bytes_on_disk == 0 and tiny.files_written == 0
        assert tiny.offload_hit_tokens == 0
        assert tiny.recomputed_for_space_tokens == served == 3 * 96  # each second turn's 3 chunks
        assert tiny.stranded_bytes == 0


def test_the_counters_of_a_curve_point_are_a_fresh_run_s() -> None:
    """Refusals, drops, cut stores and bytes on disk of each curve point equal serving the
    workload afresh over that disk (the curve resumes smaller disks from snapshots)."""
    from reference.workload import Span, Workload, requests

    chunking = _full_swa()
    w = Workload(name="t", description="", source="", sessions=20, turns=4, system_tokens=64,
                 turn_tokens=Span(40, 120), output_tokens=Span(1, 20))
    reqs = hashed(list(requests(w)), chunking.tokens_per_hash)
    for rule in EvictionRule:
        for overflow in eviction.Overflow:
            (unbounded,) = disk_economics.miss_ratio_curve(chunking, w, (2**40,), rule, KEY_BYTES)
            sizes = [unbounded.bytes_on_disk * k // 9 for k in (1, 2, 4)]
            curve = disk_economics.miss_ratio_curve(chunking, w, sizes, rule, KEY_BYTES,
                                                    overflow=overflow)
            for size, point in zip(sizes, curve, strict=True):
                index = BudgetedIndex(chunking, KEY_BYTES, size, rule, Layout.PACKED,
                                      overflow=overflow)
                engine = _Engine(chunking, Policy(), w.max_num_batched_tokens)
                engine.index = index
                engine.planner = Planner(chunking, index, Policy())
                engine.gpu_cache = GpuCache.COLD
                for req, chain in reqs:
                    index.observe(chain)
                    engine.serve(req, chain)
                assert (point.stores_refused, point.keys_dropped, point.stores_cut,
                        point.keys_cut, point.bytes_on_disk) == (
                    index.stores_refused, index.keys_dropped, index.stores_cut, index.keys_cut,
                    index.disk.bytes), (rule, overflow, size)
                assert point.stranded_bytes == index.stranded_bytes()
                if rule is EvictionRule.REACHABLE:
                    assert point.stranded_bytes == 0
                else:
                    assert point.keys_dropped == 0  # LRU admits every key


def test_a_store_that_does_not_fit_admits_its_longest_prefix_closed_head() -> None:
    """Three chunks offered to a disk of two keys: refused whole by default; under
    ``Overflow.HEAD`` chunks 0 and 1 are admitted (chunk 2's parent stays out of nothing:
    the head is prefix-closed), and a later store of chunk 2 evicts nothing it needs."""
    chunking = _full_only()
    chain = _chain(list(range(1, 97)), chunking)
    keys = group_keys(chain, chunking.groups[0])
    index = BudgetedIndex(chunking, KEY_BYTES, 2 * KEY_BYTES, EvictionRule.REACHABLE,
                          overflow=eviction.Overflow.HEAD)
    index.observe(chain)
    plan = index.prepare_store(keys)
    assert plan is not None and plan.keys_to_store == tuple(keys[:2])
    index.complete_store(plan.keys_to_store)
    assert (index.stores_refused, index.stores_cut, index.keys_cut) == (0, 1, 1)
    assert index.disk.bytes == 2 * KEY_BYTES and index.stranded_bytes() == 0
    # Chunk 2 alone: its parent (chunk 1) is no leaf once it is pending, chunk 0 neither: the
    # rule has nothing to evict, and the head of a one-chunk store does not fit either.
    assert index.prepare_store([keys[2]]) is None and index.stores_refused == 1


def _full_two_chunk_window() -> Chunking:
    """Full attention and a 48-token sliding window, 32-token chunks: a hit ending at a
    chunk end needs the window's last two chunks (cdiv(48 - 1, 32) = 2)."""
    groups = (KVGroup(0, GroupKind.FULL, 16),
              KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=48))
    return resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(2))


def test_a_head_is_sized_by_what_the_rule_frees_with_that_head_pending() -> None:
    """The smallest case of gemma-4 ``drawn_workload(2)``'s "a head that fits was refused":
    boundary 1 whole on disk (chunk 0's full file and window file), then a store of chunks 1
    and 2 in a 3-key budget.  With the whole store pending, chunk 0's window file may go
    (boundary 3 is whole on the store's own window keys); with its head (boundary 2: full
    chunk 1 and window chunk 1) pending it may not (boundary 2's window needs window chunk
    0).  The head is probed with itself pending: no head fits, the store is refused and
    nothing changes.  With one more key of budget that head fits without evicting."""
    chunking = _full_two_chunk_window()
    chain = _chain(list(range(1, 97)), chunking)  # 3 chunks
    full, window = (group_keys(chain, gc) for gc in chunking.groups)
    for budget, admitted in ((3, None), (4, (full[1], window[1]))):
        index = BudgetedIndex(chunking, KEY_BYTES, budget * KEY_BYTES, EvictionRule.REACHABLE,
                              overflow=eviction.Overflow.HEAD)
        index.observe(chain)
        plan = index.prepare_store([full[0], window[0]])
        assert plan is not None
        index.complete_store(plan.keys_to_store)
        before = dict(index.disk.file_of)
        store = [full[1], window[1], full[2], window[2]]
        whole = index._add(store)
        assert (index.disk.file_of[window[0]],) in eviction.evictable(index.disk)
        for fid in whole:
            index.disk.remove(fid)
        plan = index.prepare_store(store)
        if admitted is None:
            assert plan is None
            assert (index.stores_refused, index.stores_cut) == (1, 0)
            assert index.disk.file_of == before and index.disk.bytes == 2 * KEY_BYTES
        else:
            assert plan is not None and plan.keys_to_store == admitted
            assert plan.evicted_keys == () and (index.stores_cut, index.keys_cut) == (1, 2)
            index.complete_store(plan.keys_to_store)
            assert index.stranded_bytes() == 0


def test_prefix_closed_head_takes_whole_boundaries_with_their_windows() -> None:
    """``eviction.prefix_closed_head`` over a full + 24-token-window chunking (a boundary at
    each 32-token chunk end needs its full chunk and the window's last chunk): heads grow a
    boundary at a time, each with the window key that makes it whole; a window key for a
    boundary whose full chunk is not in the head is left out; ``fits`` picks the deepest."""
    chunking = _full_swa()
    structure = eviction.PrefixStructure(chunking)
    chain = _chain(list(range(1, 97)), chunking)  # 3 chunks
    structure.observe(chain)
    full, window = (group_keys(chain, gc) for gc in chunking.groups)
    disk = eviction.Disk(structure)
    disk.add([full[0], window[0]], 2, ready=True)  # boundary 1 whole on disk
    keys = [full[1], window[1], full[2], window[2]]
    seen: list[tuple[bytes, ...]] = []

    def fits_up_to(n: int) -> Callable[[tuple[bytes, ...]], bool]:
        def fits(head: tuple[bytes, ...]) -> bool:
            seen.append(head)
            return len(head) <= n
        return fits

    assert eviction.prefix_closed_head(disk, keys, fits_up_to(4)) == tuple(keys)
    assert eviction.prefix_closed_head(disk, keys, fits_up_to(3)) == (full[1], window[1])
    assert eviction.prefix_closed_head(disk, keys, fits_up_to(1)) == ()
    assert all(h in {(), (full[1], window[1]), tuple(keys)} for h in seen)
    # A store whose first chunk's parent is missing has no head at all.
    assert eviction.prefix_closed_head(eviction.Disk(structure), keys, fits_up_to(9)) == ()


def test_windows_apart_lets_the_rule_evict_an_interior_boundary_s_windows() -> None:
    """``windows_apart``: a packed store writes its full-attention keys and its window keys
    to two files; the window file of a boundary the next store extends may go alone (the
    full chunks stay reachable), where the packed file of both may not (no leaf)."""
    chunking = _full_swa()
    chain = _chain(list(range(1, 97)), chunking)
    full, window = (group_keys(chain, gc) for gc in chunking.groups)
    for apart, evictable_alone in ((False, False), (True, True)):
        index = BudgetedIndex(chunking, KEY_BYTES, 10 * KEY_BYTES, EvictionRule.REACHABLE,
                              windows_apart=apart)
        index.observe(chain)
        first = [full[0], full[1], window[1]]
        plan = index.prepare_store(first)
        assert plan is not None
        index.complete_store(plan.keys_to_store)
        assert len(index.disk.files) == (2 if apart else 1)
        plan = index.prepare_store([full[2], window[2]])
        assert plan is not None
        index.complete_store(plan.keys_to_store)
        units = eviction.evictable(index.disk)
        owner = index.disk.file_of[window[1]]
        assert ((owner,) in units) is evictable_alone, apart


def test_window_siblings_refuses_a_window_whose_earlier_sibling_never_comes() -> None:
    """A key set with a gap on a sliding-window group (issue #31's strand): a 48-token window
    over 32-token chunks needs the last two chunks before a boundary (cdiv(47, 32) = 2).
    Boundary 3 (96 tokens) needs window chunks 1 and 2.  The disk holds chunks 0-1 of the
    full group and nothing of the window group; a store carries full chunk 2 and window
    chunk 2 only (the CPU tier held window chunk 1 and cascades only what it newly stored).

    By default the boundary is judged by its full-attention key alone: window chunk 2 is
    admitted and is stranded once the store completes, and ``stranded(pending_windows=True)``
    does not see it.  With ``window_siblings`` it is not admitted: its sibling, window chunk
    1, ends before the store's last key and is neither on disk, nor in the store, nor
    pending.  A sibling that ends after the store's keys may still come and does not count."""
    groups = (KVGroup(0, GroupKind.FULL, 16),
              KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=48))
    chunking = resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(2))
    assert chunking.groups[1].window_in_chunks == 2
    chain = _chain(list(range(1, 97)), chunking)
    full, window = (group_keys(chain, gc) for gc in chunking.groups)
    structure = eviction.PrefixStructure(chunking)
    structure.observe(chain)
    assert structure.windows_at[split_key(full[2])[0]] == {window[1], window[2]}

    def disk_with_head() -> eviction.Disk:
        disk = eviction.Disk(structure)
        disk.add([full[0]], 1, ready=True)
        disk.add([full[1]], 1, ready=True)
        return disk

    store = [full[2], window[2]]
    disk = disk_with_head()
    assert disk.arrives_stranded(store, pending_windows=True) == set()  # the strand
    disk.add(store, 2, ready=True)
    assert window[2] in disk.stranded()
    assert window[2] not in disk.stranded(pending_windows=True)  # and nothing removes it

    disk = disk_with_head()
    assert disk.arrives_stranded(store, pending_windows=True, window_siblings=True) == {window[2]}
    # The whole boundary in one store, or the sibling already on disk: admitted.
    assert disk.arrives_stranded([full[2], window[1], window[2]], pending_windows=True,
                                 window_siblings=True) == set()
    disk.add([window[1]], 1, ready=True)
    assert disk.arrives_stranded(store, pending_windows=True, window_siblings=True) == set()
    # Chunked prefill: window chunk 1 comes first, its later sibling (chunk 2) still to come.
    disk = disk_with_head()
    assert disk.arrives_stranded([window[1]], pending_windows=True, window_siblings=True) == set()
    # A pending sibling (reserved by a store in flight) counts as present.
    disk = disk_with_head()
    disk.add([window[1]], 1, ready=False)
    assert disk.arrives_stranded(store, pending_windows=True, window_siblings=True) == set()


def test_window_keys_pending_a_refused_store_leave_once_no_store_is_pending() -> None:
    """Issue #31's strand after a refused store: a 48-token window over 32-token chunks
    needs the last two chunks before a boundary.  A prompt's first store job (chunked
    prefill) brings full chunks 0-1 and window chunk 1, admitted pending boundary 3 (its
    full-attention key is one store away).  The next job (full chunk 2, window chunk 2)
    does not fit: the full file is its parent, and window chunk 1 waits for it, so nothing
    may go and it is refused.  If it never comes, window chunk 1 is stranded.  Once no
    store is pending (``BudgetedIndex.idle``: the engine idle) the rule leaves no key no
    lookup can load, and keeps the reachable prefix; plain LRU (the baseline) is left as
    it is."""
    groups = (KVGroup(0, GroupKind.FULL, 16),
              KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=48))
    chunking = resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(2))
    chain = _chain(list(range(1, 97)), chunking)
    full, window = (group_keys(chain, gc) for gc in chunking.groups)
    for rule in (EvictionRule.REACHABLE, EvictionRule.LRU):
        index = BudgetedIndex(chunking, KEY_BYTES, 4 * KEY_BYTES, rule, Layout.PACKED)
        index.observe(chain)
        first = [full[0], full[1], window[1]]
        plan = index.prepare_store(first)
        assert plan is not None and plan.keys_to_store == tuple(first)
        index.complete_store(first)
        if rule is EvictionRule.REACHABLE:
            assert index.prepare_store([full[2], window[2]]) is None  # refused for space
            assert index.disk.stranded() == {window[1]}  # waiting for a store that is not coming
        else:
            assert index.prepare_store([full[2], window[2]]) is not None  # LRU makes room
            index.complete_store([full[2], window[2]])
        stranded = index.disk.stranded()
        index.idle()
        if rule is EvictionRule.REACHABLE:
            assert index.disk.stranded() == frozenset()
            assert set(index.disk.file_of) == {full[0], full[1]}  # the prefix stays
            assert index.stranded_bytes() == 0
        else:
            assert stranded and index.disk.stranded() == stranded


def test_window_siblings_in_the_budgeted_index() -> None:
    """The index's ``window_siblings`` option drops the gap's window key and counts it."""
    groups = (KVGroup(0, GroupKind.FULL, 16),
              KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=48))
    chunking = resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(2))
    chain = _chain(list(range(1, 97)), chunking)
    full, window = (group_keys(chain, gc) for gc in chunking.groups)
    for siblings, stored in ((False, (full[2], window[2])), (True, (full[2],))):
        index = BudgetedIndex(chunking, KEY_BYTES, 10 * KEY_BYTES, EvictionRule.REACHABLE,
                              Layout.PER_CHUNK, window_siblings=siblings)
        index.observe(chain)
        for keys in ([full[0]], [full[1]]):
            plan = index.prepare_store(keys)
            assert plan is not None
            index.complete_store(keys)
        plan = index.prepare_store([full[2], window[2]])
        assert plan is not None and plan.keys_to_store == stored
        index.complete_store(plan.keys_to_store)
        assert index.keys_dropped == (1 if siblings else 0)
        assert bool(index.disk.stranded()) is not siblings


# ---------------------------------------------------------------------------
# What the files model is built from (the ledger's replay calls these per file)
# ---------------------------------------------------------------------------


def test_is_full_is_a_full_group_or_a_recorded_parent_and_add_classifies_files_by_it() -> None:
    """``PrefixStructure.is_full`` reads the group id in place and asks the parent table
    first: it must equal its statement (``split_key(key)[1]`` in the full groups, or a
    recorded parent), and ``Disk.add`` must track a file of window keys only (and no other)
    as a candidate of the rule's first step and count its full keys' dependents."""
    from reference.eviction import Disk
    from reference.prefix_structure import Fragment, PrefixStructure

    chunking = _full_swa()
    s = PrefixStructure(chunking)
    full0, full1 = (bytes([i]) * 8 + (0).to_bytes(4, "big") for i in (1, 2))
    win, win_parented = (bytes([i]) * 8 + (1).to_bytes(4, "big") for i in (3, 4))
    s.record(Fragment(((full0, None), (full1, full0), (win_parented, None)),
                      ((full1[:-4], (full1,), (win,)),)))
    fed = PrefixStructure(None)  # a structure only record() feeds: no full groups
    fed.record(Fragment(((full1, full0),), ()))
    for structure in (s, fed):
        for key in (full0, full1, win, win_parented, b"\x00" * 12):
            stated = split_key(key)[1] in structure.full_groups or key in structure.parent
            assert structure.is_full(key) is stated, key
    assert [s.is_full(k) for k in (full0, full1, win, win_parented)] == [True, True, False, True]
    assert [fed.is_full(k) for k in (full0, full1)] == [False, True]

    disk = Disk(s)
    a = disk.add([full0], 1)
    b = disk.add([win], 1)
    c = disk.add([full1, win_parented], 1)
    assert list(disk._windows_only) == [b]
    assert disk._dependents == {a: 1, b: 0, c: 0}  # full1's parent lives in a
