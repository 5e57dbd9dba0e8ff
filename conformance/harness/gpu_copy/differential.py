"""The copy differential: vLLM's worker and the reference worker over the same KV tensors."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from conformance.harness.kv_memory import flat_bytes
from reference.transfer import TransferLayout

from .jobs import Job
from .slots import SubSlot, job_sub_slots
from .tiers import (
    ReferenceTier,
    Tier,
    compare_sub_slots,
    compare_tiers,
    copy_tier,
    first_difference,
)

__all__ = ["CopyDifferential", "CopyStats"]


@dataclass
class CopyStats:
    stores: int = 0
    loads: int = 0
    sub_slot_bytes_compared: int = 0
    tier_bytes_compared: int = 0
    gpu_bytes_compared: int = 0
    gpu_rows_loaded: int = 0
    """Destination rows whose bytes a load changed (the loads did something)."""
    failures: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (
            f"{self.stores} stores, {self.loads} loads; compared {self.sub_slot_bytes_compared} "
            f"written sub-slot bytes, {self.tier_bytes_compared} tier bytes, "
            f"{self.gpu_bytes_compared} GPU bytes; {self.gpu_rows_loaded} GPU rows changed by loads; "
            f"{len(self.failures)} failures" + "".join(f"\n  {f}" for f in self.failures[:8])
        )


class CopyDifferential:
    """Run jobs through vLLM's worker and the reference worker on the same KV tensors; compare.

    ``kv_caches`` is the ``CanonicalKVCaches`` both workers were built on;
    ``ref_worker`` a :class:`vllm_adapter.spec.ReferenceOffloadingWorker`;
    ``vllm_worker`` anything with vLLM's ``OffloadingWorker`` methods
    (``CPUOffloadingWorker`` on CUDA, ``EmulatedVllmWorker`` of ``tests/`` on CPU) and
    ``vllm_tier`` its CPU bytes.  ``full_check_bytes``: compare the whole tiers
    after every job while they are at most this big (else only in :meth:`finish`).
    """

    def __init__(
        self,
        kv_caches: Any,
        ref_worker: Any,
        vllm_worker: Any,
        vllm_tier: Tier,
        *,
        seed: int = 0,
        full_check_bytes: int = 64 << 20,
        max_failures: int = 16,
    ) -> None:
        from vllm_adapter.spec import canonical_gpu_tensors

        self.kv_caches = kv_caches
        self.layout: TransferLayout = ref_worker.layout
        self.ref_worker = ref_worker
        self.vllm_worker = vllm_worker
        self.ref_tier = ReferenceTier(ref_worker.pool, self.layout)
        self.vllm_tier = vllm_tier
        if (vllm_tier.page_bytes, vllm_tier.blocks_per_chunk, vllm_tier.num_chunks) != (
            self.ref_tier.page_bytes,
            self.ref_tier.blocks_per_chunk,
            self.ref_tier.num_chunks,
        ):
            raise ValueError(
                f"tiers differ: vLLM pages {vllm_tier.page_bytes} x{vllm_tier.blocks_per_chunk} "
                f"{vllm_tier.num_chunks} chunks, reference {self.ref_tier.page_bytes} "
                f"x{self.ref_tier.blocks_per_chunk} {self.ref_tier.num_chunks} chunks"
            )
        self.views = canonical_gpu_tensors(kv_caches)
        self.device = self.views[0].device
        storages: dict[int, Any] = {}
        for v in self.views:
            storages.setdefault(v.untyped_storage().data_ptr(), v.untyped_storage())
        self.flats = [flat_bytes(s, self.device) for s in storages.values()]
        self._storage_index = {s.data_ptr(): k for k, s in enumerate(storages.values())}
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.cpu_generator = torch.Generator().manual_seed(seed + 1)
        self.full_check = (
            sum(p * self.ref_tier.blocks_per_chunk for p in self.layout.page_bytes)
            * self.ref_tier.num_chunks
            <= full_check_bytes
        )
        self.max_failures = max_failures
        self.stats = CopyStats()
        self._next_job_id = 1

    # -- setup -----------------------------------------------------------------

    def randomize_gpu(self) -> None:
        for f in self.flats:
            f.random_(0, 256, generator=self.generator)

    def randomize_cpu(self) -> None:
        """Random bytes in every sub-slot of the reference pool, copied into vLLM's tier."""
        self.ref_tier.pool.random_(0, 256, generator=self.cpu_generator)
        copy_tier(self.ref_tier, self.vllm_tier)

    # -- helpers ---------------------------------------------------------------

    def _fail(self, messages: Iterable[str]) -> None:
        for m in messages:
            if len(self.stats.failures) < self.max_failures:
                self.stats.failures.append(m)

    def _drain(self, worker: Any, name: str, job_id: int, what: str) -> int | None:
        results = worker.get_finished()
        ids = [r.job_id for r in results]
        if ids != [job_id]:
            self._fail([f"{what}: {name} worker reported jobs {ids}, expected [{job_id}]"])
        for r in results:
            if not r.success:
                self._fail([f"{what}: {name} worker reported failure for job {r.job_id}"])
        sizes = [r.transfer_size for r in results if r.job_id == job_id]
        return sizes[0] if sizes else None

    def _view_on(self, flats: Sequence[torch.Tensor], t: int) -> torch.Tensor:
        v = self.views[t]
        k = self._storage_index[v.untyped_storage().data_ptr()]
        return flats[k].as_strided(v.shape, v.stride(), v.storage_offset())

    # -- jobs ------------------------------------------------------------------

    def run(self, job: Job) -> None:
        job_id = self._next_job_id
        self._next_job_id += 1
        copies = job_sub_slots(self.layout, job)
        what = f"job {job_id} {job.describe()}"
        if job.kind == "store":
            self._store(job_id, job, copies, what)
        else:
            self._load(job_id, job, copies, what)
        if self.full_check:
            self.check_tiers(f"after {what}")

    def _store(self, job_id: int, job: Job, copies: list[SubSlot], what: str) -> None:
        self.stats.stores += 1
        self.vllm_worker.submit_store(job_id, *job.specs(self.kv_caches))
        self.ref_worker.submit_store(job_id, *job.specs(self.kv_caches))
        self.vllm_worker.wait({job_id})
        size_v = self._drain(self.vllm_worker, "vLLM", job_id, what)
        size_r = self._drain(self.ref_worker, "reference", job_id, what)
        if size_v != size_r:
            self._fail([f"{what}: transfer_size vLLM {size_v} != reference {size_r}"])
        compared, failures = compare_sub_slots(self.vllm_tier, self.ref_tier, copies, what)
        self.stats.sub_slot_bytes_compared += compared
        self._fail(failures)

    def _load(self, job_id: int, job: Job, copies: list[SubSlot], what: str) -> None:
        self.stats.loads += 1
        before = [f.clone() for f in self.flats]
        self.vllm_worker.submit_load(job_id, *job.specs(self.kv_caches))
        self.vllm_worker.wait({job_id})
        size_v = self._drain(self.vllm_worker, "vLLM", job_id, what)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        after_vllm = [f.clone() for f in self.flats]
        for f, b in zip(self.flats, before, strict=True):
            f.copy_(b)
        self.ref_worker.submit_load(job_id, *job.specs(self.kv_caches))
        size_r = self._drain(self.ref_worker, "reference", job_id, what)
        if size_v != size_r:
            self._fail([f"{what}: transfer_size vLLM {size_v} != reference {size_r}"])
        # Now self.flats hold the reference's result.
        dest: dict[tuple[int, int], SubSlot] = {(c.tensor, c.block_id): c for c in copies}
        failures = []
        for t in range(len(self.views)):
            got, want = self._view_on(after_vllm, t), self._view_on(self.flats, t)
            self.stats.gpu_bytes_compared += got.numel()
            old = self._view_on(before, t)
            rows = sorted({c.block_id for c in copies if c.tensor == t})
            if rows:
                idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
                self.stats.gpu_rows_loaded += int(
                    (want.index_select(0, idx) != old.index_select(0, idx)).any(1).sum()
                )
            if torch.equal(got, want):
                continue
            bad = (got != want).any(dim=1).nonzero().flatten().tolist()
            for r in bad[:4]:
                (col,), n = first_difference(got[r], want[r])
                c = dest.get((t, r))
                if c is not None:
                    where = f"{c.describe()} -> GPU block {r}"
                else:
                    who = "vLLM" if not torch.equal(got[r], old[r]) else "reference"
                    where = f"tensor {t} GPU block {r}, not a destination of this load (stray write by {who})"
                failures.append(
                    f"{what}: {where}: {n} bytes differ, first at byte offset {col} "
                    f"(vLLM 0x{int(got[r, col]):02x}, reference 0x{int(want[r, col]):02x})"
                )
        for k, (got_flat, want_flat) in enumerate(zip(after_vllm, self.flats, strict=True)):
            if not failures and not torch.equal(got_flat, want_flat):
                (pos,), n = first_difference(got_flat, want_flat)
                failures.append(
                    f"{what}: {n} KV bytes outside the canonical rows differ (KV buffer {k}, "
                    f"first at byte {pos})"
                )
        self._fail(failures)

    def check_tiers(self, what: str) -> None:
        compared, failures = compare_tiers(self.vllm_tier, self.ref_tier, what)
        self.stats.tier_bytes_compared += compared
        self._fail(failures)

    def finish(self, what: str = "at the end") -> CopyStats:
        self.check_tiers(what)
        return self.stats
