"""``--spec module:Class``: the offloading spec the byte-level lanes (data, tiered, faults) run.

:class:`SpecUnderTest` is the parsed option.  The pytest plugin stores the choice in
``$KVCHUNK_SPEC`` (:data:`SPEC_ENV`), so :func:`chosen` answers the same in the lanes,
in ``python -m conformance`` and in subprocess harnesses.  Without the option the
lanes run kvchunk's reference specs (``vllm_adapter.spec.ReferenceOffloadingSpec``,
``vllm_adapter.tiering.ReferenceTieringOffloadingSpec``).

A spec whose worker is vLLM's own (a subclass of vLLM's ``CPUOffloadingSpec`` or
``TieringOffloadingSpec`` with none of kvchunk's reference specs in its MRO) needs
CUDA: vLLM's worker refuses other platforms, so without CUDA the byte lanes skip
it with :meth:`SpecUnderTest.cuda_reason`.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest

SPEC_ENV = "KVCHUNK_SPEC"
"""Where the plugin puts ``--spec`` (``module:Class``) for every process of the run."""

EXAMPLE = "vllm_adapter.spec:ReferenceOffloadingSpec"

CPU_TIER_SIZES = ("cpu_bytes_to_use", "num_cpu_chunks")
"""The extra-config keys that size the CPU tier.  The driver sets them from the lane's chunk
count (:func:`conformance.harness.driver.vllm_config.takes_chunk_count` says which a spec takes),
so a spec chosen with ``--spec`` gets its CPU tier sized for it, in bytes for vLLM's own."""

__all__ = [
    "EXAMPLE",
    "SPEC_ENV",
    "SpecUnderTest",
    "chosen",
    "data_lane_entries",
    "header_line",
    "runner_device",
    "tiered_entries",
    "tiered_lane_entries",
]


def _usage(value: str, why: str) -> ValueError:
    return ValueError(f"--spec {value!r}: {why}; give module:Class, e.g. --spec {EXAMPLE}")


@dataclass(frozen=True)
class SpecUnderTest:
    """An ``OffloadingSpec`` class named by module path and class name."""

    module: str
    name: str

    @classmethod
    def parse(cls, value: str) -> SpecUnderTest:
        """``"module:Class"``; anything else is a ``ValueError`` naming ``--spec``."""
        module, sep, name = value.strip().partition(":")
        if not sep or not module or not name or ":" in name:
            raise _usage(value, "expected exactly one ':' between a module and a class")
        if not all(part.isidentifier() for part in module.split(".")):
            raise _usage(value, f"{module!r} is not a dotted module path")
        if not name.isidentifier():
            raise _usage(value, f"{name!r} is not a class name")
        return cls(module, name)

    def __str__(self) -> str:
        return f"{self.module}:{self.name}"

    @property
    def id(self) -> str:
        """The test-id form, ``spec-<Class>``."""
        return f"spec-{self.name}"

    def entries(self) -> dict[str, str]:
        """The ``kv_connector_extra_config`` entries that select the spec."""
        return {"spec_name": self.name, "spec_module_path": self.module}

    def load(self) -> type:
        """The class; a ``ValueError`` naming ``--spec`` when it cannot be imported."""
        try:
            module = importlib.import_module(self.module)
        except ImportError as err:
            raise _usage(str(self), f"cannot import {self.module!r} ({err})") from None
        cls = getattr(module, self.name, None)
        if not isinstance(cls, type):
            raise _usage(str(self), f"{self.module!r} has no class {self.name!r}")
        from conformance.harness import vllm_harness_api as V

        if not issubclass(cls, V.OffloadingSpec):
            raise _usage(str(self), f"{self.name} is not a subclass of vLLM's OffloadingSpec")
        return cls

    @property
    def is_tiering(self) -> bool:
        """A subclass of vLLM's ``TieringOffloadingSpec`` (has secondary tiers, e.g. files)."""
        from conformance.harness import vllm_harness_api as V

        return issubclass(self.load(), V.TieringOffloadingSpec)

    def is_a(self, module: str, name: str) -> bool:
        """Whether ``module.name`` is in the spec's MRO (a subclass, or the class itself)."""
        return any(
            c.__module__ == module and c.__name__ == name for c in self.load().__mro__
        )

    @property
    def uses_vllm_worker(self) -> bool:
        """A subclass of vLLM's ``CPUOffloadingSpec`` or ``TieringOffloadingSpec`` with none of
        kvchunk's reference specs in its MRO: its worker is vLLM's CUDA-only one."""
        from conformance.harness import vllm_harness_api as V
        from conformance.harness.driver.vllm_config import is_kvchunk_spec

        cls = self.load()
        return issubclass(cls, V.CPUOffloadingSpec | V.TieringOffloadingSpec) and not (
            is_kvchunk_spec(cls)
        )

    @property
    def takes_chunk_count(self) -> bool:
        """Whether the spec sizes its CPU tier by ``num_cpu_chunks`` (kvchunk's) rather than in
        bytes only (vLLM's, a third party's)."""
        from conformance.harness.driver.vllm_config import is_kvchunk_spec

        return is_kvchunk_spec(self.load())

    def cuda_reason(self) -> str | None:
        """Why the byte lanes cannot run the spec here (its worker is vLLM's CUDA-only one and
        CUDA is absent), else ``None``."""
        import torch

        if not self.uses_vllm_worker or torch.cuda.is_available():
            return None
        return (
            f"--spec {self}: its worker is vLLM's CPUOffloadingWorker, which needs CUDA "
            "(torch.cuda.is_available() is False)"
        )


def chosen() -> SpecUnderTest | None:
    """The spec chosen with ``--spec`` (``$KVCHUNK_SPEC``), or ``None``."""
    value = os.environ.get(SPEC_ENV, "").strip()
    return SpecUnderTest.parse(value) if value else None


def header_line() -> str | None:
    """The report's one line on the spec the byte lanes ran, when ``--spec`` chose one."""
    spec = chosen()
    if spec is None:
        return None
    return (
        f"Byte lanes (data, tiered, faults) use --spec {spec} "
        "instead of kvchunk's reference specs"
    )


def runner_device() -> str:
    """Where the synthetic model runner keeps the KV cache for the chosen spec: ``cuda`` when
    its worker is vLLM's CUDA-only one, else ``cpu``."""
    spec = chosen()
    return "cuda" if spec is not None and spec.uses_vllm_worker else "cpu"


def data_lane_entries(default: Mapping[str, Any]) -> dict[str, Any]:
    """The spec entries the data lane runs: the chosen spec's, else ``default``.  Skips the
    calling test when the chosen spec cannot run here (:meth:`SpecUnderTest.cuda_reason`)."""
    spec = chosen()
    if spec is None:
        return dict(default)
    _skip_without_cuda(spec)
    return spec.entries()


def tiered_lane_entries(harness: Mapping[str, Any]) -> dict[str, Any]:
    """The tiered lanes' spec entries: ``harness`` (its tier config: ``secondary_tiers``, CPU
    tier size) with the chosen spec's name and module, if any.  Skips the calling test when
    the chosen spec is not a tiering spec or cannot run here."""
    spec = chosen()
    if spec is None:
        return dict(harness)
    if not spec.is_tiering:
        pytest.skip(f"--spec {spec} is not a tiering spec: the tiered lanes need a file tier")
    _skip_without_cuda(spec)
    return tiered_entries(harness, spec)


def tiered_entries(harness: Mapping[str, Any], spec: SpecUnderTest) -> dict[str, Any]:
    """``harness`` with ``spec``'s name and module.  The harness's CPU-tier sizes are for
    kvchunk's specs; for a spec sized in bytes only they are dropped, so the driver sizes
    its CPU tier for it (:func:`~conformance.harness.driver.vllm_config.takes_chunk_count`)."""
    entries = {**harness, **spec.entries()}
    if not spec.takes_chunk_count:
        for key in CPU_TIER_SIZES:
            entries.pop(key, None)
    return entries


def _skip_without_cuda(spec: SpecUnderTest) -> None:
    reason = spec.cuda_reason()
    if reason is not None:
        pytest.skip(reason)
