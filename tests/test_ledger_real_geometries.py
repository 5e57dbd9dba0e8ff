"""The ledger's state machine on real hybrid geometries: gemma-4-31B-it TP2 and
DeepSeek-V4-Flash TP4 at ``block_size`` 512, as the installed vLLM plans them.

:class:`test_ledger_state_machine.LedgerMachine` (crashes at every step of the store
protocol, a second host, restarts, a third engine with another budget, a damaged
journal, after every step the budget, the files and every engine's model checked) with
the engines' tiers judging prefixes by the fixture's chunking: gemma-4's five
sliding-window groups and its full group; DeepSeek-V4's windows of 8 to 128 tokens,
chunks of 8 to 512 tokens, beside its compressed full group.  A store carries the keys of
every group whose chunk ends in its 512-token span, as vLLM's store jobs do, and the
budget holds four boundaries' admitted keys, so every few stores evict.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from test_ledger_state_machine import (  # noqa: I001
    COUNTERS,
    KEY_BYTES,
    Engine,
    LedgerMachine,
    Setup,
    root_bytes,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm importable (the fixtures' chunking)")

FIXTURES = ("gemma-4-31B-it-tp2", "deepseek-v4-flash-tp4")
RESERVE = 512 << 10
"""The ledger's reserve here: a real boundary's ``add`` record lists tens of keys."""
BOUNDARIES = 4
"""The files' budget: this many boundaries' admitted keys."""


def real_setup(fixture: str) -> Setup:
    """The fixture's chunking at ``block_size`` 512, and a budget of :data:`BOUNDARIES`
    boundaries: the keys one engine admits for one prompt's first span, measured on an
    unbounded root."""
    from vllm_adapter.planning import fixture_knob

    chunking = fixture_knob(fixture, "block_size", 512).chunking
    probe = Setup(fixture, chunking, 1 << 40, RESERVE)
    with tempfile.TemporaryDirectory() as tmp:
        e = Engine(Path(tmp), "probe", setup=probe)
        e.start()
        files, positions = probe.prompt_chunks(1)
        out = e.tier.reserve(files[:1], lambda ks: f"{tmp}/probe.kvp", lambda ks: KEY_BYTES * len(ks),
                             positions) or []
        admitted = sum(len(keys) for _, keys in out)
        e.ledger.close()
    assert admitted > len(chunking.groups) - 1, f"{fixture}: admitted {admitted} keys of a boundary"
    return Setup(fixture, chunking, BOUNDARIES * admitted * KEY_BYTES, RESERVE)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_the_ledger_machine_on_a_real_geometry(fixture: str) -> None:
    setup = real_setup(fixture)
    machine = type(f"LedgerMachine_{fixture.replace('-', '_')}", (LedgerMachine,), {"setup": setup})
    profile = os.environ.get("KVCHUNK_PROFILE", "ci")
    first = len(COUNTERS)
    run_state_machine_as_test(machine, settings=settings(
        settings.get_profile(profile),
        max_examples={"ci": 15, "deep": 200}.get(profile, 5),
        stateful_step_count=25, deadline=None, derandomize=profile != "deep", database=None))
    done = [c.as_dict() for c in COUNTERS[first:]]
    evicted = sum(d["files_evicted"] for d in done)
    reclaimed = sum(d["reservations_reclaimed"] for d in done)
    print(f"\n{fixture}: {len(done)} engines, {evicted} files evicted, {reclaimed} reservations "
          f"reclaimed, {sum(d['keys_not_admitted'] for d in done)} keys not admitted")
    assert evicted > 0 and reclaimed > 0, (
        "the machine never filled the root or crashed a writer (its draws are derandomized "
        "outside deep: a new hypothesis release may draw others; raise max_examples)")


@pytest.mark.parametrize("fixture", FIXTURES)
def test_a_real_geometrys_stores_evict_within_the_budget(fixture: str, tmp_path: Path) -> None:
    """Not vacuous: on the real geometry, two engines' stores of many prompts fill the root,
    evict, and stay within the budget; a store carries several groups' keys."""
    setup = real_setup(fixture)
    a = Engine(tmp_path, "a", setup=setup)
    b = Engine(tmp_path, "b", setup=setup)
    a.start()
    b.start()
    from test_ledger_state_machine import _name_of, _write_whole

    groups_seen = set()
    for prompt in range(8):
        e = (a, b)[prompt % 2]
        files, positions = setup.prompt_chunks(prompt)
        for path, keys in e.tier.reserve(files, lambda ks: str(tmp_path / _name_of(ks)),
                                         lambda ks: KEY_BYTES * len(ks), positions) or []:
            groups_seen.update(k[-4:] for k in keys)
            _write_whole(path, keys)
            e.tier.complete([(path, True)])
        assert root_bytes(tmp_path) <= setup.budget
    evicted = a.ledger.counters.as_dict()["files_evicted"] + b.ledger.counters.as_dict()["files_evicted"]
    assert evicted > 0, "the budget never filled"
    assert len(groups_seen) > 2, "stores carried one or two groups only"
