"""vLLM's CPU tier for the resolved knob: its row (one slot per chunk key, all rank
copies, page-aligned: :func:`reference.geometry.cpu_row_bytes` through
:func:`vllm_adapter.planning.cpu_row`) and the per-group rows of the table."""

from __future__ import annotations

import os
from typing import Any

from reference.knobs import Chunking
from vllm_adapter.cli.args import CliError
from vllm_adapter.cli.result import CpuTier, GroupRow
from vllm_adapter.planning import CpuRow

__all__ = ["GiB", "cpu_tier", "group_rows", "machine_memory", "memory_note"]

GiB = 1 << 30


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def memory_note(cpu_bytes: int, memory: int | None = None) -> str | None:
    """One line when ``cpu_bytes`` is more than this machine's memory (``memory``: that
    memory, else :func:`machine_memory`): accepted, the figures are a model."""
    memory = machine_memory() if memory is None else memory
    if memory is None or cpu_bytes <= memory:
        return None
    return (
        f"--cpu-bytes {cpu_bytes} ({cpu_bytes / GiB:.1f} GiB) is more than this machine's "
        f"memory ({memory / GiB:.1f} GiB): accepted for modelling; the engine's host must "
        "hold it as pinned memory"
    )


def cpu_tier(cpu_bytes: int | None, row: CpuRow, world_size: int, spec_name: str) -> CpuTier:
    """``cpu_bytes_to_use // row`` chunks; a budget below one row is one line."""
    slot_bytes = row.row_bytes()
    num_chunks = row.chunks_in(cpu_bytes) if cpu_bytes is not None else None
    if num_chunks == 0:
        raise CliError(
            f"--cpu-bytes {cpu_bytes} holds no chunk: one chunk slot takes {slot_bytes} "
            f"bytes ({row.copies} x {row.chunk_bytes_per_worker}, page-aligned); give at "
            f"least {slot_bytes}"
        )
    return CpuTier(
        spec_name=spec_name,
        worker_kv_bytes_per_block=row.worker_kv_bytes_per_block,
        world_size=world_size,
        replicated_layout=row.replicated_layout,
        copies=row.copies,
        chunk_bytes_per_worker=row.chunk_bytes_per_worker,
        page_alignment=row.page_alignment,
        slot_bytes=slot_bytes,
        cpu_bytes_to_use=cpu_bytes,
        num_chunks=num_chunks,
    )


def group_rows(
    chunking: Chunking, sched_cfg: Any, worker_cfg: Any, chunk_bytes: int
) -> tuple[GroupRow, ...]:
    from vllm_adapter import vllm_tools_api as V

    rows = []
    for gc in chunking.groups:
        g = gc.group
        group_bytes_per_block = int(V.group_kv_bytes_per_block(worker_cfg.kv_cache_groups[g.index]))
        rows.append(
            GroupRow(
                index=g.index,
                kind=g.kind.value,
                vllm_spec=type(sched_cfg.kv_cache_groups[g.index].kv_cache_spec).__name__,
                sliding_window=g.sliding_window,
                attention_chunk_size=g.attention_chunk_size,
                is_eagle=g.is_eagle,
                tokens_per_block=g.tokens_per_block,
                blocks_per_chunk=gc.blocks_per_chunk,
                tokens_per_chunk=gc.tokens_per_chunk,
                window_in_chunks=gc.window_in_chunks,
                group_bytes_per_block=group_bytes_per_block,
                group_bytes_per_chunk=group_bytes_per_block * gc.blocks_per_chunk,
                chunk_bytes_per_worker=chunk_bytes,
                chunks_per_gib=round(GiB / chunk_bytes, 2) if chunk_bytes else None,
            )
        )
    return tuple(rows)
