"""A tiny engine for reference-only properties: block tables, KV bytes, a chunk pool.

It is not vLLM: it allocates a request's whole block table up front, prefills
in fixed token budgets, and nulls the out-of-window blocks of a load the way
vLLM's windowed managers do.  It drives :class:`reference.plan.Planner` with
the calls an engine makes, executes the jobs with :mod:`reference.transfer`
over real tensors, and checks bytes.  The conformance lanes use vLLM's real
scheduler instead; this engine lets ``nox -s tests`` pin the reference's own
properties on random geometries without vLLM.

KV content is synthetic and prefix-determined: the bytes of block ``j`` of
group ``g``, layer ``l`` are a function of ``(g, l, hash of the tokens up to
the block's end)``, so equal prefixes give equal bytes and any misplaced or
stale byte is detectable.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from reference.jobs import LoadJob, StoreJob
from reference.keys import prefix_block_hashes
from reference.knobs import Chunking, GroupChunking
from reference.mathutil import cdiv
from reference.plan import BlockRef, Planner, Policy, ScheduledRequest
from reference.rules import first_kept_block
from reference.store import ChunkStore
from reference.transfer import TensorRef, TransferLayout, gather, scatter


def block_bytes(group: int, layer: int, tokens: Sequence[int], end: int, nbytes: int) -> bytes:
    """Synthetic KV bytes of the block whose last token is ``end - 1``."""
    h = hashlib.sha256(f"{group}/{layer}/".encode())
    h.update(bytes(str(list(tokens[:end])), "ascii"))
    seed = h.digest()
    out = bytearray()
    counter = 0
    while len(out) < nbytes:
        out += hashlib.sha256(seed + counter.to_bytes(4, "little")).digest()
        counter += 1
    return bytes(out[:nbytes])


first_needed_block = first_kept_block
"""The sim's name for :func:`reference.rules.first_kept_block`."""


@dataclass
class SimRequest:
    req_id: str
    tokens: list[int]
    tables: dict[int, list[int]] = field(default_factory=dict)
    loaded: LoadJob | None = None
    after_load: list[torch.Tensor] | None = None
    """GPU tensors right after the load, before the request computes anything."""


class SimEngine:
    """Single-worker engine over a :class:`Chunking`, one tensor per (group, layer)."""

    def __init__(
        self,
        chunking: Chunking,
        num_slots: int = 256,
        policy: Policy | None = None,
        blocks_per_group: int = 4096,
    ) -> None:
        self.chunking = chunking
        groups = chunking.groups
        pages: list[int] = []
        refs: list[tuple[TensorRef, ...]] = []
        self.tensor_of: dict[tuple[int, int], int] = {}
        for i, gc in enumerate(groups):
            page = max(8, gc.group.page_bytes)
            row: list[TensorRef] = []
            for layer in range(gc.group.num_layers):
                self.tensor_of[(i, layer)] = len(pages)
                row.append(TensorRef(len(pages), page))
                pages.append(page)
            refs.append(tuple(row))
        self.layout = TransferLayout(
            tuple(pages), tuple(refs), tuple(gc.blocks_per_chunk for gc in groups)
        )
        self.gpu = [torch.zeros(blocks_per_group, p, dtype=torch.uint8) for p in pages]
        self.store = ChunkStore(num_slots, slot_bytes=self.layout.slot_bytes)
        self.planner = Planner(chunking, self.store, policy or Policy())
        self.next_block = 1  # one block pool for all groups, as in vLLM; 0 is the null block
        self.num_groups = max(gc.group.index for gc in groups) + 1
        self.blocks_per_group = blocks_per_group
        self.failed_store_keys: set[bytes] = set()
        self.requests: dict[str, SimRequest] = {}

    # -- allocation and content -------------------------------------------

    def _alloc(self, gc: GroupChunking, n: int) -> list[int]:
        start = self.next_block
        if start + n > self.blocks_per_group:
            raise MemoryError("sim engine out of GPU blocks")
        self.next_block = start + n
        return list(range(start, start + n))

    def expected_block(self, req: SimRequest, i: int, layer: int, position: int) -> bytes:
        gc = self.chunking.groups[i]
        page = self.layout.page_bytes[self.tensor_of[(i, layer)]]
        end = (position + 1) * gc.group.tokens_per_block
        return block_bytes(gc.group.index, layer, req.tokens, end, page)

    def _write_computed(self, req: SimRequest, start_token: int, end_token: int) -> None:
        """The model computes tokens [start, end): write every block that ends inside."""
        for i, gc in enumerate(self.chunking.groups):
            tpb = gc.group.tokens_per_block
            table = req.tables[gc.group.index]
            for position in range(start_token // tpb, cdiv(end_token, tpb)):
                if position >= len(table) or table[position] == 0:
                    continue
                for layer in range(gc.group.num_layers):
                    t = self.tensor_of[(i, layer)]
                    data = self.expected_block(req, i, layer, position)
                    self.gpu[t][table[position]] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    # -- jobs -------------------------------------------------------------

    def _slots(self, keys: Sequence[bytes]) -> list[int]:
        slots = [self.store.slot_of(k) for k in keys]
        missing = [k for k, s in zip(keys, slots, strict=True) if s is None]
        if missing:
            raise KeyError(f"chunks not in the store: {missing!r}")
        return [s for s in slots if s is not None]

    @property
    def _pool(self) -> torch.Tensor:
        assert self.store.pool is not None, "the simulator's store owns its pool"
        return self.store.pool

    def _run_store(self, job_id: int, job: StoreJob, fail: bool) -> None:
        gather(
            self.layout, self.gpu, self._pool, job.block_ids, job.group_sizes,
            job.block_indices, self._slots(job.keys),
        )
        if fail:
            self.failed_store_keys.update(job.keys)
        self.planner.job_done(job_id, success=not fail)

    # -- a request's life ---------------------------------------------------

    def run_request(
        self,
        req_id: str,
        tokens: Sequence[int],
        budget: int,
        fail_store: set[int] | None = None,
    ) -> SimRequest:
        """Admit, look up, load, prefill in ``budget``-token steps, finish."""
        req = SimRequest(req_id, list(tokens))
        self.requests[req_id] = req
        n = len(tokens)
        hashes = tuple(prefix_block_hashes(tokens, self.chunking.tokens_per_hash))
        self.planner.new_request(req_id, n)
        hit = self.planner.lookup(req_id, hashes, n, 0) or 0
        blocks: list[list[BlockRef]] = [[] for _ in range(self.num_groups)]
        for gc in self.chunking.groups:
            count = cdiv(n, gc.group.tokens_per_block)
            ids = self._alloc(gc, count)
            if hit and gc.window_in_chunks is not None:
                for j in range(first_needed_block(gc, hit)):
                    ids[j] = 0
            req.tables[gc.group.index] = ids
            blocks[gc.group.index] = [BlockRef(b, is_null=b == 0) for b in ids]
        load = self.planner.allocated(req_id, blocks, hit)
        if load is not None:
            scatter(
                self.layout, self.gpu, self._pool, load.block_ids, load.group_sizes,
                load.block_indices, self._slots(load.keys),
            )
            req.loaded = load
            req.after_load = [t.clone() for t in self.gpu]
            self.planner.job_done(self.planner_last_job(req_id), success=True)
        done = hit
        step = 0
        while done < n:
            todo = min(budget, n - done)
            self._write_computed(req, done, done + todo)
            info = ScheduledRequest(
                req_id=req_id,
                num_prompt_tokens=n,
                num_tokens=n,
                num_computed_tokens=done,
                num_scheduled_tokens=todo,
                block_hashes=hashes,
                new_block_ids=(
                    tuple(tuple(req.tables.get(g, ())) for g in range(self.num_groups))
                    if step == 0
                    else None
                ),
                is_full_table=step == 0,
            )
            for job_id, job in self.planner.step([info]):
                self._run_store(job_id, job, fail=bool(fail_store and job_id in fail_store))
            done += todo
            step += 1
        finished = ScheduledRequest(
            req_id=req_id, num_prompt_tokens=n, num_tokens=n + 1, num_computed_tokens=n,
            num_scheduled_tokens=0, block_hashes=hashes, is_finished=True,
        )
        for job_id, job in self.planner.step([], finished=[finished]):
            self._run_store(job_id, job, fail=bool(fail_store and job_id in fail_store))
        return req

    def planner_last_job(self, req_id: str) -> int:
        jobs = self.planner.pending_jobs(req_id)
        assert len(jobs) == 1
        return next(iter(jobs))
