"""The chunk knob, resolved as the connector will resolve it (``--block-size``,
``--blocks-per-chunk`` or ``--chunk-bytes``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reference.knobs import BLOCK_SIZE, BLOCKS_PER_CHUNK, Chunking
from vllm_adapter.cli.args import CliError, Request
from vllm_adapter.planning import PlannedEngine

__all__ = ["MAX_CHUNK_BYTES_SEARCH", "Knob", "knob", "resolve_or_fail"]

MAX_CHUNK_BYTES_SEARCH = 4096
"""How far past the first B reaching ``--chunk-bytes`` the search for a valid B goes."""


@dataclass(frozen=True)
class Knob:
    chunking: Chunking
    vllm_extra: dict[str, Any]
    """The extra config vLLM runs (``blocks_per_chunk`` resolved)."""
    knob_extra: dict[str, int]
    """The knob printed in ``kv_connector_extra_config``."""
    given: dict[str, int]


def resolve_or_fail(
    engine: PlannedEngine, knob_extra: dict[str, int], flag: str
) -> tuple[Chunking, dict[str, Any]]:
    """:meth:`PlannedEngine.resolve`; a refusal is one line naming ``flag``."""
    try:
        return engine.resolve(knob_extra)
    except ValueError as e:
        raise CliError(f"{flag}: {e}") from None


def _chunk_bytes_knob(engine: PlannedEngine, chunk_bytes: int, notes: list[str]) -> Knob:
    """The smallest ``blocks_per_chunk`` whose chunk bytes per worker reach ``chunk_bytes``."""
    _, base_extra = resolve_or_fail(engine, {BLOCKS_PER_CHUNK: 1}, "--chunk-bytes")
    bytes_per_block = int(engine.offloading_config(base_extra).worker_kv_bytes_per_block)
    if bytes_per_block <= 0:
        raise CliError("vLLM reports no KV bytes per block for this model; cannot size chunks")
    first = max(1, -(-chunk_bytes // bytes_per_block))
    last_error: ValueError | None = None
    for blocks in range(first, first + MAX_CHUNK_BYTES_SEARCH):
        try:
            chunking, vllm_extra = engine.resolve({BLOCKS_PER_CHUNK: blocks})
            break
        except ValueError as e:
            last_error = e
    else:
        raise CliError(
            f"--chunk-bytes {chunk_bytes}: no blocks_per_chunk from {first} to "
            f"{first + MAX_CHUNK_BYTES_SEARCH - 1} is valid here ({last_error})"
        )
    notes.append(
        f"--chunk-bytes {chunk_bytes}: the smallest blocks_per_chunk whose chunk "
        f"bytes per worker ({bytes_per_block} x B) reach it is {blocks}"
        + (f" ({first} was not valid)" if blocks != first else "")
    )
    return Knob(chunking, vllm_extra, {BLOCKS_PER_CHUNK: blocks}, {"chunk_bytes": chunk_bytes})


def knob(request: Request, engine: PlannedEngine, notes: list[str]) -> Knob:
    """The request's knob resolved on ``engine`` (notes: how it was chosen)."""
    if request.chunk_bytes is not None:
        return _chunk_bytes_knob(engine, request.chunk_bytes, notes)
    flag = "--block-size" if BLOCK_SIZE in request.knob_extra else "--blocks-per-chunk"
    chunking, vllm_extra = resolve_or_fail(engine, dict(request.knob_extra), flag)
    if not request.knob_extra:
        notes.append("no chunk knob given: vLLM's default blocks_per_chunk 1")
    return Knob(chunking, vllm_extra, dict(request.knob_extra), dict(request.knob_extra))
