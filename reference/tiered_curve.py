"""The miss-ratio curve as operators run it: vLLM's CPU tier in front of the disk.

:func:`reference.disk_economics.miss_ratio_curve` serves a workload over the disk alone
(every store reaches the disk, every reused token comes from it).  An engine runs the
disk behind vLLM's CPU tier (``TieringOffloadingManager``): :func:`tiered_miss_ratio_curve`
serves the same workload through :class:`reference.tiered_index.PromotingEngine` over a
:class:`reference.tiered_index.TieredIndex` whose CPU tier has ``cpu_slots`` chunk slots
(one per key: vLLM's CPU tier holds one row per chunk key) and evicts by vLLM's
request-scoped LRU (:class:`reference.cpu_lru.CpuLru`), in front of a
:class:`~reference.disk_economics.BudgetedIndex` fed only by the CPU->disk cascade of
newly stored chunks:

* a hit is a prompt token an offload tier served, the CPU tier or the disk (through a
  promotion): :attr:`TieredEconomics.hit_rate`;
* the disk is read only for what the CPU tier no longer holds, and is refreshed only by
  those reads (a CPU hit leaves the disk's use times alone);
* "stranded" keeps its strict meaning: bytes on disk no lookup can load from the disk
  alone (a restarted engine, or another engine on the root), whatever the CPU tier holds.

The GPU prefix cache is as ``gpu_cache`` says (default cold, as
:func:`~reference.disk_economics.scaled` makes it by default).  A
disk of ``size`` bytes behaves as the unbounded one until a store would take it past
``size`` (the CPU tier's state depends on the disk only through what lookups find on
it), so the curve continues from snapshots of the unbounded run, as
:func:`~reference.disk_economics.miss_ratio_curve` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from reference.cpu_lru import CpuLru
from reference.curves import curve_from_snapshots
from reference.disk_economics import BudgetedIndex, DiskEconomics
from reference.economics import hashed
from reference.eviction import EvictionRule, Layout, Overflow
from reference.knobs import Chunking
from reference.packed_split import LoadSplit
from reference.plan import Policy
from reference.tiered_index import PromotingEngine, TieredIndex
from reference.workload import GpuCache, Workload, requests

__all__ = ["TieredEconomics", "tiered_miss_ratio_curve"]


@dataclass(frozen=True)
class TieredEconomics(DiskEconomics):
    """:class:`~reference.disk_economics.DiskEconomics` of a disk behind a CPU tier of
    :attr:`cpu_slots` chunk slots.  Here :attr:`offload_hit_tokens` counts the tokens the
    CPU tier or the disk served; the disk's own figures (files read, written, evicted,
    stranded, on disk, stores refused, keys dropped) are the disk's alone, and tokens
    recomputed for lack of space are against the same CPU tier over an unbounded disk."""

    cpu_slots: int = 0
    keys_promoted: int = 0
    """Keys read from the disk into the CPU tier (promotions at lookup)."""
    promotions_refused: int = 0
    """Disk hits the CPU tier had no free or evictable slot for (the lookup missed)."""
    cpu_stores_refused: int = 0
    """GPU->CPU stores the CPU tier had no room for (offered again next step)."""
    keys_cascaded: int = 0
    """Keys the CPU->disk cascade offered the disk (newly stored chunks only)."""
    lookups_abandoned: int = 0
    """Lookups still deferred after :data:`reference.tiered_index.MAX_LOOKUP_ROUNDS`."""
    hits_evicted_by_promotions: int = 0
    """Lookups asked again because a promotion they started evicted a chunk of their hit
    (:attr:`reference.tiered_index.TieredIndex.hits_evicted_by_promotions`)."""
    bytes_written: int = 0
    """Bytes of the files the disk wrote (the cascade's, repairs included)."""
    keys_repaired: int = 0
    """Ancestors written from the CPU tier (``repair``; :meth:`TieredIndex.missing_ancestors`)."""
    bytes_repaired: int = 0
    """Their bytes, part of :attr:`bytes_written`."""


def _start(chunking: Chunking, policy: Policy, budget_tokens: int, index: TieredIndex,
           gpu_cache: GpuCache = GpuCache.COLD) -> PromotingEngine:
    engine = PromotingEngine(chunking, policy, budget_tokens, index)
    engine.gpu_cache = gpu_cache
    return engine


def tiered_miss_ratio_curve(
    chunking: Chunking,
    workload: Workload,
    sizes: Sequence[int] | int,
    cpu_slots: int,
    rule: EvictionRule = EvictionRule.REACHABLE,
    key_bytes: Mapping[int, int] | int = 1,
    layout: Layout = Layout.PACKED,
    policy: Policy = Policy(),  # noqa: B008  (a frozen dataclass)
    *,
    admission: bool | None = None,
    overflow: Overflow = Overflow.REFUSE,
    window_siblings: bool = False,
    windows_apart: bool = True,
    load_split: LoadSplit | None = None,
    gpu_cache: GpuCache = GpuCache.COLD,
    repair: bool = False,
) -> tuple[TieredEconomics, ...]:
    """``workload`` served with a CPU tier of ``cpu_slots`` chunk slots in front of a disk
    of each of ``sizes`` bytes (an int ``n``: ``n`` sizes evenly spaced up to this run's
    unbounded peak bytes, as :func:`~reference.disk_economics.miss_ratio_curve`); the
    disk's options are :class:`~reference.disk_economics.BudgetedIndex`'s; the GPU prefix
    cache is as ``gpu_cache`` says (default cold; the workload's own field is not read).
    ``repair``: :class:`~reference.tiered_index.TieredIndex`'s option (the cascade also
    writes a store's missing ancestors the CPU tier holds; off: vLLM's cascade)."""
    if isinstance(cpu_slots, bool) or not isinstance(cpu_slots, int) or cpu_slots < 0:
        raise ValueError(f"cpu_slots must be an int >= 0, got {cpu_slots!r}")
    reqs = hashed(list(requests(workload)), chunking.tokens_per_hash)
    budget_tokens = workload.max_num_batched_tokens

    def new_index(size: int) -> TieredIndex:
        disk = BudgetedIndex(chunking, key_bytes, size, rule, layout, policy.window,
                             admission=admission, overflow=overflow,
                             window_siblings=window_siblings, windows_apart=windows_apart,
                             load_split=load_split)
        return TieredIndex(disk, CpuLru(cpu_slots), repair=repair)

    def result(engine: PromotingEngine, index: TieredIndex, size: int | None,
               baseline_served: int) -> TieredEconomics:
        t, d = engine.tally, index.disk
        return TieredEconomics(
            workload=workload.name, rule=rule, layout=layout, budget_bytes=size,
            prompt_tokens=t.prompt_tokens, offload_hit_tokens=t.offload_hit,
            files_read=d.files_read, files_written=d.files_written,
            files_evicted=d.files_evicted,
            recomputed_for_space_tokens=baseline_served - (t.gpu_hit + t.offload_hit),
            stranded_bytes=d.stranded_bytes(), bytes_on_disk=d.disk.bytes,
            stores_refused=d.stores_refused, keys_dropped=d.keys_dropped,
            stores_cut=d.stores_cut, keys_cut=d.keys_cut,
            cpu_slots=cpu_slots, keys_promoted=index.keys_promoted,
            promotions_refused=index.promotions_refused,
            cpu_stores_refused=index.cpu_stores_refused, keys_cascaded=index.keys_cascaded,
            lookups_abandoned=index.lookups_abandoned,
            hits_evicted_by_promotions=index.hits_evicted_by_promotions,
            bytes_written=d.bytes_written, keys_repaired=index.keys_repaired,
            bytes_repaired=index.bytes_repaired,
        )

    def start(size: int) -> tuple[PromotingEngine, TieredIndex]:
        index = new_index(size)
        return _start(chunking, policy, budget_tokens, index, gpu_cache), index

    return curve_from_snapshots(reqs, sizes, start, lambda index: index.disk, result,
                                "tiered_miss_ratio_curve")
