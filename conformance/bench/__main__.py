"""``python -m conformance.bench [pytest args...]``: run the benchmarks, write the reports, check targets.

Runs pytest-benchmark on ``conformance/bench/`` (raw results:
``reports/bench.json``, pytest-benchmark's format plus a ``kvchunk`` section
with the environment, the load average and the target verdicts), then writes
``reports/bench.md`` (the tables, and the file-economics table of
:mod:`conformance.bench.files_report`), ``reports/bench-throughput.png``
(transfer and disk throughput against ``blocks_per_chunk`` per geometry, the
limit drawn as a dashed line) and ``reports/file-economics.png``.  Each target
check is "met", "missed" (the whole 95 % interval on the wrong side) or
"inconclusive" (it straddles the target: rerun); exits non-zero when a
benchmark fails or a target is **missed**, printing which and by how much.
What each figure means: :mod:`conformance.bench`.

``python -m conformance.bench --render`` measures nothing: it writes ``reports/bench.md``
again from ``reports/bench.json`` (its stored environment and verdicts), after a change to
the renderers.
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

from conformance.bench import BLOCKS_PER_CHUNK, DISK_MB, GEOMETRIES, ROUNDS, TARGETS, THREADS
from conformance.bench.files_report import files_markdown, plot_files
from conformance.bench.report import markdown, pick

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "reports"
JSON = REPORTS / "bench.json"
MARKDOWN = REPORTS / "bench.md"
PLOT = REPORTS / "bench-throughput.png"
FILES_PLOT = REPORTS / "file-economics.png"


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


def check_targets(
    rows: Iterable[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Every (target, figure) check, a line per miss, a line per inconclusive figure.

    Only a miss (the whole interval on the wrong side) fails the run; an inconclusive
    figure (the interval straddles the target) asks for a rerun.
    """
    checks, misses, unsure = [], [], []
    for target in TARGETS:
        for row in rows:
            if not target.applies(row):
                continue
            verdict = target.verdict(row)
            checks.append(
                {
                    "target": target.text,
                    "benchmark": row["name"],
                    "ratio": row[target.field],
                    "ratio_ci": row[f"{target.field}_ci"],
                    "verdict": verdict,
                }
            )
            line = f"{target.text}: {row['name']}: {target.explain(row)}"
            if verdict == "missed":
                misses.append(f"MISSED {line}")
            elif verdict == "inconclusive":
                unsure.append(f"INCONCLUSIVE (rerun) {line}")
    return checks, misses, unsure


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
                by_b = pick(rows, kind=kind, geometry=g, direction=direction)
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


def render() -> int:
    """``reports/bench.md`` again from ``reports/bench.json``, as the run that wrote it."""
    data, rows = load_rows(JSON)
    kv = data["kvchunk"]
    text = markdown(rows, kv["target_checks"], kv["missed"], kv["inconclusive"],
                    kv["environment"], kv["pytest_status"])
    MARKDOWN.write_text(text + files_markdown(rows))
    print(f"wrote {MARKDOWN.relative_to(ROOT)} from {JSON.relative_to(ROOT)}")
    return 0


def main(argv: list[str]) -> int:
    if argv == ["--render"]:
        return render()
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
    checks, misses, unsure = check_targets(rows)
    text = markdown(rows, checks, misses, unsure, env, status)
    text += files_markdown(rows)
    MARKDOWN.write_text(text)
    plotted = plot(rows, PLOT)
    plot_files(rows, FILES_PLOT)
    data["kvchunk"] = {
        "environment": env,
        "target_checks": checks,
        "missed": misses,
        "inconclusive": unsure,
        "pytest_status": status,
    }
    JSON.write_text(json.dumps(data, indent=2) + "\n")
    print("\n" + text)
    print(
        f"wrote {JSON.relative_to(ROOT)}, {MARKDOWN.relative_to(ROOT)}"
        + (
            f", {PLOT.relative_to(ROOT)}, {FILES_PLOT.relative_to(ROOT)}"
            if plotted
            else " (no matplotlib: no plots)"
        )
    )
    for line in (*misses, *unsure):
        print(line, file=sys.stderr)
    if status:
        print(f"benchmarks failed: pytest exit status {status}", file=sys.stderr)
        return status
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
