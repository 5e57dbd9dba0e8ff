"""The eviction rule against plain LRU on the pinned drawn workloads, per candidate rule.

Serves ``tests/test_eviction_vs_lru_property.py``'s draws (``KVCHUNK_PROFILE`` picks how
many: 48 under ``ci``) on gemma-4-31B-it TP2 and DeepSeek-V4-Flash TP4 at ``block_size``
512, under the rule with each candidate of :data:`CANDIDATES` and under plain LRU at the
same sizes (1/8, 1/4 and 1/2 of the rule's unbounded peak), and prints per geometry: the
draw-fractions where the rule trails LRU by more than 3 points (the module's
``draw_losses``), the worst gap, the mean hit rates, the mean shortfalls, the rule's curve
points with stranded bytes and the stores cut to a head; for a candidate other than
``refuse`` (the rule as it is), also each draw-fraction where it serves fewer or more
tokens than ``refuse``.  Issue #31's measurements (``docs/semantics.md`` section 10) are
this output::

    KVCHUNK_VLLM=0.34.0 HF_HUB_OFFLINE=1 KVCHUNK_PROFILE=ci \\
        .nox/tests-vllm-0-34-0/bin/python scripts/eviction_draws.py --candidates refuse head

and the same with the 0.33.0 venv and ``KVCHUNK_VLLM=0.33.0`` for that release's rules.
``--overflow`` is the older spelling of ``--candidates`` for the two overflow options.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from reference.disk_economics import BudgetedIndex  # noqa: E402
from reference.eviction import Disk, EvictionRule, Layout, Overflow  # noqa: E402
from reference.keys import split_key  # noqa: E402
from reference.workload import requests  # noqa: E402


class PrefixRecencyIndex(BudgetedIndex):
    """Candidate (a): a live session's tip protected between turns.  The rule sees keys and
    their prefix structure, no session: a completed store refreshes the use time of every
    file of its prefix (its full-attention keys' ancestors and the windows of each boundary
    on the way, oldest first, then the store's own files), so a prefix is as recent as its
    latest extension and the deepest file of the most recently extended prefixes goes last."""

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        if success and self.rule is EvictionRule.REACHABLE:
            for fid in reversed(prefix_files(self.disk, [k for k in keys
                                                         if k in self.disk.file_of])):
                self.disk.touch(fid)
        super().complete_store(keys, success)


def prefix_files(disk: Disk, keys: Sequence[bytes]) -> list[int]:
    """The files on ``disk`` holding the prefix of ``keys`` outside their own files: each
    full-attention key's ancestors and the window keys of every boundary they end, nearest
    first (each file once)."""
    s = disk.structure
    own = {disk.file_of.get(k) for k in keys}
    out: dict[int, None] = {}
    seen: set[bytes] = set()
    for key in keys:
        node: bytes | None = key
        while node is not None and node not in seen and s.is_full(node):
            seen.add(node)
            for k in (node, *s.windows_at.get(split_key(node)[0], ())):
                fid = disk.file_of.get(k)
                if fid is not None and fid not in own:
                    out[fid] = None
            node = s.parent.get(node)
    return list(out)


class BranchWindowsLastDisk(Disk):
    """Candidate (b): a shared prefix's windows kept.  A unit holding a window key of a
    boundary where prefixes branch (a full-attention key ending there has two or more
    children on disk) goes only when no other unit may: meant for a release that writes no
    junction (vLLM 0.33.0, ``Policy.offload_junctions`` False), which cannot write them
    again once they are gone."""

    deferring = False

    def unit(self, fid: int) -> tuple[int, ...] | None:
        unit = super().unit(fid)
        if unit is not None and self.deferring and self._branch_windows(unit):
            return None
        return unit

    def _next_unit(self) -> tuple[int, ...] | None:
        self.deferring = True
        try:
            unit = super()._next_unit()
        finally:
            self.deferring = False
        return unit if unit is not None else super()._next_unit()

    def _branch_windows(self, unit: Sequence[int]) -> bool:
        s = self.structure
        return any(
            any(sum(c in self.file_of for c in s.children.get(k, ())) > 1
                for b in s.serves.get(key, ()) for k in s.full_at.get(b, ()))
            for fid in unit for key in self.files[fid].keys if not s.is_full(key))


class BranchWindowsLastIndex(BudgetedIndex):
    def __init__(self, *args: Any, **options: Any) -> None:
        super().__init__(*args, **options)
        self.reset()

    def reset(self) -> None:
        self.disk = BranchWindowsLastDisk(self.structure)


@dataclass(frozen=True)
class Candidate:
    """A variant of the rule: the index's overflow option, and the index class the curves
    build (patched in while it is measured)."""

    what: str
    overflow: Overflow = Overflow.REFUSE
    index: type[BudgetedIndex] = BudgetedIndex


CANDIDATES = {
    "refuse": Candidate("the rule as it is: a store that does not fit refused whole"),
    "head": Candidate("Overflow.HEAD: the longest prefix-closed head that fits admitted",
                      Overflow.HEAD),
    "prefix-recency": Candidate(PrefixRecencyIndex.__doc__ or "", index=PrefixRecencyIndex),
    "branch-windows-last": Candidate(BranchWindowsLastDisk.__doc__ or "",
                                     index=BranchWindowsLastIndex),
}
"""Every candidate measured for issue #31, by name."""


@contextmanager
def switched(candidate: Candidate) -> Iterator[None]:
    """The curves (disk only and CPU tier in front) build ``candidate``'s index."""
    import reference.disk_economics as de
    import reference.tiered_curve as tc

    old = de.BudgetedIndex, tc.BudgetedIndex
    de.BudgetedIndex = tc.BudgetedIndex = candidate.index  # type: ignore[misc]
    try:
        yield
    finally:
        de.BudgetedIndex, tc.BudgetedIndex = old  # type: ignore[misc]


def served(T: Any, knob: Any, workloads: list[Any], candidate: Candidate) -> list[Any]:
    from reference.disk_economics import miss_ratio_curve

    draws = []
    with switched(candidate):
        for w in workloads:
            curve = miss_ratio_curve(knob.chunking, w, T.POINTS, EvictionRule.REACHABLE,
                                     knob.file_bytes, Layout.PACKED, knob.policy,
                                     overflow=candidate.overflow)
            rule = tuple(curve[i] for i in T.FRACTIONS.values())
            lru = T._curve(knob, w, [e.budget_bytes or 0 for e in rule], EvictionRule.LRU)
            draws.append(T.Draw(w, sum(len(r.prompt) for r in requests(w)), rule, lru, curve))
    return draws


def curve_points(candidate: Candidate) -> dict[str, tuple[float, float, int]]:
    """Every point of the four ``--sweep-disk`` curves (``scripts/disk_curves_cpu.py``'s
    commands, both series) and of ``tests/test_tiered_curve.py``'s draws with the CPU tier
    in front (under the installed release's rules): name -> (rule's hit rate, LRU's,
    rule's stranded bytes)."""
    import disk_curves_cpu as C
    import test_tiered_curve as TC

    from vllm_adapter.releases import RELEASES, installed_version

    out: dict[str, tuple[float, float, int]] = {}
    with switched(candidate):
        for curve in C.CURVES:
            disk = C.run(curve)["disk"]
            for series in ("curve", "cpu_curve"):
                for p in disk[series]:
                    out[f"{curve.model} {curve.workload} {series} {p['budget_bytes']}"] = (
                        p["rule"]["hit_rate"], p["lru"]["hit_rate"],
                        p["rule"]["stranded_bytes"])
        release = installed_version()
        if release is None:
            raise SystemExit("--curves needs vLLM installed (its release's rules)")
        policy = RELEASES[release].policy
        for seed in TC.SEEDS:
            w = TC.drawn(seed)
            for frac in TC.FRACTIONS:
                slots = max(2, TC.keys_of(w) // frac)
                rule = TC.curve(w, slots, EvictionRule.REACHABLE, 8, policy)
                lru = TC.curve(w, slots, EvictionRule.LRU, [e.budget_bytes or 0 for e in rule],
                               policy)
                for e, lr in zip(rule, lru, strict=True):
                    out[f"tiered drawn({seed}) {slots} slots {e.budget_bytes}"] = (
                        e.hit_rate, lr.hit_rate, e.stranded_bytes)
    return out


def compare_curves(names: list[str]) -> None:
    """:func:`curve_points` per candidate: the points behind LRU by more than half a point,
    the points stranding, and, when ``refuse`` is among them, each point a candidate changes
    against it."""
    base = curve_points(CANDIDATES["refuse"]) if "refuse" in names else {}
    for name in names:
        points = base if name == "refuse" else curve_points(CANDIDATES[name])
        behind = [f"{k}: {r:.1%} vs LRU {lr:.1%}" for k, (r, lr, _) in points.items()
                  if r < lr - 0.005]
        strands = [k for k, (_, _, s) in points.items() if s]
        changed = [f"{k}: {points[k][0]:.1%} vs refuse's {base[k][0]:.1%}" for k in base
                   if points[k][0] != base[k][0]]
        print(f"curves, {name}: {len(points)} points, {len(behind)} behind LRU by more than "
              f"half a point, {len(strands)} stranding, {len(changed)} changed against refuse")
        for line in behind + [f"changed: {c}" for c in changed]:
            print(f"    {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", "--overflow", nargs="+", choices=list(CANDIDATES),
                        default=list(CANDIDATES))
    parser.add_argument("--curves", action="store_true", help=(
        "measure the four --sweep-disk curves (both series) and tests/test_tiered_curve.py's "
        "draws behind the CPU tier instead of the drawn workloads"))
    args = parser.parse_args(argv)
    if args.curves:
        sys.path.insert(0, str(ROOT / "scripts"))
        compare_curves(args.candidates)
        return 0

    import test_eviction_vs_lru_property as T

    from vllm_adapter.planning import fixture_knob

    for fixture in T.FIXTURES:
        knob = fixture_knob(fixture, "block_size", 512)
        workloads = [T.drawn_workload(T.BASE_SEED + n) for n in range(T.DRAWS)]
        base = None
        for name in args.candidates:
            draws = served(T, knob, workloads, CANDIDATES[name])
            if name == "refuse":
                base = draws
            losses = T.draw_losses(draws)
            worst = min(d.rule[j].hit_rate - d.lru[j].hit_rate
                        for d in draws for j in range(len(T.FRACTIONS)))
            means = ", ".join(
                f"{f} {sum(d.rule[j].hit_rate for d in draws) / len(draws):.2%} vs "
                f"{sum(d.lru[j].hit_rate for d in draws) / len(draws):.2%}"
                for j, f in enumerate(T.FRACTIONS))
            print(f"{fixture}, {name}: {len(losses)} draw-fractions more than "
                  f"3 points behind LRU, worst {100 * worst:+.1f} points; means (rule vs LRU) "
                  f"{means}; mean shortfalls {len(T.mean_shortfalls(draws))}; stranding points "
                  f"{len(T.stranding(draws))}; stores cut "
                  f"{sum(e.stores_cut for d in draws for e in d.curve)}")
            for line in losses:
                print(f"    {line}")
            if base is None or draws is base:
                continue
            for b, d in zip(base, draws, strict=True):
                for k, (was, now) in enumerate(zip(b.curve, d.curve, strict=True)):
                    if now.offload_hit_tokens != was.offload_hit_tokens:
                        print(f"    {'worse' if now.hit_rate < was.hit_rate else 'better'} "
                              f"than refuse at {k + 1}/{T.POINTS}: {now.hit_rate:.1%} vs "
                              f"{was.hit_rate:.1%} on {d.workload.name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
