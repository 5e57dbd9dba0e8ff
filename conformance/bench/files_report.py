"""The file-economics section of ``reports/bench.md`` and ``reports/file-economics.png``.

Rows of kind ``files`` (:mod:`conformance.bench.test_bench_files`: the workload served
by :mod:`reference.economics`, as ``python -m vllm_adapter config`` prints it) joined
with rows of kind ``disk`` (:mod:`conformance.bench.test_bench_disk`: measured
fs-tier files/s and GB/s on this machine's disk) by geometry and ``blocks_per_chunk``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conformance.bench import GEOMETRIES
from conformance.bench.economics import FS_MODELS, WORKLOAD
from vllm_adapter.render import render_table

__all__ = ["files_markdown", "plot_files"]


def _files_rows(rows: list[dict[str, Any]], geometry: str) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("kind") == "files" and r["geometry"] == geometry]


def _measured(rows: list[dict[str, Any]], geometry: str, blocks: int, direction: str) -> str:
    for r in rows:
        if (r.get("kind"), r.get("geometry"), r.get("blocks_per_chunk"), r.get("direction")) == (
            "disk",
            geometry,
            blocks,
            direction,
        ):
            return f"{r['files_per_s']:.0f}/s, {r['candidate_gbps']:.2f} GB/s"
    return "-"


def _disk_cell(m: dict[str, Any]) -> str:
    seconds = m["write_seconds_per_million"] + m["read_seconds_per_million"]
    return f"{seconds:.2f} ({m['bound']})"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def files_markdown(rows: list[dict[str, Any]]) -> str:
    """The table (one row per geometry and knob), or nothing without ``files`` rows."""
    if not any(r.get("kind") == "files" for r in rows):
        return ""
    w = WORKLOAD
    headers = [
        "geometry",
        "knob",
        "B",
        "tokens/chunk per group",
        "file MiB (group MiB used)",
        "files written / 1M",
        "files read / 1M",
        "recomputed / 1M",
        "measured write",
        "measured read",
        *(f"{m.name}: write+read s/1M (bound)" for m in FS_MODELS),
    ]
    body = []
    for g in GEOMETRIES:
        for r in _files_rows(rows, g):
            b = int(r["blocks_per_chunk"])
            used = "/".join(_mib(x["used_bytes"]) for x in r["groups"])
            body.append(
                [
                    GEOMETRIES[g],
                    r["knob"],
                    b,
                    "/".join(str(x["tokens_per_chunk"]) for x in r["groups"]),
                    f"{_mib(r['file_bytes'])} ({used})",
                    f"{r['files_written_per_million']:.0f}",
                    f"{r['files_read_per_million']:.0f}",
                    f"{r['recomputed_per_million']:.0f}",
                    _measured(rows, g, b, "write"),
                    _measured(rows, g, b, "read"),
                    *(_disk_cell(r["modelled"][m.name]) for m in FS_MODELS),
                ]
            )
    out = [
        "### File economics: vLLM fs tier, one file per chunk per group",
        "",
        f"Workload: the `{w.name}` preset ({w.describe()}), served through the reference "
        "Planner under the installed release's rules by `reference.economics` (what "
        "`python -m vllm_adapter config` prints): files written and read (a load counts as a "
        "file read) and tokens recomputed because of the chunk granularity, per million "
        "prompt tokens. Files are CPU-tier chunk rows (all rank copies, page-aligned), the "
        "same size for every group; 'used' is what each group's layers fill. Measured: "
        "vLLM's `batch_store_block` / `batch_load_block` on its 16+16-thread pool writing "
        "real files of that size on this machine's disk (the disk benchmark, same B; '-' "
        "where B was not measured). Model (`vllm_adapter/disk_model.py`): seconds per file = "
        "max(latency / threads, bytes / bandwidth), times the files written and read; the "
        "bound is the writes'; IOPS-bound while the latency term wins.",
        "",
        *(
            f"* {m.name}: {m.source}; crossover file size {m.crossover_bytes / 1e6:.2f} MB."
            for m in FS_MODELS
        ),
        "",
        render_table(headers, body),
        "",
    ]
    return "\n".join(out)


def plot_files(rows: list[dict[str, Any]], path: Path) -> bool:
    """Files per million tokens and modelled GB/s against tokens per chunk of the first group."""
    files = [r for r in rows if r.get("kind") == "files" and r["knob"].startswith("blocks_per")]
    if not files:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for g in GEOMETRIES:
        mine = sorted(
            (r for r in files if r["geometry"] == g), key=lambda r: r["blocks_per_chunk"]
        )
        mib = [r["file_bytes"] / 2**20 for r in mine]
        written = [r["files_written_per_million"] for r in mine]
        left.plot(mib, [f if f > 0 else float("nan") for f in written], "o-",
                  label=f"{GEOMETRIES[g]} ({WORKLOAD.name})")
        for m, style in zip(FS_MODELS, ("o-", "s--", "^:"), strict=False):
            gbps = [r["modelled"][m.name]["gbps"] for r in mine]
            right.plot(mib, gbps, style, label=f"{GEOMETRIES[g]}, {m.name}")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("chunk file size (MiB; blocks_per_chunk 1..32)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    left.set_yscale("log")
    left.set_ylabel("files written per million prompt tokens")
    left.set_title(f"Files written per million prompt tokens ({WORKLOAD.name} preset, all groups)")
    right.set_ylabel("modelled write GB/s per client")
    right.set_title("Disk models: IOPS-bound left of the knee")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
