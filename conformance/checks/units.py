"""The unit-test module's checks: ``tests/test_rules.py``'s tests (direct rule tables and
the planner-against-rules properties) as callables, properties drawn derandomized.

The meta lane runs them as checks of the declarative core (the rules the lanes reach
only through the planner are stated there).  Discovered, not listed: every
``test_*`` function of the module that takes no argument, in source order, so a
renamed test is still run.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType

from conformance.harness.strategies import SLOW_EXAMPLE_CHECKS

__all__ = ["PROPERTY_EXAMPLES", "unit_tests"]

PROPERTY_EXAMPLES = 150
"""Examples per property (derandomized: the same draws on every run)."""


@cache
def _module(name: str) -> ModuleType:
    path = Path(__file__).resolve().parents[2] / "tests" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_kvchunk_unit_{name}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def unit_tests(module: str = "test_rules") -> tuple[tuple[str, Callable[[], None]], ...]:
    """``(name, run)`` for each argument-free test of ``tests/<module>.py``; hypothesis
    properties get derandomized settings once (hypothesis refuses twice)."""
    from hypothesis import Phase, settings

    found: list[tuple[int, str, Callable[[], None]]] = []
    for name, test in vars(_module(module)).items():
        if not name.startswith("test_") or not callable(test):
            continue
        if inspect.signature(test).parameters:
            continue  # pytest fixtures or parameters: not runnable on its own
        if hasattr(test, "hypothesis"):
            # No shrinking: a failing example is a finding as drawn (shrinking costs ~30 s).
            test = settings(max_examples=PROPERTY_EXAMPLES, derandomize=True, database=None,
                            phases=[Phase.explicit, Phase.generate],
                            suppress_health_check=SLOW_EXAMPLE_CHECKS, deadline=None)(test)
        line = inspect.getsourcelines(inspect.unwrap(test))[1]
        found.append((line, name, test))
    return tuple((name, test) for _, name, test in sorted(found, key=lambda row: row[0]))
