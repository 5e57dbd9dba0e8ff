"""Transfer jobs in the form vLLM's ``GPULoadStoreSpec`` expects.

Both directions describe GPU blocks group-major (offloading order), chunk by
chunk, block by block, with one ``group_sizes`` / ``block_indices`` entry per
offloaded group:

* ``group_sizes[g]``: how many of ``block_ids`` belong to group ``g``;
* ``block_indices[g]``: the position, in the request's block table of ``g``,
  of the group's first listed block.  ``block_indices[g] % blocks_per_chunk_g``
  is the sub-slot of the first chunk where the group's data starts (the skip).

``keys`` are the chunk keys, group-major and chunk-ascending, one per chunk the
job reads or writes.  Empty groups have ``group_sizes[g] == 0``; their
``block_indices`` entry is ignored by workers (vLLM writes 0 on store and the
table end on load).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StoreJob:
    """GPU blocks to copy into the chunks named by ``keys``."""

    req_id: str
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


@dataclass(frozen=True)
class LoadJob:
    """Chunks named by ``keys`` to copy into GPU blocks, for a hit of ``hit_tokens``.

    ``computed_tokens`` is the GPU prefix hit the load starts after.
    """

    req_id: str
    computed_tokens: int
    hit_tokens: int
    keys: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
