"""The README's serve commands are the one copy: they must name this connector and parse.

Two fenced blocks of ``vllm serve`` commands under "Serving with kvchunk's connector":
the CPU tier (``CPUOffloadingSpec``), then the disk variant (``TieringOffloadingSpec``
with vLLM's file-system tier), each gemma-4-31B-it then DeepSeek-V4-Flash.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from reference.knobs import BLOCK_SIZE
from vllm_adapter.names import (
    CPU_SPEC,
    KVCHUNK_CONNECTOR,
    KVCHUNK_CONNECTOR_MODULE,
    KVCHUNK_TIERING_SPEC,
)

README = Path(__file__).resolve().parent.parent / "README.md"
MODELS = ["google/gemma-4-31B-it", "deepseek-ai/DeepSeek-V4-Flash"]
FS_TIER_PARAMETERS = {"root_dir", "n_read_threads", "n_write_threads", "enable_kv_events"}
"""vLLM 0.33.0 / 0.34.0 ``FileSystemTierManager.__init__`` parameters a config may set."""


def _serve_blocks() -> list[list[list[str]]]:
    """The argv of every command, per fenced block holding ``vllm serve``."""
    text = README.read_text()
    section = text[text.index("## Serving with kvchunk's connector") :]
    section = section[: section.index("\n## ", 1)]
    blocks = section.split("```")[1::2]  # the fenced code blocks
    out = []
    for block in (b for b in blocks if "vllm serve" in b):
        commands = [c for c in block.replace("\\\n", " ").split("\n\n") if c.strip()]
        out.append([shlex.split(c) for c in commands])
    return out


def _serve_commands() -> list[list[str]]:
    """The CPU-tier commands (the first block)."""
    return _serve_blocks()[0]


def _config(argv: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config


def test_readme_has_a_cpu_and_a_disk_block() -> None:
    blocks = _serve_blocks()
    assert len(blocks) == 2
    assert [[c[2] for c in block] for block in blocks] == [MODELS, MODELS]


@pytest.mark.parametrize("variant", [0, 1], ids=["cpu", "disk"])
def test_readme_serve_commands_name_kvchunks_connector(variant: int) -> None:
    for argv in _serve_blocks()[variant]:
        assert argv[:2] == ["vllm", "serve"]
        config = _config(argv)
        assert config["kv_connector"] == KVCHUNK_CONNECTOR
        assert config["kv_connector_module_path"] == KVCHUNK_CONNECTOR_MODULE
        assert config["kv_role"] == "kv_both"
        assert int(config["kv_connector_extra_config"]["cpu_bytes_to_use"]) > 0
        assert "--enable-prefix-caching" in argv
        assert "--no-disable-hybrid-kv-cache-manager" in argv


def test_readme_cpu_commands_use_the_seeds_block_size() -> None:
    for argv in _serve_commands():
        extra = _config(argv)["kv_connector_extra_config"]
        assert extra[BLOCK_SIZE] == 512
        assert extra["spec_name"] == CPU_SPEC
        assert "secondary_tiers" not in extra


def test_readme_disk_commands_use_kvchunks_checksummed_fs_tier() -> None:
    """#17: the disk commands select kvchunk's tier (vLLM's stock fs tier serves wrong KV)."""
    gemma, dsv4 = _serve_blocks()[1]
    sizes = [_config(argv)["kv_connector_extra_config"][BLOCK_SIZE] for argv in (gemma, dsv4)]
    assert sizes == [512, 1024]  # DeepSeek-V4: 1024 tokens, half the files of 512
    for argv in (gemma, dsv4):
        extra = _config(argv)["kv_connector_extra_config"]
        assert extra["spec_name"] == KVCHUNK_TIERING_SPEC["spec_name"]
        assert extra["spec_module_path"] == KVCHUNK_TIERING_SPEC["spec_module_path"]
        (tier,) = extra["secondary_tiers"]
        assert tier["type"] == "fs"
        assert tier["root_dir"].startswith("/")
        assert set(tier) - {"type"} <= FS_TIER_PARAMETERS


@pytest.mark.parametrize("variant", [0, 1], ids=["cpu", "disk"])
def test_readme_deepseek_command_pins_its_gpu_block_size_and_tokenizer(variant: int) -> None:
    (_, dsv4) = _serve_blocks()[variant]
    assert dsv4[dsv4.index("--block-size") + 1] == "256"
    assert dsv4[dsv4.index("--kv-cache-dtype") + 1] == "fp8"
    assert dsv4[dsv4.index("--tokenizer-mode") + 1] == "deepseek_v4"


def test_first_screen_holds_the_problem_the_commands_and_what_you_get() -> None:
    """#12: the first 40 lines carry the AssertionError, both commands and the report path."""
    first = "\n".join(README.read_text().splitlines()[:40])
    assert "AssertionError" in first and "gemma-4" in first and "DeepSeek-V4" in first
    assert "nox -s conformance" in first and "nox -s tests" in first
    assert "reports/conformance.md" in first and "faults" in first
    assert f'"kv_connector": "{KVCHUNK_CONNECTOR}"' in first
