"""Replay corpus cases into a backend and compare with the answers vLLM gave (no vLLM).

Each case's records are fed, in order, to a fresh planner built by the backend
(:func:`conformance.protocol.replay.replay`, with the case's own policy switches); its
answers -- hit tokens, load jobs, store jobs -- must equal the recorded ones
(:func:`conformance.protocol.replay.recorded_answers`).
"""

from __future__ import annotations

from dataclasses import dataclass

from conformance.corpus.format import CorpusCase
from conformance.protocol.backends import Backend
from conformance.protocol.replay import first_divergence, recorded_answers, replay
from conformance.protocol.trace_format import format_record

_TRACE_LINES = 40
"""Trace lines shown before a divergence (the last ones up to its step)."""


@dataclass(frozen=True)
class CaseResult:
    case: str
    release: str
    answers: int
    failure: str | None


def check_case(case: CorpusCase, backend: Backend) -> CaseResult:
    """Replay one case into ``backend``; the failure names the case and the first call that differs."""
    if backend.planner is None:
        raise ValueError("the corpus replays into a planner: --backend reference or module:object")
    expected = recorded_answers(case.trace)
    where = f"case {case.name!r} (vLLM {case.release})"
    try:
        actual = replay(case.trace, backend.planner, policy=case.policy)
    except Exception as e:  # a backend's crash is a failed case, reported like a divergence
        return CaseResult(case.name, case.release, len(expected),
                          f"{where}: the backend raised {type(e).__name__}: {e}")
    div = first_divergence(expected, actual)
    if div is None:
        return CaseResult(case.name, case.release, len(expected), None)
    first = div.expected or div.actual
    step = first.step if first is not None else 0
    call = f"{first.call}({first.req_id}) at step {step}" if first is not None else "?"
    lines = [
        f"{where}: answer #{div.index}, {call} differs",
        f"  expected (vLLM): {div.expected.describe() if div.expected else '(no answer)'}",
        f"  backend:         {div.actual.describe() if div.actual else '(no answer)'}",
        f"trace up to step {step}:",
    ]
    shown = [line for r in case.trace.records if r.step <= step for line in format_record(r)]
    lines += ["  " + line for line in shown[-_TRACE_LINES:]]
    return CaseResult(case.name, case.release, len(expected), "\n".join(lines))
