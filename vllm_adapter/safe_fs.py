"""``KvchunkTieringOffloadingSpec``: vLLM's tiered offloading with a file tier that never serves wrong KV.

Selected like any out-of-tree offloading spec (the same keys as vLLM's
``TieringOffloadingSpec``; only ``spec_name`` / ``spec_module_path`` differ)::

    "kv_connector_extra_config": {
        "spec_name": "KvchunkTieringOffloadingSpec",
        "spec_module_path": "vllm_adapter.safe_fs",
        "cpu_bytes_to_use": <bytes>,
        "secondary_tiers": [{"type": "fs", "root_dir": "/mnt/nvme/kv"}]
    }

Everything but the file tier's I/O is vLLM's: ``TieringOffloadingManager``, the
CPU primary tier over the ``SharedOffloadRegion``, ``FileSystemTierManager``'s
lookups, thread pool, job bookkeeping and failure handling, and on CUDA vLLM's
``CPUOffloadingWorker`` (elsewhere the reference worker,
:class:`vllm_adapter.tiering.ReferenceTieringOffloadingSpec`).  Each ``"fs"``
secondary tier becomes a :class:`KvchunkFileTierManager` (registered with
vLLM's ``SecondaryTierFactory`` as ``"kvchunk_fs"``; it can also be named
directly, under vLLM's own ``TieringOffloadingSpec``, as ``{"type":
"kvchunk_fs"}`` once this module is imported, or ``{"type":
"KvchunkFileTierManager", "module_path": "vllm_adapter.safe_fs"}``).

**Chunk files** (:mod:`vllm_adapter.chunk_file`): a 4 KiB header (format
version, checksum algorithm, payload length, namespace and key digests, a 128-bit
BLAKE3 digest of the payload), then the payload; written atomically (temporary
name, then rename); a file that fails any check is a failed load, recomputed
through vLLM's own failed-promotion path, and deleted or quarantined.  A tier
sweeps temporary files a dead writer left behind when it starts.

**Namespace**: files live under ``<root_dir>/kvchunk-v<version>-<digest>/``, the
digest (BLAKE3, 128 bits) of :func:`geometry`: the model, KV dtype, KV cache
layout (and canonical / replicated layout), tokens per hash, blocks per chunk,
worker KV bytes per block, bytes per chunk and per file payload, per group its
index, tokens per block, layer names, window in chunks and blocks per chunk, the
TP/PP/PCP/DCP sizes, world size and rank, the format version and the checksum
algorithm.  vLLM hands the spec no per-group page size (``OffloadingConfig``
carries the per-worker sum, ``worker_kv_bytes_per_block``); any change of a
group's page changes that sum or the row, and the per-file payload length check
and digest stand behind it.  ``kvchunk-geometry.json`` in that directory records
the fields.  vLLM's ``FileMapper`` names the files inside it.

Options of the tier (``secondary_tiers`` entry, besides vLLM's fs-tier keys
``root_dir``, ``n_read_threads``, ``n_write_threads``, ``enable_kv_events``,
``locality``, ``backpressure``): ``"checksum": "blake3"`` (the only one),
``"bad_files": "delete" | "quarantine"``, ``"fsync": false | true`` (fsync each
file before the rename; off by default, as vLLM's tier).  Every bad value is a
``ValueError`` naming the key and a valid value.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from vllm_adapter import names
from vllm_adapter import vllm_api as V
from vllm_adapter.chunk_file import (
    BAD_FILE_POLICIES,
    CHECKSUM,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    QUARANTINE_DIR,
    ChunkFileError,
    ChunkIO,
    TierCounters,
    batch_load_chunks,
    batch_store_chunks,
    digest,
    key_digest,
    load_chunk,
    store_chunk,
    sweep_stale_temps,
)
from vllm_adapter.files import write_text_atomic
from vllm_adapter.tiering import ReferenceTieringOffloadingSpec

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "ChunkFileError",
    "ChunkIO",
    "KvchunkFileTierManager",
    "KvchunkTieringOffloadingSpec",
    "TierCounters",
    "batch_load_chunks",
    "batch_store_chunks",
    "geometry",
    "key_digest",
    "load_chunk",
    "namespace_digest",
    "store_chunk",
]

logger = logging.getLogger(__name__)

GEOMETRY_FILE = "kvchunk-geometry.json"


# ---------------------------------------------------------------------------
# Geometry namespace
# ---------------------------------------------------------------------------


def geometry(spec: Any, payload_bytes: int) -> dict[str, Any]:
    """Everything that decides the bytes of a chunk file, from an offloading spec.

    ``spec``: a ``TieringOffloadingSpec`` (its ``config`` is vLLM's
    ``OffloadingConfig``); ``payload_bytes``: the primary tier's row stride, the
    bytes one file holds.
    """
    c = spec.config
    p = c.parallel
    return {
        "format": "kvchunk-fs",
        "format_version": FORMAT_VERSION,
        "checksum": CHECKSUM,
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
        "parallel": {
            "rank": int(p.rank),
            "world_size": int(p.world_size),
            "tp_size": int(p.tp_size),
            "pp_size": int(p.pp_size),
            "pcp_size": int(p.pcp_size),
            "dcp_size": int(p.dcp_size),
        },
    }


def namespace_digest(fields: Mapping[str, Any]) -> bytes:
    """BLAKE3 (16 bytes) of the canonical JSON of :func:`geometry`'s fields."""
    return digest(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())


# ---------------------------------------------------------------------------
# The tier and the spec
# ---------------------------------------------------------------------------


TIER_KEYS = (
    "type", "module_path", "root_dir", "n_read_threads", "n_write_threads", "enable_kv_events",
    "locality", "backpressure", "checksum", "bad_files", "fsync",
)
"""The options of a kvchunk file tier: vLLM's fs tier's, and :mod:`safe_fs`'s own."""


def _where(tier_index: int | None) -> str:
    if tier_index is None:
        return f"the '{names.KVCHUNK_FS_TIER}' secondary tier config"
    return f"secondary_tiers[{tier_index}] of kv_connector_extra_config"


def check_tier_options(config: Mapping[str, Any], tier_index: int | None = None) -> None:
    """``ValueError`` naming the key and a valid value for each bad option of a file tier."""
    where = _where(tier_index)
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
    if config.get("checksum", CHECKSUM) != CHECKSUM:
        raise ValueError(
            f"'checksum' in {where} must be {CHECKSUM!r} (the only algorithm of format "
            f"version {FORMAT_VERSION}), got {config.get('checksum')!r}"
        )
    if config.get("bad_files", "delete") not in BAD_FILE_POLICIES:
        raise ValueError(
            f"'bad_files' in {where} must be 'delete' or 'quarantine', "
            f"got {config.get('bad_files')!r}"
        )
    if not isinstance(config.get("fsync", False), bool):
        raise ValueError(f"'fsync' in {where} must be true or false, got {config.get('fsync')!r}")
    for key in ("n_read_threads", "n_write_threads"):
        value = config.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"'{key}' in {where} must be an integer >= 1, e.g. 16, got {value!r}")


class KvchunkFileTierManager(V.FileSystemTierManager):
    """vLLM's ``FileSystemTierManager`` whose files are checksummed, geometry-namespaced and atomic.

    Lookups, the thread pool, the job bookkeeping and the failed-load handling
    are vLLM's; :meth:`submit_store` / :meth:`submit_load` call
    :func:`batch_store_chunks` / :func:`batch_load_chunks` instead of vLLM's
    ``batch_store_block`` / ``batch_load_block``, and vLLM's ``FileMapper``
    names the files under the geometry namespace directory.
    """

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str | None = None,
        *,
        checksum: str = CHECKSUM,
        bad_files: str = "delete",
        fsync: bool = False,
        **kwargs: Any,
    ) -> None:
        check_tier_options(
            {"root_dir": root_dir, "checksum": checksum, "bad_files": bad_files, "fsync": fsync,
             **{k: v for k, v in kwargs.items() if k in ("n_read_threads", "n_write_threads")}}
        )
        assert root_dir is not None
        assert primary_kv_view.strides is not None
        fields = geometry(offloading_spec, int(primary_kv_view.strides[0]))
        namespace = namespace_digest(fields)
        self.namespace_dir = os.path.join(root_dir, f"kvchunk-v{FORMAT_VERSION}-{namespace.hex()}")
        """``<root_dir>/kvchunk-v<version>-<digest>``: this geometry's files, and only them."""
        super().__init__(
            offloading_spec, primary_kv_view, tier_type, root_dir=self.namespace_dir, **kwargs
        )
        self.geometry = fields
        self.counters = TierCounters()
        self.io = ChunkIO(
            namespace=namespace,
            o_direct=bool(self._use_o_direct),
            fsync=fsync,
            bad_files=bad_files,
            quarantine_dir=os.path.join(self.namespace_dir, QUARANTINE_DIR),
            counters=self.counters,
        )
        _write_json_once(os.path.join(self.namespace_dir, GEOMETRY_FILE), fields)
        self.sweeper = threading.Thread(
            target=self._sweep, name="kvchunk-fs-sweep", daemon=True
        )
        """Removes the temporary files dead writers left in this namespace, once, at start."""
        self.sweeper.start()

    def _sweep(self) -> None:
        try:
            self.counters.add(stale_temps_removed=sweep_stale_temps(self.namespace_dir))
        except OSError as exc:
            logger.warning("kvchunk fs tier: sweeping %s failed: %s", self.namespace_dir, exc)

    def _paths(self, keys: Iterable[Any]) -> tuple[list[str], list[bytes]]:
        keys = list(keys)
        return [self.file_mapper.get_file_name(k) for k in keys], [key_digest(k) for k in keys]

    def submit_store(self, job_metadata: Any) -> None:
        keys = list(job_metadata.keys)
        V.fs_tier_track_store(self, job_metadata)
        paths, ids = self._paths(keys)
        offsets = [int(cid) * self._block_size for cid in job_metadata.chunk_ids]

        def store_task() -> None:
            try:
                batch_store_chunks(paths, ids, self._primary_kv_view, offsets, self._block_size,
                                   self.io)
            except OSError:
                self.counters.add(store_failures=1)
                raise

        self._job_block_counts[job_metadata.job_id] = len(keys)
        self._pool.enqueue_store(job_metadata.job_id, 1, [store_task])

    def submit_load(self, job_metadata: Any) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        self._load_job_keys[job_id] = keys
        self._job_block_counts[job_id] = len(keys)
        paths, ids = self._paths(keys)
        offsets = [int(cid) * self._block_size for cid in job_metadata.chunk_ids]

        def load_task() -> None:
            try:
                batch_load_chunks(paths, ids, self._primary_kv_view, offsets, self._block_size,
                                  self.io)
            except OSError as exc:
                # Written before the pool publishes the job (as vLLM's tier does).
                self._load_progress[job_id] = int(getattr(exc, "num_succeeded", 0))
                self.counters.add(load_failures=1)
                raise

        self._pool.enqueue_load(job_id, 1, [load_task])


def _write_json_once(path: str, data: Mapping[str, Any]) -> None:
    if os.path.exists(path):
        return
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True))


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
            cfg = {**cfg, "type": names.KVCHUNK_FS_TIER}
        out.append(cfg)
    return out


class KvchunkTieringOffloadingSpec(ReferenceTieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` (reference worker without CUDA) with kvchunk's file tier."""

    secondary_tier_configs: list[Any]
    """vLLM's parsed ``secondary_tiers``; its ``"fs"`` tiers are kvchunk's here."""

    def __init__(self, config: Any) -> None:
        extra = config.extra_config
        cpu_bytes = extra.get("cpu_bytes_to_use")
        if isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, int | str) or not cpu_bytes:
            raise ValueError(
                "'cpu_bytes_to_use' in kv_connector_extra_config must be the CPU tier's size "
                f"in bytes, e.g. {64 << 30} (64 GiB), got {cpu_bytes!r}"
            )
        kvchunk_tier_configs(extra.get("secondary_tiers", []))  # a bad tier fails before any I/O
        super().__init__(config)
        self.secondary_tier_configs = kvchunk_tier_configs(self.secondary_tier_configs)


def _register() -> None:
    with contextlib.suppress(ValueError):  # already registered (module imported again)
        V.SecondaryTierFactory.register_tier(
            names.KVCHUNK_FS_TIER, __name__, KvchunkFileTierManager.__name__
        )


_register()
