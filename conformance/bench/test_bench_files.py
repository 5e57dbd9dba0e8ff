"""File economics per knob: files per million tokens, bytes per file, a shared-FS model.

For each fixture geometry (vLLM 0.33.0's layout of gemma-4-31B-it TP2 and
DeepSeek-V4-Flash TP4) and each knob (``blocks_per_chunk`` in
:data:`conformance.bench.BLOCKS_PER_CHUNK`, ``block_size`` in :data:`BLOCK_SIZES`
tokens), the knob is resolved as kvchunk's connector resolves it
(:func:`vllm_adapter.connector.resolve_for_vllm`) and vLLM's
``build_offloading_config`` gives the bytes.  The model
(:mod:`conformance.bench.economics`) turns that into files per million tokens
of :data:`~conformance.bench.economics.WORKLOAD` and modelled shared-FS
throughput.  Measured files/s and GB/s at each file size come from the disk
benchmark (:mod:`conformance.bench.test_bench_disk`: vLLM's own
``batch_store_block`` / ``batch_load_block`` on its thread pool, real files);
``python -m conformance.bench`` joins them by ``blocks_per_chunk``.
Informational: no target.
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance import cases
from conformance.bench import BLOCKS_PER_CHUNK, GEOMETRIES, record
from conformance.bench.economics import FS_MODELS, WORKLOAD, files_per_million_tokens, modelled
from reference.mathutil import cdiv

pytest.importorskip("vllm")

from vllm_adapter import fixtures as fx  # noqa: E402
from vllm_adapter import vllm_api as V  # noqa: E402
from vllm_adapter.connector import resolve_for_vllm  # noqa: E402
from vllm_adapter.geometry import with_extra_config  # noqa: E402
from vllm_adapter.names import CPU_SPEC  # noqa: E402

BLOCK_SIZES: tuple[int, ...] = cases.BENCH_BLOCK_SIZES
KNOBS: list[tuple[str, int]] = [("blocks_per_chunk", b) for b in BLOCKS_PER_CHUNK] + [
    ("block_size", t) for t in BLOCK_SIZES
]
PARAMS = [(g, k, v) for g in GEOMETRIES for k, v in KNOBS]


def economics(geometry: str, knob: str, value: int) -> dict[str, Any]:
    """The knob's chunking and file sizes on ``geometry``, and the model's figures."""
    data = fx.load_fixture(geometry)
    sched = fx.rebuild_kv_cache_config(data, "scheduler")
    base = {"spec_name": CPU_SPEC, "cpu_bytes_to_use": 1 << 30}
    vc = with_extra_config(fx.make_vllm_config(data, {}), {knob: value, **base})
    chunking, vllm_extra = resolve_for_vllm(vc, sched)
    worker = fx.rebuild_kv_cache_config(data, "worker")
    config = V.build_offloading_config(with_extra_config(vc, {**vllm_extra, **base}), worker)
    blocks = int(vllm_extra["blocks_per_chunk"])
    copies = 1 if config.replicated_layout else int(config.parallel.world_size)
    align = int(V.CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
    file_bytes = cdiv(int(config.worker_kv_bytes_per_block) * copies * blocks, align) * align
    groups = [
        {
            "group": gc.group.index,
            "tokens_per_chunk": gc.tokens_per_chunk,
            "used_bytes": int(V.group_kv_bytes_per_block(worker.kv_cache_groups[gc.group.index]))
            * copies
            * blocks,
        }
        for gc in chunking.groups
    ]
    per_million = files_per_million_tokens(WORKLOAD, [g["tokens_per_chunk"] for g in groups])
    models = {m.name: modelled(m, file_bytes) for m in FS_MODELS}
    return {
        "knob": f"{knob}={value}",
        "blocks_per_chunk": blocks,
        "file_bytes": file_bytes,
        "groups": groups,
        "files_per_million_tokens": per_million,
        "modelled": {
            name: {
                "files_per_s": t.files_per_s,
                "gbps": t.bytes_per_s / 1e9,
                "bound": t.bound,
                "seconds_per_million_tokens": per_million / t.files_per_s,
            }
            for name, t in models.items()
        },
    }


@pytest.mark.parametrize(
    "geometry,knob,value", PARAMS, ids=[f"{g}-{k}{v}" for g, k, v in PARAMS]
)
def test_file_economics(benchmark: Any, geometry: str, knob: str, value: int) -> None:
    result = benchmark.pedantic(economics, (geometry, knob, value), rounds=1, iterations=1)
    # Every offloaded group writes one file per chunk: at least one group, files of whole pages.
    assert result["groups"] and result["file_bytes"] % 4096 == 0
    assert all(g["used_bytes"] <= result["file_bytes"] for g in result["groups"])
    record(
        benchmark,
        kind="files",
        geometry=geometry,
        label=GEOMETRIES[geometry],
        workload=vars(WORKLOAD),
        models={m.name: {**vars(m), "crossover_bytes": m.crossover_bytes} for m in FS_MODELS},
        **result,
    )
