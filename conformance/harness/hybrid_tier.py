"""kvchunk's budgeted file tier on a real hybrid fixture, for the lanes that run one.

The eviction-economics lane (:mod:`conformance.lanes.test_tiered_eviction_economics`)
and the hybrid soak (:mod:`conformance.lanes.test_tiered_soak_hybrid`) open the same
engine: a stored model fixture (gemma-4-31B-it TP2, DeepSeek-V4-Flash TP4) shrunk to
run on CPU, kvchunk's connector and ``KvchunkTieringOffloadingSpec`` with a byte
budget and the eviction rule ``reachable``, vLLM's CPU tier in front
(:func:`tier_driver`); and they step it the same way, the file tier's I/O drained
after every engine step (:func:`run_drained`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from conformance.harness import tiered as T

__all__ = ["RETENTION", "run_drained", "tier_driver"]

RETENTION = 0
"""vLLM's default ``prefix_cache_retention_interval`` (sparse)."""


def tier_driver(fixture: str, root: Path, *, layout: str, disk_bytes: int, num_cpu_chunks: int,
                num_gpu_blocks: int, block_size: int = 512) -> Any:
    """A :class:`~conformance.harness.driver.VllmDriver` of ``fixture`` at ``block_size``
    over kvchunk's file tier under ``root`` (``layout``, eviction ``reachable``) whose
    files may take ``disk_bytes``: the tier's ``disk_bytes_to_use`` adds its ledger's
    reserve (:func:`vllm_adapter.disk.ledger.budget_for_files`: the journal, the lock and
    the leases are inside the budget), behind a CPU tier of ``num_cpu_chunks`` chunks."""
    from conformance.harness import safe_fs_faults as SF
    from conformance.harness.fixture_runs import fixture_driver
    from vllm_adapter.disk.ledger import budget_for_files
    from vllm_adapter.names import KVCHUNK_CONNECTOR, connector_module

    spec = SF.kvchunk_tiering_spec(root, layout=layout,
                                   disk_bytes_to_use=budget_for_files(disk_bytes),
                                   eviction="reachable")
    return fixture_driver(
        fixture, {"block_size": block_size}, num_gpu_blocks=num_gpu_blocks,
        num_cpu_chunks=num_cpu_chunks, connector=KVCHUNK_CONNECTOR,
        connector_module_path=connector_module(KVCHUNK_CONNECTOR), spec=spec,
        retention_interval=RETENTION,
    )


def run_drained(session: Any, *, max_seconds: float = 300.0) -> None:
    """:func:`conformance.harness.tiered.run_until_idle`, draining the file tier's I/O after
    every step: each cascade (store) and promotion (load) a step submits is done before
    the next step, so stores reserve in job order, each one written before the next
    reserves, as the reference's prediction models.  (With vLLM's I/O threads left to
    run, a request's next cascade can reserve while its last file is still being
    written; a file being written cannot be evicted, so the rule takes another: the
    reference does not model overlapping stores.)"""
    deadline = time.monotonic() + max_seconds
    while session.has_work():
        if time.monotonic() > deadline:
            raise RuntimeError(f"still busy after {max_seconds:.0f} s of steps")
        session.step()
        T.drain_files(session)
        if not session.scheduler.running:
            time.sleep(0.002)
