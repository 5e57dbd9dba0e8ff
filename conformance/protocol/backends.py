"""Backends under test, selected with ``--backend``.

``vllm`` (default)  the installed vLLM's real ``OffloadingConnector`` (0.33.0,
                    0.34.0, or an unreleased build under ``--vllm-rules``): its
                    recorded answers are compared against the reference replayed
                    on the same inputs.
``reference``       the reference driving itself (self-check of the harness).
``module:object``   any object following ``conformance/PROTOCOL.md``: a
                    :class:`Backend`, or a planner factory
                    ``(chunking, store, policy) -> planner``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from conformance.protocol.replay import PlannerFactory, reference_planner


@dataclass(frozen=True)
class Backend:
    name: str
    planner: PlannerFactory | None
    """None: the implementation under test is vLLM's own connector (recorded answers)."""


VLLM = Backend("vllm", None)
REFERENCE = Backend("reference", reference_planner)


def load_backend(spec: str) -> Backend:
    if spec == "vllm":
        return VLLM
    if spec == "reference":
        return REFERENCE
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise ValueError(f"--backend must be 'vllm', 'reference' or 'module:object', got {spec!r}")
    obj = getattr(importlib.import_module(module_name), attr)
    if isinstance(obj, Backend):
        return obj
    if callable(obj):
        return Backend(spec, obj)
    raise ValueError(f"--backend {spec!r}: {obj!r} is neither a Backend nor a planner factory")
