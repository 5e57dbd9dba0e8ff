"""Every release switch is reached through vLLM.

For each :class:`reference.plan.Policy` switch on which the supported releases differ
(:data:`vllm_adapter.releases.RELEASES`), :data:`SWITCH_CASES` names lane cases whose
outcome through vLLM differs between the switch's settings:

* a versions-lane case (``conformance/lanes/test_versions.py::test_change``) records
  vLLM's trace, replays it exactly under the installed release's rules, and asserts
  that the other setting of the switch answers differently;
* an economics-lane case (``conformance/lanes/test_tiered_economics.py``) asserts that
  the files vLLM writes and reads equal the installed release's prediction, and, with
  ``EconomicsCase.switch`` naming the switch, that the other setting predicts other files.

The golden corpus check does not count: it flags any change, right or wrong.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from reference.plan import Policy
from vllm_adapter.releases import RELEASES

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = "conformance/lanes/test_versions.py"
ECONOMICS = "conformance/lanes/test_tiered_economics.py"

SWITCH_CASES: dict[str, tuple[str, ...]] = {
    "last_token": (f"{VERSIONS}::test_change[last-token-cap]",),
    "null_blocks_in_store": (f"{VERSIONS}::test_change[null-blocks-in-store-jobs]",),
    "reload_after_failed_load": (f"{VERSIONS}::test_change[failed-load-retry]",),
    "offload_junctions": (
        f"{ECONOMICS}::test_predicted_files_are_the_files_written"
        "[deepseek-v4-flash-tp4-block_size512-junction-retention=0]",
    ),
}
"""Switch -> the lane cases (pytest node ids) whose outcome through vLLM it changes."""


def differing_switches() -> set[str]:
    """The Policy switches on which the supported releases' rules differ."""
    return {
        f.name for f in fields(Policy)
        if len({repr(getattr(r.policy, f.name)) for r in RELEASES.values()}) > 1
    }


def test_every_switch_the_releases_differ_on_has_a_case() -> None:
    differing = differing_switches()
    missing = sorted(differing - set(SWITCH_CASES))
    stale = sorted(set(SWITCH_CASES) - differing)
    assert not missing, f"release switches with no lane case reaching them through vLLM: {missing}"
    assert not stale, f"SWITCH_CASES lists switches the releases agree on: {stale}"
    assert all(SWITCH_CASES.values()), "every switch needs at least one case"


def test_the_differing_switches_are_found() -> None:
    """The scan itself: it sees a switch the releases differ on, and not one they share."""
    assert "last_token" in differing_switches()
    assert "retention_interval" not in differing_switches()


def test_each_case_is_a_collected_lane_case_that_separates_its_switch() -> None:
    pytest.importorskip("vllm")
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    files = sorted({case.split("::")[0] for cases in SWITCH_CASES.values() for case in cases})
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         *files],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    collected = set(out.stdout.split())
    missing = [c for cases in SWITCH_CASES.values() for c in cases if c not in collected]
    assert not missing, (
        f"cases not collected from the lanes: {missing}\n{out.stdout[-2000:]}{out.stderr[-2000:]}")

    from conformance.lanes import test_tiered_economics as economics
    from conformance.lanes import test_versions as versions

    for switch, cases in SWITCH_CASES.items():
        for case in cases:
            path, name = case.split("::")
            param = name.split("[", 1)[1].rstrip("]")
            if path == VERSIONS:
                # test_change asserts the case separates the releases' rules.
                assert param in versions.CASES, case
            else:
                (econ,) = [c for c in economics.CASES if str(c) == param]
                assert econ.switch == switch, (
                    f"{case} does not assert that {switch} separates its prediction "
                    f"(EconomicsCase.switch is {econ.switch!r})"
                )
