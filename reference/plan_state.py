"""What the planner remembers per request and per job (:mod:`reference.plan`'s state)."""

from __future__ import annotations

from dataclasses import dataclass, field

from reference.keys import group_keys, make_key
from reference.knobs import Chunking


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
