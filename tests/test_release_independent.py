"""The modules ``nox -s tests`` runs on the newest release only really import no vLLM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import HARNESS_ONCE, RELEASE_INDEPENDENT

TESTS = Path(__file__).resolve().parent


def test_release_independent_modules_import_no_vllm() -> None:
    imports = "; ".join(f"import {m}" for m in sorted(RELEASE_INDEPENDENT))
    code = f"import sys; {imports}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm')[:5])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=TESTS, capture_output=True, text=True,
                          env={"PYTHONPATH": f"{TESTS}:{TESTS.parent}", "PATH": "/usr/bin:/bin"},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", f"a release-independent module imports vLLM: {proc.stdout}"


def test_every_listed_module_exists() -> None:
    for name in RELEASE_INDEPENDENT | HARNESS_ONCE:
        assert (TESTS / f"{name}.py").exists(), f"tests/conftest.py lists {name}, which is gone"
