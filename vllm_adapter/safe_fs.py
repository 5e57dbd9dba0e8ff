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

**Chunk file** (format version :data:`FORMAT_VERSION`): a :data:`HEADER_SIZE`
(4096) byte header, then the payload (one CPU-tier row, page-aligned in the file,
so ``O_DIRECT`` works where the directory supports it, as vLLM's tier probes).
The header holds :data:`MAGIC`, the format version, the checksum algorithm, the
header size, the payload length, the geometry namespace digest, a digest of the
chunk's key (a file renamed or copied under another key fails), a 128-bit BLAKE3
digest of the payload and a BLAKE3 digest of the header fields.

*Why BLAKE3*: it is already a dependency of vLLM (pinned in both locks,
``blake3==1.0.11``), so no new package; it is fast (about 3.2-3.6 GB/s on one core
of an AVX2 host, as fast as zlib's CRC-32 there, faster with AVX-512) and, unlike
a CRC, it hashes one large payload on several cores (payloads of
:data:`MULTITHREAD_BYTES` and more); and a
128-bit digest also catches a whole foreign or stale file of the right length,
where a 32-bit CRC (CRC32C, as vllm#54363 proposes) lets one in 2^32 through.

**Store**: header + payload go to a unique temporary name in the same directory,
which is then ``os.replace``-d onto the chunk's name (atomic): a reader sees a
whole file or none.  Unlike vLLM's tier, a file already at the name is replaced,
not kept: the tier stores a chunk only when it was just computed, and a file
there that the lookup did not reach (so was never verified) may be damaged.  Any
failure removes the temporary file and fails the store job.

**Load**: the file must be exactly ``HEADER_SIZE + payload`` bytes, its header
must match (magic, version, algorithm, sizes, namespace, key) and its payload
digest must equal the header's.  Otherwise the load raises :class:`ChunkFileError`
(an ``OSError``, ``EBADMSG``) carrying ``num_succeeded``, exactly the failure
vLLM's fs tier raises for a short file: ``FileSystemTierManager`` keeps the chunks
before it, marks the rest a miss and the tokens are recomputed through vLLM's own
failed-promotion path.  The bad file is deleted (``"bad_files": "delete"``, the
default) or moved to ``<namespace>/quarantine/`` (``"quarantine"``), unless a
writer replaced it in the meantime, so the recomputed chunk is stored again and
the next request is served from the new file.

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
import errno
import json
import logging
import mmap
import os
import struct
import threading
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3

from vllm_adapter import names
from vllm_adapter import vllm_api as V
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

FORMAT_VERSION = 1
MAGIC = b"KVCHUNK\x00"
HEADER_SIZE = 4096
"""Bytes before the payload: one page, so the payload stays page-aligned in the file."""
CHECKSUM = "blake3"
_CHECKSUM_ID = 1
DIGEST_BYTES = 16
_FIELDS = struct.Struct("<8sHHIQ16s16s16s")
"""magic, format version, checksum id, header size, payload length, namespace, key, payload digest."""
_HEADER_USED = _FIELDS.size + DIGEST_BYTES
GEOMETRY_FILE = "kvchunk-geometry.json"
QUARANTINE_DIR = "quarantine"
BAD_FILE_POLICIES = ("delete", "quarantine")
O_DIRECT = getattr(os, "O_DIRECT", 0)


MULTITHREAD_BYTES = 1 << 20
"""Payloads from this size on are hashed on all cores (BLAKE3's tree hashing), so the hash
of one large chunk file does not serialize behind one core while its I/O waits."""


def _digest(data: Any) -> bytes:
    threads = blake3.blake3.AUTO if len(data) >= MULTITHREAD_BYTES else 1
    return bytes(blake3.blake3(data, max_threads=threads).digest(DIGEST_BYTES))


def key_digest(key: bytes) -> bytes:
    """The 16-byte identity of an offload key a chunk file's header carries."""
    return _digest(bytes(key))


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
    return _digest(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())


# ---------------------------------------------------------------------------
# One chunk file
# ---------------------------------------------------------------------------


class ChunkFileError(OSError):
    """A chunk file that is not a whole, intact file of this namespace and key (``EBADMSG``)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(errno.EBADMSG, f"bad chunk file ({why})", path)
        self.why = why


@dataclass
class TierCounters:
    """What a :class:`KvchunkFileTierManager` did (thread-safe; for metrics and the lanes)."""

    files_stored: int = 0
    files_loaded: int = 0
    store_failures: int = 0
    load_failures: int = 0
    bad_files: Counter[str] = field(default_factory=Counter)
    """Why files failed verification (``size``, ``header``, ``checksum``, ...)."""
    bad_files_removed: int = 0
    recent_bad: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=256))
    """The last 256 bad files seen: ``(path, why)``."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def bad(self, path: str, why: str) -> None:
        with self._lock:
            self.bad_files[why] += 1
            self.recent_bad.append((path, why))

    def bad_paths(self) -> list[str]:
        with self._lock:
            return [p for p, _ in self.recent_bad]


@dataclass(frozen=True)
class ChunkIO:
    """How a tier's files are written and checked."""

    namespace: bytes
    o_direct: bool = False
    fsync: bool = False
    bad_files: str = "delete"
    quarantine_dir: str | None = None
    counters: TierCounters = field(default_factory=TierCounters)


_local = threading.local()


def _header_page() -> mmap.mmap:
    """This thread's page-aligned header buffer (``O_DIRECT`` needs aligned memory)."""
    page = getattr(_local, "page", None)
    if page is None:
        # Private: an anonymous mmap is shared by default, and a forked child would
        # then write its headers into its parent's buffer.
        page = mmap.mmap(-1, HEADER_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        _local.page = page
    return page


def encode_header(page: Any, payload: memoryview, key_id: bytes, namespace: bytes) -> None:
    """Write the header of ``payload`` into the first bytes of ``page`` (the rest stays zero)."""
    fields = _FIELDS.pack(
        MAGIC, FORMAT_VERSION, _CHECKSUM_ID, HEADER_SIZE, len(payload), namespace, key_id,
        _digest(payload),
    )
    page[: _FIELDS.size] = fields
    page[_FIELDS.size : _HEADER_USED] = _digest(fields)


def check_header(path: str, page: Any, payload_len: int, key_id: bytes, namespace: bytes) -> bytes:
    """The payload digest of a header that matches; :class:`ChunkFileError` otherwise."""
    fields = bytes(page[: _FIELDS.size])
    if _digest(fields) != bytes(page[_FIELDS.size : _HEADER_USED]):
        raise ChunkFileError(path, "header")
    magic, version, algo, hsize, plen, ns, kid, digest = _FIELDS.unpack(fields)
    if magic != MAGIC or version != FORMAT_VERSION or algo != _CHECKSUM_ID or hsize != HEADER_SIZE:
        raise ChunkFileError(path, "format")
    if plen != payload_len:
        raise ChunkFileError(path, "length")
    if ns != namespace:
        raise ChunkFileError(path, "namespace")
    if kid != key_id:
        raise ChunkFileError(path, "key")
    return bytes(digest)


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    """``writev`` until every byte is written; a write that makes no progress is ``ENOSPC``."""
    while buffers:
        n = os.writev(fd, buffers)
        if n <= 0:
            raise OSError(errno.ENOSPC, "write made no progress")
        while buffers and n >= len(buffers[0]):
            n -= len(buffers[0])
            buffers.pop(0)
        if buffers and n:
            buffers[0] = buffers[0][n:]


def store_chunk(path: str, payload: memoryview, key_id: bytes, io: ChunkIO) -> None:
    """Write one chunk file atomically (replacing any file at ``path``: a freshly computed
    chunk is never second to a file that may be damaged and was never read)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}.tmp"
    page = _header_page()
    encode_header(page, payload, key_id, io.namespace)
    flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | (O_DIRECT if io.o_direct else 0)
    try:
        fd = os.open(tmp, flags, 0o644)
        try:
            _write_all(fd, [memoryview(page), payload])
            if io.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _discard(path: str, st: os.stat_result, io: ChunkIO) -> None:
    """Delete or quarantine a bad file, unless a writer has replaced it since it was opened."""
    try:
        now = os.stat(path)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return
        if io.bad_files == "quarantine" and io.quarantine_dir is not None:
            os.makedirs(io.quarantine_dir, exist_ok=True)
            name = f"{os.path.basename(path)}.{st.st_ino}.bad"
            os.replace(path, os.path.join(io.quarantine_dir, name))
        else:
            os.remove(path)
        io.counters.add(bad_files_removed=1)
    except OSError as exc:
        logger.warning("kvchunk fs tier: could not remove bad chunk file %s: %s", path, exc)


def load_chunk(path: str, dest: memoryview, key_id: bytes, io: ChunkIO) -> None:
    """Read and verify one chunk file into ``dest``; :class:`ChunkFileError` if it is bad.

    ``dest`` may hold some of the file's bytes after a failure (the caller's load
    job fails, so they are never used).
    """
    fd = os.open(path, os.O_RDONLY | (O_DIRECT if io.o_direct else 0))
    st = os.fstat(fd)
    try:
        expected = HEADER_SIZE + len(dest)
        if st.st_size != expected:
            raise ChunkFileError(path, "size")
        page = _header_page()
        if os.readv(fd, [page, dest]) != expected:
            raise ChunkFileError(path, "size")
        digest = check_header(path, page, len(dest), key_id, io.namespace)
        if _digest(dest) != digest:
            raise ChunkFileError(path, "checksum")
    except ChunkFileError as exc:
        io.counters.bad(path, exc.why)
        logger.warning("kvchunk fs tier: %s: %s; the chunk is recomputed", path, exc.strerror)
        _discard(path, st, io)
        raise
    finally:
        os.close(fd)


def _slices(view: memoryview, offsets: Sequence[int], size: int) -> list[memoryview]:
    flat = view.cast("B")
    for off in offsets:
        if off < 0 or off + size > len(flat):
            raise ValueError(f"chunk offset {off} (+{size}) is outside a {len(flat)}-byte region")
    return [flat[off : off + size] for off in offsets]


def batch_store_chunks(
    paths: Sequence[str],
    key_ids: Sequence[bytes],
    view: memoryview,
    offsets: Sequence[int],
    size: int,
    io: ChunkIO,
) -> None:
    """Store a job's chunks (region rows at ``offsets``); raises on the first error."""
    for path, kid, payload in zip(paths, key_ids, _slices(view, offsets, size), strict=True):
        store_chunk(path, payload, kid, io)
        io.counters.add(files_stored=1)


def batch_load_chunks(
    paths: Sequence[str],
    key_ids: Sequence[bytes],
    view: memoryview,
    offsets: Sequence[int],
    size: int,
    io: ChunkIO,
) -> None:
    """Load a job's chunks; on failure the ``OSError`` carries ``num_succeeded``
    (the chunks loaded before the first failing one), as vLLM's ``batch_load_block``.

    After a failure the job's remaining files are still read and verified (and
    discarded when bad), though vLLM will not use them: a bad file is never
    left behind unread, so a later request does not fail on it again.
    """
    first: OSError | None = None
    for i, (path, kid, dest) in enumerate(
        zip(paths, key_ids, _slices(view, offsets, size), strict=True)
    ):
        try:
            load_chunk(path, dest, kid, io)
        except OSError as exc:
            if first is None:
                exc.num_succeeded = i  # type: ignore[attr-defined]
                first = exc
            continue
        if first is None:
            io.counters.add(files_loaded=1)
    if first is not None:
        raise first


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
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


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
