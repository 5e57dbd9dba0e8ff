"""A finished request strands nothing (issue #31): once vLLM has finished a request and its
stores are done, the keys it stored that no lookup can load leave the ledger and the disk
(:meth:`vllm_adapter.disk.ledger.RootLedger.drop_finished`), as the reference's
:meth:`reference.disk_economics.BudgetedIndex.idle` drops them.

On the real hybrid geometries (gemma-4-31B-it TP2, DeepSeek-V4-Flash TP4 at ``block_size``
512) a prompt's first boundary comes in two stores, as vLLM's chunked prefill stores it:
store A carries window chunks ending before the boundary (admitted *pending* the
boundary: its full-attention chunk is one store away), store B its full-attention chunk
and the later window chunks, but with a gap: one sliding-window group's chunk ending at
the boundary never comes (vLLM's CPU tier still held it, and cascades only what it newly
stored).  The boundary is never whole, so A's window keys are stranded once B is done;
while the request is live they must stay (its next chunked-prefill step may still
complete a boundary).  Each test drives the reference with the same keys, and both must
end with the same files holding the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from conformance.harness.window_gap import WindowGap, window_gap
from conformance.testing.requires import require_vllm

require_vllm()  # the fixtures' chunking (vllm_adapter.planning.fixture_knob)

from test_ledger_state_machine import KEY_BYTES, NS, Engine, Setup, _name_of, _write_whole  # noqa: E402

from reference.disk_economics import BudgetedIndex  # noqa: E402
from reference.eviction import EvictionRule, Layout  # noqa: E402
from reference.keys import prefix_block_hashes  # noqa: E402
from vllm_adapter.disk.ledger import RootLedger  # noqa: E402

SPLIT = {"gemma-4-31B-it-tp2": 256, "deepseek-v4-flash-tp4": 448}
"""Where store A ends (tokens): its window chunks serve the first 512-token boundary."""
FIXTURES = tuple(SPLIT)


def gap_of(fixture: str, seed: int = 0) -> WindowGap:
    from vllm_adapter.planning import fixture_knob

    chunking = fixture_knob(fixture, "block_size", 512).chunking
    assert chunking.alignment_tokens is not None
    hashes = prefix_block_hashes(
        [seed * 100_000 + i for i in range(2 * chunking.alignment_tokens)],
        chunking.tokens_per_hash)
    return window_gap(chunking, hashes, SPLIT[fixture])


def engine(root: Path, gap: WindowGap, name: str = "a") -> Engine:
    e = Engine(root, name, setup=Setup(name, gap.chunking, 1 << 40, 512 << 10))
    e.start()
    return e


def store(e: Engine, gap: WindowGap, keys: Sequence[bytes]) -> list[tuple[str, tuple[bytes, ...]]]:
    """Reserve, write and complete a store of ``keys`` (the files admitted)."""
    out = e.tier.reserve(gap.files(keys), lambda ks: str(e.root / _name_of(ks)),
                         lambda ks: KEY_BYTES * len(ks), gap.positions)
    assert out is not None
    for path, keys_ in out:
        _write_whole(path, keys_, e.tier)
    e.tier.complete([(p, True) for p, _ in out])
    return out


def reference(gap: WindowGap) -> BudgetedIndex:
    ref = BudgetedIndex(gap.chunking, KEY_BYTES, 1 << 40, EvictionRule.REACHABLE, Layout.PACKED,
                        window_siblings=True)
    ref.observe(gap.hashes)
    return ref


def ref_store(ref: BudgetedIndex, keys: Sequence[bytes]) -> None:
    plan = ref.prepare_store(keys)
    assert plan is not None
    ref.complete_store(plan.keys_to_store)


def ledger_files(ledger: RootLedger) -> set[frozenset[bytes]]:
    out = set()
    for path in ledger.files(NS):
        entry = ledger.entry(path)
        assert entry is not None
        out.add(frozenset(entry[0]))
    return out


def reference_files(ref: BudgetedIndex) -> set[frozenset[bytes]]:
    return {frozenset(f.keys) for f in ref.disk.files.values()}


def on_disk(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*.kvp")}


@pytest.mark.parametrize("fixture", FIXTURES)
def test_a_boundary_with_a_gap_leaves_when_the_request_that_stored_it_finishes(
    fixture: str, tmp_path: Path,
) -> None:
    gap = gap_of(fixture)
    e = engine(tmp_path, gap)
    ref = reference(gap)
    out_a = store(e, gap, gap.a)
    ref_store(ref, gap.a)
    held = {k for _, ks in out_a for k in ks}
    assert held == set(gap.a), "store A's window chunks were not admitted pending their boundary"
    store(e, gap, gap.b)
    ref_store(ref, gap.b)
    assert held <= ref.disk.stranded(), "not vacuous: A's window keys are stranded once B is done"
    assert e.ledger.stranded_bytes() > 0 and ledger_files(e.ledger) == reference_files(ref)
    gone = e.tier.drop_finished(gap.a + gap.b)
    ref.idle()
    assert not ref.disk.stranded() and not held & set(ref.disk.file_of)
    assert e.ledger.stranded_bytes() == 0, e.ledger.files(NS)
    assert e.tier.snapshot(stranded=True)["stranded_bytes"] == 0
    assert ledger_files(e.ledger) == reference_files(ref)
    assert set(e.ledger.files(NS)) == on_disk(tmp_path), "the ledger and the disk disagree"
    assert {str(Path(p).relative_to(tmp_path)) for p in gone} == {
        str(Path(p).relative_to(tmp_path)) for p, _ in out_a}
    counters = e.ledger.counters.as_dict()
    assert counters["finished_keys_dropped"] == len(held)
    assert counters["finished_files_removed"] == len(out_a) == len(gone)
    # a fresh replay of the journal agrees, and so does a second engine's
    replayed = RootLedger.replayed(str(tmp_path), chunkings={NS: gap.chunking})
    assert replayed.model() == e.ledger.model()
    b = engine(tmp_path, gap, "b")
    assert ledger_files(b.ledger) == reference_files(ref) and b.ledger.stranded_bytes() == 0
    b.ledger.close()
    e.ledger.close()


@pytest.mark.parametrize("fixture", FIXTURES)
def test_a_whole_boundary_stays(fixture: str, tmp_path: Path) -> None:
    """Not a window chunk of a boundary that is whole goes, whoever asks."""
    gap = gap_of(fixture)
    e = engine(tmp_path, gap)
    store(e, gap, gap.a)
    store(e, gap, [k for k in gap.whole if k not in gap.a])
    before = ledger_files(e.ledger)
    assert e.ledger.stranded_bytes() == 0 and before
    assert e.tier.drop_finished(gap.whole + gap.a) == []
    assert ledger_files(e.ledger) == before
    assert e.ledger.counters.as_dict()["finished_keys_dropped"] == 0
    e.ledger.close()


def test_another_engines_files_stay(tmp_path: Path) -> None:
    """Another engine's request may still complete its boundary: only the engine that
    stored a file drops its keys."""
    gap = gap_of(FIXTURES[0])
    e = engine(tmp_path, gap)
    f = engine(tmp_path, gap, "f")
    store(e, gap, gap.a)
    store(e, gap, gap.b)
    assert e.ledger.stranded_bytes() > 0
    assert f.tier.drop_finished(gap.a + gap.b) == []
    assert f.ledger.stranded_bytes() > 0 and e.ledger.stranded_bytes() > 0
    assert e.tier.drop_finished(gap.a + gap.b)
    f.ledger.sync()
    assert e.ledger.stranded_bytes() == 0 == f.ledger.stranded_bytes()
    f.ledger.close()
    e.ledger.close()


def test_a_file_being_read_keeps_its_keys(tmp_path: Path) -> None:
    gap = gap_of(FIXTURES[0])
    e = engine(tmp_path, gap)
    out_a = store(e, gap, gap.a)
    store(e, gap, gap.b)
    paths_a = [p for p, _ in out_a]
    with e.tier.reading(paths_a):  # a load of this engine reads A's file
        assert e.tier.drop_finished(gap.a) == []
    assert e.ledger.stranded_bytes() > 0
    assert e.tier.drop_finished(gap.a)
    assert e.ledger.stranded_bytes() == 0
    assert set(e.ledger.files(NS)) == on_disk(tmp_path)
    e.ledger.close()


def test_under_lru_nothing_is_dropped(tmp_path: Path) -> None:
    """Plain LRU keeps what it stores (its stranded bytes are what it is measured by)."""
    gap = gap_of(FIXTURES[0])
    e = engine(tmp_path, gap)
    store(e, gap, gap.a)
    store(e, gap, gap.b)
    e.ledger.rule = EvictionRule.LRU
    assert e.tier.drop_finished(gap.a + gap.b) == []
    assert e.ledger.stranded_bytes() > 0
    e.ledger.close()
