"""kvchunk's conformance suite: vLLM's real offloading path against the reference.

Run it with ``nox -s conformance`` (or ``python -m conformance``).  Layout:

- :mod:`conformance.protocol`: what any backend is judged by: trace records and their
  text format, replay into a backend, the invariants, the per-release rules
  (``versions``), the backends, and the recorded deviations with their repro scripts;
- :mod:`conformance.harness`: how vLLM's real path is driven: the driver, the synthetic
  model runner and byte check (``kvdata``; its byte pattern ``kv_pattern``, KV memory
  ``kv_memory``, stats ``kv_stats``), file tiers and their faults, the GPU copy
  differential, e2e configurations, and the case tables and strategies the lanes draw;
- :mod:`conformance.checks`: the checks, one function each, shared by the lanes and the
  meta lane;
- :mod:`conformance.lanes`: thin pytest wrappers, one file per lane;
- :mod:`conformance.meta`: mutants and the mutation run that scores the checks;
- :mod:`conformance.corpus`: the golden corpus (JSON Lines) that needs no vLLM;
- :mod:`conformance.bench`: throughput benchmarks (``nox -s bench``);
- :mod:`conformance.testing`: deliberately broken parts shipped for spec authors;
- ``plugin`` (pytest options), ``report`` (the Markdown report), ``__main__``.
"""
