"""``KvchunkTieringOffloadingSpec``: vLLM's tiered offloading with a file tier that never serves wrong KV.

Selected like any out-of-tree offloading spec (the same keys as vLLM's
``TieringOffloadingSpec``; only ``spec_name`` / ``spec_module_path`` differ)::

    "kv_connector_extra_config": {
        "spec_name": "KvchunkTieringOffloadingSpec",
        "spec_module_path": "vllm_adapter.disk.tier",
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
"KvchunkFileTierManager", "module_path": "vllm_adapter.disk.tier"}``).

**Chunk files** (:mod:`vllm_adapter.disk.chunk_file`): a 4 KiB header (format
version, checksum algorithm, payload length, namespace and key digests, a 128-bit
BLAKE3 digest of the payload), then the payload; written atomically (temporary
name, then rename); a file that fails any check is a failed load, recomputed
through vLLM's own failed-promotion path, and deleted or quarantined.  A tier
sweeps temporary files a dead writer left behind when it starts.

**Namespace**: files live under ``<root_dir>/kvchunk-v<version>-<digest>/``, the
digest (BLAKE3, 128 bits) of :func:`~vllm_adapter.disk.options.geometry`: the model,
KV dtype, KV cache layout (and canonical / replicated layout), tokens per hash, blocks
per chunk, worker KV bytes per block, bytes per chunk and per file payload, per group its
index, tokens per block, layer names, window in chunks and blocks per chunk, the
TP/PP/PCP/DCP sizes, world size and rank, the format version and the checksum
algorithm.  vLLM hands the spec no per-group page size (``OffloadingConfig``
carries the per-worker sum, ``worker_kv_bytes_per_block``); any change of a
group's page changes that sum or the row, and the per-file payload length check
and digest stand behind it.  ``kvchunk-geometry.json`` in that directory records
the fields.  vLLM's ``FileMapper`` names the files inside it.

**Layouts** (``"layout"``): ``"per_chunk"`` (the default) writes one chunk
file per key, as vLLM's tier does, named by vLLM's ``FileMapper``.  ``"packed"``
writes **one or two files per store job** (:mod:`vllm_adapter.disk.packed_file`, the
layout of :mod:`reference.packed`): the tiering manager hands the tier every key of one
GPU->CPU store as one job; its full-attention keys become the sections of one file and
its window keys (the groups with a window) the sections of another
(:func:`reference.packed.store_job_files`; a job of one kind writes one file), reserved
and completed together, so that the eviction rule can evict a window file alone.  A job
of at least twice ``store_part_bytes`` (8 MiB) of new sections is written by several
tasks of vLLM's pool, one contiguous range of sections each, the first reserving, the
last writing the headers and completing; a load job of at least twice ``load_part_bytes``
(8 MiB) is several tasks too, one slice of its sections each (each slice opening the files
it reads; :func:`reference.packed_split.load_slices`, the rule the reference counts opens
and reads with), the last reporting the job (:mod:`vllm_adapter.disk.packed_split`).  The
packed tier answers ``lookup(key)`` from an in-memory index, key -> (file, section),
which it fills when it starts from its index snapshot (one file written at shutdown and
every ``SNAPSHOT_SECONDS`` while the index changes, validated against a listing:
:mod:`vllm_adapter.disk.packed_snapshot`) and the headers of the files the snapshot does
not describe, and a background thread keeps up with other engines' files (within
``POLL_SECONDS`` plus one
ledger replay; the lookup itself never waits on the root's lock); a key
already in the index is not written again; a load opens each file it needs once
and reads adjacent sections in one call, without reading the file's header when one
``fstat`` shows the file the index holds (same device, inode, size and mtime:
:mod:`vllm_adapter.disk.packed_io`), and verifies each section's checksum; a section
that fails verification fails its key alone and leaves the index.

Options of the tier (``secondary_tiers`` entry, besides vLLM's fs-tier keys
``root_dir``, ``n_read_threads``, ``n_write_threads``, ``enable_kv_events``,
``locality``, ``backpressure``): ``"layout": "per_chunk" | "packed"``,
``"checksum": "xxh3-128" | "blake3"`` (the payload checksum; the namespace
includes it), ``"bad_files": "delete" | "quarantine"``, ``"fsync": false | true``
(fsync each file before the rename; off by default, as vLLM's tier).  Every bad
value is a ``ValueError`` naming the key and a valid value, raised when the spec
is built, before vLLM sees it; ``root_dir`` is expanded (``~``, ``~user``),
created and probed for writing there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from reference import packed as RP
from reference import packed_split as RS
from vllm_adapter import names
from vllm_adapter import vllm_api as V
from vllm_adapter.disk import budget as DB
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk.chunk_file import (
    CHECKSUM,
    FORMAT_VERSION,
    HEADER_SIZE,
    MAGIC,
    QUARANTINE_DIR,
    TEMP_SUFFIX,
    ChunkFileError,
    ChunkIO,
    TierCounters,
    batch_load_chunks,
    batch_store_chunks,
    key_digest,
    load_chunk,
    store_chunk,
    sweep_stale_temps,
)
from vllm_adapter.disk.fileio import TierFileIO
from vllm_adapter.disk.finished import FinishedRequests
from vllm_adapter.disk.metrics import TierStats, metric_definitions, with_kvchunk_tiers
from vllm_adapter.disk.options import (
    DEFAULT_LAYOUT,
    check_tier_options,
    geometry,
    kvchunk_tier_configs,
    namespace_digest,
    usable_root,
    where_of,
)
from vllm_adapter.disk.packed_io import IndexStart, PackedIndex
from vllm_adapter.disk.packed_snapshot import SNAPSHOT_FILE
from vllm_adapter.disk.packed_split import (
    PART_BYTES,
    SplitLoad,
    SplitStore,
    pool_threads,
    split_load_job,
    store_job_parts,
)
from vllm_adapter.disk.tier_budget import (
    POLL_SECONDS,
    TierBudget,
    key_positions,
    reserve_files,
    store_files,
)
from vllm_adapter.files import write_text_atomic
from vllm_adapter.spec import count_option
from vllm_adapter.tiering import ReferenceTieringOffloadingSpec

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "POOL_THREAD_KEYS",
    "ChunkFileError",
    "ChunkIO",
    "KvchunkFileTierManager",
    "KvchunkTieringOffloadingSpec",
    "TierCounters",
    "batch_load_chunks",
    "batch_store_chunks",
    "configured_load_split",
    "configured_pool_threads",
    "key_digest",
    "live_tiers",
    "load_chunk",
    "namespace_files",
    "store_chunk",
]

logger = logging.getLogger(__name__)

GEOMETRY_FILE = "kvchunk-geometry.json"
SNAPSHOT_SECONDS = 60.0
"""A packed tier's follower writes its index snapshot this often while the index changes
(and the tier at shutdown): a start after a crash reads the headers of the files written
since (:mod:`vllm_adapter.disk.packed_snapshot`)."""
SNAPSHOT_RESERVE_SHARE = 8
"""The index snapshot takes at most this share of the ledger's reserve."""


# ---------------------------------------------------------------------------
# The tier and the spec
# ---------------------------------------------------------------------------


_LIVE: weakref.WeakSet[KvchunkFileTierManager] = weakref.WeakSet()


class NamespaceFiles(NamedTuple):
    """A namespace's data files and its writers' temporary files, as one walk found them."""

    files: list[str]
    temps: list[str]


def namespace_files(namespace_dir: str, layout: str) -> NamespaceFiles:
    """The data files of ``layout`` under ``namespace_dir`` (packed: its packed files,
    :func:`~vllm_adapter.disk.packed_file.iter_packed_files`'s paths; per chunk: its
    ``.bin`` files, the quarantine left out) and its writers' temporary files, in one
    walk: a start lists the namespace once, for the ledger and the packed index."""
    top, data_suffix = ((os.path.join(namespace_dir, P.PACKED_DIR), P.PACKED_SUFFIX)
                        if layout == "packed" else (namespace_dir, ".bin"))
    found = NamespaceFiles([], [])
    for d, _, names_ in os.walk(top):
        if QUARANTINE_DIR in d:
            continue
        for n in names_:
            if n.endswith(data_suffix):
                found.files.append(os.path.join(d, n))
            elif n.endswith(TEMP_SUFFIX):
                found.temps.append(os.path.join(d, n))
    return found


def live_tiers() -> list[KvchunkFileTierManager]:
    """The kvchunk file tiers alive in this process (the conformance lanes read their counters)."""
    return list(_LIVE)


VLLM_METHODS_MIRRORED: dict[str, dict[str, str]] = {
    "0.33.0": {"__init__": "1a61caeb392d0a5c", "submit_store": "06fef249ab22c192",
               "submit_load": "a48594d698b760c0", "get_finished_jobs": "4f6c74569799121b"},
    "0.34.0": {"__init__": "6995abb1ef4ead47", "submit_store": "ef3f684b1fdb0e51",
               "submit_load": "a48594d698b760c0", "get_finished_jobs": "6e905c534b61d9fd"},
}
"""What :class:`KvchunkFileTierManager` was written against, per vLLM release: the first
16 hex digits of SHA-256 of each ``FileSystemTierManager`` method's source (dedented).
``submit_store`` / ``submit_load`` here re-state vLLM's (the job bookkeeping in its
private ``_store_jobs``, ``_job_block_counts``, ``_load_job_keys``, ``_load_progress``,
``_pool``, ``_block_size``, set up by ``__init__`` and read by ``get_finished_jobs``)
around kvchunk's file I/O: vLLM has no hook for the I/O alone.
``tests/test_safe_fs.py::test_the_vllm_methods_kvchunk_mirrors_have_not_drifted`` fails,
naming the method, when the installed vLLM's differ: review this class, then the digest."""


class KvchunkFileTierManager(V.FileSystemTierManager):
    """vLLM's ``FileSystemTierManager`` whose files are checksummed, geometry-namespaced and atomic.

    Per-chunk layout: lookups, the thread pool, the job bookkeeping and the
    failed-load handling are vLLM's; :meth:`submit_store` / :meth:`submit_load`
    call :func:`batch_store_chunks` / :func:`batch_load_chunks` instead of vLLM's
    ``batch_store_block`` / ``batch_load_block``, and vLLM's ``FileMapper``
    names the files under the geometry namespace directory.  Packed layout: one
    or two files per store job, its full-attention keys and its window keys apart
    (:mod:`vllm_adapter.disk.packed_file`), lookups from
    :class:`~vllm_adapter.disk.packed_io.PackedIndex`; the thread pool, job bookkeeping and
    failed-load handling stay vLLM's.

    Nothing vLLM's scheduler thread calls waits on another process: packed lookups read
    the index only, and a ``kvchunk-fs-follow`` daemon thread per tier follows the root's
    ledger (other engines' new and evicted files) every
    :data:`~vllm_adapter.disk.tier_budget.POLL_SECONDS`, stopped by :meth:`shutdown` or when
    the tier is garbage-collected.  Staleness bound: another engine's store is a MISS, and
    its eviction may still be a HIT (the load then fails and vLLM recomputes), for at most
    ``POLL_SECONDS`` plus one follower pass (the wait for the root's lock while another
    engine holds it, a ledger replay, the new files' header reads); see :meth:`lookup`.
    """

    file_io_factory: Callable[[], TierFileIO] = TierFileIO
    """Builds each tier's :attr:`file_io`; a test replaces it to wrap the tier's I/O."""
    store_part_bytes: int = PART_BYTES
    """A packed store job is split into sub-tasks of at least this many payload bytes
    (:mod:`~vllm_adapter.disk.packed_split`); a test lowers it to split small jobs."""
    load_part_bytes: int = PART_BYTES
    """A packed load job of at least twice this many bytes is split into slices
    (:func:`reference.packed_split.load_slices`), one pool task each; 0: every load job is
    one task, as vLLM's.  ``python -m vllm_adapter config`` counts the opens and reads of
    the split a tier will use (:func:`configured_load_split`); a test sets 1 to split every
    job."""

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str | None = None,
        *,
        layout: str = DEFAULT_LAYOUT,
        checksum: str = CHECKSUM,
        bad_files: str = "delete",
        fsync: bool = False,
        disk_bytes_to_use: Any = None,
        eviction: str = "reachable",
        adopt_recorded_budget: bool = False,
        **kwargs: Any,
    ) -> None:
        check_tier_options(
            {"root_dir": root_dir, "layout": layout, "checksum": checksum,
             "bad_files": bad_files, "fsync": fsync, "eviction": eviction,
             "adopt_recorded_budget": adopt_recorded_budget,
             **{k: v for k, v in kwargs.items() if k in ("n_read_threads", "n_write_threads")}}
        )
        assert root_dir is not None
        assert primary_kv_view.strides is not None
        root_dir = usable_root(root_dir)
        fields = geometry(offloading_spec, int(primary_kv_view.strides[0]), layout=layout,
                          checksum=checksum)
        namespace = namespace_digest(fields)
        version = FORMAT_VERSION if layout == "per_chunk" else P.FORMAT_VERSION
        self.namespace_dir = os.path.join(root_dir, f"kvchunk-v{version}-{namespace.hex()}")
        """``<root_dir>/kvchunk-v<version>-<digest>``: this geometry's files, and only them."""
        super().__init__(
            offloading_spec, primary_kv_view, tier_type, root_dir=self.namespace_dir, **kwargs
        )
        self.layout = layout
        self.geometry = fields
        self.counters = TierCounters()
        self.file_io = type(self).file_io_factory()
        """Every file this tier reads or writes goes through it (:mod:`~vllm_adapter.disk.fileio`)."""
        self.io = ChunkIO(
            namespace=namespace,
            checksum=checksum,
            o_direct=bool(self._use_o_direct),
            fsync=fsync,
            bad_files=bad_files,
            quarantine_dir=os.path.join(self.namespace_dir, QUARANTINE_DIR),
            quarantine_root=root_dir,
            counters=self.counters,
        )
        _write_json_once(os.path.join(self.namespace_dir, GEOMETRY_FILE), fields)
        chunking = DB.budget_chunking(offloading_spec.config)
        budget = DB.parse_disk_bytes(disk_bytes_to_use, root_dir, where_of(None),
                                     min_bytes=DB.min_disk_bytes(
                                         layout, self._block_size,
                                         len(offloading_spec.config.groups), HEADER_SIZE,
                                         full_groups=len(chunking.full_groups)))
        self.budget = TierBudget(root_dir, self.namespace_dir, budget,
                                 DB.parse_eviction(eviction, where_of(None)), chunking,
                                 adopt_budget=adopt_recorded_budget, recycle=True)
        """The root's byte budget, shared with every engine writing under ``root_dir``; an
        evicted file no larger than a new one is overwritten as its temporary file
        (:mod:`vllm_adapter.disk.ledger`'s docstring)."""
        self.io = dataclasses.replace(self.io, quarantine_bytes=self.budget.ledger.ledger_bytes // 4)
        """The quarantine holds a quarter of the ledger's reserve, inside the budget."""
        self._stats = TierStats()
        """What get_stats reported last (:mod:`vllm_adapter.disk.metrics`)."""
        listing = namespace_files(self.namespace_dir, layout)
        self.started = self.budget.start(*listing)
        """What the start did: dead writers' reservations failed, orphans removed, evictions."""
        self.index = PackedIndex()
        """Packed layout: key -> (file, section), from the index snapshot and the headers of
        the files it does not describe (:meth:`PackedIndex.start`)."""
        self.index_started: IndexStart | None = None
        """Packed layout: how the index was filled at start."""
        self._snapshot_generation = -1
        """The index's generation the snapshot on disk shows (-1: none known)."""
        self._snapshot_at = time.monotonic()
        self._snapshot_refused = False
        """Whether a snapshot was too large (said once in the log)."""
        self._follow_lock = threading.Lock()
        """Serializes one ledger poll with its index update (the follower, a store)."""
        self._follow_stop = threading.Event()
        self.follower: threading.Thread | None = None
        """Packed layout: the ``kvchunk-fs-follow`` daemon thread (:meth:`lookup`)."""
        if layout == "packed":
            begun = time.perf_counter()
            started = self.index_started = self.index.start(
                self.namespace_dir, self.io, listing=self.budget.held(listing.files))
            if started.snapshot == "used" and not (started.from_headers or started.dropped):
                self._snapshot_generation = self.index.generation  # the snapshot is current
            if started.files or started.bad or started.snapshot != "missing":
                logger.info("kvchunk fs tier: indexed %d packed files (%d keys, %d bad) in %s "
                            "in %.2f s: %d from the index snapshot (%s, %d entries gone), %d "
                            "from their headers", started.files, len(self.index), started.bad,
                            self.namespace_dir, time.perf_counter() - begun,
                            started.from_snapshot, started.snapshot, started.dropped,
                            started.from_headers)
            self.follower = threading.Thread(
                target=_follow_root, args=(weakref.ref(self), self._follow_stop),
                name="kvchunk-fs-follow", daemon=True,
            )
            weakref.finalize(self, self._follow_stop.set)
            self.follower.start()
        self.sweeper = threading.Thread(
            target=self._sweep, name="kvchunk-fs-sweep", daemon=True
        )
        """Removes the temporary files dead writers left in this namespace, once, at start."""
        self.sweeper.start()
        self.requests = FinishedRequests()
        """Each request's store tasks in flight and keys stored, until vLLM finished it and
        they are done (:mod:`vllm_adapter.disk.finished`): then its stranded keys leave."""
        self._finisher = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kvchunk-fs-finish")
        """Runs the drop of a request finished with no store task in flight (never on vLLM's
        scheduler thread: it takes the root's lock)."""
        self._finish_last: concurrent.futures.Future[None] | None = None
        """The drop handed to it last (one thread, in order: when it is done, all are)."""
        _LIVE.add(self)

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, V.OffloadingMetricMetadata]:
        """kvchunk's counters and disk gauges (:func:`vllm_adapter.disk.metrics.metric_definitions`)."""
        return metric_definitions()

    def get_stats(self) -> V.OffloadingConnectorStats | None:
        """The counters' increases since the last call and the disk gauges, ``stranded_bytes``
        (O(files)) at most every 10 s (:meth:`vllm_adapter.disk.metrics.TierStats.sample`)."""
        return self._stats.sample(self.counters, self.budget)

    def _servable(self, key: bytes, path: str) -> bool:
        """Whether a load could still read ``key``, which the ledger holds in ``path``: its
        section is indexed, or its chunk file exists.  A packed file this tier has not
        indexed yet (another engine's, newer than this tier's last look at the ledger) is
        taken as the ledger says: only a tier that read the file can judge its keys."""
        if self.layout == "packed":
            return key in self.index or not self.index.has_file(path)
        return os.path.exists(self.file_mapper.get_file_name(key))

    def _file_bytes(self, keys: Sequence[bytes]) -> int:
        """Bytes of the file holding ``keys`` (what a store reserves)."""
        if self.layout == "per_chunk":
            return HEADER_SIZE + self._block_size
        return RP.packed_file_bytes([self._block_size] * len(keys), [len(k) for k in keys])

    def _sweep(self) -> None:
        try:
            self.counters.add(stale_temps_removed=sweep_stale_temps(self.namespace_dir))
        except OSError as exc:
            logger.warning("kvchunk fs tier: sweeping %s failed: %s", self.namespace_dir, exc)

    def _paths(self, keys: Iterable[Any]) -> tuple[list[str], list[bytes]]:
        keys = list(keys)
        return [self.file_mapper.get_file_name(k) for k in keys], [key_digest(k) for k in keys]

    def lookup(self, key: Any, req_context: Any) -> Any:
        """vLLM's scheduler thread asks: per-chunk layout, vLLM's lookup; packed layout, the
        in-memory index alone (its short in-process lock).  Nothing here touches the root's
        ledger or waits on another process: :meth:`_follow_ledger` runs on the
        ``kvchunk-fs-follow`` thread (and a store's pool thread).

        Staleness (packed layout): a key another engine stored is a MISS until the follower
        indexes its file, at most :data:`~vllm_adapter.disk.tier_budget.POLL_SECONDS` plus
        one follower pass (its wait for the root's lock, held by another engine for as long
        as its reservation or eviction takes, the ledger replay and the new files' header
        reads) after that engine's ``done`` record; a file another engine evicted may still
        be a HIT for the same window: its load then fails (the file is missing), vLLM
        recomputes the keys and the failed-load accounting drops the file from the index
        and the ledger."""
        if self.layout == "per_chunk":
            result = super().lookup(key, req_context)
        else:
            result = V.LookupResult.HIT if bytes(key) in self.index else V.LookupResult.MISS
        self.counters.add(**{"lookup_hits" if result == V.LookupResult.HIT else "lookup_misses": 1})
        return result

    def _follow_ledger(self, force: bool = False) -> None:
        """Packed layout: index the files other engines wrote, forget the files that left.

        Waits for the root's lock when the ledger changed (another engine may hold it for
        a whole eviction): call it from the follower thread or a pool thread, never from
        vLLM's scheduler thread."""
        with self._follow_lock:
            added, removed = self.budget.poll(force)
            for path in removed:
                self.index.drop_file(path)
            for path in added:
                if self.index.has_file(path):
                    continue
                # Indexed by the keys its ledger entry names, not opened: on a shared file
                # system every open is a round trip to the metadata server, and each engine
                # would open every file each peer writes; a load opens the file anyway and
                # reads its header then (vllm_adapter.metadata_model counts no such open).
                keys = self.budget.keys_of(path)
                if keys:
                    self.index.add_keys(path, keys)

    def stop_following(self, timeout: float = 5.0) -> None:
        """Stop the ``kvchunk-fs-follow`` thread (:meth:`shutdown` does; it also stops when
        the tier is garbage-collected).  Waits up to ``timeout`` seconds for its current pass
        (which may be waiting for the root's lock)."""
        self._follow_stop.set()
        follower = self.follower
        if follower is not None and follower is not threading.current_thread():
            follower.join(timeout)
            if follower.is_alive():
                logger.warning("kvchunk fs tier: the ledger follower of %s did not stop "
                               "within %.1f s (waiting for the root's lock?)",
                               self.namespace_dir, timeout)

    def shutdown(self) -> None:
        """vLLM's (the lookup manager, the I/O pool), after the ledger follower stops; then
        the packed index's snapshot is written (the next start reads it instead of every
        file's header) and the ledger closed."""
        self.stop_following()
        super().shutdown()
        self._finisher.shutdown(wait=True)  # after the pool: no store task submits a drop now
        if self.layout == "packed":
            try:
                self.save_index_snapshot()
            except Exception as exc:  # the next start reads the headers: slower, as correct
                logger.warning("kvchunk fs tier: writing the index snapshot of %s failed: %s",
                               self.namespace_dir, exc)
        self.budget.close()  # pending reads journaled, the root's lease released

    def snapshot_max_bytes(self) -> int:
        """The most bytes the index snapshot may take: an eighth of the ledger's reserve
        (the journal compacts at half of it, the quarantine keeps a quarter), so the root
        stays within ``disk_bytes_to_use``."""
        return self.budget.ledger.ledger_bytes // SNAPSHOT_RESERVE_SHARE

    def save_index_snapshot(self, force: bool = False) -> int | None:
        """Packed layout: write the index snapshot
        (:mod:`~vllm_adapter.disk.packed_snapshot`) when the index changed since the last
        one (or ``force``); its bytes, or None when none was written (unchanged, or larger
        than :meth:`snapshot_max_bytes`)."""
        generation = self.index.generation
        if generation == self._snapshot_generation and not force:
            return None
        self._snapshot_at = time.monotonic()
        self._snapshot_generation = generation
        if not self.index.files():  # nothing to describe: a start lists no file either
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.namespace_dir, SNAPSHOT_FILE))
            return None
        written = self.index.save_snapshot(self.namespace_dir, self.io,
                                           self.snapshot_max_bytes())
        if written is None and not self._snapshot_refused:
            self._snapshot_refused = True
            logger.info("kvchunk fs tier: the index snapshot of %s (%d files) would pass %d "
                        "bytes (an eighth of the ledger's reserve): not written, the next start "
                        "reads the files' headers", self.namespace_dir, self.index.files(),
                        self.snapshot_max_bytes())
        return written

    def _snapshot_if_due(self) -> None:
        """The follower's part: the index snapshot every :data:`SNAPSHOT_SECONDS` while the
        index changes (a start after a crash reads the headers of the files since)."""
        if time.monotonic() - self._snapshot_at >= SNAPSHOT_SECONDS:
            self.save_index_snapshot()

    def submit_store(self, job_metadata: Any) -> None:
        keys = list(job_metadata.keys)
        positions = key_positions(job_metadata.req_context)
        V.fs_tier_track_store(self, job_metadata)
        offsets = [int(cid) * self._block_size for cid in job_metadata.chunk_ids]
        tasks = (self._packed_store_tasks(keys, offsets, positions) if self.layout == "packed"
                 else [self._store_task(keys, offsets, positions)])
        req_id = getattr(job_metadata.req_context, "req_id", None)
        if req_id is not None:  # its window keys: only those can be left stranded
            full = self.budget.chunking.full_groups
            self.requests.stored(req_id, (bytes(k) for k in keys
                                          if P.group_of_key(bytes(k)) not in full), len(tasks))
            tasks = [self._counted(req_id, t) for t in tasks]
        self._job_block_counts[job_metadata.job_id] = len(keys)
        self._pool.enqueue_store(job_metadata.job_id, len(tasks), tasks)

    def _counted(self, req_id: str, task: Callable[[], None]) -> Callable[[], None]:
        """``task``, then the request's count of store tasks in flight less one; the last
        task of a request vLLM has finished drops its stranded keys before it returns (so
        the job is reported done after the drop: :meth:`drain_jobs` waits for both)."""
        def counted() -> None:
            try:
                task()
            finally:
                keys = self.requests.task_done(req_id)
                if keys:
                    self._drop_finished(keys)
        return counted

    def on_request_finished(self, req_context: Any) -> None:
        """vLLM's (its lookup bookkeeping released); then, when no store task of the
        request is in flight, the drop of its stranded keys is handed to the
        ``kvchunk-fs-finish`` thread (otherwise its last store task runs it)."""
        super().on_request_finished(req_context)
        keys = self.requests.finished(req_context.req_id)
        if keys:
            try:
                self._finish_last = self._finisher.submit(self._drop_finished, keys)
            except RuntimeError:  # shut down: the engine is stopping, its keys stay
                logger.debug("kvchunk fs tier: request %s finished after shutdown",
                             req_context.req_id)

    def _drop_finished(self, keys: Sequence[bytes]) -> None:
        """A finished request's keys no lookup can load leave the ledger, the disk and the
        index (:meth:`vllm_adapter.disk.ledger.RootLedger.drop_finished`); ``keys``: its
        window keys (a request that stored none takes no lock).  A failure is logged: the
        keys stay, counted stranded, and a store never fails for it."""
        if not keys:
            return
        try:
            gone = self.budget.drop_finished(keys)
        except Exception as exc:
            logger.warning("kvchunk fs tier: dropping a finished request's stranded keys "
                           "in %s failed: %s", self.namespace_dir, exc)
            return
        for path in gone:
            self.index.drop_file(path)

    def drain_jobs(self) -> None:
        """vLLM's (the I/O pool idle), then the drops of finished requests done."""
        super().drain_jobs()
        last = self._finish_last
        if last is not None:
            last.result()

    def _store_task(self, keys: list[Any], offsets: list[int], positions: dict[bytes, int]) -> Any:
        paths, ids = self._paths(keys)
        row = {bytes(k): (path, kid, off)
               for k, path, kid, off in zip(keys, paths, ids, offsets, strict=True)}

        def write(path: str, keys_: tuple[bytes, ...]) -> None:
            _, kid, off = row[keys_[0]]
            self.file_io.store_chunks([path], [kid], self._primary_kv_view, [off],
                                      self._block_size, self.io,
                                      [self.budget.take_recycled(path)])

        def store_task() -> None:
            self._store([[bytes(k)] for k in keys], lambda ks: row[bytes(ks[0])][0], write,
                        positions)

        return store_task

    def _store(self, files: list[list[bytes]], name_of: Any, write: Any,
               positions: dict[bytes, int], written: Any = None) -> list[str]:
        """:func:`~vllm_adapter.disk.tier_budget.store_files` (reserve, write, complete; any
        exception fails the reservation), counting a refused or failed store once."""
        try:
            return store_files(self.budget, files, name_of, self._file_bytes, write, positions,
                               self._servable, written)
        except BaseException:
            self.counters.add(store_failures=1)
            raise

    def _store_threads(self) -> int:
        """The pool's threads (a job's sub-tasks are at most these)."""
        return pool_threads(self._pool)

    @property
    def load_split(self) -> RS.LoadSplit | None:
        """How this tier splits a packed load job (:func:`reference.packed_split.load_slices`:
        the rule :mod:`reference.layout_economics` counts its opens and reads with); None:
        it does not (:attr:`load_part_bytes` 0)."""
        if not self.load_part_bytes:
            return None
        return RS.LoadSplit(self._store_threads(), self.load_part_bytes)

    @property
    def section_bytes(self) -> int:
        """A packed section's payload: one CPU-tier row, every group."""
        return int(self._block_size)

    def _packed_store_tasks(self, keys: list[Any], offsets: list[int],
                            positions: dict[bytes, int]) -> list[Any]:
        # A file's sections go group-major, each group in prefix order (the order of the
        # reference's store job, reference.plan_state.store_job_of), whatever order vLLM
        # hands the keys in (0.33.0 hands a set): a load of consecutive chunks is then one
        # read per group, as reference.layout_economics counts it.
        new = sorted(((bytes(k), off) for k, off in zip(keys, offsets, strict=True)
                      if bytes(k) not in self.index),
                     key=lambda ko: (P.group_of_key(ko[0]), positions.get(ko[0], 0)))
        offset_of = dict(new)

        def write(path: str, new_keys: tuple[bytes, ...]) -> Any:
            self._follow_ledger(force=True)  # the files this store evicted leave the index
            return self.file_io.store_packed(
                path, new_keys, self._primary_kv_view, [offset_of[k] for k in new_keys],
                self._block_size, self.io, self.budget.take_recycled(path),
            )

        # Its full-attention keys in one file, its window keys in another (a job with one
        # kind: one file), reserved and completed together (reference.packed.store_job_files).
        files = [list(f) for f in RP.store_job_files([k for k, _ in new],
                                                     self.budget.chunking.full_groups)]

        def name_of(ks: Sequence[bytes]) -> str:
            return P.packed_name(self.namespace_dir, ks)

        n = store_job_parts(len(new), self._block_size, self._store_threads(),
                            self.store_part_bytes)
        if n > 1:  # queue depth inside the job (vllm_adapter.disk.packed_split)
            def reserve() -> list[tuple[str, tuple[bytes, ...]]]:
                admitted = reserve_files(self.budget, files, name_of, self._file_bytes,
                                         positions, self._servable)
                self._follow_ledger(force=True)  # the files this store evicted leave the index
                return admitted

            def complete(results: list[tuple[str, bool]]) -> None:
                for path in self.budget.complete(results):
                    self.index.drop_file(path)

            return SplitStore(
                n, reserve=reserve, complete=complete, written=self.index.add,
                failed=lambda _: self.counters.add(store_failures=1), file_io=self.file_io,
                io=self.io, view=self._primary_kv_view, offset_of=offset_of,
                size=self._block_size, recycled=self.budget.take_recycled,
            ).tasks

        def store_task() -> None:
            if not files:
                return
            gone = self._store(files, name_of, write, positions, written=self.index.add)
            for path in gone:
                self.index.drop_file(path)

        return [store_task]

    def _account_failed_load(self, files: Sequence[str], rids: dict[str, str],
                             failed_by_file: Mapping[str, Sequence[bytes]]) -> None:
        """The ledger learns what a failed load found: files gone (discarded as bad, or
        vanished) leave it; a file whose sections failed keeps its other keys.  ``rids``:
        the reservations the load read, so that a file stored anew since is left alone."""
        self.budget.forget([p for p in files if not os.path.exists(p)], rids)
        for path, keys in failed_by_file.items():
            if os.path.exists(path) and path in rids:
                for gone in self.budget.drop_keys(path, keys, rids[path]):
                    self.index.drop_file(gone)

    def submit_load(self, job_metadata: Any) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        self._load_job_keys[job_id] = keys
        self._job_block_counts[job_id] = len(keys)
        offsets = [int(cid) * self._block_size for cid in job_metadata.chunk_ids]
        if self.layout == "packed":
            files = list(dict.fromkeys(w[0] for k in keys if (w := self.index.get(bytes(k)))))
            split = self._split_load_tasks(job_id, keys, offsets, files)
            if split:  # queue depth inside the job (reference.packed_split.load_slices)
                self._pool.enqueue_load(job_id, len(split), split)
                return

            def load() -> None:
                self.file_io.load_packed(self.index, keys, self._primary_kv_view, offsets,
                                  self._block_size, self.io)
        else:
            paths, ids = self._paths(keys)
            files = paths

            def load() -> None:
                self.file_io.load_chunks(paths, ids, self._primary_kv_view, offsets, self._block_size,
                                  self.io)

        def load_task() -> None:
            rids = self.budget.rids(files)  # what this load reads; later records touch only it
            try:
                with self.budget.reading(files):  # none of them is recycled meanwhile
                    load()
            except OSError as exc:
                # Written before the pool publishes the job (as vLLM's tier does).
                self._load_progress[job_id] = int(getattr(exc, "num_succeeded", 0))
                self.counters.add(load_failures=1)
                self._account_failed_load(files, rids, getattr(exc, "failed_by_file", {}))
                raise
            finally:
                self.budget.touch(files, rids)  # journaled in batches

        # One task per job, as vLLM's tier, below twice load_part_bytes.  One task per file of
        # a job was tried: on the 2-core bench VM it did not read faster (0.72-0.80x vLLM's
        # per-chunk loads, one task per job 0.71-0.96x over two runs of nox -s bench,
        # 2026-12-04); a large job's slices are _split_load_tasks.
        self._pool.enqueue_load(job_id, 1, [load_task])

    def _split_load_tasks(self, job_id: Any, keys: list[Any], offsets: list[int],
                          files: list[str]) -> list[Any]:
        """A packed load job of at least twice ``load_part_bytes`` as sub-tasks, one per
        slice (:func:`~vllm_adapter.disk.packed_split.load_job_slices`), with the one-task
        load's accounting, once per job: the reservations read, taken before any slice
        loads; on failure the keys before the first failed key in job order written to
        ``_load_progress`` before the pool publishes the job, one ``load_failures``, the
        failed files and keys accounted; the files touched.  Empty: one task (a small job,
        or a key the index cannot place by its section yet)."""
        found = split_load_job(self.index, keys, self._block_size, self.load_split)
        if found is None:
            return []
        plan, slices = found

        def load(keys_: Sequence[Any], offsets_: Sequence[int]) -> None:
            self.file_io.load_packed(self.index, keys_, self._primary_kv_view, offsets_,
                                     self._block_size, self.io, plan=plan)

        def begin() -> dict[str, str]:
            rids = self.budget.rids(files)
            self.budget.begin_reading(files)  # none of them is recycled until the last slice
            return rids

        def end(rids: dict[str, str] | None, error: BaseException | None) -> None:
            if rids is None:  # begin failed: as the one-task load, before it loads
                return
            self.budget.end_reading(files)
            try:
                if isinstance(error, OSError):
                    self._load_progress[job_id] = int(getattr(error, "num_succeeded", 0))
                    self.counters.add(load_failures=1)
                    self._account_failed_load(files, rids, getattr(error, "failed_by_file", {}))
            finally:
                self.budget.touch(files, rids)

        return SplitLoad(keys, offsets, slices, [plan.path_of[bytes(k)] for k in keys],
                         begin=begin, load=load, end=end).tasks


POOL_THREAD_KEYS = V.FS_TIER_POOL_PARAMETERS
"""The fs tier entry's keys whose threads vLLM's pool starts (read- and write-priority)."""


def configured_pool_threads(tier_config: Mapping[str, Any]) -> int:
    """The threads vLLM's I/O pool starts for the fs tier entry ``tier_config`` (what
    :func:`~vllm_adapter.disk.packed_split.pool_threads` finds on the started tier):
    ``n_read_threads + n_write_threads``, each vLLM's ``FileSystemTierManager`` default
    when the entry does not give it (:func:`~vllm_adapter.vllm_api.fs_tier_pool_defaults`)."""
    defaults = V.fs_tier_pool_defaults()
    return sum(int(tier_config.get(k, defaults[k])) for k in POOL_THREAD_KEYS)


def configured_load_split(tier_config: Mapping[str, Any]) -> RS.LoadSplit | None:
    """How a packed tier started from the fs tier entry ``tier_config`` splits its load
    jobs (its :attr:`KvchunkFileTierManager.load_split`), known before it starts: what
    the operator CLI counts a packed load's opens and reads with."""
    part = KvchunkFileTierManager.load_part_bytes
    return RS.LoadSplit(configured_pool_threads(tier_config), part) if part else None


def _follow_root(tier_ref: weakref.ref[KvchunkFileTierManager], stop: threading.Event) -> None:
    """The ``kvchunk-fs-follow`` thread of one packed tier: every :data:`POLL_SECONDS`, the
    files other engines wrote join the tier's index and the files that left the root leave
    it.  Holds the tier only during a pass (a weak reference between passes), so it ends
    when the tier is garbage-collected, or when ``stop`` is set (:meth:`shutdown`)."""
    last_error = ""
    while not stop.wait(POLL_SECONDS):
        tier = tier_ref()
        if tier is None:
            return
        try:
            tier._follow_ledger(force=True)
            tier._snapshot_if_due()
            last_error = ""
        except Exception as exc:  # the next pass retries; lookups keep the index they have
            if repr(exc) != last_error:
                logger.warning("kvchunk fs tier: following the ledger of %s failed: %s",
                               tier.budget.root, exc)
            last_error = repr(exc)
        finally:
            del tier


def _write_json_once(path: str, data: Mapping[str, Any]) -> None:
    if os.path.exists(path):
        return
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True))


class KvchunkTieringOffloadingSpec(ReferenceTieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` (reference worker without CUDA) with kvchunk's file tier."""

    secondary_tier_configs: list[Any]
    """vLLM's parsed ``secondary_tiers``; its ``"fs"`` tiers are kvchunk's here."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, V.OffloadingMetricMetadata]:
        """vLLM's, with the ``"fs"`` tiers resolved as kvchunk's (as ``__init__`` does), so
        the frontend defines the names the kvchunk tier reports."""
        return super().build_metric_definitions(with_kvchunk_tiers(extra_config))

    def __init__(self, config: Any) -> None:
        extra = config.extra_config
        cpu_bytes = extra.get("cpu_bytes_to_use")
        try:
            ok = count_option("cpu_bytes_to_use", cpu_bytes) > 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                "'cpu_bytes_to_use' in kv_connector_extra_config must be the CPU tier's size "
                f"in bytes, a positive integer, e.g. {64 << 30} (64 GiB), got {cpu_bytes!r}"
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
