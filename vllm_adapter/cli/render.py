"""A :class:`Sizing` as ``table`` (default), ``markdown`` or ``json``."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ByteSize

from vllm_adapter.cli.result import (
    DiskRun,
    DiskTier,
    GroupRow,
    LayoutTraffic,
    MetadataEconomics,
    PerGroupMap,
    Sizing,
    Sweep,
    SweepPoint,
    TieredDiskRun,
    Traffic,
)
from vllm_adapter.disk.tier_budget import POLL_SECONDS
from vllm_adapter.metadata_model import FOLLOWER_POLLS_PER_S, OP_KINDS
from vllm_adapter.render import Align, TableFormat, render_table

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
        f"fs tier, per_chunk layout: one file per chunk per group, {files.file_bytes} B "
        f"({human_bytes(files.file_bytes)}) each; packed layout: per store job one file of its "
        "full-attention chunks and one of its window chunks, each chunk a page-aligned section "
        "of that size (how many of each a workload writes and reads: per 1M below)"
    )
    if files.fs_tier is not None:
        text += f"; root_dir {files.fs_tier['root_dir']}"
    return text


def _summary_lines(sizing: Sizing) -> list[tuple[str, str]]:
    model, engine, vllm = sizing.model, sizing.engine, sizing.vllm
    lm = ", language model only" if model.language_model_only else ""
    return [
        ("model", f"{model.given} ({model.architecture}{lm})"),
        ("engine", engine.flags),
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
        *_economics_lines(sizing),
        *(("note", note) for note in sizing.notes),
    ]


def _n(x: float) -> str:
    """A per-million figure: whole numbers with thousands separators (``12,345``)."""
    return f"{x:,.0f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def _seconds(x: float) -> str:
    return f"{x:,.1f}" if x >= 10 else f"{x:,.2f}"


def _knob_of(knob: dict[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in knob.items())


def _policy_text(sizing: Sizing) -> str:
    p = sizing.policy
    retention = p.prefix_cache_retention_interval
    kept = (
        "dense retention" if retention is None
        else "retention 0 (sparse)" if retention == 0
        else f"retention every {retention} tokens"
    )
    known = "" if p.release_known else " (no row for this release: the newest rules assumed)"
    stored = "prompt tokens stored" if p.offload_prompt_only else "prompt and decoded tokens stored"
    return f"vLLM {p.vllm_release} rules{known}; {kept}; {stored}"


READ_MEANINGS = (
    "every load: each load job reads its chunks from disk (a CPU tier that never holds them: "
    "the disk's worst case); read once: each chunk read from disk once per pass (a CPU tier "
    "that keeps what it promoted: what the tiered economics check verifies)"
)


def _traffic_text(t: Traffic) -> str:
    return (
        f"written {_n(t.files_written_per_million)} files ({_gb(t.bytes_written_per_million)}), "
        f"read {_n(t.files_read_per_million)} files every load ({_gb(t.bytes_read_per_million)}),"
        f" {_n(t.files_read_once_per_million)} read once; "
        f"recomputed {_n(t.recomputed_per_million)} tokens (partial tail "
        f"{_n(t.recomputed_tail_per_million)}, lost chunks {_n(t.recomputed_lost_per_million)}) "
        f"of {_n(t.ideal_hit_per_million)} an ideal cache serves"
    )


def _map_text(sizing: Sizing) -> str:
    m: PerGroupMap = sizing.per_group_map
    if not m.valid or m.traffic is None:
        return f"not valid here: {m.reason}"
    one = sizing.traffic
    return (
        f"every group {m.tokens_per_chunk} tokens/chunk, blocks_per_chunk "
        f"{json.dumps({str(k): v for k, v in m.blocks_per_chunk.items()})}, each group's own "
        f"bytes per file: {_traffic_text(m.traffic)}; vs one B: files written "
        f"{_n(one.files_written_per_million)} -> {_n(m.traffic.files_written_per_million)}, "
        f"bytes written {_gb(one.bytes_written_per_million)} -> "
        f"{_gb(m.traffic.bytes_written_per_million)}, recomputed "
        f"{_n(one.recomputed_per_million)} -> {_n(m.traffic.recomputed_per_million)} "
        "(reference only: vLLM executes one blocks_per_chunk)"
    )


ASSUMPTIONS = (
    "an unbounded disk index (nothing evicted; --disk-bytes serves the workload over a budget), "
    "one request at a time (each request's prefill and stores finish before the next), "
)
"""What the per-million figures assume (:mod:`reference.economics`), printed with them."""
GPU_CACHE_MEANS = {
    "cold": "GPU cache cold: every reused token comes from offload",
    "hot_shared_prefix": "GPU cache hot_shared_prefix: the system prompt, rounded down to the "
                         "lcm of the groups' tokens per block, stays on the GPU (modelled; "
                         "vLLM's LRU block pool does not keep it, see the README)",
}
"""One line per :class:`reference.workload.GpuCache` mode, for the output."""


def _economics_lines(sizing: Sizing) -> list[tuple[str, str]]:
    w = sizing.workload
    return [
        ("workload", w.shape.replace("GPU cache cold", "GPU cache cold (checked)").replace(
            "GPU cache hot_shared_prefix", "GPU cache hot_shared_prefix (modelled, not checked)")
         + f"; {w.requests} requests, {w.prompt_tokens} prompt tokens"),
        ("rules", _policy_text(sizing)),
        ("source", w.source),
        ("assumes", ASSUMPTIONS + GPU_CACHE_MEANS[
            "hot_shared_prefix" if "GPU cache hot_shared_prefix" in w.shape else "cold"]),
        ("per 1M", "prompt tokens: " + _traffic_text(sizing.traffic)),
        ("per-group", _map_text(sizing)),
    ]


TRAFFIC_COLUMNS = (
    "group", "tokens/chunk", "file bytes", "files written/1M", "files read/1M (every load)",
    "files read/1M (once)", "bytes written/1M", "bytes read/1M (every load)",
)


def _traffic_rows(t: Traffic) -> list[list[str]]:
    return [
        [
            str(g.index),
            str(g.tokens_per_chunk),
            f"{g.file_bytes} ({human_bytes(g.file_bytes)})",
            _n(g.files_written_per_million),
            _n(g.files_read_per_million),
            _n(g.files_read_once_per_million),
            _gb(g.bytes_written_per_million),
            _gb(g.bytes_read_per_million),
        ]
        for g in t.groups
    ]


LAYOUT_COLUMNS = (
    "layout", "files written/1M", "sections written/1M", "file opens/1M (every load)",
    "file opens/1M (once)", "reads/1M (every load)", "reads/1M (once)", "bytes written/1M",
    "bytes read/1M (every load)", "bytes read/1M (once)",
)
LAYOUT_UNITS = {
    "per_chunk": "one file per chunk per group (vLLM's fs tier)",
    "packed": "per store job one file of its full-attention chunks and one of its window "
              "chunks, as sections",
    "packed_per_request": "one file per request, all its stored chunks as sections",
}


def _layout_rows(layouts: tuple[LayoutTraffic, ...]) -> list[list[str]]:
    return [
        [
            x.layout, _n(x.files_written_per_million), _n(x.sections_written_per_million),
            _n(x.file_opens_per_million), _n(x.file_opens_once_per_million),
            _n(x.reads_per_million), _n(x.reads_once_per_million),
            _gb(x.bytes_written_per_million), _gb(x.bytes_read_per_million),
            _gb(x.bytes_read_once_per_million),
        ]
        for x in layouts
    ]


DISK_COLUMNS = (
    "layout", "fs model", "latency/file", "threads", "GB/s (w/r)", "write s/1M",
    "read s/1M (every load)",
)


def _disk_rows(sizing: Sizing, t: Traffic) -> list[list[str]]:
    models = {m.name: m for m in sizing.fs_models}
    rows = []
    for layout in t.layouts:
        for d in layout.disk:
            m = models[d.fs_model]
            lat = f"{m.file_latency_s * 1e3:g} ms"
            if m.read_file_latency_s != m.file_latency_s:
                lat = f"{m.file_latency_s * 1e3:.1f}/{m.read_file_latency_s * 1e3:.1f} ms"
            rows.append([
                layout.layout, d.fs_model, lat, str(m.concurrency),
                f"{m.bandwidth_bps / 1e9:.2f}/{m.read_bandwidth_bps / 1e9:.2f}",
                f"{_seconds(d.write_seconds_per_million)} ({d.write_bound})",
                f"{_seconds(d.read_seconds_per_million)} ({d.read_bound})",
            ])
    return rows


def _sweep_columns(sizing: Sizing, sweep: Sweep) -> tuple[str, ...]:
    return (
        "knob", "B", "layout", "section size", "files written/1M", "file opens/1M (every load)",
        "GB written/1M", "recomputed/1M", "+recomputed",
        *(f"{m.name}: write+read s/1M" for m in sizing.fs_models),
    )


def _sweep_row(p: SweepPoint, layout: LayoutTraffic) -> list[str]:
    t = p.traffic
    added = p.recomputed_added_per_million
    return [
        _knob_of(p.knob), str(p.blocks_per_chunk), layout.layout, human_bytes(p.file_bytes),
        _n(layout.files_written_per_million), _n(layout.file_opens_per_million),
        f"{layout.bytes_written_per_million / 1e9:,.2f}", _n(t.recomputed_per_million),
        "-" if added is None else f"{added:+,.0f}",
        *(
            f"{_seconds(d.write_seconds_per_million + d.read_seconds_per_million)} "
            f"({_bounds(d.write_bound, d.read_bound)})"
            for d in layout.disk
        ),
    ]


def _sweep_rows(sweep: Sweep) -> list[list[str]]:
    """One row per layout per knob value."""
    return [_sweep_row(p, layout) for p in sweep.points for layout in p.traffic.layouts]


def _bounds(write: str, read: str) -> str:
    return write if write == read else f"{write}/{read}"


def _knee_lines(sweep: Sweep) -> list[str]:
    out = []
    for k in sweep.knees:
        if k.knob is None:
            out.append(f"{k.fs_model}: IOPS-bound at every swept value")
        else:
            out.append(
                f"{k.fs_model}: no longer IOPS-bound from {_knob_of(k.knob)} "
                f"({human_bytes(k.file_bytes)} files)"
            )
    return out


def _sweep_text(sizing: Sizing, sweep: Sweep, fmt: TableFormat) -> list[str]:
    out = [
        f"sweep of {sweep.knob_name} (workload {sizing.workload.name}; per million prompt "
        "tokens; one line per layout; +recomputed: the hit cost of each step up):",
        "",
        render_table(_sweep_columns(sizing, sweep), _sweep_rows(sweep), fmt),
        "",
        *(("* " if fmt == "markdown" else "") + line for line in _knee_lines(sweep)),
    ]
    if sweep.skipped:
        out.append(("* " if fmt == "markdown" else "") + f"skipped: {'; '.join(sweep.skipped)}")
    if sweep.plot:
        out.append(("* " if fmt == "markdown" else "") + f"plot: {sweep.plot}")
    return out


def _alternative_unit(t: Traffic) -> str:
    alt = t.packed_per_request
    packed = next(x for x in t.layouts if x.layout == "packed")
    return (
        f"packed_per_request ({LAYOUT_UNITS[alt.layout]}; reference only, the tier packs per "
        f"store job, windows apart): {_n(alt.files_written_per_million)} files written, "
        f"{_n(alt.file_opens_once_per_million)} file opens read once per 1M, vs packed "
        f"{_n(packed.files_written_per_million)} and {_n(packed.file_opens_once_per_million)}"
    )


def _economics_tables(sizing: Sizing, fmt: TableFormat) -> list[str]:
    t = sizing.traffic
    bullet = "* " if fmt == "markdown" else ""
    out = [
        "",
        f"per million prompt tokens of workload {sizing.workload.name} (reference.economics), "
        "per_chunk layout by group:",
        "",
        render_table(TRAFFIC_COLUMNS, _traffic_rows(t), fmt, align=(_RIGHT,) * len(TRAFFIC_COLUMNS)),
        "",
        f"{bullet}{READ_MEANINGS}",
        "",
        "both layouts per million prompt tokens (a read: one run of adjacent sections of one "
        "file read by one load job):",
        "",
        render_table(LAYOUT_COLUMNS, _layout_rows(t.layouts), fmt,
                     align=("left", *(_RIGHT,) * (len(LAYOUT_COLUMNS) - 1))),
        "",
        *(f"{bullet}{x.layout}: {LAYOUT_UNITS[x.layout]}" for x in t.layouts),
        f"{bullet}{_alternative_unit(t)}",
        "",
        "modelled disk time per million prompt tokens (per file: max(latency / threads, "
        "file bytes / bandwidth); each file written priced with its own bytes, each file "
        "open of every load with the bytes it reads; where the file system's metadata "
        "service is a shared rate, at least the layout's metadata operations (below) over "
        "it: bound 'metadata'):",
        "",
        render_table(DISK_COLUMNS, _disk_rows(sizing, t), fmt),
        "",
        *(f"{bullet}{m.name}: {m.source}" for m in sizing.fs_models),
    ]
    if sizing.metadata is not None:
        out += ["", *_metadata_text(sizing.metadata, fmt)]
    if sizing.sweep is not None:
        out += ["", *_sweep_text(sizing, sizing.sweep, fmt)]
    if sizing.disk is not None:
        out += ["", *_disk_text(sizing.disk, fmt)]
    return out


METADATA_COLUMNS = (
    "layout", "created/1M", "opened/1M", "renamed/1M", "unlinked/1M", "makedirs/1M",
    "lookups/1M", "root lock/1M", "ledger appends/1M", "ops/1M", "ops/s (one engine)",
    "ops/s each (at the answer)", "engines",
)
METADATA_MEANINGS = (
    "per_chunk: vLLM's fs tier (fs_io_C): a file stored is access(dest), create_directories "
    "(a stat of its existing leaf directory; stat, stat, mkdir while its <hhh>/<hh>_g<group> "
    "directory is new), a create and a rename: 4; a file read (every load) is the access that "
    "found it and its open: 2; one access per request and offloaded group (the miss after "
    "the hit); it never unlinks",
    "packed: kvchunk's tier: a file stored is two ledger transactions of 9 (open the lock "
    "file, flock, symlink the held lock, open the journal to replay other engines' records, "
    "open it to write, write, readlink and unlink the held lock, release), the write's "
    "ledger poll (a stat), a create, a rename and an unlink (a full budget evicts about a "
    "file per file written; no directory call: the create makes its directory only when it "
    "finds it missing): 22; a file opened by a load: 1 (lookups answer from memory); a load "
    f"job: 2 (its use records appended); per engine, {FOLLOWER_POLLS_PER_S} stats/s (the "
    f"ledger follower's {POLL_SECONDS * 1000:g} ms poll); per peer, a replay (7) per poll "
    f"that finds the journal grown (at most {FOLLOWER_POLLS_PER_S}/s); a peer's file is "
    "indexed from the journal's keys, not opened",
    "every call counted as one operation at the server (no client metadata cache; a stat "
    "priced as a create, though 10-100x cheaper on the file systems of disk-anchors.md "
    "section 4); closes, data reads and writes, a tier's start and journal compaction are not "
    "counted",
    "engines: the most engines whose operations together (each engine's own, its peers' "
    "included) stay within the file system's rate; per_chunk: rate / ops/s",
)


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _metadata_text(m: MetadataEconomics, fmt: TableFormat) -> list[str]:
    bullet = "* " if fmt == "markdown" else ""
    tokens = m.prefill_tokens_per_s
    engine = ("give --prefill-tokens-per-s T (one engine's prompt tokens per second) for the "
              "rates and the engines" if tokens is None
              else f"one engine takes in {tokens:,} prompt tokens/s")
    rows = [
        [x.layout, *(_n(getattr(x, f"{k}_per_million")) for k in OP_KINDS),
         _n(x.ops_per_million), _rate(x.ops_per_second),
         _rate(x.ops_per_second_per_engine_at_engines),
         "-" if x.engines is None else f"{x.engines:,}"]
        for x in m.layouts
    ]
    return [
        "metadata operations per million prompt tokens (every load), and the engines one file "
        f"system serves (its metadata service: {m.fs_metadata_ops:,} operations/s shared by "
        f"every engine; {engine}):",
        "",
        render_table(METADATA_COLUMNS, rows, fmt,
                     align=("left", *(_RIGHT,) * (len(METADATA_COLUMNS) - 1))),
        "",
        *(f"{bullet}{line}" for line in METADATA_MEANINGS),
        f"{bullet}{m.fs_metadata_ops:,} operations/s: {m.fs_metadata_ops_source}",
        f"{bullet}{m.cached_fraction:.1%} of this workload's prompt tokens are not computed "
        "(GPU and offload hits): an engine that computes P prompt tokens/s takes in about "
        f"P / {1 - m.cached_fraction:.3f}",
    ]


DISK_COLUMNS_AT = (
    "rule", "disk budget", "hit rate", "hits from disk/1M", "files read/1M",
    "files written/1M", "files evicted/1M", "recomputed for space/1M", "stranded bytes",
    "stores refused", "keys dropped", "bytes on disk",
)
RULE_MEANINGS = {
    "reachable": "the rule: leaves of the prefix structure first, least recently used among "
    "them, window chunks with the boundary they serve (strands nothing)",
    "lru": "plain per-file LRU: the least recently used file, whatever depends on it "
    "(the baseline; what it strands is counted)",
}


def _disk_cells(r: DiskRun) -> list[str]:
    return [
        f"{r.hit_rate:.1%}", _n(r.hits_per_million), _n(r.files_read_per_million),
        _n(r.files_written_per_million), _n(r.files_evicted_per_million),
        _n(r.recomputed_for_space_per_million),
        f"{r.stranded_bytes} ({human_bytes(r.stranded_bytes)})",
        str(r.stores_refused), str(r.keys_dropped),
        f"{r.bytes_on_disk} ({human_bytes(r.bytes_on_disk)})",
    ]


DISK_CURVE_COLUMNS = (
    "disk budget", "hit rate (rule)", "hit rate (LRU)", "files evicted/1M (rule)",
    "files evicted/1M (LRU)", "recomputed for space/1M (rule)",
    "recomputed for space/1M (LRU)", "LRU stranded bytes", "rule stranded bytes",
    "stores refused (rule)", "stores refused (LRU)", "keys dropped (rule)",
    "bytes on disk (rule)", "bytes on disk (LRU)",
)


CPU_CURVE_COLUMNS = (
    "disk budget", "hit rate (rule)", "hit rate (LRU)", "chunks from disk/1M (rule)",
    "chunks from disk/1M (LRU)", "files evicted/1M (rule)", "files evicted/1M (LRU)",
    "recomputed for space/1M (rule)", "recomputed for space/1M (LRU)", "LRU stranded bytes",
    "rule stranded bytes", "stores refused (rule)", "stores refused (LRU)",
    "keys dropped (rule)", "bytes on disk (rule)", "bytes on disk (LRU)",
    "lookups abandoned (rule)", "lookups abandoned (LRU)",
    "hits evicted by promotions (rule)", "hits evicted by promotions (LRU)",
)


def _cpu_curve_text(disk: DiskTier, fmt: TableFormat) -> list[str]:
    """The sweep's second series: vLLM's CPU tier in front of the disk."""
    bullet = "* " if fmt == "markdown" else ""
    if disk.cpu_curve is None:
        return ["", f"{bullet}with vLLM's CPU tier in front of the disk: give --cpu-bytes (the "
                "CPU tier's size) for that series"]
    assert disk.cpu_bytes is not None and disk.cpu_chunks is not None
    rows = []
    for p in disk.cpu_curve:
        r, lru = p.rule, p.lru
        assert isinstance(r, TieredDiskRun) and isinstance(lru, TieredDiskRun)
        rows.append([
            f"{p.budget_bytes} ({human_bytes(p.budget_bytes)})",
            f"{r.hit_rate:.1%}", f"{lru.hit_rate:.1%}",
            _n(r.keys_promoted_per_million), _n(lru.keys_promoted_per_million),
            _n(r.files_evicted_per_million), _n(lru.files_evicted_per_million),
            _n(r.recomputed_for_space_per_million), _n(lru.recomputed_for_space_per_million),
            f"{lru.stranded_bytes} ({human_bytes(lru.stranded_bytes)})",
            f"{r.stranded_bytes} ({human_bytes(r.stranded_bytes)})",
            str(r.stores_refused), str(lru.stores_refused), str(r.keys_dropped),
            f"{r.bytes_on_disk} ({human_bytes(r.bytes_on_disk)})",
            f"{lru.bytes_on_disk} ({human_bytes(lru.bytes_on_disk)})",
            str(r.lookups_abandoned), str(lru.lookups_abandoned),
            str(r.hits_evicted_by_promotions), str(lru.hits_evicted_by_promotions),
        ])
    return [
        "",
        f"with vLLM's CPU tier in front of the disk, as operators run it (--cpu-bytes "
        f"{disk.cpu_bytes} ({human_bytes(disk.cpu_bytes)}): {disk.cpu_chunks} chunk slots, "
        "one per key; the same disk sizes):",
        "",
        f"{bullet}the CPU tier: vLLM's LRU as the release ranks it (a request's keys tail "
        "first while it runs, head last when it ends); a lookup that misses it asks the disk "
        "and promotes what it finds there; the disk gets only the chunks the CPU tier newly "
        "stores (one cascade per GPU->CPU store), never what it still holds; GPU prefix "
        "cache cold",
        f"{bullet}hit rate: prompt tokens the CPU tier or the disk served; chunks from disk: "
        "chunks promoted from the disk to the CPU tier; stranded bytes: on disk at the end, "
        "loadable by no lookup from the disk alone (a restarted engine, another engine on "
        "the root), whatever the CPU tier holds; recomputed for space: against the same "
        "CPU tier over an unbounded disk; lookups abandoned: requests whose hit needs more "
        "chunk slots than the CPU tier has (each round's promotions evict the last "
        "round's), served with no offload hit after 8 rounds; hits evicted by promotions: "
        "lookups whose full-attention scan promoted chunks that evicted a chunk of their own "
        "hit the CPU tier had answered for (vLLM's prepare_load asserts there; asked again "
        "here)",
        "",
        render_table(CPU_CURVE_COLUMNS, rows, fmt, align=(_RIGHT,) * len(CPU_CURVE_COLUMNS)),
    ]


def _disk_text(disk: DiskTier, fmt: TableFormat) -> list[str]:
    bullet = "* " if fmt == "markdown" else ""
    sizes = ", ".join(f"group {g}: {human_bytes(b)}" for g, b in disk.key_bytes.items())
    out = [
        f"disk tier (reference.eviction; {disk.layout} layout: per store job one file of its "
        f"full-attention keys and one of its window keys, each key a section of one CPU-tier "
        f"row: {sizes}); per million prompt tokens of {disk.workload}, "
        f"{disk.prompt_tokens} prompt tokens:",
        "",
        f"{bullet}workload scaled: {disk.scaling}",
        f"{bullet}recomputed for space: tokens an unbounded disk serves that this one does not "
        "(tokens recomputed for chunk granularity, which the unbounded disk recomputes too, "
        "are not counted); stranded bytes: on disk at the end, loadable by no lookup; "
        "stores refused: stores nothing evictable made room for (offered again next step); "
        "keys dropped: keys left out of a store because they would arrive stranded (the "
        "rule's admission; LRU admits every key)",
        *(f"{bullet}{rule}: {text}" for rule, text in RULE_MEANINGS.items()),
    ]
    if disk.at_budget is not None:
        rows = [[r.rule, f"{r.budget_bytes} ({human_bytes(r.budget_bytes)})", *_disk_cells(r)]
                for r in disk.at_budget]
        out += ["", render_table(DISK_COLUMNS_AT, rows, fmt,
                                 align=("left", *(_RIGHT,) * (len(DISK_COLUMNS_AT) - 1)))]
    if disk.curve is not None:
        rows = [
            [
                f"{p.budget_bytes} ({human_bytes(p.budget_bytes)})",
                f"{p.rule.hit_rate:.1%}", f"{p.lru.hit_rate:.1%}",
                _n(p.rule.files_evicted_per_million), _n(p.lru.files_evicted_per_million),
                _n(p.rule.recomputed_for_space_per_million),
                _n(p.lru.recomputed_for_space_per_million),
                f"{p.lru.stranded_bytes} ({human_bytes(p.lru.stranded_bytes)})",
                f"{p.rule.stranded_bytes} ({human_bytes(p.rule.stranded_bytes)})",
                str(p.rule.stores_refused), str(p.lru.stores_refused), str(p.rule.keys_dropped),
                f"{p.rule.bytes_on_disk} ({human_bytes(p.rule.bytes_on_disk)})",
                f"{p.lru.bytes_on_disk} ({human_bytes(p.lru.bytes_on_disk)})",
            ]
            for p in disk.curve
        ]
        out += [
            "",
            "miss-ratio curve (--sweep-disk), the disk only (no CPU tier): hit rate against "
            "disk size, the rule and plain LRU side by side (the last size: the unbounded "
            "run's peak bytes, nothing evicted):",
            "",
            render_table(DISK_CURVE_COLUMNS, rows, fmt, align=(_RIGHT,) * len(DISK_CURVE_COLUMNS)),
        ]
        out += _cpu_curve_text(disk, fmt)
    if disk.plot:
        out += ["", f"{bullet}plot: {disk.plot}"]
    return out


def _config_json(sizing: Sizing) -> str:
    return json.dumps(sizing.kv_transfer_config.to_json())


def render_text(sizing: Sizing) -> str:
    out = [f"{label:<9} {text}" for label, text in _summary_lines(sizing)]
    out += ["", render_table(COLUMNS, _rows(sizing), "text", align=_ALIGN)]
    out += _economics_tables(sizing, "text")
    out += ["", "--kv-transfer-config:", _config_json(sizing)]
    return "\n".join(out) + "\n"


def render_markdown(sizing: Sizing) -> str:
    model = sizing.model
    out = [f"### kvchunk config: {Path(model.dir).name}, TP {model.tensor_parallel_size}", ""]
    out += [f"* **{label}**: {text}" for label, text in _summary_lines(sizing)]
    out += ["", render_table(COLUMNS, _rows(sizing), "markdown")]
    out += _economics_tables(sizing, "markdown")
    out += ["", "`--kv-transfer-config`:", "", "```json", _config_json(sizing), "```"]
    return "\n".join(out) + "\n"


def render(sizing: Sizing, fmt: str) -> str:
    """``fmt``: ``table``, ``markdown`` or ``json``."""
    if fmt == "json":
        return json.dumps(sizing.to_json(), indent=2) + "\n"
    if fmt == "markdown":
        return render_markdown(sizing)
    return render_text(sizing)
