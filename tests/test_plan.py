"""Store and load plans of the reference, on random geometries (no vLLM).

The sim engine (conformance.harness.sim) allocates block tables, writes synthetic,
prefix-determined KV bytes, and runs every job through reference.transfer, so
these properties pin plans and bytes together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import Phase, assume, event, given, settings
from hypothesis import strategies as st

from conformance.harness.sim import SimEngine, SimRequest, first_needed_block
from conformance.harness.strategies import geometries
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.keys import chunk_key, prefix_block_hashes
from reference.knobs import BlocksPerChunk, Chunking, PerGroupBlocksPerChunk, resolve
from reference.mathutil import cdiv
from reference.plan import Policy, UnsupportedChunking, supports_partial_tail
from reference.store import LookupResult

prompts = st.lists(st.integers(0, 2), min_size=1, max_size=260)


def _chunking_outcome(draw: st.DrawFn, kinds: tuple[GroupKind, ...] | None) -> Chunking | str:
    """A drawn chunking, or why :func:`chunkings` filters it (the event it records)."""
    geometry = draw(geometries(max_groups=4, kinds=kinds))
    if draw(st.booleans()):
        knob = BlocksPerChunk(draw(st.integers(1, 4)))
    else:
        knob = PerGroupBlocksPerChunk.of(
            {g.index: draw(st.integers(1, 4)) for g in geometry.groups}, default=1
        )
    retention = draw(st.sampled_from((0, None)))
    try:
        chunking = resolve(geometry, knob, retention_interval=retention)
    except ValueError:
        return "chunkings: filtered, the knob is refused"
    return "chunkings: filtered, partial tail" if supports_partial_tail(chunking) else chunking


@st.composite
def chunkings(draw: st.DrawFn, kinds: tuple[GroupKind, ...] | None = None) -> Chunking:
    outcome = _chunking_outcome(draw, kinds)
    event("chunkings: kept" if isinstance(outcome, Chunking) else outcome)
    assume(isinstance(outcome, Chunking))
    assert isinstance(outcome, Chunking)
    return outcome


CHUNKINGS_KEPT_FLOOR = 0.8
"""Share of drawn chunkings :func:`chunkings` must keep (neither refused nor partial-tail)."""


def test_chunkings_are_mostly_kept() -> None:
    """A fixed batch of draws: at least CHUNKINGS_KEPT_FLOOR of them are kept, for every kinds
    argument the tests pass, so a filter that starts rejecting most draws fails here instead
    of leaving the store and load properties to a handful of examples."""
    kept_by_kinds: dict[tuple[GroupKind, ...] | None, list[bool]] = {}
    for kinds in (None, _LOADABLE_KINDS):
        kept = kept_by_kinds.setdefault(kinds, [])

        @settings(max_examples=100, derandomize=True, database=None, phases=[Phase.generate])
        @given(st.composite(_chunking_outcome)(kinds))
        def record(outcome: Chunking | str) -> None:
            kept.append(isinstance(outcome, Chunking))  # noqa: B023 (run at once, below)

        record()
        assert len(kept) >= 50, len(kept)
        assert sum(kept) >= CHUNKINGS_KEPT_FLOOR * len(kept), (
            f"kinds {kinds}: {sum(kept)} of {len(kept)} chunkings kept"
        )


def _policy(data: st.DataObject) -> Policy:
    return Policy(retention_interval=data.draw(st.sampled_from((0, None))))


token_ids = st.integers(0, 2)


def tokens_to_hit(chunking: Chunking) -> int:
    """A prompt long enough that its repeat can load: a hit ends where a chunk of every
    group ends, after the chunks each group needs before it (at least one, a window's
    worth for windowed groups), with the chunk an EAGLE group peeks past it and the last
    token, which is always recomputed, still inside the prompt."""
    spans = [gc.tokens_per_chunk for gc in chunking.groups]
    common = math.lcm(*spans)
    before = max(gc.tokens_per_chunk * max(1, gc.window_in_chunks or 0) for gc in chunking.groups)
    peek = max(gc.tokens_per_chunk * gc.group.is_eagle for gc in chunking.groups)
    return cdiv(before, common) * common + peek + 1


def attends_before_end(group: KVGroup) -> bool:
    """The first recomputed token attends to some earlier token of this group (all but a
    1-token sliding window with nothing retained; an EAGLE group peeks a chunk further)."""
    if group.kind is not GroupKind.SLIDING_WINDOW or group.is_eagle:
        return True
    assert group.sliding_window is not None
    return group.sliding_window - 1 + group.extra_retained_tokens > 0


SHAPES = ("repeat", "prefix", "diverge", "fresh")
"""How the second request relates to the first: all of it (and maybe more), a prefix long
enough to hit, a prefix then a differing token (partial overlap), or a fresh prompt."""
_DRAWN_SHAPES = ("repeat",) * 4 + ("prefix",) * 2 + ("diverge", "fresh")
"""Shapes that can load drawn more often; a miss is drawn too (a fresh prompt)."""

_LOADABLE_KINDS = tuple(k for k in GroupKind if k is not GroupKind.MAMBA_ALIGN)
"""Kinds whose chunks the sim engine stores: Mamba-align states are stored only from boundary
hand-offs, which it never makes, so a geometry with such a group never loads here."""


@dataclass(frozen=True)
class Workload:
    chunking: Chunking
    policy: Policy
    first: tuple[int, ...]
    budget: int
    failing: frozenset[int]
    """Store jobs of the first request that fail."""
    second: tuple[int, ...]
    shape: str


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    chunking = draw(chunkings(draw(st.sampled_from((None, _LOADABLE_KINDS, _LOADABLE_KINDS)))))
    policy = Policy(retention_interval=draw(st.sampled_from((0, None))))
    shape = draw(st.sampled_from(_DRAWN_SHAPES))
    need = tokens_to_hit(chunking)
    if shape != "fresh":
        # Long prompts repeat a drawn pattern: keys hash whole prefixes, so every chunk
        # still has its own key, and the draw stays small.
        pattern = draw(st.lists(token_ids, min_size=1, max_size=48))
        length = draw(st.integers(need, need + 64))
        first = (pattern * cdiv(length, len(pattern)))[:length]
    else:
        first = draw(prompts)
    suffix = st.lists(token_ids, max_size=40)
    if shape == "repeat":
        second = first + draw(suffix)
    elif shape == "prefix":
        second = first[: draw(st.integers(need, len(first)))] + draw(suffix)
    elif shape == "diverge":
        last = len(first) - 1  # early divergences miss, late ones may load a shorter prefix
        cut = draw(st.one_of(st.integers(0, last), st.integers(min(need, last), last)))
        other = (first[cut] + draw(st.integers(1, 2))) % 3
        second = first[:cut] + [other] + draw(suffix)
    else:
        second = draw(prompts)
    no_failure = st.just(frozenset[int]())
    failures = st.frozensets(st.integers(0, 8), min_size=1, max_size=3)
    failing = draw(st.one_of(no_failure, no_failure, no_failure, failures))
    budget = draw(st.integers(max(1, len(first) // 32), 300))  # at most 32 prefill steps
    return Workload(chunking, policy, tuple(first), budget, failing, tuple(second), shape)


@dataclass(frozen=True)
class Replay:
    sim: SimEngine
    req: SimRequest
    """The second request."""
    ready_before: frozenset[bytes]
    """Keys the store could serve when the second request arrived."""
    gpu_before: tuple[torch.Tensor, ...]


def replay(w: Workload) -> Replay:
    """Run the first request (with its failing stores), then the second."""
    sim = SimEngine(w.chunking, policy=w.policy)
    sim.run_request("a", w.first, w.budget, fail_store=set(w.failing))
    ready = frozenset(k for k in sim.store.lru_order() if sim.store.lookup(k) is LookupResult.HIT)
    before = tuple(t.clone() for t in sim.gpu)
    return Replay(sim, sim.run_request("b", w.second, w.budget), ready, before)


LOAD_FLOOR = 0.5
"""Share of drawn workloads whose second request must load (the round trip is checked)."""


def test_workloads_mostly_load() -> None:
    """A fixed batch of workloads: at least LOAD_FLOOR of them load, and every shape is drawn,
    so a strategy that stops exercising the round trip fails here, not silently."""
    loaded: list[bool] = []
    shapes: set[str] = set()

    @settings(max_examples=100, derandomize=True, database=None, phases=[Phase.generate])
    @given(workloads())
    def record(w: Workload) -> None:
        shapes.add(w.shape)
        loaded.append(replay(w).req.loaded is not None)

    record()
    assert len(loaded) >= 50, len(loaded)
    assert sum(loaded) >= LOAD_FLOOR * len(loaded), f"{sum(loaded)} of {len(loaded)} workloads load"
    assert shapes == set(SHAPES)


@given(workloads())
def test_round_trip_and_sound_hits(w: Workload) -> None:
    chunking, tokens, second = w.chunking, list(w.first), list(w.second)
    run = replay(w)
    sim, req, ready_before, before = run.sim, run.req, run.ready_before, run.gpu_before
    hashes = prefix_block_hashes(second, chunking.tokens_per_hash)
    load = req.loaded
    event(f"shape: {w.shape}, {'no load' if load is None else 'loads'}")
    if load is None:
        event("no load: the round trip is not checked")  # counted (--hypothesis-show-statistics)
        return
    hit = load.hit_tokens
    assert 0 < hit < len(second) + (0 if any(gc.window_in_chunks for gc in chunking.groups) else 1)
    # Sound hit: every chunk the hit needs was stored, completed, and never failed.
    assert set(load.keys) <= ready_before
    assert not set(load.keys) & sim.failed_store_keys
    for gc in chunking.groups:
        first_chunk = first_needed_block(gc, hit) // gc.blocks_per_chunk if gc.window_in_chunks else 0
        for k in range(first_chunk, cdiv(hit, gc.tokens_per_chunk)):
            assert chunk_key(hashes, gc, k) in ready_before, (gc.group.describe(), k, hit)
    # A hit never reaches past the prefix the two requests share -- unless no group attends
    # to any token before the hit's end (every group a 1-token window, docs/semantics.md:
    # such a hit needs no KV at all, so nothing ties it to the first request).
    common = next((i for i, (x, y) in enumerate(zip(tokens, second, strict=False)) if x != y), min(len(tokens), len(second)))
    if any(attends_before_end(gc.group) for gc in chunking.groups):
        assert hit <= common
    else:
        event("every group a 1-token window: the hit needs no KV")
    # Round trip: each loaded block holds exactly the bytes request "a" computed there.
    first_req = sim.requests["a"]
    loaded_rows: dict[int, set[int]] = {}
    offset = 0
    for i, (gc, n, first) in enumerate(zip(chunking.groups, load.group_sizes, load.block_indices, strict=True)):
        for j in range(n):
            block = load.block_ids[offset + j]
            position = first + j
            assert req.tables[gc.group.index][position] == block
            for layer in range(gc.group.num_layers):
                t = sim.tensor_of[(i, layer)]
                loaded_rows.setdefault(t, set()).add(block)
                assert req.after_load is not None
                got = bytes(req.after_load[t][block].tolist())
                assert got == sim.expected_block(first_req, i, layer, position), (gc.group.describe(), position)
                if (position + 1) * gc.group.tokens_per_block <= hit:
                    assert got == sim.expected_block(req, i, layer, position)
        offset += n
    assert offset == len(load.block_ids)
    # No block outside the load plan changed during the load.
    for t, (old, new) in enumerate(zip(before, sim.gpu, strict=True)):
        for row in range(1, min(old.shape[0], sim.next_block)):
            if row not in loaded_rows.get(t, set()) and not any(
                row in table for table in req.tables.values()
            ):
                assert torch.equal(old[row], new[row])


@given(chunkings(), prompts, st.integers(1, 300), st.data())
def test_store_jobs_are_well_formed(chunking: Chunking, tokens: list[int], budget: int, data: st.DataObject) -> None:
    sim = SimEngine(chunking, policy=_policy(data))
    jobs = []
    original = sim.planner.step

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(*args, **kwargs)
        jobs.extend(out)
        return out

    sim.planner.step = spy  # type: ignore[method-assign]
    req = sim.run_request("a", tokens, budget)
    hashes = prefix_block_hashes(tokens, chunking.tokens_per_hash)
    seen: set[bytes] = set()
    for _, job in jobs:
        assert sum(job.group_sizes) == len(job.block_ids)
        assert len(job.group_sizes) == len(chunking.groups)
        assert not set(job.keys) & seen  # never stored twice
        seen.update(job.keys)
        offset = 0
        key_iter = iter(job.keys)
        for gc, n, first in zip(chunking.groups, job.group_sizes, job.block_indices, strict=True):
            bpc = gc.blocks_per_chunk
            blocks = job.block_ids[offset : offset + n]
            offset += n
            if not n:
                continue
            table = req.tables[gc.group.index]
            chunks = sorted({table.index(b) // bpc for b in blocks})
            assert table.index(blocks[0]) == first
            for k in chunks:
                key = next(key_iter)
                assert key == chunk_key(hashes, gc, k)
                assert (k + 1) * gc.tokens_per_chunk <= len(tokens)  # complete prompt chunks only
                # A full-attention chunk is stored whole.
                if gc.window_in_chunks is None:
                    assert all(table[j] in blocks for j in range(k * bpc, (k + 1) * bpc))


def test_partial_tail_chunkings_are_refused() -> None:
    g = Geometry((KVGroup(0, GroupKind.FULL, 64), KVGroup(1, GroupKind.MAMBA_ALIGN, 64)), 16)
    chunking = resolve(g, BlocksPerChunk(1))
    assert supports_partial_tail(chunking)
    try:
        SimEngine(chunking)
    except UnsupportedChunking as err:
        assert "partial tails" in str(err)
    else:
        raise AssertionError("expected UnsupportedChunking")


# --- worked example, docs/semantics.md §7 ----------------------------------------

FA64_SW128 = Geometry(
    (KVGroup(0, GroupKind.FULL, 64, 64), KVGroup(1, GroupKind.SLIDING_WINDOW, 16, 64, sliding_window=128)),
    tokens_per_hash=16,
)


def _positions(sim: SimEngine, group: int, blocks: tuple[int, ...]) -> list[int]:
    table = next(r for r in sim.requests.values()).tables[group]
    return [table.index(b) for b in blocks]


def _first_store(retention: int | None, budget: int) -> list:  # type: ignore[type-arg]
    sim = SimEngine(resolve(FA64_SW128, BlocksPerChunk(2), retention), policy=Policy(retention_interval=retention))
    jobs = []
    original = sim.planner.step

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = original(*args, **kwargs)
        jobs.append(out)
        return out

    sim.planner.step = spy  # type: ignore[method-assign]
    sim.run_request("a", list(range(300)), budget)
    return [(sim, job) for step in jobs for _, job in step]


def test_worked_example_7_1_store_sparse() -> None:
    (sim, job), = _first_store(0, 300)
    assert job.group_sizes == (4, 8) and job.block_indices == (0, 8)
    assert _positions(sim, 0, job.block_ids[:4]) == [0, 1, 2, 3]
    assert _positions(sim, 1, job.block_ids[4:]) == list(range(8, 16))
    h = prefix_block_hashes(list(range(300)), 16)
    assert [k[:-4] for k in job.keys] == [h[7], h[15], h[9], h[11], h[13], h[15]]


def test_worked_example_7_2_store_dense() -> None:
    (_, job), = _first_store(None, 300)
    assert job.group_sizes == (4, 18) and job.block_indices == (0, 0)
    assert len(job.keys) == 11


def test_worked_example_7_3_chunked_prefill() -> None:
    jobs = [job for _, job in _first_store(0, 100)]
    assert [(j.group_sizes, j.block_indices) for j in jobs] == [((2, 4), (0, 8)), ((2, 4), (2, 12))]
    dense = [job for _, job in _first_store(None, 100)]
    assert [j.group_sizes for j in dense] == [(0, 6), (2, 6), (2, 6)]


def test_worked_example_7_4_reload() -> None:
    chunking = resolve(FA64_SW128, BlocksPerChunk(2))
    sim = SimEngine(chunking)
    sim.run_request("a", list(range(300)), 300)
    req = sim.run_request("b", list(range(300)), 300)
    assert req.loaded is not None
    assert req.loaded.hit_tokens == 256
    assert req.loaded.group_sizes == (4, 8) and req.loaded.block_indices == (0, 8)
