"""Chunk keys: how an offloaded chunk is named.

Chunk ``i`` of a group covers tokens ``[i * tokens_per_chunk, (i + 1) * tokens_per_chunk)``.
Its key is the block hash at the chunk's last hash unit -- the fingerprint of the
whole prefix ``[0, (i + 1) * tokens_per_chunk)`` -- followed by the group's original
index as a big-endian uint32.  Only complete chunks have keys.  This is byte for
byte vLLM 0.33.0's ``make_offload_key``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from reference.knobs import GroupChunking

GROUP_ID_BYTES = 4


def make_key(block_hash: bytes, group_index: int) -> bytes:
    """``block_hash || uint32_be(group_index)``."""
    return bytes(block_hash) + group_index.to_bytes(GROUP_ID_BYTES, "big", signed=False)


def split_key(key: bytes) -> tuple[bytes, int]:
    """Inverse of :func:`make_key`."""
    return key[:-GROUP_ID_BYTES], int.from_bytes(key[-GROUP_ID_BYTES:], "big")


def chunk_key(block_hashes: Sequence[bytes], gc: GroupChunking, chunk_index: int) -> bytes:
    """Key of chunk ``chunk_index`` of the group; the chunk must be complete."""
    last = (chunk_index + 1) * gc.hashes_per_chunk - 1
    if chunk_index < 0 or last >= len(block_hashes):
        raise IndexError(
            f"chunk {chunk_index} of {gc.group.describe()} is not complete: it needs "
            f"{last + 1} block hashes, the request has {len(block_hashes)}"
        )
    return make_key(block_hashes[last], gc.group.index)


def group_keys(block_hashes: Sequence[bytes], gc: GroupChunking) -> list[bytes]:
    """Keys of every complete chunk of the group, in chunk order."""
    hpc = gc.hashes_per_chunk
    group = gc.group.index.to_bytes(GROUP_ID_BYTES, "big", signed=False)  # make_key's suffix
    return [bytes(h) + group for h in block_hashes[hpc - 1 :: hpc]]


def boundary_key(block_hashes: Sequence[bytes], tokens_per_hash: int, group_index: int,
                 boundary_tokens: int) -> bytes:
    """Key of the state at ``boundary_tokens`` (Mamba-align hand-offs).

    Equals :func:`chunk_key` when the boundary is a chunk end.
    """
    return make_key(block_hashes[boundary_tokens // tokens_per_hash - 1], group_index)


def prefix_block_hashes(tokens: Sequence[int], tokens_per_hash: int,
                        seed: bytes = b"kvchunk") -> list[bytes]:
    """A chained SHA-256 over full hash units, shaped like vLLM's block hashes.

    vLLM hashes with its own function and seed; keys take whatever hashes the
    engine produced.  This one serves tests and tools that have only tokens.
    """
    hashes: list[bytes] = []
    parent = hashlib.sha256(seed).digest()
    for start in range(0, len(tokens) - tokens_per_hash + 1, tokens_per_hash):
        unit = tokens[start : start + tokens_per_hash]
        h = hashlib.sha256(parent)
        for t in unit:
            h.update(int(t).to_bytes(8, "little", signed=True))
        parent = h.digest()
        hashes.append(parent)
    return hashes
