"""The once-per-CI test modules: the release-independent ones really import no vLLM, and each
once-only set runs on exactly one release (release-independent: the oldest; the suite's option
tests: the newest)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import HARNESS_ONCE, RELEASE_INDEPENDENT, pytest_collection_modifyitems

from vllm_adapter.releases import NEWEST, OLDEST, RELEASES

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


class _Item:
    def __init__(self, module: str) -> None:
        self.module = SimpleNamespace(__name__=f"tests.{module}")
        self.skips: list[str] = []

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.skips.append(marker.kwargs["reason"])


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_each_once_only_set_runs_on_exactly_one_release(
    release: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCHUNK_VLLM", release)
    independent, option, other = (
        _Item(sorted(RELEASE_INDEPENDENT)[0]), _Item(sorted(HARNESS_ONCE)[0]), _Item("test_cli")
    )
    pytest_collection_modifyitems(None, [independent, option, other])
    assert bool(independent.skips) == (release != OLDEST), independent.skips
    assert bool(option.skips) == (release != NEWEST), option.skips
    assert other.skips == [], "a release-dependent module must run on every release"
