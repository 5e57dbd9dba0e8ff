"""kvchunk's reference chunker: the executable definition of chunked KV offloading.

Pure PyTorch and the standard library; it never imports vLLM.
"""

from reference.geometry import Geometry, GroupKind, KVGroup
from reference.keys import chunk_key, group_keys, make_key, split_key
from reference.knobs import (
    BlockSize,
    BlocksPerChunk,
    Chunking,
    GroupChunking,
    Knob,
    PerGroupBlocksPerChunk,
    parse_knob,
    resolve,
    resolve_extra_config,
)

__all__ = [
    "BlockSize",
    "BlocksPerChunk",
    "Chunking",
    "Geometry",
    "GroupChunking",
    "GroupKind",
    "KVGroup",
    "Knob",
    "PerGroupBlocksPerChunk",
    "chunk_key",
    "group_keys",
    "make_key",
    "parse_knob",
    "resolve",
    "resolve_extra_config",
    "split_key",
]
