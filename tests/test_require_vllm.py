"""``require_vllm()``: under nox (``KVCHUNK_VLLM`` set) a broken vLLM install is red, never a skip;
without ``KVCHUNK_VLLM`` a missing vLLM skips."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.testing.requires import ENV, require_vllm

ROOT = Path(__file__).resolve().parent.parent


def _hide_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` now raises ImportError


def test_with_kvchunk_vllm_set_a_failed_import_is_an_error_naming_the_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _hide_vllm(monkeypatch)
    monkeypatch.setenv(ENV, "0.34.0")
    with pytest.raises(ImportError, match=r"KVCHUNK_VLLM=0\.34\.0 is set .*`import vllm` failed"):
        require_vllm()


def test_without_kvchunk_vllm_a_missing_vllm_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_vllm(monkeypatch)
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(pytest.skip.Exception):
        require_vllm()


@pytest.mark.parametrize(("env", "red"), [("0.34.0", True), ("", False)])
def test_a_module_that_requires_vllm_fails_collection_only_under_nox(
    env: str, red: bool, tmp_path: Path
) -> None:
    """The whole chain as nox runs it: a module-level ``require_vllm()`` with vLLM hidden is a
    collection error (pytest exits non-zero) with ``KVCHUNK_VLLM`` set, and a skip without it."""
    (tmp_path / "conftest.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    (tmp_path / "test_needs_vllm.py").write_text(textwrap.dedent("""\
        from conformance.testing.requires import require_vllm

        require_vllm()


        def test_x():
            pass
    """))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), ENV: env},
    )
    out = proc.stdout + proc.stderr
    if red:
        assert proc.returncode == 2, out  # interrupted: errors during collection
        assert "1 error" in out and "`import vllm` failed" in out, out
    else:
        assert proc.returncode == 5, out  # no tests ran: the module skipped, nothing failed
        assert "1 skipped" in out and "error" not in out, out
