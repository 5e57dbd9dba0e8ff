"""A boundary whose window chunks come with a gap: the case a finished request must not
leave stranded (issue #31; ``tests/test_ledger_finished.py`` on the ledger, the hybrid soak
lane's gemma-4 case on the real tier).

vLLM's chunked prefill stores a boundary's window chunks in steps before its
full-attention chunk; when vLLM's CPU tier still holds one of them it cascades only what it
newly stored, so that chunk never reaches the disk.  :func:`window_gap` splits the first
alignment boundary's keys so: store A, the window chunks the boundary's hit needs ending
by ``split`` tokens (admitted *pending* the boundary: its full-attention chunk is one
store away); store B, the full-attention chunks and the later window chunks but one (the
first window group's chunk ending at the boundary: the gap).  Pure: no vLLM, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from reference.keys import group_keys
from reference.knobs import Chunking
from reference.packed import store_job_files

__all__ = ["WindowGap", "window_gap"]


@dataclass(frozen=True)
class WindowGap:
    """A prompt's first boundary stored in two stores, one window chunk missing from B."""

    chunking: Chunking
    hashes: tuple[bytes, ...]
    """The prompt's block hashes."""
    a: tuple[bytes, ...]
    b: tuple[bytes, ...]
    missing: bytes
    whole: tuple[bytes, ...]
    """Every key the boundary's hit needs (no gap): a store of these makes it whole."""
    positions: dict[bytes, int]
    """Each key's end token (vLLM's ``ReqContext`` records them)."""

    def files(self, keys: Sequence[bytes]) -> list[list[bytes]]:
        """A store's packed files: its full-attention keys, its window keys."""
        return [list(f) for f in store_job_files(list(keys), self.chunking.full_groups)]


def window_gap(chunking: Chunking, hashes: Sequence[bytes], split: int) -> WindowGap:
    """The first boundary of the prompt hashed ``hashes`` in two stores (the module
    docstring), store A ending at ``split`` tokens.  ``ValueError`` when the chunking has
    no such boundary (no alignment, no window group, nothing before ``split``)."""
    boundary = chunking.alignment_tokens
    if boundary is None:
        raise ValueError("window_gap: the chunking has no alignment boundary")
    positions: dict[bytes, int] = {}
    a: list[bytes] = []
    b: list[bytes] = []
    whole: list[bytes] = []
    missing = None
    for gc in chunking.groups:
        for i, k in enumerate(group_keys(list(hashes), gc)):
            end = gc.tokens_per_chunk * (i + 1)
            positions[k] = end
            if end > boundary:
                continue
            if gc.window_in_chunks is not None and (
                    end <= boundary - gc.window_in_chunks * gc.tokens_per_chunk):
                continue  # a window chunk the boundary's hit does not need
            whole.append(k)
            if gc.window_in_chunks is None:
                b.append(k)
            elif end <= split:
                a.append(k)
            elif end == boundary and missing is None:
                missing = k  # the gap: this chunk never comes
            else:
                b.append(k)
    if missing is None or not a or not b:
        raise ValueError(f"window_gap: no window chunks before {split} tokens and at the "
                         f"boundary ({boundary} tokens) to split")
    return WindowGap(chunking, tuple(hashes), tuple(a), tuple(b), missing, tuple(whole), positions)
