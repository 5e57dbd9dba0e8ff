"""A :class:`Sizing` as ``table`` (default), ``markdown`` or ``json``."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ByteSize

from vllm_adapter.cli.result import GroupRow, Sizing
from vllm_adapter.render import Align, render_table

__all__ = ["COLUMNS", "render", "render_markdown", "render_text"]

COLUMNS = (
    "group",
    "kind",
    "tokens/block",
    "blocks/chunk",
    "tokens/chunk",
    "window (chunks)",
    "group bytes/chunk",
    "chunk bytes/worker",
    "chunks/GiB",
    "files/1M tokens",
)
_RIGHT: Align = "right"
_ALIGN: tuple[Align, ...] = (_RIGHT, "left", *(_RIGHT,) * (len(COLUMNS) - 2))


def human_bytes(n: int | None) -> str:
    """``20971520`` -> ``20 MiB``, ``17038080`` -> ``16.25 MiB`` (``-`` for ``None``).

    The unit is pydantic's ``ByteSize.human_readable`` choice (binary units); the
    number keeps two decimals, trailing zeros dropped, where pydantic prints one.
    """
    if n is None:
        return "-"
    if n >= 2**80:  # a yobibyte and up: past pydantic's units (and, near 1e308, past a float)
        return f"{n} B"
    size = ByteSize(n)
    unit = size.human_readable(separator=" ").split()[-1]
    if unit == "B":
        return f"{n} B"
    return f"{size.to(unit):.2f}".rstrip("0").rstrip(".") + f" {unit}"


def _groups(n: int) -> str:
    return f"{n} KV-cache group" + ("" if n == 1 else "s")


def _kind(group: GroupRow) -> str:
    kind = group.kind
    if group.sliding_window is not None:
        kind += f" {group.sliding_window}"
    if group.attention_chunk_size is not None:
        kind += f" {group.attention_chunk_size}"
    if group.is_eagle:
        kind += " (EAGLE)"
    return kind


def _rows(sizing: Sizing) -> list[list[str]]:
    return [
        [
            str(g.index),
            _kind(g),
            str(g.tokens_per_block),
            str(g.blocks_per_chunk),
            str(g.tokens_per_chunk),
            "-" if g.window_in_chunks is None else str(g.window_in_chunks),
            f"{g.group_bytes_per_chunk} ({human_bytes(g.group_bytes_per_chunk)})",
            f"{g.chunk_bytes_per_worker} ({human_bytes(g.chunk_bytes_per_worker)})",
            "-" if g.chunks_per_gib is None else f"{g.chunks_per_gib:g}",
            f"{g.files_per_million_tokens:g}",
        ]
        for g in sizing.groups
    ]


def _knob_text(sizing: Sizing) -> str:
    knob = sizing.knob
    if knob.given:
        ((name, value),) = knob.given.items()
        text = f"{name}={value} -> blocks_per_chunk {knob.blocks_per_chunk} (every group)"
    else:
        text = f"none -> blocks_per_chunk {knob.blocks_per_chunk} (vLLM's default)"
    if knob.alignment_tokens is not None:
        text += f"; hits align to {knob.alignment_tokens} tokens"
    return text


def _cpu_text(sizing: Sizing) -> str:
    cpu = sizing.cpu_tier
    if cpu.replicated_layout:
        layout = f"one copy for all {cpu.world_size} ranks: vLLM's replicated MLA layout"
    else:
        layout = f"{cpu.copies} rank copies"
    text = (
        f"{cpu.worker_kv_bytes_per_block} B/block per worker; chunk "
        f"{cpu.chunk_bytes_per_worker} B ({human_bytes(cpu.chunk_bytes_per_worker)}) per worker; "
        f"slot {cpu.slot_bytes} B ({layout}; {cpu.page_alignment}-byte aligned)"
    )
    if cpu.cpu_bytes_to_use is not None:
        text += (
            f"; cpu_bytes_to_use {cpu.cpu_bytes_to_use} ({human_bytes(cpu.cpu_bytes_to_use)}) "
            f"-> {cpu.num_chunks} chunks"
        )
    return text


def _files_text(sizing: Sizing) -> str:
    files = sizing.files
    text = (
        f"fs tier: one file per chunk per group, {files.file_bytes} B "
        f"({human_bytes(files.file_bytes)}) each; {files.files_per_million_tokens:g} files "
        "per million tokens (all groups)"
    )
    if files.fs_tier is not None:
        text += f"; root_dir {files.fs_tier['root_dir']}"
    return text


def _summary_lines(sizing: Sizing) -> list[tuple[str, str]]:
    model, engine, vllm = sizing.model, sizing.engine, sizing.vllm
    lm = ", language model only" if model.language_model_only else ""
    retention = engine.prefix_cache_retention_interval
    return [
        ("model", f"{model.given} ({model.architecture}{lm})"),
        (
            "engine",
            engine.flags + (f" --prefix-cache-retention-interval {retention}" if retention else ""),
        ),
        (
            "vLLM",
            f"{vllm.version} KV planning on CPU: {_groups(vllm.num_kv_cache_groups)} "
            f"(offloaded {list(vllm.offloaded_group_ids)}), cache block {vllm.cache_block_size} "
            f"tokens, kv_cache_dtype {vllm.resolved_cache_dtype}, tokens_per_hash "
            f"{vllm.tokens_per_hash}",
        ),
        ("knob", _knob_text(sizing)),
        ("CPU tier", _cpu_text(sizing)),
        ("files", _files_text(sizing)),
        *(("note", note) for note in sizing.notes),
    ]


def _config_json(sizing: Sizing) -> str:
    return json.dumps(sizing.kv_transfer_config.to_json())


def render_text(sizing: Sizing) -> str:
    out = [f"{label:<9} {text}" for label, text in _summary_lines(sizing)]
    out += ["", render_table(COLUMNS, _rows(sizing), "text", align=_ALIGN)]
    out += ["", "--kv-transfer-config:", _config_json(sizing)]
    return "\n".join(out) + "\n"


def render_markdown(sizing: Sizing) -> str:
    model = sizing.model
    out = [f"### kvchunk config: {Path(model.dir).name}, TP {model.tensor_parallel_size}", ""]
    out += [f"* **{label}**: {text}" for label, text in _summary_lines(sizing)]
    out += ["", render_table(COLUMNS, _rows(sizing), "markdown")]
    out += ["", "`--kv-transfer-config`:", "", "```json", _config_json(sizing), "```"]
    return "\n".join(out) + "\n"


def render(sizing: Sizing, fmt: str) -> str:
    """``fmt``: ``table``, ``markdown`` or ``json``."""
    if fmt == "json":
        return json.dumps(sizing.to_json(), indent=2) + "\n"
    if fmt == "markdown":
        return render_markdown(sizing)
    return render_text(sizing)
