"""The chunk knob for a planned :class:`Request`, and the CPU tier's slots.

:func:`plan` returns a :class:`Sizing` (typed, frozen); :meth:`Sizing.to_json` is the
document ``--format json`` prints.  vLLM's planning: :mod:`.derivation`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from reference.knobs import BLOCK_SIZE, BLOCKS_PER_CHUNK, Chunking
from reference.plan import Policy
from reference.workload import Workload
from vllm_adapter.cli.args import CliError, Request
from vllm_adapter.cli.derivation import derive, with_retention
from vllm_adapter.cli.economics import (
    SweepInput,
    fs_model_info,
    per_group_map,
    plot_sweep,
    serve,
    sweep,
    traffic,
)
from vllm_adapter.cli.result import (
    CpuTier,
    EngineInfo,
    FileEconomics,
    GroupRow,
    KnobInfo,
    KvTransferConfig,
    ModelInfo,
    PolicyInfo,
    Sizing,
    Sweep,
    VllmInfo,
    WorkloadInfo,
)
from vllm_adapter.disk_model import FS_MODELS, FsModel
from vllm_adapter.names import CPU_SPEC, KVCHUNK_CONNECTOR, KVCHUNK_CONNECTOR_MODULE

__all__ = [
    "SWEEP_POINTS",
    "GiB",
    "PlannedEngine",
    "plan",
    "release_policy",
    "run_sweep",
    "sweep_inputs",
    "sweep_values",
]

GiB = 1 << 30
MAX_CHUNK_BYTES_SEARCH = 4096
"""How far past the first B reaching ``--chunk-bytes`` the search for a valid B goes."""
SWEEP_POINTS = 8
"""Knob values a ``--sweep`` shows."""
SWEEP_FIRST_BLOCK_SIZE = 256
SWEEP_LAST_EXPONENT = 24
"""The largest power of two a ``--block-size`` sweep tries (2**24 tokens)."""


# ---------------------------------------------------------------------------
# The knob: resolved as the connector will resolve it
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PlannedEngine:
    """The planned engine: resolve a knob, build vLLM's offloading config for it."""

    vllm_config: Any
    scheduler_kv_cache_config: Any
    cpu_bytes_for_checks: int
    """``cpu_bytes_to_use`` is required by CPUOffloadingSpec: a stand-in when not given."""

    def resolve(self, knob_extra: dict[str, int]) -> tuple[Chunking, dict[str, Any]]:
        from vllm_adapter.connector import resolve_for_vllm
        from vllm_adapter.geometry import with_extra_config

        extra = {**knob_extra, "spec_name": CPU_SPEC, "cpu_bytes_to_use": self.cpu_bytes_for_checks}
        return resolve_for_vllm(
            with_extra_config(self.vllm_config, extra), self.scheduler_kv_cache_config
        )

    def resolve_or_fail(
        self, knob_extra: dict[str, int], flag: str
    ) -> tuple[Chunking, dict[str, Any]]:
        try:
            return self.resolve(knob_extra)
        except ValueError as e:
            raise CliError(f"{flag}: {e}") from None

    def offloading_config(self, vllm_extra: dict[str, Any]) -> Any:
        from vllm_adapter import vllm_tools_api as V
        from vllm_adapter.geometry import with_extra_config

        return V.build_offloading_config(
            with_extra_config(self.vllm_config, vllm_extra), self.scheduler_kv_cache_config
        )


@dataclass(frozen=True)
class _Knob:
    chunking: Chunking
    vllm_extra: dict[str, Any]
    """The extra config vLLM runs (``blocks_per_chunk`` resolved)."""
    knob_extra: dict[str, int]
    """The knob printed in ``kv_connector_extra_config``."""
    given: dict[str, int]


def _chunk_bytes_knob(engine: PlannedEngine, chunk_bytes: int, notes: list[str]) -> _Knob:
    """The smallest ``blocks_per_chunk`` whose chunk bytes per worker reach ``chunk_bytes``."""
    _, base_extra = engine.resolve_or_fail({BLOCKS_PER_CHUNK: 1}, "--chunk-bytes")
    bytes_per_block = int(engine.offloading_config(base_extra).worker_kv_bytes_per_block)
    if bytes_per_block <= 0:
        raise CliError("vLLM reports no KV bytes per block for this model; cannot size chunks")
    first = max(1, -(-chunk_bytes // bytes_per_block))
    last_error: ValueError | None = None
    for blocks in range(first, first + MAX_CHUNK_BYTES_SEARCH):
        try:
            chunking, vllm_extra = engine.resolve({BLOCKS_PER_CHUNK: blocks})
            break
        except ValueError as e:
            last_error = e
    else:
        raise CliError(
            f"--chunk-bytes {chunk_bytes}: no blocks_per_chunk from {first} to "
            f"{first + MAX_CHUNK_BYTES_SEARCH - 1} is valid here ({last_error})"
        )
    notes.append(
        f"--chunk-bytes {chunk_bytes}: the smallest blocks_per_chunk whose chunk "
        f"bytes per worker ({bytes_per_block} x B) reach it is {blocks}"
        + (f" ({first} was not valid)" if blocks != first else "")
    )
    return _Knob(chunking, vllm_extra, {BLOCKS_PER_CHUNK: blocks}, {"chunk_bytes": chunk_bytes})


def _knob(request: Request, engine: PlannedEngine, notes: list[str]) -> _Knob:
    if request.chunk_bytes is not None:
        return _chunk_bytes_knob(engine, request.chunk_bytes, notes)
    flag = "--block-size" if BLOCK_SIZE in request.knob_extra else "--blocks-per-chunk"
    chunking, vllm_extra = engine.resolve_or_fail(dict(request.knob_extra), flag)
    if not request.knob_extra:
        notes.append("no chunk knob given: vLLM's default blocks_per_chunk 1")
    return _Knob(chunking, vllm_extra, dict(request.knob_extra), dict(request.knob_extra))


# ---------------------------------------------------------------------------
# CPU tier slots and per-group rows
# ---------------------------------------------------------------------------


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _cpu_tier(
    cpu_bytes: int | None, off: Any, world_size: int, blocks: int, spec_name: str
) -> CpuTier:
    """vLLM's CPU tier: one page-aligned slot per chunk key, for all rank copies."""
    from vllm_adapter import vllm_tools_api as V

    bytes_per_block = int(off.worker_kv_bytes_per_block)
    replicated = bool(off.replicated_layout)
    copies = 1 if replicated else world_size
    alignment = int(V.CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
    chunk_bytes = bytes_per_block * blocks
    slot_bytes = _round_up(chunk_bytes * copies, alignment)
    num_chunks = cpu_bytes // slot_bytes if cpu_bytes is not None else None
    if num_chunks == 0:
        raise CliError(
            f"--cpu-bytes {cpu_bytes} holds no chunk: one chunk slot takes {slot_bytes} "
            f"bytes ({copies} x {chunk_bytes}, page-aligned); give at least {slot_bytes}"
        )
    return CpuTier(
        spec_name=spec_name,
        worker_kv_bytes_per_block=bytes_per_block,
        world_size=world_size,
        replicated_layout=replicated,
        copies=copies,
        chunk_bytes_per_worker=chunk_bytes,
        page_alignment=alignment,
        slot_bytes=slot_bytes,
        cpu_bytes_to_use=cpu_bytes,
        num_chunks=num_chunks,
    )


def _kv_transfer_config(
    knob_extra: dict[str, int], cpu_bytes: int | None, request: Request
) -> KvTransferConfig:
    from vllm_adapter import vllm_tools_api as V

    extra: dict[str, Any] = {**knob_extra, "spec_name": request.spec_name}
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


def _group_rows(
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


# ---------------------------------------------------------------------------
# The workload: files, bytes, recomputed tokens, disk time (reference.economics)
# ---------------------------------------------------------------------------


def release_policy(version: str, vllm_config: Any, offload_prompt_only: bool) -> tuple[Policy, bool]:
    """The rules ``version`` runs (:mod:`vllm_adapter.releases`) with the engine's settings
    (retention as vLLM's offloading scheduler reads it, prompt-only storing, prefix
    caching); and whether the release is known."""
    from vllm_adapter.geometry import retention_interval_from
    from vllm_adapter.releases import rules_for

    rules = rules_for(version)
    policy = replace(
        rules.policy,
        retention_interval=retention_interval_from(vllm_config),
        offload_prompt_only=offload_prompt_only,
        prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
    )
    return policy, rules.known


def slot_bytes(bytes_per_block: int, copies: int, blocks: int, alignment: int) -> int:
    """vLLM's CPU-tier row (and fs-tier file): all copies of a chunk, page-aligned."""
    return _round_up(bytes_per_block * copies * blocks, alignment)


def sweep_values(knob_name: str) -> list[int]:
    """The values a sweep tries, in order: powers of two (``block_size`` from 256)."""
    if knob_name == BLOCK_SIZE:
        first = SWEEP_FIRST_BLOCK_SIZE.bit_length() - 1
        return [1 << k for k in range(first, SWEEP_LAST_EXPONENT + 1)]
    return [1 << k for k in range(SWEEP_POINTS)]


def sweep_inputs(
    engine: PlannedEngine, knob_name: str, cpu_tier: CpuTier
) -> tuple[list[SweepInput], list[str]]:
    """:data:`SWEEP_POINTS` valid knob values (resolved as the connector will), and the
    values skipped on the way, each with vLLM's or the reference's reason."""
    points: list[SweepInput] = []
    skipped: list[str] = []
    for value in sweep_values(knob_name):
        if len(points) == SWEEP_POINTS:
            break
        try:
            chunking, vllm_extra = engine.resolve({knob_name: value})
        except ValueError as e:
            skipped.append(f"{knob_name}={value}: {' '.join(str(e).split())}")
            continue
        blocks = int(vllm_extra[BLOCKS_PER_CHUNK])
        size = slot_bytes(
            cpu_tier.worker_kv_bytes_per_block, cpu_tier.copies, blocks, cpu_tier.page_alignment
        )
        points.append(SweepInput({knob_name: value}, chunking, blocks, size))
    return points, skipped


def run_sweep(
    vllm_config: Any,
    scheduler_kv_cache_config: Any,
    knob_name: str,
    workload: Workload,
    models: tuple[FsModel, ...] = FS_MODELS,
) -> Sweep:
    """``--sweep`` on an already planned engine (no model dir, no planning run): the
    knob values resolved as the connector will, each served through the workload.
    The benchmark (``conformance/bench/test_bench_sweep.py``) times this."""
    from vllm_adapter import vllm_tools_api as V

    engine = PlannedEngine(vllm_config, scheduler_kv_cache_config, GiB)
    _, base_extra = engine.resolve({BLOCKS_PER_CHUNK: 1})
    world_size = int(vllm_config.parallel_config.world_size)
    cpu = _cpu_tier(None, engine.offloading_config(base_extra), world_size, 1, CPU_SPEC)
    policy, _ = release_policy(V.VLLM_VERSION, vllm_config, True)
    points, skipped = sweep_inputs(engine, knob_name, cpu)
    return sweep(knob_name, points, skipped, workload, policy, models)


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


def _sweep(
    request: Request,
    engine: PlannedEngine,
    cpu_tier: CpuTier,
    workload: Workload,
    policy: Policy,
    models: tuple[FsModel, ...],
    title: str,
) -> Sweep | None:
    if not request.sweep:
        return None
    knob_name = BLOCK_SIZE if BLOCK_SIZE in request.knob_extra else BLOCKS_PER_CHUNK
    points, skipped = sweep_inputs(engine, knob_name, cpu_tier)
    if not points:
        raise CliError(
            f"--sweep: no {knob_name} value is valid here ({skipped[0] if skipped else ''})"
        )
    result = sweep(knob_name, points, skipped, workload, policy, models)
    if request.plot is not None:
        plot_sweep(result, request.plot, title)
        result = replace(result, plot=str(request.plot))
    return result


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
    knob = _knob(request, engine, notes)
    blocks = int(knob.vllm_extra[BLOCKS_PER_CHUNK])
    world_size = int(vllm_config.parallel_config.world_size)
    cpu_tier = _cpu_tier(request.cpu_bytes, engine.offloading_config(knob.vllm_extra),
                         world_size, blocks, request.spec_name)
    if request.cpu_bytes is None:
        notes.append(
            f'add "cpu_bytes_to_use" (--cpu-bytes) before serving: {request.spec_name} requires it'
        )
    cache = vllm_config.cache_config
    worker_cfg = derivation.worker_kv_cache_configs[0]
    groups = _group_rows(knob.chunking, sched_cfg, worker_cfg, cpu_tier.chunk_bytes_per_worker)

    workload = request.workload_or_default()
    policy, release_known = release_policy(V.VLLM_VERSION, vllm_config, not request.decode_storing)
    models = request.fs_models or FS_MODELS
    served = serve(knob.chunking, workload, policy)
    chosen = traffic(
        served, {gc.group.index: cpu_tier.slot_bytes for gc in knob.chunking.groups}, models
    )
    group_bytes = {row.index: row.group_bytes_per_block for row in groups}

    def group_file_bytes(index: int, blocks: int) -> int:
        return slot_bytes(group_bytes[index], cpu_tier.copies, blocks, cpu_tier.page_alignment)

    mapped = per_group_map(knob.chunking, group_file_bytes, workload, policy, models)
    title = (
        f"{request.model_dir.name} TP{request.tensor_parallel_size} ({request.engine_flags()}); "
        f"workload {workload.name}; vLLM {V.VLLM_VERSION} rules"
    )
    swept = _sweep(request, engine, cpu_tier, workload, policy, models, title)
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
        cpu_tier=cpu_tier,
        groups=groups,
        files=FileEconomics(
            file_bytes=cpu_tier.slot_bytes,
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
    )
