"""Harness of the faults lane's sharing cases: engines of two parallel configurations on one root.

A stored fixture is one engine's planning (DeepSeek-V4-Flash at TP4, gemma-4 at TP2);
:func:`with_tp_size` turns its driver into the same model's engine at another
tensor-parallel size, so two engines of one model and two TP sizes can run over one
``root_dir`` (``conformance/lanes/test_tiered_sharing.py``):

* :func:`with_tp_size`: the engine's ``ParallelConfig`` at another TP size (and
  ``kv_tp_replicas`` where every TP rank held a replica), KV-cache tensors unchanged;
* :func:`tier_spec`: the offloading spec vLLM built for a session (what says
  ``replicated_layout``);
* :func:`data_files`: the chunk and packed files under a root, with their inodes (a
  rewrite is a new inode: files are written aside and renamed over);
* :func:`namespaces`: the namespace directories kvchunk's tier made under a root;
* :func:`serve`: one request to completion, its file I/O drained;
* :class:`Engines`: a fixture case's engines over one root, opened on demand (kvchunk's
  tier, ``--spec``'s if it chose one with that tier), all shut down on exit.
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from conformance.harness import safe_fs_faults as SF
from conformance.harness import spec_option
from conformance.harness import tiered as T
from conformance.harness.fixture_runs import FixtureCase
from conformance.harness.kvdata import SyntheticModelRunner
from conformance.protocol.trace import RequestSpec

__all__ = ["Engines", "data_files", "namespaces", "serve", "tier_spec", "with_tp_size"]


def with_tp_size(driver: Any, tp_size: int) -> Any:
    """``driver`` as the same model's engine at ``tp_size`` (rank 0; the world size derived
    as vLLM's ``ParallelConfig`` does: TP x PP x PCP).

    The KV-cache configs are kept: right for a model whose KV is replicated across TP
    ranks (MLA: DeepSeek-V4's latent KV is one head, ``kv_tp_replicas`` equal to the TP
    size, so every rank holds the whole latent KV and a rank's KV bytes per block do not
    depend on the TP size); ``kv_tp_replicas`` follows the TP size where it was equal to
    it (one replica per rank), as vLLM plans it.  For a model whose KV heads are sharded
    across ranks (gemma-4) the engine at another TP size would hold other per-rank pages;
    kept as they are, its pages still differ from the fixture's engine's in the parallel
    sizes and the per-rank layout of vLLM's CPU tier, which is all a namespace check needs.

    Rank 0: the engine core, where vLLM's scheduler side (and so the file tier) runs, has
    rank 0 in every engine; and the driver's one in-process worker stands for every rank,
    so it must be the replicated layout's store writer, rank 0 (vLLM's
    ``OffloadingConnectorWorker`` lets only rank 0 of a replicated layout write stores).
    """
    vllm_config = copy.copy(driver.vllm_config)
    parallel = copy.copy(vllm_config.parallel_config)
    old = int(parallel.tensor_parallel_size)
    parallel.tensor_parallel_size = tp_size
    parallel.world_size = tp_size * int(parallel.pipeline_parallel_size) * int(
        parallel.prefill_context_parallel_size
    )
    parallel.rank = 0
    vllm_config.parallel_config = parallel
    driver.vllm_config = vllm_config
    for kvc in {id(c): c for c in (driver.kv_cache_config, driver.worker_kv_cache_config)}.values():
        if int(kvc.kv_tp_replicas) == old:
            kvc.kv_tp_replicas = tp_size
    return driver


def tier_spec(session: Any) -> Any:
    """The offloading spec vLLM built for ``session`` (its worker side's)."""
    return session.worker_connector.connector_worker.spec


def data_files(root: Path) -> dict[str, int]:
    """Every chunk file (vLLM's ``FileMapper`` names) and packed file under ``root``: its inode."""
    return {str(p): p.stat().st_ino for p in (*T.block_files(root), *SF.packed_files(root))}


def namespaces(root: Path) -> list[str]:
    """The namespace directories kvchunk's tier made under ``root``."""
    return sorted(p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("kvchunk-v"))


def serve(session: Any, req_id: str, prompt: tuple[int, ...], max_seconds: float = 120.0) -> None:
    """Serve ``prompt`` to completion (two tokens) and wait for the file tier's I/O.

    A packed tier's lookups answer from its index, which its follower thread brings up to
    date with other engines' files within ``POLL_SECONDS``; the engine catches up first
    (what the follower does), so the lane does not race that bound."""
    tier = SF.tier_of(session)
    if tier.layout == "packed":
        tier._follow_ledger(force=True)
    session.add_request(RequestSpec(req_id, prompt, max_tokens=2))
    T.run_until_idle(session, max_seconds=max_seconds)
    T.drain_files(session)


class Engines:
    """``case``'s engines over kvchunk's file tier at ``root`` (``layout``), opened on demand
    (a fresh engine: empty GPU prefix cache and CPU tier); every one is shut down on exit."""

    def __init__(self, case: FixtureCase, root: Path, layout: str) -> None:
        self.case = case
        self.spec = spec_option.tiered_lane_entries(SF.kvchunk_tiering_spec(root, layout=layout))
        self.opened: list[tuple[Any, SyntheticModelRunner]] = []

    def open(self, tp_size: int | None = None) -> tuple[Any, SyntheticModelRunner]:
        """An engine of the fixture's parallel configuration, or at ``tp_size`` (:func:`with_tp_size`)."""
        driver = self.case.driver(spec=self.spec)
        if tp_size is not None:
            driver = with_tp_size(driver, tp_size)
        engine = T.open_session(driver, self.case.workload_budget)
        self.opened.append(engine)
        return engine

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for session, _ in self.opened:
            T.shutdown(session)
