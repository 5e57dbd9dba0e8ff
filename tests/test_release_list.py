"""The supported vLLM releases are listed once (``vllm_adapter/release_list.py``); noxfile.py,
the serve-install script, the release rules and the tests all read that list."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from vllm_adapter.release_list import SUPPORTED_RELEASES

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / "vllm_adapter" / "release_list.py"
SKIP_DIRS = {".nox", ".git", "build", "dist", "__pycache__", ".venv"}


def _python_files() -> list[Path]:
    return [
        p for p in ROOT.rglob("*.py")
        if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts) and p != HOME
    ]


def _copies(source: str) -> list[int]:
    """Lines of tuple, list or set displays naming two or more supported releases."""
    tree = ast.parse(source)
    # A (old, new) pair keying a dict display names a transition between two releases, not the list.
    pair_keys = {id(k) for d in ast.walk(tree) if isinstance(d, ast.Dict) for k in d.keys}
    hits = []
    for node in ast.walk(tree):
        if id(node) in pair_keys:
            continue
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            named = {e.value for e in node.elts if isinstance(e, ast.Constant)} & set(
                SUPPORTED_RELEASES
            )
            if len(named) >= 2:
                hits.append(node.lineno)
    return hits


def test_the_detector_sees_a_copy() -> None:
    assert _copies(f"VERSIONS = {SUPPORTED_RELEASES!r}\nx = [{SUPPORTED_RELEASES[0]!r}]") == [1]
    assert _copies(f"ok = {{{SUPPORTED_RELEASES[0]!r}: 16, {SUPPORTED_RELEASES[-1]!r}: 64}}") == []
    assert _copies(f"ok = {{{SUPPORTED_RELEASES[:2]!r}: 4}}") == []


def test_the_release_list_is_written_once() -> None:
    copies = {
        str(path.relative_to(ROOT)): lines
        for path in _python_files()
        if (lines := _copies(path.read_text(encoding="utf-8")))
    }
    assert copies == {}, (
        f"the supported releases are listed again at {copies}: import SUPPORTED_RELEASES from "
        "vllm_adapter/release_list.py instead"
    )


def test_noxfile_reads_the_list_with_only_the_standard_library() -> None:
    """``.ci/run`` imports noxfile.py where only nox is installed: the list must load by path."""
    code = (
        "import sys, types\n"
        "sys.modules['nox'] = types.SimpleNamespace(options=types.SimpleNamespace(),\n"
        "    session=lambda *a, **k: (lambda f: f), parametrize=lambda *a, **k: (lambda f: f),\n"
        "    Session=object)\n"
        "for name in ('vllm_adapter', 'reference', 'vllm', 'torch'):\n"
        "    sys.modules[name] = None\n"
        "import noxfile\n"
        "print(' '.join(noxfile.VLLM_VERSIONS))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == list(SUPPORTED_RELEASES)


def test_each_supported_release_has_its_rules() -> None:
    from vllm_adapter.releases import NEWEST, OLDEST, RELEASES

    assert tuple(RELEASES) == SUPPORTED_RELEASES
    assert (OLDEST, NEWEST) == (SUPPORTED_RELEASES[0], SUPPORTED_RELEASES[-1])
