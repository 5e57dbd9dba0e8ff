"""Any vLLM build: a version that is no known release runs a known release's rules,
deviations and live-derived geometry fixtures, and says so in one line.

The end-to-end check relabels the installed vLLM (0.34.0 or 0.33.0) as
``0.35.0.dev42+g1234abc`` -- what a source build of vLLM main reports -- with a
``sitecustomize`` on ``PYTHONPATH`` (the shared environment's vLLM is not touched),
and runs a slice of the config and versions lanes both ways: the outcomes must be
the same, plus the one line.  No real build of vLLM main is available here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from conformance.testing.requires import require_vllm

require_vllm()

from conformance.protocol.versions import (  # noqa: E402
    NEWEST,
    RELEASES,
    RULES_ENV,
    check_release,
    rules_for,
    rules_line,
)
from vllm_adapter import fixtures as F  # noqa: E402
from vllm_adapter import releases  # noqa: E402
from vllm_adapter.derive import RECIPES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DEV = "0.35.0.dev42+g1234abc"
V = F.V  # the vLLM API module the fixtures (and the derivation) read the version from
INSTALLED = V.VLLM_VERSION
SLICE = ["-m", "config or versions", "-k", "test_versions or synthetic-full-swa"]
"""The config lane on one fixture (its strict xfails included), fixture drift, and the
versions lane: what a relabelled build must reproduce."""

SITECUSTOMIZE = '''
import importlib.machinery, importlib.metadata, os, sys

FAKE = os.environ["KVCHUNK_FAKE_VLLM_VERSION"]
_real_version = importlib.metadata.version
importlib.metadata.version = lambda name: FAKE if name.lower() == "vllm" else _real_version(name)


class _Relabel:
    def find_spec(self, fullname, path, target=None):
        if fullname != "vllm._version":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        exec_module = spec.loader.exec_module

        def patched(module):
            exec_module(module)
            module.__version__ = module.version = FAKE

        spec.loader.exec_module = patched
        return spec


sys.meta_path.insert(0, _Relabel())
'''


# --- rules ---------------------------------------------------------------------------------


def test_an_unknown_build_runs_the_newest_known_releases_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(RULES_ENV, raising=False)
    for version in (DEV, "0.34.1rc1", "9.0.0"):
        rules = rules_for(version)
        assert not rules.known and rules.release == NEWEST
        assert rules.policy == RELEASES[NEWEST].policy
        assert rules_line(version) == (
            f"vLLM {version} is not a known release: using {NEWEST}'s rules and deviations "
            "(the newest known release); geometry fixtures derived live"
        )
    for version in RELEASES:
        assert rules_for(version) == RELEASES[version] and rules_line(version) is None


def test_vllm_rules_overrides_the_installed_vllms_rules_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    oldest = releases.OLDEST
    monkeypatch.setattr(releases, "installed_version", lambda: DEV)
    monkeypatch.setenv(RULES_ENV, oldest)
    rules = rules_for(DEV)
    assert rules.release == oldest and rules.policy == RELEASES[oldest].policy
    assert f"using {oldest}'s rules and deviations (--vllm-rules)" in (rules_line(DEV) or "")
    assert rules_for(NEWEST) == RELEASES[NEWEST]  # another version: its own row


def test_an_unknown_rules_release_is_a_usage_error_listing_the_known_ones() -> None:
    with pytest.raises(ValueError, match="'0.1.0' is not a known vLLM release") as err:
        check_release("0.1.0")
    assert all(v in str(err.value) for v in RELEASES)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conformance.plugin", "--vllm-rules", "0.1.0",
         "-p", "no:cacheprovider", "--collect-only", "-q", str(ROOT / "tests" / "test_gpu_ci.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert f"known: {', '.join(sorted(RELEASES))}" in proc.stderr, proc.stderr


# --- fixtures ------------------------------------------------------------------------------


def test_an_unknown_build_derives_its_fixtures_live_outside_the_repo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(V, "VLLM_VERSION", DEV)
    monkeypatch.setenv("KVCHUNK_FIXTURES_CACHE", str(tmp_path))
    before = sorted(F.FIXTURES_ROOT.iterdir())
    assert F.fixtures_are_live() and F.fixture_names() == sorted(RECIPES)
    fixture = F.load_fixture("synthetic-full-swa")
    path = F.fixture_path("synthetic-full-swa")
    assert path.is_relative_to(tmp_path) and path.exists()
    assert sorted(F.FIXTURES_ROOT.iterdir()) == before, "nothing written into the repository"
    # Same vLLM code as the stored release: the same geometry, only the label differs.
    stored = F.load_fixture("synthetic-full-swa", INSTALLED)
    label = {"vllm_version", "provenance"}
    assert {k: v for k, v in fixture.items() if k not in label} == {
        k: v for k, v in stored.items() if k not in label
    }
    assert fixture["vllm_version"] == DEV


def test_a_release_older_than_every_stored_one_still_fails_loudly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(V, "VLLM_VERSION", "0.20.0")
    assert not F.fixtures_are_live()
    with pytest.raises(F.MissingFixturesError, match=r"vLLM 0\.20\.0"):
        F.fixture_names()


def test_a_drifted_fixture_is_reported_by_fixture_group_and_field() -> None:
    stored = F.load_fixture("synthetic-full-swa", INSTALLED)
    derived = json.loads(json.dumps(stored))
    derived["resolved"]["groups"][1]["tokens_per_block"] *= 2
    derived["scheduler_kv_cache_config"]["kv_cache_groups"][0]["kv_cache_spec"]["fields"][
        "sliding_window"
    ] += 1
    kind = stored["resolved"]["groups"][1]["kind"]
    tokens = stored["resolved"]["groups"][1]["tokens_per_block"]
    assert F.fixture_differences(stored, derived) == [
        f"resolved.groups[1] (group 1, {kind}, {tokens} tokens per block).tokens_per_block: "
        f"stored {tokens}, derived {2 * tokens}",
        "scheduler_kv_cache_config.kv_cache_groups[0] (group 0, sliding_window, 16 tokens per "
        "block).kv_cache_spec.fields.sliding_window: stored 128, derived 129",
    ]
    assert F.fixture_differences(stored, json.loads(json.dumps(stored))) == []


# --- the suite on a relabelled vLLM ----------------------------------------------------------


def _outcomes(junit: Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        skipped = case.find("skipped")
        if skipped is not None and skipped.get("type") == "pytest.xfail":
            kinds = ["xfailed"]
        out[f"{case.get('classname')}::{case.get('name')}"] = kinds[0] if kinds else "passed"
    return out


def test_a_relabelled_vllm_has_the_same_outcomes_plus_one_line(tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(textwrap.dedent(SITECUSTOMIZE))
    # On an older release, the relabelled build is told to keep that release's rules.
    rules = [] if INSTALLED == NEWEST else ["--vllm-rules", INSTALLED]
    base_env = {
        **os.environ, "KVCHUNK_FIXTURES_CACHE": str(tmp_path / "cache"),
        "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING",
    }
    base_env.pop(RULES_ENV, None)
    runs = {}
    for label, extra_env, extra_args in (
        ("installed", {"PYTHONPATH": str(ROOT)}, []),
        ("relabelled", {"PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}",
                        "KVCHUNK_FAKE_VLLM_VERSION": DEV}, rules),
    ):
        reports = tmp_path / label
        env = {**base_env, **extra_env, "KVCHUNK_REPORTS_DIR": str(reports)}
        runs[label] = (reports, subprocess.Popen(
            [sys.executable, "-m", "conformance", *SLICE, *extra_args, "-p", "no:cacheprovider"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        ))
    outputs = {label: proc.communicate(timeout=900)[0] for label, (_, proc) in runs.items()}
    for label, (_, proc) in runs.items():
        assert proc.returncode == 0, f"{label}:\n{outputs[label][-4000:]}"

    installed = _outcomes(tmp_path / "installed" / f"conformance-{INSTALLED}.xml")
    relabelled = _outcomes(tmp_path / "relabelled" / f"conformance-{DEV}.xml")
    assert relabelled == installed
    assert sum(o == "passed" for o in installed.values()) >= 10
    assert any(o == "xfailed" for o in installed.values()), "the release's deviations applied"

    how = "(the newest known release)" if not rules else "(--vllm-rules)"
    line = (f"vLLM {DEV} is not a known release: using {INSTALLED}'s rules and deviations "
            f"{how}; geometry fixtures derived live")
    assert outputs["relabelled"].count(line) == 2, outputs["relabelled"][-4000:]  # console, report
    report = (tmp_path / "relabelled" / f"conformance-{DEV}.md").read_text()
    assert report.count(line) == 1 and report.splitlines()[2] == line + "."
    assert "not a known release" not in outputs["installed"]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir())[0].startswith(DEV)
