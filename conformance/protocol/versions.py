"""The rules each supported vLLM release runs, as named reference policy switches.

The reference (:class:`reference.plan.Policy`) defaults to the *intended* rule
for every switch.  A release that deviates runs the switch that reproduces it,
so the plan lane can still compare call by call; the deviation itself is listed
in ``conformance/protocol/deviations/vllm-<version>.toml`` and, where two releases
differ, in :data:`CHANGES` (the report's "What changed" section, whose answers
the suite measures on each release: ``conformance/lanes/test_versions.py``).

Not every switch is a :data:`CHANGES` case: ``Policy.offload_junctions`` (0.34.0 pins a
shared-prefix junction where windowed groups cut an offload hit short of the
full-attention end; 0.33.0 does not) acts only in the engine that serves a workload, so
the tiered economics lane measures it (its ``junction`` case: the files written differ).
``tests/test_release_switches.py`` holds every switch on which the releases differ to a
lane case.

One row per release; a release not listed runs the newest row's rules (or the
``--vllm-rules`` release's) and the report says so in one line (:func:`rules_line`).  The rows live in
:mod:`vllm_adapter.releases` (the operator CLI needs them and may not import the
suite); this module re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_adapter.releases import (
    NEWEST,
    RELEASES,
    RULES_ENV,
    ReleaseRules,
    check_release,
    rules_for,
    rules_line,
)

__all__ = [
    "CHANGES",
    "NEWEST",
    "RELEASES",
    "RULES_ENV",
    "UNMEASURED",
    "Change",
    "ReleaseRules",
    "UnmeasuredChange",
    "check_release",
    "rules_for",
    "rules_line",
]


@dataclass(frozen=True)
class Change:
    """A behaviour that differs between supported releases, with its minimal case."""

    id: str
    rule: str
    """The rule, in one sentence."""
    case: str
    """The smallest workload that shows it (what the measuring test runs)."""
    intended: str
    """Which answer is the intended rule, and why."""


CHANGES: tuple[Change, ...] = (
    Change(
        id="last-token-cap",
        rule=(
            "With windowed groups the request's last token is recomputed. 0.33.0 subtracts that "
            "token after applying the step's token budget and max_load_tokens; 0.34.0 subtracts "
            "it from the request end only, so a hit bounded by a cap keeps its last chunk."
        ),
        case=(
            "fa64+sw128@16 (full attention + sliding window 128, 16 tokens/block), "
            "blocks_per_chunk=1, dense retention: store a 200-token prompt, reset the GPU prefix "
            "cache, send it again with max_load_tokens=64."
        ),
        intended=(
            "0.34.0: a cap is already a legal hit end; losing a token there drops a whole chunk "
            "(reference LastTokenRule.REQUEST_END)."
        ),
    ),
    Change(
        id="null-blocks-in-store-jobs",
        rule=(
            "A stored sliding-window chunk may contain null blocks (freed, out of the window). "
            "0.33.0 leaves them out of the store job; 0.34.0 keeps them as placeholders so every "
            "block keeps its offset inside the chunk."
        ),
        case=(
            "fa64+sw40@16, blocks_per_chunk=2, dense retention, 8 CPU chunks, 64-token steps: "
            "two 600-token prompts sharing 300 tokens; a store that could not allocate is "
            "retried after the window freed its chunk's first block."
        ),
        intended=(
            "0.34.0: the chunk layout is positional (sub-slot j holds block j of the chunk); "
            "omitting a block shifts the ones after it (reference NullBlockRule.PLACEHOLDER)."
        ),
    ),
    Change(
        id="failed-load-retry",
        rule=(
            "After a failed load, 0.33.0 lets the request look up and load again; 0.34.0 never "
            "loads that request from the offloaded cache again (load_failed), preemption included."
        ),
        case=(
            "fa64+sw128@16, blocks_per_chunk=2: request A stores its prompt, a connector reset "
            "runs, B sends the same prompt and its load job fails (kv_load_failure_policy "
            "'recompute')."
        ),
        intended="Either (a retry policy, not a correctness rule); the reference defaults to 0.34.0.",
    ),
    Change(
        id="failed-store-reported",
        rule=(
            "0.33.0's worker asserts every transfer succeeded, so a failed store cannot be "
            "reported (its keys stay pending until a reset); 0.34.0 reports it and drops the keys."
        ),
        case="full@16, blocks_per_chunk=4: one 100-token request whose store job fails.",
        intended="0.34.0: a failed store becomes visible to nobody and frees its slots.",
    ),
    Change(
        id="connector-reset-twice",
        rule=(
            "Two connector resets with no scheduler step between them: 0.33.0 dies with a bare "
            "AssertionError (jobs_to_flush not empty); 0.34.0 merges the flush sets."
        ),
        case=(
            "full@16, blocks_per_chunk=2, jobs reported 3 steps late: a 300-token request steps "
            "twice (a store in flight), then reset_prefix_cache(reset_connector=True) twice."
        ),
        intended="0.34.0: a reset must be idempotent.",
    ),
)


@dataclass(frozen=True)
class UnmeasuredChange:
    """A 0.33.0 -> 0.34.0 change in the offloading code that no lane reaches yet, and why."""

    id: str
    change: str
    why_not_measured: str


UNMEASURED: tuple[UnmeasuredChange, ...] = (
    UnmeasuredChange(
        "eagle-drop-with-lookahead-hashes",
        "0.34.0 drops an EAGLE/MTP group's trailing chunk (store and load) only with legacy "
        "hashes; with lookahead block hashes (num_hash_lookahead_tokens > 0) it is kept.",
        "Lookahead needs a speculative config; the driver's engines have none, so every trace "
        "runs legacy hashes and both releases drop the chunk (the plan lane's EAGLE cases agree).",
    ),
    UnmeasuredChange(
        "finished-before-prefill-clamp",
        "0.34.0 stores a finished request only up to its computed tokens "
        "(min(num_computed_tokens, ...)); 0.33.0 assumed the prompt was computed.",
        "Only a request finished by an error mid-prefill differs; the driver finishes requests "
        "by length or abort (aborts were already clamped). The reference applies the clamp.",
    ),
    UnmeasuredChange(
        "store-threshold-counts-once-per-request",
        "0.34.0's CPU manager counts a key toward store_threshold once per request.",
        "An eviction-policy detail of vLLM's manager; the plan lane replays its capacity "
        "decisions (ReplayedEvictionStore) and no case sets store_threshold.",
    ),
    UnmeasuredChange(
        "partial-tail-anchor",
        "0.34.0 anchors Mamba partial-tail lookups at the full-attention hit boundary.",
        "The reference refuses partial-tail chunkings (UnsupportedChunking), as on 0.33.0.",
    ),
)
