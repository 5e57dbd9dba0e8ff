"""The disk-budget sections of ``reports/bench.md`` (issue #25): the miss-ratio curve's
speed (``--sweep-disk``), a tier's start time per 100k files, and the eviction overhead.

Rows: ``disk_curve`` (:mod:`conformance.bench.test_bench_disk_curve`), ``budget_restart``
and ``budget_eviction`` (:mod:`conformance.bench.test_bench_budget`)."""

from __future__ import annotations

from typing import Any

from conformance.bench import TARGETS
from vllm_adapter.render import render_table

__all__ = ["disk_budget_markdown"]

Row = dict[str, Any]


def _verdict(row: Row) -> str:
    target = next((t for t in TARGETS if t.kind == row["kind"]), None)
    if target is None or not target.applies(row):
        return "-"
    verdict = target.verdict(row)
    return verdict if verdict == "met" else f"**{verdict}**"


def _ci(value: float, ci: list[float], fmt: str = ".2f") -> str:
    return f"{value:{fmt}} [{ci[0]:{fmt}}, {ci[1]:{fmt}}]"


def _curve(rows: list[Row]) -> list[str]:
    curve = [r for r in rows if r["kind"] == "disk_curve"]
    if not curve:
        return []
    body = [[r["label"], r["workload"], ", ".join(f"{s:.2f}" for s in r["seconds"]),
             f"{r['median_s']:.2f}", _ci(r["ratio"], r["ratio_ci"]), _verdict(r)]
            for r in curve]
    table = render_table(("geometry", "workload", "seconds per round", "median s",
                          "time / 10 s", "verdict"), body)
    return ["### Disk: `python -m vllm_adapter config --sweep-disk` (miss-ratio curve)", "",
            "Target <= 10 s per curve (time / budget <= 1.0): 8 disk sizes, the workload "
            "scaled to ~1M prompt tokens, the eviction rule, block_size 512.", "",
            *table.splitlines(), ""]


def _restart(row: Row) -> list[str]:
    body = [[step, _ci(row[f"cold_{step}"]["s_per_100k"], row[f"cold_{step}"]["s_per_100k_ci"])
             if f"cold_{step}" in row else "-",
             _ci(row[f"warm_{step}"]["s_per_100k"], row[f"warm_{step}"]["s_per_100k_ci"])]
            for step in ("total", "scan", "ledger", "index")]
    body.append(["ledger (second start)", "-",
                 _ci(row["warm_ledger_second_start"]["s_per_100k"],
                     row["warm_ledger_second_start"]["s_per_100k_ci"])])
    table = render_table(("step", "cold page cache: s / 100k files",
                          "warm: s / 100k files"), body)
    return ["### Disk budget: a tier's start over a full root", "",
            f"Informational. {row['label']}, packed files of {row['keys_per_file']} sections "
            f"({row['file_bytes']:,} bytes), {row['scaling']}; {row['filesystem']}; "
            f"headline ({row['headline']}): **{row['s_per_100k']:.1f} s per 100k files** "
            f"[{row['s_per_100k_ci'][0]:.1f}, {row['s_per_100k_ci'][1]:.1f}]. Steps: scan "
            "(list the files), ledger (replay, reconcile, enforce the budget), index (one "
            "header read per file).", "", *table.splitlines(), ""]


def _eviction(row: Row) -> list[str]:
    phases = ("reserve", "write", "complete")
    body = [[name, f"{row[f'{name}_files_per_s']:.0f}",
             *(f"{row[f'{name}_ms_per_store'].get(p, 0.0):.3f}" for p in phases)]
            for name in ("full", "empty")]
    table = render_table(("root", "files/s", *(f"{p} ms/store" for p in phases)), body)
    confirm = (f"; measured again: {_ci(row['confirm_ratio'], row['confirm_ratio_ci'])}"
               if "confirm_ratio" in row else "")
    return ["### Disk budget: eviction overhead", "",
            f"Target >= 0.9 (full-root throughput / empty-root throughput): "
            f"{_ci(row['ratio'], row['ratio_ci'])}{confirm}: {_verdict(row)}. "
            f"{row['label']}, rule {row['rule']}, {row['files_on_full_root']:,} files on the "
            f"full root, every store evicts one; files of {row['file_bytes']:,} bytes "
            f"({row['keys_per_file']} sections of {row['section_bytes']:,}): small files, so "
            f"the ratio is the eviction's fixed cost per store against a {row['file_bytes'] // 1024} KiB write; "
            "a real section (MiB) writes for milliseconds, not measured here.", "",
            *table.splitlines(), ""]


def disk_budget_markdown(rows: list[Row]) -> list[str]:
    """The curve speed, restart and eviction-overhead sections (none without their rows)."""
    out = _curve(rows)
    for kind, render in (("budget_restart", _restart), ("budget_eviction", _eviction)):
        out += [line for r in rows if r["kind"] == kind for line in render(r)]
    return out
