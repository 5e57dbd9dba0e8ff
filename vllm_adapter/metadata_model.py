"""How many engines one shared file system carries: metadata operations per layout, stated.

A shared file system's metadata service (a CephFS MDS, a Lustre MDT, an NFS server) is a
**rate shared by every client**, not a per-thread latency: every engine's creates, opens,
renames, unlinks, directory calls and lookups queue at the same server.  This module counts
the metadata operations each disk layout asks per million prompt tokens, from the
reference's counts (:func:`reference.economics.economics`: files written, file opens of
every load, load jobs, requests; :mod:`reference.layout_economics`), prices one engine at
``T`` prompt tokens per second, and answers how many engines a file system of ``N``
metadata operations per second serves before its metadata saturates.

What one event costs, each call counted as one operation at the server (no client-side
metadata cache: the upper end; a close is not counted; a stat is priced as a create,
although on every file system of ``/work/shared/design/disk-anchors.md`` section 4 it is
10-100x cheaper).  The syscalls were read off ``strace`` of vLLM 0.34.0's ``fs_io_C`` and of
kvchunk's ledger (``reserve`` / write / ``complete``):

``per_chunk`` -- vLLM's fs tier (``vllm/v1/kv_offload/tiering/fs``; ``fs_io_C``'s
``batch_store_block`` / ``batch_load_block`` / ``batch_lookup``, shipped by the 0.33.0 and
0.34.0 wheels):

* a file stored (:data:`PER_CHUNK_STORE`): ``access(dest)`` (a lookup: is it there?),
  ``std::filesystem::create_directories(parent)`` (the C twin of ``io.py``'s
  ``_ensure_dirs`` / ``os.makedirs``, before **every** file: one ``stat`` of the existing
  directory; three calls, ``stat`` x2 + ``mkdir``, when the file's ``<hhh>/<hh>_g<group>``
  leaf directory is new, as it is for most files until a group holds about 2^20 files), a
  create (``open(tmp, O_CREAT|O_EXCL)``) and a rename (``rename(tmp, dest)``): 4;
* a file read (:data:`PER_CHUNK_LOAD`, every load: the CPU tier assumed not to hold it):
  the ``access`` that found it at lookup, and its ``open``: 2;
* per request and offloaded group (:data:`PER_CHUNK_MISS_PROBE`): the ``access`` of the key
  after the hit, which misses;
* nothing is ever unlinked (vLLM's fs tier never deletes: vllm#52784, vllm#54327).

``packed`` -- kvchunk's disk tier (``vllm_adapter.disk``), which needs a byte budget and
shares it through a journal under the root's lock (:mod:`vllm_adapter.disk.ledger`):

* a ledger transaction (:data:`LEDGER_TRANSACTION`, a store's ``reserve`` and its
  ``complete``): ``open`` the lock file, ``flock``, ``symlink`` the held lock, ``open`` the
  journal to replay the records other engines appended (its size from ``fstat``), ``open``
  it to write, the write (a shared file's size and write capability move between clients:
  counted as one operation), ``readlink`` and ``unlink`` the held lock, and the ``flock``'s
  release at ``close``: 9;
* a store job that writes files (:data:`PACKED_STORE_JOB`; a job's files are reserved
  together and completed together): two ledger transactions, 18;
* a file stored (:data:`PACKED_FILE`): the write's ledger poll (a ``stat``), and, a full
  budget in steady state evicting about a file per file written, the victim's rename onto
  the new file's temporary name (the ledger recycles it:
  :meth:`~vllm_adapter.disk.ledger.RootLedger.reserve`), its ``open``, and the rename into
  place (the victim's ``rm`` rides on the reserve's appends): 4, where unlinking the victim
  and creating the file would also be 4.  No directory call: a temporary file is created
  in its ``packed/<2 hex>`` directory, and the directory made, only when missing
  (:func:`vllm_adapter.disk.chunk_file.write_atomically`; 256 directories a namespace,
  each made once, and the tier never removes one);
* a file opened by a load (:data:`PACKED_LOAD`): its ``open`` (lookups answer from the
  in-memory index: none);
* a load job (:data:`PACKED_LOAD_JOB`): its ``use`` records, appended at the engine's next
  locked operation (``open`` ``O_APPEND`` + append; an upper bound, jobs may share one);
* per engine, whatever its traffic (:data:`FOLLOWER_POLLS_PER_S`): the ledger follower
  ``stat``s the journal every ``tier_budget.POLL_SECONDS``, and when other engines
  appended since (at most once per poll) replays it under the lock
  (:data:`FOLLOWER_REPLAY`: ``open`` lock, ``flock``, ``symlink``, ``open`` journal,
  ``readlink``, ``unlink``, release: 7);
* per engine and peer: nothing per file: the follower indexes each packed file another
  engine writes from the keys the journal names, without opening it (a load opens it,
  counted as :data:`PACKED_LOAD`).

Not counted: a tier's start (its directory walk and header reads), journal compaction,
``config.json``, ``fstat`` on an open descriptor, and reads and writes of data.
"""

from __future__ import annotations

from dataclasses import dataclass

from reference.economics import MILLION, Economics
from reference.layout_economics import PER_CHUNK, LayoutEconomics
from vllm_adapter.disk.tier_budget import POLL_SECONDS

__all__ = [
    "DEFAULT_FS_METADATA_OPS",
    "FOLLOWER_POLLS_PER_S",
    "FOLLOWER_REPLAY",
    "FS_METADATA_SOURCE",
    "LEDGER_TRANSACTION",
    "OP_KINDS",
    "PACKED_LOAD",
    "PACKED_LOAD_JOB",
    "PACKED_FILE",
    "PACKED_STORE_JOB",
    "PER_CHUNK_LOAD",
    "PER_CHUNK_MISS_PROBE",
    "PER_CHUNK_STORE",
    "MetadataEconomics",
    "MetadataLayout",
    "Ops",
    "engine_ops_per_second",
    "engines_served",
    "layout_ops",
    "metadata_economics",
]

DEFAULT_FS_METADATA_OPS = 2700
"""``--fs-metadata-ops``' default: the low end of the request rates one CephFS metadata
server was seen to serve (about 2.7k-12.5k requests/s; the MDS is single-threaded)."""
FS_METADATA_SOURCE = (
    "one CephFS MDS: about 2.7k-12.5k requests/s seen, the low end taken "
    "(/work/shared/design/disk-anchors.md section 4: red-hat-storage/ocs-operator#471, "
    "ceph/ceph#30592); for comparison Lustre creates run from about 500/s on one thread to "
    "about 15k-29k/s per metadata target, and FSx for Lustre provisions 1,500-192,000 "
    "metadata IOPS"
)
"""Where the default rate comes from (printed with it)."""

OP_KINDS = ("created", "opened", "renamed", "unlinked", "makedirs", "lookups",
            "ledger_locks", "ledger_appends")
"""The operation kinds, in the order every rendering shows them."""


@dataclass(frozen=True)
class Ops:
    """Metadata operations by kind (per event, or per million prompt tokens)."""

    created: float = 0
    """Files created (``open(O_CREAT|O_EXCL)`` of a temporary file)."""
    opened: float = 0
    """Existing files opened (a load's file, the ledger's lock file and journal)."""
    renamed: float = 0
    unlinked: float = 0
    makedirs: float = 0
    """The directory-ensuring call before a file is written (its ``stat`` and ``mkdir``
    calls)."""
    lookups: float = 0
    """``access`` / ``stat`` of a path outside ``makedirs``."""
    ledger_locks: float = 0
    """The root's lock: ``flock``, the held symlink's ``symlink``, ``readlink`` and
    ``unlink``, and the ``flock``'s release."""
    ledger_appends: float = 0

    @property
    def total(self) -> float:
        return sum(getattr(self, k) for k in OP_KINDS)

    def __add__(self, other: Ops) -> Ops:
        return Ops(**{k: getattr(self, k) + getattr(other, k) for k in OP_KINDS})

    def times(self, n: float) -> Ops:
        return Ops(**{k: getattr(self, k) * n for k in OP_KINDS})


PER_CHUNK_STORE = Ops(created=1, renamed=1, makedirs=1, lookups=1)
PER_CHUNK_LOAD = Ops(opened=1, lookups=1)
PER_CHUNK_MISS_PROBE = Ops(lookups=1)
LEDGER_TRANSACTION = Ops(opened=3, ledger_locks=5, ledger_appends=1)
PACKED_FILE = Ops(opened=1, renamed=2, lookups=1)
PACKED_STORE_JOB = LEDGER_TRANSACTION.times(2)
PACKED_LOAD = Ops(opened=1)
PACKED_LOAD_JOB = Ops(opened=1, ledger_appends=1)
FOLLOWER_POLLS_PER_S = round(1 / POLL_SECONDS)
"""The ledger follower's polls per second (``1 / tier_budget.POLL_SECONDS``)."""
FOLLOWER_REPLAY = Ops(opened=2, ledger_locks=5)
"""A follower poll that finds the journal grown: a replay under the lock (beyond its stat)."""
_PACKED_APPENDS_PER_STORE = 2
"""Journal appends per store job that writes files (``add`` at reserve, ``done`` at complete)."""


@dataclass(frozen=True)
class MetadataLayout:
    """One layout's metadata operations; per million prompt tokens unless named per second."""

    layout: str
    created_per_million: float
    opened_per_million: float
    renamed_per_million: float
    unlinked_per_million: float
    makedirs_per_million: float
    lookups_per_million: float
    ledger_locks_per_million: float
    ledger_appends_per_million: float
    ops_per_million: float
    """All of the above."""
    fixed_ops_per_second: float
    """Per engine whatever its traffic (kvchunk's ledger follower's polls)."""
    ops_per_second: float | None
    """One engine alone at ``prefill_tokens_per_s``: its traffic plus its fixed operations
    (``None`` without ``--prefill-tokens-per-s``)."""
    engines: int | None
    """The most engines whose operations together stay within ``fs_metadata_ops`` (with
    every peer's cost counted); ``None`` without ``--prefill-tokens-per-s``, or when an
    engine asks nothing."""
    ops_per_second_per_engine_at_engines: float | None
    """What each of those engines asks then (its replays of its peers' appends included)."""


@dataclass(frozen=True)
class MetadataEconomics:
    """``--fs-metadata-ops`` / ``--prefill-tokens-per-s``: engines per file system."""

    fs_metadata_ops: int
    fs_metadata_ops_source: str
    """``--fs-metadata-ops`` as given, or where the default comes from."""
    prefill_tokens_per_s: int | None
    """Prompt tokens one engine takes in per second (computed or loaded)."""
    cached_fraction: float
    """Prompt tokens not computed (GPU and offload hits): an engine that computes ``P``
    prompt tokens per second takes in about ``P / (1 - this)``."""
    layouts: tuple[MetadataLayout, ...]
    """``per_chunk`` (vLLM's fs tier), then ``packed`` (kvchunk's tier)."""


def engine_ops_per_second(n: int, per_engine: float, fixed: float = 0.0,
                          peer_appends: float = 0.0) -> float:
    """What each of ``n`` engines asks per second: ``per_engine`` (its traffic) + ``fixed``
    (its follower's polls, a ``stat`` each) + :data:`FOLLOWER_REPLAY` per poll that finds
    the journal grown (``peer_appends`` per peer, at most one per poll: ``fixed``; only a
    tier with a follower, ``fixed`` > 0)."""
    replays = min(fixed, (n - 1) * peer_appends)
    return per_engine + fixed + FOLLOWER_REPLAY.total * replays


def engines_served(capacity: float, per_engine: float, fixed: float = 0.0,
                   peer_appends: float = 0.0) -> int | None:
    """The largest ``E`` whose engines together ask at most ``capacity`` operations per
    second (``E x`` :func:`engine_ops_per_second` ``(E, ...)``); ``None`` when an engine
    asks nothing (no limit)."""
    def total(n: int) -> float:
        return n * engine_ops_per_second(n, per_engine, fixed, peer_appends)

    if total(1) <= 0:
        return None
    if total(1) > capacity:
        return 0
    low, high = 1, 2
    while total(high) <= capacity:
        low, high = high, high * 2
    while high - low > 1:  # each engine asks more as engines are added: total(n) grows
        mid = (low + high) // 2
        if total(mid) <= capacity:
            low = mid
        else:
            high = mid
    return low


def _layout(e: Economics, name: str, ops: Ops, fixed: float,
            appends: int, capacity: int, tokens_per_s: int | None) -> MetadataLayout:
    per_million = ops.times(e.per_million(1))
    rate = None if tokens_per_s is None else tokens_per_s / MILLION
    own = None if rate is None else per_million.total * rate
    peer_appends = 0.0
    if rate is not None and fixed:
        peer_appends = e.per_million(appends) * rate
    n = None if own is None else engines_served(capacity, own, fixed, peer_appends)
    return MetadataLayout(
        layout=name,
        **{f"{k}_per_million": getattr(per_million, k) for k in OP_KINDS},
        ops_per_million=per_million.total,
        fixed_ops_per_second=fixed,
        ops_per_second=None if own is None else own + fixed,
        engines=n,
        ops_per_second_per_engine_at_engines=None if own is None or not n
        else engine_ops_per_second(n, own, fixed, peer_appends),
    )


def layout_ops(e: Economics, layout: LayoutEconomics) -> tuple[Ops, Ops]:
    """``layout``'s metadata operations for the served workload ``e`` (totals of one pass):
    those of its stores, and those of its loads and lookups.  vLLM's per-chunk tier
    (:data:`PER_CHUNK_STORE` a file written; :data:`PER_CHUNK_LOAD` a file opened,
    :data:`PER_CHUNK_MISS_PROBE` per request and group), else kvchunk's packed tier
    (:data:`PACKED_FILE` a file, :data:`PACKED_STORE_JOB` a job that writes files;
    :data:`PACKED_LOAD` a file opened, :data:`PACKED_LOAD_JOB` a load job)."""
    if layout.layout == PER_CHUNK:
        return (PER_CHUNK_STORE.times(layout.files_written),
                PER_CHUNK_LOAD.times(layout.file_opens)
                + PER_CHUNK_MISS_PROBE.times(e.requests * len(e.groups)))
    return (PACKED_FILE.times(layout.files_written) + PACKED_STORE_JOB.times(layout.jobs_written),
            PACKED_LOAD.times(layout.file_opens) + PACKED_LOAD_JOB.times(e.load_jobs))


def metadata_economics(e: Economics, fs_metadata_ops: int | None = None,
                       prefill_tokens_per_s: int | None = None,
                       source: str | None = None) -> MetadataEconomics:
    """Both layouts' metadata operations for the served workload ``e`` (totals of one pass;
    :class:`Ops` per event above), one engine's rate at ``prefill_tokens_per_s`` and the
    engines a file system of ``fs_metadata_ops`` (default :data:`DEFAULT_FS_METADATA_OPS`)
    serves."""
    capacity = DEFAULT_FS_METADATA_OPS if fs_metadata_ops is None else fs_metadata_ops
    if source is None:
        source = FS_METADATA_SOURCE if fs_metadata_ops is None else "--fs-metadata-ops"
    per_chunk, packed = e.per_chunk, e.packed
    per_chunk_ops, packed_ops = (w + r for w, r in (layout_ops(e, per_chunk),
                                                     layout_ops(e, packed)))
    appends = _PACKED_APPENDS_PER_STORE * packed.jobs_written + e.load_jobs
    cached = (e.gpu_hit_tokens + e.offload_hit_tokens) / e.prompt_tokens if e.prompt_tokens \
        else 0.0
    return MetadataEconomics(
        fs_metadata_ops=capacity,
        fs_metadata_ops_source=source,
        prefill_tokens_per_s=prefill_tokens_per_s,
        cached_fraction=cached,
        layouts=(
            _layout(e, per_chunk.layout, per_chunk_ops, 0.0, 0,
                    capacity, prefill_tokens_per_s),
            _layout(e, packed.layout, packed_ops, float(FOLLOWER_POLLS_PER_S),
                    appends, capacity, prefill_tokens_per_s),
        ),
    )
