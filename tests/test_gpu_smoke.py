"""``python -m reference.gpu_smoke`` runs with torch alone, passes on CPU, and catches a wrong copy.

The script is what a GPU machine without vLLM runs (``docs/gpu-ci.md``); here it runs
with ``--device cpu`` in a subprocess where numpy, vLLM, pytest and hypothesis cannot be
imported, so a new import of any of them in the script's reach fails this test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reference.gpu_smoke import DEEPSEEK_V4, GEMMA_4, SHAPES

ROOT = Path(__file__).resolve().parent.parent
BLOCKED = ("numpy", "vllm", "pytest", "hypothesis", "yaml", "blake3", "transformers")
RUNNER = (
    "import sys\n"
    f"for name in {BLOCKED!r}:\n"
    "    sys.modules[name] = None  # import fails: only torch and the standard library exist\n"
    "import runpy\n"
    "sys.argv = ['reference.gpu_smoke', *sys.argv[1:]]\n"
    "runpy.run_module('reference.gpu_smoke', run_name='__main__', alter_sys=True)\n"
)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "ignore", "-c", RUNNER, "--device", "cpu", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )


def test_cpu_run_passes_with_torch_alone() -> None:
    result = _run()
    assert result.returncode == 0, result.stdout + result.stderr
    for shape in SHAPES:
        assert f"{shape.name} ({shape.source}): bytes equal" in result.stdout
        for direction in ("store", "load"):
            row = [line for line in result.stdout.splitlines()
                   if line.startswith(f"| {shape.name} | {direction} |")]
            assert len(row) == 1, result.stdout
            fast, torch_copy, ratio = (float(x) for x in row[0].strip("|").split("|")[3:6])
            assert fast > 0 and torch_copy > 0
            # Four significant digits each: the printed ratio is the printed speeds' to 0.2 %.
            assert abs(ratio - fast / torch_copy) <= 2e-3 * ratio, row[0]


def test_a_corrupted_copy_is_caught() -> None:
    result = _run("--self-test-corrupt")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "byte mismatch" in result.stderr
    for shape in SHAPES:
        for direction in ("store", "load"):
            assert f"{shape.name} {direction} (fast vs plain copy)" in result.stderr
        # Only the corrupted path is reported: the spec still agrees with the plain copy.
        assert f"{shape.name} store (spec vs plain copy)" not in result.stderr
    assert "fixture | direction" not in result.stdout  # no speed table after a mismatch


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the CUDA run is the check")
def test_cuda_without_cuda_is_a_one_line_error() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "reference.gpu_smoke", "--device", "cuda"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "--device cuda: CUDA is not available (torch.cuda.is_available() is False); use --device cpu"
    )


def _fixture(path: str) -> dict:  # type: ignore[type-arg]
    return json.loads((ROOT / path).read_text())


def test_page_shapes_are_the_fixtures() -> None:
    """The hard-coded page shapes are the stored fixtures' (the script cannot read them itself
    without vLLM's codec, but the numbers must not drift from them)."""
    gemma = _fixture(GEMMA_4.source)["resolved"]["groups"]
    assert len(GEMMA_4.group_tensors) == len(gemma)
    for tensors, group in zip(GEMMA_4.group_tensors, gemma, strict=True):
        assert len(tensors) == group["num_layers"]
        assert {GEMMA_4.page_bytes[t] for t in tensors} == {group["page_size_bytes"]}
    deepseek = _fixture(DEEPSEEK_V4.source)
    strides = {t["block_stride"] for t in deepseek["worker_kv_cache_config"]["kv_cache_tensors"]}
    assert DEEPSEEK_V4.page_bytes == tuple(strides)
    assert len(DEEPSEEK_V4.group_tensors) == len(deepseek["resolved"]["offloaded_group_ids"])
