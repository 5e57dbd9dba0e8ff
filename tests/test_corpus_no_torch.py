"""The corpus replay needs no torch: a backend author installs kvchunk without it.

``python -m conformance.corpus replay --backend reference`` and ``tests/test_corpus.py``
run in subprocesses where torch and vLLM cannot be imported (a ``sitecustomize`` on
``PYTHONPATH`` blocks them in every process, the replay's own subprocesses included)
and must pass every case.  ``nox -s corpus_replay`` runs the same in an environment
without torch installed; this test keeps a torch import from creeping back into the
replay's path between those runs (:class:`reference.store.ChunkStore` imports torch
only for its optional pool).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.corpus.format import DATA_DIR

ROOT = Path(__file__).resolve().parents[1]

_MARK = "blocked by tests/test_corpus_no_torch.py"
_SITECUSTOMIZE = f'''
import sys


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "vllm"):
            raise ModuleNotFoundError(f"No module named {{name!r}} ({_MARK})", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
'''


@pytest.fixture
def no_torch_env(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python processes cannot import torch or vLLM."""
    (tmp_path / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    path = [str(tmp_path), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(path)
    probe = subprocess.run([sys.executable, "-c", "import torch"], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert probe.returncode != 0 and _MARK in probe.stderr, (
        "the sitecustomize that blocks torch did not load (another one shadows it?): "
        + probe.stderr[-1000:])
    return env


def test_replay_passes_every_case_without_torch(no_torch_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "conformance.corpus", "replay", "--backend", "reference"],
        cwd=ROOT, env=no_torch_env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    total = sum(len(p.read_text().splitlines()) for p in DATA_DIR.glob("vllm-*.jsonl"))
    assert total and f"reference: {total}/{total} cases passed" in proc.stdout, proc.stdout


def test_corpus_tests_pass_without_torch(no_torch_env: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_corpus.py", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, env=no_torch_env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
