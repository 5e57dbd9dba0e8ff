"""What changed between vLLM releases: each :data:`conformance.protocol.versions.CHANGES` case, measured.

Every case runs its minimal workload through the installed vLLM's real
scheduler and connector and records vLLM's answer.  Three things must hold:

* the installed release's rules (``conformance.protocol.versions.rules_for``) replay the
  trace exactly (the plan lane's comparison, on this one trace);
* the case *separates* the releases' rules: replaying the same trace under the
  other release's switch gives a different answer (so the case is minimal and
  not vacuous);
* the answer is recorded (``version_answer``); ``python -m conformance`` puts the
  answers of every release that ran into the report's "What changed" section.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

import pytest

from conformance.testing.requires import require_vllm

require_vllm()

from conformance.harness import driver as D  # noqa: E402
from conformance.harness import vllm_harness_api as V  # noqa: E402
from conformance.protocol import trace as T  # noqa: E402
from conformance.protocol.replay import Answer, first_divergence, recorded_answers, replay  # noqa: E402
from conformance.protocol.versions import CHANGES, RELEASES, rules_for, rules_line  # noqa: E402
from reference.plan import LastTokenRule, NullBlockRule, Planner, Policy, WindowRule  # noqa: E402

pytestmark = pytest.mark.versions

PROMPT_200 = tuple(range(1000, 1200))


def _replay_with(trace: T.Trace, **switches: object) -> list[Answer]:
    def factory(chunking, store, policy):  # type: ignore[no-untyped-def]
        return Planner(chunking, store, replace(policy, **switches))

    return replay(trace, factory)


def _exact(trace: T.Trace) -> None:
    div = first_divergence(replay(trace), recorded_answers(trace))
    assert div is None, div.explain(trace)


def _first(answers: list[Answer], call: str, req_id: str) -> object:
    return next(a.value for a in answers if a.call == call and a.req_id == req_id)


# -- the cases ------------------------------------------------------------------


def last_token_cap() -> tuple[str, bool | None]:
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_swa_kv_cache_config(64, 16, 128),
        extra_config={"blocks_per_chunk": 1},
        prefix_cache_retention_interval=None,  # dense: every window chunk is stored
    )
    s = driver.session()
    s.add_request(T.RequestSpec("A", PROMPT_200, max_tokens=1))
    s.run_until_idle()
    assert s.reset_prefix_cache()  # GPU only: the CPU tier keeps A's chunks
    s.add_request(
        T.RequestSpec("B", PROMPT_200, max_tokens=1, kv_transfer_params=(("max_load_tokens", 64),))
    )
    s.run_until_idle()
    trace = s.trace()
    _exact(trace)
    hit = trace.lookups("B")[0].hit_tokens
    after = _first(_replay_with(trace, last_token=LastTokenRule.AFTER_CAPS), "lookup", "B")
    end = _first(_replay_with(trace, last_token=LastTokenRule.REQUEST_END), "lookup", "B")
    return f"B (200-token prompt, max_load_tokens 64) hits {hit} tokens", after != end


def null_blocks_in_store_jobs() -> tuple[str, bool | None]:
    """A store that could not allocate (8 CPU chunks) is retried steps later, by which
    time the 40-token window has freed the first block of some chunk."""
    rng = random.Random(0)
    p = tuple(rng.randrange(100, 30000) for _ in range(600))
    q = p[:300] + tuple(rng.randrange(100, 30000) for _ in range(300))
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_swa_kv_cache_config(64, 16, 40, num_blocks=160),
        extra_config={"blocks_per_chunk": 2},
        prefix_cache_retention_interval=None,
        num_gpu_blocks=160,
        num_cpu_chunks=8,
        max_num_batched_tokens=64,
    )
    trace = driver.run(
        T.WorkloadSpec(
            requests=(T.RequestSpec("a", p, max_tokens=3), T.RequestSpec("b", q, max_tokens=3))
        )
    )
    _exact(trace)
    jobs = [j.job for r in trace.of_type(T.BuildMeta) for j in r.store_jobs]
    nulls = sum(1 for j in jobs if 0 in j.block_ids)
    skip = _replay_with(trace, null_blocks_in_store=NullBlockRule.SKIP)
    keep = _replay_with(trace, null_blocks_in_store=NullBlockRule.PLACEHOLDER)
    answer = f"{len(jobs)} store jobs, {nulls} with a null block (id 0) in the job"
    return answer, [a for a in skip if a.call == "step"] != [a for a in keep if a.call == "step"]


def failed_load_retry() -> tuple[str, bool | None]:
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_swa_kv_cache_config(),
        extra_config={"blocks_per_chunk": 2},
        kv_load_failure_policy="recompute",
    )
    spec = T.WorkloadSpec(
        requests=(
            T.RequestSpec("A", PROMPT_200, max_tokens=1),
            T.RequestSpec("B", PROMPT_200, max_tokens=1, arrival_step=6),
        ),
        resets=(T.ResetSpec(5),),
        faults=(T.JobFault(1, fail=True),),
    )
    trace = driver.run(spec)
    _exact(trace)
    loads = trace.load_jobs("B")
    hits = [lk.hit_tokens for lk in trace.lookups("B")]
    retry = _replay_with(trace, reload_after_failed_load=True)
    no_retry = _replay_with(trace, reload_after_failed_load=False)
    lookups = [a.value for a in retry if a.call == "lookup" and a.req_id == "B"]
    lookups_no = [a.value for a in no_retry if a.call == "lookup" and a.req_id == "B"]
    return (
        f"B's load fails; B's lookups hit {hits}, {len(loads)} load job(s)",
        lookups != lookups_no,
    )


def failed_store_reported() -> tuple[str, bool | None]:
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_attention_kv_cache_config(), extra_config={"blocks_per_chunk": 4}
    )
    s = driver.session()
    assert s.engine is not None
    s.engine._succeeds = lambda job_id: job_id != 0  # type: ignore[method-assign]
    s.add_request(T.RequestSpec("A", tuple(range(1000, 1100)), max_tokens=1))
    try:
        s.run_until_idle()
    except AssertionError:
        answer = "the worker half raises a bare AssertionError (TransferResult.success asserted)"
        return answer, _as_stated("failed-store-reported", "raises")
    trace = s.trace()
    done = [d.success for r in trace.of_type(T.JobsDone) for d in r.done if d.job_id == 0]
    behaviour = "reported failed" if done == [False] else f"reported {done}"
    return (f"store job 0 reported done with success={done}",
            _as_stated("failed-store-reported", behaviour))


def connector_reset_twice() -> tuple[str, bool | None]:
    # The faults lane's test_vllm_connector_reset_twice_between_steps, measured.
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_attention_kv_cache_config(), extra_config={"blocks_per_chunk": 2}
    )
    s = driver.session(default_delay_steps=3)
    s.add_request(T.RequestSpec("A", tuple(range(1000, 1300)), max_tokens=5))
    s.step()
    s.step()
    assert s.connector_scheduler._jobs  # a store job in flight
    try:
        s.reset_prefix_cache(reset_connector=True)
        s.reset_prefix_cache(reset_connector=True)
        s.run_until_idle()
    except AssertionError as e:
        return (f"AssertionError: {str(e) or '(bare assert)'}",
                _as_stated("connector-reset-twice", "raises"))
    return "both resets succeed", _as_stated("connector-reset-twice", "succeeds")


BEHAVIOUR: dict[str, dict[str, str]] = {
    "failed-store-reported": {"0.33.0": "raises", "0.34.0": "reported failed"},
    "connector-reset-twice": {"0.33.0": "raises", "0.34.0": "succeeds"},
}
"""Changes no policy switch replays (the worker or the reset path itself differs): what
each release does, as :data:`conformance.protocol.versions.CHANGES` states it."""


def _as_stated(change_id: str, observed: str) -> bool:
    """The case separates the releases: the installed release's rules behave as stated
    for that release, and the other releases are stated to behave otherwise."""
    stated = BEHAVIOUR[change_id]
    release = rules_for(V.VLLM_VERSION).release
    others = {b for r, b in stated.items() if r != release}
    return observed == stated.get(release) and observed not in others


CASES: dict[str, Callable[[], tuple[str, bool | None]]] = {
    "last-token-cap": last_token_cap,
    "null-blocks-in-store-jobs": null_blocks_in_store_jobs,
    "failed-load-retry": failed_load_retry,
    "failed-store-reported": failed_store_reported,
    "connector-reset-twice": connector_reset_twice,
}


def test_every_change_has_a_case() -> None:
    assert sorted(CASES) == sorted(c.id for c in CHANGES)
    # A build with no row of its own (dev, rc, post, newer) runs a known row's rules, and says so.
    rules = rules_for(V.VLLM_VERSION)
    assert rules.release in RELEASES, rules
    assert rules.known or rules.release in (rules_line(V.VLLM_VERSION) or ""), (
        f"vLLM {V.VLLM_VERSION} has no row in conformance.protocol.versions.RELEASES "
        f"(known: {sorted(RELEASES)}) and the run does not say whose rules it uses"
    )


@pytest.mark.parametrize("change", CHANGES, ids=lambda c: c.id)
def test_change(change, record_property) -> None:  # type: ignore[no-untyped-def]
    record_property("fixture", change.id)
    record_property("knob", "what changed")
    answer, separates = CASES[change.id]()
    record_property(f"version_answer:{change.id}", answer)
    # None: the case is not reachable through vLLM's scheduler here (the case says why).
    assert separates is not False, f"{change.id}: the case does not separate the releases' rules"


def test_policy_defaults_are_the_intended_rules() -> None:
    """The reference's defaults are the newest release's rules for every switch listed."""
    default = Policy()
    assert default.last_token is LastTokenRule.REQUEST_END
    assert default.null_blocks_in_store is NullBlockRule.PLACEHOLDER
    assert default.reload_after_failed_load is False
    # Not a release difference: both releases ask one chunk too many (a recorded deviation).
    assert default.window is WindowRule.TOKENS_BEFORE_END
