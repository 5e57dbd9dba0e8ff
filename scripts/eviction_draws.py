"""The eviction rule against plain LRU on the pinned drawn workloads, per overflow option.

Serves ``tests/test_eviction_vs_lru_property.py``'s draws (``KVCHUNK_PROFILE`` picks how
many: 48 under ``ci``) on gemma-4-31B-it TP2 and DeepSeek-V4-Flash TP4 at ``block_size``
512, under the rule with each ``--overflow`` option (:class:`reference.eviction.Overflow`:
a store that does not fit refused whole, or its longest prefix-closed head admitted) and
under plain LRU at the same sizes (1/8, 1/4 and 1/2 of the rule's unbounded peak), and
prints per geometry: the draw-fractions where the rule trails LRU by more than 3 points
(the module's ``draw_losses``), the worst gap, the mean hit rates, the mean shortfalls,
the rule's curve points with stranded bytes and the stores cut to a head.  Issue #31's
measurements of ``Overflow.HEAD`` (``docs/semantics.md`` section 10) are this output::

    KVCHUNK_VLLM=0.34.0 HF_HUB_OFFLINE=1 KVCHUNK_PROFILE=ci \\
        .nox/tests-vllm-0-34-0/bin/python scripts/eviction_draws.py --overflow refuse head
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from reference.eviction import EvictionRule, Layout, Overflow  # noqa: E402
from reference.workload import requests  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overflow", nargs="+", choices=[o.value for o in Overflow],
                        default=[o.value for o in Overflow])
    args = parser.parse_args(argv)

    import test_eviction_vs_lru_property as T

    from reference.disk_economics import miss_ratio_curve
    from vllm_adapter.planning import fixture_knob

    for fixture in T.FIXTURES:
        knob = fixture_knob(fixture, "block_size", 512)
        workloads = [T.drawn_workload(T.BASE_SEED + n) for n in range(T.DRAWS)]
        for overflow in map(Overflow, args.overflow):
            draws = []
            for w in workloads:
                curve = miss_ratio_curve(knob.chunking, w, T.POINTS, EvictionRule.REACHABLE,
                                         knob.file_bytes, Layout.PACKED, knob.policy,
                                         overflow=overflow)
                rule = tuple(curve[i] for i in T.FRACTIONS.values())
                lru = T._curve(knob, w, [e.budget_bytes or 0 for e in rule], EvictionRule.LRU)
                draws.append(T.Draw(w, sum(len(r.prompt) for r in requests(w)), rule, lru, curve))
            losses = T.draw_losses(draws)
            worst = min(d.rule[j].hit_rate - d.lru[j].hit_rate
                        for d in draws for j in range(len(T.FRACTIONS)))
            means = ", ".join(
                f"{f} {sum(d.rule[j].hit_rate for d in draws) / len(draws):.2%} vs "
                f"{sum(d.lru[j].hit_rate for d in draws) / len(draws):.2%}"
                for j, f in enumerate(T.FRACTIONS))
            print(f"{fixture}, overflow {overflow.value}: {len(losses)} draw-fractions more than "
                  f"3 points behind LRU, worst {100 * worst:+.1f} points; means (rule vs LRU) "
                  f"{means}; mean shortfalls {len(T.mean_shortfalls(draws))}; stranding points "
                  f"{len(T.stranding(draws))}; stores cut "
                  f"{sum(e.stores_cut for d in draws for e in d.curve)}")
            for line in losses:
                print(f"    {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
