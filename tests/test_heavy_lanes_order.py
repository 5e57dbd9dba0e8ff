"""The conformance plugin's order of lanes under ``KVCHUNK_HEAVY_LANES_FIRST``
(``.ci/run`` sets it for one release's chain, so the two chains meet less at the heavy
lanes' machine-wide lock, :mod:`conformance.harness.heavy_lock`)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from conformance import plugin
from conformance.harness.heavy_lock import one_heavy_lane_per_machine


class _Item:
    def __init__(self, module: types.ModuleType, name: str) -> None:
        self.module, self.name = module, name


def _module(name: str, heavy: bool) -> types.ModuleType:
    module = types.ModuleType(name)
    if heavy:
        module.one_heavy_lane_per_machine = one_heavy_lane_per_machine  # type: ignore[attr-defined]
    return module


LIGHT_A, HEAVY_B, LIGHT_C, HEAVY_D = (
    _module("a", False), _module("b", True), _module("c", False), _module("d", True))
ITEMS = [_Item(m, f"{m.__name__}{i}") for m in (LIGHT_A, HEAVY_B, LIGHT_C, HEAVY_D) for i in (1, 2)]


def _order(monkeypatch: pytest.MonkeyPatch, value: str | None) -> list[str]:
    if value is None:
        monkeypatch.delenv(plugin.HEAVY_FIRST_ENV, raising=False)
    else:
        monkeypatch.setenv(plugin.HEAVY_FIRST_ENV, value)
    items: list[Any] = list(ITEMS)
    plugin.pytest_collection_modifyitems(None, items)  # type: ignore[arg-type]
    return [item.name for item in items]


def test_heavy_lanes_first_each_module_whole_and_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _order(monkeypatch, "1") == ["b1", "b2", "d1", "d2", "a1", "a2", "c1", "c2"]


@pytest.mark.parametrize("value", [None, "0", ""])
def test_without_it_pytest_s_order_stays(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    assert _order(monkeypatch, value) == [item.name for item in ITEMS]


def test_the_ci_script_sets_it_for_exactly_one_chain() -> None:
    from pathlib import Path

    script = (Path(__file__).parent.parent / ".ci" / "run").read_text()
    exports = [line for line in script.splitlines() if f"export {plugin.HEAVY_FIRST_ENV}=1" in line]
    assert len(exports) == 1 and '"$v" = "$newest"' in exports[0], exports
