"""The README's serve commands are the one copy: they must name this connector and parse."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from reference.knobs import BLOCK_SIZE

README = Path(__file__).resolve().parent.parent / "README.md"


def _serve_commands() -> list[list[str]]:
    text = README.read_text()
    section = text[text.index("## Serving with kvchunk's connector") :]
    section = section[: section.index("\n## ", 1)]
    blocks = section.split("```")[1::2]  # the fenced code blocks
    (block,) = [b for b in blocks if "vllm serve" in b]
    commands = [c for c in block.replace("\\\n", " ").split("\n\n") if c.strip()]
    return [shlex.split(c) for c in commands]


def test_readme_serve_commands_name_kvchunks_connector() -> None:
    commands = _serve_commands()
    assert [c[2] for c in commands] == ["google/gemma-4-31B-it", "deepseek-ai/DeepSeek-V4-Flash"]
    for argv in commands:
        assert argv[:2] == ["vllm", "serve"]
        config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "KvchunkOffloadingConnector"
        assert config["kv_connector_module_path"] == "vllm_adapter.connector"
        assert config["kv_connector_extra_config"][BLOCK_SIZE] == 512
        assert "--enable-prefix-caching" in argv
        assert "--no-disable-hybrid-kv-cache-manager" in argv


def test_readme_deepseek_command_pins_its_gpu_block_size_and_tokenizer() -> None:
    (_, dsv4) = _serve_commands()
    assert dsv4[dsv4.index("--block-size") + 1] == "256"
    assert dsv4[dsv4.index("--kv-cache-dtype") + 1] == "fp8"
    assert dsv4[dsv4.index("--tokenizer-mode") + 1] == "deepseek_v4"
