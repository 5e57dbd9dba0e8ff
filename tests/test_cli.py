"""``python -m vllm_adapter config``: output, round trip into a real Scheduler, errors.

* Both shipped model dirs print (table / json / markdown) the geometry vLLM's
  planning derives (equal to the stored fixtures) and the resolved knob.
* The printed ``--kv-transfer-config`` JSON, fed to a real ``Scheduler`` built the
  way :mod:`vllm_adapter.fixtures` builds one, runs kvchunk's connector with
  gemma-4 B=16 (vLLM 0.33.0; B=4 on 0.34.0, see :data:`GEMMA_BY_DEFAULT_BLOCK`) /
  DeepSeek-V4 B=2 for ``block_size`` 512.
* ``--chunk-bytes`` picks the smallest B whose chunk bytes per worker reach the target.
* Every user mistake: non-zero exit, one stderr line, no traceback, nothing on stdout
  (a few cases in a subprocess -- they fail before vLLM is imported, so they are
  quick -- the rest through ``main(argv)``, plus hypothesis over random argv).
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from vllm_adapter.cli import main, parse_bytes
from vllm_adapter.cli.render import human_bytes
from vllm_adapter.disk.tier_budget import POLL_SECONDS
from vllm_adapter.render import render_table

REPO = Path(__file__).resolve().parents[1]
MODELS = REPO / "vllm_adapter" / "models"
GEMMA = ["--model", str(MODELS / "gemma-4-31B-it"), "--tensor-parallel-size", "2"]
DSV4 = [
    "--model",
    str(MODELS / "DeepSeek-V4-Flash"),
    "--tensor-parallel-size",
    "4",
    "--kv-cache-dtype",
    "fp8",
    "--block-size-gpu",
    "256",
]
# model flags, fixture, blocks per chunk for block_size 512 (None: see gemma()), window in
# chunks per group
MODELS_512 = {
    "gemma": (GEMMA, "gemma-4-31B-it-tp2", None, [4, 4, 4, 4, 4, None]),
    "dsv4": (DSV4, "deepseek-v4-flash-tp4", 2, [1, 1, None, 1, 8]),
}
# GEMMA gives no --block-size-gpu, so Gemma-4's sliding groups get vLLM's
# CacheConfig.DEFAULT_BLOCK_SIZE tokens per block (FlashAttention keeps the default) and its
# full group twice that.  vLLM 0.34.0 raised DEFAULT_BLOCK_SIZE from 16 to 64, so block_size
# 512 is B=16 on 0.33.0 and B=4 on 0.34.0: the same 512-token (full) / 256-token (sliding)
# chunks of 4x larger blocks.  DEFAULT_BLOCK_SIZE -> (sliding tokens/block, full
# tokens/block, B for block_size 512, B for --chunk-bytes 64MiB).
GEMMA_BY_DEFAULT_BLOCK = {16: (16, 32, 16, 52), 64: (64, 128, 4, 13)}
CPU_BYTES = 25 << 30

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vllm importable"
)


def gemma() -> tuple[int, int, int, int]:
    """:data:`GEMMA_BY_DEFAULT_BLOCK` for the installed vLLM."""
    from conformance.harness import vllm_harness_api as V

    return GEMMA_BY_DEFAULT_BLOCK[V.CacheConfig.DEFAULT_BLOCK_SIZE]


def models_512(model: str) -> tuple[list[str], str, int, list[int | None]]:
    flags, fixture, blocks, windows = MODELS_512[model]
    return flags, fixture, gemma()[2] if blocks is None else blocks, windows


def _examples(divisor: int) -> int:
    """A modest share of the profile's examples (ci 200 -> 200 // divisor)."""
    return max(10, settings.default.max_examples // divisor)


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = main(["config", *argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def doc(argv: list[str]) -> dict[str, Any]:
    rc, out, err = run([*argv, "--format", "json"])
    assert rc == 0 and err == "", err
    return json.loads(out)


def assert_one_line_error(rc: int, out: str, err: str, needle: str = "") -> None:
    assert rc == 2, (rc, out, err)
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("python -m vllm_adapter"), err
    assert ": error: " in lines[0], err
    assert needle in lines[0], (needle, err)


def fixture_bytes_per_block(name: str) -> int:
    from vllm_adapter import fixtures as fx

    cfg = fx.load_fixture(name)["scheduler_kv_cache_config"]
    return int(cfg["kv_cache_tensors"][0]["size"]) // int(cfg["num_blocks"])


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("model", sorted(MODELS_512))
def test_json_has_the_fixture_geometry_and_the_resolved_knob(model: str) -> None:
    from vllm_adapter import fixtures as fx

    flags, fixture, blocks, windows = models_512(model)
    d = doc([*flags, "--block-size", "512", "--cpu-bytes", str(CPU_BYTES)])
    stored = fx.load_fixture(fixture)["resolved"]
    extra = d["kv_transfer_config"]["kv_connector_extra_config"]
    assert d["kv_transfer_config"] == {
        "kv_connector": "KvchunkOffloadingConnector",
        "kv_connector_module_path": "vllm_adapter.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    assert extra == {
        "block_size": 512,
        "spec_name": "CPUOffloadingSpec",
        "cpu_bytes_to_use": CPU_BYTES,
    }
    assert d["knob"]["blocks_per_chunk"] == blocks
    assert d["vllm"]["tokens_per_hash"] == stored["tokens_per_hash"]
    assert d["vllm"]["offloaded_group_ids"] == stored["offloaded_group_ids"]
    groups = d["groups"]
    assert [g["tokens_per_block"] for g in groups] == [
        g["tokens_per_block"] for g in stored["groups"]
    ]
    assert [g["group_bytes_per_block"] for g in groups] == [
        g["worker_bytes_per_block"] for g in stored["groups"]
    ]
    assert [g["window_in_chunks"] for g in groups] == windows
    assert {g["blocks_per_chunk"] for g in groups} == {blocks}
    assert [g["tokens_per_chunk"] for g in groups] == [
        g["tokens_per_block"] * blocks for g in groups
    ]
    cpu = d["cpu_tier"]
    per_block = fixture_bytes_per_block(fixture)
    assert cpu["worker_kv_bytes_per_block"] == per_block
    assert cpu["chunk_bytes_per_worker"] == per_block * blocks
    assert {g["chunk_bytes_per_worker"] for g in groups} == {per_block * blocks}
    assert max(g["group_bytes_per_chunk"] for g in groups) <= per_block * blocks
    # vLLM's CPU tier: copies x chunk bytes, rounded up to the page; cpu_bytes // slot chunks.
    assert cpu["copies"] == (1 if model == "dsv4" else 2)  # DSv4: replicated MLA layout
    slot = -(-cpu["copies"] * per_block * blocks // cpu["page_alignment"]) * cpu["page_alignment"]
    assert cpu["slot_bytes"] == slot
    assert cpu["num_chunks"] == CPU_BYTES // slot
    assert groups[0]["chunks_per_gib"] == round((1 << 30) / (per_block * blocks), 2)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("model", sorted(MODELS_512))
def test_table_and_markdown_print(model: str) -> None:
    flags, _, blocks, windows = models_512(model)
    rc, table, err = run([*flags, "--block-size", "512"])
    assert rc == 0 and err == ""
    lines = table.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("group "))
    cells = [re.split(r"\s{2,}", r.strip()) for r in lines[header + 1 : header + 1 + len(windows)]]
    assert [c[0] for c in cells] == [str(i) for i in range(len(windows))]
    assert {c[3] for c in cells} == {str(blocks)}  # blocks/chunk
    assert [c[5] for c in cells] == ["-" if w is None else str(w) for w in windows]
    assert lines[-2] == "--kv-transfer-config:"
    printed = json.loads(lines[-1])
    assert printed["kv_connector_extra_config"]["block_size"] == 512
    assert "cpu_bytes_to_use" not in printed["kv_connector_extra_config"]
    assert any("cpu_bytes_to_use" in line for line in lines if line.startswith("note"))

    rc, md, err = run([*flags, "--block-size", "512", "--format", "markdown"])
    assert rc == 0 and err == ""
    md_lines = md.splitlines()
    first = md_lines.index(next(line for line in md_lines if line.startswith("| group ")))
    group_table = md_lines[first : md_lines.index("", first)]  # then the workload's tables
    table_rows = [line for line in group_table if line.startswith("| ") and line[2].isdigit()]
    assert len(table_rows) == len(windows)
    fence = md_lines.index("```json")
    assert json.loads(md_lines[fence + 1]) == printed


# ---------------------------------------------------------------------------
# Round trip: the printed JSON into a real Scheduler
# ---------------------------------------------------------------------------


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("model", sorted(MODELS_512))
def test_printed_json_runs_a_real_scheduler(model: str) -> None:
    from conformance.harness import vllm_harness_api as V
    from vllm_adapter import fixtures as fx
    from vllm_adapter.connector import KvchunkOffloadingConnector

    flags, fixture_name, blocks, _ = models_512(model)
    rc, out, err = run([*flags, "--block-size", "512", "--cpu-bytes", "25GiB"])
    assert rc == 0 and err == ""
    printed = json.loads(out.splitlines()[-1])  # what an operator pastes

    # vllm_adapter.fixtures-style: the fixture's engine config with this KV-transfer config.
    fixture = fx.load_fixture(fixture_name)
    vllm_config = fx.make_vllm_config(
        fixture,
        printed["kv_connector_extra_config"],
        connector=printed["kv_connector"],
        connector_module_path=printed["kv_connector_module_path"],
        cpu_bytes=printed["kv_connector_extra_config"]["cpu_bytes_to_use"],
    )
    pasted = V.KVTransferConfig(**printed)  # what vLLM makes of --kv-transfer-config
    built = vllm_config.kv_transfer_config
    for field in (
        "kv_connector",
        "kv_connector_module_path",
        "kv_role",
        "kv_connector_extra_config",
    ):
        assert getattr(built, field) == getattr(pasted, field), field
    kv_cache_config = fx.rebuild_kv_cache_config(fixture, "scheduler")
    block_size, hash_block_size = fx.scheduler_block_sizes(kv_cache_config, vllm_config)
    scheduler = V.Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=V.StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=False,
    )
    connector = scheduler.connector
    assert isinstance(connector, KvchunkOffloadingConnector)
    assert connector.kvchunk_extra_config["blocks_per_chunk"] == blocks
    assert connector.connector_scheduler.config.blocks_per_chunk == blocks
    assert connector.kvchunk_chunking.uniform_blocks_per_chunk == blocks


# ---------------------------------------------------------------------------
# --chunk-bytes
# ---------------------------------------------------------------------------


@pytest.mark.vllm
@needs_vllm
@settings(max_examples=_examples(16))
@given(
    model=st.sampled_from(sorted(MODELS_512)),
    target=st.one_of(st.integers(1, 64 << 20), st.sampled_from([1 << 20, 16 << 20, 1 << 30])),
)
def test_chunk_bytes_picks_the_smallest_b_reaching_the_target(model: str, target: int) -> None:
    flags = MODELS_512[model][0]
    d = doc([*flags, "--chunk-bytes", str(target)])
    blocks = d["knob"]["blocks_per_chunk"]
    per_block = d["cpu_tier"]["worker_kv_bytes_per_block"]
    assert d["kv_transfer_config"]["kv_connector_extra_config"]["blocks_per_chunk"] == blocks
    assert d["knob"]["given"] == {"chunk_bytes": target}
    assert {g["blocks_per_chunk"] for g in d["groups"]} == {blocks}  # one B for every group
    assert d["cpu_tier"]["chunk_bytes_per_worker"] == per_block * blocks >= target
    assert blocks == 1 or per_block * (blocks - 1) < target  # smallest (every B is valid here)
    # The chosen B, given directly, prints the same table.
    same = doc([*flags, "--blocks-per-chunk", str(blocks)])
    assert same["groups"] == d["groups"]


@pytest.mark.vllm
@needs_vllm
def test_chunk_bytes_units() -> None:
    d = doc([*GEMMA, "--chunk-bytes", "64MiB", "--cpu-bytes", "25GiB"])
    # gemma-4 TP2: 1.25 MiB per block per worker -> 52 blocks = 65 MiB >= 64 MiB > 51 blocks
    # (vLLM 0.34.0's 4x larger default blocks: 5 MiB -> 13 blocks = 65 MiB)
    assert d["knob"]["blocks_per_chunk"] == gemma()[3]
    assert d["cpu_tier"]["cpu_bytes_to_use"] == 25 << 30


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["config", "--model", "/no/such/dir", "-tp", "2"], "no such directory"),
        ([*["config"], *GEMMA, "--block-size", "512", "--blocks-per-chunk", "16"], "only one of"),
        (["config", "--model", str(MODELS / "tiny-llama"), "-tp", "1"], "LlamaForCausalLM"),
    ],
    ids=["missing-dir", "both-knobs", "unsupported-arch"],
)
def test_subprocess_errors_are_one_line(argv: list[str], needle: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_adapter", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, needle)


PRE_IMPORT_ERRORS = [
    (["--model", str(MODELS / "gemma-4-31B-it")], "required: --tensor-parallel-size"),
    ([*GEMMA[:2], "-tp", "0"], "must be a positive integer, got '0'"),
    ([*GEMMA[:2], "-tp", "two"], "must be a positive integer, got 'two'"),
    ([*GEMMA, "--block-size", "0"], "'block_size' must be greater than 0"),
    ([*GEMMA, "--block-size", "5.5"], "'block_size' must be a positive integer"),
    (
        [*GEMMA, "--blocks-per-chunk", "-3"],
        "'blocks_per_chunk' must be a positive integer, got '-3'",
    ),
    ([*GEMMA, "--blocks-per-chunk", "true"], "'blocks_per_chunk' must be a positive integer"),
    ([*GEMMA, "--chunk-bytes", "0"], "positive whole number of bytes"),
    ([*GEMMA, "--chunk-bytes", "1.5B"], "positive whole number of bytes"),
    ([*GEMMA, "--cpu-bytes", "lots"], "must be a byte count"),
    ([*GEMMA, "--chunk-bytes", "1MiB", "--block-size", "512"], "at most one of"),
    ([*GEMMA, "--format", "yaml"], "invalid choice: 'yaml'"),
    ([*GEMMA, "--mamba-cache-mode", "all"], "invalid choice: 'all'"),
    ([*GEMMA, "--prefix-cache-retention-interval", "-1"], "must be an integer >= 0"),
    ([*GEMMA, "--frobnicate"], "unrecognized arguments: --frobnicate"),
    ([*GEMMA, "--kv-cache-dtype", "fp8; rm"], "not a KV-cache dtype name"),
    (["--model", str(MODELS / "gemma-4-31B-it" / "config.json"), "-tp", "2"], "not a directory"),
    ([*GEMMA, "--disk-bytes", "0"], "argument --disk-bytes: must be a positive whole number"),
    ([*GEMMA, "--disk-bytes", "-5"], "argument --disk-bytes: must be a byte count such as"),
    ([*GEMMA, "--disk-bytes", "2TB!"], "argument --disk-bytes: must be a byte count such as"),
    ([*GEMMA, "--plot", "x.png"], "--plot needs --sweep or --sweep-disk"),
    ([*GEMMA, "--sweep", "--sweep-disk", "--plot", "x.png"], "give --sweep or --sweep-disk"),
]


@pytest.mark.parametrize(("argv", "needle"), PRE_IMPORT_ERRORS)
def test_argument_errors_are_one_line(argv: list[str], needle: str) -> None:
    assert_one_line_error(*run(argv), needle)


def test_model_dir_errors(tmp_path: Path) -> None:
    assert_one_line_error(*run(["--model", str(tmp_path), "-tp", "1"]), "no config.json")
    (tmp_path / "config.json").write_text("{not json")
    assert_one_line_error(*run(["--model", str(tmp_path), "-tp", "1"]), "not readable JSON")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert_one_line_error(*run(["--model", str(tmp_path), "-tp", "1"]), "names no 'architectures'")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("26843545600", 26843545600),
        ("25GiB", 25 * 1024**3),
        ("25 gib", 25 * 1024**3),
        ("16MiB", 16 * 1024**2),
        ("1KB", 1000),
        ("1kib", 1024),
        ("1.5GB", 1_500_000_000),
        ("0.5KiB", 512),
        ("1TB", 10**12),
        ("0.29MB", 290_000),  # exact: pydantic's float would give 289999
    ],
)
def test_byte_counts_decimal_and_binary_units(text: str, value: int) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["1_0", "+64", "-1", "1e3", "25G", "8bit", "1 GiB x", "1.5B", "0"])
def test_byte_counts_pydantic_would_take_are_refused(text: str) -> None:
    """``ByteSize`` takes ``1_0``, ``+64``, ``25G`` (decimal), bit units, trailing junk and
    truncates ``1.5B``; the CLI does not."""
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bytes(text)


@pytest.mark.parametrize(
    ("n", "text"),
    [(None, "-"), (1023, "1023 B"), (1024, "1 KiB"), (17038080, "16.25 MiB"), (25 << 30, "25 GiB"),
     (10**400, f"{10**400} B")],  # past a float: printed whole, never an OverflowError
)
def test_human_bytes(n: int | None, text: str) -> None:
    assert human_bytes(n) == text


def test_render_table_text_and_markdown() -> None:
    rows = [("0", "sliding 1024", "51.20"), ("10", "full", "-")]
    assert render_table(("group", "kind", "x"), rows, "text", align=("right", "left", "right")) == (
        "group  kind              x\n"
        "    0  sliding 1024  51.20\n"
        "   10  full              -"
    )
    md = render_table(("group", "kind"), [("0", "full")], "markdown").splitlines()
    header, rule, row = ([c.strip() for c in line.strip("|").split("|")] for line in md)
    assert (header, row) == (["group", "kind"], ["0", "full"])
    assert [set(c) for c in rule] == [{"-"}, {"-"}]
    with pytest.raises(ValueError, match="has 1 cells, headers 2"):
        render_table(("a", "b"), [("x",)], "text")


def test_no_command_and_help() -> None:
    out, err = io.StringIO(), io.StringIO()
    assert main([], stdout=out, stderr=err) == 2
    assert len(err.getvalue().splitlines()) == 1 and "required: command" in err.getvalue()
    out = io.StringIO()
    assert main(["config", "--help"], stdout=out, stderr=io.StringIO()) == 0
    assert "--chunk-bytes" in out.getvalue()


# Needles are str.format templates: {sliding} / {full} are Gemma-4's tokens per block and
# {below_500} the largest multiple of {full} below 500 (per vLLM release, see gemma()).
PLANNING_ERRORS = [
    # The reference's messages: the knob, the group, valid values.
    (
        [*GEMMA, "--block-size", "500"],
        "'block_size'=500 in kv_connector_extra_config must be a multiple of the alignment "
        "groups' block size ({full} tokens, e.g. group 5 (full, {full} tokens/block)). "
        "Use {below_500} or 512",
    ),
    (
        [*DSV4, "--block-size", "100"],
        "(256 tokens, e.g. group 2 (full, 256 tokens/block)). Use 256",
    ),
    (
        [*GEMMA, "--block-size", "512", "--prefix-cache-retention-interval", "100"],
        "prefix_cache_retention_interval (100) must be a multiple of tokens_per_chunk (256) of "
        "group 0 (sliding_window, window 1024, {sliding} tokens/block)",
    ),
    ([*GEMMA, "--block-size", "512", "--cpu-bytes", "1MiB"], "holds no chunk"),
    # vLLM's own verdicts, on one line.
    ([*GEMMA[:2], "-tp", "3"], "must be divisible by tensor parallel size (3)"),
    ([*GEMMA, "--kv-cache-dtype", "fp9"], "Invalid kv_cache_dtype: 'fp9'"),
]


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize(("argv", "needle"), PLANNING_ERRORS)
def test_planning_errors_are_one_line(argv: list[str], needle: str) -> None:
    sliding, full, _, _ = gemma()
    needle = needle.format(sliding=sliding, full=full, below_500=500 // full * full)
    assert_one_line_error(*run(argv), needle)


@pytest.mark.vllm
@needs_vllm
@settings(max_examples=_examples(8))
@given(tokens=st.integers(1, 1 << 20).filter(lambda t: t % 32))
def test_block_size_not_a_multiple_names_the_group_and_valid_values(tokens: int) -> None:
    full = gemma()[1]  # 32 or 128: a non-multiple of 32 is a non-multiple of either
    lower, upper = tokens // full * full, tokens // full * full + full
    valid = f"Use {lower} or {upper}" if lower else f"Use {upper}"
    assert_one_line_error(
        *run([*GEMMA, "--block-size", str(tokens)]),
        f"group 5 (full, {full} tokens/block)). {valid}",
    )


@pytest.mark.vllm
@needs_vllm
def test_gemma_with_the_033_gpu_block_size_is_b16_on_every_release() -> None:
    """``--block-size-gpu 16`` pins vLLM 0.33.0's default layout on any release: B=16."""
    d = doc([*GEMMA, "--block-size-gpu", "16", "--block-size", "512"])
    assert [g["tokens_per_block"] for g in d["groups"]] == [16] * 5 + [32]
    assert d["knob"]["blocks_per_chunk"] == 16
    assert [g["tokens_per_chunk"] for g in d["groups"]] == [256] * 5 + [512]


# A chunk longer than --max-model-len: DeepSeek-V4 TP4 (256-token blocks) at 1024 tokens.
MAX_MODEL_LEN = 1024
SHORT_WORKLOAD = Path(__file__).parent / "data" / "short-prompts.toml"
"""Prompts of at most 402 tokens: the CLI refuses a workload longer than --max-model-len."""


def dsv4_max_model_len_expected(max_model_len: int) -> tuple[str, int, int, int]:
    """From the stored fixture, by brute force: the longest group (as error messages name
    it), its tokens per block, the largest B whose chunk fits on every group's hash boundary,
    and the next such B above it."""
    from vllm_adapter import fixtures as fx

    resolved = fx.load_fixture(MODELS_512["dsv4"][1])["resolved"]
    groups, tph = resolved["groups"], resolved["tokens_per_hash"]
    longest = max(groups, key=lambda g: g["tokens_per_block"])
    assert [g for g in groups if "sliding" not in g["kind"]] == [longest]  # block_size's unit
    tpb = longest["tokens_per_block"]

    def valid(b: int) -> bool:
        return all(g["tokens_per_block"] * b % tph == 0 for g in groups)

    largest = max(b for b in range(1, max_model_len // tpb + 1) if valid(b))
    above = next(b for b in range(largest + 1, 10**6) if valid(b))
    return f"group {longest['index']} (full, {tpb} tokens/block)", tpb, largest, above


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize(("flag", "knob"), [("--block-size", "block_size"),
                                            ("--blocks-per-chunk", "blocks_per_chunk")])
def test_a_chunk_longer_than_max_model_len_is_one_line(flag: str, knob: str) -> None:
    group, tpb, largest, above = dsv4_max_model_len_expected(MAX_MODEL_LEN)
    unit = tpb if knob == "block_size" else 1
    flags = [*DSV4, "--max-model-len", str(MAX_MODEL_LEN), "--workload", str(SHORT_WORKLOAD)]
    # The largest valid value runs (here its chunk is exactly max_model_len long) ...
    d = doc([*flags, flag, str(largest * unit)])
    assert d["engine"]["max_model_len"] == MAX_MODEL_LEN
    assert d["knob"]["blocks_per_chunk"] == largest
    assert max(g["tokens_per_chunk"] for g in d["groups"]) == largest * tpb <= MAX_MODEL_LEN
    # ... the next valid one is refused: the knob, the group and its chunk, the largest value.
    rc, out, err = run([*flags, flag, str(above * unit)])
    assert_one_line_error(rc, out, err, f"{flag}: '{knob}'={above * unit} gives {group} "
                                        f"chunks of {above * tpb} tokens")
    assert f"max_model_len={MAX_MODEL_LEN}" in err, err
    assert f"The largest valid '{knob}' is {largest * unit} " in err, err


@pytest.mark.vllm
@needs_vllm
def test_dsv4_block_size_2048_at_max_model_len_1024() -> None:
    """The issue's case: 2048-token chunks, 1024-token requests."""
    group, tpb, largest, _ = dsv4_max_model_len_expected(1024)
    rc, out, err = run([*DSV4, "--max-model-len", "1024", "--block-size", "2048",
                        "--workload", str(SHORT_WORKLOAD)])
    assert_one_line_error(rc, out, err, f"--block-size: 'block_size'=2048 gives {group} chunks "
                                        "of 2048 tokens")
    assert f"The largest valid 'block_size' is {largest * tpb} " in err, err
    assert f'{{"block_size": {largest * tpb}}}' in err, err


_JUNK = st.one_of(
    st.integers(-(10**6), 10**12).map(str),
    st.sampled_from(["", "0", "-0", "1e3", "2.5", "0x10", "true", "null", " 64 ", "1_0"]),
    st.text(alphabet="0123456789.-+abcGMKiB ", max_size=8),
)
_PLAUSIBLE = st.sampled_from(["512", "1024", "16", "2", "256", "64MiB", "25GiB", "4096"])
_VALUE = st.one_of(_PLAUSIBLE, _JUNK)
_BYTES = st.sampled_from(["25GiB", "1TB", "1073741824", "26843545600"])
_KNOB = st.sampled_from(["--block-size", "--blocks-per-chunk", "--chunk-bytes"])
_MODELS = [
    (str(MODELS / "gemma-4-31B-it"), "2"),
    (str(MODELS / "DeepSeek-V4-Flash"), "4"),
]


@st.composite
def random_argv(draw: st.DrawFn) -> list[str]:
    """Mostly plausible command lines with junk mixed in (planned models only: cached)."""
    model, tp = draw(
        st.sampled_from(
            [*_MODELS, *_MODELS, (str(MODELS / "tiny-llama"), "1"), (str(MODELS / "nope"), "2")]
        )
    )
    argv = ["--model", model]
    if draw(st.sampled_from([True] * 9 + [False])):  # usually present
        # Few distinct TP values: each new one is a (cached) vLLM planning run.
        bad_tp = st.sampled_from(["0", "-1", "x", "", "2.0", "1_0", "3", "10**9"])
        argv += ["--tensor-parallel-size", draw(st.one_of(st.just(tp), bad_tp))]
    for flag in draw(st.lists(_KNOB, max_size=draw(st.sampled_from([1, 1, 2])))):
        argv += [flag, draw(_VALUE)]
    if draw(st.sampled_from([True, False])):
        argv += ["--cpu-bytes", draw(st.one_of(_BYTES, _JUNK))]
    if draw(st.booleans()):
        argv += ["--format", draw(st.sampled_from(["table", "json", "markdown", "xml"]))]
    return argv


@pytest.mark.vllm
@needs_vllm
@settings(max_examples=_examples(4))
@given(argv=random_argv())
def test_random_argv_prints_or_fails_with_one_line(argv: list[str]) -> None:
    rc, out, err = run(argv)
    event(f"exit status {rc}")
    if rc == 0:
        assert err == ""
        assert "KvchunkOffloadingConnector" in out
        if "json" in argv:
            json.loads(out)
    else:
        assert_one_line_error(rc, out, err)


# ---------------------------------------------------------------------------
# File economics and the fs tier (TieringOffloadingSpec)
# ---------------------------------------------------------------------------


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("blocks", [1, 8])
@pytest.mark.parametrize("model", sorted(MODELS_512))
def test_file_bytes_follow_the_fixture_geometry_and_no_closed_form_count(
    model: str, blocks: int
) -> None:
    flags, fixture, _, _ = models_512(model)
    d = doc([*flags, "--blocks-per-chunk", str(blocks), "--cpu-bytes", str(CPU_BYTES)])
    # Each file is one CPU slot: copies x bytes per block x B, rounded up to 4 KiB.
    copies = 1 if model == "dsv4" else 2
    raw = copies * fixture_bytes_per_block(fixture) * blocks
    assert d["files"]["file_bytes"] == -(-raw // 4096) * 4096
    assert d["files"]["fs_tier"] is None
    # One disk answer (issue #26): the workload's counts, not 1e6 / tokens_per_chunk.
    assert "files_per_million_tokens" not in d["files"]
    assert all("files_per_million_tokens" not in g for g in d["groups"])
    rc, out, err = run([*flags, "--blocks-per-chunk", str(blocks)])
    assert rc == 0, err
    assert "files per million tokens" not in out and "files/1M tokens" not in out


@pytest.mark.vllm
@needs_vllm
def test_chunk_bytes_states_the_file_size_of_the_chosen_knob() -> None:
    d = doc([*DSV4, "--chunk-bytes", "8MiB"])
    per_block = fixture_bytes_per_block("deepseek-v4-flash-tp4")
    blocks = -(-(8 << 20) // per_block)  # the smallest B reaching 8 MiB per worker
    assert d["knob"]["blocks_per_chunk"] == blocks
    # DeepSeek-V4's MLA cache: one copy for all ranks, rounded up to 4 KiB.
    assert d["files"]["file_bytes"] == -(-per_block * blocks // 4096) * 4096


@pytest.mark.vllm
@needs_vllm
def test_tiering_spec_emits_vllms_fs_secondary_tier() -> None:
    import inspect

    from conformance.harness import vllm_harness_api as V

    d = doc(
        [
            *DSV4,
            "--block-size",
            "512",
            "--cpu-bytes",
            str(CPU_BYTES),
            "--spec-name",
            "TieringOffloadingSpec",
            "--fs-path",
            "/mnt/kvcache",
            "--fs-write-threads",
            "8",
        ]
    )
    extra = d["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra == {
        "block_size": 512,
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": CPU_BYTES,
        "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/kvcache", "n_write_threads": 8}],
    }
    assert d["files"]["fs_tier"] == extra["secondary_tiers"][0]
    assert d["cpu_tier"]["spec_name"] == "TieringOffloadingSpec"
    # Every tier key but "type" is a FileSystemTierManager constructor parameter.
    params = inspect.signature(V.FileSystemTierManager.__init__).parameters
    assert set(extra["secondary_tiers"][0]) - {"type"} <= set(params)
    V.KVTransferConfig(**d["kv_transfer_config"])
    # --fs-write-threads 8 is the disk model's write concurrency (reads keep 16 threads):
    # seconds per file max(latency / threads, bytes / bandwidth) with 8 threads, not 16.
    from vllm_adapter.disk_model import FS_MODELS

    default = doc([*DSV4, "--block-size", "512", "--cpu-bytes", str(CPU_BYTES)])
    slot = d["files"]["file_bytes"]
    for row, base, m in zip(d["traffic"]["disk"], default["traffic"]["disk"], FS_MODELS,
                            strict=True):
        assert row["fs_model"] == base["fs_model"] == m.name
        ratio = max(m.file_latency_s / 8, slot / m.bandwidth_bps) / max(
            m.file_latency_s / 16, slot / m.bandwidth_bps)
        if row["write_bound"] == base["write_bound"] == "metadata":
            ratio = 1.0  # the shared metadata rate's floor: no thread count moves it
        assert row["write_seconds_per_million"] == pytest.approx(
            base["write_seconds_per_million"] * ratio), (m.name, row, base)
        assert row["read_seconds_per_million"] == pytest.approx(base["read_seconds_per_million"])
    assert any(m.file_latency_s / 16 > slot / m.bandwidth_bps for m in FS_MODELS), (
        "no latency-bound model: the thread count would change nothing here")


@pytest.mark.vllm
@needs_vllm
def test_kvchunk_tiering_spec_emits_a_complete_disk_config(tmp_path: Path) -> None:
    """``--spec-name KvchunkTieringOffloadingSpec --fs-path DIR --disk-bytes 4GiB``: the
    config kvchunk's disk tier serves with, as printed (table and json), loadable as is."""
    import importlib

    from conformance.harness import vllm_harness_api as V
    from vllm_adapter.disk import options as TO
    from vllm_adapter.disk.tier import KvchunkTieringOffloadingSpec
    from vllm_adapter.names import KVCHUNK_TIERING_SPEC

    root = str(tmp_path / "kv")
    argv = [*GEMMA, "--block-size", "512", "--spec-name", "KvchunkTieringOffloadingSpec",
            "--fs-path", root, "--disk-bytes", "4GiB"]
    rc, out, err = run(argv)
    assert rc == 0 and err == "", err
    lines = out.splitlines()
    config = json.loads(lines[lines.index("--kv-transfer-config:") + 1])
    extra = config["kv_connector_extra_config"]
    assert extra == {
        "block_size": 512,
        "spec_name": "KvchunkTieringOffloadingSpec",
        "spec_module_path": "vllm_adapter.disk",
        "secondary_tiers": [{"type": "fs", "root_dir": root, "disk_bytes_to_use": 4 << 30}],
    }
    assert {k: extra[k] for k in KVCHUNK_TIERING_SPEC} == KVCHUNK_TIERING_SPEC
    assert doc(argv)["kv_transfer_config"] == config
    # Loadable: vLLM parses it, its spec factory finds kvchunk's spec, the tier takes the entry.
    V.KVTransferConfig(**config)
    module = importlib.import_module(extra["spec_module_path"])
    assert getattr(module, extra["spec_name"]) is KvchunkTieringOffloadingSpec
    (tier,) = TO.kvchunk_tier_configs(extra["secondary_tiers"])
    assert tier["disk_bytes_to_use"] == 4 << 30
    # Without --disk-bytes the tier refuses to start: the output says to add it.
    d = doc([*GEMMA, "--block-size", "512", "--spec-name", "KvchunkTieringOffloadingSpec",
             "--fs-path", root])
    assert d["files"]["fs_tier"] == {"type": "fs", "root_dir": root}
    assert any('"disk_bytes_to_use"' in n and "--disk-bytes" in n for n in d["notes"]), d["notes"]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([*GEMMA, "--fs-path", "/mnt/kv"], "--fs-path needs --spec-name TieringOffloadingSpec"),
        ([*GEMMA, "--fs-read-threads", "4"], "--fs-read-threads needs --spec-name"),
        ([*GEMMA, "--spec-name", "TieringOffloadingSpec"], "give --fs-path DIR"),
        ([*GEMMA, "--spec-name", "KvchunkTieringOffloadingSpec", "--disk-bytes", "4GiB"],
         "--spec-name KvchunkTieringOffloadingSpec: give --fs-path DIR"),
        ([*GEMMA, "--spec-name", "Nope"], "invalid choice: 'Nope'"),
    ],
)
def test_fs_tier_flag_errors_are_one_line(argv: list[str], needle: str) -> None:
    assert_one_line_error(*run(argv), needle)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("model", sorted(MODELS_512))
def test_a_knob_past_a_float_fails_with_one_line(model: str) -> None:
    """``--blocks-per-chunk 10**400`` (found by the CLI fuzzer: an OverflowError in the
    files-per-million-tokens column and the byte rendering; ``test_human_bytes`` keeps the
    rendering's case): its chunks are far longer than the model's max_model_len, so it is a
    one-line error, with or without a CPU tier."""
    flags, _, _, _ = models_512(model)
    huge = str(10**400)
    for extra in ([], ["--cpu-bytes", str(CPU_BYTES)]):
        rc, out, err = run([*flags, "--blocks-per-chunk", huge, *extra])
        assert_one_line_error(rc, out, err, f"'blocks_per_chunk'={huge} gives group")
        assert "max_model_len=" in err, err


# ---------------------------------------------------------------------------
# The workload: files, bytes, recomputed tokens, disk time, per-group map, sweep
# ---------------------------------------------------------------------------


VLLM_POOL_THREADS = 16 + 16
"""vLLM's fs tier pool by default: 16 read-priority and 16 write-priority threads
(``FileSystemTierManager``'s ``n_read_threads`` / ``n_write_threads``)."""


def reference_economics(
    model: str, knob: dict[str, Any], retention: int | None = 0, prompt_only: bool = True,
    section_bytes: int | None = None, threads: int = VLLM_POOL_THREADS,
) -> tuple[Any, Any, Any]:
    """What :mod:`reference.economics` says for the fixture under ``knob`` and the installed
    release's rules, serving the CLI's default workload: (Economics, chunking, policy).
    ``section_bytes`` (the CPU tier's row): the packed tier splits its large load jobs as it
    does by default, ``PART_BYTES`` parts over its pool's ``threads`` (None: one task each)."""
    import dataclasses

    from conformance.harness import vllm_harness_api as V
    from conformance.protocol.versions import rules_for
    from reference.economics import economics
    from reference.layout_economics import PackedLoads
    from reference.packed_split import PART_BYTES, LoadSplit
    from reference.workload import preset
    from vllm_adapter import fixtures as fx
    from vllm_adapter.cli.args import DEFAULT_WORKLOAD
    from vllm_adapter.connector import resolve_for_vllm
    from vllm_adapter.geometry import with_extra_config

    data = fx.load_fixture(MODELS_512[model][1])
    vc = fx.make_vllm_config(data, {})
    vc.cache_config.prefix_cache_retention_interval = retention
    vc = with_extra_config(vc, {**knob, "spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": 1 << 30})
    chunking, _ = resolve_for_vllm(vc, fx.rebuild_kv_cache_config(data, "scheduler"))
    policy = dataclasses.replace(
        rules_for(V.VLLM_VERSION).policy, retention_interval=retention,
        offload_prompt_only=prompt_only,
    )
    loads = None if section_bytes is None else PackedLoads(
        LoadSplit(threads, PART_BYTES), {gc.group.index: section_bytes for gc in chunking.groups})
    return (economics(chunking, preset(DEFAULT_WORKLOAD), policy, packed_loads=loads), chunking,
            policy)


def assert_traffic_is(traffic: dict[str, Any], e: Any, file_bytes: dict[int, int]) -> None:
    assert [g["index"] for g in traffic["groups"]] == [g.index for g in e.groups]
    for got, want in zip(traffic["groups"], e.groups, strict=True):
        assert got["files_written_per_million"] == pytest.approx(e.per_million(want.files_written))
        assert got["files_read_per_million"] == pytest.approx(e.per_million(want.files_read))
        assert got["files_read_once_per_million"] == pytest.approx(
            e.per_million(want.files_read_once)
        )
        assert got["bytes_written_per_million"] == pytest.approx(
            e.per_million(want.files_written * file_bytes[want.index])
        )
    assert traffic["files_written_per_million"] == pytest.approx(e.per_million(e.files_written))
    assert traffic["files_read_per_million"] == pytest.approx(e.per_million(e.files_read))
    assert traffic["files_read_once_per_million"] == pytest.approx(e.per_million(e.files_read_once))
    # Both layouts side by side: per chunk (the figures above), then packed per store job.
    per_chunk, packed = traffic["layouts"]
    assert (per_chunk["layout"], packed["layout"]) == ("per_chunk", "packed")
    assert per_chunk["files_written_per_million"] == traffic["files_written_per_million"]
    assert per_chunk["file_opens_per_million"] == pytest.approx(traffic["files_read_per_million"])
    assert per_chunk["bytes_written_per_million"] == pytest.approx(
        traffic["bytes_written_per_million"])
    for got, want in ((packed, e.packed), (traffic["packed_per_request"], e.packed_per_request)):
        assert got["files_written_per_million"] == pytest.approx(e.per_million(want.files_written))
        assert got["sections_written_per_million"] == pytest.approx(
            traffic["files_written_per_million"])
        assert got["file_opens_once_per_million"] == pytest.approx(
            e.per_million(want.file_opens_once))
        assert got["sections_read_once_per_million"] == pytest.approx(
            traffic["files_read_once_per_million"])
        assert got["file_opens_per_million"] <= per_chunk["file_opens_per_million"]
    assert traffic["recomputed_tail_per_million"] == pytest.approx(
        e.per_million(e.recomputed_tail_tokens)
    )
    assert traffic["recomputed_lost_per_million"] == pytest.approx(
        e.per_million(e.recomputed_lost_tokens)
    )


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("retention", [0, None], ids=["sparse", "dense"])
@pytest.mark.parametrize("model", sorted(MODELS_512))
def test_files_per_million_are_reference_economics(model: str, retention: int | None) -> None:
    """The CLI's per-group files and bytes per million prompt tokens are what
    ``reference.economics`` computes for the same chunking, rules and workload."""
    flags = models_512(model)[0]
    given = ["--prefix-cache-retention-interval", "None"] if retention is None else []
    d = doc([*flags, "--block-size", "512", *given])
    slot = d["cpu_tier"]["slot_bytes"]
    e, chunking, _ = reference_economics(model, {"block_size": 512}, retention, section_bytes=slot)
    assert_traffic_is(d["traffic"], e, {g.index: slot for g in e.groups})
    assert list(d)[-8:] == ["workload", "policy", "fs_models", "traffic", "per_group_map", "sweep",
                            "disk", "metadata"]
    assert d["sweep"] is None
    assert d["workload"]["name"] == "chat" and d["workload"]["prompt_tokens"] == e.prompt_tokens
    assert d["policy"]["prefix_cache_retention_interval"] == retention
    assert d["engine"]["prefix_cache_retention_interval"] == retention
    # Modelled disk time: files x max(latency / threads, bytes / bandwidth), per fs model;
    # on a model whose metadata service is a shared rate, at least the stores' metadata
    # operations over it (vLLM's tier: 4 a file; kvchunk's: 4 a file and 18 a store job).
    from vllm_adapter.disk_model import FS_MODELS

    def floored(seconds: float, ops: float, m: Any) -> float:
        return max(seconds, ops / m.metadata_ops_per_s) if m.metadata_ops_per_s else seconds

    assert any(m.metadata_ops_per_s for m in FS_MODELS)
    assert [r["fs_model"] for r in d["traffic"]["disk"]] == [m.name for m in FS_MODELS]
    for row, m in zip(d["traffic"]["disk"], FS_MODELS, strict=True):
        files = e.per_million(e.files_written)
        expected = files * max(m.file_latency_s / m.concurrency, slot / m.bandwidth_bps)
        expected = floored(expected, files * sum(VLLM_FILE_STORED), m)
        assert row["write_seconds_per_million"] == pytest.approx(expected)
    # Packed: each file priced with its own bytes (a header page-rounded plus its sections).
    packed = d["traffic"]["layouts"][1]
    sizes = e.packed.written_sizes({g.index: slot for g in e.groups})
    assert all(size > slot for size, _ in sizes)
    for row, m in zip(packed["disk"], FS_MODELS, strict=True):
        expected = sum(
            e.per_million(n) * max(m.file_latency_s / m.concurrency, size / m.bandwidth_bps)
            for size, n in sizes
        )
        ops = e.per_million(e.packed.files_written * sum(KVCHUNK_FILE_STORED)
                            + e.packed.jobs_written * sum(KVCHUNK_STORE_JOB))
        assert row["write_seconds_per_million"] == pytest.approx(floored(expected, ops, m))


@pytest.mark.vllm
@needs_vllm
def test_packed_opens_and_reads_are_those_of_the_split_the_tier_will_use(tmp_path: Path) -> None:
    """kvchunk's packed tier splits a large load job across its pool (a slice opens each
    file it touches, and reads each run it holds): the CLI's packed file opens and reads
    per million are the reference's counted with the tier's split, on vLLM's default pool
    or on the fs tier's ``n_read_threads + n_write_threads``; gemma-4's rows are large
    enough that the split opens more files than one task per job."""
    flags = models_512("gemma")[0]
    fs = ["--spec-name", "KvchunkTieringOffloadingSpec", "--fs-path", str(tmp_path)]
    for extra, threads in (([], VLLM_POOL_THREADS),
                           ([*fs, "--fs-read-threads", "1", "--fs-write-threads", "2"], 3)):
        d = doc([*flags, "--block-size", "512", *extra])
        slot = d["cpu_tier"]["slot_bytes"]
        e, _, _ = reference_economics("gemma", {"block_size": 512}, section_bytes=slot,
                                      threads=threads)
        packed = d["traffic"]["layouts"][1]
        assert packed["layout"] == "packed"
        for key, want in (("file_opens", e.packed.file_opens),
                          ("file_opens_once", e.packed.file_opens_once),
                          ("reads", e.packed.reads), ("reads_once", e.packed.reads_once)):
            assert packed[f"{key}_per_million"] == pytest.approx(e.per_million(want)), (extra, key)
    unsplit, _, _ = reference_economics("gemma", {"block_size": 512})
    assert e.packed.file_opens > unsplit.packed.file_opens


@pytest.mark.vllm
@needs_vllm
def test_dsv4_chat_prints_both_layouts_and_packing_writes_a_quarter_of_the_files() -> None:
    """Issue #24's target: DeepSeek-V4 TP4, block_size 512, chat -- at most 790 packed files
    per million prompt tokens, from 3,153 per chunk; every format carries the same numbers."""
    argv = ["--model", str(MODELS / "DeepSeek-V4-Flash"), "--tensor-parallel-size", "4",
            "--block-size", "512", "--workload", "chat"]
    d = doc(argv)
    per_chunk, packed = d["traffic"]["layouts"]
    assert round(per_chunk["files_written_per_million"]) == 3153
    assert packed["files_written_per_million"] <= 790
    assert packed["file_opens_once_per_million"] <= per_chunk["file_opens_once_per_million"] / 2
    for fmt in ("table", "markdown"):
        rc, out, err = run([*argv, "--format", fmt])
        assert rc == 0, err
        rows = {line.split("|")[1].strip() if fmt == "markdown" else line.split()[0]: line
                for line in out.splitlines()
                if re.match(r"\|? ?(per_chunk|packed) ", line) and "GB" in line
                and "fs model" not in line}
        for layout in (per_chunk, packed):
            row = rows[layout["layout"]]
            for key in ("files_written_per_million", "file_opens_per_million",
                        "file_opens_once_per_million"):
                assert f"{layout[key]:,.0f}" in row, (fmt, key, row)
        assert "read once:" in out and "every load:" in out


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("model", sorted(MODELS_512))
def test_per_group_map_is_reference_economics_of_the_map(model: str) -> None:
    """Every group at the full-attention tokens per chunk, resolved by the reference (the
    connector refuses it): B_g = T / tokens_per_block_g, each group's own bytes per file;
    its packed opens and reads counted with the split the tier will use, as every other
    figure (each group's rows its sections, vLLM's default pool)."""
    from reference.economics import economics
    from reference.knobs import PerGroupBlocksPerChunk, resolve
    from reference.layout_economics import PackedLoads
    from reference.packed_split import PART_BYTES, LoadSplit
    from reference.workload import preset

    flags = models_512(model)[0]
    d = doc([*flags, "--block-size", "512"])
    e, chunking, policy = reference_economics(model, {"block_size": 512})
    m = d["per_group_map"]
    assert m["valid"] and m["tokens_per_chunk"] == 512
    values = {gc.group.index: 512 // gc.group.tokens_per_block for gc in chunking.groups}
    assert {int(k): v for k, v in m["blocks_per_chunk"].items()} == values
    mapped = resolve(chunking.geometry, PerGroupBlocksPerChunk.of(values), 0)
    assert {gc.tokens_per_chunk for gc in mapped.groups} == {512}
    cpu, rows = d["cpu_tier"], {g["index"]: g for g in d["groups"]}
    sizes = {
        i: -(-rows[i]["group_bytes_per_block"] * cpu["copies"] * b // cpu["page_alignment"])
        * cpu["page_alignment"]
        for i, b in values.items()
    }
    split = PackedLoads(LoadSplit(VLLM_POOL_THREADS, PART_BYTES), sizes)
    e_map = economics(mapped, preset("chat"), policy, packed_loads=split)
    assert_traffic_is(m["traffic"], e_map, sizes)
    if model == "gemma":  # rows large enough that the split opens more files
        unsplit = economics(mapped, preset("chat"), policy)
        assert e_map.packed.file_opens > unsplit.packed.file_opens


@pytest.mark.vllm
@needs_vllm
def test_decode_storing_workload_file_and_fs_model(tmp_path: Path) -> None:
    """--decode-storing is vLLM's offload_prompt_only false; --workload FILE; --fs-model."""
    agentic = (REPO / "reference" / "workloads" / "agentic.toml").read_text()
    path = tmp_path / "mine.toml"
    path.write_text(agentic.replace('name = "agentic"', 'name = "mine"').replace(
        "sessions = 4", "sessions = 1"))
    argv = [*DSV4, "--block-size", "512", "--workload", str(path), "--fs-model", "nfs"]
    prompt_only = doc(argv)
    stored = doc([*argv, "--decode-storing"])
    extra = stored["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["offload_prompt_only"] is False
    assert "offload_prompt_only" not in prompt_only["kv_transfer_config"]["kv_connector_extra_config"]
    assert stored["policy"]["offload_prompt_only"] is False
    assert prompt_only["policy"]["offload_prompt_only"] is True
    assert stored["workload"]["name"] == "mine" and stored["workload"]["given"] == str(path)
    assert (
        stored["traffic"]["files_written_per_million"]
        >= prompt_only["traffic"]["files_written_per_million"]
    )
    assert [m["name"] for m in stored["fs_models"]] == ["NFS/Lustre"]
    assert [r["fs_model"] for r in stored["traffic"]["disk"]] == ["NFS/Lustre"]
    rc, out, err = run([*argv, "--decode-storing"])
    assert rc == 0 and "prompt and decoded tokens stored" in out, err
    assert "NFS/Lustre" in out and "object store" not in out


@pytest.mark.vllm
@needs_vllm
def test_sweep_table_json_and_plot(tmp_path: Path) -> None:
    from vllm_adapter.disk_model import FS_MODELS

    argv = [*GEMMA, "--blocks-per-chunk", "4", "--sweep"]
    d = doc(argv)
    sweep = d["sweep"]
    assert sweep["knob_name"] == "blocks_per_chunk" and sweep["plot"] is None
    assert [p["knob"] for p in sweep["points"]] == [{"blocks_per_chunk": 1 << k} for k in range(8)]
    assert sweep["points"][0]["recomputed_added_per_million"] is None
    for a, b in zip(sweep["points"], sweep["points"][1:], strict=False):
        assert b["recomputed_added_per_million"] == pytest.approx(
            b["traffic"]["recomputed_per_million"] - a["traffic"]["recomputed_per_million"]
        )
        assert b["file_bytes"] > a["file_bytes"]
    # The chosen knob's point is the CLI's own figures.
    (chosen,) = [p for p in sweep["points"] if p["knob"] == {"blocks_per_chunk": 4}]
    assert chosen["traffic"] == d["traffic"]
    # What the bench times (run_sweep, no CLI) is this computation: every point's packed
    # opens and reads those of the split the tier will use.
    from reference.workload import preset
    from vllm_adapter import fixtures as fx
    from vllm_adapter.planning import run_sweep

    data = fx.load_fixture(MODELS_512["gemma"][1])
    timed = run_sweep(fx.make_vllm_config(data, {}), fx.rebuild_kv_cache_config(data, "scheduler"),
                      "blocks_per_chunk", preset(sweep_workload := d["workload"]["name"]))
    assert sweep_workload == "chat" and len(timed.points) == len(sweep["points"])
    for got, printed in zip(timed.points, sweep["points"], strict=True):
        packed = printed["traffic"]["layouts"][1]
        assert got.traffic.layouts[1].layout == packed["layout"] == "packed"
        for key in ("file_opens_per_million", "reads_per_million"):
            assert getattr(got.traffic.layouts[1], key) == pytest.approx(packed[key]), key
    # The knee: the first point whose files are bandwidth-bound both ways, per model.
    for knee, m in zip(sweep["knees"], FS_MODELS, strict=True):
        first = next((p for p in sweep["points"]
                      if m.bound(p["file_bytes"], "write") == m.bound(p["file_bytes"], "read")
                      == "bandwidth"), None)
        assert knee["fs_model"] == m.name
        assert knee["knob"] == (None if first is None else first["knob"])
    png = tmp_path / "sweep.png"
    rc, out, err = run([*argv, "--plot", str(png)])
    assert rc == 0 and err == "", err
    assert "sweep of blocks_per_chunk" in out and f"plot: {png}" in out
    assert "IOPS-bound" in out and "+recomputed" in out
    # One line per layout per knob value.
    for layout in ("per_chunk", "packed"):
        assert sum(1 for line in out.splitlines()
                   if re.match(rf"blocks_per_chunk=\d+ +\d+ +{layout} ", line)) == 8
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


WORKLOAD_FILE_ERRORS = [
    ('name = "w"\nsessions = 2\nturns = "four"\nturn_tokens = 8\noutput_tokens = 8\n', "turns"),
    ('name = "w"\nsessions = 2\nturns = 2\nturn_tokens = [9, 1]\noutput_tokens = 8\n',
     "turn_tokens"),
    ('name = "w"\nsessions = 2\nturns = 2\nturn_tokens = 8\noutput_tokens = 8\nsesions = 3\n',
     "sesions"),
    ('name = "w"\nturns = 2\nturn_tokens = 8\noutput_tokens = 8\n', "sessions"),
    ("name = [", "not valid TOML"),
]


@pytest.mark.parametrize(("text", "field"), WORKLOAD_FILE_ERRORS)
def test_malformed_workload_file_is_one_line_naming_the_field(
    tmp_path: Path, text: str, field: str
) -> None:
    path = tmp_path / "w.toml"
    path.write_text(text)
    rc, out, err = run([*GEMMA, "--workload", str(path)])
    assert_one_line_error(rc, out, err, "--workload: workload file")
    assert field in err, err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([*GEMMA, "--workload", "nope"], "neither a preset (chat, rag, agentic) nor an existing file"),
        ([*GEMMA, "--plot", "x.png"], "--plot needs --sweep"),
        ([*GEMMA, "--sweep", "--chunk-bytes", "8MiB"], "not --chunk-bytes"),
        ([*GEMMA, "--fs-model", "tape"], "invalid choice: 'tape'"),
        ([*GEMMA, "--prefix-cache-retention-interval", "dense"], "or None (dense retention)"),
    ],
)
def test_economics_flag_errors_are_one_line(argv: list[str], needle: str) -> None:
    assert_one_line_error(*run(argv), needle)


@pytest.mark.vllm
@needs_vllm
def test_disk_budget_and_miss_ratio_curve() -> None:
    """``--disk-bytes`` / ``--sweep-disk`` on DeepSeek-V4 ``block_size`` 512: a disk at least
    the unbounded run's peak evicts nothing and serves what the unbounded disk serves; a
    smaller one serves fewer hits; both rules side by side; the rule strands nothing; the
    table and markdown carry the JSON's numbers."""
    flags = [*DSV4, "--block-size", "512", "--disk-bytes", "1PiB", "--sweep-disk"]
    d = doc(flags)["disk"]
    assert d["prompt_tokens"] >= 900_000 and "sessions" in d["scaling"]
    curve = d["curve"]
    assert len(curve) == 8
    sizes = [p["budget_bytes"] for p in curve]
    assert sizes == sorted(sizes) and len(set(sizes)) == 8
    unbounded = curve[-1]  # the peak itself: nothing had to go
    for rule in ("rule", "lru"):
        assert unbounded[rule]["files_evicted_per_million"] == 0
        assert unbounded[rule]["recomputed_for_space_per_million"] == 0
        assert unbounded[rule]["bytes_on_disk"] <= unbounded["budget_bytes"]
    assert [r["rule"] for r in d["at_budget"]] == ["reachable", "lru"]
    for at, rule in zip(d["at_budget"], ("rule", "lru"), strict=True):
        assert at["budget_bytes"] == 1 << 50
        assert at["files_evicted_per_million"] == 0
        assert at["hits_per_million"] == unbounded[rule]["hits_per_million"]
    smallest = curve[0]
    for rule in ("rule", "lru"):
        assert smallest[rule]["hits_per_million"] < unbounded[rule]["hits_per_million"]
        assert smallest[rule]["files_evicted_per_million"] > 0
        assert smallest[rule]["bytes_on_disk"] <= smallest["budget_bytes"]
        assert smallest[rule]["recomputed_for_space_per_million"] > 0
    assert all(p["rule"]["stranded_bytes"] == 0 for p in curve)
    assert all(p["rule"]["rule"] == "reachable" and p["lru"]["rule"] == "lru" for p in curve)
    # no --cpu-bytes: the series with the CPU tier in front is not served, and the output says so
    assert d["cpu_curve"] is None and d["cpu_bytes"] is None
    assert "give --cpu-bytes" in run(flags)[1]
    for fmt in ("table", "markdown"):
        rc, out, err = run([*flags, "--format", fmt])
        assert rc == 0 and err == "", err
        assert "hit rate (rule)" in out and "hit rate (LRU)" in out and "LRU stranded" in out
        assert f"{smallest['lru']['stranded_bytes']} (" in out
        for p in curve:
            assert f"{p['budget_bytes']} (" in out
            assert f"{p['rule']['hit_rate']:.1%}" in out and f"{p['lru']['hit_rate']:.1%}" in out


# ---------------------------------------------------------------------------
# Engines per file system: metadata operations per layout (issue #30 item 5)
# ---------------------------------------------------------------------------

METADATA_KINDS = ("created", "opened", "renamed", "unlinked", "makedirs", "lookups",
                  "ledger_locks", "ledger_appends")
# Per event, by kind, from the syscalls (strace of vLLM 0.34.0's fs_io_C and kvchunk's ledger).
# vLLM's fs tier: a file stored is access(dest) + create_directories (a stat) + create +
# rename; a file read is the access that found it + open; per request and group, the access
# that misses after the hit.
VLLM_FILE_STORED = (1, 0, 1, 0, 1, 1, 0, 0)
VLLM_FILE_READ = (0, 1, 0, 0, 0, 1, 0, 0)
VLLM_MISS_PROBE = (0, 0, 0, 0, 0, 1, 0, 0)
# kvchunk's packed tier: a store job that writes files is two ledger transactions (open lock,
# flock, symlink held, open to replay, open to write, write, readlink + unlink held, release);
# a file stored is, a full budget evicting a file per file written, the victim's rename onto
# the temporary name (recycled), its open and the rename into place, + the write's poll (a
# stat), and no directory call (its directory exists after the first file); a file a load
# opens: open;
# a load job: its use records (open + write).
KVCHUNK_STORE_JOB = (0, 6, 0, 0, 0, 0, 10, 2)
KVCHUNK_FILE_STORED = (0, 1, 2, 0, 0, 1, 0, 0)
KVCHUNK_FILE_OPENED = (0, 1, 0, 0, 0, 0, 0, 0)
KVCHUNK_LOAD_JOB = (0, 1, 0, 0, 0, 0, 0, 1)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("model", sorted(MODELS_512))
def test_engines_per_file_system_are_the_reference_counts(model: str) -> None:
    """``--fs-metadata-ops`` / ``--prefill-tokens-per-s`` on both models at ``block_size``
    512: each layout's metadata operations per million prompt tokens are the reference's
    files written, file opens (every load), load jobs and requests times each event's
    syscalls; one engine's rate at T; the engines N serves (vLLM's tier: N / rate; kvchunk's:
    the last count whose engines, each with its ledger follower and its peers' appends,
    fit); every format carries the numbers."""
    tokens, capacity = 10_000, 5_000
    argv = [*models_512(model)[0], "--block-size", "512", "--prefill-tokens-per-s", str(tokens),
            "--fs-metadata-ops", str(capacity)]
    d = doc(argv)
    assert list(d)[-2:] == ["disk", "metadata"]
    m = d["metadata"]
    assert (m["fs_metadata_ops"], m["prefill_tokens_per_s"]) == (capacity, tokens)
    e, _, _ = reference_economics(model, {"block_size": 512},
                                  section_bytes=d["cpu_tier"]["slot_bytes"])
    per_chunk, packed = e.per_chunk, e.packed  # reference.layout_economics.LayoutEconomics
    assert (per_chunk.layout, packed.layout) == ("per_chunk", "packed")

    def per_million(n: float) -> float:
        return n * 1_000_000 / e.prompt_tokens

    want = {
        "per_chunk": [per_million(per_chunk.files_written * s + per_chunk.file_opens * r
                                  + e.requests * len(e.groups) * p)
                      for s, r, p in zip(VLLM_FILE_STORED, VLLM_FILE_READ, VLLM_MISS_PROBE,
                                         strict=True)],
        "packed": [per_million(packed.files_written * s + packed.jobs_written * t
                               + packed.file_opens * o + e.load_jobs * j)
                   for s, t, o, j in zip(KVCHUNK_FILE_STORED, KVCHUNK_STORE_JOB,
                                         KVCHUNK_FILE_OPENED, KVCHUNK_LOAD_JOB, strict=True)],
    }
    rows = {row["layout"]: row for row in m["layouts"]}
    assert list(rows) == ["per_chunk", "packed"]
    assert list(rows["packed"]) == [
        "layout", *(f"{k}_per_million" for k in METADATA_KINDS), "ops_per_million",
        "fixed_ops_per_second", "ops_per_second", "engines",
        "ops_per_second_per_engine_at_engines"]
    for name, kinds in want.items():
        row = rows[name]
        assert [row[f"{k}_per_million"] for k in METADATA_KINDS] == pytest.approx(kinds)
        assert row["ops_per_million"] == pytest.approx(sum(kinds))
    # Packing asks fewer operations per token, and vLLM's tier none of the ledger's.
    assert rows["packed"]["ops_per_million"] < rows["per_chunk"]["ops_per_million"] / 2
    assert rows["per_chunk"]["ledger_locks_per_million"] == 0
    # vLLM's tier: N / (ops per million x T / 1M).
    chunk_rate = sum(want["per_chunk"]) * tokens / 1e6
    assert rows["per_chunk"]["ops_per_second"] == pytest.approx(chunk_rate)
    assert rows["per_chunk"]["engines"] == int(capacity // chunk_rate)
    # kvchunk's: each engine adds its follower's stats (one per poll) and a replay (7
    # operations) per peer's append, at most one per poll; a peer's file is not opened.
    polls = 1 / POLL_SECONDS
    own = sum(want["packed"]) * tokens / 1e6
    appends = per_million(2 * packed.jobs_written + e.load_jobs) * tokens / 1e6
    assert rows["packed"]["ops_per_second"] == pytest.approx(own + polls)

    def each(n: int) -> float:
        return own + polls + 7 * min(polls, (n - 1) * appends)

    n = 0
    while (n + 1) * each(n + 1) <= capacity:
        n += 1
    assert n >= 1 and rows["packed"]["engines"] == n
    assert rows["packed"]["ops_per_second_per_engine_at_engines"] == pytest.approx(each(n))
    for fmt in ("table", "markdown"):
        rc, out, err = run([*argv, "--format", fmt])
        assert rc == 0 and err == "", err
        section = out[out.index("metadata operations per million"):]
        assert f"{capacity:,} operations/s" in section and f"{tokens:,} prompt tokens/s" in section
        for name, row in rows.items():
            line = next(x for x in section.splitlines() if re.match(rf"\|? ?{name} ", x))
            cells = [c.strip() for c in line.strip("|").split("|")] if fmt == "markdown" \
                else line.split()
            assert cells[0] == name
            assert cells[9:] == [f"{row['ops_per_million']:,.0f}", f"{row['ops_per_second']:,.0f}",
                                 f"{row['ops_per_second_per_engine_at_engines']:,.0f}",
                                 f"{row['engines']:,}"], (fmt, line)


@pytest.mark.vllm
@needs_vllm
def test_without_a_prefill_rate_the_metadata_table_has_counts_only() -> None:
    """No ``--prefill-tokens-per-s``: operations per million prompt tokens, the default rate
    and its source (a CephFS MDS, from disk-anchors.md), no engines."""
    d = doc([*DSV4, "--block-size", "512"])
    m = d["metadata"]
    assert m["prefill_tokens_per_s"] is None and m["fs_metadata_ops"] == 2700
    assert "CephFS" in m["fs_metadata_ops_source"] and "disk-anchors.md" in m[
        "fs_metadata_ops_source"]
    assert all(r["engines"] is None and r["ops_per_second"] is None for r in m["layouts"])
    rc, out, err = run([*DSV4, "--block-size", "512"])
    assert rc == 0 and "give --prefill-tokens-per-s T" in out


@pytest.mark.parametrize(("argv", "needle"), [
    ([*GEMMA, "--fs-metadata-ops", "5000"], "--fs-metadata-ops needs --prefill-tokens-per-s"),
    ([*GEMMA, "--prefill-tokens-per-s", "0"], "must be a positive integer"),
    ([*GEMMA, "--prefill-tokens-per-s", "1e4"], "must be a positive integer"),
    ([*GEMMA, "--prefill-tokens-per-s", "100", "--fs-metadata-ops", "-5"],
     "must be a positive integer"),
])
def test_metadata_flag_errors_are_one_line(argv: list[str], needle: str) -> None:
    assert_one_line_error(*run(argv), needle)


@pytest.mark.vllm
@needs_vllm
def test_disk_runs_report_refusals_drops_recomputation_and_bytes() -> None:
    """Issue #31's counters, per rule: stores refused, keys dropped by admission, tokens
    recomputed for lack of space (the count beside its per-million figure), bytes stranded
    and on disk at the end.  DeepSeek-V4 agentic on a 40 MiB disk: both rules refuse stores
    (no room for a store's file after eviction), LRU admits every key and strands what it
    keeps, the rule strands nothing; the table carries the JSON's numbers."""
    flags = [*DSV4, "--block-size", "512", "--workload", "agentic", "--disk-bytes", "40MiB"]
    d = doc(flags)["disk"]
    rule, lru = d["at_budget"]
    assert (rule["rule"], lru["rule"]) == ("reachable", "lru")
    for r in (rule, lru):
        assert list(r)[-5:] == ["stranded_bytes", "bytes_on_disk", "stores_refused",
                                "keys_dropped", "recomputed_for_space_tokens"]
        assert all(isinstance(r[k], int) for k in list(r)[-5:])
        assert r["recomputed_for_space_per_million"] == pytest.approx(
            r["recomputed_for_space_tokens"] * 1e6 / d["prompt_tokens"])
        assert 0 < r["bytes_on_disk"] <= r["budget_bytes"] == 40 << 20
        assert r["stores_refused"] > 0
    assert rule["stranded_bytes"] == 0 and lru["stranded_bytes"] > 0
    assert lru["keys_dropped"] == 0
    for fmt in ("table", "markdown"):
        rc, out, err = run([*flags, "--format", fmt])
        assert rc == 0 and err == "", err
        assert "stores refused" in out and "keys dropped" in out and "bytes on disk" in out
        for r in (rule, lru):
            assert f"{r['bytes_on_disk']} (" in out and f" {r['stores_refused']} " in out


@pytest.mark.vllm
@needs_vllm
def test_disk_bytes_below_the_files_of_one_chunk_is_one_line_naming_that_size() -> None:
    """Issue #31, bad input: ``--disk-bytes`` below the smallest packed files a full chunk
    needs (the tier's own floor, :func:`vllm_adapter.disk.budget.min_disk_bytes`: a file of
    the full-attention sections and one of the window sections, one CPU-tier row each) is
    a one-line error naming that size; that size itself is served."""
    from vllm_adapter.disk.budget import min_disk_bytes
    from vllm_adapter.disk.chunk_file import HEADER_SIZE
    from vllm_adapter.planning import fixture_knob

    knob = fixture_knob("deepseek-v4-flash-tp4", "block_size", 512)
    smallest = min_disk_bytes("packed", knob.row.row_bytes(), len(knob.chunking.groups),
                              HEADER_SIZE, full_groups=len(knob.chunking.full_groups))
    assert smallest > knob.row.row_bytes()
    flags = [*DSV4, "--block-size", "512", "--workload", "agentic"]
    assert_one_line_error(*run([*flags, "--disk-bytes", str(smallest - 1)]),
                          f"--disk-bytes {smallest - 1} is smaller than the packed files one "
                          f"full chunk needs ({smallest} bytes")
    served = doc([*flags, "--disk-bytes", str(smallest)])["disk"]["at_budget"]
    assert [r["budget_bytes"] for r in served] == [smallest, smallest]


@pytest.mark.vllm
@needs_vllm
def test_sweep_disk_with_the_cpu_tier_in_front() -> None:
    """``--sweep-disk --cpu-bytes``: a second series at the same disk sizes with vLLM's CPU
    tier in front (``cpu_bytes // slot`` chunk slots).  A CPU tier that holds the whole
    workload (1 PiB, more than this machine's memory: accepted with a one-line note) serves
    every reuse itself: at every disk size and under both rules nothing is promoted nor read
    from the disk, and the hits are the unbounded disk's; a smaller one reads the disk; the
    table and markdown carry the JSON's numbers."""
    base = [*GEMMA, "--block-size", "512", "--workload", "agentic", "--sweep-disk"]
    d = doc([*base, "--cpu-bytes", "1PiB"])
    notes = [n for n in d["notes"] if "machine's memory" in n]
    assert len(notes) == 1 and "accepted for modelling" in notes[0] and "\n" not in notes[0]
    disk = d["disk"]
    assert disk["cpu_bytes"] == 1 << 50
    assert disk["cpu_chunks"] == d["cpu_tier"]["num_chunks"] == (1 << 50) // d["cpu_tier"]["slot_bytes"]
    sizes = [p["budget_bytes"] for p in disk["curve"]]
    assert [p["budget_bytes"] for p in disk["cpu_curve"]] == sizes
    unbounded = disk["curve"][-1]["lru"]
    assert unbounded["files_evicted_per_million"] == 0
    for p in disk["cpu_curve"]:
        for rule in ("rule", "lru"):
            r = p[rule]
            assert r["keys_promoted_per_million"] == 0 and r["files_read_per_million"] == 0
            assert r["lookups_abandoned"] == 0 and r["promotions_refused"] == 0
            assert r["hits_per_million"] == unbounded["hits_per_million"], (p["budget_bytes"], rule)

    small = doc([*base, "--cpu-bytes", "8GiB"])["disk"]
    assert small["cpu_chunks"] == (8 << 30) // d["cpu_tier"]["slot_bytes"]
    cpu_curve = small["cpu_curve"]
    assert any(p["rule"]["keys_promoted_per_million"] > 0 for p in cpu_curve)
    for p in cpu_curve:
        for rule in ("rule", "lru"):
            assert p[rule]["bytes_on_disk"] <= p["budget_bytes"]
    for fmt in ("table", "markdown"):
        rc, out, err = run([*base, "--cpu-bytes", "8GiB", "--format", fmt])
        assert rc == 0 and err == "", err
        assert "with vLLM's CPU tier in front of the disk" in out and "lookups abandoned" in out
        assert "machine's memory" not in out
        for p in cpu_curve:
            assert f"{p['rule']['hit_rate']:.1%}" in out and f"{p['lru']['hit_rate']:.1%}" in out
            assert f"{p['lru']['stranded_bytes']} (" in out


def test_a_cpu_tier_larger_than_memory_is_one_line_of_note() -> None:
    from vllm_adapter.cli.cpu_tier import memory_note

    assert memory_note(8 << 30, memory=16 << 30) is None
    assert memory_note(16 << 30, memory=16 << 30) is None
    note = memory_note(32 << 30, memory=16 << 30)
    assert note is not None and "\n" not in note
    assert "32.0 GiB" in note and "16.0 GiB" in note and "accepted for modelling" in note
