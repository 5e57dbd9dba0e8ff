"""A tiny engine for reference-only properties: block tables, KV bytes, a chunk pool.

It is not vLLM: it allocates a request's whole block table up front, prefills
in fixed token budgets, and nulls the out-of-window blocks of a load the way
vLLM's windowed managers do.  The loop is the economics engine's
(:class:`reference.economics.Engine`, one loop over :class:`reference.plan.Planner`
for both); this subclass gives it a bounded chunk store, GPU tensors, and jobs
executed with :mod:`reference.transfer` over real tensors, and checks bytes.  The conformance lanes use vLLM's real
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

from reference.economics import Engine
from reference.jobs import LoadJob, StoreJob
from reference.keys import prefix_block_hashes
from reference.knobs import Chunking, GroupChunking
from reference.mathutil import cdiv
from reference.plan import Policy
from reference.rules import first_kept_block
from reference.store import ChunkStore
from reference.transfer import TensorRef, TransferLayout, gather, scatter
from reference.workload import WorkloadRequest


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


class SimEngine(Engine):
    """Single-worker engine over a :class:`Chunking`, one tensor per (group, layer)."""

    def __init__(
        self,
        chunking: Chunking,
        num_slots: int = 256,
        policy: Policy | None = None,
        blocks_per_group: int = 4096,
    ) -> None:
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
        # No junctions: the simulator's requests share no pinned prefix.
        super().__init__(chunking, policy or Policy(), 0, self.store, pin_junctions=False)
        self.blocks_per_group = blocks_per_group
        self.failed_store_keys: set[bytes] = set()
        self.requests: dict[str, SimRequest] = {}
        self._fail_store: set[int] = set()
        self._current: SimRequest | None = None

    # -- allocation and content -------------------------------------------

    def _allocate(self, gc: GroupChunking, n: int) -> list[int]:
        if self.next_block + n > self.blocks_per_group:
            raise MemoryError("sim engine out of GPU blocks")
        return super()._allocate(gc, n)

    def _table_tokens(self, prompt_tokens: int, total_tokens: int) -> int:
        return prompt_tokens  # the sampled token gets no block

    def expected_block(self, req: SimRequest, i: int, layer: int, position: int) -> bytes:
        gc = self.chunking.groups[i]
        page = self.layout.page_bytes[self.tensor_of[(i, layer)]]
        end = (position + 1) * gc.group.tokens_per_block
        return block_bytes(gc.group.index, layer, req.tokens, end, page)

    def _allocated(self, req_id: str, tables: Sequence[Sequence[int]]) -> None:
        self.requests[req_id].tables = {
            gc.group.index: list(tables[gc.group.index]) for gc in self.chunking.groups
        }

    def _computing(self, req_id: str, tables: Sequence[Sequence[int]], start: int,
                   end: int) -> None:
        self._write_computed(self.requests[req_id], start, end)

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

    def _run_store(self, job_id: int, job: StoreJob) -> bool:
        gather(
            self.layout, self.gpu, self._pool, job.block_ids, job.group_sizes,
            job.block_indices, self._slots(job.keys),
        )
        fail = job_id in self._fail_store
        if fail:
            self.failed_store_keys.update(job.keys)
        return not fail

    def _run_load(self, req_id: str, load: LoadJob) -> None:
        scatter(
            self.layout, self.gpu, self._pool, load.block_ids, load.group_sizes,
            load.block_indices, self._slots(load.keys),
        )
        req = self.requests[req_id]
        req.loaded = load
        req.after_load = [t.clone() for t in self.gpu]

    # -- a request's life ---------------------------------------------------

    def run_request(
        self,
        req_id: str,
        tokens: Sequence[int],
        budget: int,
        fail_store: set[int] | None = None,
    ) -> SimRequest:
        """Admit, look up, load, prefill in ``budget``-token steps, finish (one sampled token)."""
        req = SimRequest(req_id, list(tokens))
        self.requests[req_id] = req
        self.budget = budget
        self._fail_store = fail_store or set()
        hashes = tuple(prefix_block_hashes(tokens, self.chunking.tokens_per_hash))
        # One sampled token (never stored, no block); the GPU prefix cache stays cold.
        self.serve(WorkloadRequest(0, 0, tuple(tokens), (0,), 0), hashes, req_id=req_id)
        return req

    def planner_last_job(self, req_id: str) -> int:
        jobs = self.planner.pending_jobs(req_id)
        assert len(jobs) == 1
        return next(iter(jobs))
