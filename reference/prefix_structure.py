"""Which stored chunk depends on which: the prefix structure a disk index keeps.

A key is the block hash at its chunk's end plus the group (:mod:`reference.keys`); a
hash does not name its parent.  So the index records, from the block hashes of every
request whose chunks it stores:

* for each full-attention key, the key of the chunk before it in its prefix (its
  *parent*; None for chunk 0);
* for each *boundary* (a prefix ending at a multiple of the alignment span ``A``,
  :attr:`~reference.knobs.Chunking.alignment_tokens`, named by the block hash at its
  end), the keys a lookup ending there needs: :func:`reference.rules.needed_chunks`
  of every group from token 0 (the full-attention keys ending there and the window
  keys).

Three ways in, one table:

* :meth:`PrefixStructure.observe`: a request's whole hash chain (the reference's
  Planner has it);
* :meth:`PrefixStructure.observe_positions`: a request's keys with their end tokens
  (what a disk tier is handed: vLLM's ``ReqContext`` records the end token of every
  key of a request), read as a chain with holes where no key ends;
* :meth:`PrefixStructure.record`: a :class:`Fragment` another index exported with
  :meth:`PrefixStructure.fragment` (a disk shared by several engines: each one
  learns the others' files without their chunking).

:mod:`reference.eviction` decides reachability and eviction over it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from reference.geometry import GroupKind
from reference.keys import GROUP_ID_BYTES, make_key, split_key
from reference.knobs import Chunking
from reference.rules import WindowRule, needed_chunks

__all__ = ["Fragment", "PrefixStructure"]


@dataclass(frozen=True)
class Fragment:
    """The part of a prefix structure some keys need: their parents and their boundaries.

    ``parents``: (full-attention key, its parent or None); ``boundaries``: (boundary
    hash, the full-attention keys ending there, the window keys a hit there needs).
    """

    parents: tuple[tuple[bytes, bytes | None], ...]
    boundaries: tuple[tuple[bytes, tuple[bytes, ...], tuple[bytes, ...]], ...]


class PrefixStructure:
    """What an index knows about the keys' prefixes (see the module docstring)."""

    def __init__(self, chunking: Chunking | None,
                 window_rule: WindowRule = WindowRule.TOKENS_BEFORE_END) -> None:
        """``chunking`` None: a structure fed by :meth:`record` alone (full-attention
        keys are the ones :meth:`record` names with a parent)."""
        self.chunking = chunking
        self.window_rule = window_rule
        self.alignment: int | None = None
        self.full_groups: frozenset[int] = frozenset()
        if chunking is not None:
            if chunking.alignment_tokens is None:
                raise ValueError(
                    "eviction: the chunking has no alignment span (full-attention groups of "
                    "different chunk spans); give every full group one span, e.g. the knob "
                    "block_size"
                )
            for gc in chunking.groups:
                if gc.group.kind is GroupKind.MAMBA_ALIGN:
                    raise ValueError(
                        f"eviction: {gc.group.describe()} is a Mamba-align group; the eviction "
                        "rule models full-attention and windowed groups only"
                    )
            self.alignment = chunking.alignment_tokens
            self.full_groups = chunking.full_groups
        self.parent: dict[bytes, bytes | None] = {}
        """Full-attention key -> the key of the chunk before it in its prefix (None: chunk 0)."""
        self.children: dict[bytes, set[bytes]] = {}
        """Full-attention key -> the keys whose parent it is."""
        self.full_at: dict[bytes, tuple[bytes, ...]] = {}
        """Boundary -> the full-attention keys ending there (one per full group)."""
        self.windows_at: dict[bytes, frozenset[bytes]] = {}
        """Boundary -> the window keys a hit ending there needs."""
        self.serves: dict[bytes, list[bytes]] = {}
        """Window key -> the boundaries that need it."""
        self.end_token: dict[bytes, int] = {}
        """Key -> the token its chunk ends at (keys :meth:`observe` recorded; a key
        :meth:`record` brought in has none)."""

    def is_full(self, key: bytes) -> bool:
        """A full-attention key: of a full group, or named with a parent (:meth:`record`).
        The parent table is asked first (one lookup), the group id (``split_key(key)[1]``,
        read in place) only for the keys it does not name."""
        return key in self.parent or int.from_bytes(key[-GROUP_ID_BYTES:], "big") in self.full_groups

    # -- ways in --------------------------------------------------------------

    def observe(self, block_hashes: Sequence[bytes | None]) -> None:
        """Record the prefix structure of one request's hash chain (idempotent).  A
        boundary already recorded names its whole prefix, so the walk starts after the
        last one the chain shares with earlier chains.  A hole (None) where a boundary,
        a parent or a window key would end leaves that boundary unrecorded."""
        chunking = self.chunking
        if chunking is None or self.alignment is None:
            raise ValueError("observe needs a chunking; this structure is fed by record()")
        tph = chunking.tokens_per_hash
        ends = range(self.alignment, len(block_hashes) * tph + 1, self.alignment)
        first = 0
        for i in range(len(ends) - 1, -1, -1):
            if block_hashes[ends[i] // tph - 1] in self.full_at:
                first = i + 1
                break
        for end in ends[first:]:
            boundary = block_hashes[end // tph - 1]
            if boundary is None:
                continue
            parents: list[tuple[bytes, bytes | None]] = []
            windows: list[bytes] = []
            window_end: dict[bytes, int] = {}
            complete = True
            for gc in chunking.groups:
                g, hpc = gc.group.index, gc.hashes_per_chunk
                chunks = needed_chunks(gc, 0, end, self.window_rule)
                if gc.window_in_chunks is None:
                    before = (block_hashes[end // tph - 1 - hpc]
                              if end > gc.tokens_per_chunk else b"")
                    if before is None:
                        complete = False
                        break
                    parents.append((make_key(boundary, g),
                                    make_key(before, g) if before else None))
                elif chunks.stop * hpc > len(block_hashes):
                    complete = False  # an EAGLE peek past the chain: a longer one records it
                    break
                else:
                    ends_of = [block_hashes[(k + 1) * hpc - 1] for k in chunks]
                    if any(h is None for h in ends_of):
                        complete = False
                        break
                    for k, h in zip(chunks, ends_of, strict=True):
                        if h is not None:
                            windows.append(make_key(h, g))
                            window_end[make_key(h, g)] = (k + 1) * gc.tokens_per_chunk
            if not complete or boundary in self.full_at:
                continue
            self._add_parents(parents)
            self._add_boundary(boundary, tuple(k for k, _ in parents), windows)
            for key, _ in parents:
                self.end_token.setdefault(key, end)
            for key in windows:
                self.end_token.setdefault(key, window_end[key])

    def observe_positions(self, positions: Mapping[bytes, int]) -> None:
        """:meth:`observe` of a request known by its keys' end tokens (key -> end token):
        the chain has the key's hash where a key ends and a hole elsewhere."""
        if self.chunking is None:
            raise ValueError("observe_positions needs a chunking")
        tph = self.chunking.tokens_per_hash
        if not positions:
            return
        chain: list[bytes | None] = [None] * (max(positions.values()) // tph)
        for key, end in positions.items():
            if end > 0 and end % tph == 0:
                chain[end // tph - 1] = split_key(key)[0]
        self.observe(chain)

    def record(self, fragment: Fragment) -> None:
        """Take in a :class:`Fragment` (idempotent; a boundary already known is kept)."""
        self._add_parents(fragment.parents)
        for boundary, full, windows in fragment.boundaries:
            if boundary not in self.full_at:
                self._add_boundary(boundary, full, windows)

    def _add_parents(self, parents: Iterable[tuple[bytes, bytes | None]]) -> None:
        for key, parent in parents:
            if key in self.parent:
                continue
            self.parent[key] = parent
            if parent is not None:
                self.children.setdefault(parent, set()).add(key)

    def _add_boundary(self, boundary: bytes, full: Iterable[bytes],
                      windows: Iterable[bytes]) -> None:
        self.full_at[boundary] = tuple(full)
        needed = self.windows_at[boundary] = frozenset(windows)
        serves = self.serves
        for key in needed:
            if key in serves:
                serves[key].append(boundary)
            else:
                serves[key] = [boundary]

    # -- way out --------------------------------------------------------------

    def fragment(self, keys: Iterable[bytes]) -> Fragment:
        """What :meth:`record` needs to judge ``keys`` as this structure does: the
        parents of their full-attention keys and every boundary they end or serve."""
        parents: dict[bytes, bytes | None] = {}
        boundaries: dict[bytes, None] = {}
        for key in keys:
            if key in self.parent:
                parents[key] = self.parent[key]
                boundary = split_key(key)[0]
                if boundary in self.full_at:
                    boundaries[boundary] = None
            for b in self.serves.get(key, ()):
                boundaries[b] = None
        return Fragment(
            tuple(parents.items()),
            tuple((b, self.full_at[b], tuple(sorted(self.windows_at[b]))) for b in boundaries),
        )

    def reset(self) -> None:
        for table in (self.parent, self.children, self.full_at, self.windows_at, self.serves,
                      self.end_token):
            table.clear()
