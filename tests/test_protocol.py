"""conformance/PROTOCOL.md's commands run: a backend author's one page must stay true.

Every command in a fenced block of PROTOCOL.md is run, with its placeholders
(``mypackage.offload:backend``, ``my_package.my_module:MyOffloadingSpec``) replaced by kvchunk's
own backend and spec.  ``nox -s S -- ARGS`` runs what session ``S`` runs
(``noxfile.py``) with ``ARGS``, in this environment (nox would build a new one).
Suite runs (``python -m conformance``, ``python -m pytest``) stop after collection
(``--collect-only``): the lanes themselves run in
``nox -s conformance``; here the point is that every option and marker the page
names exists and selects tests.  The corpus replay runs in full (seconds).
"""

from __future__ import annotations

import ast
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.testing.requires import require_vllm

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = ROOT / "conformance" / "PROTOCOL.md"
PLACEHOLDERS = {
    "mypackage.offload:backend": "reference",
    "my_package.my_module:MyOffloadingSpec": "vllm_adapter.spec:ReferenceOffloadingSpec",
}
"""What the page's example names stand for here."""


def _commands() -> list[str]:
    blocks = PROTOCOL.read_text().split("```")[1::2]
    # a block's first line is its info string (``python`` blocks are code, not commands:
    # tests/test_protocol_doc.py checks them); a trailing backslash continues a command
    blocks = [b for b in blocks if b.split("\n", 1)[0].strip() in ("", "sh", "console")]
    lines = [line.strip() for block in blocks
             for line in block.split("\n", 1)[-1].replace("\\\n", " ").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _session_commands() -> dict[str, list[str]]:
    """``nox`` session name -> the argv of its last ``session.run`` (before posargs)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    out: dict[str, list[str]] = {}
    for fn in tree.body:
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "run"):
                argv = [a.value for a in node.args if isinstance(a, ast.Constant)]
                if argv:
                    out[fn.name] = [str(a) for a in argv]
    return out


def _argv(command: str) -> list[str]:
    for placeholder, value in PLACEHOLDERS.items():
        command = command.replace(placeholder, value)
    argv = shlex.split(command)
    if argv[:2] == ["nox", "-s"]:
        session, rest = argv[2], argv[3:]
        sessions = _session_commands()
        assert session in sessions, f"PROTOCOL.md runs nox session {session!r}: noxfile has none"
        posargs = rest[rest.index("--") + 1:] if "--" in rest else []
        argv = [*sessions[session], *posargs]
    if argv[0] == "python":
        argv[0] = sys.executable
    if argv[1:3] in (["-m", "conformance"], ["-m", "pytest"]):
        argv.append("--collect-only")
    return argv


def test_the_page_has_commands() -> None:
    commands = _commands()
    assert any("--backend" in c for c in commands), commands
    assert any("corpus replay" in c for c in commands), commands


@pytest.mark.parametrize("command", _commands())
def test_every_command_runs(command: str, tmp_path: Path) -> None:
    require_vllm()
    argv = _argv(command)
    env = {**os.environ, "KVCHUNK_REPORTS_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{command!r} (ran {argv}) exited {proc.returncode}:\n{out[-3000:]}"
    if "--collect-only" in argv:
        assert " collected" in out or "tests collected" in out, out[-2000:]
        assert "no tests collected" not in out, f"{command!r} selects no test:\n{out[-2000:]}"
