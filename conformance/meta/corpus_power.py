"""The corpus's power, measured: how many rule mutants does the golden corpus kill alone?

The meta lane's mutation score (:mod:`conformance.meta.mutation`) asks whether *the
suite* catches each mutant.  This asks the same of the corpus replay alone, the one
check a backend author runs without vLLM (``python -m conformance.corpus replay``):
for every reference-rule mutant (:data:`conformance.meta.mutants.rules.MUTANTS`)
:func:`measure` installs it, replays every committed case into the ``reference``
backend with :func:`conformance.corpus.run.check_case` (the command's own path), and
uninstalls it.  A mutant is *killed* when some case fails, by a divergence from
vLLM's recorded answers or by the backend raising (both fail the command); else it
*survived*.  A mutant whose edit no longer applies (:class:`NotApplicable`) is left
out of the score (the lane skips it).  vLLM-side mutants are out of scope:
the corpus is vLLM's recorded answers, a fault in vLLM cannot change them.

Every case must pass unmutated first (:class:`conformance.meta.mutation.HarnessError`
otherwise); that replay also imports every module the replay touches, so a mutant
installed afterwards patches every binding of its target (``LineEdit.install``) and
leaves none behind.
"""

from __future__ import annotations

import inspect
import sys
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import pytest

from conformance.corpus.format import DATA_DIR, CorpusCase, read_corpus
from conformance.corpus.run import check_case
from conformance.meta.mutants.source import Mutant, NotApplicable
from conformance.meta.mutation import HarnessError
from conformance.protocol.backends import REFERENCE

__all__ = ["CORPUS_GAPS", "TARGET", "CorpusPower", "MutantKill", "committed_cases",
           "executed_code", "measure", "replay_executes", "replay_mutant", "rule_mutants"]

TARGET = 0.9
"""The corpus alone should kill this fraction of the applicable rule mutants (issue #32)."""


@dataclass(frozen=True)
class MutantKill:
    """One rule mutant against the corpus replay."""

    mutant: str
    killed: bool
    first_failing_case: str | None
    """``release:case`` of the first case that failed (files in name order), None when none did."""
    raised: bool
    """The first failing case failed by the backend raising, not by a divergence."""
    detail: str
    """The first line of that case's failure report; ``-`` when it survived."""
    seconds: float
    reached: bool
    """The unmutated replay executes the mutant's target (:func:`replay_executes`): a mutant
    whose target it never runs (the byte layout, the disk tier, the engine-side model
    whose decisions the corpus records as inputs) cannot be killed by any case."""


@dataclass(frozen=True)
class CorpusPower:
    """Every applicable rule mutant's outcome, and the corpus's score over them."""

    kills: tuple[MutantKill, ...]
    not_applicable: tuple[str, ...]
    """Mutants whose edit applies to no current source (left out of the score)."""
    cases: int
    """Committed cases replayed per mutant."""

    @property
    def killed(self) -> int:
        return sum(k.killed for k in self.kills)

    @property
    def total(self) -> int:
        return len(self.kills)

    @property
    def fraction(self) -> float:
        return self.killed / self.total if self.total else 1.0

    @property
    def survivors(self) -> tuple[str, ...]:
        return tuple(k.mutant for k in self.kills if not k.killed)

    @property
    def reached(self) -> int:
        """Mutants whose target the replay executes (the only ones a case can kill)."""
        return sum(k.reached for k in self.kills)

    @property
    def killed_reached(self) -> int:
        return sum(k.killed and k.reached for k in self.kills)


def rule_mutants() -> tuple[Mutant, ...]:
    from conformance.meta.mutants import rules

    return rules.MUTANTS


@cache
def committed_cases() -> tuple[CorpusCase, ...]:
    """Every committed case (``data/vllm-*.jsonl``, in name order: the replay's default),
    after checking that each passes on the unmutated reference."""
    cases = tuple(c for path in sorted(DATA_DIR.glob("vllm-*.jsonl")) for c in read_corpus(path))
    if not cases:
        raise HarnessError(f"no corpus files in {DATA_DIR}")
    failing = [r.case for r in (check_case(c, REFERENCE) for c in cases) if r.failure is not None]
    if failing:
        raise HarnessError(f"corpus cases fail on the unmutated reference: {failing}; "
                           "a replay that fails unmutated cannot score mutants")
    return cases


@cache
def executed_code() -> frozenset[types.CodeType]:
    """The code objects the unmutated replay of every committed case calls."""
    cases = committed_cases()
    seen: set[types.CodeType] = set()

    def profile(frame: types.FrameType, event: str, arg: object) -> None:
        if event == "call":
            seen.add(frame.f_code)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        for case in cases:
            check_case(case, REFERENCE)
    finally:
        sys.setprofile(previous)
    return frozenset(seen)


def replay_executes(mutant: Mutant) -> bool:
    """The unmutated replay calls the function the mutant edits."""
    _, _, original = mutant.edit.resolve()
    func = original.__func__ if isinstance(original, (classmethod, staticmethod)) else original
    func = inspect.unwrap(getattr(func, "fget", func))
    return func.__code__ in executed_code()


def replay_mutant(mutant: Mutant, cases: Sequence[CorpusCase] | None = None) -> MutantKill:
    """Install ``mutant``, replay ``cases`` (default: every committed one) until one fails,
    uninstall it.  Raises :class:`NotApplicable` when the mutant's edit does not apply."""
    cases = committed_cases() if cases is None else cases
    reached = replay_executes(mutant)
    start = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        mutant.apply(mp)
        for case in cases:
            result = check_case(case, REFERENCE, trace_lines=1)
            if result.failure is not None:
                return MutantKill(mutant.name, True, f"{case.release}:{case.name}", result.raised,
                                  result.failure.splitlines()[0][:200],
                                  time.perf_counter() - start, reached)
    return MutantKill(mutant.name, False, None, False, "-", time.perf_counter() - start, reached)


def measure(mutants: Sequence[Mutant] | None = None) -> CorpusPower:
    """Every rule mutant (or ``mutants``) against every committed case."""
    cases = committed_cases()
    kills, skipped = [], []
    for mutant in rule_mutants() if mutants is None else mutants:
        try:
            kills.append(replay_mutant(mutant, cases))
        except NotApplicable:
            skipped.append(mutant.name)
    return CorpusPower(tuple(kills), tuple(skipped), len(cases))

# -- the record: each survivor and the corpus case it lacks ---------------------------

_INPUT = ("the replay never runs it: the corpus records vLLM's own decision here as an input "
          "of the replay (")
_NO_BYTES = "the replay never runs it: the corpus holds scheduler answers, no bytes ("
_DISK = ("the replay never runs it: the corpus replays vLLM's CPU tier, not the disk tier "
         "whose evictions this rule decides (reference.eviction)")

CORPUS_GAPS: dict[str, str] = {
    # Targets the unmutated replay executes, in situations no vLLM trace reaches.
    "rule_finished_stores_last_token":
        "unobservable in a vLLM trace: a finished request has num_computed_tokens == "
        "num_tokens only when it finishes (finished_error, kv_load_failure_policy fail) "
        "while waiting for a load whose hit reached num_tokens, and the connector has not "
        "been handed that request's blocks since its lookup, so it stores nothing under "
        "either rule (the corpus has that finish: case preempted-load-fails); the suite "
        "catches it only in tests/test_rules.py",
    "rule_final_tail_for_eagle":
        "equivalent through the Planner: an EAGLE group's store mask has no final tail under "
        "either horizon (reachable_block_mask), so the chunks a tail would make it reconsider "
        "are exactly the ones offered_under_prompt_horizon reports offered already, and it "
        "re-offers none; only tests/test_rules.py (final_tail_blocks itself) catches it",
    "rule_load_reads_eagle_peek":
        "unreachable with vLLM's GPU prefix cache: only the peek differs when another "
        "request's load holds this lookup's peek chunk and none of its loaded chunks, which "
        "needs this hit to end where that load starts (its GPU hit) while this request's own "
        "GPU hit is shorter, but the two share that prefix and the loading request holds "
        "those blocks, so this one's GPU hit is as long; the suite catches it only in "
        "tests/test_rules.py",
    "rule_deferred_by_peek_loading":
        "unreachable with vLLM's GPU prefix cache, as rule_load_reads_eagle_peek (the same "
        "deferral, edited in lookup_deferred instead of loaded_chunks)",
    "rule_aligned_to_any_group":
        "unreachable by the store rules: 'any' and 'all' differ only when every windowed "
        "group holds at an end that is one group's chunk end (16 tokens) but not another's "
        "(32), but a windowed group holds a hit only at the boundaries its store mask keeps a "
        "window before (multiples of the alignment or the retention interval, so of every "
        "windowed group's chunk) or, where it stores every chunk, up to its last one, and "
        "then the group with the longest chunks ends the hit on its own chunk end; only a "
        "chunk lost to an eviction could open the gap (300 drawn two-EAGLE-group workloads "
        "with max_load_tokens found none); the suite catches it only in tests/test_rules.py",
    "rule_block_size_floored":
        "no block_size knob that is not a whole number of blocks: vLLM rejects such a config, "
        "and the corpus records only configs vLLM accepted (its format has no rejection case)",
    # Targets the replay never executes: no corpus case can kill them.
    "rule_kept_blocks_whole_window":
        _INPUT + "first_kept_block: the block tables vLLM allocated for a hit)",
    "rule_full_end_without_windows":
        _INPUT + "full_attention_end: each step's shared_prefix_boundary)",
    "rule_junction_at_hit_end":
        _INPUT + "shared_prefix_junction: each step's shared_prefix_boundary)",
    "rule_gpu_hit_reaches_last_token":
        _INPUT + "gpu_prefix_hit, the economics model's GPU cache: a lookup's computed_tokens)",
    "rule_gpu_hit_unaligned":
        _INPUT + "gpu_prefix_hit, the economics model's GPU cache: a lookup's computed_tokens)",
    "rule_gpu_pin_under_dense":
        _INPUT + "pinned_junction, the economics model: each step's shared_prefix_boundary)",
    "rule_gpu_pin_replaces_offload_junction":
        _INPUT + "pinned_junction, the economics model: each step's shared_prefix_boundary)",
    "rule_slot_regions_overlap": _NO_BYTES + "the worker's slot layout, reference.transfer_fast)",
    "rule_sub_slot_stride_of_tensor0":
        _NO_BYTES + "the worker's slot layout, reference.transfer_fast)",
    "spec_sub_slots_reversed": _NO_BYTES + "the byte-layout spec, reference.transfer)",
    "spec_last_chunk_past_the_blocks": _NO_BYTES + "the byte-layout spec, reference.transfer)",
    "spec_regions_ignore_blocks_per_chunk": _NO_BYTES + "the byte-layout spec, reference.transfer)",
    "rule_eviction_takes_a_prefix": _DISK,
    "rule_eviction_any_windows_first": _DISK,
    "rule_window_sibling_always_to_come": _DISK,
    "rule_head_without_windows": _DISK,
    "rule_stranded_ignores_window_siblings": _DISK,
    "rule_unit_recency_by_leaf": _DISK,
}
"""Rule mutants the corpus replay alone does not kill, and the case class each lacks
(measured 2026-12-05 on the committed 0.33.0 and 0.34.0 corpora, 44 cases: 26/47 killed).
``conformance/lanes/test_corpus_power.py`` makes each a strict xfail, so a new case that
kills one fails until its record goes."""


def main() -> None:
    """Print each rule mutant's outcome against the corpus alone, then the score."""
    power = measure()
    for k in power.kills:
        where = f"{k.first_failing_case} ({'raised' if k.raised else 'diverged'})" if k.killed else "-"
        reach = "" if k.reached else " (the replay never runs its target)"
        print(f"{k.seconds:5.2f}s {'killed' if k.killed else 'SURVIVED':8} {k.mutant}: {where}"
              f"{reach}", flush=True)
    for name in power.not_applicable:
        print(f"  n/a   {name}")
    print(f"corpus alone: {power.killed}/{power.total} = {power.fraction:.0%} of the rule mutants "
          f"killed over {power.cases} cases ({power.killed_reached}/{power.reached} of those whose "
          f"target the replay runs); survivors {list(power.survivors)}")


if __name__ == "__main__":
    main()
