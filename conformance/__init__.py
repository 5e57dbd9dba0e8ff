"""kvchunk's conformance suite: vLLM's real offloading path against the reference.

Run it with ``nox -s conformance`` (or ``python -m conformance``).
"""
