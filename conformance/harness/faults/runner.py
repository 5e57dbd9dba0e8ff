"""The synthetic model runner with the fault suite's checks: loads, reads and foreign bytes.

Loads are checked byte by byte when the :class:`~conformance.harness.faults.worker.FaultyWorker`
executes them (not in the step they are submitted).  Reads are checked against
a *shadow*: ``block id -> (group, position, prefix hash)`` of what each block
holds, updated by everything that writes KV bytes (this runner's forward pass,
executed loads, poison) -- vLLM itself never writes them.  With
``check_read_bytes`` every read is also compared byte by byte, which keeps the
shadow honest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from conformance.harness.faults.worker import POISON, FaultStats, FaultyWorker, _Job
from conformance.harness.kv_memory import flat_bytes
from conformance.harness.kv_pattern import prefix_hashes
from conformance.harness.kvdata import SyntheticModelRunner

BYTE_CHECK_LIMIT = 64 << 20
"""KV memories up to this size get every read compared byte by byte (and every load's foreign
bytes checked); larger ones (the real-model fixtures) rely on the shadow for reads."""

_POISONED = ("poison",)
_CORRUPT = ("corrupt",)

Snapshot = list[torch.Tensor]
"""Every KV storage's bytes, flat (what a load must leave unchanged outside its blocks)."""


class FaultRunner(SyntheticModelRunner):
    """:class:`conformance.harness.kvdata.SyntheticModelRunner` with checks for lazy, faulty workers
    (module doc)."""

    def __init__(self, kv_cache_config: Any, vllm_config: Any, stats: FaultStats, *,
                 check_foreign: bool | None = None, check_read_bytes: bool | None = None) -> None:
        super().__init__(kv_cache_config, vllm_config, check_loads=False)
        self.fault_stats = stats
        small = sum(s.nbytes() for s in self._storages) <= BYTE_CHECK_LIMIT
        self.check_foreign = small if check_foreign is None else check_foreign
        self.check_read_bytes = small if check_read_bytes is None else check_read_bytes
        self.worker: FaultyWorker | None = None
        self.shadow: dict[int, tuple[Any, ...]] = {}

    # -- bytes ---------------------------------------------------------------

    def _write(self, layer: Any, block_ids: list[int], positions: list[int],
               hashes: list[int]) -> None:
        super()._write(layer, block_ids, positions, hashes)
        for b, i, h in zip(block_ids, positions, hashes, strict=True):
            self.shadow[b] = (layer.group_id, i, h)

    def poison_gpu(self, gpu_spec: Any) -> None:
        for gid, block_ids, _ in self._job_blocks(gpu_spec):
            idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
            for layer in self.group_layers.get(gid, ()):
                layer.pages.index_fill_(0, idx, POISON)
            for b in block_ids:
                self.shadow[b] = _POISONED

    def snapshot(self) -> Snapshot:
        return [flat_bytes(s, self.device).clone() for s in self._storages]

    def _expected(self, layer: Any, positions: list[int], hashes: Sequence[int]) -> torch.Tensor:
        tpb = layer.tokens_per_block
        return layer.rows(positions, [hashes[(i + 1) * tpb] for i in positions])

    def _wrong_bytes(self, layers: Sequence[Any], block_ids: list[int], positions: list[int],
                     hashes: Sequence[int]) -> list[bool]:
        """Per block: does any layer's row differ from the expected bytes at its position?"""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        bad = torch.zeros(len(block_ids), dtype=torch.bool, device=self.device)
        for layer in layers:
            bad |= (layer.data.index_select(0, idx)
                    != self._expected(layer, positions, hashes)).any(dim=1)
        return bad.tolist()

    # -- loads ---------------------------------------------------------------

    def check_loaded(self, worker: FaultyWorker, job: _Job, snapshot: Snapshot | None) -> None:
        """The blocks ``job`` loaded hold the expected bytes of its request; nothing else moved."""
        hashes = prefix_hashes(job.tokens)
        storage_index = {s.data_ptr(): k for k, s in enumerate(self._storages)}
        for gid, block_ids, positions in self._job_blocks(job.dst):
            self.fault_stats.loaded_blocks_checked += len(block_ids)
            if snapshot is not None:
                idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
                self._forgive(worker.inner, gid, idx, snapshot, storage_index)
            self._check_loaded_group(job, gid, block_ids, positions, hashes)
        if snapshot is not None:
            self._check_foreign_bytes(job, snapshot)

    def _check_loaded_group(self, job: _Job, gid: int, block_ids: list[int],
                            positions: list[int], hashes: Sequence[int]) -> None:
        st_ = self.fault_stats
        layers = self.group_layers[gid]
        tpb = layers[0].tokens_per_block
        if (positions[-1] + 1) * tpb > len(job.tokens):
            st_.corrupted_loads += len(block_ids)
            st_.fail(f"load job {job.job_id} ({job.req_id}) group {gid} loads position "
                     f"{positions[-1]}, past the request's {len(job.tokens)} tokens")
            for b in block_ids:
                self.shadow[b] = _CORRUPT
            return
        flags = self._wrong_bytes(layers, block_ids, positions, hashes)
        for b, i, wrong in zip(block_ids, positions, flags, strict=True):
            self.shadow[b] = _CORRUPT if wrong else (gid, i, hashes[(i + 1) * tpb])
        if any(flags):
            k = flags.index(True)
            st_.fail(f"load job {job.job_id} ({job.req_id}) group {gid}: block {block_ids[k]} "
                     f"at position {positions[k]} holds wrong bytes")
        st_.corrupted_loads += sum(flags)

    def _check_foreign_bytes(self, job: _Job, snapshot: Snapshot) -> None:
        for before, storage in zip(snapshot, self._storages, strict=True):
            after = flat_bytes(storage, self.device)
            if not torch.equal(before, after):
                n = int((before != after).sum())
                self.fault_stats.foreign_bytes_changed += n
                self.fault_stats.fail(
                    f"load job {job.job_id}: {n} bytes outside its blocks changed"
                )

    # -- driver hooks --------------------------------------------------------

    def before_start_load_kv(self, session: Any, so: Any) -> None:
        self.stats.steps += 1
        self._snapshots = None
        cs = session.connector_scheduler
        for req_id in so.preempted_req_ids or ():
            status = cs._req_status.get(req_id)
            if status is not None and status.transfer_jobs:
                self.fault_stats.count("preemptions_in_flight")

    def execute_model(self, session: Any, so: Any) -> None:
        # Writes first: vLLM caches a block when it is *scheduled*, so another request
        # of the same batch may attend to it in the very forward pass that fills it.
        super().execute_model(session, so)
        self.check_reads(session, so)
        live = session.scheduler.requests
        for req_id in [r for r in self._hashes if r not in live]:
            del self._hashes[req_id]

    # -- reads ---------------------------------------------------------------

    def check_reads(self, session: Any, so: Any) -> None:
        """Every complete, non-null block a scheduled request attends to holds its expected bytes.

        Called after the step's writes: the blocks of positions before the
        request's first token of this step (loaded, prefix-cache hits, computed
        earlier or by another request of this batch).
        """
        failed = self.worker.failed_load_reqs if self.worker is not None else set()
        for req_id, n in so.num_scheduled_tokens.items():
            req = session.scheduler.requests[req_id]
            before = int(req.num_computed_tokens) - int(n)
            if before <= 0:
                continue
            hashes = self.hashes(req_id, req.all_token_ids[:before])
            table = session.block_ids(req_id)
            for gid, layers in self.group_layers.items():
                if layers[0].is_mamba:
                    continue
                tpb = layers[0].tokens_per_block
                chosen = [(b, i) for i, b in enumerate(table[gid][: before // tpb]) if b != 0]
                if chosen:
                    self._check_group_reads(session.step_no, req_id, gid, chosen, hashes,
                                            recomputed=req_id in failed)

    def _check_group_reads(self, step_no: int, req_id: str, gid: int,
                           chosen: list[tuple[int, int]], hashes: Sequence[int], *,
                           recomputed: bool) -> None:
        """``chosen``: the ``(block id, position)`` s one request reads in one group."""
        st_ = self.fault_stats
        layers = self.group_layers[gid]
        tpb = layers[0].tokens_per_block
        st_.blocks_read_checked += len(chosen)
        if recomputed:
            st_.recomputed_blocks_checked += len(chosen)
        wrong = [(b, i) for b, i in chosen if self.shadow.get(b) != (gid, i, hashes[(i + 1) * tpb])]
        if self.check_read_bytes:
            flags = self._wrong_bytes(layers, [b for b, _ in chosen], [i for _, i in chosen],
                                      hashes)
            by_bytes = {chosen[k] for k, x in enumerate(flags) if x}
            if by_bytes != set(wrong):
                st_.fail(f"step {step_no}: the shadow ({sorted(wrong)}) and the "
                         f"bytes ({sorted(by_bytes)}) disagree for {req_id} group {gid}")
            wrong = sorted(set(wrong) | by_bytes)
        if wrong:
            b, i = wrong[0]
            st_.fail(f"step {step_no}: {req_id} reads group {gid} block {b} at "
                     f"position {i} holding {self.shadow.get(b)!r}")
        st_.corrupted_reads += len(wrong)
