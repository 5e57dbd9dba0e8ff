"""``--plot`` of ``--sweep``: the figure, and writing a figure (:func:`save_plot`).

The computations it draws are :mod:`vllm_adapter.economics`' (shared with
:mod:`vllm_adapter.planning` and the benchmarks); what only the CLI adds is here: the
plots, whose failures are one-line :class:`~vllm_adapter.cli.args.CliError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_adapter.cli.args import CliError
from vllm_adapter.results import Sweep

__all__ = ["plot_sweep", "save_plot"]


def plot_sweep(result: Sweep, path: Path, title: str) -> None:
    """A PNG of the sweep: files, recomputed tokens and modelled disk time per knob value."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError(
            "--plot needs matplotlib, which is not installed here (pip install matplotlib)"
        ) from None
    xs = [next(iter(p.knob.values())) for p in result.points]

    def positive(values: list[float]) -> list[float]:
        """Zeros (nothing stored at that chunk size) left out of a log axis."""
        return [v if v > 0 else float("nan") for v in values]

    fig, (files, hits, disk) = plt.subplots(1, 3, figsize=(16, 4.6))
    files.plot(xs, positive([p.traffic.files_written_per_million for p in result.points]), "o-",
               label="files written")
    files.plot(xs, positive([p.traffic.files_read_per_million for p in result.points]), "s--",
               label="files read")
    files.set_yscale("log")
    files.set_ylabel("files per million prompt tokens")
    files.set_title("Files (all groups)")
    hits.plot(xs, [p.traffic.recomputed_per_million for p in result.points], "o-",
              label="recomputed (tail + lost)")
    hits.plot(xs, [p.traffic.recomputed_tail_per_million for p in result.points], "s--",
              label="partial tail")
    hits.set_ylabel("tokens recomputed per million prompt tokens")
    hits.set_title("Hit cost of the chunk size")
    for i, name in enumerate(r.fs_model for r in (result.points[0].traffic.disk
                                                  if result.points else ())):
        disk.plot(xs, positive([p.traffic.disk[i].write_seconds_per_million
                                for p in result.points]), "o-", label=f"{name}: write")
        disk.plot(xs, positive([p.traffic.disk[i].read_seconds_per_million
                                for p in result.points]), "s--", label=f"{name}: read")
    disk.set_yscale("log")
    disk.set_ylabel("modelled disk seconds per million prompt tokens")
    disk.set_title("Modelled disk time")
    for ax in (files, hits, disk):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(result.knob_name)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    save_plot(fig, path, title)


def save_plot(fig: Any, path: Path, title: str) -> None:
    """Title, lay out and write a ``--plot`` figure as PNG (a one-line error if it cannot be
    written), then close it."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110, format="png")
    except OSError as e:
        raise CliError(f"--plot {path}: cannot write it ({e.strerror or e})") from None
    finally:
        plt.close(fig)
