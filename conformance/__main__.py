"""``python -m conformance [--backend module:object] [--vllm-rules RELEASE] [--require-cuda]
[--spec module:Class] [-n auto] [pytest args...]``.

``-n N`` (pytest-xdist) runs the cases on N worker processes; the report is the same as a
serial run's, plus the workers' count in its timings (``docs/gpu-ci.md``).

Runs every lane against the installed vLLM, prints the fixture x knob x lane
table and writes, for that release:

* ``reports/conformance-<vllm version>.md`` and ``.xml`` (JUnit);
* ``reports/versions-<vllm version>.json``: its answers to the cases of
  :data:`conformance.protocol.versions.CHANGES`;

then rewrites ``reports/conformance.md``: the "What changed" section (every
release whose answers are in ``reports/``, side by side) followed by the newest
release's report.  ``$KVCHUNK_REPORTS_DIR`` sends all of it to another folder.
A vLLM that is not a known release runs a known release's rules (the report's
first line says whose); a usage error (``--require-cuda`` without CUDA, an unknown
``--vllm-rules``) writes no report.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import pytest

from conformance.harness.spec_option import header_line as spec_header_line
from conformance.protocol.versions import CHANGES, RELEASES, UNMEASURED, rules_line
from conformance.report import ConformanceReport
from vllm_adapter.files import write_text_atomic
from vllm_adapter.releases import installed_version
from vllm_adapter.render import render_table

ROOT = Path(__file__).resolve().parent.parent
REPORTS = Path(os.environ.get("KVCHUNK_REPORTS_DIR") or ROOT / "reports")
"""Where reports go: ``reports/`` unless ``$KVCHUNK_REPORTS_DIR`` names another folder."""


def _vllm_version() -> str:
    return installed_version() or "none"


def _deviations_section() -> str:
    from conformance.protocol import deviations

    rows = [
        (d.id, d.kind, d.lane, ", ".join(d.cases) or "-", " ".join(d.reproduction.split()))
        for d in deviations.load("vllm")
    ]
    path = deviations.path_for("vllm").relative_to(ROOT)
    table = render_table(("id", "kind", "lane", "cases", "minimal reproduction"), rows)
    return (
        f"\n## Known deviations ({path}; strict xfails where a case is named)\n\n{table}\n"
    )


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".") if p.isdigit())


def what_changed(answers: dict[str, dict[str, str]]) -> str:
    """The "What changed" section: per change, the rule, its case and each release's answer."""
    versions = sorted(answers, key=_version_key)
    if not versions:
        return ""
    changes = render_table(
        ("change", "rule", "minimal case", *(f"vLLM {v}" for v in versions), "intended"),
        [
            (f"`{c.id}`", c.rule, c.case,
             *(answers[v].get(c.id, "(not run)") for v in versions), c.intended)
            for c in CHANGES
        ],
    )
    unmeasured = render_table(
        ("change", "what changed", "why not measured"),
        [(f"`{u.id}`", u.change, u.why_not_measured) for u in UNMEASURED],
    )
    policies = "\n".join(
        f"* vLLM {v}: `{RELEASES[v].policy.last_token.value}` last-token rule, "
        f"`{RELEASES[v].policy.null_blocks_in_store.value}` null blocks, "
        f"reload after a failed load: {RELEASES[v].policy.reload_after_failed_load}"
        for v in sorted(RELEASES, key=_version_key)
    )
    return (
        "## What changed between vLLM releases (measured by the `versions` lane)\n\n"
        "Each answer is what that release's real scheduler and connector did on the case, "
        "recorded by `conformance/lanes/test_versions.py` from `reports/versions-<release>.json`. "
        "The reference replays every trace with the release's switches "
        "(`conformance/protocol/versions.py`):\n\n"
        f"{policies}\n\n{changes}\n\n"
        "Changes in the offloading code that no lane reaches yet:\n\n"
        f"{unmeasured}\n"
    )


def parallel_args(argv: list[str]) -> list[str]:
    """With pytest-xdist's ``-n`` and no ``--dist``, cases go to workers one by one except
    those of one ``xdist_group`` (the meta lane's mutants share one worker's outcomes)."""
    parallel = any(a == "-n" or a.startswith(("-n", "--numprocesses")) for a in argv)
    chosen = any(a.startswith("--dist") for a in argv)
    return ["--dist=loadgroup"] if parallel and not chosen else []


def main(argv: list[str]) -> int:
    REPORTS.mkdir(exist_ok=True)
    version = _vllm_version()
    plugin = ConformanceReport()
    args = [
        str(ROOT / "conformance" / "lanes"),
        "-p",
        "conformance.plugin",
        f"--junitxml={REPORTS / f'conformance-{version}.xml'}",
        "-o",
        "junit_family=xunit1",
        "-q",
        "-rfEsx",
        *parallel_args(argv),
        *argv,
    ]
    code = pytest.main(args, plugins=[plugin])
    if code == pytest.ExitCode.USAGE_ERROR:  # e.g. --require-cuda without CUDA: no report
        return int(code)
    try:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu only (no CUDA)"
    except ImportError:  # pragma: no cover
        device = "unknown"
    line = rules_line(version) if version != "none" else None
    spec = spec_header_line()
    header = (
        (f"{line}.\n\n" if line else "")
        + (f"{spec}.\n\n" if spec else "")
        + f"vLLM {version}, profile `{os.environ.get('KVCHUNK_PROFILE', 'ci')}`, python "
        f"{platform.python_version()}, device: {device}, exit status {int(code)}."
    )
    per_version = REPORTS / f"conformance-{version}.md"
    text = plugin.write(per_version, header) + _deviations_section()
    write_text_atomic(per_version, text)
    if plugin.version_answers:
        write_text_atomic(
            REPORTS / f"versions-{version}.json",
            json.dumps(plugin.version_answers, indent=2, sort_keys=True) + "\n",
        )
    answers = {
        p.stem.removeprefix("versions-"): json.loads(p.read_text())
        for p in REPORTS.glob("versions-*.json")
    }
    newest = max([version, *answers], key=_version_key)
    newest_text = text if newest == version else (REPORTS / f"conformance-{newest}.md").read_text()
    others = ", ".join(
        f"[vLLM {v}](conformance-{v}.md)" for v in sorted(answers, key=_version_key)
    )
    combined = (
        f"# kvchunk conformance\n\nPer release: {others or per_version.name}.\n\n"
        + what_changed(answers)
        + "\n"
        + newest_text.replace("# kvchunk conformance report", f"# vLLM {newest}", 1)
    )
    write_text_atomic(REPORTS / "conformance.md", combined)
    print("\n" + text)
    return int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
