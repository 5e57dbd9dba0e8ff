"""KV-cache geometry: the offloaded groups, as the reference sees them.

A *group* is one KV-cache group of vLLM's ``KVCacheConfig`` that the offloading
connector moves (prefix-cacheable, transfer-enabled).  Its ``index`` is the
original position in ``kv_cache_groups``: keys and block tables are addressed
by it, so it stays stable even when other groups are not offloaded.

Nothing here knows about chunks; :mod:`reference.knobs` turns a geometry plus a
user knob into a :class:`reference.knobs.Chunking`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class GroupKind(StrEnum):
    """How a group's attention reaches back, which decides what a hit needs."""

    FULL = "full"
    """Full attention (also MLA, sink, RSWA): a hit needs every chunk of the prefix."""
    SLIDING_WINDOW = "sliding_window"
    """Sliding window (also sliding-window MLA): a hit needs the last window of chunks."""
    CHUNKED_LOCAL = "chunked_local"
    """Chunked-local attention: a hit needs the chunks of the current attention chunk."""
    MAMBA_ALIGN = "mamba_align"
    """Mamba in ``align`` cache mode: state is offloaded only at boundary hand-offs."""
    MAMBA = "mamba"
    """Mamba in any other cache mode: one state chunk per boundary, stored like SWA."""

    @property
    def windowed(self) -> bool:
        """True when a hit needs only a bounded suffix of chunks (not the whole prefix)."""
        return self is not GroupKind.FULL


@dataclass(frozen=True)
class KVGroup:
    """One offloaded KV-cache group.

    ``tokens_per_block`` is already scaled by decode-context parallelism
    (vLLM's ``resolve_dcp_kv_block_size``).  ``page_bytes`` is the per-layer,
    per-worker page; ``num_layers`` the number of layers in the group.
    """

    index: int
    kind: GroupKind
    tokens_per_block: int
    page_bytes: int = 0
    num_layers: int = 1
    sliding_window: int | None = None
    extra_retained_tokens: int = 0
    attention_chunk_size: int | None = None
    is_eagle: bool = False

    def __post_init__(self) -> None:
        where = self.describe()
        if self.index < 0:
            raise ValueError(f"{where}: group index must be >= 0")
        if self.tokens_per_block <= 0:
            raise ValueError(f"{where}: tokens_per_block must be > 0")
        if self.kind is GroupKind.SLIDING_WINDOW and (
            self.sliding_window is None or self.sliding_window <= 0
        ):
            raise ValueError(f"{where}: a sliding-window group needs sliding_window > 0")
        if self.kind is GroupKind.CHUNKED_LOCAL and (
            self.attention_chunk_size is None or self.attention_chunk_size <= 0
        ):
            raise ValueError(f"{where}: a chunked-local group needs attention_chunk_size > 0")
        if self.extra_retained_tokens < 0:
            raise ValueError(f"{where}: extra_retained_tokens must be >= 0")

    def describe(self) -> str:
        """The way every error message names a group: index, kind, tokens per block."""
        extra = ""
        if self.kind is GroupKind.SLIDING_WINDOW:
            extra = f", window {self.sliding_window}"
        elif self.kind is GroupKind.CHUNKED_LOCAL:
            extra = f", attention chunk {self.attention_chunk_size}"
        eagle = ", EAGLE" if self.is_eagle else ""
        return (
            f"group {self.index} ({self.kind.value}{extra}{eagle}, "
            f"{self.tokens_per_block} tokens/block)"
        )

    @property
    def bytes_per_block(self) -> int:
        return self.page_bytes * self.num_layers


@dataclass(frozen=True)
class Geometry:
    """The offloaded groups of one model/config, plus the hash unit.

    ``groups`` are in offloading order (ascending original index), exactly the
    order of vLLM's ``get_offloading_group_ids``.
    """

    groups: tuple[KVGroup, ...]
    tokens_per_hash: int
    name: str = field(default="", compare=False)
    max_model_len: int | None = field(default=None, compare=False)
    """The engine's ``max_model_len``: no request grows longer (``None``: not known).
    :func:`reference.knobs.resolve` refuses chunks longer than it
    (:func:`reference.knobs.check_chunks_fit`)."""

    def __post_init__(self) -> None:
        if self.tokens_per_hash <= 0:
            raise ValueError(f"tokens_per_hash must be > 0, got {self.tokens_per_hash}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")
        indices = [g.index for g in self.groups]
        if indices != sorted(set(indices)):
            raise ValueError(
                f"groups must have distinct indices in ascending order, got {indices}"
            )

    def group(self, index: int) -> KVGroup:
        for g in self.groups:
            if g.index == index:
                return g
        raise KeyError(index)


def cpu_row_bytes(
    worker_kv_bytes_per_block: int, copies: int, blocks_per_chunk: int, alignment: int
) -> int:
    """Bytes of one CPU-tier chunk row, which is also one fs-tier chunk file.

    vLLM's ``CPUOffloadingSpec``: a row holds ``blocks_per_chunk`` blocks of every KV-cache
    group for each of ``copies`` workers (the world size, or 1 for the replicated MLA
    layout), ``worker_kv_bytes_per_block`` bytes per block per worker, rounded up to
    ``alignment`` (``CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT``, the host page size).
    """
    for name, value in (("worker_kv_bytes_per_block", worker_kv_bytes_per_block),
                        ("copies", copies), ("blocks_per_chunk", blocks_per_chunk),
                        ("alignment", alignment)):
        if value < 1:
            raise ValueError(f"cpu_row_bytes: {name} must be >= 1, got {value}")
    raw = worker_kv_bytes_per_block * copies * blocks_per_chunk
    return -(-raw // alignment) * alignment
