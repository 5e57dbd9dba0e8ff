"""Config fuzzing of the CLI (``python -m vllm_adapter config``) on the real-model fixtures.

Each case runs :func:`vllm_adapter.cli.main` in-process: it must exit 0 with
the reference's resolution (and consistent CPU-tier arithmetic), or exit 2
with exactly one ``error:`` line on stderr and nothing on stdout.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from hypothesis import strategies as st

from conformance.harness import cases
from conformance.harness.fuzz.config import ConfigTarget, ConfigVerdict, config_target, knob_scalars
from reference.geometry import Geometry
from reference.knobs import BLOCK_SIZE, BLOCKS_PER_CHUNK, resolve_extra_config

CLI_FIXTURES = cases.MODEL_FIXTURES
"""The fixtures of real models (the CLI plans model directories, not hand-made groups)."""

CLI_PREFIX = "python -m vllm_adapter config: error: "

CliCase = tuple[str, list[str], dict[str, str]]
"""``(fixture, extra argv, knob)``."""

_cli_text = st.one_of(
    knob_scalars.map(str),
    st.sampled_from(["", "512", "16", "2", " 4 ", "+8", "0", "-1", "1e3", "0x10", "abc", "²",
                     "٥١٢", "8.0", "99999999999999999999999999", "1_000"]),
)
_cli_bytes = st.sampled_from(["25GiB", "16MiB", "1.5GB", "1", "0", "-1", "abc", "1e3", "4096",
                              "10TiB", "0.5KiB", "1.5B", "99999999999999999999999999"])


@st.composite
def cli_cases(draw: Any) -> CliCase:
    """``(fixture, extra argv, knob)``: the knob flags, ``--cpu-bytes`` and ``--chunk-bytes``,
    as text."""
    fixture = draw(st.sampled_from(CLI_FIXTURES))
    argv: list[str] = []
    knob: dict[str, str] = {}
    for flag, key in (("--block-size", BLOCK_SIZE), ("--blocks-per-chunk", BLOCKS_PER_CHUNK)):
        if draw(st.booleans()) and (not knob or draw(st.integers(0, 3)) == 0):
            knob[key] = draw(_cli_text)
            argv += [flag, knob[key]]
    if draw(st.integers(0, 5)) == 0:
        argv += ["--chunk-bytes", draw(_cli_bytes)]
    if draw(st.booleans()):
        argv += ["--cpu-bytes", draw(_cli_bytes)]
    return fixture, argv, knob


@cache
def _cli_base_argv(fixture: str) -> tuple[str, ...]:
    from vllm_adapter import fixtures as F

    fx = F.load_fixture(fixture)
    ea = fx["engine_args"]
    argv = ["config", "--model", str(F.model_dir_path(fx)),
            "--tensor-parallel-size", str(ea["tensor_parallel_size"])]
    if ea.get("block_size") is not None:
        argv += ["--block-size-gpu", str(ea["block_size"])]
    if ea.get("kv_cache_dtype", "auto") != "auto":
        argv += ["--kv-cache-dtype", str(ea["kv_cache_dtype"])]
    if ea.get("disable_hybrid_kv_cache_manager"):
        argv.append("--no-hybrid")
    for key, flag in (("prefix_match_unit", "--prefix-match-unit"),
                      ("mamba_cache_mode", "--mamba-cache-mode"),
                      ("max_model_len", "--max-model-len")):
        if ea.get(key) is not None:
            argv += [flag, str(ea[key])]
    return (*argv, "--format", "json")


def _geometry(target: ConfigTarget) -> Geometry:
    """The CLI's fixtures are real models that vLLM plans: their geometry always exists."""
    if target.geometry is None:
        raise AssertionError(f"{target.name}: vLLM refused the engine config: {target.geometry_error}")
    return target.geometry


def _judge_exit_2(case: CliCase, lines: list[str], stdout: str) -> ConfigVerdict:
    """Exit 2: one error line, and the reference (or vLLM 0.33.0) must refuse the knob too."""
    fixture, argv, knob = case
    if len(lines) != 1 or not lines[0].startswith(CLI_PREFIX) or stdout:
        return ConfigVerdict("unclean", f"exit 2 but stderr {lines!r}, stdout {stdout[:80]!r}")
    if "--chunk-bytes" in argv or len(knob) > 1:
        return ConfigVerdict("rejected", lines[0])
    target = config_target(fixture)
    try:
        chunking = resolve_extra_config(_geometry(target), knob, target.retention)
    except ValueError:
        return ConfigVerdict("rejected", lines[0])
    tph = chunking.tokens_per_hash
    if any(gc.group.tokens_per_block % tph for gc in chunking.groups):
        return ConfigVerdict("rejected", lines[0])
    if "--cpu-bytes" in argv and "--cpu-bytes" in lines[0]:
        return ConfigVerdict("rejected", lines[0])
    return ConfigVerdict("unclean", f"the reference accepts {knob}, the CLI says {lines[0]}")


def _judge_exit_0(case: CliCase, doc: dict[str, Any]) -> ConfigVerdict:
    """Exit 0: the JSON plan holds the reference's resolution and consistent CPU-tier numbers."""
    fixture, argv, knob = case
    target = config_target(fixture)
    if "--chunk-bytes" in argv:
        value = argv[argv.index("--chunk-bytes") + 1]
        want = int(value) if value.isdecimal() else None
        got_bytes = doc["cpu_tier"]["chunk_bytes_per_worker"]
        if want is not None and got_bytes < want:
            return ConfigVerdict("unclean", f"--chunk-bytes {want}: chunks of {got_bytes} bytes")
        return ConfigVerdict("accepted")
    try:
        chunking = resolve_extra_config(_geometry(target), knob, target.retention)
    except ValueError as e:
        return ConfigVerdict("unclean", f"the CLI accepts {knob}, the reference rejects: {e}")
    got = (doc["knob"]["blocks_per_chunk"], doc["vllm"]["tokens_per_hash"],
           [g["tokens_per_chunk"] for g in doc["groups"]])
    want_ = (chunking.uniform_blocks_per_chunk, chunking.tokens_per_hash,
             [gc.tokens_per_chunk for gc in chunking.groups])
    if got != want_:
        return ConfigVerdict("unclean", f"the CLI resolves {knob} to {got}, the reference {want_}")
    cpu = doc["cpu_tier"]
    if (cpu["cpu_bytes_to_use"] is not None
            and cpu["num_chunks"] != cpu["cpu_bytes_to_use"] // cpu["slot_bytes"]):
        return ConfigVerdict("unclean", f"cpu tier arithmetic: {cpu}")
    return ConfigVerdict("accepted")


def check_cli(case: CliCase) -> ConfigVerdict:
    """Run the CLI in-process: exit 0 with the reference's resolution, or 2 with one error line."""
    import io
    import json

    from vllm_adapter import cli

    fixture, argv, _ = case
    out, err = io.StringIO(), io.StringIO()
    try:
        code = cli.main([*_cli_base_argv(fixture), *argv], stdout=out, stderr=err)
    except BaseException as e:  # noqa: BLE001 - nothing may escape main
        return ConfigVerdict("unclean", f"main raised {type(e).__name__}: {e}")
    lines = err.getvalue().splitlines()
    if code == 2:
        return _judge_exit_2(case, lines, out.getvalue())
    if code != 0:
        return ConfigVerdict("unclean", f"exit {code}: {lines!r}")
    return _judge_exit_0(case, json.loads(out.getvalue()))
