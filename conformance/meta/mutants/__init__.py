"""Every deliberately broken part the suite must catch, in one place (meta lane).

- :mod:`conformance.meta.mutants.planner`: wrong planners, usable as
  ``--backend conformance.meta.mutants.planner:NAME``.
- :mod:`conformance.meta.mutants.worker`: broken transfer workers
  (:func:`~conformance.meta.mutants.worker.install_mutation`: a lost store reported
  done, flushes not waited for, loads reported before they are copied) that the
  faults lane's checks must catch.  Not imported here: it needs vLLM.
- :mod:`conformance.meta.mutants.vllm_side`: one-line faults in vLLM's own offloading
  config, scheduler, CPU tier and worker, monkeypatched in process (mutation score).
- :mod:`conformance.meta.mutants.rules`: one-line faults in the reference's rules
  (every rule of ``docs/semantics.md`` section 8, keys, knobs, the fast path's slot
  layout) and in the byte-layout spec (``reference.transfer``).
- :mod:`conformance.meta.mutants.source`: the one-line-edit machinery both use
  (:class:`~conformance.meta.mutants.source.Mutant`); :mod:`conformance.meta.mutation` scores them
  with the checks :mod:`conformance.meta.mutants.catalogue` lists (the lanes' own, from
  :mod:`conformance.checks`); :mod:`conformance.meta.mutants.records` keeps the results.
"""

from __future__ import annotations

from conformance.meta.mutants.planner import MUTANTS

__all__ = ["MUTANTS"]
