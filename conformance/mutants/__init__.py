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
  (window, storable and needed chunks, hit limit, keys, slot layout).
- :mod:`conformance.mutants.source`: the one-line-edit machinery both use
  (:class:`~conformance.mutants.source.Mutant`); :mod:`conformance.mutation` scores them.
"""

from __future__ import annotations

from conformance.mutants.planner import MUTANTS

__all__ = ["MUTANTS"]
