"""The eviction rule against plain LRU on drawn multi-turn workloads (issue #31).

Small workloads are drawn from fixed seeds (:func:`drawn_workload`) and served over a
budgeted disk (:func:`reference.disk_economics.miss_ratio_curve`: GPU cache cold, the packed
layout with each store job's window keys in a file of their own) on gemma-4-31B-it TP2 and
DeepSeek-V4-Flash TP4 at ``block_size`` 512, as the installed vLLM plans them, at 1/8, 1/4
and 1/2 of the unbounded run's peak bytes, under the rule and under LRU.

What must hold: the rule never strands a byte; at each fraction its mean hit rate over the
draws is at least LRU's (within :data:`MEAN_SLACK`); no draw trails LRU by more than
:data:`DRAW_SLACK`.  A draw that breaks one is printed with its workload (smallest first)
and the rule is studied on it; the test is not loosened.  ``KVCHUNK_PROFILE=deep`` draws
more workloads, from a fresh base seed it prints.  One of the properties does not hold
today: its test is a strict xfail naming the finding (:data:`TRAILS_LRU_ON_SOME_DRAWS`), for
the lead to decide.
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import mean
from typing import Any

import pytest

from reference.disk_economics import DiskEconomics, miss_ratio_curve
from reference.eviction import EvictionRule, Layout
from reference.workload import Span, Workload, requests

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm importable (the fixtures' chunking)")

GEMMA, DSV4 = "gemma-4-31B-it-tp2", "deepseek-v4-flash-tp4"
FIXTURES = (GEMMA, DSV4)
POINTS = 8
"""The rule's curve has ``--sweep-disk``'s points: ``peak * k // 8`` bytes, k = 1..8."""
FRACTIONS = {"1/8": 0, "1/4": 1, "1/2": 3}
"""The disks compared, as fractions of the rule's unbounded peak bytes (curve indices)."""
MEAN_SLACK = 0.005
"""The rule's mean hit rate may trail LRU's by half a point at most (ties on small draws)."""
DRAW_SLACK = 0.03
"""No draw's hit rate may trail LRU's by more than 3 points."""
MAX_PROMPT_TOKENS = 60_000
"""A draw's prompts together, every span at its high: a draw serves in well under a second
on both geometries."""

PROFILE = os.environ.get("KVCHUNK_PROFILE", "ci")
DRAWS = {"ci": 48, "deep": 400}.get(PROFILE, 8)
BASE_SEED = random.SystemRandom().randrange(1 << 32) if PROFILE == "deep" else 0
"""Draw ``n`` is ``drawn_workload(BASE_SEED + n)``: fixed outside ``deep``."""
KNOWN_STRICT = PROFILE in ("ci", "deep")
"""The known findings' xfails are strict where the draws hold them (ci's pinned 48, deep's
400); ``dev``'s 8 draws may miss them."""


def _span(rng: random.Random, low: int, high: int) -> Span:
    a, b = rng.randint(low, high), rng.randint(low, high)
    return Span(min(a, b), max(a, b))


def drawn_workload(seed: int) -> Workload:
    """A small multi-turn workload, a function of ``seed`` alone: 1-5 sessions of 2-6 turns,
    round-robin (with two or more, each session returns after every other: a cyclic
    revisit); a shared system prompt half the time, shared documents a third of the time;
    random turn, output and document lengths; prefill steps of 2k or 8k tokens (a prompt
    longer than a step is stored in several jobs).  Redrawn while its prompts could exceed
    :data:`MAX_PROMPT_TOKENS`."""
    rng = random.Random(seed)
    while True:
        documents = rng.choice((0, 0, rng.randint(1, 2)))
        workload = Workload(
            name=f"drawn_workload({seed})",
            description="a drawn multi-turn workload",
            source="tests/test_eviction_vs_lru_property.py",
            sessions=rng.randint(1, 5),
            turns=rng.randint(2, 6),
            system_tokens=rng.choice((0, rng.randint(256, 2048))),
            turn_tokens=_span(rng, 32, 1024),
            output_tokens=_span(rng, 16, 512),
            documents=documents,
            document_tokens=_span(rng, 256, 2048) if documents else Span(0, 0),
            seed=seed,
            max_num_batched_tokens=rng.choice((2048, 8192)),
        )
        if workload.total_prompt_bound <= MAX_PROMPT_TOKENS:
            return workload


@dataclass(frozen=True)
class Draw:
    """One workload served under the rule and under LRU."""

    workload: Workload
    prompt_tokens: int
    rule: tuple[DiskEconomics, ...]
    """The rule at each of :data:`FRACTIONS`, in order."""
    lru: tuple[DiskEconomics, ...]
    """LRU at the same sizes."""
    curve: tuple[DiskEconomics, ...] = ()
    """The rule's whole curve (:data:`POINTS` points, the last the unbounded run)."""

    def shown(self) -> str:
        w = self.workload
        return (f"{w.describe()}; {self.prompt_tokens} prompt tokens, prefill steps of "
                f"{w.max_num_batched_tokens} (reproduce: {w.name})")


def _curve(knob: Any, workload: Workload, sizes: Sequence[int] | int, rule: EvictionRule,
           windows_apart: bool = True) -> tuple[DiskEconomics, ...]:
    return miss_ratio_curve(knob.chunking, workload, sizes, rule, knob.file_bytes,
                            Layout.PACKED, knob.policy, windows_apart=windows_apart)


def serve(knob: Any, workload: Workload) -> Draw:
    """``workload`` under the rule's curve, and under LRU at the compared sizes."""
    curve = _curve(knob, workload, POINTS, EvictionRule.REACHABLE)
    rule = tuple(curve[i] for i in FRACTIONS.values())
    lru = _curve(knob, workload, [e.budget_bytes or 0 for e in rule], EvictionRule.LRU)
    return Draw(workload, sum(len(r.prompt) for r in requests(workload)), rule, lru, curve)


def stranding(draws: Sequence[Draw], of: str = "curve") -> list[str]:
    """Every point (of ``of``: the rule's ``curve``, or ``lru``) ending with stranded bytes."""
    names = [f"{k}/{POINTS}" for k in range(1, POINTS + 1)] if of == "curve" else list(FRACTIONS)
    return [f"{e.stranded_bytes} bytes stranded at {name} of peak ({e.budget_bytes} bytes): "
            f"{d.shown()}"
            for d in draws for name, e in zip(names, getattr(d, of), strict=True)
            if e.stranded_bytes]


def mean_shortfalls(draws: Sequence[Draw]) -> list[str]:
    """The fractions where the rule's mean hit rate trails LRU's by more than
    :data:`MEAN_SLACK`."""
    out = []
    for j, fraction in enumerate(FRACTIONS):
        rule = mean(d.rule[j].hit_rate for d in draws)
        lru = mean(d.lru[j].hit_rate for d in draws)
        if rule < lru - MEAN_SLACK:
            out.append(f"at {fraction} of peak: rule {rule:.2%} < LRU {lru:.2%} "
                       f"over {len(draws)} draws")
    return out


def draw_losses(draws: Sequence[Draw]) -> list[str]:
    """Each draw and fraction where the rule trails LRU by more than :data:`DRAW_SLACK`,
    smallest workload first."""
    out = []
    for d in draws:
        for j, fraction in enumerate(FRACTIONS):
            rule, lru = d.rule[j].hit_rate, d.lru[j].hit_rate
            if rule < lru - DRAW_SLACK:
                out.append((d.prompt_tokens, f"at {fraction} of peak ({d.rule[j].budget_bytes} "
                            f"bytes): rule {rule:.1%} < LRU {lru:.1%} on {d.shown()}"))
    return [what for _, what in sorted(out)]


_SERVED: dict[str, tuple[Any, list[Draw]]] = {}


def served(fixture: str) -> tuple[Any, list[Draw]]:
    """The fixture's knob at ``block_size`` 512 (its chunking, the release's policy, every
    key a CPU slot's bytes, as ``--sweep-disk`` uses them) and every draw served on it;
    computed once per module."""
    if fixture not in _SERVED:
        from vllm_adapter.planning import fixture_knob

        knob = fixture_knob(fixture, "block_size", 512)
        _SERVED[fixture] = knob, [serve(knob, drawn_workload(BASE_SEED + n))
                                  for n in range(DRAWS)]
    return _SERVED[fixture]


def _report(what: str, lines: list[str]) -> str:
    return (f"{len(lines)} {what} (base seed {BASE_SEED}, {DRAWS} draws a geometry):\n"
            + "\n".join(lines[:16]))


def _on_both(check: Any) -> list[str]:
    """``check``'s lines for the draws on each geometry, named."""
    return [f"{fixture}: {line}" for fixture in FIXTURES for line in check(served(fixture)[1])]


TRAILS_LRU_ON_SOME_DRAWS = pytest.mark.xfail(strict=KNOWN_STRICT, raises=AssertionError, reason=(
    "issue #31 finding, open: the rule trails LRU by more than 3 points on a few gemma-4 "
    "TP2 draws, all at 1/2 of peak (DeepSeek-V4 TP4: none since the rule takes leaves' units "
    "by their newest file, eviction.unit_last_use).  vLLM 0.34.0: drawn_workload(27) 24.2% "
    "vs 28.6%, drawn_workload(44) 20.8% vs 27.0%; 0.33.0: drawn_workload(35) 7.3% vs 21.8%, "
    "drawn_workload(17) 32.0% vs 35.8%.  One mechanism in all four: where the two diverge, "
    "the rule's unit is larger than LRU's victim; LRU evicts part of it and leaves the rest "
    "stranded until the session's next turn reconnects it with a smaller store, while the "
    "rule's next store writes it all again and the extra bytes take the next session's tip.  "
    "(35), 3 cyclic sessions over a disk that holds about two: LRU evicts s1's full-attention "
    "file (80 MiB), the rule s1's tip, that file and its window file (680 MiB); s1's next "
    "turn writes 3F+10W (LRU) or 3F+20W, and the rule's eviction takes s2's tip (s2's next "
    "turn: 0 tokens, LRU 1536).  (44), a shared document: s1's window file needs window "
    "chunks of s0's (the junction's), so the unit of s0's old windows takes s1's too; LRU "
    "strands s1's until s0's next turn rewrites the junction's windows, and s1's next turn "
    "hits 1536 tokens (the rule 512); the last turn's store is then refused 3 times.  (27) "
    "and (17): a session's two window files are one unit (its later boundary's window needs "
    "a chunk of the earlier file); LRU evicts the older and strands the newer, the rule takes "
    "both and keeps the session's full-attention files, so the session's next turn re-stores "
    "every boundary's windows (27: s2, 1.21 GiB against LRU's 0.94 GiB; 17: s2, 20 window "
    "keys against 10) and that store takes s0's newest files (27: s0's first window file, "
    "which a hit at the shared document had just read; 17: s0's tip); s0's next turn hits 0 "
    "tokens against LRU's 1024 (27), 1024 against 2048 (17).  Tried on the 48 draws and not "
    "kept (draw-fractions more than 3 points behind on vLLM 0.34.0 / 0.33.0, against 2 / 2 "
    "now; worst): no passed-windows step (10 / 6; -20.0 / -14.6 points), a boundary "
    "'passed' only when one prefix was ever observed past it (11 / 8; -24.9 / -24.9), the "
    "step skipping window files a hit has read (7 / 6; -16.1 / -14.6), a unit no larger than "
    "its newest file's own unit (7 / 2; -18.7 / -7.3: it halves (35)'s gap on 0.33.0 but "
    "loses DeepSeek-V4 draws at 1/4 on 0.34.0), "
    "Overflow.HEAD by default, each head sized with itself pending (22 / 12; -22.7 / -14.6; "
    "DeepSeek-V4's mean at 1/8 falls below LRU's on 0.34.0, 2.84% vs 3.68%; the four draws "
    "unchanged: a cut head turns a refusal into an eviction, so on a disk too small for a "
    "cyclic revisit each session's head evicts the one whole prefix a refusal kept and is "
    "evicted before its session returns: gemma drawn_workload(7) at 1/8 on 0.34.0, 0.0% vs "
    "LRU's and REFUSE's 7.4%), the head cut back to its deepest whole boundary (19 / 10; "
    "-22.7 / -14.6), and a store not writing the window keys of a boundary it passes itself, "
    "one prefix only (2 / 2; -13.2 / -14.6: fixes (27) on 0.34.0 but DeepSeek-V4 "
    "drawn_workload(27) at 1/8 falls to 0.0% vs 13.2%; no change on 0.33.0), a completed "
    "store refreshing its whole prefix, so the most recently extended tips go last (2 / 2; "
    "-6.2 / -14.6: the same four draws; gemma drawn_workload(17) at 5/8 falls from 58.4% to "
    "50.8% on both releases), and a unit holding a branch boundary's windows taken last, for "
    "a release writing no junction (4 / 3; -24.9 / -24.9: fixes (27) on 0.34.0 only, puts "
    "gemma drawn_workload(28) behind on both releases, (26) and DeepSeek-V4 "
    "drawn_workload(33) on 0.34.0) "
    "(scripts/eviction_draws.py --candidates refuse prefix-recency branch-windows-last).  "
    "Remove this mark once the rule is fixed."))


@pytest.mark.parametrize("fixture", FIXTURES)
def test_the_draws_exercise_a_full_disk(fixture: str) -> None:
    """Not vacuous: most draws are multi-session, every compared disk evicts and hits, and
    the rule and LRU differ on some draw."""
    _, draws = served(fixture)
    assert sum(d.workload.sessions > 1 for d in draws) >= len(draws) // 2
    for j in range(len(FRACTIONS)):
        assert sum(d.rule[j].files_evicted for d in draws) > 0
        assert sum(d.lru[j].offload_hit_tokens for d in draws) > 0
    assert any(d.rule[j].hit_rate != d.lru[j].hit_rate
               for d in draws for j in range(len(FRACTIONS)))


def test_the_rule_never_strands() -> None:
    """Stranded bytes are disk no lookup can load: the rule must leave none, at any point of
    its curve, on either geometry."""
    found = _on_both(stranding)
    assert not found, _report("curve points with stranded bytes", found)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_the_rule_s_mean_hit_rate_is_at_least_lru_s(fixture: str) -> None:
    """Over the draws, at each fraction, the rule serves at least as many prompt tokens from
    the disk as LRU does."""
    _, draws = served(fixture)
    assert not mean_shortfalls(draws), _report("shortfalls", mean_shortfalls(draws))


@TRAILS_LRU_ON_SOME_DRAWS
def test_no_draw_falls_more_than_3_points_below_lru() -> None:
    """A mean can hide a workload the rule serves badly: on neither geometry may a draw
    trail LRU by more than 3 points."""
    found = _on_both(draw_losses)
    assert not found, _report("draws more than 3 points below LRU", found)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_the_checks_catch_a_weaker_rule(fixture: str) -> None:
    """The checks have teeth: LRU's own points strand, and the rule writing a store job's
    window keys in its full-attention file (windows not apart, where issue #31 measured it
    losing to LRU on small disks) trails LRU's mean and falls below it on some draw."""
    knob, draws = served(fixture)
    assert stranding(draws, "lru")
    weaker = [Draw(d.workload, d.prompt_tokens,
                   _curve(knob, d.workload, [e.budget_bytes or 0 for e in d.rule],
                          EvictionRule.REACHABLE, windows_apart=False), d.lru)
              for d in draws]
    assert mean_shortfalls(weaker)
    assert draw_losses(weaker)
