"""``python -m conformance.bench [pytest args...]``: run the benchmarks, write the reports, check targets.

Runs pytest-benchmark on ``conformance/bench/`` (raw results:
``reports/bench.json``, pytest-benchmark's format plus a ``kvchunk`` section
with the environment and the target checks), then writes ``reports/bench.md``
(the tables) and ``reports/bench-throughput.png`` (transfer and disk throughput
against ``blocks_per_chunk`` per geometry, the limit drawn as a dashed line).
Exits non-zero when a benchmark fails or a target is missed, printing which
target and by how much.  What each figure means: :mod:`conformance.bench`.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from conformance.bench import (
    BLOCKS_PER_CHUNK,
    DISK_MB,
    GEOMETRIES,
    ROUNDS,
    TARGETS,
    THREADS,
    Target,
)

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "reports"
JSON = REPORTS / "bench.json"
MARKDOWN = REPORTS / "bench.md"
PLOT = REPORTS / "bench-throughput.png"


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


def load_rows(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """pytest-benchmark's JSON and one row per benchmark (its ``extra_info`` plus its name)."""
    data = json.loads(path.read_text())
    rows = []
    for b in data.get("benchmarks", []):
        info = dict(b.get("extra_info") or {})
        if "kind" in info:
            info["name"] = b["name"]
            rows.append(info)
    return data, rows


def check_targets(rows: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every (target, figure) check, and a line per miss."""
    checks, misses = [], []
    for target in TARGETS:
        for row in rows:
            if not target.applies(row):
                continue
            miss = target.miss(float(row["ratio"]))
            checks.append(
                {
                    "target": target.text,
                    "benchmark": row["name"],
                    "ratio": row["ratio"],
                    "miss": miss,
                }
            )
            if miss:
                misses.append(f"MISSED {target.text}: {row['name']}: {miss}")
    return checks, misses


def _pick(rows: Iterable[dict[str, Any]], **match: Any) -> dict[int, dict[str, Any]]:
    """Rows matching ``match``, by blocks_per_chunk."""
    return {
        int(r["blocks_per_chunk"]): r for r in rows if all(r.get(k) == v for k, v in match.items())
    }


def _target_for(kind: str) -> Target | None:
    return next((t for t in TARGETS if t.kind == kind), None)


def _cell(row: dict[str, Any] | None, extra: str = "") -> str:
    if row is None:
        return "-"
    text = f"{row['ratio']:.2f}"
    target = _target_for(row["kind"])
    if target is not None and target.applies(row) and target.miss(float(row["ratio"])):
        text = f"**{text}** (miss)"
    if extra:
        text += f" ({extra.format(**row)})"
    return text


def _table(
    title: str, header: str, lines: list[tuple[str, dict[int, dict[str, Any]], str]]
) -> list[str]:
    out = [f"### {title}", "", header, ""]
    cols = " | ".join(f"B={b}" for b in BLOCKS_PER_CHUNK)
    out.append(f"| | {cols} |")
    out.append("|---|" + "---|" * len(BLOCKS_PER_CHUNK))
    for label, by_b, extra in lines:
        cells = " | ".join(_cell(by_b.get(b), extra) for b in BLOCKS_PER_CHUNK)
        out.append(f"| {label} | {cells} |")
    out.append("")
    return out


def markdown(
    rows: list[dict[str, Any]],
    checks: list[dict[str, Any]],
    misses: list[str],
    env: dict[str, Any],
    status: int,
) -> str:
    out = ["# kvchunk benchmarks", ""]
    out.append(
        f"{env['date']}; {env['machine']}; python {env['python']}, torch {env['torch']}, "
        f"vLLM {env['vllm']}; torch threads {env['threads']}; load average "
        f"{env['loadavg_start']} at start, {env['loadavg_end']} at end; pytest exit status {status}."
    )
    out.append("")
    out.append(
        "Every figure is a ratio against a baseline measured in the same process, in the same "
        "rounds (median over rounds of each round's candidate vs the baseline runs around it; "
        "connector: fastest run vs fastest run); `B` is `blocks_per_chunk`. Bold: a target missed. "
        "What each figure measures: `conformance/bench/__init__.py`."
    )
    out.append("")
    geos = list(GEOMETRIES)
    lines = []
    for g in geos:
        for d, what in (("gather", "store (gather)"), ("scatter", "load (scatter)")):
            lines.append(
                (
                    f"{GEOMETRIES[g]} {what}",
                    _pick(rows, kind="transfer", geometry=g, direction=d),
                    "{candidate_gbps:.1f} GB/s",
                )
            )
    out += _table(
        "Transfer: reference gather/scatter vs one contiguous copy (memcpy limit)",
        "Target >= 0.8 for B >= 4. Cell: ratio (reference GB/s). Job: 64 random blocks of one "
        "group, every layer, over vLLM's canonical KV tensors (1024 blocks).",
        lines,
    )
    lines = []
    for g in geos:
        lines.append(
            (
                f"{GEOMETRIES[g]} kvchunk / stock",
                _pick(rows, kind="connector", geometry=g),
                "{step_ms[kvchunk]:.2f} ms/step",
            )
        )
    for g in geos:
        for who in ("stock", "kvchunk"):
            by_b = {
                b: {**r, "kind": "info", "ratio": r[f"ratio_{who}_vs_none"]}
                for b, r in _pick(rows, kind="connector", geometry=g).items()
            }
            extra = "{step_ms[none]:.2f} ms/step without" if who == "stock" else ""
            lines.append((f"{GEOMETRIES[g]} {who} / no connector", by_b, extra))
    out += _table(
        "Connector overhead: wall time per scheduler step",
        "Target kvchunk / stock <= 1.05 (same requests, same decisions: checked), fastest of "
        "15 runs each (a run is tens of ms: noise from other jobs only adds time). Connector / "
        "no connector: informational (per step; the runs differ in steps and offloading work).",
        lines,
    )
    lines = []
    for g in geos:
        for d in ("write", "read"):
            lines.append(
                (
                    f"{GEOMETRIES[g]} {d}",
                    _pick(rows, kind="disk", geometry=g, direction=d),
                    "{candidate_gbps:.2f} GB/s, {files_per_s:.0f} files/s",
                )
            )
    disk = [r for r in rows if r["kind"] == "disk"]
    note = ""
    if disk:
        r0 = disk[0]
        reads = [r for r in disk if r["direction"] == "read"]
        note = (
            f" {r0['bytes'] / 2**20:.0f} MiB per configuration (scaled down from 2 GiB for the time "
            f"budget; `KVCHUNK_BENCH_DISK_MB`), {r0.get('filesystem', '?')}, "
            f"O_DIRECT {'on' if r0['o_direct'] else 'off'}, "
            f"page cache dropped between write and read: "
            f"{'yes' if reads and all(r['drop_caches'] for r in reads) else 'no'}; reads served "
            f"from the page cache: {'yes' if any(r['read_from_page_cache'] for r in reads) else 'no'}."
        )
    out += _table(
        "Disk: vLLM fs-tier chunk files vs one sequential file of the same bytes",
        "Informational. Cell: ratio (fs tier GB/s, files/s)." + note,
        lines,
    )
    lines = []
    for g in geos:
        lines.append(
            (
                f"{GEOMETRIES[g]}",
                _pick(rows, kind="suite", geometry=g),
                "lane {lane_examples_per_s:.0f}/s, oracle {oracle_examples_per_s:.0f}/s",
            )
        )
    out += _table(
        "Suite speed: plan-lane examples per second",
        "Informational. Cell: oracle throughput / vLLM-run throughput on the same examples "
        "(lane examples/s: hypothesis draw + vLLM run + replay + compare; oracle examples/s).",
        lines,
    )
    gpu = [r for r in rows if r["kind"] == "gpu"]
    if gpu:
        lines = []
        for g in geos:
            for w in ("vllm", "reference"):
                for d in ("store", "load"):
                    lines.append(
                        (
                            f"{GEOMETRIES[g]} {w} {d}",
                            _pick(rows, kind="gpu", geometry=g, worker=w, direction=d),
                            "{candidate_gbps:.1f} GB/s",
                        )
                    )
        out += _table(
            f"GPU: offloading workers vs pinned cudaMemcpyAsync ({gpu[0]['device']})",
            "Target (vLLM worker) >= 0.8 for B >= 4. Cell: ratio (GB/s).",
            lines,
        )
    else:
        out += ["### GPU", "", f"Skipped: {env['gpu']}.", ""]
    out += ["### Targets", ""]
    if not checks:
        out.append("No target was checked (no results).")
    for t in TARGETS:
        mine = [c for c in checks if c["target"] == t.text]
        if not mine:
            continue
        failed = [c for c in mine if c["miss"]]
        worst = (
            min(mine, key=lambda c: c["ratio"])
            if t.min_ratio is not None
            else max(mine, key=lambda c: c["ratio"])
        )
        verdict = "met" if not failed else f"MISSED in {len(failed)} of {len(mine)}"
        out.append(f"* {t.text}: {verdict} (worst {worst['ratio']:.3f}, {worst['benchmark']})")
    out += [f"* {m}" for m in misses]
    out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    geos = list(GEOMETRIES)
    fig, axes = plt.subplots(2, len(geos), figsize=(6 * len(geos), 8), squeeze=False)
    panels = (
        ("transfer", (("gather", "store (gather)"), ("scatter", "load (scatter)")), "memcpy"),
        ("disk", (("write", "write"), ("read", "read")), "one sequential file"),
    )
    for row_i, (kind, series, limit_name) in enumerate(panels):
        for col, g in enumerate(geos):
            ax = axes[row_i][col]
            for (direction, label), color in zip(series, ("tab:blue", "tab:orange"), strict=True):
                by_b = _pick(rows, kind=kind, geometry=g, direction=direction)
                bs = sorted(by_b)
                if not bs:
                    continue
                ax.plot(bs, [by_b[b]["candidate_gbps"] for b in bs], "o-", color=color, label=label)
                ax.plot(
                    bs,
                    [by_b[b]["limit_gbps"] for b in bs],
                    "--",
                    color=color,
                    alpha=0.7,
                    label=f"limit: {limit_name} ({direction})",
                )
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(BLOCKS_PER_CHUNK), [str(b) for b in BLOCKS_PER_CHUNK])
            ax.set_xlabel("blocks_per_chunk")
            ax.set_ylabel("GB/s")
            ax.set_ylim(bottom=0)
            what = "reference transfer" if kind == "transfer" else "vLLM fs-tier chunk files"
            ax.set_title(f"{GEOMETRIES[g]}: {what}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def environment(loadavg_start: str) -> dict[str, Any]:
    import torch

    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:  # pragma: no cover
        vllm_version = "not installed"
    cuda = torch.cuda.is_available()
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.processor() or platform.system()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": vllm_version,
        "threads": torch.get_num_threads(),
        "rounds": ROUNDS,
        "disk_mb": DISK_MB,
        "loadavg_start": loadavg_start,
        "loadavg_end": _loadavg(),
        "gpu": torch.cuda.get_device_name()
        if cuda
        else "no CUDA on this host (torch.cuda.is_available() is False)",
    }


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover
        return "n/a"


def main(argv: list[str]) -> int:
    import torch

    torch.set_num_threads(THREADS)
    REPORTS.mkdir(exist_ok=True)
    if JSON.exists():
        JSON.unlink()
    loadavg_start = _loadavg()
    args = [
        str(ROOT / "conformance" / "bench"),
        "-p",
        "no:cacheprovider",
        "-q",
        "-rfEs",
        f"--benchmark-json={JSON}",
        "--benchmark-disable-gc",
        "--benchmark-sort=name",
        "--benchmark-columns=median,rounds",
        *argv,
    ]
    status = int(pytest.main(args))
    if not JSON.exists():
        print(f"no results: pytest exited {status} before writing {JSON}", file=sys.stderr)
        return status or 1
    data, rows = load_rows(JSON)
    env = environment(loadavg_start)
    checks, misses = check_targets(rows)
    text = markdown(rows, checks, misses, env, status)
    MARKDOWN.write_text(text)
    plotted = plot(rows, PLOT)
    data["kvchunk"] = {
        "environment": env,
        "target_checks": checks,
        "missed": misses,
        "pytest_status": status,
    }
    JSON.write_text(json.dumps(data, indent=2) + "\n")
    print("\n" + text)
    print(
        f"wrote {JSON.relative_to(ROOT)}, {MARKDOWN.relative_to(ROOT)}"
        + (f", {PLOT.relative_to(ROOT)}" if plotted else " (no matplotlib: no plot)")
    )
    for line in misses:
        print(line, file=sys.stderr)
    if status:
        print(f"benchmarks failed: pytest exit status {status}", file=sys.stderr)
        return status
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
