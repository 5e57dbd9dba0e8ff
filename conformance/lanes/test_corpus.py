"""Plan lane, golden corpus: the committed corpus is what the installed vLLM generates,
and the backend under test answers every case as vLLM did.

``python -m conformance.corpus check`` regenerates the installed release's corpus
(a fresh process: it needs ``PYTHONHASHSEED=0``) and compares it byte for byte
with ``conformance/corpus/data/vllm-<release>.jsonl``.  A release with no
committed corpus (a development build) is skipped with the command that makes one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conformance.corpus.format import data_path, read_corpus
from conformance.corpus.generate import HASH_SEED
from conformance.corpus.run import check_case
from conformance.harness import vllm_harness_api as V
from conformance.protocol.backends import Backend
from conformance.protocol.replay import reference_planner

pytestmark = pytest.mark.plan

ROOT = Path(__file__).resolve().parents[2]


def _committed() -> Path:
    path = data_path(V.VLLM_VERSION)
    if not path.exists():
        pytest.skip(f"no golden corpus for vLLM {V.VLLM_VERSION}: python -m conformance.corpus generate")
    return path


def test_committed_corpus_equals_a_fresh_generation(record_property) -> None:  # type: ignore[no-untyped-def]
    _committed()
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "conformance.corpus", "check"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONHASHSEED": HASH_SEED},  # else the command starts itself again
    )
    record_property("corpus_check_seconds", round(time.perf_counter() - start, 1))
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_backend_answers_every_corpus_case(backend: Backend, record_property) -> None:  # type: ignore[no-untyped-def]
    """The corpus holds vLLM's answers: with ``--backend vllm`` the reference replays it."""
    planner = backend.planner or reference_planner
    cases = read_corpus(_committed())
    results = [check_case(c, Backend(backend.name, planner)) for c in cases]
    record_property("counter:corpus_cases", len(results))
    record_property("counter:corpus_answers_compared", sum(r.answers for r in results))
    failures = [r.failure for r in results if r.failure is not None]
    assert cases and not failures, "\n\n".join(failures[:3])
