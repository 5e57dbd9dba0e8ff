"""Write README.md's generated regions from ``reports/`` and real CLI runs (``nox -s docs``).

The README states figures about performance and about ``python -m vllm_adapter config``'s
output only inside marked regions::

    <!-- generated:NAME -->...<!-- /generated:NAME -->

and this script is what writes them; the prose around them is hand-written.  Two sources:

* **bench** regions: ``reports/bench.json`` (rows by ``kind``: a kind the report lacks is
  "not measured", never an error), the target verdicts of :data:`conformance.bench.TARGETS`
  on those rows, and ``reports/bench.md`` for the one fact the JSON does not record (which
  payload checksum the checksummed-tier table ran with);
* **report** regions: the mutation score of ``reports/conformance-<release>.md``, one report
  per supported release (the meta lane's "Score (caught by assertion / non-equivalent
  mutants)" line and its survivors; a report or a score missing is "not measured");
* **cli** regions: :data:`SAMPLES`, each run through the CLI in-process (its parser,
  :func:`vllm_adapter.cli.validate`, :func:`~vllm_adapter.cli.plan`,
  :func:`~vllm_adapter.cli.render`, i.e. ``main`` without the process) on the stored model
  configs under ``vllm_adapter/models/``: an excerpt of the table output, and sentences from
  the same run's JSON.  They are the newest supported release's output, so they run only
  under it.

::

    python scripts/gen_readme.py              # rewrite README.md (bench and cli regions)
    python scripts/gen_readme.py --check      # exit 1, naming each region that differs
    python scripts/gen_readme.py --bench-only # only the bench regions (no vLLM needed)

``tests/test_readme.py`` fails when a region differs from what this script produces.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.metadata
import json
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

from conformance.bench import (  # noqa: E402
    GEOMETRIES,
    SHARE_OF_BOUND,
    TARGETS,
    Target,
    proposed_target,
)
from vllm_adapter.disk.chunk_file import CHECKSUM  # noqa: E402
from vllm_adapter.release_list import SUPPORTED_RELEASES  # noqa: E402

README = ROOT / "README.md"
GPU_CI = ROOT / "docs" / "gpu-ci.md"
OTHER_DOCS = {"conformance-timing": GPU_CI}
"""Regions that live in another document than the README, by name."""
BENCH_JSON = ROOT / "reports" / "bench.json"
BENCH_MD = ROOT / "reports" / "bench.md"
REPORTS = ROOT / "reports"

REGION = re.compile(
    r"<!-- generated:(?P<name>[\w-]+) -->(?P<body>.*?)<!-- /generated:(?P=name) -->", re.S
)
NOT_MEASURED = "not measured"
Row = dict[str, Any]


# ---------------------------------------------------------------------------
# Regions
# ---------------------------------------------------------------------------


def read_regions(text: str) -> dict[str, str]:
    """Each region's body by name (a name used twice is an error)."""
    out: dict[str, str] = {}
    for m in REGION.finditer(text):
        if m["name"] in out:
            raise ValueError(f"README region {m['name']!r} appears twice")
        out[m["name"]] = m["body"]
    return out


def fill(text: str, bodies: Mapping[str, str]) -> str:
    """``text`` with each named region's body replaced; every name must have its region."""
    missing = sorted(set(bodies) - set(read_regions(text)))
    if missing:
        raise ValueError(f"README has no region {', '.join(missing)}: add the markers")

    def body(m: re.Match[str]) -> str:
        name = m["name"]
        new = bodies.get(name, m["body"])
        return f"<!-- generated:{name} -->{new}<!-- /generated:{name} -->"

    return REGION.sub(body, text)


def _block(lines: Iterable[str]) -> str:
    """A multi-line region body: its own lines between the markers."""
    return "\n" + "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# bench regions
# ---------------------------------------------------------------------------


def _rows(bench: Mapping[str, Any], kind: str) -> list[Row]:
    return [
        dict(b["extra_info"])
        for b in bench.get("benchmarks", [])
        if (b.get("extra_info") or {}).get("kind") == kind
    ]


def _target(kind: str) -> Target:
    return next(t for t in TARGETS if t.kind == kind)


def _counts(target: Target, rows: Sequence[Row]) -> tuple[str, dict[str, int], int]:
    """The target's overall verdict, the count per verdict and the figures it applies to."""
    checked = [r for r in rows if target.applies(r)]
    counts = {v: sum(target.verdict(r) == v for r in checked) for v in ("met", "inconclusive", "missed")}
    overall = "missed" if counts["missed"] else "inconclusive" if counts["inconclusive"] else "met"
    return overall, counts, len(checked)


def _count_text(target: Target, rows: Sequence[Row]) -> str:
    overall, c, n = _counts(target, rows)
    word = "**missed**" if overall == "missed" else overall
    return f"{word} ({c['met']} met, {c['inconclusive']} inconclusive, {c['missed']} missed of {n})"


def _verdict_counts(c: Mapping[str, int]) -> str:
    return ", ".join(f"{c.get(v, 0)} {v}" for v in ("met", "inconclusive", "missed"))


def _range(values: Iterable[float], fmt: str = "{:.2f}") -> str:
    vals = sorted(values)
    low, high = fmt.format(vals[0]), fmt.format(vals[-1])
    return low if low == high else f"{low}-{high}"


def _order(geometry: str) -> int:
    """Geometries in :data:`~conformance.bench.GEOMETRIES` order (unknown ones last)."""
    names = list(GEOMETRIES)
    return names.index(geometry) if geometry in names else len(names)


def _label(row: Row) -> str:
    return str(row.get("label") or GEOMETRIES.get(row["geometry"], row["geometry"]))


def _ratio_ci(row: Row) -> str:
    low, high = row["ratio_ci"]
    return f"{row['ratio']:.2f} [{low:.2f}, {high:.2f}]"


def checksum_of_report(bench_md: str, rows: Sequence[Row]) -> str | None:
    """The payload checksum the checksummed-tier figures ran with (row field, else bench.md)."""
    for r in rows:
        if r.get("checksum"):
            return str(r["checksum"])
    m = re.search(r"each kvchunk file is ([\w-]+)-checked", bench_md) or re.search(
        r"default checksum \(([\w-]+);", bench_md
    )
    return m[1].lower() if m else None


def _checksum_region(bench: Mapping[str, Any], bench_md: str, date: str) -> str:
    rows = _rows(bench, "disk_checksum")
    target = _target("disk_checksum")
    if not rows:
        return (
            f"the checksummed tier against vLLM's plain one: {NOT_MEASURED} in the last "
            f"`nox -s bench` ({date}, `reports/bench.md`)."
        )
    algo = checksum_of_report(bench_md, rows)
    ran_with = f"each file checked with {algo.upper()}" if algo else "its checksum not recorded"
    overall, c, n = _counts(target, rows)
    missed = [r for r in rows if target.applies(r) and target.verdict(r) == "missed"]
    text = (
        f"the last `nox -s bench` ({date}; `reports/bench.md`, \"Disk: kvchunk's checksummed fs "
        f"tier vs vLLM's plain fs tier\", {ran_with}) measured it against a target of "
        f"{target.min_ratio} x vLLM's plain tier at {target.min_blocks_per_chunk}+ blocks per "
        f"chunk: {'**not met**' if overall != 'met' else 'met'}: {c['met']} met, "
        f"{c['inconclusive']} inconclusive (the interval straddles the target) and "
        f"{c['missed']} missed of {n} figures"
    )
    if missed:
        text += " (" + "; ".join(
            f"{_label(r)} {r['direction']} at B={r['blocks_per_chunk']}: {_ratio_ci(r)}"
            + (
                f", {r['confirm_ratio']:.2f} [{r['confirm_ratio_ci'][0]:.2f}, "
                f"{r['confirm_ratio_ci'][1]:.2f}] measured again"
                if "confirm_ratio_ci" in r else ""
            )
            for r in missed
        ) + ")"
    text += "."
    if algo is not None and algo != CHECKSUM:
        text += (
            f" The tier's default payload checksum is now {CHECKSUM.upper()}; no bench has "
            "measured the tier with it yet, so no verdict is claimed for it."
        )
    return text


def _files_region(bench: Mapping[str, Any]) -> str:
    """The file-economics table (smallest and largest chunk per geometry) with its workload."""
    rows = [r for r in _rows(bench, "files") if str(r.get("knob", "")).startswith("blocks_per_chunk")]
    if not rows:
        return f"File economics: {NOT_MEASURED} in `reports/bench.json`."
    wl = rows[0]["workload"]
    out = [
        f"**File economics, the seed's question** (vLLM's fs tier writes one file per chunk per "
        f"group; the `{wl['name']}` workload preset ({wl['shape']}) served by "
        f"`reference.economics` as `python -m vllm_adapter config --workload {wl['name']}` "
        f"prints it, in `reports/bench.md`; a load counts as a file read):",
        "",
    ]
    by_geometry: dict[str, list[Row]] = {}
    for r in rows:
        by_geometry.setdefault(r["geometry"], []).append(r)
    smallest = min(r["blocks_per_chunk"] for r in rows)
    largest = max(r["blocks_per_chunk"] for r in rows)
    out += [
        f"| per million prompt tokens | smallest chunk (B={smallest}) | largest chunk (B={largest}) |",
        "|---|---|---|",
    ]

    def cell(r: Row | None) -> str:
        if r is None:
            return NOT_MEASURED
        return (
            f"{r['files_written_per_million']:,.0f} files of {r['file_bytes'] / 2**20:.2f} MiB "
            f"written, {r['files_read_per_million']:,.0f} read; "
            f"{r['recomputed_per_million']:,.0f} tokens recomputed"
        )

    for mine in by_geometry.values():
        by_b = {r["blocks_per_chunk"]: r for r in mine}
        out.append(f"| {_label(mine[0])} | {cell(by_b.get(smallest))} | {cell(by_b.get(largest))} |")
    return _block(out)


def _bound_region(bench: Mapping[str, Any]) -> str:
    """Per disk model of the file-economics rows: where each geometry is IOPS-bound."""
    rows = sorted(
        (r for r in _rows(bench, "files") if str(r.get("knob", "")).startswith("blocks_per_chunk")),
        key=lambda r: (_order(r["geometry"]), r["blocks_per_chunk"]),
    )
    if not rows:
        return f"Disk bounds: {NOT_MEASURED}."
    out = []
    for name, model in rows[0]["models"].items():
        parts = []
        for geometry in dict.fromkeys(r["geometry"] for r in rows):
            mine = [r for r in rows if r["geometry"] == geometry]
            iops = [r for r in mine if r["modelled"][name]["bound"] == "IOPS"]
            label = _label(mine[0])
            if not iops:
                parts.append(f"{label} is bandwidth-bound at every B measured")
            else:
                parts.append(
                    f"{label} is IOPS-bound at B={', '.join(str(r['blocks_per_chunk']) for r in iops)} "
                    f"({', '.join(format(r['modelled'][name]['gbps'], '.2f') for r in iops)} GB/s)"
                )
        out.append(
            f"* {name} ({model['file_latency_s'] * 1e3:.1f} ms per file, {model['concurrency']} "
            f"threads, {model['bandwidth_bps'] / 1e9:.2f} GB/s): " + "; ".join(parts) + "."
        )
    return _block(out)


def _bullet_transfer(bench: Mapping[str, Any]) -> str:
    rows = _rows(bench, "transfer")
    t = _target("transfer")
    if not rows:
        return f"**Transfer**: {NOT_MEASURED}."
    checked = [r for r in rows if t.applies(r)]
    return (
        f"**Transfer** (reference gather/scatter vs one contiguous copy of the same bytes; target "
        f">= {t.min_ratio} for `blocks_per_chunk` >= {t.min_blocks_per_chunk}): "
        f"{_count_text(t, rows)}; ratios {_range(r['ratio'] for r in checked)} "
        f"({_range((r['candidate_gbps'] for r in checked), '{:.1f}')} GB/s)."
    )


def _bullet_oracle(bench: Mapping[str, Any]) -> str:
    rows = _rows(bench, "oracle")
    t = _target("oracle")
    if not rows:
        return f"**Oracle**: {NOT_MEASURED}."
    checked = [r for r in rows if t.applies(r)]
    others = [r for r in rows if not t.applies(r)]
    text = (
        f"**Oracle** (the reference's replay and comparison per scheduler step vs vLLM's "
        f"scheduler with the stock connector, 32k-token prompts; target <= {t.max_ratio} for "
        f"B >= {t.min_blocks_per_chunk}): {_count_text(t, rows)}; ratios "
        f"{_range(r['ratio'] for r in checked)}"
    )
    if others:
        text += "; not gated: " + ", ".join(
            f"{_label(r)} B={r['blocks_per_chunk']} {r['ratio']:.2f}" for r in others
        )
    return text + "."


def _bullet_disk(bench: Mapping[str, Any]) -> str:
    rows = _rows(bench, "disk")
    if not rows:
        return f"**Disk** (informational): {NOT_MEASURED}."
    parts = []
    for d in ("write", "read"):
        mine = [r["ratio"] for r in rows if r["direction"] == d]
        if mine:
            parts.append(f"{d}s {_range(mine)}x one sequential file")
    return (
        "**Disk** (informational): vLLM's own fs-tier I/O functions and thread pool vs one "
        f"sequential file of the same bytes: {', '.join(parts)}."
    )


def _bullet_checksummed(bench: Mapping[str, Any]) -> str:
    rows = _rows(bench, "disk_checksum")
    t = _target("disk_checksum")
    if not rows:
        return f"**Checksummed fs tier** vs vLLM's plain one: {NOT_MEASURED}."
    return (
        f"**Checksummed fs tier** vs vLLM's plain one (target >= {t.min_ratio} for B >= "
        f"{t.min_blocks_per_chunk}): {_count_text(t, rows)}; see the disk variant above."
    )


_PACKED_KINDS = (
    "packed_files_written",
    "packed_read_opens",
    "packed_bytes_written",
    "packed_time",
    "packed_time_metadata",
)


def _bullet_packed(bench: Mapping[str, Any]) -> str:
    """Each packed target's verdicts (a kind may have several: the metadata-bound file
    system's store and load targets), rows whose target is above the emulated mount's
    bound said apart, and the rows no target covers (10,000 operations/s) by rate."""
    present = [k for k in _PACKED_KINDS if _rows(bench, k)]
    if not present:
        return f"**Packed fs tier** vs vLLM's per-chunk tier: {NOT_MEASURED}."
    parts = []
    for kind in _PACKED_KINDS:
        rows = _rows(bench, kind)
        for t in (t for t in TARGETS if t.kind == kind):
            mine = [r for r in rows if t.matches(r)]
            if not mine:
                parts.append(f"{t.text}: {NOT_MEASURED}")
                continue
            text = f"{t.text}: {_count_text(t, mine)}, ratios {_range(r[t.field] for r in mine)}"
            above = [r for r in mine if r.get("target_above_bound")]
            if above:
                proposed = Counter(proposed_target(r)[1] for r in above)
                text += (f" ({len(above)} of {len(mine)} with the target above the mount's "
                         "bound: a wrong target, not a miss; against the proposed "
                         f"{SHARE_OF_BOUND:g} x the bound: {_verdict_counts(proposed)})")
            parts.append(text)
        free = [r for r in rows if not any(t.matches(r) for t in TARGETS)]
        for rate in sorted({r["ops_per_s"] for r in free if "ops_per_s" in r}):
            at = [r for r in free if r.get("ops_per_s") == rate]
            parts.append(f"on the emulated metadata-bound file system at {rate:,} operations/s "
                         f"(no target): ratios {_range(r['ratio'] for r in at)}")
    return "**Packed fs tier** vs vLLM's per-chunk tier: " + "; ".join(parts) + "."


def _bullet_suite(bench: Mapping[str, Any]) -> str:
    rows = _rows(bench, "suite")
    if not rows:
        return f"**Suite speed** (informational): {NOT_MEASURED}."
    return (
        "**Suite speed** (informational): the oracle replays plan-lane examples "
        f"{_range((r['ratio'] for r in rows), '{:.0f}')}x faster than vLLM produces them."
    )


def _bullet_gpu(bench: Mapping[str, Any], env: Mapping[str, Any]) -> str:
    rows = _rows(bench, "gpu")
    t = _target("gpu")
    if not rows:
        why = env.get("gpu")
        return f"**GPU** (target >= {t.min_ratio} of pinned `cudaMemcpyAsync`): {NOT_MEASURED}" + (
            f": {why}." if why else "."
        )
    return (
        f"**GPU** (vLLM's worker vs pinned `cudaMemcpyAsync`, target >= {t.min_ratio} for B >= "
        f"{t.min_blocks_per_chunk}; {rows[0].get('device', '?')}): {_count_text(t, rows)}."
    )


def _bullet_sweep(bench: Mapping[str, Any]) -> str:
    rows = _rows(bench, "sweep")
    t = _target("sweep")
    if not rows:
        return f"**Sweep** (`python -m vllm_adapter config --sweep`): {NOT_MEASURED}."
    budget = rows[0]["budget_s"]
    return (
        f"**Sweep** (`python -m vllm_adapter config --sweep` after vLLM's planning: "
        f"{len(rows[0]['points'])} knob values, the `{rows[0]['workload']}` preset; target <= "
        f"{budget:g} s): {_count_text(t, rows)}; "
        + ", ".join(f"{_label(r)} {r['median_s']:.1f} s median" for r in rows)
        + "."
    )


def _bullet_budget(bench: Mapping[str, Any]) -> str:
    """The disk budget's figures (issues #25, #30): curve speed, start time, eviction overhead
    (small files, informational; real section sizes, the target)."""
    curve, start, evict = (_rows(bench, k) for k in ("disk_curve", "budget_restart",
                                                      "budget_eviction"))
    if not (curve or start or evict):
        return f"**Disk budget**: {NOT_MEASURED}."
    parts = []
    if curve:
        for t in (t for t in TARGETS if t.kind == "disk_curve"):
            rows = [r for r in curve if t.matches(r)]
            if rows:
                parts.append(f"`--sweep-disk`, {rows[0]['series']} (8 sizes, ~1M tokens, the "
                             f"rule and LRU; target <= {rows[0]['budget_s']:g} s per curve): "
                             f"{_count_text(t, rows)}, "
                             f"{_range((r['median_s'] for r in rows), '{:.1f}')} s median")
    for r in start:
        lo, hi = r["s_per_100k_ci"]
        checked = [t for t in TARGETS if t.matches(r)]
        target = (f"target <= 2 s per 100k files: {_count_text(checked[0], [r])}; "
                  if checked else "informational; ")
        parts.append(f"a tier's start over a full root ({target}{r['scaling']}, "
                     f"{r['headline']}): {r['s_per_100k']:.1f} s per 100k files [{lo:.1f}, {hi:.1f}]")
    small = [r for r in evict if r.get("sizes", "small") == "small"]
    real = [r for r in evict if r.get("sizes") == "real"]
    if small:
        parts.append(f"eviction overhead (store throughput with the budget full / empty, "
                     f"informational: files of {small[0]['file_bytes'] // 1024} KiB, "
                     f"{small[0]['files_on_full_root']:,} files on the root): "
                     + ", ".join(_ratio_ci(r) for r in small))
    target = next(t for t in TARGETS if t.kind == "budget_eviction")
    if real:
        parts.append(f"eviction overhead at real section sizes ({real[0]['files_on_full_root']:,} "
                     f"files on the root; target >= {target.min_ratio}): "
                     f"{_count_text(target, real)}, "
                     + ", ".join(f"{_label(r)} {_ratio_ci(r)}" for r in real))
    else:
        parts.append(f"eviction overhead at real section sizes (target >= {target.min_ratio}): "
                     f"{NOT_MEASURED}")
    return "**Disk budget**: " + "; ".join(parts) + "."


def _results_region(bench: Mapping[str, Any]) -> str:
    env = bench.get("kvchunk", {}).get("environment", {})
    head = (
        f"Last run: {env.get('date', bench.get('datetime', '?'))} on {env.get('machine', '?')}, "
        f"vLLM {env.get('vllm', '?')}, torch {env.get('torch', '?')}; load average "
        f"{env.get('loadavg_start', '?')} at start, {env.get('loadavg_end', '?')} at end:"
    )
    bullets = [
        _bullet_transfer(bench),
        _bullet_oracle(bench),
        _bullet_disk(bench),
        _bullet_checksummed(bench),
        _bullet_packed(bench),
        _bullet_suite(bench),
        _bullet_gpu(bench, env),
        _bullet_sweep(bench),
        _bullet_budget(bench),
    ]
    return _block([head, "", *(f"* {b}" for b in bullets)])


def bench_regions(bench: Mapping[str, Any], bench_md: str) -> dict[str, str]:
    """The bench regions' bodies from ``reports/bench.json`` (and ``bench.md``)."""
    date = bench.get("kvchunk", {}).get("environment", {}).get("date") or bench.get("datetime", "?")
    return {
        "bench-checksum": _checksum_region(bench, bench_md, date),
        "bench-files": _files_region(bench),
        "bench-bounds": _bound_region(bench),
        "bench-results": _results_region(bench),
    }


# ---------------------------------------------------------------------------
# report regions
# ---------------------------------------------------------------------------

_SCORE = re.compile(
    r"^Score \(caught by assertion / non-equivalent mutants\): (?P<caught>\d+)/(?P<scored>\d+)\b",
    re.M,
)
_NUMBER_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def mutation_score(report_md: str) -> tuple[int, int, list[str]] | None:
    """The meta lane's score in a conformance report (``conformance/report.py``
    ``mutation_section``): (caught by assertion, non-equivalent mutants, the survivors'
    reasons), or None when the report has no score."""
    m = _SCORE.search(report_md)
    if m is None:
        return None
    rest = report_md[m.end():].split("\n## ", 1)[0]
    survivors = re.findall(r"^- `[\w-]+`: (.*)$", rest, re.M)
    return int(m["caught"]), int(m["scored"]), survivors


def load_conformance_reports() -> dict[str, str]:
    """``reports/conformance-<release>.md`` per supported release ("" where there is none)."""
    out = {}
    for release in SUPPORTED_RELEASES:
        path = REPORTS / f"conformance-{release}.md"
        out[release] = path.read_text() if path.exists() else ""
    return out


def _mutation_region(reports: Mapping[str, str]) -> str:
    scores = {release: mutation_score(md) for release, md in reports.items()}
    files = ", ".join(f"`reports/conformance-{r}.md`" for r in reports)
    if any(s is None for s in scores.values()):
        missing = ", ".join(f"vLLM {r}" for r, s in scores.items() if s is None)
        return f"{NOT_MEASURED} in {files} ({missing} has no score)"
    measured = {r: s for r, s in scores.items() if s is not None}
    pairs = {(c, n) for c, n, _ in measured.values()}
    if len(pairs) == 1:
        ((caught, scored),) = pairs
        where = "both releases" if len(measured) == 2 else "every release"
        text = f"{caught} of {scored} on {where} ({files})"
    else:
        text = "; ".join(f"{c} of {n} on vLLM {r}" for r, (c, n, _) in measured.items())
        text += f" ({files})"
    survivors = measured[list(measured)[-1]][2]  # the newest release's
    n = len(survivors)
    if n == 0:
        return text + "; every mutant is caught"
    count = _NUMBER_WORDS[n] if n < len(_NUMBER_WORDS) else str(n)
    noun = "survivor" if n == 1 else "survivors"
    if all("assert" in reason for reason in survivors):
        verb = "only makes" if n == 1 else "only make"
        return f"{text}; the {count} {noun} {verb} vLLM's own code assert before any answer differs"
    named = "is named" if n == 1 else "are named"
    return f"{text}; the {count} {noun} {named} in the reports with why"


_TIMING = re.compile(
    r"^Wall time (?P<wall>\d+) s \((?P<procs>[^)]*)\); cases' seconds summed "
    r"(?P<summed>\d+) s; longest case (?P<longest>[\d.]+) s \(`(?P<case>[^`]*)`\); "
    r"largest xdist group (?P<group_s>\d+) s \(`(?P<group>[^`]*)`[^)]*\)\. "
    r"Setups waited (?P<waited>\d+) s",
    re.M,
)


@dataclass(frozen=True)
class SuiteTiming:
    """A conformance report's timing line (``conformance/report.py`` ``timings``)."""

    wall_s: int
    processes: str
    summed_s: int
    longest_s: float
    longest_case: str
    group_s: int
    group: str
    waited_s: int
    """Seconds the run's setups waited for another process's economics lane (CI runs both
    releases' chains at once): part of the wall time, not of the suite's own."""

    def expected_s(self, workers: int) -> int:
        """The wall time ``-n workers`` implies: the summed seconds shared out, never below
        the longest case or the largest group one worker runs whole, plus the serial run's
        wall time over its summed seconds (the start, collection and report) once."""
        own_wall = self.wall_s - self.waited_s
        overhead = max(own_wall - self.summed_s, 0) if self.processes == "one process" else 0
        return round(max(self.summed_s / workers, self.longest_s, self.group_s) + overhead)


def suite_timing(report_md: str) -> SuiteTiming | None:
    m = _TIMING.search(report_md)
    if m is None:
        return None
    return SuiteTiming(int(m["wall"]), m["procs"], int(m["summed"]), float(m["longest"]),
                       m["case"], int(m["group_s"]), m["group"], int(m["waited"]))


def _timing_region(reports: Mapping[str, str]) -> str:
    timings = {release: suite_timing(md) for release, md in reports.items()}
    lines = []
    for release, t in timings.items():
        where = f"`reports/conformance-{release}.md`"
        if t is None:
            lines.append(f"* vLLM {release}: {NOT_MEASURED} ({where} has no timing line).")
            continue
        waited = (f" ({t.waited_s} s of it waiting for the other release's economics lanes)"
                  if t.waited_s else "")
        lines.append(
            f"* vLLM {release} ({where}): {t.wall_s} s wall in {t.processes}{waited}, the cases' "
            f"seconds summed {t.summed_s} s, the longest case {t.longest_s:.0f} s "
            f"(`{t.longest_case}`), the largest group one worker runs whole {t.group_s} s "
            f"(`{t.group}`). Expected wall time: about {t.expected_s(2)} s with `-n 2`, "
            f"{t.expected_s(8)} s with `-n 8`, {t.expected_s(32)} s with `-n 32` (the summed "
            "seconds shared out, never below the longest case or that group, plus the start)."
        )
    return _block(lines)


def report_regions(reports: Mapping[str, str]) -> dict[str, str]:
    """The report regions' bodies from ``reports/conformance-<release>.md``."""
    return {"meta-mutation-score": _mutation_region(reports),
            "conformance-timing": _timing_region(reports)}


# ---------------------------------------------------------------------------
# cli regions
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """A CLI run the README shows: its argument lines and which parts of the output to keep."""

    name: str
    lines: tuple[tuple[str, ...], ...]
    """``config``'s arguments, one tuple per printed line."""
    keep_labels: tuple[str, ...]
    """Summary lines kept, by their label (the first word of a ``label  value`` line)."""
    keep_sections: tuple[str, ...]
    """Paragraphs kept whole, by how their first line starts (a kept paragraph ending
    with ``:`` keeps the next one too)."""

    @property
    def argv(self) -> list[str]:
        return ["config", *(a for line in self.lines for a in line)]

    def command(self) -> str:
        first, *rest = (" ".join(line) for line in self.lines)
        return " \\\n    ".join([f"$ python -m vllm_adapter config {first}", *rest])


_GEMMA = ("--model", "vllm_adapter/models/gemma-4-31B-it")
_DSV4 = ("--model", "vllm_adapter/models/DeepSeek-V4-Flash")
_DSV4_ENGINE = ("--tensor-parallel-size", "4", "--kv-cache-dtype", "fp8", "--block-size-gpu", "256")
_CONFIG_KEEP = dict(
    keep_labels=("knob", "CPU tier", "files"),
    keep_sections=("group  kind", "--kv-transfer-config:"),
)

SAMPLES: tuple[Sample, ...] = (
    Sample(
        "cli-config-gemma",
        (_GEMMA, ("--tensor-parallel-size", "2", "--block-size", "512", "--cpu-bytes", "25GiB")),
        **_CONFIG_KEEP,
    ),
    Sample(
        "cli-config-dsv4",
        (_DSV4, _DSV4_ENGINE, ("--chunk-bytes", "16MiB", "--cpu-bytes", "25GiB")),
        **_CONFIG_KEEP,
    ),
    Sample(
        "cli-sweep",
        (_DSV4, _DSV4_ENGINE, ("--block-size", "512", "--workload", "agentic", "--sweep")),
        keep_labels=("knob", "workload", "rules", "per 1M", "per-group"),
        keep_sections=("sweep of", "local disk: no longer"),
    ),
)


DISK_CURVE = Sample(
    "cli-disk-curve",
    (_GEMMA, ("--tensor-parallel-size", "2", "--block-size", "512", "--workload", "agentic",
              "--cpu-bytes", "8GiB", "--sweep-disk")),
    keep_labels=(), keep_sections=(),
)
"""The README's miss-ratio curve: both series (the disk only, and vLLM's CPU tier in front)."""


def _disk_curve(data: Mapping[str, Any]) -> str:
    """The two series of ``--sweep-disk --cpu-bytes`` as a table, from the run's JSON."""
    disk = data["disk"]

    def stranded(p: Mapping[str, Any]) -> str:
        return f"{_mib(p['rule']['stranded_bytes'])} / {_mib(p['lru']['stranded_bytes'])}"

    rows = [
        f"| {_mib(a['budget_bytes'])} | {a['rule']['hit_rate']:.1%} | {a['lru']['hit_rate']:.1%} | "
        f"{stranded(a)} | {b['rule']['hit_rate']:.1%} | {b['lru']['hit_rate']:.1%} | {stranded(b)} |"
        for a, b in zip(disk["curve"], disk["cpu_curve"], strict=True)
    ]
    command = "python -m vllm_adapter config " + " ".join(a for line in DISK_CURVE.lines for a in line)
    return _block([
        f"`{command}` (vLLM {data['vllm']['version']}; {disk['workload']}, "
        f"{disk['prompt_tokens']:,} prompt tokens, GPU prefix cache cold; CPU tier in front: "
        f"{_mib(disk['cpu_bytes'])}, {disk['cpu_chunks']} chunk slots; hit rate: prompt tokens "
        "an offload tier served; stranded: bytes on disk at the end no lookup can load from "
        "the disk alone, the rule / LRU):",
        "",
        "| disk | disk only: rule | disk only: LRU | disk only: stranded | CPU tier in front: "
        "rule | CPU tier in front: LRU | CPU tier in front: stranded |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
    ])


def excerpt(output: str, sample: Sample) -> list[str]:
    """The kept lines of a table output; ``  ...`` where lines were left out.

    The output's first paragraph is its summary, one ``label text`` line each (the label
    padded to 9 characters: :func:`vllm_adapter.cli.render.render_text`); the other
    paragraphs are tables and notes.
    """
    summary, *paragraphs = output.strip("\n").split("\n\n")
    summary_lines = summary.splitlines()
    out = [line for line in summary_lines if line[:9].rstrip() in sample.keep_labels]
    skipped = len(out) < len(summary_lines)
    keep_next = False
    for paragraph in paragraphs:
        lines = paragraph.splitlines()
        if not (keep_next or lines[0].startswith(sample.keep_sections)):
            skipped, keep_next = True, False
            continue
        out.append("  ..." if skipped else "")
        out.extend(lines)
        skipped = False
        keep_next = lines[-1].endswith(":") and len(lines) == 1
    return out


def run_cli(argv: Sequence[str]) -> tuple[str, dict[str, Any]]:
    """The CLI's table output and its JSON for one run (one planning, rendered twice)."""
    from vllm_adapter.cli import build_parser, plan, render, validate

    with contextlib.chdir(ROOT):
        request = validate(build_parser().parse_args(list(argv)))
        sizing = plan(request)
        return render(sizing, "table"), json.loads(render(sizing, "json"))


def _mib(n: int) -> str:
    from vllm_adapter.cli.render import human_bytes

    return human_bytes(n)


def _point(sweep: Mapping[str, Any], value: int) -> Mapping[str, Any]:
    name = sweep["knob_name"]
    return next(p for p in sweep["points"] if p["knob"].get(name) == value)


def _sweep_sentences(data: Mapping[str, Any]) -> dict[str, str]:
    """Sentences the README says about the sweep sample, from its JSON."""
    sweep, traffic = data["sweep"], data["traffic"]
    name = sweep["knob_name"]
    points = sweep["points"]
    workload = data["workload"]["name"]
    first = points[0]
    at = {p["knob"][name]: p for p in points}

    def files(p: Mapping[str, Any]) -> float:
        return float(p["traffic"]["files_written_per_million"])

    knees = []
    for k in sweep["knees"]:
        value = k["knob"][name]
        p = at[value]
        if p is first:
            knees.append(f"{k['fs_model']} is bandwidth-bound already at {name} {value}")
        else:
            knees.append(
                f"{k['fs_model']} wants {name} {value} ({files(first) / files(p):.1f}x fewer files "
                f"written than {first['knob'][name]} for "
                f"{p['traffic']['recomputed_per_million'] - first['traffic']['recomputed_per_million']:,.0f}"
                " more recomputed tokens per million)"
            )
    reading = "On this run (`" + workload + "`): " + "; ".join(knees) + "."
    pg = data.get("per_group_map") or {}
    if pg.get("valid") and pg.get("traffic"):
        other = pg["traffic"]
        reading += (
            f" A per-group map ({pg['tokens_per_chunk']} tokens per chunk in every group; "
            f"reference only) would write {other['files_written_per_million']:,.0f} files instead "
            f"of {traffic['files_written_per_million']:,.0f} and "
            f"{other['bytes_written_per_million'] / 1e9:.2f} GB instead of "
            f"{traffic['bytes_written_per_million'] / 1e9:.2f} GB per million prompt tokens."
        )
    return {"cli-sweep-reading": reading, "cli-sweep-points": str(len(points))}


def _larger_chunks(data: Mapping[str, Any], low: int = 512, high: int = 1024) -> str:
    """DeepSeek-V4 at ``block_size`` 1024 (the disk serve command) vs 512, from the sweep."""
    sweep = data["sweep"]
    a, b = _point(sweep, low), _point(sweep, high)
    ta, tb = a["traffic"], b["traffic"]
    return (
        f"on the `{data['workload']['name']}` workload preset (the sweep below; retention "
        f"{data['policy']['prefix_cache_retention_interval']}), DeepSeek-V4 at `block_size` {high} "
        f"writes {tb['files_written_per_million']:,.0f} files of {_mib(b['file_bytes'])} per "
        f"million prompt tokens and reads {tb['files_read_per_million']:,.0f} (every load), "
        f"instead of {ta['files_written_per_million']:,.0f} written and "
        f"{ta['files_read_per_million']:,.0f} read of {_mib(a['file_bytes'])} at {low}, for "
        f"{tb['recomputed_per_million'] - ta['recomputed_per_million']:,.0f} more recomputed "
        "tokens per million"
    )


def installed_vllm() -> str | None:
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def cli_regions(run: Callable[[Sequence[str]], tuple[str, dict[str, Any]]] = run_cli) -> dict[str, str]:
    """The cli regions' bodies: each sample's excerpt, and sentences from the sweep's JSON."""
    newest = SUPPORTED_RELEASES[-1]
    if installed_vllm() != newest:
        raise SystemExit(
            f"gen_readme: the README's CLI samples are vLLM {newest}'s output; installed: "
            f"{installed_vllm()} (run `nox -s docs`, or --bench-only)"
        )
    out: dict[str, str] = {}
    sweep_data: dict[str, Any] | None = None
    for sample in SAMPLES:
        text, data = run(sample.argv)
        out[sample.name] = _block(
            ["```", f"# vLLM {data['vllm']['version']}", sample.command(), *excerpt(text, sample), "```"]
        )
        if "sweep" in data and data["sweep"]:
            sweep_data = data
    assert sweep_data is not None, "SAMPLES has no --sweep run"
    out.update(_sweep_sentences(sweep_data))
    out["cli-larger-chunks"] = _larger_chunks(sweep_data)
    out[DISK_CURVE.name] = _disk_curve(run(DISK_CURVE.argv)[1])
    return out


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def load_bench() -> tuple[dict[str, Any], str]:
    bench: dict[str, Any] = json.loads(BENCH_JSON.read_text())
    return bench, BENCH_MD.read_text() if BENCH_MD.exists() else ""


def generate(*, cli: bool = True) -> dict[str, str]:
    bodies = bench_regions(*load_bench())
    bodies.update(report_regions(load_conformance_reports()))
    if cli:
        bodies.update(cli_regions())
    return bodies


def regions_in(doc: Path, bodies: Mapping[str, str]) -> dict[str, str]:
    """The bodies of the regions that live in ``doc`` (:data:`OTHER_DOCS`; else the README)."""
    return {name: body for name, body in bodies.items() if OTHER_DOCS.get(name, README) == doc}


def stale(text: str, bodies: Mapping[str, str]) -> list[str]:
    """A unified diff per region whose body differs from ``bodies``."""
    have = read_regions(text)
    out = []
    for name, body in bodies.items():
        if have.get(name) != body:
            diff = difflib.unified_diff(
                (have.get(name) or "").splitlines(), body.splitlines(),
                f"README.md {name}", f"generated {name}", lineterm="",
            )
            out.append("\n".join(diff))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gen_readme", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    parser.add_argument("--bench-only", action="store_true", help="only the regions from reports/")
    args = parser.parse_args(argv)
    bodies = generate(cli=not args.bench_only)
    status = 0
    for doc in (README, *sorted(set(OTHER_DOCS.values()))):
        mine = regions_in(doc, bodies)
        text = doc.read_text()
        if args.check:
            diffs = stale(text, mine)
            for d in diffs:
                print(d)
            status = status or (1 if diffs else 0)
            continue
        new = fill(text, mine)
        if new != text:
            doc.write_text(new)
        print(f"gen_readme: {len(mine)} regions of {doc.relative_to(ROOT)} "
              f"{'rewritten' if new != text else 'already current'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
