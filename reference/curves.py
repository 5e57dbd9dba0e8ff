"""The miss-ratio curves' serving loop, shared by the disk-only curve
(:func:`reference.disk_economics.miss_ratio_curve`) and the CPU-in-front one
(:func:`reference.tiered_curve.tiered_miss_ratio_curve`): a disk of ``size`` bytes
behaves as the unbounded one until a store would take it past ``size``, so each smaller
size continues from a snapshot of the unbounded run."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from reference.economics import Tally
from reference.workload import WorkloadRequest

if TYPE_CHECKING:
    from reference.disk_economics import BudgetedIndex, DiskEconomics

__all__ = ["SNAPSHOTS", "curve_from_snapshots"]

SNAPSHOTS = 32
"""States of the unbounded run a curve keeps (evenly spaced in requests): a bounded run
starts from the latest one it shares (see :func:`curve_from_snapshots`)."""


EngineT = TypeVar("EngineT", bound="_Serving")
IndexT = TypeVar("IndexT")
ResultT = TypeVar("ResultT", bound="DiskEconomics")


class _Serving(Protocol):
    """An engine of the curves (``reference.economics``'s, or a promoting one)."""

    tally: Tally

    def serve(self, req: WorkloadRequest, all_hashes: Sequence[bytes]) -> Any: ...


def curve_from_snapshots(
    reqs: Sequence[tuple[WorkloadRequest, Sequence[bytes]]],
    sizes: Sequence[int] | int,
    start: Callable[[int], tuple[EngineT, IndexT]],
    disk_of: Callable[[IndexT], BudgetedIndex],
    result: Callable[[EngineT, IndexT, int | None, int], ResultT],
    name: str,
) -> tuple[ResultT, ...]:
    """The curve of :func:`miss_ratio_curve` (and of the CPU-in-front one,
    :func:`reference.tiered_curve.tiered_miss_ratio_curve`): ``reqs`` served once over an
    unbounded disk keeping :data:`SNAPSHOTS` states, then each smaller size continued from
    the latest state whose peak bytes fit it.  ``start(size)``: a fresh engine and index
    over a disk of ``size`` bytes; ``disk_of``: the index's budgeted disk (observed before,
    told :meth:`BudgetedIndex.idle` after each request); ``result(engine, index, size,
    unbounded run's served tokens)``: a point (``size`` None: the unbounded run)."""

    def serve(engine: EngineT, index: IndexT, first: int) -> None:
        disk = disk_of(index)
        for req, all_hashes in reqs[first:]:
            disk.observe(all_hashes)
            engine.serve(req, all_hashes)
            disk.idle()  # no store pending: the rule's disk strands nothing

    # The unbounded run, keeping (peak bytes so far, requests served, state) snapshots.
    engine, index = start(2**62)
    stride = max(1, -(-len(reqs) // SNAPSHOTS))
    snapshots: list[tuple[int, int, bytes]] = []
    disk = disk_of(index)
    for i, (req, all_hashes) in enumerate(reqs):
        if i and i % stride == 0:
            snapshots.append((disk.disk.peak_bytes, i,
                              pickle.dumps((engine, index), pickle.HIGHEST_PROTOCOL)))
        disk.observe(all_hashes)
        engine.serve(req, all_hashes)
        disk.idle()
    peak = disk.disk.peak_bytes
    served = engine.tally.gpu_hit + engine.tally.offload_hit
    unbounded = result(engine, index, None, served)
    if isinstance(sizes, int):
        if sizes < 1:
            raise ValueError(f"{name}: sizes must be >= 1 points, got {sizes}")
        sizes = [max(1, peak * k // sizes) for k in range(1, sizes + 1)]

    out = []
    for size in sizes:
        if size >= peak:
            out.append(replace(unbounded, budget_bytes=size))
            continue
        snap = next((s for s in reversed(snapshots) if s[0] <= size), None)
        if snap is None:
            engine, index = start(size)
            first = 0
        else:
            engine, index = pickle.loads(snap[2])
            disk_of(index).budget = size
            first = snap[1]
        serve(engine, index, first)
        out.append(result(engine, index, size, served))
    return tuple(out)
