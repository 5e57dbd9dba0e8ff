"""GPU CI readiness: ``--require-cuda`` fails at start without CUDA, and the CI recipe in
``docs/gpu-ci.md`` runs what ``scripts/gpu_lanes.sh`` runs (its ``--dry-run``)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_lanes.sh"
DOC = ROOT / "docs" / "gpu-ci.md"
DRY_RUN_LINE = re.compile(r"lane (\w+): timeout (\d+) s: (.+)")
VLLM_SPEC = "vllm.v1.kv_offload.tiering.spec:TieringOffloadingSpec"
BYTE_LANES = ("test_data.py", "test_tiered.py", "test_tiered_faults.py")


def _expected_commands(python: str, require_cuda: str = " --require-cuda") -> dict[str, str]:
    """What each lane must run: the CUDA lanes by marker through ``python -m conformance``, and
    the byte lanes with vLLM's own tiering spec through pytest with the conformance plugin."""
    byte_lanes = " ".join(f"conformance/lanes/{name}" for name in BYTE_LANES)
    return {
        "gpu_copy": f"{python} -m conformance{require_cuda} -m gpu_copy",
        "e2e": f"{python} -m conformance{require_cuda} -m e2e",
        "vllm_spec": f"{python} -m pytest -p conformance.plugin{require_cuda} "
        f"--spec {VLLM_SPEC} {byte_lanes}",
    }


def _dry_run(**env: str) -> str:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in {**os.environ, **env}.items() if k != "KVCHUNK_GPU_LANES_ANYWAY"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _lanes(dry_run: str) -> dict[str, tuple[int, str]]:
    lines = dry_run.strip().splitlines()
    matches = [DRY_RUN_LINE.fullmatch(line) for line in lines]
    assert lines and all(matches), dry_run
    return {m[1]: (int(m[2]), m[3]) for m in matches if m}


def _yaml_blocks(text: str) -> list[object]:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S)]


def test_dry_run_lists_the_cuda_lanes_with_require_cuda_and_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    lanes = _lanes(_dry_run(OUT=str(out), PYTHON="python3"))
    assert {lane: command for lane, (_, command) in lanes.items()} == _expected_commands("python3")
    assert all(limit > 0 for limit, _ in lanes.values()), lanes
    assert not out.exists(), "a dry run must write nothing"


def test_the_vllm_spec_lane_names_vllm_s_own_tiering_spec_and_the_byte_lane_files() -> None:
    from conformance.harness.spec_option import SpecUnderTest

    spec = SpecUnderTest.parse(VLLM_SPEC)
    assert spec.is_tiering, "the tiered lanes skip a spec without a file tier"
    assert spec.uses_vllm_worker, "the lane is there to run vLLM's own worker, not kvchunk's"
    assert all((ROOT / "conformance" / "lanes" / name).is_file() for name in BYTE_LANES)


def test_dry_run_follows_the_timeouts_and_the_anyway_switch() -> None:
    timeouts = {"GPU_COPY_TIMEOUT": "7", "E2E_TIMEOUT": "9", "VLLM_SPEC_TIMEOUT": "11"}
    lanes = _lanes(_dry_run(**timeouts, PYTHON="py"))
    commands = _expected_commands("py")
    assert lanes == {
        "gpu_copy": (7, commands["gpu_copy"]),
        "e2e": (9, commands["e2e"]),
        "vllm_spec": (11, commands["vllm_spec"]),
    }
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "KVCHUNK_GPU_LANES_ANYWAY": "1", "PYTHON": "py"},
    )
    assert proc.returncode == 0, proc.stderr
    anyway = {lane: command for lane, (_, command) in _lanes(proc.stdout).items()}
    assert anyway == _expected_commands("py", require_cuda=""), proc.stdout


def test_the_doc_shows_the_dry_run_and_estimates_every_lane() -> None:
    text = DOC.read_text(encoding="utf-8")
    dry_run = _dry_run(PYTHON="python3")
    assert dry_run.strip() in text, "docs/gpu-ci.md must show the script's --dry-run output"
    rows = dict(re.findall(r"^\| (\w+) \|.*\| (\d+) s \|$", text, flags=re.M))
    lanes = _lanes(dry_run)
    assert {lane: int(s) for lane, s in rows.items()} == {k: v[0] for k, v in lanes.items()}
    assert "estimate, not measured" in text and "Nothing on this page has been run on a GPU" in text


def test_both_ci_recipes_run_the_script_within_their_timeout() -> None:
    buildkite, actions = _yaml_blocks(DOC.read_text(encoding="utf-8"))
    lanes = _lanes(_dry_run(PYTHON="python3"))
    minutes = math.ceil(sum(limit for limit, _ in lanes.values()) / 60)

    assert isinstance(buildkite, list) and len(buildkite) == 1
    step = buildkite[0]
    assert step["num_gpus"] == 1 and step["timeout_in_minutes"] >= minutes
    assert any("bash scripts/gpu_lanes.sh" in c for c in step["commands"]), step
    assert any("--require-cuda" in c for c in step["commands"] if "-m conformance" in c), step

    assert isinstance(actions, dict)
    (job,) = actions["jobs"].values()
    assert "gpu" in job["runs-on"] and job["timeout-minutes"] >= minutes
    runs = [s.get("run", "") for s in job["steps"]]
    assert any("bash scripts/gpu_lanes.sh" in r for r in runs), runs


def test_readme_points_to_the_recipe_and_claims_no_gpu_run() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/gpu-ci.md" in readme
    assert "nothing there has been run on a GPU" in readme


def test_nox_conformance_session_forwards_its_arguments() -> None:
    noxfile = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    session = noxfile[noxfile.index("def conformance(") :].split("\n\n\n")[0]
    assert '"-m", "conformance", *session.posargs' in session, session


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
@pytest.mark.parametrize(
    "entry", [["-m", "conformance"], ["-m", "pytest", "-p", "conformance.plugin"]],
    ids=["python -m conformance", "pytest"],
)
def test_require_cuda_fails_at_start_with_one_line(entry: list[str], tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, *entry, "--require-cuda", "-p", "no:cacheprovider",
         str(ROOT / "conformance" / "lanes" / "test_gpu_copy.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "KVCHUNK_REPORTS_DIR": str(tmp_path)},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    errors = [line for line in out.splitlines() if "--require-cuda" in line]
    assert errors == [
        "ERROR: --require-cuda: CUDA is not available (torch.cuda.is_available() is False); "
        "the gpu_copy and e2e lanes cannot run here"
    ], out[-3000:]
    assert not re.search(r"\d+ (passed|skipped)", out), out[-3000:]
    assert list(tmp_path.iterdir()) == [], "a usage error writes no report"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_the_vllm_spec_lane_fails_at_start_without_cuda(tmp_path: Path) -> None:
    command = _lanes(_dry_run(PYTHON=sys.executable))["vllm_spec"][1]
    proc = subprocess.run(
        [*command.split(), "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "KVCHUNK_REPORTS_DIR": str(tmp_path)},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert [line for line in out.splitlines() if line.startswith("ERROR: --require-cuda")], out
    assert not re.search(r"\d+ (passed|skipped|failed)", out), out[-3000:]
