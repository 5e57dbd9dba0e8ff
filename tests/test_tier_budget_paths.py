"""The tier's paths relative to its root (:meth:`~vllm_adapter.disk.tier_budget.TierBudget._rel`).

A start converts every listed file's path (once per file), so the conversion slices the
root's prefix off instead of calling :func:`os.path.relpath` whenever the part below the
root holds no "." or ".." component; a root under a hidden directory (``~/.cache/...``,
the budget bench's ``.kvchunk-bench-*``) takes the same fast path.  Either way the result
is :func:`os.path.relpath`'s.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_ledger_state_machine import CHUNKING, NS, Engine, _data_files, _store  # noqa: I001

from reference.eviction import EvictionRule
from vllm_adapter.disk.tier_budget import TierBudget


def _tier(root: Path) -> TierBudget:
    root.mkdir(parents=True)
    return TierBudget(str(root), str(root / NS), 1 << 30, EvictionRule.REACHABLE, CHUNKING)


@pytest.mark.parametrize("below", [f"{NS}/packed/ab/cd.kvp", f"{NS}/x.kvp.1.tmp"])
def test_a_root_under_a_hidden_directory_is_sliced_not_resolved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, below: str) -> None:
    tier = _tier(tmp_path / ".hidden" / "root")
    path = os.path.join(tier.root, below)
    expected = os.path.relpath(path, tier.root)

    def refused(*args: object) -> str:
        raise AssertionError("relpath called for a plain path under the root")

    monkeypatch.setattr(os.path, "relpath", refused)
    assert tier._rel(path) == expected


@pytest.mark.parametrize("below", [f"{NS}/../{NS}/a.kvp", f"{NS}/./a.kvp", f"./{NS}/a.kvp",
                                   f"{NS}/.a.kvp"])
def test_a_dotted_path_below_the_root_is_resolved(tmp_path: Path, below: str) -> None:
    tier = _tier(tmp_path / ".hidden" / "root")
    path = os.path.join(tier.root, below)
    assert tier._rel(path) == os.path.relpath(path, tier.root)


def test_a_path_outside_the_root_is_resolved(tmp_path: Path) -> None:
    tier = _tier(tmp_path / "root")
    path = str(tmp_path / "other" / "a.kvp")
    assert tier._rel(path) == os.path.relpath(path, tier.root)


def test_held_is_a_starts_listing_less_what_the_start_and_other_engines_removed(
        tmp_path: Path) -> None:
    """A tier lists its namespace once at start (:func:`vllm_adapter.disk.tier.namespace_files`)
    and indexes that listing less what :meth:`TierBudget.held` says the ledger no longer
    holds: the orphan its start removed, and a file another engine removed since."""
    a = Engine(tmp_path, "a")
    a.start()
    (kept,) = _store(a, 1)
    a.tier.complete([(kept, True)])
    (other,) = _store(a, 2)
    a.tier.complete([(other, True)])
    orphan = tmp_path / NS / "orphan.kvp"
    orphan.write_bytes(b"\0" * 10)
    listing = [str(p) for p in _data_files(tmp_path)]
    assert sorted(listing) == sorted([kept, other, str(orphan)])
    b = Engine(tmp_path, "b")
    assert b.tier.start(listing)["orphans"] == 1 and not orphan.exists()
    assert sorted(b.tier.held(listing)) == sorted([kept, other])
    a.tier.forget([other])
    assert b.tier.held(listing) == [kept]
