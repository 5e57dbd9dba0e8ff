"""pytest plugin: collect lane outcomes and write the conformance report.

Every conformance test carries one lane marker (config, plan, data, gpu_copy,
e2e, faults, meta) and names what it ran on through ``record_property``:
``fixture`` (a model fixture or synthetic hybrid) and ``knob`` (the
kv_connector_extra_config knob, as text).  Tests may also record ``counter:<name>``
properties with integers; they are summed into the reliability table.
"""

from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from vllm_adapter.render import render_table

LANES = ("config", "plan", "data", "gpu_copy", "e2e", "faults", "versions", "meta")
TIER_KNOB = re.compile(r"^(?P<before>.*?)\b(?P<tier>vllm|kvchunk) fs tier(?P<after>.*)$")
"""A faults-lane knob naming the file tier it ran on (the case is the rest of it)."""
DEVIATION_ID = re.compile(r"deviation '([\w.-]+)'")


@dataclass
class Cell:
    passed: int = 0
    failed: int = 0
    xfailed: int = 0
    skipped: int = 0
    reasons: set[str] = field(default_factory=set)
    seconds: float = 0.0

    def status(self) -> str:
        parts = []
        for name in ("passed", "failed", "xfailed", "skipped"):
            n = getattr(self, name)
            if n:
                parts.append(f"{n} {name}")
        text = ", ".join(parts) or "-"
        if self.reasons:
            text += " (" + "; ".join(sorted(self.reasons))[:200] + ")"
        return text


class ConformanceReport:
    def __init__(self) -> None:
        self.cells: dict[tuple[str, str, str], Cell] = defaultdict(Cell)
        self.lane_seconds: dict[str, float] = defaultdict(float)
        self.counters: dict[str, int] = defaultdict(int)
        self.version_answers: dict[str, str] = {}
        """``version_answer:<change id>`` properties: this release's answer per change."""
        self.mutations: list[tuple[str, ...]] = []
        """Meta lane, per mutant test: (mutant, bug class, caught by, assertion/crash,
        crashed check, seconds, survivor reason)."""
        self.mutation_score: str | None = None
        self.corpus_score: str | None = None
        """The corpus alone (``test_corpus_power.py``): rule mutants killed by the replay."""
        self.economics: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
        """Economics check: (fixture, knob) -> (outcome, ``econ:*`` properties)."""
        self.file_tier: dict[tuple[str, str], dict[str, Any]] = {}
        self.tier_cases: dict[tuple[str, str], dict[str, tuple[str, str, str]]] = defaultdict(dict)
        """Faults lane, cases run on both file tiers: (fixture, case) -> tier -> result cell key."""
        self.tier_counters: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        """Faults lane: tier (``vllm`` / ``kvchunk``) -> counter totals of its cases."""
        """Tiered lanes: (fixture, knob) -> ``counter:files_*`` / ``bytes_per_file:g<i>`` values."""
        self.case_seconds: dict[str, float] = defaultdict(float)
        """Per test (node id): its setup, call and teardown together."""
        self.call_seconds: dict[str, float] = {}
        """Per test (node id): its call alone (a setup may wait on a lane's shared fixture or
        the economics lanes' machine-wide lock: that is not the case's own time)."""
        self.lock_wait_s = 0.0
        """Setups' waits for the economics lanes' machine-wide lock (left out of case times)."""
        self.groups: dict[str, str] = {}
        """Per test (node id) in an ``xdist_group``: the group (one worker runs it whole)."""
        self.workers = 0
        """pytest-xdist workers (``-n``); 0: one process."""
        self.started = time.monotonic()

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.workers = int(getattr(session.config.option, "numprocesses", 0) or 0)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props = dict(report.user_properties)
        wait = props.get("lock_wait_s") if report.when == "setup" else None
        waited = float(wait) if isinstance(wait, (int, float)) else 0.0
        self.case_seconds[report.nodeid] += report.duration - waited
        self.lock_wait_s += waited
        if report.when == "call":
            self.call_seconds[report.nodeid] = report.duration
        if "xdist_group" in props:
            self.groups[report.nodeid] = str(props["xdist_group"])
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            lane = props.get("lane", "other")
            key = (str(props.get("fixture", "-")), str(props.get("knob", "-")), str(lane))
            cell = self.cells[key]
            if hasattr(report, "wasxfail"):
                if report.outcome == "skipped":
                    cell.xfailed += 1
                    cell.reasons.add(f"xfail: {report.wasxfail}"[:120])
                else:
                    cell.failed += 1  # strict xfail that passed
                    cell.reasons.add("XPASS(strict): deviation fixed? update deviations file")
            elif report.outcome == "passed":
                cell.passed += 1
            elif report.outcome == "failed":
                cell.failed += 1
            else:
                cell.skipped += 1
                if isinstance(report.longrepr, tuple):
                    cell.reasons.add(str(report.longrepr[2]).removeprefix("Skipped: ")[:160])
            cell.seconds += report.duration
            self.lane_seconds[str(lane)] += report.duration
            if "mutant" in props:
                self.mutations.append(tuple(str(props.get(k, "-")) for k in (
                    "mutant", "bug_class", "caught_by", "catch_kind", "crashed_by", "seconds",
                    "survivor_reason")))
            if "mutation_score" in props:
                outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
                self.mutation_score = f"{props['mutation_score']} ({outcome})"
            if "corpus_mutation_score" in props:
                outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
                self.corpus_score = (
                    f"{props['corpus_mutation_score']} of the reference-rule mutants ({outcome}); "
                    f"{props.get('corpus_mutation_score_reached', '-')} of those whose code the "
                    "replay runs (`conformance/lanes/test_corpus_power.py` names each survivor "
                    "and the case class the corpus lacks)")
            tier = TIER_KNOB.match(key[1])
            if tier is not None:
                parts = (tier["before"].strip(" ,"), tier["after"].strip(" ,"))
                case = ", ".join(p for p in parts if p) or "-"
                self.tier_cases[(key[0], case)][tier["tier"]] = key
            files = {
                k: v for k, v in props.items()
                if k.startswith(("bytes_per_file:", "counter:files_", "files_written:", "files_read:"))
            }
            if files:
                self.file_tier[(key[0], key[1])] = files
            econ = {k: v for k, v in props.items() if k.startswith("econ:")}
            if econ:
                outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
                self.economics[(key[0], key[1])] = (outcome, econ)
            for name, value in props.items():
                if name.startswith("counter:") and isinstance(value, int):
                    self.counters[name.removeprefix("counter:")] += value
                    if tier is not None:  # the same counter, per file tier
                        self.tier_counters[tier["tier"]][name.removeprefix("counter:")] += value
                elif name.startswith("version_answer:"):
                    suffix = "" if report.outcome == "passed" else f" (test {report.outcome})"
                    self.version_answers[name.removeprefix("version_answer:")] = f"{value}{suffix}"

    def table(self) -> str:
        order = {lane: i for i, lane in enumerate(LANES)}
        rows = [
            (fixture, knob, lane, cell.status())
            for (fixture, knob, lane), cell in sorted(
                self.cells.items(), key=lambda kv: (order.get(kv[0][2], 99), kv[0][0], kv[0][1])
            )
        ]
        return render_table(("fixture", "knob", "lane", "result"), rows)

    def reliability(self) -> str:
        """The Reliability table: every number is a counter the suite recorded (faults lane)."""
        c = self.counters
        if not any(k.startswith(("config_fuzz_", "fault:", "faults_", "load_trace_")) for k in c):
            return ""

        def get(name: str) -> str:
            return str(c[name]) if name in c else "not run"

        rows: list[tuple[str, str, str]] = [
            ("configs tried (fuzzed kv_connector_extra_config, CLI arguments)",
             get("config_fuzz_tried"), "config_fuzz_tried"),
            ("invalid configs rejected cleanly (ValueError / exit 2 naming the knob)",
             get("config_fuzz_rejected_cleanly"), "config_fuzz_rejected_cleanly"),
            ("valid configs accepted and resolved as the reference says",
             get("config_fuzz_accepted"), "config_fuzz_accepted"),
            ("configs handled uncleanly (other exception, no knob named, wrong resolution)",
             get("config_fuzz_unclean"), "config_fuzz_unclean"),
        ]
        for name in sorted(k for k in c if k.startswith("fault:")):
            kind = name.removeprefix("fault:").replace("_", " ")
            rows.append((f"faults injected: {kind}", str(c[name]), name))
        corrupted = [n for n in ("faults_corrupted_loads", "corrupted_loads") if n in c]
        rows += [
            ("loaded blocks checked against the expected bytes (faults + data lanes)",
             str(sum(c.get(n, 0) for n in ("faults_loaded_blocks_checked", "loaded_blocks_checked"))),
             "faults_loaded_blocks_checked + loaded_blocks_checked"),
            ("corrupted loads (faults + data lanes)",
             str(sum(c[n] for n in corrupted)) if corrupted else "not run", " + ".join(corrupted)),
            ("blocks read by a forward pass, checked", get("faults_blocks_read_checked"),
             "faults_blocks_read_checked"),
            ("corrupted reads", get("faults_corrupted_reads"), "faults_corrupted_reads"),
            ("blocks recomputed after a failed load, checked", get("faults_recomputed_blocks_checked"),
             "faults_recomputed_blocks_checked"),
            ("loads of a key whose store failed", get("faults_failed_store_loaded"),
             "faults_failed_store_loaded"),
            ("leaks (pins, ref counts, pool blocks, request state left after the drain)",
             get("faults_leaks"), "faults_leaks"),
            ("lost-store jobs vLLM retains until a connector reset (accounted, not leaks)",
             get("faults_lost_store_jobs_retained"), "faults_lost_store_jobs_retained"),
            ("connector resets needed to unblock requests waiting on a lost store",
             get("faults_lost_store_stall_resets"), "faults_lost_store_stall_resets"),
        ]
        if "load_trace_requests" in c:
            secs = max(c.get("load_trace_ms", 0), 1) / 1000
            rows += [
                ("load trace: requests", str(c["load_trace_requests"]), "load_trace_requests"),
                ("load trace: engine steps", get("load_trace_steps"), "load_trace_steps"),
                ("load trace: harness throughput (requests/s)",
                 f"{c['load_trace_requests'] / secs:.0f}", "load_trace_requests / load_trace_ms"),
                ("load trace: harness throughput (steps/s)",
                 f"{c.get('load_trace_steps', 0) / secs:.0f}", "load_trace_steps / load_trace_ms"),
                ("load trace: RSS growth after warm-up (KiB)", get("load_trace_rss_growth_kib"),
                 "load_trace_rss_growth_kib"),
            ]
        return render_table(
            ("measure", "value", "counter"), [(what, value, f"`{src}`") for what, value, src in rows]
        )

    def mutation_section(self) -> str:
        """Meta lane: per mutant the check whose assertion caught it, or the check it only
        crashed (not counted); the score by assertion; one sentence per survivor."""
        if not self.mutations:
            return ""
        from vllm_adapter.render import render_table

        rows = sorted(self.mutations, key=lambda row: (row[1], row[0]))
        table = render_table(("mutant", "bug class", "caught by (lane::test)", "catch",
                              "crashed (not counted)", "seconds"), [row[:6] for row in rows])
        score = self.mutation_score or "not computed (test_mutation_score did not run)"
        survivors = [f"- `{row[0]}`: {row[6]}" for row in rows if row[3] != "assertion"]
        text = f"{table}\n\nScore (caught by assertion / non-equivalent mutants): {score}"
        if self.corpus_score is not None:
            text += f"\n\nThe golden corpus alone (replayed into the reference): {self.corpus_score}"
        if survivors:
            text += "\n\nNot caught by an assertion:\n\n" + "\n".join(survivors)
        return text

    def tier_comparison(self) -> tuple[str, str]:
        """The fault cases run on vLLM's fs tier and on kvchunk's, side by side: per case
        the result on each, and the counters each tier's cases totalled."""
        if not self.tier_cases:
            return "", ""
        names = {"vllm": "vLLM's fs tier", "kvchunk": "kvchunk's fs tier (vllm_adapter.disk)"}

        def result(cell_key: tuple[str, str, str] | None) -> str:
            if cell_key is None:
                return "- (case not run on this tier)"
            cell = self.cells[cell_key]
            deviations = sorted({m for r in cell.reasons for m in DEVIATION_ID.findall(r)})
            parts = [f"{n} {what}" for n, what in ((cell.passed, "passed"),
                     (cell.failed, "FAILED"), (cell.xfailed, "xfailed"), (cell.skipped, "skipped"))
                     if n]
            text = ", ".join(parts) or "-"
            return text + (f" (deviation {', '.join(deviations)})" if deviations else "")

        rows = [
            (fixture, case, *(result(tiers.get(t)) for t in names))
            for (fixture, case), tiers in sorted(self.tier_cases.items())
        ]
        cases = render_table(("fixture", "fault case", *names.values()), rows)
        measures = [
            ("wrong loads served (bytes differ from the stored chunk)", "tier_wrong_loads"),
            ("failed load jobs (tokens recomputed)", "tier_failed_loads"),
            ("requests left unfinished", "tier_unfinished_requests"),
            ("files written", "files_written"),
            ("files read", "files_read"),
            ("bad files detected (kvchunk's checks)", "kvchunk_bad_files"),
        ]
        totals = render_table(
            ("measure (faults lane, file-tier cases)", *names.values(), "counter"),
            [(what, *(str(self.tier_counters[t].get(c, 0)) if t in self.tier_counters
                      else "not run" for t in names), f"`{c}`") for what, c in measures],
        )
        return cases, totals

    def file_tier_section(self) -> str:
        """Tiered lanes: files written and read, per group, and bytes per file, per case."""
        if not self.file_tier:
            return ""

        def per_group(props: dict[str, Any], prefix: str) -> str:
            items = sorted((k.removeprefix(prefix), v) for k, v in props.items()
                           if k.startswith(prefix))
            return " ".join(f"{g}:{v}" for g, v in items) or "-"

        rows = [
            (fixture, knob, props.get("counter:files_written", "-"),
             per_group(props, "files_written:"), props.get("counter:files_read", "-"),
             per_group(props, "files_read:"), per_group(props, "bytes_per_file:"))
            for (fixture, knob), props in sorted(self.file_tier.items())
        ]
        return render_table(("fixture", "knob", "files written", "per group", "files read",
                             "per group", "bytes per file"), rows)

    def economics_section(self) -> str:
        """Predicted (reference economics) against written and read files, per group."""
        if not self.economics:
            return ""
        rows = []
        for (fixture, knob), (outcome, props) in sorted(self.economics.items()):
            groups = sorted({k.rsplit(":g", 1)[1] for k in props if ":g" in k}, key=int)

            def pair(kind: str, groups: list[str] = groups, props: dict[str, Any] = props) -> str:
                return " ".join(
                    f"{g}:{props.get(f'econ:predicted_{kind}:g{g}', '-')}"
                    + ("" if props.get(f"econ:predicted_{kind}:g{g}") == props.get(f"econ:{kind}:g{g}")
                       else f"!={props.get(f'econ:{kind}:g{g}', '-')}")
                    for g in groups
                )

            total = sum(int(props.get(f"econ:written:g{g}", 0)) for g in groups)
            rows.append((fixture, knob, props.get("econ:prompt_tokens", "-"), pair("written"),
                         pair("read"), total, outcome))
        return render_table(
            ("fixture", "knob, retention, workload", "prompt tokens",
             "files written per group (reference; != vLLM where they differ)",
             "files read per group", "files written (vLLM)", "outcome"),
            rows,
        )

    def timings(self) -> str:
        """Per lane file: its cases, their seconds (setup, call and teardown summed) and its
        longest case (its call); then the run's wall time and workers, and the longest case
        of all."""
        files: dict[str, list[str]] = defaultdict(list)
        for nodeid in self.case_seconds:
            files[nodeid.split("::", 1)[0]].append(nodeid)

        def summed(ids: list[str]) -> float:
            return sum(self.case_seconds[i] for i in ids)

        rows = [(name, str(len(ids)), f"{summed(ids):.1f}",
                 f"{max(self.call_seconds.get(i, 0.0) for i in ids):.1f}")
                for name, ids in sorted(files.items(), key=lambda kv: -summed(kv[1]))]
        table = render_table(("lane file", "cases", "seconds", "longest case (s, its call)"), rows)
        wall = time.monotonic() - self.started
        longest = max(self.call_seconds.items(), key=lambda kv: kv[1], default=("-", 0.0))
        procs = f"{self.workers} pytest-xdist workers" if self.workers else "one process"
        groups: dict[str, float] = defaultdict(float)
        for nodeid, group in self.groups.items():
            groups[group] += self.case_seconds[nodeid]
        biggest = max(groups.items(), key=lambda kv: kv[1], default=("-", 0.0))
        return (f"{table}\n\nWall time {wall:.0f} s ({procs}); cases' seconds summed "
                f"{sum(self.case_seconds.values()):.0f} s; longest case {longest[1]:.1f} s "
                f"(`{longest[0]}`); largest xdist group {biggest[1]:.0f} s (`{biggest[0]}`, "
                f"one worker runs it whole). Setups waited {self.lock_wait_s:.0f} s for another "
                "process's economics lane (`conformance/harness/heavy_lock.py`), left out of "
                "the cases' seconds.")

    def write(self, path: Path, header: str) -> str:
        timing = render_table(
            ("lane", "seconds"),
            [(lane, f"{secs:.1f}") for lane, secs in sorted(self.lane_seconds.items())],
        )
        counters = render_table(("counter", "value"), sorted(self.counters.items()))
        text = (
            f"# kvchunk conformance report\n\n{header}\n\n## Results\n\n{self.table()}\n\n"
            f"## Lane timings (s)\n\n{timing}\n\n"
            f"## Case timings per lane file\n\n{self.timings()}\n"
        )
        reliability = self.reliability()
        if reliability:
            text += f"\n## Reliability (counted by the suite)\n\n{reliability}\n"
        tier_cases, tier_totals = self.tier_comparison()
        if tier_cases:
            text += (
                "\n## File tiers side by side (tiered faults lane)\n\n"
                "Every file-tier fault case runs on vLLM's fs tier and on kvchunk's "
                "(`vllm_adapter.disk.tier`); an xfail is a recorded vLLM deviation.\n\n"
                f"{tier_totals}\n\n{tier_cases}\n"
            )
        mutation = self.mutation_section()
        if mutation:
            text += f"\n## Mutation score\n\n{mutation}\n"
        file_tier = self.file_tier_section()
        if file_tier:
            text += f"\n## File tier (tiered lanes)\n\n{file_tier}\n"
        economics = self.economics_section()
        if economics:
            text += (
                "\n## File economics: predicted == written (tiered lanes)\n\n"
                "The reference's economics (`reference/economics.py`, what `python -m "
                "vllm_adapter config` prints) against the files vLLM's fs tier wrote and read "
                "for the same workload (`conformance/lanes/test_tiered_economics.py`).\n\n"
                f"{economics}\n"
            )
        if self.counters:
            text += f"\n## Counters (counted by the suite)\n\n{counters}\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return text
