"""The workload's files, bytes, recomputed tokens and modelled disk time for a chunking.

Every figure comes from :func:`reference.economics.economics` (the reference
Planner serving the workload's requests under the release's rules); this module
adds file sizes, the disk model (:mod:`vllm_adapter.disk_model`), the per-group
map comparison and the sweep, as :mod:`vllm_adapter.results`' types.  No vLLM and no
CLI import: the callers (``python -m vllm_adapter config``, :mod:`vllm_adapter.planning`,
the benchmarks) resolve knobs and pass chunkings and file sizes in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from reference.economics import Economics, economics
from reference.knobs import Chunking, PerGroupBlocksPerChunk, resolve
from reference.layout_economics import LayoutEconomics, PackedLoads
from reference.packed_split import LoadSplit
from reference.plan import Policy
from reference.workload import Workload
from vllm_adapter.disk_model import FsModel, disk_time_of
from vllm_adapter.metadata_model import layout_ops
from vllm_adapter.results import (
    BandwidthKnee,
    DiskTimeRow,
    FsModelInfo,
    GroupTraffic,
    LayoutTraffic,
    PerGroupMap,
    Sweep,
    SweepPoint,
    Traffic,
)

__all__ = [
    "SweepInput",
    "forget_served",
    "fs_model_info",
    "layout_traffic",
    "packed_loads_of",
    "per_group_map",
    "serve",
    "sweep",
    "traffic",
]

_SERVED: dict[tuple[Chunking, Workload, Policy, object], Economics] = {}
"""Per process: one serving run per chunking, workload, rules and packed load split (the
fuzzer repeats knobs)."""


def serve(chunking: Chunking, workload: Workload, policy: Policy,
          packed_loads: PackedLoads | None = None) -> Economics:
    """:func:`reference.economics.economics` of the workload (file sizes applied later);
    ``packed_loads``: how kvchunk's packed tier splits its load jobs across its pool
    (:func:`packed_loads_of`; None: one task each), so that its file opens and reads are
    the tier's."""
    split = None if packed_loads is None else (
        packed_loads.split, tuple(sorted(packed_loads.section_bytes.items())))
    key = (chunking, workload, policy, split)
    found = _SERVED.get(key)
    if found is None:
        found = economics(chunking, workload, policy, packed_loads=packed_loads)
        _SERVED[key] = found
    return found


def packed_loads_of(split: LoadSplit | None, section_bytes: Mapping[int, int]) -> PackedLoads | None:
    """The packed tier's load split (``split``: the tier's,
    :func:`vllm_adapter.disk.tier.configured_load_split`; None: it does not split) with
    each group's section bytes (one CPU-tier row)."""
    return None if split is None else PackedLoads(split, dict(section_bytes))


def forget_served() -> None:
    """Drop :func:`serve`'s per-process results (a benchmark times fresh runs)."""
    _SERVED.clear()


def fs_model_info(model: FsModel) -> FsModelInfo:
    read = model.direction("read")
    return FsModelInfo(
        name=model.name,
        file_latency_s=model.file_latency_s,
        read_file_latency_s=read.file_latency_s,
        concurrency=model.concurrency,
        bandwidth_bps=model.bandwidth_bps,
        read_bandwidth_bps=read.bandwidth_bps,
        crossover_bytes=model.crossover_bytes,
        source=model.source,
        metadata_ops_per_s=model.metadata_ops_per_s,
    )


def _disk_row(
    model: FsModel,
    written: Sequence[tuple[float, int]],
    read: Sequence[tuple[float, int]],
    ops: tuple[float, float] = (0.0, 0.0),
) -> DiskTimeRow:
    """``written`` / ``read``: ``(files per million, bytes of each)`` pairs; ``ops``: the
    stores' and the loads' metadata operations per million."""
    w = disk_time_of(model, written, "write", ops[0])
    r = disk_time_of(model, read, "read", ops[1])
    return DiskTimeRow(
        fs_model=model.name,
        write_seconds_per_million=w.seconds,
        write_bound=w.bound,
        read_seconds_per_million=r.seconds,
        read_bound=r.bound,
    )


def layout_traffic(
    e: Economics,
    layout: LayoutEconomics,
    file_bytes: Mapping[int, int],
    models: Sequence[FsModel],
) -> LayoutTraffic:
    """One layout per million prompt tokens; disk time with each file (write) and each
    open (read, every load) priced at its own bytes."""
    written = layout.written_sizes(file_bytes)
    opened = layout.opened_sizes(file_bytes)
    store_ops, load_ops = layout_ops(e, layout)
    ops = (store_ops.total * e.per_million(1), load_ops.total * e.per_million(1))
    return LayoutTraffic(
        layout=layout.layout,
        files_written_per_million=e.per_million(layout.files_written),
        sections_written_per_million=e.per_million(layout.sections_written),
        file_opens_per_million=e.per_million(layout.file_opens),
        file_opens_once_per_million=e.per_million(layout.file_opens_once),
        sections_read_per_million=e.per_million(layout.sections_read),
        sections_read_once_per_million=e.per_million(layout.sections_read_once),
        reads_per_million=e.per_million(layout.reads),
        reads_once_per_million=e.per_million(layout.reads_once),
        bytes_written_per_million=e.per_million(layout.bytes_written(file_bytes)),
        bytes_read_per_million=e.per_million(layout.bytes_read(file_bytes)),
        bytes_read_once_per_million=e.per_million(layout.bytes_read(file_bytes, once=True)),
        disk=tuple(
            _disk_row(
                m,
                [(e.per_million(n), size) for size, n in written],
                [(e.per_million(n), size) for size, n in opened],
                ops,
            )
            for m in models
        ),
    )


def traffic(e: Economics, file_bytes: Mapping[int, int], models: Sequence[FsModel]) -> Traffic:
    """Per million prompt tokens: files and bytes per group, recomputed tokens, disk time,
    and both layouts side by side."""
    groups = tuple(
        GroupTraffic(
            index=g.index,
            tokens_per_chunk=g.tokens_per_chunk,
            file_bytes=file_bytes[g.index],
            files_written_per_million=e.per_million(g.files_written),
            files_read_per_million=e.per_million(g.files_read),
            files_read_once_per_million=e.per_million(g.files_read_once),
            # int products first: exact, and no float overflow for an absurd chunk size
            bytes_written_per_million=e.per_million(g.files_written * file_bytes[g.index]),
            bytes_read_per_million=e.per_million(g.files_read * file_bytes[g.index]),
        )
        for g in e.groups
    )
    layouts = tuple(layout_traffic(e, layout, file_bytes, models) for layout in e.layouts)
    return Traffic(
        groups=groups,
        files_written_per_million=e.per_million(e.files_written),
        files_read_per_million=e.per_million(e.files_read),
        files_read_once_per_million=e.per_million(e.files_read_once),
        bytes_written_per_million=sum(g.bytes_written_per_million for g in groups),
        bytes_read_per_million=sum(g.bytes_read_per_million for g in groups),
        ideal_hit_per_million=e.per_million(e.ideal_tokens),
        gpu_hit_per_million=e.per_million(e.gpu_hit_tokens),
        offload_hit_per_million=e.per_million(e.offload_hit_tokens),
        recomputed_tail_per_million=e.per_million(e.recomputed_tail_tokens),
        recomputed_lost_per_million=e.per_million(e.recomputed_lost_tokens),
        recomputed_per_million=e.per_million(e.recomputed_tokens),
        disk=layouts[0].disk,
        layouts=layouts,
        packed_per_request=layout_traffic(e, e.packed_per_request, file_bytes, models),
    )


def per_group_map(
    chunking: Chunking,
    group_file_bytes: Callable[[int, int], int],
    workload: Workload,
    policy: Policy,
    models: Sequence[FsModel],
    load_split: LoadSplit | None = None,
) -> PerGroupMap:
    """Every group at the full-attention groups' tokens per chunk (``B_g = T / tokens_per_block_g``).

    Resolved with :func:`reference.knobs.resolve` (vLLM's connector refuses per-group
    maps); ``group_file_bytes(index, B_g)``: that group's file size.  ``load_split``: the
    packed tier's (:func:`packed_loads_of`, each group's rows its sections), as the CLI's
    other figures count it.
    """
    tokens = chunking.alignment_tokens
    if tokens is None:
        return PerGroupMap(None, {}, False, "the full-attention groups disagree on tokens per "
                           "chunk: no single span to give every group", None)
    values: dict[int, int] = {}
    for gc in chunking.groups:
        tpb = gc.group.tokens_per_block
        if tokens % tpb:
            return PerGroupMap(
                tokens, {}, False,
                f"{gc.group.describe()}: {tokens} tokens are not a whole number of its "
                f"{tpb}-token blocks", None,
            )
        values[gc.group.index] = tokens // tpb
    try:
        mapped = resolve(
            chunking.geometry, PerGroupBlocksPerChunk.of(values), policy.retention_interval
        )
    except ValueError as e:
        return PerGroupMap(tokens, values, False, str(e), None)
    sizes = {gc.group.index: group_file_bytes(gc.group.index, gc.blocks_per_chunk)
             for gc in mapped.groups}
    return PerGroupMap(
        tokens, values, True, None,
        traffic(serve(mapped, workload, policy, packed_loads_of(load_split, sizes)), sizes, models),
    )


@dataclass(frozen=True)
class SweepInput:
    """One resolved knob value of a sweep: the chunking and its (uniform) file size."""

    knob: dict[str, int]
    chunking: Chunking
    blocks_per_chunk: int
    file_bytes: int


def sweep(
    knob_name: str,
    points: Sequence[SweepInput],
    skipped: Sequence[str],
    workload: Workload,
    policy: Policy,
    models: Sequence[FsModel],
    load_split: LoadSplit | None = None,
) -> Sweep:
    """The figures at every point, the hit cost of each step up, and where each fs model
    stops being IOPS-bound (writes and reads both bandwidth-bound); ``load_split``: the
    packed tier's (:func:`packed_loads_of`, each point's rows its sections)."""
    out: list[SweepPoint] = []
    previous: float | None = None
    for p in points:
        sizes = {gc.group.index: p.file_bytes for gc in p.chunking.groups}
        t = traffic(serve(p.chunking, workload, policy, packed_loads_of(load_split, sizes)),
                    sizes, models)
        out.append(
            SweepPoint(
                knob=dict(p.knob),
                blocks_per_chunk=p.blocks_per_chunk,
                alignment_tokens=p.chunking.alignment_tokens,
                file_bytes=p.file_bytes,
                traffic=t,
                recomputed_added_per_million=None
                if previous is None
                else t.recomputed_per_million - previous,
            )
        )
        previous = t.recomputed_per_million
    knees = []
    for m in models:
        first = next(
            (
                p
                for p in out
                if m.bound(p.file_bytes, "write") == "bandwidth"
                and m.bound(p.file_bytes, "read") == "bandwidth"
            ),
            None,
        )
        knees.append(
            BandwidthKnee(m.name, None if first is None else dict(first.knob),
                          None if first is None else first.file_bytes)
        )
    return Sweep(knob_name, tuple(out), tuple(skipped), tuple(knees), None)
