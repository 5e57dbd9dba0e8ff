"""The options of kvchunk's file tier and the geometry namespace its files live under.

:func:`geometry` is everything that decides the bytes of a chunk file (or a packed
section), and :func:`namespace_digest` its BLAKE3 digest, which names the tier's
namespace directory (``<root_dir>/kvchunk-v<version>-<digest>/``, see
:mod:`vllm_adapter.disk.tier`).  :func:`check_tier_options`, :func:`usable_root` and
:func:`kvchunk_tier_configs` check a ``secondary_tiers`` entry before vLLM sees it: every
bad value is a ``ValueError`` naming the key and a valid value.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from vllm_adapter import names
from vllm_adapter.disk import budget as DB
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk.chunk_file import (
    BAD_FILE_POLICIES,
    CHECKSUM,
    CHECKSUMS,
    FORMAT_VERSION,
    digest,
)

__all__ = [
    "DEFAULT_LAYOUT",
    "LAYOUTS",
    "MAX_THREADS",
    "TIER_KEYS",
    "check_tier_options",
    "geometry",
    "kvchunk_tier_configs",
    "namespace_digest",
    "parallel_agnostic",
    "usable_root",
]

# ---------------------------------------------------------------------------
# Geometry namespace
# ---------------------------------------------------------------------------


def geometry(
    spec: Any, payload_bytes: int, *, layout: str = "per_chunk", checksum: str = CHECKSUM
) -> dict[str, Any]:
    """Everything that decides the bytes of a chunk file, from an offloading spec.

    ``spec``: a ``TieringOffloadingSpec`` (its ``config`` is vLLM's
    ``OffloadingConfig``); ``payload_bytes``: the primary tier's row stride, the
    bytes one file (or one packed section) holds; ``layout`` and ``checksum``: the
    tier's options (files of another layout or checksum live in another namespace).
    """
    c = spec.config
    p = c.parallel
    return {
        "format": "kvchunk-fs" if layout == "per_chunk" else "kvchunk-fs-packed",
        "format_version": FORMAT_VERSION if layout == "per_chunk" else P.FORMAT_VERSION,
        "checksum": checksum,
        "model": str(c.model.name),
        "kv_dtype": str(c.model.dtype),
        "kv_cache_layout": None if c.kv_cache_layout is None else str(c.kv_cache_layout),
        "canonical_layout": bool(c.canonical_layout),
        "replicated_layout": bool(getattr(spec, "replicated_layout", False)),
        "tokens_per_hash": int(c.cache.tokens_per_hash),
        "blocks_per_chunk": int(c.cache.blocks_per_chunk),
        "worker_kv_bytes_per_block": int(c.worker_kv_bytes_per_block),
        "kv_bytes_per_chunk": int(spec.kv_bytes_per_chunk),
        "cpu_page_size_per_worker": int(spec.cpu_page_size_per_worker),
        "file_payload_bytes": int(payload_bytes),
        "groups": [
            {
                "group_id": int(g.group_id),
                "tokens_per_block": int(g.tokens_per_block),
                "layer_names": [str(n) for n in g.layer_names],
                "sliding_window_size_in_chunks": g.sliding_window_size_in_chunks,
                "blocks_per_chunk": int(c.cache.blocks_per_chunk),
            }
            for g in c.groups
        ],
        "parallel": {"agnostic": True} if parallel_agnostic(spec) else {
            "rank": int(p.rank),
            "world_size": int(p.world_size),
            "tp_size": int(p.tp_size),
            "pp_size": int(p.pp_size),
            "pcp_size": int(p.pcp_size),
            "dcp_size": int(p.dcp_size),
        },
    }


def parallel_agnostic(spec: Any) -> bool:
    """Whether vLLM's ``FileMapper`` shares this spec's files across parallel configurations:
    its fs tier asks for it, and it is granted when the pages are parallelism-invariant
    (``OffloadingConfig.parallel.is_parallelism_agnostic``) or the layout is replicated
    (DeepSeek's MLA: one copy for every rank).  kvchunk's namespace then leaves the
    parallel sizes and the rank out, exactly there: a TP2 and a TP4 engine of one
    replicated model read each other's files (every other geometry field still has to
    match, the payload size among them)."""
    c = spec.config
    return bool(
        getattr(c.parallel, "is_parallelism_agnostic", False)
        or getattr(c, "replicated_layout", False)
        or getattr(spec, "replicated_layout", False)
    )


def namespace_digest(fields: Mapping[str, Any]) -> bytes:
    """BLAKE3 (16 bytes) of the canonical JSON of :func:`geometry`'s fields."""
    return digest(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())


# ---------------------------------------------------------------------------
# The tier's options
# ---------------------------------------------------------------------------


TIER_KEYS = (
    "type", "module_path", "root_dir", "n_read_threads", "n_write_threads", "enable_kv_events",
    "locality", "backpressure", "layout", "checksum", "bad_files", "fsync",
    DB.DISK_BYTES_KEY, "eviction", "adopt_recorded_budget",
)
"""The options of a kvchunk file tier: vLLM's fs tier's, and kvchunk's own."""
LAYOUTS = ("per_chunk", "packed")
DEFAULT_LAYOUT = "per_chunk"
MAX_THREADS = 256
"""``n_read_threads`` / ``n_write_threads`` above this are a mistake (vLLM's default is 16)."""


def where_of(tier_index: int | None) -> str:
    if tier_index is None:
        return f"the '{names.KVCHUNK_FS_TIER}' secondary tier config"
    return f"secondary_tiers[{tier_index}] of kv_connector_extra_config"


def check_tier_options(config: Mapping[str, Any], tier_index: int | None = None) -> None:
    """``ValueError`` naming the key and a valid value for each bad option of a file tier."""
    where = where_of(tier_index)
    unknown = sorted(set(config) - set(TIER_KEYS))
    if unknown:
        raise ValueError(
            f"{unknown[0]!r} in {where} is not a file tier option; valid: {', '.join(TIER_KEYS)}"
        )
    root = config.get("root_dir")
    if not isinstance(root, str) or not root:
        raise ValueError(
            f"'root_dir' in {where} must be a directory path, e.g. \"/mnt/nvme/kvchunk\", "
            f"got {root!r}"
        )
    if config.get("layout", DEFAULT_LAYOUT) not in LAYOUTS:
        raise ValueError(
            f"'layout' in {where} must be 'per_chunk' or 'packed', got {config.get('layout')!r}"
        )
    if config.get("checksum", CHECKSUM) not in CHECKSUMS:
        raise ValueError(
            f"'checksum' in {where} must be one of {', '.join(map(repr, CHECKSUMS))}, "
            f"got {config.get('checksum')!r}"
        )
    if config.get("bad_files", "delete") not in BAD_FILE_POLICIES:
        raise ValueError(
            f"'bad_files' in {where} must be 'delete' or 'quarantine', "
            f"got {config.get('bad_files')!r}"
        )
    DB.parse_eviction(config.get("eviction", "reachable"), where)
    if not isinstance(config.get("adopt_recorded_budget", False), bool):
        raise ValueError(
            f"'adopt_recorded_budget' in {where} must be true (an engine whose "
            f"'{DB.DISK_BYTES_KEY}' differs from the one recorded on the root uses the recorded "
            f"one) or false (it refuses to start), got {config.get('adopt_recorded_budget')!r}")
    if not isinstance(config.get("fsync", False), bool):
        raise ValueError(f"'fsync' in {where} must be true or false, got {config.get('fsync')!r}")
    for key in ("n_read_threads", "n_write_threads"):
        value = config.get(key, 1)
        if (isinstance(value, bool) or not isinstance(value, int)
                or not 1 <= value <= MAX_THREADS):
            raise ValueError(
                f"'{key}' in {where} must be an integer from 1 to {MAX_THREADS}, e.g. 16, "
                f"got {value!r}"
            )


def usable_root(root: str, tier_index: int | None = None) -> str:
    """``root_dir`` with ``~`` / ``~user`` expanded, created, and probed by writing a file in it.

    ``ValueError`` naming ``root_dir`` when it cannot be expanded, created or written.
    """
    where = where_of(tier_index)
    path = os.path.expanduser(root)
    if path.startswith("~"):
        raise ValueError(
            f"'root_dir' in {where} names a home directory that does not exist ({root!r}); "
            "give an absolute path, e.g. \"/mnt/nvme/kvchunk\""
        )
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ValueError(
            f"'root_dir' in {where} must be a writable directory, e.g. \"/mnt/nvme/kvchunk\"; "
            f"{root!r}: {exc.strerror or exc}"
        ) from None
    return path


def kvchunk_tier_configs(configs: Any) -> list[Any]:
    """``secondary_tiers`` with every ``"fs"`` tier turned into kvchunk's (others unchanged)."""
    if not isinstance(configs, list):
        raise ValueError(
            "'secondary_tiers' in kv_connector_extra_config must be a list of tier configs, "
            f"e.g. [{{\"type\": \"fs\", \"root_dir\": \"/mnt/nvme/kvchunk\"}}], got {configs!r}"
        )
    out: list[Any] = []
    for i, cfg in enumerate(configs):
        if not isinstance(cfg, dict):
            raise ValueError(
                f"secondary_tiers[{i}] of kv_connector_extra_config must be an object, "
                f"e.g. {{\"type\": \"fs\", \"root_dir\": \"/mnt/nvme/kvchunk\"}}, got {cfg!r}"
            )
        if cfg.get("type") in ("fs", names.KVCHUNK_FS_TIER):
            check_tier_options(cfg, i)
            root = usable_root(cfg["root_dir"], i)
            cfg = {**cfg, "type": names.KVCHUNK_FS_TIER, "root_dir": root,
                   DB.DISK_BYTES_KEY: DB.parse_disk_bytes(cfg.get(DB.DISK_BYTES_KEY), root,
                                                          where_of(i))}
        out.append(cfg)
    return out
