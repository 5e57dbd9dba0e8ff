"""The lanes' checks, stated once: the lanes (thin pytest wrappers) and the meta lane's
mutation score (:mod:`conformance.meta.mutation`) call the same functions.

- :mod:`conformance.checks.config`: vLLM's config path against the reference (needs vLLM);
- :mod:`conformance.checks.plan`: recorded answers against the reference's replay, the
  tier's capacity and evictions;
- :mod:`conformance.checks.data`: real bytes through vLLM's offloading path (needs vLLM);
- :mod:`conformance.checks.invariants`: the planner invariants on both sides.

A check returns normally when it holds and raises :class:`CheckFailed` (an
``AssertionError``) saying exactly what differed when it does not.  Any other
exception out of a check is a crash, not a finding: the mutation score counts
only assertion failures (:func:`conformance.meta.mutation.classify`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckFailed", "expect", "expect_equal"]


class CheckFailed(AssertionError):
    """A check's finding: the message says what differed (both sides where there are two)."""


def expect(holds: bool, finding: str) -> None:
    """Raise :class:`CheckFailed` with ``finding`` unless ``holds``."""
    if not holds:
        raise CheckFailed(finding)


def expect_equal(what: str, got: Any, want: Any) -> None:
    """``got == want``, else :class:`CheckFailed` naming ``what`` and both values."""
    if got != want:
        raise CheckFailed(f"{what}: got {got!r}, want {want!r}")
