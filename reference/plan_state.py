"""What the planner remembers per request and per job (:mod:`reference.plan`'s state),
and the jobs it builds from a request's block tables."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from reference.jobs import LoadJob, StoreJob
from reference.keys import group_keys, make_key
from reference.knobs import Chunking
from reference.mathutil import cdiv
from reference.plan_inputs import BlockRef


@dataclass
class GroupState:
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    """The group's block table for the request; 0 is the null block."""
    next_stored_chunk: int = 0


@dataclass
class RequestState:
    req_id: str
    num_prompt_tokens: int
    groups: tuple[GroupState, ...]
    max_load_tokens: int | None = None
    max_offload_tokens: int | None = None
    num_tokens: int = 0
    block_hashes: tuple[bytes, ...] = ()
    computed_tokens: int = 0
    jobs: set[int] = field(default_factory=set)
    finished: bool = False
    finished_signaled: bool = False
    load_failed: bool = False


@dataclass
class JobRecord:
    req_id: str
    keys: tuple[bytes, ...]
    is_store: bool


def update_keys(chunking: Chunking, req: RequestState) -> None:
    """Keys are append-only: chunk i is keyed once its last hash unit is hashed (a
    request whose hashes changed under its last keyed chunk is refused)."""
    for gc, state in zip(chunking.groups, req.groups, strict=True):
        known = len(state.keys)
        hpc = gc.hashes_per_chunk
        if known and (
            len(req.block_hashes) < known * hpc
            or make_key(req.block_hashes[known * hpc - 1], gc.group.index) != state.keys[-1]
        ):
            raise ValueError(f"request {req.req_id}: block hashes changed under keyed chunks")
        state.keys.extend(group_keys(req.block_hashes[known * hpc :], gc))


def load_job_of(
    chunking: Chunking, req: RequestState, blocks: Sequence[Sequence[BlockRef]],
    num_external_tokens: int,
) -> LoadJob:
    """The load of ``num_external_tokens`` past the request's GPU hit into ``blocks`` (per
    KV-cache group, original index): each group from its first fresh (non-null, unhashed)
    block past the GPU hit.  Loaded chunks are not stored again."""
    computed = req.computed_tokens
    end = computed + num_external_tokens
    keys: list[bytes] = []
    block_ids: list[int] = []
    group_sizes: list[int] = []
    block_indices: list[int] = []
    for gc, state in zip(chunking.groups, req.groups, strict=True):
        table = blocks[gc.group.index]
        tpb, bpc = gc.group.tokens_per_block, gc.blocks_per_chunk
        num_blocks = cdiv(end, tpb)
        if len(table) < num_blocks or computed % tpb:
            raise ValueError(f"request {req.req_id}: block table too short for the load")
        start = next(
            (
                i
                for i in range(cdiv(computed, tpb), num_blocks)
                if not table[i].is_null and not table[i].has_block_hash
            ),
            num_blocks,
        )
        pending = num_blocks - start
        if gc.window_in_chunks is not None and pending > gc.window_in_chunks * bpc + 1:
            raise ValueError(f"request {req.req_id}: window load larger than the window")
        num_chunks = cdiv(end, gc.tokens_per_chunk)
        if pending:
            keys.extend(state.keys[start // bpc : num_chunks])
        block_ids.extend(b.block_id for b in table[start:num_blocks])
        group_sizes.append(pending)
        block_indices.append(start)
        state.next_stored_chunk = num_chunks
    return LoadJob(
        req_id=req.req_id,
        computed_tokens=computed,
        hit_tokens=num_external_tokens,
        keys=tuple(keys),
        block_ids=tuple(block_ids),
        group_sizes=tuple(group_sizes),
        block_indices=tuple(block_indices),
    )


def store_job_of(
    chunking: Chunking, req: RequestState, offered: Sequence[bytes], to_store: set[bytes],
    ranges: Sequence[tuple[int, int]], placeholders: bool,
) -> StoreJob:
    """The store of the offered keys the store accepted, blocks group-major over each
    group's ``(start, stop)`` chunk range; a null block inside a stored chunk is kept as a
    placeholder or skipped (``placeholders``).  Each group's next chunk moves past its range."""
    block_ids: list[int] = []
    group_sizes: list[int] = []
    block_indices: list[int] = []
    for gc, state, (start, num_chunks) in zip(chunking.groups, req.groups, ranges, strict=True):
        bpc = gc.blocks_per_chunk
        count, first = 0, None
        for k in range(start, num_chunks):
            if state.keys[k] not in to_store:
                continue
            for j in range(k * bpc, (k + 1) * bpc):
                if state.block_ids[j] == 0 and not placeholders:
                    continue
                if first is None:
                    first = j
                block_ids.append(state.block_ids[j])
                count += 1
        group_sizes.append(count)
        block_indices.append(first or 0)
        state.next_stored_chunk = max(state.next_stored_chunk, num_chunks)
    return StoreJob(
        req_id=req.req_id,
        keys=tuple(k for k in offered if k in to_store),
        block_ids=tuple(block_ids),
        group_sizes=tuple(group_sizes),
        block_indices=tuple(block_indices),
    )


def boundary_store_job(
    chunking: Chunking, req_id: str, position: int, key: bytes, block_id: int, boundary: int
) -> StoreJob:
    """The store of one Mamba-align state handed over at ``boundary`` (group at
    ``position``): the block holding the boundary's last token."""
    sizes = [0] * len(chunking.groups)
    indices = [0] * len(chunking.groups)
    sizes[position] = 1
    indices[position] = boundary // chunking.groups[position].group.tokens_per_block - 1
    return StoreJob(req_id, (key,), (block_id,), tuple(sizes), tuple(indices))
