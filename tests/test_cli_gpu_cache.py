"""``--gpu-cache`` (issue #31 item 4): the GPU prefix cache ``--disk-bytes`` and ``--sweep-disk``
serve under, both series (the disk alone, vLLM's CPU tier in front).

* The flag overrides the workload's own ``gpu_cache`` (a workload file's field; every
  preset's is cold); without it the workload's value is used, as every other figure uses it.
* The CLI's disk figures under ``--gpu-cache M`` are exactly what the reference's curves
  (:func:`reference.disk_economics.miss_ratio_curve`,
  :func:`reference.tiered_curve.tiered_miss_ratio_curve`) compute when called directly with
  ``gpu_cache=GpuCache(M)``; without the flag, with ``GpuCache.COLD`` (today's output).
* A bad value is one line naming the flag and the valid values.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
from pathlib import Path
from typing import Any

import pytest

from reference.disk_economics import miss_ratio_curve, scaled
from reference.eviction import EvictionRule, Layout
from reference.tiered_curve import tiered_miss_ratio_curve
from reference.workload import GpuCache, preset
from vllm_adapter.cli import main
from vllm_adapter.cli.args import GPU_CACHES, build_parser, validate

REPO = Path(__file__).resolve().parents[1]
DSV4 = ["--model", str(REPO / "vllm_adapter" / "models" / "DeepSeek-V4-Flash"),
        "--tensor-parallel-size", "4", "--kv-cache-dtype", "fp8", "--block-size-gpu", "256"]
RULES = (EvictionRule.REACHABLE, EvictionRule.LRU)


def _drawn(seed: int) -> Any:
    from test_tiered_curve import drawn

    return drawn(seed)

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vllm importable"
)


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(["config", *argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def request(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["config", *DSV4, *argv])


def test_the_values_are_gpu_caches() -> None:
    assert GPU_CACHES == ("cold", "hot_shared_prefix") == tuple(c.value for c in GpuCache)


def test_a_bad_value_is_one_line_naming_the_flag_and_the_values() -> None:
    rc, out, err = run([*DSV4, "--block-size", "512", "--sweep-disk", "--gpu-cache", "warm"])
    assert rc == 2 and out == "" and "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "argument --gpu-cache: invalid choice: 'warm'" in lines[0], err
    assert all(v in lines[0] for v in GPU_CACHES), err


def test_the_flag_overrides_the_workload_files_gpu_cache(tmp_path: Path) -> None:
    """Without the flag the workload's ``gpu_cache`` (a file's field; presets: cold); with
    it, the flag's, whatever the file says."""
    text = (REPO / "reference" / "workloads" / "agentic.toml").read_text()
    assert 'gpu_cache = "cold"' in text
    hot = tmp_path / "hot.toml"
    hot.write_text(text.replace('gpu_cache = "cold"', 'gpu_cache = "hot_shared_prefix"'))
    cases = [
        ([], GpuCache.COLD),
        (["--gpu-cache", "hot_shared_prefix"], GpuCache.HOT_SHARED_PREFIX),
        (["--workload", str(hot)], GpuCache.HOT_SHARED_PREFIX),
        (["--workload", str(hot), "--gpu-cache", "cold"], GpuCache.COLD),
        (["--workload", "agentic", "--gpu-cache", "hot_shared_prefix"], GpuCache.HOT_SHARED_PREFIX),
    ]
    for argv, expected in cases:
        got = validate(request(argv)).workload_or_default().gpu_cache
        assert got is expected, (argv, got)


def _captured_run(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                  ) -> tuple[dict[str, Any], tuple[Any, ...], dict[str, Any]]:
    """The CLI's JSON, and the arguments it handed :func:`vllm_adapter.cli.disk.disk_tier`."""
    import vllm_adapter.cli.sizing as sizing

    got: list[tuple[tuple[Any, ...], dict[str, Any]]] = []
    real = sizing.disk_tier

    def spy(*args: Any, **kwargs: Any) -> Any:
        got.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(sizing, "disk_tier", spy)
    rc, out, err = run([*argv, "--format", "json"])
    assert rc == 0 and err == "", err
    (args, kwargs), = got
    return json.loads(out), args, kwargs


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("flag", [None, "hot_shared_prefix"])
def test_both_series_are_the_reference_under_that_gpu_cache(
    flag: str | None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """DeepSeek-V4 TP4 agentic, ``block_size`` 512, a 400 MiB CPU tier: ``--disk-bytes``, the
    disk-only curve and the CPU-in-front curve, every hit rate and stranded byte count as
    the reference computes them called directly with ``gpu_cache`` (no flag: cold, today's
    output)."""
    argv = [*DSV4, "--block-size", "512", "--workload", "agentic", "--cpu-bytes", "400MiB",
            "--sweep-disk", "--disk-bytes", "300MiB"]
    if flag is not None:
        argv += ["--gpu-cache", flag]
    gpu_cache = GpuCache.COLD if flag is None else GpuCache(flag)
    d, args, kwargs = _captured_run(argv, monkeypatch)
    chunking, _, policy, key_bytes = args[:4]
    cpu_chunks, load_split = kwargs["cpu_chunks"], kwargs["load_split"]
    big = scaled(preset("agentic"))  # cold: the curves read their own gpu_cache parameter
    disk = d["disk"]
    assert (f"GPU prefix cache {gpu_cache.value}" in disk["scaling"]
            and gpu_cache.value in disk["workload"]), disk["scaling"]
    sizes = tuple(p["budget_bytes"] for p in disk["curve"])
    assert tuple(p["budget_bytes"] for p in disk["cpu_curve"]) == sizes

    def figures(e: Any) -> tuple[float, int]:
        return e.hit_rate, e.stranded_bytes

    for rule, name in zip(RULES, ("rule", "lru"), strict=True):
        alone = miss_ratio_curve(chunking, big, sizes, rule, key_bytes, Layout.PACKED, policy,
                                 load_split=load_split, gpu_cache=gpu_cache)
        front = tiered_miss_ratio_curve(chunking, big, sizes, cpu_chunks, rule, key_bytes,
                                        Layout.PACKED, policy, load_split=load_split,
                                        gpu_cache=gpu_cache)
        (at,) = miss_ratio_curve(chunking, big, (300 << 20,), rule, key_bytes, Layout.PACKED,
                                 policy, load_split=load_split, gpu_cache=gpu_cache)
        assert [(p[name]["hit_rate"], p[name]["stranded_bytes"]) for p in disk["curve"]] == [
            figures(e) for e in alone], (name, "disk only")
        assert [(p[name]["hit_rate"], p[name]["stranded_bytes"]) for p in disk["cpu_curve"]] == [
            figures(e) for e in front], (name, "CPU tier in front")
        got = next(r for r in disk["at_budget"] if r["rule"] == rule.value)
        assert (got["hit_rate"], got["stranded_bytes"]) == figures(at), (name, "--disk-bytes")


@pytest.mark.parametrize("seed", [s for s in range(12) if _drawn(s).system_tokens >= 32][:3])
def test_the_reference_curves_serve_the_shared_prefix_from_the_gpu_when_hot(seed: int) -> None:
    """Both curves take ``gpu_cache`` as a parameter (nothing hard-coded): on a drawn
    workload with a system prompt, a hot shared prefix serves it from the GPU, so the offload
    tiers serve fewer tokens than with a cold GPU cache at the unbounded disk (disk only, and
    a CPU tier in front); the default is cold."""
    from test_tiered_curve import CHUNKING, KEY_BYTES

    w = _drawn(seed)
    for cpu in (None, 64):
        def curve(cpu: int | None = cpu, **options: Any) -> Any:
            if cpu is None:
                return miss_ratio_curve(CHUNKING, w, 1, EvictionRule.REACHABLE, KEY_BYTES,
                                        Layout.PACKED, **options)
            return tiered_miss_ratio_curve(CHUNKING, w, 1, cpu, EvictionRule.REACHABLE,
                                           KEY_BYTES, Layout.PACKED, **options)

        (default,), (cold,), (hot,) = curve(), curve(gpu_cache=GpuCache.COLD), curve(
            gpu_cache=GpuCache.HOT_SHARED_PREFIX)
        assert default == cold
        assert hot.offload_hit_tokens < cold.offload_hit_tokens, (seed, cpu)
