"""File economics per knob: files per million tokens, bytes per file, disk models.

For each fixture geometry (gemma-4-31B-it TP2 and DeepSeek-V4-Flash TP4) and each
knob (``blocks_per_chunk`` in :data:`conformance.bench.BLOCKS_PER_CHUNK`,
``block_size`` in :data:`BLOCK_SIZES` tokens), the knob is resolved as kvchunk's
connector resolves it (:func:`vllm_adapter.connector.resolve_for_vllm`) and vLLM's
``build_offloading_config`` gives the bytes.  :func:`conformance.bench.economics.file_economics`
(the computation ``python -m vllm_adapter config`` prints: :mod:`reference.economics`
serving :data:`~conformance.bench.economics.WORKLOAD`) turns that into files written
and read per million prompt tokens, recomputed tokens, and modelled disk time
(:mod:`vllm_adapter.disk_model`).  Measured files/s and GB/s at each file size come from the disk
benchmark (:mod:`conformance.bench.test_bench_disk`: vLLM's own
``batch_store_block`` / ``batch_load_block`` on its thread pool, real files);
``python -m conformance.bench`` joins them by ``blocks_per_chunk``.
Informational: no target.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance.bench import BLOCKS_PER_CHUNK, GEOMETRIES, record
from conformance.bench.economics import FS_MODELS, WORKLOAD, file_economics
from conformance.harness import cases
from conformance.testing.requires import require_vllm

require_vllm()

BLOCK_SIZES: tuple[int, ...] = cases.BENCH_BLOCK_SIZES
KNOBS: list[tuple[str, int]] = [("blocks_per_chunk", b) for b in BLOCKS_PER_CHUNK] + [
    ("block_size", t) for t in BLOCK_SIZES
]
PARAMS = [(g, k, v) for g in GEOMETRIES for k, v in KNOBS]


@pytest.mark.parametrize(
    "geometry,knob,value", PARAMS, ids=[f"{g}-{k}{v}" for g, k, v in PARAMS]
)
def test_file_economics(benchmark: Any, geometry: str, knob: str, value: int) -> None:
    result = benchmark.pedantic(file_economics, (geometry, knob, value), rounds=1, iterations=1)
    # Every offloaded group writes one file per chunk: at least one group, files of whole pages.
    assert result["groups"] and result["file_bytes"] % 4096 == 0
    assert all(g["used_bytes"] <= result["file_bytes"] for g in result["groups"])
    record(
        benchmark,
        kind="files",
        geometry=geometry,
        label=GEOMETRIES[geometry],
        workload={"name": WORKLOAD.name, "shape": WORKLOAD.describe()},
        models={m.name: {**vars(m), "crossover_bytes": m.crossover_bytes} for m in FS_MODELS},
        **result,
    )
