"""The disk-budget sections of ``reports/bench.md`` (issues #25, #30): the miss-ratio curve's
speed (``--sweep-disk``), a tier's start time per 100k files, and the eviction overhead
(small files, informational; real section sizes, the target).

Rows: ``disk_curve`` (:mod:`conformance.bench.test_bench_disk_curve`), ``budget_restart``
and ``budget_eviction`` (:mod:`conformance.bench.test_bench_budget`)."""

from __future__ import annotations

from typing import Any

from conformance.bench import TARGETS
from vllm_adapter.render import render_table

__all__ = ["disk_budget_markdown"]

Row = dict[str, Any]


def _verdict(row: Row) -> str:
    target = next((t for t in TARGETS if t.matches(row)), None)
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
    body = [[r["label"], r["workload"], _series(r), f"{r['budget_s']:g}",
             ", ".join(f"{s:.2f}" for s in r["seconds"]), f"{r['median_s']:.2f}",
             _ci(r["ratio"], r["ratio_ci"]), _verdict(r)]
            for r in curve]
    table = render_table(("geometry", "workload", "series", "budget s", "seconds per round",
                          "median s", "time / budget", "verdict"), body)
    return ["### Disk: `python -m vllm_adapter config --sweep-disk` (miss-ratio curve)", "",
            "Targets (issue #31): the CLI's sweep after vLLM's planning (8 disk sizes, the "
            "workload scaled to ~1M prompt tokens, the rule and LRU, block_size 512) within "
            "10 s per curve for the disk alone, and within 20 s with both series (the disk "
            "alone, and with vLLM's CPU tier of `--cpu-bytes` in front); time / budget <= 1.0.",
            "", *table.splitlines(), ""]


def _series(row: Row) -> str:
    """A curve row's series; a row of an older run (the rule's curve alone) says so."""
    series = row.get("series")
    if series is None:
        return "the rule alone (older run)"
    if series == "both":
        return f"both, CPU tier {row['cpu_bytes'] / 2**20:,.0f} MiB"
    return str(series)


_STEPS = {
    "total": "total",
    "scan": "scan",
    "ledger": "ledger",
    "index": "index",
    "index_headers": "index from the headers (no snapshot)",
}


def _step(row: Row, key: str) -> str:
    return _ci(row[key]["s_per_100k"], row[key]["s_per_100k_ci"]) if key in row else "-"


def _snapshot_size(row: Row, name: str, when: str, share: str, instead: str) -> str:
    """A snapshot's size, write time and cap (the row's ``<name>_*`` fields); ``instead``:
    what a tier does when its snapshot would pass the cap."""
    within = row[f"{name}_within_cap"]
    return (f"{row[f'{name}_bytes']:,} bytes ({row[f'{name}_bytes_per_file']:.0f} per file), "
            f"written in {row[f'{name}_write_s_per_100k']:.2f} s per 100k files{when}; "
            + ("within" if within else "over")
            + f" the tier's cap at this budget ({row[f'{name}_cap_bytes']:,} bytes, {share} of "
            "the ledger's reserve)"
            + ("" if within else
               f": with these 4 KiB sections a tier would not write it and would {instead}")
            + ".")


def _restart(row: Row) -> list[str]:
    body = [[text, _step(row, f"cold_{step}"), _step(row, f"warm_{step}")]
            for step, text in _STEPS.items() if f"warm_{step}" in row]
    body.append(["ledger (second start)", "-", _step(row, "warm_ledger_second_start")])
    if "warm_ledger_fallback" in row:
        body.append(["ledger without its snapshot (the journal replayed whole)",
                     _step(row, "cold_ledger_fallback"), _step(row, "warm_ledger_fallback")])
    table = render_table(("step", "cold page cache: s / 100k files",
                          "warm: s / 100k files"), body)
    if row.get("index") == "snapshot":
        target = (f"Target <= 2 s per 100k files, cold page cache: {_verdict(row)}. "
                  if row.get("target_checked") else
                  "Target <= 2 s per 100k files, cold page cache: not checked (the page cache "
                  "could not be dropped). ")
        index = ("index (the index snapshot read and checked, validated against a listing; "
                 "the files it does not describe read from their headers). The snapshot: "
                 + _snapshot_size(row, "snapshot", "", "an eighth",
                                  "start from the headers (last line); sections of 180 KiB "
                                  "and more always fit, 2 MiB ones take about 0.01 % of the "
                                  "files' bytes"))
    else:
        target, index = "Informational. ", "index (one header read per file)."
    if "ledger_snapshot_bytes" in row:
        index += (f" The ledger's snapshot (its model, loaded instead of replaying the journal: "
                  f"{row['ledger_snapshot']}): "
                  + _snapshot_size(row, "ledger_snapshot", " at shutdown", "a sixteenth",
                                   "replay the journal (the last line); sections of 512 KiB "
                                   "and more always fit"))
    return ["### Disk budget: a tier's start over a full root", "",
            f"{target}{row['label']}, packed files of {row['keys_per_file']} sections "
            f"({row['file_bytes']:,} bytes), {row['scaling']}; {row['filesystem']}; "
            f"headline ({row['headline']}): **{row['s_per_100k']:.1f} s per 100k files** "
            f"[{row['s_per_100k_ci'][0]:.1f}, {row['s_per_100k_ci'][1]:.1f}]. Steps: scan "
            f"(list the files), ledger (replay, reconcile, enforce the budget), {index}", "",
            *table.splitlines(), ""]


_PHASES = ("reserve", "write", "complete")


def _eviction(row: Row) -> list[str]:
    body = [[name, f"{row[f'{name}_files_per_s']:.0f}",
             *(f"{row[f'{name}_ms_per_store'].get(p, 0.0):.3f}" for p in _PHASES)]
            for name in ("full", "empty")]
    table = render_table(("root", "files/s", *(f"{p} ms/store" for p in _PHASES)), body)
    confirm = (f"; measured again: {_ci(row['confirm_ratio'], row['confirm_ratio_ci'])}"
               if "confirm_ratio" in row else "")
    return ["### Disk budget: eviction overhead, small files", "",
            f"Informational (issue #30's target is the real-size rows' below): full-root "
            f"throughput / empty-root throughput {_ci(row['ratio'], row['ratio_ci'])}{confirm}. "
            f"{row['label']}, rule {row['rule']}, {row['files_on_full_root']:,} files on the "
            f"full root, every store evicts one; files of {row['file_bytes']:,} bytes "
            f"({row['keys_per_file']} sections of {row['section_bytes']:,}): small files, so "
            f"the ratio is the eviction's fixed cost per store against a "
            f"{row['file_bytes'] // 1024} KiB write.", "",
            *table.splitlines(), ""]


def _section_text(row: Row) -> str:
    scale = row.get("section_scale", 1)
    text = f"{row['section_bytes']:,}"
    if scale != 1:
        text += f" (1/{scale} of the real {row['real_section_bytes']:,})"
    return text


def _eviction_real(rows: list[Row]) -> list[str]:
    if not rows:
        return []
    body = []
    for r in rows:
        confirm = (f", then {_ci(r['confirm_ratio'], r['confirm_ratio_ci'])}"
                   if "confirm_ratio" in r else "")
        body.append([r["label"], _section_text(r), str(r["keys_per_file"]),
                     f"{r['files_on_full_root']:,}",
                     f"{r['full_files_per_s']:.0f} / {r['empty_files_per_s']:.0f}",
                     " / ".join(f"{r['full_ms_per_store'].get(p, 0.0):.2f}" for p in _PHASES),
                     f"{r['full_ms_per_store'].get('unlink', 0.0):.2f}"
                     if "unlink" in r["full_ms_per_store"] else "-",
                     f"{r['files_recycled']:,} / {r['files_evicted']:,}"
                     if "files_recycled" in r else "-",
                     " / ".join(f"{r['empty_ms_per_store'].get(p, 0.0):.2f}" for p in _PHASES),
                     _ci(r["ratio"], r["ratio_ci"]) + confirm, _verdict(r)])
    table = render_table(("geometry", "section bytes", "sections per file", "files on root",
                          "files/s full / empty", "full ms/store (reserve / write / complete)",
                          "of reserve: unlink or rename ms", "evicted files recycled",
                          "empty ms/store", "full / empty", "verdict"),
                         body)
    r0 = rows[0]
    return ["### Disk budget: eviction overhead at real section sizes", "",
            f"Target >= 0.95 (full-root throughput / empty-root throughput; issue #30): the "
            f"full root holds {r0['files_on_full_root']:,} files, its budget exactly full, so "
            f"every store evicts one; {r0['stores_per_round']} stores per round, "
            f"{r0['rounds']} rounds, rule {r0['rule']}; files of one store job's first "
            f"sections (the full-attention key first), {r0['filesystem']}, O_DIRECT "
            f"{'on' if r0['o_direct'] else 'off'}.", "", *table.splitlines(), ""]


def disk_budget_markdown(rows: list[Row]) -> list[str]:
    """The curve speed, restart and eviction-overhead sections (none without their rows)."""
    out = _curve(rows)
    out += [line for r in rows if r["kind"] == "budget_restart" for line in _restart(r)]
    evictions = [r for r in rows if r["kind"] == "budget_eviction"]
    out += [line for r in evictions if r.get("sizes", "small") == "small"
            for line in _eviction(r)]
    out += _eviction_real([r for r in evictions if r.get("sizes") == "real"])
    return out
