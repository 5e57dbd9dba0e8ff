"""Serving imports only the serving core of vLLM's names: a harness rename cannot break it.

vLLM's names are bound in three modules (see :mod:`vllm_adapter.vllm_api`): the
serving core, the operator tooling (:mod:`vllm_adapter.vllm_tools_api`) and the
conformance harness (:mod:`conformance.harness.vllm_harness_api`).  An upstream rename
of a name only the harness or the tooling uses makes that module fail to
import; the serving modules and the CLI's entry point must still import, and
serving must not pull in the conformance suite at all.  Each case runs in a
fresh interpreter where the two non-serving modules raise ``ImportError``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conformance.testing.requires import require_vllm

require_vllm()

ROOT = Path(__file__).resolve().parents[1]

NOT_SERVING = ("conformance.harness.vllm_harness_api", "vllm_adapter.vllm_tools_api")
"""Made unimportable, as an upstream rename of one of their names would make them."""

SERVING = (
    "vllm_adapter",
    "vllm_adapter.connector",
    "vllm_adapter.spec",
    "vllm_adapter.disk.tier",
    "vllm_adapter.tiering",
    "vllm_adapter.geometry",
    "vllm_adapter.cli",
    "vllm_adapter.__main__",
)
"""What an engine (``kv_connector_module_path`` / ``spec_module_path``) or an operator
running ``python -m vllm_adapter config`` imports."""

_PROBE = textwrap.dedent(
    """
    import importlib, json, sys

    BLOCKED = set(json.loads(sys.argv[1]))

    class Unimportable:
        def find_spec(self, name, path=None, target=None):
            if name in BLOCKED:
                raise ImportError(f"{name} is made unimportable by the test")
            return None

    sys.meta_path.insert(0, Unimportable())
    failed = {}
    for name in json.loads(sys.argv[2]):
        try:
            importlib.import_module(name)
        except Exception as e:
            failed[name] = f"{type(e).__name__}: {e}"
    conformance_modules = sorted(
        m for m in sys.modules if m == "conformance" or m.startswith("conformance.")
    )
    loaded = sorted(m for m in sys.modules if m.startswith("vllm_adapter"))
    blocked_raises = {}
    for name in sorted(BLOCKED):  # last: importing a blocked name loads its parent package
        try:
            importlib.import_module(name)
            blocked_raises[name] = False
        except ImportError:
            blocked_raises[name] = True
    print(json.dumps({
        "failed": failed,
        "conformance_modules": conformance_modules,
        "loaded": loaded,
        "blocked_raises": blocked_raises,
    }))
    """
)


@pytest.fixture(scope="module")
def probe() -> dict[str, object]:
    """Import every serving module in a fresh interpreter with the other two blocked."""
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(NOT_SERVING), json.dumps(SERVING)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_non_serving_modules_are_really_unimportable_in_the_probe(
    probe: dict[str, object],
) -> None:
    assert probe["blocked_raises"] == dict.fromkeys(NOT_SERVING, True)


def test_serving_modules_import_without_the_harness_and_tooling_names(
    probe: dict[str, object],
) -> None:
    assert probe["failed"] == {}
    loaded = probe["loaded"]
    assert isinstance(loaded, list)
    assert set(SERVING) <= set(loaded)
    assert "vllm_adapter.vllm_api" in loaded


def test_serving_imports_nothing_from_the_conformance_suite(probe: dict[str, object]) -> None:
    assert probe["conformance_modules"] == []
