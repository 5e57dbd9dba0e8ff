"""Generate the corpus: run every case on the installed vLLM (needs vLLM).

Deterministic: the workloads are fixed, the driver's model and worker are, and
:func:`generate_text` refuses to run unless ``PYTHONHASHSEED`` is ``0`` (vLLM
iterates sets of request ids, so store jobs of requests finishing in one step
come out in string-hash order; and ``PYTHONHASHSEED`` seeds vLLM's block
hashes).  ``python -m conformance.corpus generate`` re-runs itself with it.
"""

from __future__ import annotations

import os
from typing import Any

from conformance.corpus.cases import SPECS, CorpusSpec
from conformance.corpus.coverage import covers
from conformance.corpus.format import CorpusCase, dumps_corpus
from conformance.protocol.replay import first_divergence, policy_of, recorded_answers, replay

HASH_SEED = "0"


class CorpusGenerationError(RuntimeError):
    """vLLM and the reference disagree on a case (it cannot be a golden case)."""


def installed_release() -> str:
    from conformance.harness import vllm_harness_api as V

    return V.VLLM_VERSION


def _driver(spec: CorpusSpec) -> Any:
    from conformance.harness import driver as D
    kvc = getattr(D, spec.builder)(*spec.builder_args, num_blocks=spec.num_gpu_blocks)
    return D.VllmDriver.from_kv_cache_config(
        kvc,
        extra_config=dict(spec.knob + spec.other_extra),
        prefix_cache_retention_interval=spec.retention,
        num_gpu_blocks=spec.num_gpu_blocks,
        num_cpu_chunks=spec.num_cpu_chunks,
        kv_load_failure_policy=spec.kv_load_failure_policy,
    )


def generate_case(spec: CorpusSpec, release: str) -> CorpusCase:
    """Run one case on vLLM; the reference must answer every call as vLLM did."""
    trace = _driver(spec).run(spec.workload)
    policy = policy_of(trace.config)
    div = first_divergence(recorded_answers(trace), replay(trace, policy=policy))
    if div is not None:
        raise CorpusGenerationError(f"{spec.name} on vLLM {release}: {div.explain(trace)}")
    return CorpusCase(
        name=spec.name,
        release=release,
        description=spec.description,
        knob=spec.knob,
        policy=policy,
        covers=covers(trace),
        trace=trace,
    )


def generate_text(release: str | None = None) -> str:
    """The corpus file of the installed vLLM release, as text."""
    if os.environ.get("PYTHONHASHSEED") != HASH_SEED:
        raise CorpusGenerationError(
            f"generate with PYTHONHASHSEED={HASH_SEED} (python -m conformance.corpus sets it)"
        )
    release = release or installed_release()
    return dumps_corpus(generate_case(spec, release) for spec in SPECS)
