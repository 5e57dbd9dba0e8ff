"""The synthetic KV contents: deterministic bytes per (layer, block position, prefix hash).

:func:`expected_bytes` ``(layer, i, h)`` is what the synthetic model runner
(:mod:`conformance.harness.kvdata`) writes into a layer's block at position
``i`` of a request whose tokens up to that block's end hash to ``h``
(:func:`prefix_hashes`).  A complete block thus holds ``f(layer, position,
hash of the prefix up to its end)``: equal prefixes give equal bytes, and a
block from another layer, position or prefix -- or one never written --
differs in every 8-byte word.

Pure torch: no vLLM.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

__all__ = [
    "block_seed",
    "expected_bytes",
    "expected_rows",
    "expected_words",
    "prefix_hashes",
]

_MASK64 = (1 << 64) - 1
_PATTERN_SEED = 0x6B76_6368_756E_6B21  # "kvchunk!"


def _mix64(x: int) -> int:
    """splitmix64's finaliser."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def prefix_hashes(tokens: Sequence[int], into: list[int] | None = None) -> list[int]:
    """``out[k]`` = 64-bit hash of ``tokens[:k]`` for ``k = 0 .. len(tokens)``.

    A hash chain, so equal prefixes hash equal.  With ``into`` (a previous
    result for a prefix of ``tokens``) only the new tokens are hashed.
    """
    out = into if into is not None else [0]
    for tok in tokens[len(out) - 1 :]:
        out.append(_mix64(out[-1] ^ (int(tok) * 0x100000001B3 & _MASK64)))
    return out


def block_seed(layer: str, block_index: int, prefix_hash: int) -> bytes:
    """8 bytes naming (layer, block position, prefix hash)."""
    key = f"{layer}\0{block_index}\0{prefix_hash}".encode()
    return hashlib.blake2b(key, digest_size=8).digest()


_PATTERN_WORDS = 1 << 17  # 1 MiB of pattern, repeated for longer pages
_pattern_cache: dict[str, torch.Tensor] = {}


def _pattern_words(nwords: int, device: torch.device) -> torch.Tensor:
    """int64 ``[nwords]``: fixed pseudo-random words, the same for every layer and block."""
    have = _pattern_cache.get(str(device))
    if have is None:
        gen = torch.Generator().manual_seed(_PATTERN_SEED)
        base = torch.randint(0, 256, (_PATTERN_WORDS * 8,), generator=gen, dtype=torch.uint8)
        have = base.view(torch.int64).to(device)
        _pattern_cache[str(device)] = have
    if nwords <= have.numel():
        return have[:nwords]
    return have.repeat(-(-nwords // have.numel()))[:nwords]


def expected_words(
    layer: str,
    block_indices: Sequence[int],
    hashes: Sequence[int],
    nwords: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """int64 ``[n, nwords]``: the pattern XOR each row's 8-byte :func:`block_seed`."""
    device = torch.device(device)
    seeds = b"".join(block_seed(layer, i, h) for i, h in zip(block_indices, hashes, strict=True))
    seed = torch.frombuffer(bytearray(seeds), dtype=torch.int64).to(device)
    return _pattern_words(nwords, device).unsqueeze(0) ^ seed.unsqueeze(1)


def expected_rows(
    layer: str,
    block_indices: Sequence[int],
    hashes: Sequence[int],
    nbytes: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``[n, nbytes]`` uint8: row ``k`` is :func:`expected_bytes` of ``(layer, block_indices[k], hashes[k])``."""
    words = expected_words(layer, block_indices, hashes, -(-nbytes // 8), device)
    return words.view(torch.uint8)[:, :nbytes]


def expected_bytes(
    layer: str, block_index: int, prefix_hash: int, nbytes: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The ``nbytes`` bytes the runner writes into ``layer``'s block at position ``block_index``
    when the request's tokens up to that block's end (or up to the last computed
    token, for a block still filling) hash to ``prefix_hash`` (:func:`prefix_hashes`).

    A fixed pattern XOR the 8-byte :func:`block_seed`, repeated: two different
    seeds differ in every 8-byte word.
    """
    return expected_rows(layer, [block_index], [prefix_hash], nbytes, device)[0]
