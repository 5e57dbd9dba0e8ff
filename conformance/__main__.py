"""``python -m conformance [--backend module:object] [pytest args...]``.

Runs every lane, prints the fixture x knob x lane table and writes
``reports/conformance.md`` and ``reports/conformance.xml`` (JUnit).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import pytest

from conformance.report import ConformanceReport

ROOT = Path(__file__).resolve().parent.parent


def _deviations_section() -> str:
    from conformance import deviations

    rows = [
        f"| {d.id} | {d.kind} | {d.lane} | {', '.join(d.cases)} | {' '.join(d.reproduction.split())} |"
        for d in deviations.load("vllm")
    ]
    return (
        "\n## Known deviations (conformance/deviations/vllm.toml, strict xfails)\n\n"
        "| id | kind | lane | cases | minimal reproduction |\n|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n"
    )


def main(argv: list[str]) -> int:
    reports = ROOT / "reports"
    reports.mkdir(exist_ok=True)
    plugin = ConformanceReport()
    args = [
        str(ROOT / "conformance" / "lanes"),
        "-p",
        "conformance.plugin",
        f"--junitxml={reports / 'conformance.xml'}",
        "-o",
        "junit_family=xunit1",
        "-q",
        "-rfEsx",
        *argv,
    ]
    code = pytest.main(args, plugins=[plugin])
    try:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu only (no CUDA)"
    except ImportError:  # pragma: no cover
        device = "unknown"
    header = (
        f"Profile `{os.environ.get('KVCHUNK_PROFILE', 'ci')}`, python {platform.python_version()}, "
        f"device: {device}, exit status {int(code)}."
    )
    text = plugin.write(reports / "conformance.md", header)
    text += _deviations_section()
    (reports / "conformance.md").write_text(text)
    print("\n" + text)
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
