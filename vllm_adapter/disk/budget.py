"""One byte budget per ``root_dir``, shared by every engine and rank that writes there.

**How engines share it: a ledger under a lock.**  ``<root_dir>/kvchunk-ledger.jsonl``
is a journal of what is on the root (:mod:`vllm_adapter.disk.journal`: a file reserved,
written or failed, read, removed, each record naming its reservation id).  Every change
is written under the root's lock (an ``flock`` of ``<root_dir>/kvchunk-ledger.lock`` among
the processes of one kernel, then the symlink ``<root_dir>/kvchunk-ledger.held`` among
hosts: :class:`~vllm_adapter.disk.lease.RootLock`), and every engine replays what the
others wrote before it decides anything, so all of them hold the same model of the
root: the same bytes, files, prefix structure and recency.  The rejected alternatives: ``statvfs`` sees other tenants' bytes and not which
file to evict; a directory scan per store is slow at 100k files and cannot see recency
or prefixes; a quota per engine is Mooncake's bug (#2419: every instance under its own
quota, none ever evicts, the disk fills).

**What the budget covers.**  Everything under the root: files get ``disk_bytes_to_use``
less the ledger's reserve (:func:`~vllm_adapter.disk.ledger.ledger_reserve`: 1/128, at
least 1 MiB, at most 1 GiB).  The reserve holds the journal (compacted while engines
run, once it passes half the reserve; if even the compacted journal does not fit,
files are evicted until it does), the lock and lease files (empty), the geometry files,
the quarantine (``"bad_files": "quarantine"`` keeps at most a quarter of the reserve,
the oldest bad file out first) and a packed tier's index snapshot (written only when it
fits in an eighth of the reserve: :mod:`vllm_adapter.disk.packed_snapshot`).

**Bound.**  A file's bytes are reserved (journaled) before it is written, and a victim
is unlinked (or recycled: renamed onto a new file's temporary name, after that file's
reservation) before its removal is journaled, so at every step of the store protocol,
crashes included (``tests/test_ledger_state_machine.py`` crashes an engine at each), the
bytes under the root stay within ``disk_bytes_to_use``.  **Reads are not pinned across
engines**: an engine may evict a file another engine is reading.  Unlinked, POSIX keeps
the open file readable and frees its blocks at close, so the excess over the budget is
at most the files of the loads in flight (per engine, ``n_read_threads`` files), for the
time of those reads (``tests/test_disk_bounds.py``); recycled, its blocks are the new
file's, and the reader's keys fail their checksums and are recomputed (never served
wrong).  An engine never recycles a file one of its own loads is reading
(:meth:`~vllm_adapter.disk.ledger.RootLedger.reading`).  Pinning across engines would
cost two journal appends under the lock per load.

**Eviction** is :mod:`reference.eviction`'s, through its public interface
(:meth:`~reference.eviction.Disk.next_victim`): the least recently used unit of every
namespace's evictable units goes first (the rule), or the least recently used file
(``"lru"``, the baseline).  A store that does not fit after evicting everything
evictable is refused: nothing is written, nothing is advertised, the tokens are
recomputed.

**One budget per root.**  The first engine records ``disk_bytes_to_use`` in the
journal.  An engine that starts with another value while an engine on the recorded one
runs refuses with a ``ValueError`` naming both values and the root, unless
``"adopt_recorded_budget": true``; when no engine runs on the root, a new value
replaces the recorded one (an operator's resize across a restart).

**Crashes and owners.**  Every ledger is an owner with a random id and a lease,
``<root_dir>/kvchunk-owners/<id>.lease`` (:class:`~vllm_adapter.disk.lease.Lease`): an
``flock`` held while it lives, judged by owners of the same kernel, and a heartbeat (the
file touched every ``lease_s / 4``), judged by owners on other hosts against the file
system's clock.  A reservation whose owner is dead is reclaimed by the next engine that
takes the ledger's lock, whoever it is: its file and temporary files removed, the files
its failure strands too.  No host name and no pid is trusted: a restarted container with
the same pid, or an engine in another PID or UTS namespace, is judged by its lease
(``tests/test_ledger_two_hosts.py``).  When a tier
starts it also reconciles the ledger with its namespace directory (names and sizes):
a file the ledger names and the directory lacks leaves it; a file the directory holds
and the ledger does not name is an orphan and is removed; a size that differs from its
record is corrected.  A damaged journal line is skipped, never fatal.

**Hosts.**  Engines on several hosts may share one root on any file system where
``symlink`` creation is atomic (POSIX; NFSv3/v4, CephFS, Lustre, GPFS): nothing relies on
``flock`` or ``O_APPEND`` across clients.  ``flock`` serves only among the processes of one
kernel (where it is coherent whatever the file system); across hosts the lock is the held
symlink, liveness the heartbeat, and the journal is written at the end it has under the
lock (opened afresh: close-to-open consistency gives its current size).  A file system
whose ``flock`` fails (``ENOLCK``, ``EOPNOTSUPP``) runs on the symlink and heartbeats
alone; one whose ``flock`` is silently local to each client (Lustre ``localflock``) is
harmless (``tests/test_ledger_across_hosts.py``).  **Bound:** the bytes under the root stay
within ``disk_bytes_to_use`` at every step, as on one host.  **Cost:** one global lock per
root, which every store and every batch of reads takes (a symlink and its removal more
than ``flock`` alone); a peer on another host reclaims a dead engine's lock and
reservations only once its lease is silent (30 s); an engine that stalls longer than that
while holding reservations loses them (counter ``reservations_lost``, its late files
removed), and one that stalls holding the lock may lose the lock: the one case the design
does not cover, as no lease without fencing tokens does.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from reference.eviction import EvictionRule
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.knobs import BlocksPerChunk, Chunking, resolve
from reference.packed import packed_file_bytes
from vllm_adapter import units
from vllm_adapter.disk.ledger import LEDGER_FILE, LOCK_FILE, BudgetCounters, RootLedger

__all__ = [
    "DISK_BYTES_KEY",
    "LEDGER_FILE",
    "LOCK_FILE",
    "BudgetCounters",
    "RootLedger",
    "VLLM_KEY_BYTES",
    "budget_chunking",
    "min_disk_bytes",
    "parse_disk_bytes",
    "parse_eviction",
    "suggested_disk_bytes",
]

DISK_BYTES_KEY = "disk_bytes_to_use"
EVICTION_RULES = {"reachable": EvictionRule.REACHABLE, "lru": EvictionRule.LRU}
GiB = 1 << 30


# ---------------------------------------------------------------------------
# The budget's value
# ---------------------------------------------------------------------------


def _fs_bytes(path: str) -> tuple[int, int]:
    """(size, free) of the file system holding ``path``, in bytes."""
    st = os.statvfs(path)
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def suggested_disk_bytes(root: str) -> int:
    """What to suggest when ``disk_bytes_to_use`` is missing: 80% of the free space
    under ``root`` rounded down to a GiB (at least 1 GiB)."""
    _, free = _fs_bytes(root)
    return max(GiB, (free * 8 // 10) // GiB * GiB)


VLLM_KEY_BYTES = 36
"""An offload key as vLLM makes it (``make_offload_key``): the block hash (32 bytes with the
default ``sha256`` prefix-caching hash), then the KV-cache group index (4 bytes)."""


def min_disk_bytes(
    layout: str, row_bytes: int, groups: int, chunk_header_bytes: int,
    key_bytes: int = VLLM_KEY_BYTES, *, full_groups: int | None = None,
) -> int:
    """The smallest ``disk_bytes_to_use`` a tier can store a chunk under: the files a full
    chunk needs.  ``"per_chunk"``: one chunk file (``chunk_header_bytes`` + one CPU-tier
    row of ``row_bytes``).  ``"packed"``: one section per offloaded KV-cache group
    (``groups``), each a row under a vLLM key, in the files a store job of that chunk
    writes (:func:`reference.packed.store_job_files`, reserved together): a file of the
    ``full_groups`` full-attention sections (None: every group is full attention) and a
    file of the other groups' (window) sections, each
    :func:`reference.packed.packed_file_bytes`: a budget below it refuses every store."""
    if layout == "per_chunk":
        return chunk_header_bytes + row_bytes
    full = groups if full_groups is None else full_groups
    if not 0 <= full <= groups:
        raise ValueError(f"min_disk_bytes: full_groups must be in [0, {groups}], got {full}")
    return sum(packed_file_bytes([row_bytes] * n, [key_bytes] * n)
               for n in (full, groups - full) if n)


def parse_disk_bytes(value: Any, root: str, where: str, min_bytes: int = 1) -> int:
    """``disk_bytes_to_use`` as an int, or a ``ValueError`` naming the key and a valid
    value.  Taken: an int, or a string the CLI's ``--disk-bytes`` takes
    (:func:`vllm_adapter.units.parse_bytes`: ``"1000000000000"``, ``"800GB"``,
    ``"4GiB"``; KB = 1000, KiB = 1024).  Refused: missing, anything else (``"1e12"``,
    ``1.5``, ``true``), not positive, below ``min_bytes`` (:func:`min_disk_bytes`: the
    files one chunk needs), above the file system."""
    suggestion = suggested_disk_bytes(root)
    example = f"e.g. {suggestion} ({suggestion / GiB:.0f} GiB, 80% of the free space under {root!r})"
    if value is None:
        raise ValueError(
            f"'{DISK_BYTES_KEY}' in {where} is required: the byte budget of the whole root_dir, "
            f"shared by every engine writing there (an unbounded disk tier fills its disk); "
            f"{example}. Choose it with python -m vllm_adapter config ... --sweep-disk"
        )
    parsed: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        parsed = value
    elif isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        parsed = int(value.strip())  # "0" is "not positive" below, as 0 is
    elif isinstance(value, str):
        with contextlib.suppress(ValueError):
            parsed = units.parse_bytes(value)
    if parsed is None:
        raise ValueError(
            f"'{DISK_BYTES_KEY}' in {where} must be a number of bytes: an integer, or a "
            f"string such as \"{suggestion // GiB}GiB\" or \"800GB\" (KiB = 1024, KB = 1000), "
            f"{example}; got {value!r}"
        )
    if parsed <= 0:
        raise ValueError(f"'{DISK_BYTES_KEY}' in {where} must be positive, {example}; got {parsed}")
    if parsed < min_bytes:
        raise ValueError(
            f"'{DISK_BYTES_KEY}' in {where} ({parsed}) is smaller than the files one chunk needs "
            f"on this tier ({min_bytes} bytes: a chunk file, or the packed files of one section "
            f"per KV-cache group); give at least {min_bytes}, {example}"
        )
    size, _ = _fs_bytes(root)
    if parsed > size:
        raise ValueError(
            f"'{DISK_BYTES_KEY}' in {where} ({parsed}) is larger than the file system under "
            f"{root!r} ({size} bytes); {example}"
        )
    return parsed


def parse_eviction(value: Any, where: str) -> EvictionRule:
    if value not in EVICTION_RULES:
        raise ValueError(
            f"'eviction' in {where} must be 'reachable' (never strands a file) or 'lru' "
            f"(plain per-file LRU, the baseline), got {value!r}"
        )
    return EVICTION_RULES[value]


def budget_chunking(config: Any) -> Chunking:
    """The reference chunking of a vLLM ``OffloadingConfig``, for the prefix structure.

    ``OffloadingConfig`` carries per group its tokens per block and vLLM's window in
    chunks (``None``: full attention); a windowed group becomes a reference group whose
    hits need exactly that many chunks before a boundary (a chunked-local group of
    ``window x tokens_per_chunk`` tokens).  EAGLE peeks are not in the config: a
    boundary's peek chunk is not part of its unit."""
    bpc = int(config.cache.blocks_per_chunk)
    groups = []
    for g in sorted(config.groups, key=lambda g: int(g.group_id)):
        tpb = int(g.tokens_per_block)
        window = g.sliding_window_size_in_chunks
        if window is None:
            groups.append(KVGroup(index=int(g.group_id), kind=GroupKind.FULL, tokens_per_block=tpb))
        else:
            groups.append(KVGroup(index=int(g.group_id), kind=GroupKind.CHUNKED_LOCAL,
                                  tokens_per_block=tpb,
                                  attention_chunk_size=int(window) * tpb * bpc))
    geometry = Geometry(tuple(groups), int(config.cache.tokens_per_hash), name=str(config.model.name))
    return resolve(geometry, BlocksPerChunk(bpc), retention_interval=None)
