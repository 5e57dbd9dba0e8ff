"""File economics of one knob on a fixture geometry: the CLI's computation, for the bench.

vLLM's fs tier (``vllm/v1/kv_offload/tiering/fs``) writes **one file per chunk
per offloaded group**, each file one CPU-tier chunk row: ``round_up(
worker_kv_bytes_per_block x copies x blocks_per_chunk, 4096)`` bytes (``copies``:
TP ranks, or 1 with vLLM's replicated MLA layout).  How many files a workload
writes and reads, and how many tokens the chunk granularity costs, is what
``python -m vllm_adapter config`` prints: :func:`reference.economics.economics`
serving the workload (:data:`WORKLOAD`) through the
reference Planner under the installed release's rules
(:func:`vllm_adapter.planning.fixture_knob` resolves the knob), and the disk model
(:mod:`vllm_adapter.disk_model`: :class:`FsModel`, :data:`FS_MODELS`,
:func:`modelled`, one copy shared with the CLI).
"""

from __future__ import annotations

from typing import Any

from reference.workload import Workload, preset
from vllm_adapter.disk_model import FS_MODELS, FsModel, ModelledThroughput, modelled

__all__ = [
    "FS_MODELS",
    "WORKLOAD",
    "FsModel",
    "ModelledThroughput",
    "file_economics",
    "modelled",
]

WORKLOAD: Workload = preset("agentic")
"""The workload the file-economics table serves: the ``agentic`` preset, whose contexts
(3k-token system prompt, 20 turns, up to ~30k tokens) span every swept chunk size
(``blocks_per_chunk`` 1..32: up to 8192-token chunks); the CLI's default ``chat``
stores nothing at 4096-token chunks.  ``python -m vllm_adapter config --workload
agentic`` prints the same figures."""


def file_economics(geometry: str, knob: str, value: int) -> dict[str, Any]:
    """The knob's chunking, file size and the workload's files, hits and disk time."""
    from conformance.harness import vllm_harness_api as V
    from vllm_adapter.planning import fixture_knob, knob_traffic

    k = fixture_knob(geometry, knob, value)
    worker, file_bytes, copies = k.worker_kv_cache_config, k.file_bytes, k.row.copies
    blocks = k.row.blocks_per_chunk
    t = knob_traffic(k.chunking, file_bytes, WORKLOAD, k.policy, FS_MODELS)
    groups = [
        {
            "group": g.index,
            "tokens_per_chunk": g.tokens_per_chunk,
            "used_bytes": int(V.group_kv_bytes_per_block(worker.kv_cache_groups[g.index]))
            * copies
            * blocks,
            "files_written_per_million": g.files_written_per_million,
            "files_read_per_million": g.files_read_per_million,
        }
        for g in t.groups
    ]
    return {
        "knob": f"{knob}={value}",
        "blocks_per_chunk": blocks,
        "file_bytes": file_bytes,
        "groups": groups,
        "files_written_per_million": t.files_written_per_million,
        "files_read_per_million": t.files_read_per_million,
        "recomputed_per_million": t.recomputed_per_million,
        "modelled": {
            d.fs_model: {
                "gbps": modelled(m, file_bytes).bytes_per_s / 1e9,
                "bound": d.write_bound,
                "write_seconds_per_million": d.write_seconds_per_million,
                "read_seconds_per_million": d.read_seconds_per_million,
            }
            for m, d in zip(FS_MODELS, t.disk, strict=True)
        },
    }
