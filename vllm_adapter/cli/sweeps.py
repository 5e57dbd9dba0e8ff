"""``--sweep``: the chosen knob's figures across knob values (the computation is
:func:`vllm_adapter.planning.sweep_inputs` and :func:`vllm_adapter.economics.sweep`)."""

from __future__ import annotations

from dataclasses import replace

from reference.knobs import BLOCK_SIZE, BLOCKS_PER_CHUNK
from reference.packed_split import LoadSplit
from reference.plan import Policy
from reference.workload import Workload
from vllm_adapter.cli.args import CliError, Request
from vllm_adapter.cli.economics import plot_sweep
from vllm_adapter.disk_model import FsModel
from vllm_adapter.economics import sweep
from vllm_adapter.planning import CpuRow, PlannedEngine, sweep_inputs
from vllm_adapter.results import Sweep

__all__ = ["knob_sweep"]


def knob_sweep(
    request: Request,
    engine: PlannedEngine,
    row: CpuRow,
    workload: Workload,
    policy: Policy,
    models: tuple[FsModel, ...],
    title: str,
    load_split: LoadSplit | None = None,
) -> Sweep | None:
    if not request.sweep:
        return None
    knob_name = BLOCK_SIZE if BLOCK_SIZE in request.knob_extra else BLOCKS_PER_CHUNK
    points, skipped = sweep_inputs(engine, knob_name, row)
    if not points:
        raise CliError(
            f"--sweep: no {knob_name} value is valid here ({skipped[0] if skipped else ''})"
        )
    result = sweep(knob_name, points, skipped, workload, policy, models, load_split)
    if request.plot is not None and not request.sweep_disk:
        plot_sweep(result, request.plot, title)
        result = replace(result, plot=str(request.plot))
    return result
