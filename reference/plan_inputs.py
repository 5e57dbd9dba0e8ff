"""The planner's inputs: its policy switches, what the engine tells it, the store it plans for.

:class:`reference.plan.Planner` re-exports every name here; the rules these
switches choose between are stated in :mod:`reference.rules`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import Protocol

from reference.rules import LastTokenRule, WindowRule
from reference.store import LookupResult, StorePlan


class NullBlockRule(Enum):
    """What a store job carries for a null block (id 0) inside a stored chunk.

    Only unreachable window blocks can be null inside a stored chunk (a reachable
    null block vetoes the chunk, see :meth:`Planner._store_job`).
    """

    PLACEHOLDER = "placeholder"
    """Intended (vLLM 0.34.0): the null block stays in the job, so every block of a
    chunk keeps its offset in the chunk (``block_indices`` is the chunk's first block)."""
    SKIP = "skip"
    """vLLM 0.33.0: null blocks are left out; ``group_sizes`` counts real blocks and
    ``block_indices`` is the first real block's position."""


@dataclass(frozen=True)
class Policy:
    """Engine settings that change plans but not chunk shapes.

    The defaults are the intended rules.  ``conformance.protocol.versions`` says which
    switches each vLLM release runs with, so the plan lane compares exactly.
    """

    retention_interval: int | None = 0
    """``prefix_cache_retention_interval``: 0 sparse (vLLM default), None dense, N > 0."""
    offload_prompt_only: bool = True
    prefix_caching: bool = True
    """GPU prefix caching on: a hit whose chunks are still being loaded is deferred."""
    last_token: LastTokenRule = LastTokenRule.REQUEST_END
    window: WindowRule = WindowRule.TOKENS_BEFORE_END
    """How many chunks a sliding-window hit needs (:class:`reference.rules.WindowRule`)."""
    null_blocks_in_store: NullBlockRule = NullBlockRule.PLACEHOLDER
    offload_junctions: bool = True
    """Intended (vLLM 0.34.0): an offload hit that windowed groups cut short of the
    full-attention end pins that end as a junction the request's stores keep
    (:func:`reference.rules.shared_prefix_junction`).  False (vLLM 0.33.0): only the
    GPU prefix cache pins junctions, so a shared prefix served from offload alone
    is recomputed by every request under sparse retention.  The Planner takes the
    junction from the engine (``ScheduledRequest.shared_prefix_boundary``); the
    economics engine (:mod:`reference.economics`) computes it with this switch."""
    reload_after_failed_load: bool = False
    """False (vLLM 0.34.0): after a failed load its request never loads from the
    offloaded cache again, preemption included, so a faulting chunk is not retried.
    True (vLLM 0.33.0): later lookups may hit and load again.  Neither serves
    wrong bytes; this is a retry policy, not a correctness rule."""


@dataclass(frozen=True)
class BlockRef:
    """A block the engine allocated for a request, as the load plan sees it."""

    block_id: int
    is_null: bool = False
    has_block_hash: bool = False
    """True when the block already holds hashed (GPU-cached) content."""


NULL_BLOCK = BlockRef(0, is_null=True)
"""A null block (a window's block the engine freed); frozen, so one reference serves all."""


@cache
def block_ref(block_id: int, has_block_hash: bool) -> BlockRef:
    """The (frozen, so shared) :class:`BlockRef` of an allocated, non-null block: an engine
    model builds one per block of every request, and a pool's block ids repeat."""
    return BlockRef(block_id, False, has_block_hash)


@dataclass(frozen=True)
class ScheduledRequest:
    """What one step tells the connector about one request."""

    req_id: str
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_hashes: tuple[bytes, ...]
    new_block_ids: tuple[tuple[int, ...], ...] | None = None
    """New block ids per KV-cache group (original index); None when unchanged."""
    is_full_table: bool = False
    """True for a new or resumed request: ``new_block_ids`` is its whole table."""
    is_finished: bool = False
    is_aborted: bool = False
    shared_prefix_boundary: int = 0


class ChunkIndex(Protocol):
    """The part of a chunk store the planner talks to (see :mod:`reference.store`)."""

    def lookup(self, key: bytes) -> LookupResult: ...

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        """Slots for the keys not held yet, or None if it cannot allocate them all."""
        ...

    def prepare_load(self, keys: Sequence[bytes]) -> object: ...

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None: ...

    def complete_load(self, keys: Sequence[bytes]) -> None: ...

    def reset(self) -> None: ...


class UnsupportedChunking(ValueError):
    """A configuration whose semantics the reference deliberately does not model."""
