"""Every deliberately broken part the suite must catch, in one place (meta lane).

- :mod:`conformance.mutants.planner`: wrong planners, usable as
  ``--backend conformance.mutants.planner:NAME``.
- :mod:`conformance.mutants.worker`: broken transfer workers
  (:func:`~conformance.mutants.worker.install_mutation`: a lost store reported
  done, flushes not waited for, loads reported before they are copied) that the
  faults lane's checks must catch.  Not imported here: it needs vLLM.
- :mod:`conformance.mutants.vllm_side`: one-line faults in vLLM's own offloading
  config, scheduler, CPU tier and worker, monkeypatched in process (mutation score).
- :mod:`conformance.mutants.rules`: one-line faults in the reference's rules
  (every rule of ``docs/semantics.md`` section 8, keys, knobs, the fast path's slot
  layout) and in the byte-layout spec (``reference.transfer``).
- :mod:`conformance.mutants.source`: the one-line-edit machinery both use
  (:class:`~conformance.mutants.source.Mutant`); :mod:`conformance.mutation` scores them
  with the checks :mod:`conformance.mutants.catalogue` lists (the lanes' own, from
  :mod:`conformance.checks`); :mod:`conformance.mutants.records` keeps the results.
"""

from __future__ import annotations

from conformance.mutants.planner import MUTANTS

__all__ = ["MUTANTS"]
