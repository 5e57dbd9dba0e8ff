"""``plan``: the orchestration of ``python -m vllm_adapter config``.

vLLM's planning (:mod:`.derivation`), the knob (:mod:`.knob`), the CPU tier
(:mod:`.cpu_tier`), the workload's files (:mod:`vllm_adapter.economics`), ``--sweep``
(:mod:`.sweeps`), the disk tier's hit rate (:mod:`.disk`) and the engines one file system
serves (:mod:`vllm_adapter.metadata_model`), gathered into a
:class:`Sizing` (typed, frozen); :meth:`Sizing.to_json` is the document
``--format json`` prints.  What it computes on a planned engine, shared with the bench:
:mod:`vllm_adapter.planning`.
"""

from __future__ import annotations

from typing import Any

from reference.knobs import BLOCKS_PER_CHUNK, Chunking
from reference.workload import Workload
from vllm_adapter.cli.args import CliError, Request, spec_entries
from vllm_adapter.cli.cpu_tier import GiB, cpu_tier, group_rows, memory_note
from vllm_adapter.cli.derivation import derive, with_retention
from vllm_adapter.cli.disk import disk_tier
from vllm_adapter.cli.knob import knob as resolve_knob
from vllm_adapter.cli.result import (
    EngineInfo,
    FileEconomics,
    KnobInfo,
    KvTransferConfig,
    ModelInfo,
    PolicyInfo,
    Sizing,
    VllmInfo,
    WorkloadInfo,
)
from vllm_adapter.cli.sweeps import knob_sweep
from vllm_adapter.disk.budget import DISK_BYTES_KEY, min_disk_bytes
from vllm_adapter.disk.chunk_file import HEADER_SIZE
from vllm_adapter.disk_model import FS_MODELS
from vllm_adapter.economics import fs_model_info, packed_loads_of, per_group_map, serve, traffic
from vllm_adapter.metadata_model import metadata_economics
from vllm_adapter.names import (
    KVCHUNK_CONNECTOR,
    KVCHUNK_CONNECTOR_MODULE,
    KVCHUNK_TIERING_SPEC_NAME,
)
from vllm_adapter.planning import PlannedEngine, cpu_row, release_policy

__all__ = ["plan", "release_policy"]


def _kv_transfer_config(
    knob_extra: dict[str, int], cpu_bytes: int | None, request: Request
) -> KvTransferConfig:
    from vllm_adapter import vllm_tools_api as V

    extra: dict[str, Any] = {**knob_extra, **spec_entries(request.spec_name)}
    if request.decode_storing:
        extra["offload_prompt_only"] = False
    if cpu_bytes is not None:
        extra["cpu_bytes_to_use"] = cpu_bytes
    if request.fs_tier is not None:
        extra["secondary_tiers"] = [dict(request.fs_tier)]
    config = KvTransferConfig(
        kv_connector=KVCHUNK_CONNECTOR,
        kv_connector_module_path=KVCHUNK_CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    # What vLLM does with --kv-transfer-config: it must parse.
    V.KVTransferConfig(**config.to_json())
    return config


def _workload_info(request: Request, workload: Workload, served: Any) -> WorkloadInfo:
    return WorkloadInfo(
        given=request.workload_given,
        name=workload.name,
        description=workload.description,
        shape=workload.describe(),
        source=" ".join(workload.source.split()),
        requests=served.requests,
        prompt_tokens=served.prompt_tokens,
    )


# ---------------------------------------------------------------------------
# plan
# ---------------------------------------------------------------------------


def _model_info(request: Request) -> ModelInfo:
    return ModelInfo(
        dir=str(request.model_dir),
        given=request.model_arg,
        architecture=request.architecture,
        language_model_only=request.language_model_only,
        tensor_parallel_size=request.tensor_parallel_size,
    )


def _engine_info(request: Request, retention_interval: int | None) -> EngineInfo:
    return EngineInfo(
        flags=request.engine_flags(),
        block_size=request.block_size_gpu,
        kv_cache_dtype=request.kv_cache_dtype,
        hybrid_kv_cache_manager=not request.no_hybrid,
        prefix_match_unit=request.prefix_match_unit,
        mamba_cache_mode=request.mamba_cache_mode,
        max_model_len=request.max_model_len,
        prefix_cache_retention_interval=retention_interval,
    )


def _check_disk_bytes(disk_bytes: int, chunking: Chunking, row_bytes: int) -> None:
    """``--disk-bytes`` below the packed files one full chunk needs (the tier's own floor,
    :func:`vllm_adapter.disk.budget.min_disk_bytes`: a file of its full-attention sections
    and one of its window sections, one CPU-tier row each) is one line naming that size:
    such a disk refuses every store."""
    smallest = min_disk_bytes("packed", row_bytes, len(chunking.groups), HEADER_SIZE,
                              full_groups=len(chunking.full_groups))
    if disk_bytes < smallest:
        raise CliError(
            f"--disk-bytes {disk_bytes} is smaller than the packed files one full chunk needs "
            f"({smallest} bytes: one section of {row_bytes} bytes per offloaded KV-cache group, "
            "with the files' headers), so every store would be refused; give at least "
            f"{smallest}"
        )


def plan(request: Request, *, debug: bool = False) -> Sizing:
    """Derive, resolve, and size: what every format renders."""
    derivation = derive(request, debug)
    from vllm_adapter import vllm_tools_api as V
    from vllm_adapter.geometry import geometry_from_vllm

    vllm_config = with_retention(
        derivation.vllm_config, request.retention_interval, request.dense_retention
    )
    sched_cfg = derivation.scheduler_kv_cache_config
    try:
        geometry_from_vllm(sched_cfg, vllm_config)
    except ValueError as e:
        raise CliError(f"this KV-cache geometry cannot be offloaded: {e}") from None
    resolved = derivation.fixture["resolved"]
    notes: list[str] = []
    if request.block_size_gpu is None:
        notes.append(
            f"no --block-size-gpu: planned with vLLM {V.VLLM_VERSION}'s default cache block size "
            f"for this model ({resolved['cache_config_block_size_after_backend']} "
            "tokens); if the engine runs with --block-size N, pass --block-size-gpu N"
        )
    engine = PlannedEngine(
        vllm_config, sched_cfg, request.cpu_bytes if request.cpu_bytes is not None else GiB
    )
    knob = resolve_knob(request, engine, notes)
    blocks = int(knob.vllm_extra[BLOCKS_PER_CHUNK])
    world_size = int(vllm_config.parallel_config.world_size)
    row = cpu_row(engine.offloading_config(knob.vllm_extra), world_size, blocks)
    cpu = cpu_tier(request.cpu_bytes, row, world_size, request.spec_name)
    if request.disk_bytes is not None:
        _check_disk_bytes(request.disk_bytes, knob.chunking, cpu.slot_bytes)
    if request.cpu_bytes is None:
        notes.append(
            f'add "cpu_bytes_to_use" (--cpu-bytes) before serving: {request.spec_name} requires it'
        )
    else:
        note = memory_note(request.cpu_bytes)
        if note is not None:
            notes.append(note)
    if request.fs_tier is not None and request.spec_name == KVCHUNK_TIERING_SPEC_NAME \
            and DISK_BYTES_KEY not in request.fs_tier:
        notes.append(
            f'add "{DISK_BYTES_KEY}" to the fs tier (--disk-bytes) before serving: '
            f"{request.spec_name} requires it; choose it with --sweep-disk"
        )
    cache = vllm_config.cache_config
    worker_cfg = derivation.worker_kv_cache_configs[0]
    groups = group_rows(knob.chunking, sched_cfg, worker_cfg, cpu.chunk_bytes_per_worker)

    workload = request.workload_or_default()
    policy, release_known = release_policy(V.VLLM_VERSION, vllm_config, not request.decode_storing)
    tier = request.fs_tier or {}
    models = tuple(m.with_threads(tier.get("n_write_threads"), tier.get("n_read_threads"))
                   for m in request.fs_models or FS_MODELS)
    key_bytes = {gc.group.index: cpu.slot_bytes for gc in knob.chunking.groups}
    # The packed tier's file opens and reads are those of the split its pool will use.
    from vllm_adapter.disk.tier import configured_load_split

    load_split = configured_load_split(tier)
    served = serve(knob.chunking, workload, policy, packed_loads_of(load_split, key_bytes))
    chosen = traffic(served, key_bytes, models)
    group_bytes = {g.index: g.group_bytes_per_block for g in groups}

    def group_file_bytes(index: int, blocks: int) -> int:
        return row.row_bytes(group_bytes[index], blocks)

    mapped = per_group_map(knob.chunking, group_file_bytes, workload, policy, models, load_split)
    title = (
        f"{request.model_dir.name} TP{request.tensor_parallel_size} ({request.engine_flags()}); "
        f"workload {workload.name}; vLLM {V.VLLM_VERSION} rules"
    )
    swept = knob_sweep(request, engine, row, workload, policy, models, title, load_split)
    disk = disk_tier(
        knob.chunking, workload, policy, key_bytes, request.disk_bytes, request.sweep_disk,
        request.plot if request.sweep_disk else None, title,
        cpu_bytes=request.cpu_bytes, cpu_chunks=cpu.num_chunks, load_split=load_split,
    )
    return Sizing(
        kv_transfer_config=_kv_transfer_config(knob.knob_extra, request.cpu_bytes, request),
        model=_model_info(request),
        engine=_engine_info(request, cache.prefix_cache_retention_interval),
        vllm=VllmInfo(
            version=V.VLLM_VERSION,
            cache_block_size=int(cache.block_size),
            resolved_cache_dtype=str(cache.cache_dtype),
            scheduler_block_size=resolved["scheduler_block_size"],
            tokens_per_hash=int(knob.chunking.tokens_per_hash),
            num_kv_cache_groups=len(sched_cfg.kv_cache_groups),
            offloaded_group_ids=tuple(gc.group.index for gc in knob.chunking.groups),
        ),
        knob=KnobInfo(
            given=knob.given,
            blocks_per_chunk=blocks,
            alignment_tokens=knob.chunking.alignment_tokens,
        ),
        cpu_tier=cpu,
        groups=groups,
        files=FileEconomics(
            file_bytes=cpu.slot_bytes,
            fs_tier=request.fs_tier,
        ),
        notes=tuple(notes),
        workload=_workload_info(request, workload, served),
        policy=PolicyInfo(
            vllm_release=V.VLLM_VERSION,
            release_known=release_known,
            prefix_cache_retention_interval=policy.retention_interval,
            offload_prompt_only=policy.offload_prompt_only,
            offload_junctions=policy.offload_junctions,
        ),
        fs_models=tuple(fs_model_info(m) for m in models),
        traffic=chosen,
        per_group_map=mapped,
        sweep=swept,
        disk=disk,
        metadata=metadata_economics(served, request.fs_metadata_ops,
                                    request.prefill_tokens_per_s),
    )
