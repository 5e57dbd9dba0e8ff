"""Every deliberately broken part the suite must catch, in one place (meta lane).

- :mod:`conformance.mutants.planner`: wrong planners, usable as
  ``--backend conformance.mutants.planner:NAME``.
"""

from __future__ import annotations

from conformance.mutants.planner import MUTANTS

__all__ = ["MUTANTS"]
