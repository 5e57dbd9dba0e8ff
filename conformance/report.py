"""pytest plugin: collect lane outcomes and write the conformance report.

Every conformance test carries one lane marker (config, plan, data, gpu_copy,
e2e, faults, meta) and names what it ran on through ``record_property``:
``fixture`` (a model fixture or synthetic hybrid) and ``knob`` (the
kv_connector_extra_config knob, as text).  Tests may also record ``counter:<name>``
properties with integers; they are summed into the reliability table.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

LANES = ("config", "plan", "data", "gpu_copy", "e2e", "faults", "meta")


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
        self.started = time.monotonic()

    @staticmethod
    def _lane(item: pytest.Item) -> str:
        for lane in LANES:
            if item.get_closest_marker(lane):
                return lane
        return "other"

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props = dict(report.user_properties)
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
            for name, value in props.items():
                if name.startswith("counter:") and isinstance(value, int):
                    self.counters[name.removeprefix("counter:")] += value

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> None:
        item.user_properties.append(("lane", self._lane(item)))
        case: Any = getattr(item, "callspec", None)
        params = case.params if case is not None else {}
        for value in params.values():
            for attr in ("fixture", "knob"):
                if hasattr(value, attr) and not any(k == attr for k, _ in item.user_properties):
                    item.user_properties.append((attr, str(getattr(value, attr))))

    def table(self) -> str:
        lines = [
            "| fixture | knob | lane | result |",
            "|---|---|---|---|",
        ]
        order = {lane: i for i, lane in enumerate(LANES)}
        for (fixture, knob, lane), cell in sorted(
            self.cells.items(), key=lambda kv: (order.get(kv[0][2], 99), kv[0][0], kv[0][1])
        ):
            lines.append(f"| {fixture} | {knob} | {lane} | {cell.status()} |")
        return "\n".join(lines)

    def write(self, path: Path, header: str) -> str:
        timing = "\n".join(
            f"| {lane} | {secs:.1f} |" for lane, secs in sorted(self.lane_seconds.items())
        )
        counters = "\n".join(f"| {k} | {v} |" for k, v in sorted(self.counters.items()))
        text = (
            f"# kvchunk conformance report\n\n{header}\n\n## Results\n\n{self.table()}\n\n"
            f"## Lane timings (s)\n\n| lane | seconds |\n|---|---|\n{timing}\n"
        )
        if counters:
            text += f"\n## Counters (counted by the suite)\n\n| counter | value |\n|---|---|\n{counters}\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return text
