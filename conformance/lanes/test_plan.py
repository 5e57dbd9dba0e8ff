"""Lane 2 (plan): every store and load decision of vLLM's real scheduler equals the reference's.

Each example runs a random workload (shared prefixes, chunked prefill budgets,
decode steps, GPU and connector resets, aborts, delayed completions; small GPU
pools preempt) through vLLM 0.33.0's real ``Scheduler`` + ``OffloadingConnector``,
records every scheduler-side connector call, replays the inputs into the
reference planner (capacity decisions -- which keys a full tier evicts -- are
replayed from vLLM's manager: see ``ReplayedEvictionStore``) and compares every answer: hit tokens, load jobs (keys,
blocks, group_sizes, block_indices) and store jobs.  On a failure the message
shows the shrunk workload's trace up to the first diverging step.  The checks are
:mod:`conformance.checks.plan`'s (the meta lane runs them too).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings

from conformance.checks import plan as P
from conformance.corpus.cases import window_gap_workload
from conformance.harness import cases
from conformance.harness.strategies import SLOW_EXAMPLE_CHECKS
from conformance.harness.workloads import PlanCase, driver_for, workloads
from conformance.protocol import deviations
from conformance.protocol import trace as T
from conformance.protocol.backends import Backend

pytestmark = pytest.mark.plan

_PROFILE = os.environ.get("KVCHUNK_PROFILE", "ci")
_EXAMPLES = {"ci": 40, "deep": 1500, "dev": 8}.get(_PROFILE, 40)
# The CI profile draws the same examples on every run, so what it catches (and its
# non-vacuity counts) cannot depend on the seed; deep runs keep exploring.
_DERANDOMIZE = _PROFILE == "ci"


def _case(fixture: str, builder: str, args: tuple, bpc: int, retention: int | None = 0,
          blocks: int = 1024, cpu_chunks: int = 64) -> PlanCase:
    return PlanCase(fixture, f"blocks_per_chunk={bpc}", builder, args,
                    (("blocks_per_chunk", bpc),), retention, blocks, cpu_chunks)


CASES = [
    _case("full@16", "full_attention_kv_cache_config", (16,), 1),
    _case("full@16", "full_attention_kv_cache_config", (16,), 4),
    _case("fa64+sw128@16", "full_swa_kv_cache_config", (64, 16, 128), 1),
    _case("fa64+sw128@16", "full_swa_kv_cache_config", (64, 16, 128), 2),
    _case("fa64+sw128@16", "full_swa_kv_cache_config", (64, 16, 128), 2, None),
    _case("fa64+sw128@16", "full_swa_kv_cache_config", (64, 16, 128), 4),
    _case("fa64+sw40@16", "full_swa_kv_cache_config", (64, 16, 40), 2),
    _case("fa64+sw300@16", "full_swa_kv_cache_config", (64, 16, 300), 2, None),
    _case("fa32+sw100@32", "full_swa_kv_cache_config", (32, 32, 100), 3),
    _case("fa64+sw128@16 small pool", "full_swa_kv_cache_config", (64, 16, 128), 2, 0, 48),
    _case("fa64+sw128@16 full tier", "full_swa_kv_cache_config", (64, 16, 128), 2, 0, 1024, 12),
    _case("full@16 full tier", "full_attention_kv_cache_config", (16,), 4, 0, 1024, 4),
    _case("fa64+eagle-sw128@16", "swa_eagle_kv_cache_config", (64, 16, 128), 2),
    _case("fa64+eagle-sw128@16", "swa_eagle_kv_cache_config", (64, 16, 128), 1, None),
    _case("fa64+mamba-align@64", "full_mamba_align_kv_cache_config", (64, 64), 1),
    _case("fa64+mamba-align@64", "full_mamba_align_kv_cache_config", (64, 64), 2),
    *(
        PlanCase(c.fixture, str(c.knob), "fixture",
                 (c.fixture, c.knob.connector, c.knob.connector_module), c.knob.items, 0,
                 c.plan.num_gpu_blocks, c.plan.num_cpu_chunks, c.plan.max_len)
        for c in cases.CASES if c.plan is not None
    ),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_plans_agree(case: PlanCase, backend: Backend, record_property) -> None:  # type: ignore[no-untyped-def]
    _plans_agree(case, backend, record_property)


def _plans_agree(case: PlanCase, backend: Backend, record_property,  # type: ignore[no-untyped-def]
                 fixed: tuple[T.WorkloadSpec, ...] = (), drawn: bool = True) -> None:
    """The drawn workloads (unless not ``drawn``), after the ``fixed`` ones, agree; both
    directions exercised."""
    driver = driver_for(case)
    counts = {"traces": 0, "answers": 0, "loads": 0, "stores": 0}

    @settings(
        max_examples=_EXAMPLES,
        suppress_health_check=SLOW_EXAMPLE_CHECKS,
        derandomize=_DERANDOMIZE,
        database=None if _DERANDOMIZE else settings().database,
    )
    @given(workloads(max_len=case.max_len))
    def check(workload) -> None:  # type: ignore[no-untyped-def]
        trace = driver.run(workload)
        expected = P.answers_agree(trace, backend.planner)
        counts["traces"] += 1
        counts["answers"] += len(expected)
        counts["loads"] += sum(1 for a in expected if a.call == "allocated" and a.value)
        counts["stores"] += sum(len(a.value) for a in expected if a.call == "step")

    for workload in fixed:
        check.hypothesis.inner_test(workload)  # type: ignore[attr-defined]  # hypothesis adds it
    if drawn:
        check()
    record_property("counter:plan_traces", counts["traces"])
    record_property("counter:plan_answers_compared", counts["answers"])
    record_property("counter:plan_load_jobs", counts["loads"])
    record_property("counter:plan_store_jobs", counts["stores"])
    P.exercised_both_directions(case, counts)


@pytest.mark.parametrize("case", [c for c in CASES if c.builder != "fixture"], ids=str)
def test_tier_holds_what_it_was_sized_for(case: PlanCase) -> None:
    P.tier_holds_what_it_was_sized_for(case)


@pytest.mark.parametrize("case", [c for c in CASES if "full tier" in c.fixture], ids=str)
def test_full_tier_evicts_what_capacity_requires(case: PlanCase) -> None:
    @settings(max_examples=_EXAMPLES, suppress_health_check=SLOW_EXAMPLE_CHECKS,
              derandomize=_DERANDOMIZE, database=None)
    @given(workloads(max_len=case.max_len))
    def check(workload) -> None:  # type: ignore[no-untyped-def]
        P.full_tier_evicts_what_capacity_requires(driver_for(case).run(workload))

    check()


EDGE_CASES = [
    # 33 = 32 + 1: the one window length where rounding its chunks down or up differs.
    _case("fa64+sw33@16", "full_swa_kv_cache_config", (64, 16, 33), 2),
    # Decode tokens offloaded too: an EAGLE group's volatile last chunk must wait.
    PlanCase("fa64+eagle-sw128@16 decode stores", "blocks_per_chunk=1 offload_prompt_only=False",
             "swa_eagle_kv_cache_config", (64, 16, 128),
             (("blocks_per_chunk", 1), ("offload_prompt_only", False)), 0),
    # MTP: a 32-token window retaining 2 more tokens spans 2 chunks of 32, not 1.
    PlanCase("fa64+sw32+mtp2@16", "blocks_per_chunk=2", "swa_mtp_kv_cache_config",
             (64, 16, 32, 2), (("blocks_per_chunk", 2),), 0),
    # A window (16) under a chunk (64 tokens of the window group): a prefill step ending
    # mid-chunk frees the chunk's first block, so its store carries a null block.
    _case("fa64+sw16@16", "full_swa_kv_cache_config", (64, 16, 16), 4),
]
"""Geometries and knobs at the rules' edges (found by the meta lane's mutation score)."""


EDGE_WORKLOAD_CASES = [
    # MTP retaining 1 token: W - 1 + extra = 32, one whole chunk, so a hit ending one token
    # short of a chunk end (a prompt of whole full-attention chunks) needs the chunk before
    # its last too.  Only the fixed edge workloads run here (no drawn ones: a few seconds).
    PlanCase("fa64+sw32+mtp1@16", "blocks_per_chunk=2", "swa_mtp_kv_cache_config",
             (64, 16, 32, 1), (("blocks_per_chunk", 2),), 0),
    # Dense retention, a window (3 blocks) under the 128-token alignment segment (8 blocks):
    # a prompt whose last chunk ends mid-segment stores that segment's tail at the step its
    # prefill completes (the prompt horizon: ``reference.rules.store_horizon``).
    _case("fa64+sw40@16", "full_swa_kv_cache_config", (64, 16, 40), 2, None),
]
"""Edge geometries checked on :func:`edge_workloads` alone (found by the mutation score)."""


def _expect_known_deviation(case: PlanCase, request: pytest.FixtureRequest) -> None:
    """A case with a recorded vLLM deviation is a strict xfail (it passes the day vLLM agrees)."""
    dev = deviations.find("vllm", "plan", str(case))
    if dev is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=dev.xfail_reason()))


@pytest.mark.parametrize("case", EDGE_CASES, ids=str)
def test_plans_agree_at_the_edges(case: PlanCase, backend: Backend, record_property,  # type: ignore[no-untyped-def]
                                  request: pytest.FixtureRequest) -> None:
    _expect_known_deviation(case, request)
    _plans_agree(case, backend, record_property, edge_workloads())


@pytest.mark.parametrize("case", EDGE_WORKLOAD_CASES, ids=str)
def test_edge_workloads_agree(case: PlanCase, backend: Backend, record_property,  # type: ignore[no-untyped-def]
                              request: pytest.FixtureRequest) -> None:
    _expect_known_deviation(case, request)
    _plans_agree(case, backend, record_property, edge_workloads(), drawn=False)


def edge_workloads() -> tuple[T.WorkloadSpec, ...]:
    """Fixed workloads that reach the rules' edges on every geometry.

    Exact repeats of chunk-aligned prompts (hits end at the last token) and of one
    token more, after a GPU-only reset, with decode steps (EAGLE tails, decode
    stores); the budget of 512 prefills a prompt in one step, that of 32 ends steps
    mid-chunk (``fa64+sw16@16`` then stores null blocks), and the last workload
    decodes 20 tokens (an EAGLE group's volatile tail chunk).  A repeat of a longer
    prompt loads on 0.34.0 (0.33.0 subtracts the last token after the caps: on
    ``fa64+sw33@16`` it loads nothing, an open problem).  Then
    :func:`conformance.corpus.cases.window_gap_workload` (windows with one chunk missing) and
    :func:`_abort_while_loading_workload` (a store offered with no blocks).
    """
    base = tuple((7 * i) % 30 for i in range(600))
    # 20 decode steps after a one-step prefill: decode stores complete a chunk (EAGLE tail).
    decode = T.WorkloadSpec(
        requests=(
            T.RequestSpec("a", base[:200], max_tokens=20),
            T.RequestSpec("again", base[:200], 2, 31),
            T.RequestSpec("longer", base[:240], 2, 36),
        ),
        max_num_batched_tokens=512,
        resets=(T.ResetSpec(step=30), T.ResetSpec(step=35)),
    )
    return (*tuple(
        T.WorkloadSpec(
            requests=(
                T.RequestSpec("a", base[:n], max_tokens=6),
                T.RequestSpec("b", base[: n // 2] + tuple(range(31, 31 + n // 3)), 6, 2),
                T.RequestSpec("again", base[:n], 2, 31),
                T.RequestSpec("longer", base[: n + 40], 2, 36),
            ),
            max_num_batched_tokens=budget,
            resets=(T.ResetSpec(step=30), T.ResetSpec(step=35)),
        )
        for n, budget in ((256, 64), (257, 96), (256, 512), (256, 32))
    ), decode, window_gap_workload(base), _abort_while_loading_workload(base))


def _abort_while_loading_workload(base: tuple[int, ...]) -> T.WorkloadSpec:
    """A request aborted while its load is in flight, after a connector reset.

    ``z`` hits ``a``'s chunks and waits 3 steps for its load: vLLM gave the connector
    no blocks for it yet (only the load's).  The connector reset at step 13 restarts
    every request's stores at chunk 0; the abort at 14 then offers ``z``'s computed
    tokens with no block allocated: nothing may be stored.
    """
    return T.WorkloadSpec(
        requests=(T.RequestSpec("a", base[:300], 2, 0), T.RequestSpec("z", base[:300], 2, 12)),
        max_num_batched_tokens=512,
        resets=(T.ResetSpec(step=11), T.ResetSpec(step=13, reset_connector=True)),
        aborts=(T.AbortSpec(step=14, req_id="z"),),
        default_delay_steps=3,
    )


TWO_EAGLE_CASE = PlanCase("fa64+eagle-sw40@16+eagle-sw4@8", "blocks_per_chunk=2",
                          "two_eagle_swa_kv_cache_config", (64, (16, 40), (8, 4)),
                          (("blocks_per_chunk", 2),), 0)
"""Two windowed EAGLE groups (vLLM marks every group holding a draft layer)."""


def test_two_eagle_groups_each_peek_at_the_hit_end(backend: Backend,
                                                    request: pytest.FixtureRequest) -> None:
    """Every EAGLE group shows its peek chunk at the final hit end (``rules.needed_chunks``),
    also when another EAGLE group shrank the hit after the first one peeked further out:
    on :func:`two_eagle_groups_workload` ``r`` loads nothing."""
    _expect_known_deviation(TWO_EAGLE_CASE, request)
    trace = driver_for(TWO_EAGLE_CASE).run(two_eagle_groups_workload())
    expected = P.answers_agree(trace, backend.planner)
    assert any(a.call == "lookup" and a.req_id == "r" for a in expected), "r was never looked up"
    assert sum(1 for a in expected if a.call == "step" and a.value) >= 2, "c and a stored nothing"


def two_eagle_groups_workload() -> T.WorkloadSpec:
    """``c`` (300 tokens), then ``a`` (its first 150), then ``r`` (``c`` again), a GPU
    reset before each of the last two; 30-token steps, retention 0.

    Group 1 (window 40, 32-token chunks) holds chunks 6-8 from ``c`` (the window and peek
    before its boundary 256) and 2-3 from ``a`` (boundary 128; its peek chunk 4, tokens
    128-160, is past ``a``'s 150 tokens).  Group 2 (window 4, 16-token chunks) holds 7-8
    from ``a`` and 15 from ``c`` (``c``'s step ending at token 270 frees block 32 before
    chunk 16 completes, so that chunk is not stored).  For ``r`` the full group ends at 256;
    group 1 holds window and peek there, group 2 does not and shrinks the hit to 128, where
    group 1's peek chunk 4 is missing: no hit (vLLM 0.33.0 and 0.34.0 load 128 tokens).
    """
    base = tuple((7 * i) % 30 for i in range(300))
    return T.WorkloadSpec(
        requests=(
            T.RequestSpec("c", base, 2, 0),
            T.RequestSpec("a", base[:150], 2, 16),
            T.RequestSpec("r", base, 2, 31),
        ),
        max_num_batched_tokens=30,
        resets=(T.ResetSpec(step=15), T.ResetSpec(step=30)),
    )


PENDING_CASE = PlanCase("fa64+eagle-sw40@16+eagle-sw4@8 pending store", "blocks_per_chunk=2",
                        "two_eagle_swa_kv_cache_config", (64, (16, 40), (8, 4)),
                        (("blocks_per_chunk", 2),), 0)
"""The same geometry, a lookup while a store is still in flight."""


def test_no_wait_when_the_hit_is_empty(backend: Backend, request: pytest.FixtureRequest) -> None:
    """A lookup whose hit is 0 answers 0, not "ask again later", even when a chunk it
    looked at is still being written (``rules.lookup_deferred``: pending chunks already
    count as held, so their store completing cannot lengthen the hit):
    on :func:`pending_store_workload` ``r`` is answered 0 at once."""
    _expect_known_deviation(PENDING_CASE, request)
    trace = driver_for(PENDING_CASE).run(pending_store_workload())
    expected = P.answers_agree(trace, backend.planner)
    assert any(a.call == "lookup" and a.req_id == "r" for a in expected), "r was never looked up"
    assert sum(1 for a in expected if a.call == "step" and a.value) >= 2, "p and s stored nothing"


def pending_store_workload() -> T.WorkloadSpec:
    """``p`` (410 tokens), then ``s`` (the first 300), then ``r`` (430, ``p``'s prefix) while
    ``s``'s last store is in flight (every job completes 8 steps late); GPU resets before
    ``s`` and ``r``; 30-token steps, retention 0.

    The full group holds chunks 0-2 (ends at 384).  Group 1 (window 40, 32-token chunks)
    holds 10-11 from ``p`` (its peek chunk 12, tokens 384-416, is past ``p``'s 410 tokens)
    and 6-8 from ``s``, chunk 8 still being written.  Group 2 (window 4, 16-token chunks)
    holds 23-24 from ``p`` and 15 from ``s`` (chunk 16 is not stored: see
    :func:`two_eagle_groups_workload`).  Group 1's only window with its peek ends at 256,
    where group 2 holds nothing: the hit is 0 with chunk 8 pending or written.  vLLM
    0.33.0 and 0.34.0 answer "ask again later" until chunk 8 is written, then 0.
    """
    base = tuple((7 * i) % 30 for i in range(430))
    return T.WorkloadSpec(
        requests=(
            T.RequestSpec("p", base[:410], 2, 0),
            T.RequestSpec("s", base[:300], 2, 25),
            T.RequestSpec("r", base, 2, 39),
        ),
        max_num_batched_tokens=30,
        resets=(T.ResetSpec(step=24), T.ResetSpec(step=38)),
        default_delay_steps=8,
    )
