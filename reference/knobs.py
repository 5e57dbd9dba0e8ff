"""Knob resolution: from a geometry and the user's knob to per-group chunking.

Three knobs exist.  Each is stated once here; ``docs/semantics.md`` says the
same in plain words.

``blocks_per_chunk: B`` (an int)
    Every group uses ``B`` blocks per chunk.  This is vLLM 0.33.0's rule.

``block_size: T`` (tokens)
    ``T`` is the chunk span of the *alignment groups*: the groups without a
    window (full attention / MLA), or every group when there are none.  They
    must agree on ``tokens_per_block``; then ``B = T / tokens_per_block`` and
    every group uses that ``B``.  On a uniform model this is vLLM's rule.

``blocks_per_chunk: {group_index: B_g, "default": B}`` (per-group)
    Listed groups use ``B_g``, the others the default (1 when absent).

Whatever the knob, a chunk must end on a hash boundary:
``tokens_per_chunk % tokens_per_hash == 0``.  vLLM 0.33.0 asks the stronger
``tokens_per_block % tokens_per_hash == 0``; kvchunk's rule admits groups
smaller than one hash unit once their chunk spans one (vLLM issue #54413).

And no chunk may be longer than the engine's ``max_model_len``
(:func:`check_chunks_fit`; vLLM has no such check and silently stores nothing).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from reference.geometry import Geometry, GroupKind, KVGroup
from reference.rules import WindowRule, window_in_chunks

BLOCKS_PER_CHUNK = "blocks_per_chunk"
BLOCK_SIZE = "block_size"
RETENTION = "prefix_cache_retention_interval"
DEFAULT_KEY = "default"


@dataclass(frozen=True)
class BlocksPerChunk:
    """``blocks_per_chunk: B``: one value for every group (vLLM's rule)."""

    value: int


@dataclass(frozen=True)
class BlockSize:
    """``block_size: T``: the alignment groups' chunk span in tokens."""

    tokens: int


@dataclass(frozen=True)
class PerGroupBlocksPerChunk:
    """``blocks_per_chunk: {index: B_g, "default": B}``."""

    values: tuple[tuple[int, int], ...]
    default: int = 1

    @classmethod
    def of(cls, values: Mapping[int, int], default: int = 1) -> PerGroupBlocksPerChunk:
        return cls(tuple(sorted(values.items())), default)

    def for_group(self, index: int) -> int:
        return dict(self.values).get(index, self.default)


Knob = BlocksPerChunk | BlockSize | PerGroupBlocksPerChunk


@dataclass(frozen=True)
class GroupChunking:
    """What one group's chunks look like under a resolved knob."""

    group: KVGroup
    blocks_per_chunk: int
    tokens_per_chunk: int
    hashes_per_chunk: int
    window_in_chunks: int | None
    """vLLM's ``sliding_window_size_in_chunks`` (the config field the config lane
    compares): :func:`reference.rules.window_in_chunks` at an aligned end under
    ``WindowRule.WHOLE_WINDOW``; ``None`` for full attention.  Hits use the
    planner's ``Policy.window`` rule, which by default needs one chunk less when
    ``(W - 1) % tokens_per_chunk == 0``."""


@dataclass(frozen=True)
class Chunking:
    """A geometry resolved under a knob: the input to keys, plans and transfers."""

    geometry: Geometry
    groups: tuple[GroupChunking, ...]
    alignment_tokens: int | None
    """Full-attention chunk span that SWA store masks align to (vLLM's rule)."""
    mamba_align_tokens: int | None
    """Chunk span of the Mamba-align groups, to which load hits round down."""

    @property
    def tokens_per_hash(self) -> int:
        return self.geometry.tokens_per_hash

    @property
    def full_groups(self) -> frozenset[int]:
        """The full-attention groups' indexes (no window: ``window_in_chunks`` None); the
        others are window groups (sliding, chunked-local, Mamba)."""
        return frozenset(gc.group.index for gc in self.groups if gc.window_in_chunks is None)

    @property
    def uniform_blocks_per_chunk(self) -> int | None:
        values = {gc.blocks_per_chunk for gc in self.groups}
        return values.pop() if len(values) == 1 else None

    def for_index(self, index: int) -> GroupChunking:
        for gc in self.groups:
            if gc.group.index == index:
                return gc
        raise KeyError(index)


# ---------------------------------------------------------------------------
# Parsing kv_connector_extra_config
# ---------------------------------------------------------------------------


_INTEGER = re.compile(r"\s*\+?[0-9]+\s*", re.ASCII)
_SIGNED_INTEGER = re.compile(r"\s*[+-]?[0-9]+\s*", re.ASCII)


def is_integer_string(text: str, *, signed: bool = False) -> bool:
    """Whether ``text`` spells an integer the way kvchunk accepts it.

    ASCII digits with optional surrounding whitespace and one leading ``+`` (or
    ``-`` when ``signed``): ``"64"``, ``" +64 "``.  Not ``"++5"`` (``int()`` raises),
    nor ``"1_000"``, ``"\u0665"`` (Arabic-Indic five) or ``"\u00b2"``, which
    ``int()`` or ``str.isdecimal`` partly accept.
    """
    return (_SIGNED_INTEGER if signed else _INTEGER).fullmatch(text) is not None


def _positive_int(knob: str, value: Any, what: str = "") -> int:
    """An int > 0 from JSON: ints and decimal strings, never bools or floats."""
    label = f"'{knob}'{what}"
    if isinstance(value, bool):
        raise ValueError(f"{label} must be a positive integer, got the boolean {value!r}.")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and is_integer_string(value):
        # vLLM does int(value), so "64" is accepted there; accept it here too.
        n = int(value.strip())
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    else:
        raise ValueError(
            f"{label} must be a positive integer, got {value!r} ({type(value).__name__}); "
            "write it in digits, for example 16."
        )
    if n <= 0:
        raise ValueError(f"{label} must be greater than 0, got {n}; for example use 1.")
    return n


def _group_index(key: Any, geometry: Geometry) -> int:
    valid = [g.index for g in geometry.groups]
    index: int | None = None
    if isinstance(key, bool):
        index = None
    elif isinstance(key, int):
        index = key
    elif isinstance(key, str) and key.strip().isascii() and key.strip().isdecimal():
        index = int(key.strip())
    if index is None or index not in valid:
        raise ValueError(
            f"'{BLOCKS_PER_CHUNK}' names group {key!r}, which is not an offloaded KV-cache "
            f"group; valid group indices are {valid} (or '{DEFAULT_KEY}')."
        )
    return index


def parse_knob(extra_config: Mapping[str, Any], geometry: Geometry) -> Knob:
    """Read the chunk-size knob out of ``kv_connector_extra_config``.

    Absent knobs mean ``blocks_per_chunk: 1``, as in vLLM.
    """
    if not isinstance(extra_config, Mapping):
        raise ValueError(
            f"kv_connector_extra_config must be a JSON object, got {type(extra_config).__name__}."
        )
    bpc = extra_config.get(BLOCKS_PER_CHUNK)
    tokens = extra_config.get(BLOCK_SIZE)
    if bpc is not None and tokens is not None:
        raise ValueError(
            f"Specify only one of '{BLOCK_SIZE}' or '{BLOCKS_PER_CHUNK}' in "
            f"kv_connector_extra_config (got {BLOCK_SIZE}={tokens!r} and "
            f"{BLOCKS_PER_CHUNK}={bpc!r})."
        )
    if tokens is not None:
        return BlockSize(_positive_int(BLOCK_SIZE, tokens))
    if bpc is None:
        return BlocksPerChunk(1)
    if isinstance(bpc, Mapping):
        default = 1
        values: dict[int, int] = {}
        for key, value in bpc.items():
            if key == DEFAULT_KEY:
                default = _positive_int(BLOCKS_PER_CHUNK, value, f"['{DEFAULT_KEY}']")
                continue
            index = _group_index(key, geometry)
            if index in values:
                raise ValueError(f"'{BLOCKS_PER_CHUNK}' names group {index} twice.")
            values[index] = _positive_int(BLOCKS_PER_CHUNK, value, f"[{index}]")
        return PerGroupBlocksPerChunk.of(values, default)
    return BlocksPerChunk(_positive_int(BLOCKS_PER_CHUNK, bpc))


# ---------------------------------------------------------------------------
# Resolution
# ---------------------------------------------------------------------------


def alignment_groups(geometry: Geometry) -> tuple[KVGroup, ...]:
    """The groups whose chunk span ``block_size`` names: the unwindowed ones, else all."""
    full = tuple(g for g in geometry.groups if not g.kind.windowed)
    return full or geometry.groups


def _blocks_for_block_size(tokens: int, geometry: Geometry) -> int:
    groups = alignment_groups(geometry)
    sizes = sorted({g.tokens_per_block for g in groups})
    if len(sizes) != 1:
        listing = "; ".join(g.describe() for g in groups)
        raise ValueError(
            f"'{BLOCK_SIZE}'={tokens} is ambiguous: the alignment groups (those without a "
            f"window) disagree on tokens per block: {listing}. Set '{BLOCKS_PER_CHUNK}' "
            f"instead, e.g. {{\"{BLOCKS_PER_CHUNK}\": 1}}, or the per-group form "
            f"{{\"{BLOCKS_PER_CHUNK}\": {{\"{groups[0].index}\": "
            f"{max(1, tokens // groups[0].tokens_per_block)}, \"default\": 1}}}}."
        )
    tpb = sizes[0]
    if tokens % tpb:
        lower, upper = tokens // tpb * tpb, (tokens // tpb + 1) * tpb
        valid = f"{lower} or {upper}" if lower else f"{upper}"
        first = next(g for g in groups if g.tokens_per_block == tpb)
        raise ValueError(
            f"'{BLOCK_SIZE}'={tokens} in kv_connector_extra_config must be a multiple of the "
            f"alignment groups' block size ({tpb} tokens, e.g. {first.describe()}). Use "
            f"{valid} instead, or set '{BLOCKS_PER_CHUNK}' to express the chunk size in blocks."
        )
    return tokens // tpb


def knob_blocks_per_chunk(knob: Knob, geometry: Geometry) -> dict[int, int]:
    """Blocks per chunk for each offloaded group index under ``knob``."""
    if isinstance(knob, BlocksPerChunk):
        if knob.value <= 0:
            raise ValueError(f"'{BLOCKS_PER_CHUNK}' must be greater than 0, got {knob.value}.")
        return {g.index: knob.value for g in geometry.groups}
    if isinstance(knob, BlockSize):
        if knob.tokens <= 0:
            raise ValueError(f"'{BLOCK_SIZE}' must be greater than 0, got {knob.tokens}.")
        b = _blocks_for_block_size(knob.tokens, geometry)
        return {g.index: b for g in geometry.groups}
    valid = [g.index for g in geometry.groups]
    for index, value in knob.values:
        if index not in valid:
            raise ValueError(
                f"'{BLOCKS_PER_CHUNK}' names group {index}, which is not an offloaded "
                f"KV-cache group; valid group indices are {valid}."
            )
        if value <= 0:
            raise ValueError(
                f"'{BLOCKS_PER_CHUNK}'[{index}] must be greater than 0 for "
                f"{geometry.group(index).describe()}, got {value}; for example use 1."
            )
    if knob.default <= 0:
        raise ValueError(f"'{BLOCKS_PER_CHUNK}'['default'] must be greater than 0.")
    return {g.index: knob.for_group(g.index) for g in geometry.groups}


def knob_name(knob: Knob) -> str:
    return BLOCK_SIZE if isinstance(knob, BlockSize) else BLOCKS_PER_CHUNK


def smallest_valid_blocks_per_chunk(group: KVGroup, tokens_per_hash: int) -> int:
    """The least B for which the group's chunk ends on a hash boundary."""
    return math.lcm(group.tokens_per_block, tokens_per_hash) // group.tokens_per_block


def resolve(
    geometry: Geometry,
    knob: Knob,
    retention_interval: int | None = 0,
) -> Chunking:
    """Resolve ``knob`` on ``geometry``; every user mistake is a ``ValueError``.

    ``retention_interval`` is vLLM's ``prefix_cache_retention_interval``
    (default 0; ``None`` means dense), validated against the chunk spans.
    Last, :func:`check_chunks_fit` holds the chunks to ``geometry.max_model_len``.
    """
    if not geometry.groups:
        raise ValueError("KV offloading found no eligible cache groups.")
    name = knob_name(knob)
    per_group = knob_blocks_per_chunk(knob, geometry)
    tph = geometry.tokens_per_hash

    chunkings: list[GroupChunking] = []
    for g in geometry.groups:
        b = per_group[g.index]
        tpc = g.tokens_per_block * b
        if tpc % tph:
            good = smallest_valid_blocks_per_chunk(g, tph)
            raise ValueError(
                f"'{name}' gives {g.describe()} chunks of {tpc} tokens "
                f"({b} blocks), which do not end on a hash boundary (tokens_per_hash="
                f"{tph}). Its blocks per chunk must be a multiple of {good}, e.g. "
                f"{{\"{BLOCKS_PER_CHUNK}\": {{\"{g.index}\": {good * max(1, -(-b // good))}, "
                f"\"default\": ...}}}}."
            )
        chunkings.append(
            GroupChunking(
                group=g,
                blocks_per_chunk=b,
                tokens_per_chunk=tpc,
                hashes_per_chunk=tpc // tph,
                window_in_chunks=window_in_chunks(g, tpc, rule=WindowRule.WHOLE_WINDOW),
            )
        )

    full_spans = {gc.tokens_per_chunk for gc in chunkings if gc.window_in_chunks is None}
    alignment: int | None
    if len(full_spans) == 1:
        alignment = next(iter(full_spans))
    elif not full_spans:
        alignment = max(gc.tokens_per_chunk for gc in chunkings)
    else:
        alignment = None

    mamba_spans = {
        gc.tokens_per_chunk for gc in chunkings if gc.group.kind is GroupKind.MAMBA_ALIGN
    }
    if len(mamba_spans) > 1:
        listing = "; ".join(
            f"{gc.group.describe()} -> {gc.tokens_per_chunk} tokens/chunk"
            for gc in chunkings
            if gc.group.kind is GroupKind.MAMBA_ALIGN
        )
        raise ValueError(
            f"'{name}' gives the Mamba-align groups different chunk spans ({listing}); "
            f"loads round down to one Mamba chunk span, so they must agree."
        )
    mamba_align = next(iter(mamba_spans)) if mamba_spans else None

    if retention_interval is not None:
        if retention_interval < 0:
            raise ValueError(
                f"{RETENTION} ({retention_interval}) must be non-negative; e.g. 0 (sparse) "
                f"or None (dense)."
            )
        for gc in chunkings:
            if gc.window_in_chunks is not None and retention_interval % gc.tokens_per_chunk:
                lcm = math.lcm(*(c.tokens_per_chunk for c in chunkings if c.window_in_chunks))
                raise ValueError(
                    f"{RETENTION} ({retention_interval}) must be a multiple of "
                    f"tokens_per_chunk ({gc.tokens_per_chunk}) of {gc.group.describe()} "
                    f"under '{name}'; e.g. {lcm} or 0."
                )

    chunking = Chunking(
        geometry=geometry,
        groups=tuple(chunkings),
        alignment_tokens=alignment,
        mamba_align_tokens=mamba_align,
    )
    check_chunks_fit(chunking, knob, retention_interval)
    return chunking


# ---------------------------------------------------------------------------
# The chunk-length rule
# ---------------------------------------------------------------------------


def check_chunks_fit(chunking: Chunking, knob: Knob, retention_interval: int | None = 0) -> None:
    """No chunk may be longer than ``max_model_len`` (``chunking.geometry.max_model_len``).

    A chunk is stored only once it is complete, and no request grows past the
    engine's ``max_model_len``; so a group whose ``tokens_per_chunk`` exceeds it
    never stores a chunk, and the knob silently offloads nothing.  Such a knob
    is a ``ValueError`` that names the knob, the group with the longest chunks
    (its index, kind, tokens per block and tokens per chunk) and the largest
    value of the knob whose longest chunk fits and that every other rule of
    :func:`resolve` accepts (``retention_interval`` included), or says that no
    value is valid.  A chunk exactly ``max_model_len`` long fits.  With
    ``max_model_len`` unknown (``None``) there is nothing to check.

    The value varied is the one that sets the longest group's chunk: the knob
    itself for ``blocks_per_chunk: B`` and ``block_size: T`` (in steps of the
    alignment groups' block), and for a per-group map every entry that holds the
    longest group's value (the others stay as given).
    """
    limit = chunking.geometry.max_model_len
    if limit is None:
        return
    longest = max(chunking.groups, key=lambda gc: gc.tokens_per_chunk)
    if longest.tokens_per_chunk <= limit:
        return
    group, blocks = longest.group, longest.blocks_per_chunk
    label, unit, knob_at = _varied_entry(knob, chunking, blocks)
    head = (
        f"{label}={blocks * unit} gives {group.describe()} chunks of "
        f"{longest.tokens_per_chunk} tokens ({_blocks(blocks)}, the longest of any group), "
        f"longer than max_model_len={limit}: a chunk is stored only once it is complete, so "
        f"group {group.index} would never store one."
    )
    unbounded = replace(chunking.geometry, max_model_len=None)
    fits = limit // group.tokens_per_block  # the most blocks whose chunk fits
    refused: ValueError | None = None
    for b in range(fits, 0, -1):
        try:
            resolve(unbounded, knob_at(b), retention_interval)
        except ValueError as e:
            refused = refused or e
            continue
        raise ValueError(
            f"{head} The largest valid {label} is {b * unit} ({_blocks(b)}: "
            f"{b * group.tokens_per_block}-token chunks in group {group.index}): "
            f"{_knob_json(knob_at(b))}."
        )
    why = (
        f"even 1 block per chunk is {group.tokens_per_block} tokens"
        if refused is None
        else f"every value up to {fits * unit} breaks another rule (for {fits * unit}: "
        f"{str(refused).rstrip('.')})"
    )
    raise ValueError(f"{head} No value of {label} is valid: {why}.")


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def _varied_entry(
    knob: Knob, chunking: Chunking, blocks: int
) -> tuple[str, int, Callable[[int], Knob]]:
    """The knob entry that sets the longest chunk (``blocks`` blocks): its label, its value
    per block, and the knob with that entry at ``b`` blocks."""
    if isinstance(knob, BlocksPerChunk):
        return f"'{BLOCKS_PER_CHUNK}'", 1, BlocksPerChunk
    if isinstance(knob, BlockSize):
        tokens_per_block = knob.tokens // blocks
        return f"'{BLOCK_SIZE}'", tokens_per_block, lambda b: BlockSize(b * tokens_per_block)
    listed = dict(knob.values)
    keys = [index for index, value in knob.values if value == blocks]
    vary_default = knob.default == blocks and any(
        gc.group.index not in listed for gc in chunking.groups
    )
    names = [str(index) for index in keys] + ([f"'{DEFAULT_KEY}'"] if vary_default else [])

    def knob_at(b: int) -> Knob:
        values = {index: b if index in keys else value for index, value in listed.items()}
        return PerGroupBlocksPerChunk.of(values, b if vary_default else knob.default)

    return f"'{BLOCKS_PER_CHUNK}'[{', '.join(names)}]", 1, knob_at


def _knob_json(knob: Knob) -> str:
    """``knob`` as it is written in ``kv_connector_extra_config``."""
    value: Any
    if isinstance(knob, BlocksPerChunk):
        value = knob.value
    elif isinstance(knob, BlockSize):
        value = knob.tokens
    else:
        value = {str(index): b for index, b in knob.values}
        value[DEFAULT_KEY] = knob.default
    return json.dumps({knob_name(knob): value})


def resolve_extra_config(
    geometry: Geometry,
    extra_config: Mapping[str, Any],
    retention_interval: int | None = 0,
) -> Chunking:
    """``parse_knob`` then ``resolve``: what a connector does with its extra config."""
    return resolve(geometry, parse_knob(extra_config, geometry), retention_interval)


def supports_partial_tail(chunking: Chunking) -> bool:
    """vLLM's ``supports_partial_tail`` gate (dcp 1): sub-chunk Mamba hits.

    The reference does not model partial tails; planners refuse such chunkings.
    """
    groups = chunking.groups
    return (
        all(gc.blocks_per_chunk == 1 for gc in groups)
        and len({gc.group.tokens_per_block for gc in groups}) == 1
        and any(
            gc.group.kind is GroupKind.MAMBA_ALIGN
            and gc.group.tokens_per_block > chunking.tokens_per_hash
            for gc in groups
        )
        and all(
            gc.window_in_chunks is None or gc.group.kind is GroupKind.MAMBA_ALIGN
            for gc in groups
        )
    )
