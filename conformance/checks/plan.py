"""Plan lane checks: vLLM's recorded scheduler answers against the reference's replay,
and the CPU tier's capacity accounting.

Each raises :class:`~conformance.checks.CheckFailed` with the first difference (the
trace up to the diverging step, for answers).
"""

from __future__ import annotations

from dataclasses import replace

from conformance.checks import CheckFailed, expect
from conformance.harness.workloads import PlanCase, driver_for
from conformance.protocol import trace as T
from conformance.protocol.replay import (
    Answer,
    Divergence,
    PlannerFactory,
    first_divergence,
    recorded_answers,
    replay,
)

__all__ = ["answers_agree", "eviction_problem", "exercised_both_directions",
           "full_tier_evicts_what_capacity_requires", "tier_holds_what_it_was_sized_for"]


def answers_agree(trace: T.Trace, planner: PlannerFactory | None = None) -> list[Answer]:
    """The reference's replay of ``trace`` equals vLLM's recorded answers (or ``planner``'s
    replay, for a plugged-in backend), call by call; returns the reference's answers.

    A replay that cannot go on (the trace reports, say, the completion of a store job
    the reference never made) is a finding when the answers before that point already
    differ: the first divergence is reported, with the error it led to.
    """
    try:
        expected = replay(trace)
    except Exception as err:
        div = _divergence_before(trace, planner)
        if div is None:
            raise
        raise CheckFailed(f"{div.explain(trace)}\n(the reference's replay then raised "
                          f"{type(err).__name__}: {err})") from err
    div = first_divergence(expected, _actual(trace, planner))
    if div is not None:
        raise CheckFailed(div.explain(trace))
    return expected


def _actual(trace: T.Trace, planner: PlannerFactory | None) -> list[Answer]:
    return recorded_answers(trace) if planner is None else replay(trace, planner)


def _divergence_before(trace: T.Trace, planner: PlannerFactory | None) -> Divergence | None:
    """The first divergence within the longest prefix of ``trace`` the reference replays."""
    good, bad = 0, len(trace.records)
    while bad - good > 1:  # replay(prefix of length good) runs; of length bad raises
        mid = (good + bad) // 2
        try:
            replay(replace(trace, records=trace.records[:mid]))
            good = mid
        except Exception:
            bad = mid
    prefix = replace(trace, records=trace.records[:good])
    return first_divergence(replay(prefix), _actual(prefix, planner))


def exercised_both_directions(case: object, counts: dict[str, int]) -> None:
    """Non-vacuity: the workloads stored and loaded at least once on this case."""
    expect(counts["stores"] > 0 and counts["loads"] > 0,
           f"{case}: the workloads did not exercise both directions: {counts}")


def tier_holds_what_it_was_sized_for(case: PlanCase) -> None:
    """vLLM's CPU tier holds exactly the chunks the case sized it for.

    The driver sizes ``cpu_bytes_to_use`` as ``num_cpu_chunks`` times the bytes
    vLLM's own spec says one chunk takes, and the reference store holds one key
    per slot: so vLLM's manager must hold exactly ``num_cpu_chunks`` keys.
    Replays take capacity from the trace, so this is the check that sees it.
    Fixture cases size the tier themselves (4096 chunks): nothing to compare.
    """
    if case.builder == "fixture":
        return
    held = driver_for(case).session().connector_scheduler.manager._num_chunks
    expect(held == case.num_cpu_chunks,
           f"{case}: the tier holds {held} chunks, sized for {case.num_cpu_chunks}")


def eviction_problem(trace: T.Trace) -> str | None:
    """Where vLLM's tier evicted other than exactly what a full tier must make room for.

    Replays take *which* keys a full tier evicts from the trace (an eviction
    policy, not chunk semantics), but *how many* is capacity accounting: a store
    of ``n`` new keys into a tier of ``C`` slots holding ``h`` evicts
    ``max(0, h + n - C)`` keys.
    """
    capacity, held = trace.config.num_cpu_chunks, set[bytes]()
    for r in trace.records:
        if isinstance(r, T.ResetPrefixCache) and r.connector_reset:
            held.clear()
        if not isinstance(r, T.BuildMeta):
            continue
        for offer in r.store_offers:
            if offer.accepted is None:
                continue
            new = set(offer.accepted) - held
            due = max(0, len(held) + len(new) - capacity)
            if len(offer.evicted) != due:
                return (f"[step {r.step}] {offer.req_id}: {len(new)} new keys into {len(held)} "
                        f"held of {capacity}: evicted {len(offer.evicted)}, due {due}")
            held = (held - set(offer.evicted)) | set(offer.accepted)
    return None


def full_tier_evicts_what_capacity_requires(trace: T.Trace) -> None:
    problem = eviction_problem(trace)
    expect(problem is None, str(problem))
