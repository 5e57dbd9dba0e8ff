"""Faults lane: each vLLM deviation's standalone reproduction script still reproduces it.

``conformance/protocol/deviations/repro/`` holds one minimal script per suspected vLLM bug of the
file tier (under 40 lines, CPU only, nothing but vLLM imported), named by the deviation's
``script`` key in the installed release's deviations file.  Each script exits 1 and
prints ``BUG`` while the bug holds, so these tests fail loudly once vLLM fixes it (and
the deviation, with its strict xfails, must go).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from conformance.testing.requires import require_vllm

require_vllm()

from conformance.protocol import deviations  # noqa: E402

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]
REPRO = ROOT / "conformance" / "protocol" / "deviations" / "repro"
FS_DEVIATIONS = ("fs-tier-no-checksum", "fs-tier-namespace-ignores-kv-geometry")


def _scripts() -> dict[str, str]:
    data = tomllib.loads(deviations.path_for("vllm").read_text())
    return {d["id"]: d["script"] for d in data.get("deviation", []) if "script" in d}


def test_every_file_tier_deviation_has_a_script() -> None:
    scripts = _scripts()
    listed = {d.id for d in deviations.load("vllm")}
    for dev in FS_DEVIATIONS:
        if dev in listed:
            assert dev in scripts, f"deviation {dev} names no reproduction script"
    assert {Path(s).name for s in scripts.values()} == {p.name for p in REPRO.glob("*.py")}, (
        f"scripts in {REPRO} and the deviations' 'script' keys differ: {scripts}"
    )


@pytest.mark.parametrize("script", sorted(p.name for p in REPRO.glob("*.py")))
def test_reproduction_script_reproduces(script: str, record_property: Any) -> None:
    path = REPRO / script
    source = path.read_text()
    assert len(source.splitlines()) < 40, f"{script} has {len(source.splitlines())} lines"
    imported = {
        (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    ours = sorted(m for m in imported if m.split(".")[0] in ("vllm_adapter", "conformance", "reference"))
    assert not ours, f"{script} imports kvchunk ({ours}): it must stand alone"
    done = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    record_property("knob", f"standalone reproduction {script}")
    assert done.returncode == 1 and done.stdout.startswith("BUG"), (
        f"{script} did not reproduce (exit {done.returncode}): {done.stdout}{done.stderr[-2000:]}"
    )
