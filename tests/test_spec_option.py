"""``--spec module:Class``: the byte lanes (data, tiered, faults) run any ``OffloadingSpec``.

Three ways, each a real pytest run of a lane in a subprocess (one or two small cases):
vLLM's own ``TieringOffloadingSpec`` (its worker needs CUDA: skipped here, with the
reason), kvchunk's specs (pass), and the broken spec shipped as a fixture
(``conformance.testing.broken_spec``: fails, naming the chunk and the block).  Plus the
option's parsing and its errors.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conformance.harness.spec_option import SPEC_ENV, SpecUnderTest, chosen
from conformance.testing.requires import require_vllm

ROOT = Path(__file__).resolve().parent.parent
LANES = ROOT / "conformance" / "lanes"
VLLM_TIERING = "vllm.v1.kv_offload.tiering.spec:TieringOffloadingSpec"
REFERENCE = "vllm_adapter.spec:ReferenceOffloadingSpec"
KVCHUNK_TIERING = "vllm_adapter.disk.tier:KvchunkTieringOffloadingSpec"
BROKEN = "conformance.testing.broken_spec:SwappedBlocksSpec"
SUMMARY = re.compile(r"=* ?(.*\b(?:passed|failed|skipped|error|errors)\b.*) in [\d.]+s")


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["vllm_adapter.spec", "a:b:C", ":Spec", "module:", "1bad.module:Spec", "m:not a name"]
)
def test_a_malformed_spec_is_an_error_naming_the_option_with_an_example(value: str) -> None:
    with pytest.raises(ValueError, match=r"--spec .*module:Class, e\.g\. --spec \w"):
        SpecUnderTest.parse(value)


def test_a_spec_parses_into_its_config_entries() -> None:
    spec = SpecUnderTest.parse(f" {REFERENCE} ")
    assert spec == SpecUnderTest("vllm_adapter.spec", "ReferenceOffloadingSpec")
    assert str(spec) == REFERENCE
    assert spec.entries() == {
        "spec_name": "ReferenceOffloadingSpec",
        "spec_module_path": "vllm_adapter.spec",
    }
    assert spec.id == "spec-ReferenceOffloadingSpec"


def test_chosen_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SPEC_ENV, raising=False)
    assert chosen() is None
    monkeypatch.setenv(SPEC_ENV, BROKEN)
    assert chosen() == SpecUnderTest.parse(BROKEN)


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("no_such_module_kvchunk:Spec", "cannot import"),
        ("vllm_adapter.spec:NoSuchSpec", "has no class"),
        ("conformance.harness.spec_option:SpecUnderTest", "not a subclass of vLLM's OffloadingSpec"),
    ],
)
def test_a_spec_that_does_not_load_is_an_error_naming_the_option(value: str, why: str) -> None:
    require_vllm()
    with pytest.raises(ValueError, match=f"--spec '{re.escape(value)}': .*{why}"):
        SpecUnderTest.parse(value).load()


def test_which_specs_need_cuda_and_which_are_tiering() -> None:
    require_vllm()
    import torch

    for value, tiering, vllm_worker in (
        (REFERENCE, False, False),
        (BROKEN, False, False),
        (KVCHUNK_TIERING, True, False),
        ("vllm_adapter.tiering:ReferenceTieringOffloadingSpec", True, False),
        (VLLM_TIERING, True, True),
        ("vllm.v1.kv_offload.cpu.spec:CPUOffloadingSpec", False, True),
    ):
        spec = SpecUnderTest.parse(value)
        assert (spec.is_tiering, spec.uses_vllm_worker) == (tiering, vllm_worker), value
        reason = spec.cuda_reason()
        if vllm_worker and not torch.cuda.is_available():
            assert reason is not None and "needs CUDA" in reason and value in reason
        else:
            assert reason is None, value


# ---------------------------------------------------------------------------
# The lanes, run with --spec
# ---------------------------------------------------------------------------


def _run_lane(lane: str, spec: str, select: str) -> tuple[int, str]:
    """``pytest -p conformance.plugin conformance/lanes/<lane> --spec <spec> -k <select>``."""
    require_vllm()
    env = {k: v for k, v in os.environ.items() if k != SPEC_ENV}
    env.update(KVCHUNK_PROFILE="dev", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conformance.plugin", str(LANES / lane),
         "--spec", spec, "-k", select, "-q", "-rs", "-p", "no:cacheprovider"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=env,
    )
    return proc.returncode, proc.stdout + proc.stderr


def _outcome(output: str) -> str:
    """The run's final counts line, e.g. ``1 passed, 28 deselected``."""
    lines = [m[1] for m in map(SUMMARY.search, output.splitlines()) if m]
    assert lines, f"no pytest summary line:\n{output[-3000:]}"
    return lines[-1]


@pytest.mark.parametrize("num_cpu_chunks", [3, 16])
def test_vllm_tiering_spec_gets_the_lanes_cpu_tier_size_in_bytes(num_cpu_chunks: int) -> None:
    """vLLM's ``TieringOffloadingSpec`` ignores ``num_cpu_chunks``: under ``--spec`` the
    tiered lanes' CPU tier must reach it in bytes, and vLLM's own spec (built here on CPU:
    its constructor needs no GPU) must then hold exactly the lane's chunk count."""
    require_vllm()
    from conformance.harness import driver as D
    from conformance.harness import vllm_harness_api as V
    from conformance.harness.spec_option import tiered_entries
    from conformance.harness.tiered import tiering_spec

    spec = SpecUnderTest.parse(VLLM_TIERING)
    assert not spec.takes_chunk_count
    assert SpecUnderTest.parse(KVCHUNK_TIERING).takes_chunk_count
    extra = {**tiered_entries(tiering_spec(Path("/nonexistent")), spec), "blocks_per_chunk": 2}
    assert "cpu_bytes_to_use" not in extra
    kvc = D.full_attention_kv_cache_config(block_size=16, num_blocks=64)
    vllm_config, resolved = D.build_vllm_config(
        kvc, extra_config=extra, num_cpu_chunks=num_cpu_chunks
    )
    built = V.TieringOffloadingSpec(V.build_offloading_config(vllm_config, resolved))
    assert built.num_chunks == num_cpu_chunks, (
        f"vLLM's TieringOffloadingSpec got {built.num_chunks} CPU chunks, the lane asked for "
        f"{num_cpu_chunks} (cpu_bytes_to_use "
        f"{vllm_config.kv_transfer_config.kv_connector_extra_config['cpu_bytes_to_use']})"
    )


def test_vllm_tiering_spec_on_the_tiered_lane_skips_with_the_cuda_reason() -> None:
    """vLLM's ``TieringOffloadingSpec`` with its fs tier: its worker is vLLM's CUDA-only one."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the lane runs the spec instead of skipping it")
    code, out = _run_lane("test_tiered.py", VLLM_TIERING, "gemma and block_size512")
    assert code == 0, out[-3000:]
    assert _outcome(out).startswith("1 skipped"), out[-3000:]
    assert f"--spec {VLLM_TIERING}: its worker is vLLM's CPUOffloadingWorker, which needs CUDA" in out
    assert f"use --spec {VLLM_TIERING}" in out, "the run does not say which spec it used"


def test_a_non_tiering_spec_skips_the_tiered_lane_with_the_reason() -> None:
    code, out = _run_lane("test_tiered.py", REFERENCE, "gemma and block_size512")
    assert code == 0, out[-3000:]
    assert _outcome(out).startswith("1 skipped"), out[-3000:]
    assert f"--spec {REFERENCE} is not a tiering spec: the tiered lanes need a file tier" in out


def test_kvchunks_reference_spec_passes_the_data_lane() -> None:
    code, out = _run_lane("test_data.py", REFERENCE, "synthetic-full-bpc4")
    assert code == 0, out[-3000:]
    assert _outcome(out).startswith("1 passed"), out[-3000:]


def test_kvchunks_tiering_spec_passes_the_tiered_faults_lane() -> None:
    code, out = _run_lane(
        "test_tiered_faults.py", KVCHUNK_TIERING,
        "spec-KvchunkTieringOffloadingSpec-flipped or spec-KvchunkTieringOffloadingSpec-same",
    )
    assert code == 0, out[-3000:]
    assert _outcome(out).startswith("2 passed"), out[-3000:]


def test_the_broken_spec_fails_the_data_lane_naming_chunk_and_block() -> None:
    """The worker that swaps two blocks of a chunk on load: every case with two blocks per
    chunk fails, and the failure names the chunk and the block (group, block index)."""
    code, out = _run_lane("test_data.py", BROKEN, "synthetic-full-bpc4")
    assert code == 1, out[-3000:]
    assert _outcome(out).startswith("1 failed"), out[-3000:]
    named = re.search(
        r"request chunk (\d+) \(CPU chunk \d+\), group (\d+) layer \S+: GPU block \d+ at "
        r"block index (\d+) holds wrong bytes \(those of block index (\d+)\)",
        out,
    )
    assert named, f"the failure does not name the chunk and block:\n{out[-3000:]}"
    chunk, _, index, other = map(int, named.groups())
    assert index // 4 == other // 4 == chunk and index != other, named[0]


def test_a_bad_spec_option_is_a_usage_error() -> None:
    code, out = _run_lane("test_data.py", "vllm_adapter.spec", "nothing")
    assert code == pytest.ExitCode.USAGE_ERROR, out[-3000:]
    assert "--spec 'vllm_adapter.spec': expected exactly one ':'" in out
