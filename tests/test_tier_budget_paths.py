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
from test_ledger_state_machine import CHUNKING, NS  # noqa: I001

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
