"""The e2e lane's engine configurations: arguments, prompts and metrics for ``vllm.LLM``.

:class:`E2ECase` is one configuration (model, reduction, connector, knob);
:data:`E2E_CASES` are the lane's (``conformance/lanes/test_e2e.py``).  Nothing
here needs vLLM or a GPU; the lane's CUDA skip reason is
:func:`conformance.harness.gpu_copy.cuda_skip_reason`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conformance.harness.cases import ConnectorChoice
from vllm_adapter.names import CPU_SPEC, connector_module

__all__ = [
    "DSV4",
    "E2E_CASES",
    "GEMMA4_TEXT",
    "MODELS_DIR",
    "E2ECase",
    "metric_total",
    "offload_byte_counters",
]

MODELS_DIR = Path(__file__).resolve().parents[2] / "vllm_adapter" / "models"
GEMMA4_TEXT = "gemma-4-31B-it-text"
DSV4 = "DeepSeek-V4-Flash"


def _gemma4_overrides(num_layers: int) -> dict[str, Any]:
    cfg = json.loads((MODELS_DIR / GEMMA4_TEXT / "config.json").read_text())
    return {"num_hidden_layers": num_layers, "layer_types": cfg["layer_types"][:num_layers]}


def _dsv4_overrides(num_layers: int) -> dict[str, Any]:
    cfg = json.loads((MODELS_DIR / DSV4 / "config.json").read_text())
    names = {
        0: "sliding_attention",
        4: "compressed_sparse_attention",
        128: "heavily_compressed_attention",
    }
    ratios = cfg["compress_ratios"][:num_layers]
    n_hash = min(num_layers, int(cfg.get("num_hash_layers", 3)))
    return {
        "num_hidden_layers": num_layers,
        "layer_types": [names[r] for r in ratios],
        "mlp_layer_types": ["hash_moe"] * n_hash + ["moe"] * (num_layers - n_hash),
    }


def _frozen(overrides: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in overrides.items())


@dataclass(frozen=True)
class E2ECase(ConnectorChoice):
    """One engine configuration of the e2e lane."""

    fixture: str
    """Report label: the model and its reduction."""
    model_dir: str
    extra: tuple[tuple[str, int], ...]
    kvchunk: bool
    hf_overrides: tuple[tuple[str, Any], ...]
    engine: tuple[tuple[str, Any], ...] = ()
    prompt_len: int = 1600
    num_prompts: int = 2
    max_tokens: int = 8
    needs_sm: tuple[int, int] | None = None
    """Minimum CUDA compute capability (DeepSeek-V4's FlashMLA kernels: sm90)."""

    def __str__(self) -> str:
        (key, value), *_ = self.extra
        return f"{self.model_dir}-{key}{value}-{'kvchunk' if self.kvchunk else 'stock'}"

    def overrides(self) -> dict[str, Any]:
        """``hf_overrides`` (list values are kept as tuples in the case, for hashing)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.hf_overrides}

    def kv_transfer_config(self, cpu_bytes: int) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "kv_connector": self.connector,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                **dict(self.extra),
                "spec_name": CPU_SPEC,
                "cpu_bytes_to_use": int(cpu_bytes),
            },
        }
        module = connector_module(self.connector)
        if module is not None:
            cfg["kv_connector_module_path"] = module
        return cfg

    def engine_kwargs(self, cpu_bytes: int) -> dict[str, Any]:
        """``vllm.LLM(**kwargs)``: dummy weights, token-id prompts, HMA + prefix caching on, TP=1."""
        return {
            "model": str(MODELS_DIR / self.model_dir),
            "load_format": "dummy",
            "skip_tokenizer_init": True,
            "generation_config": "vllm",
            "hf_overrides": self.overrides(),
            "tensor_parallel_size": 1,
            "enforce_eager": True,
            "enable_prefix_caching": True,
            "disable_hybrid_kv_cache_manager": False,
            "max_model_len": 4096,
            "max_num_seqs": 8,
            "gpu_memory_utilization": 0.85,
            "kv_cache_memory_bytes": 8 << 30,
            "seed": 0,
            "disable_log_stats": False,
            "kv_transfer_config": self.kv_transfer_config(cpu_bytes),
            **dict(self.engine),
        }

    def prompts(self, vocab_size: int, seed: int = 0) -> list[list[int]]:
        """Token-id prompts: the second shares the first half of the first."""
        rng = random.Random(seed)
        hi = max(1100, min(vocab_size, 100_000) - 100)
        first = [rng.randrange(1000, hi) for _ in range(self.prompt_len)]
        out = [first]
        for _ in range(1, self.num_prompts):
            half = self.prompt_len // 2
            out.append(
                first[:half] + [rng.randrange(1000, hi) for _ in range(self.prompt_len - half)]
            )
        return out


E2E_CASES = [
    # 12 of 60 layers: 10 sliding (5 groups of 2) + 2 full, the same six KV groups as the full model.
    E2ECase(
        "gemma-4-31B-it (12 layers, TP1)",
        GEMMA4_TEXT,
        (("block_size", 512),),
        True,
        _frozen(_gemma4_overrides(12)),
    ),
    E2ECase(
        "gemma-4-31B-it (12 layers, TP1)",
        GEMMA4_TEXT,
        (("blocks_per_chunk", 2),),
        False,
        _frozen(_gemma4_overrides(12)),
    ),
    # 4 of 43 layers: sliding, sliding, c4 (sparse + indexer), c128: every KV group kind.
    E2ECase(
        "DeepSeek-V4-Flash (4 layers, TP1)",
        DSV4,
        (("block_size", 512),),
        True,
        _frozen(_dsv4_overrides(4)),
        engine=(("kv_cache_dtype", "fp8"), ("block_size", 256)),
        needs_sm=(9, 0),
    ),
]


def metric_total(metrics: Iterable[Any], name: str) -> int | None:
    """Sum of a counter's values over its label sets (``None`` when the engine has no such metric)."""
    values = [m.value for m in metrics if getattr(m, "name", None) == name and hasattr(m, "value")]
    return int(sum(values)) if values else None


def offload_byte_counters(metrics: Iterable[Any]) -> dict[str, int]:
    """Every counter whose name mentions offloading and bytes (informative)."""
    out: dict[str, int] = {}
    for m in metrics:
        name = str(getattr(m, "name", ""))
        if "offload" in name and "bytes" in name and hasattr(m, "value"):
            out[name] = out.get(name, 0) + int(m.value)
    return out
