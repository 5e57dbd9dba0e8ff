"""``--disk-bytes`` and ``--sweep-disk``: what hit rate a disk of a given size gives.

The workload is scaled to about a million prompt tokens of sessions over time
(:func:`reference.disk_economics.scaled`: sessions turn by turn round-robin), then served
through the reference Planner over a disk tier of a byte budget (:func:`reference.disk_economics.miss_ratio_curve`),
packed layout (per store job a file of its full-attention keys and one of its window
keys, as the tier writes them), each key one CPU-tier row of the chosen knob.
Both eviction rules run: the reference's rule (leaves of the prefix structure first,
least recently used among them; strands nothing) and plain per-file LRU (the
baseline, whose stranded bytes are reported).  With ``--cpu-bytes``, ``--sweep-disk``
serves the same workload a second time at the same disk sizes with vLLM's CPU tier in
front of the disk, as operators run it (:func:`reference.tiered_curve.tiered_miss_ratio_curve`:
``cpu_bytes_to_use // slot`` chunk slots, vLLM's request-scoped LRU, promotions at
lookup, the disk fed only by the CPU->disk cascade of newly stored chunks).  The GPU
prefix cache, in both series, is the workload's ``gpu_cache`` (cold for every preset: every
reused token must come from offload), which ``--gpu-cache`` overrides (the ``gpu_cache``
parameter of both curves).  No vLLM import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from reference.disk_economics import DiskEconomics, scaled
from reference.eviction import EvictionRule, Layout
from reference.knobs import Chunking
from reference.packed_split import LoadSplit
from reference.plan import Policy
from reference.tiered_curve import TieredEconomics
from reference.workload import GpuCache, Workload, requests
from vllm_adapter.cli.args import CliError
from vllm_adapter.cli.economics import save_plot
from vllm_adapter.cli.result import DiskCurvePoint, DiskRun, DiskTier, TieredDiskRun
from vllm_adapter.planning import DISK_SWEEP_POINTS, disk_curve, disk_sweep

__all__ = ["DISK_SWEEP_POINTS", "disk_run", "disk_tier", "plot_disk_curve"]

RULES = (EvictionRule.REACHABLE, EvictionRule.LRU)


def disk_run(e: DiskEconomics) -> DiskRun:
    """One served disk, per million prompt tokens."""
    return DiskRun(
        rule=e.rule.value,
        budget_bytes=e.budget_bytes,
        hit_rate=e.hit_rate,
        hits_per_million=e.per_million(e.offload_hit_tokens),
        files_read_per_million=e.per_million(e.files_read),
        files_written_per_million=e.per_million(e.files_written),
        files_evicted_per_million=e.per_million(e.files_evicted),
        recomputed_for_space_per_million=e.per_million(e.recomputed_for_space_tokens),
        stranded_bytes=e.stranded_bytes,
        bytes_on_disk=e.bytes_on_disk,
        stores_refused=e.stores_refused,
        keys_dropped=e.keys_dropped,
        recomputed_for_space_tokens=e.recomputed_for_space_tokens,
    )


def tiered_run(e: TieredEconomics) -> TieredDiskRun:
    """One disk behind the CPU tier, per million prompt tokens."""
    return TieredDiskRun(
        **vars(disk_run(e)),
        keys_promoted_per_million=e.per_million(e.keys_promoted),
        promotions_refused=e.promotions_refused,
        cpu_stores_refused=e.cpu_stores_refused,
        lookups_abandoned=e.lookups_abandoned,
        hits_evicted_by_promotions=e.hits_evicted_by_promotions,
    )


def _scaling(workload: Workload, scaled_workload: Workload) -> str:
    given = sum(len(r.prompt) for r in requests(workload))
    return (
        f"{workload.name}: {workload.sessions} session(s), {given} prompt tokens, scaled to "
        f"{scaled_workload.sessions} sessions (~1M prompt tokens) served turn by turn "
        "round-robin (a session's next turn comes back after every other session's), "
        + ("GPU prefix cache cold: every reused token comes from the disk"
           if scaled_workload.gpu_cache is GpuCache.COLD else
           f"GPU prefix cache {scaled_workload.gpu_cache.value}: the system prompt stays on "
           "the GPU, every other reused token comes from the disk")
    )


def disk_tier(
    chunking: Chunking,
    workload: Workload,
    policy: Policy,
    key_bytes: Mapping[int, int],
    disk_bytes: int | None,
    sweep: bool,
    plot: Path | None,
    title: str,
    cpu_bytes: int | None = None,
    cpu_chunks: int | None = None,
    load_split: LoadSplit | None = None,
) -> DiskTier | None:
    """Both rules at ``disk_bytes`` and/or across :data:`DISK_SWEEP_POINTS` sizes; with
    ``cpu_chunks`` (the CPU tier's slots for ``cpu_bytes``), the sweep's sizes again with
    that CPU tier in front of the disk.  ``load_split``: the packed tier's (its files read
    are one per file per slice, :class:`reference.disk_economics.BudgetedIndex`).  The GPU
    prefix cache is ``workload.gpu_cache`` in both series."""
    if disk_bytes is None and not sweep:
        return None
    if chunking.alignment_tokens is None:
        raise CliError(
            "--disk-bytes / --sweep-disk: this chunking has no alignment span (full-attention "
            "groups of different chunk spans); give a --block-size, e.g. --block-size 512"
        )
    big = scaled(workload, gpu_cache=workload.gpu_cache)
    prompt_tokens = sum(len(r.prompt) for r in requests(big))

    def curve(sizes: tuple[int, ...] | int, rule: EvictionRule) -> tuple[DiskEconomics, ...]:
        try:
            return disk_curve(chunking, big, sizes, rule, policy, key_bytes, load_split)
        except ValueError as e:  # a Mamba-align group: the rule does not model it
            raise CliError(f"--disk-bytes / --sweep-disk: {e}") from None

    at_budget: tuple[DiskRun, ...] | None = None
    if disk_bytes is not None:
        at_budget = tuple(disk_run(curve((disk_bytes,), rule)[0]) for rule in RULES)
    points: tuple[DiskCurvePoint, ...] | None = None
    cpu_points: tuple[DiskCurvePoint, ...] | None = None
    if sweep:
        try:
            swept = disk_sweep(chunking, big, policy, key_bytes, cpu_chunks, load_split)
        except ValueError as e:  # a Mamba-align group: the rule does not model it
            raise CliError(f"--disk-bytes / --sweep-disk: {e}") from None
        points = tuple(
            DiskCurvePoint(size, disk_run(r), disk_run(lru))
            for size, r, lru in zip(swept.sizes, swept.rule, swept.lru, strict=True)
        )
        if swept.cpu_rule is not None and swept.cpu_lru is not None:
            cpu_points = tuple(
                DiskCurvePoint(size, tiered_run(r), tiered_run(lru))
                for size, r, lru in zip(swept.sizes, swept.cpu_rule, swept.cpu_lru, strict=True)
            )
    result = DiskTier(
        workload=big.name,
        scaling=_scaling(workload, big),
        sessions=big.sessions,
        prompt_tokens=prompt_tokens,
        layout=Layout.PACKED.value,
        key_bytes={int(k): int(v) for k, v in key_bytes.items()},
        at_budget=at_budget,
        curve=points,
        plot=None,
        cpu_bytes=cpu_bytes if cpu_points is not None else None,
        cpu_chunks=cpu_chunks if cpu_points is not None else None,
        cpu_curve=cpu_points,
    )
    if plot is not None and points is not None:
        plot_disk_curve(points, plot, f"{title}; {big.name}", cpu_points, cpu_bytes)
        result = replace(result, plot=str(plot))
    return result


def plot_disk_curve(
    points: tuple[DiskCurvePoint, ...], path: Path, title: str,
    cpu_points: tuple[DiskCurvePoint, ...] | None = None, cpu_bytes: int | None = None,
) -> None:
    """A PNG: hit rate against disk size, both rules, disk only and (with ``cpu_points``)
    with the CPU tier in front; the stranded bytes beside."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CliError(
            "--plot needs matplotlib, which is not installed here (pip install matplotlib)"
        ) from None
    xs = [p.budget_bytes / 1e9 for p in points]
    fig, (hits, stranded) = plt.subplots(1, 2, figsize=(12, 4.6))
    # (series name, its points, the rule's line style, LRU's)
    series = [("disk only", points, "o-", "s--")]
    if cpu_points is not None:
        cpu = f"CPU tier in front ({cpu_bytes / 1e9:.1f} GB)" if cpu_bytes else "CPU tier in front"
        series.append((cpu, cpu_points, "^:", "v-."))
    for name, pts, rule_style, lru_style in series:
        hits.plot(xs, [p.rule.hit_rate for p in pts], rule_style,
                  label=f"the rule (leaves first), {name}")
        hits.plot(xs, [p.lru.hit_rate for p in pts], lru_style,
                  label=f"plain per-file LRU, {name}")
        stranded.plot(xs, [p.lru.stranded_bytes / 1e9 for p in pts], lru_style,
                      label=f"plain LRU, {name}")
        stranded.plot(xs, [p.rule.stranded_bytes / 1e9 for p in pts], rule_style,
                      label=f"the rule, {name}")
    hits.set_ylabel("prompt tokens served from offload (hit rate)")
    hits.set_title("Miss-ratio curve")
    stranded.set_ylabel("GB on disk no lookup can load from the disk alone (at the end)")
    stranded.set_title("Stranded bytes")
    for ax in (hits, stranded):
        ax.set_xlabel("disk budget (GB)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    save_plot(fig, path, title)
