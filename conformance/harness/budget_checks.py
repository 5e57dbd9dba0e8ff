"""Checks of a kvchunk file tier's byte budget (:mod:`vllm_adapter.disk.budget`) for the lanes.

What :mod:`conformance.lanes.test_tiered_budget` holds the tier to, judged from the
root itself and from the reference, not from the tier's own model:

* :func:`budget_files`: the bytes the budget covers, every file under the root but
  the ledger, its lock, the geometry files and vLLM's ``config.json`` (temporary
  files included: an in-flight write was reserved before it began).  The directory
  is listed whole before any file is stat-ed: a store unlinks its victims before it
  creates its file, so a file created while the listing ran means its victims were
  gone before the stats, and two files that never coexisted are never summed;
* :class:`BoundWatch`: that sum against the budget after every job the tier reports
  finished (its ``get_finished_jobs``, which vLLM's tiering manager polls);
* :class:`ReferenceJudge`: the keys on disk that no lookup could load,
  :meth:`reference.eviction.Disk.stranded` over a
  :class:`~reference.prefix_structure.PrefixStructure` built from the requests'
  whole hash chains and the keys of the files really on disk;
* :func:`quiescent_problems`: at quiescence, everything above plus the ledger (after a
  replay) naming exactly the files on disk, each with its real size.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reference.eviction import Disk
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.keys import split_key
from reference.knobs import BlocksPerChunk, Chunking, resolve
from reference.prefix_structure import PrefixStructure
from vllm_adapter.disk import budget as DB
from vllm_adapter.disk import ledger_snapshot as LS
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk import packed_snapshot as PS
from vllm_adapter.disk import tier as S
from vllm_adapter.disk.chunk_file import QUARANTINE_DIR, TEMP_SUFFIX
from vllm_adapter.disk.lease import LEASE_DIR

__all__ = [
    "METADATA_FILES",
    "BoundWatch",
    "ReferenceJudge",
    "budget_files",
    "file_loads",
    "root_bytes",
    "full_attention_chunking",
    "quiescent_problems",
    "tier_files",
]

METADATA_FILES = frozenset({DB.LEDGER_FILE, DB.LOCK_FILE, S.GEOMETRY_FILE, "config.json",
                            PS.SNAPSHOT_FILE, LS.SNAPSHOT_FILE})
"""Files under a root the budget does not cover as files (the module docstring of
:mod:`vllm_adapter.disk.budget`: the ledger's reserve holds them); a ledger being compacted
(``<ledger>.<pid>.compact``), an index snapshot being written (``<snapshot>.<...>.tmp``)
and a ledger snapshot being written (``<snapshot>.<owner>.writing``) neither."""


def full_attention_chunking(block_size: int, blocks_per_chunk: int) -> Chunking:
    """The reference chunking of one full-attention group hashed per block."""
    group = KVGroup(0, GroupKind.FULL, block_size)
    return resolve(Geometry((group,), tokens_per_hash=block_size), BlocksPerChunk(blocks_per_chunk))


def file_loads(tier: S.KvchunkFileTierManager) -> int:
    """Chunks ``tier`` loaded from files (chunk files, or packed sections)."""
    c = tier.counters
    return c.files_loaded if tier.layout == "per_chunk" else c.sections_loaded


def root_bytes(root: Path | str) -> dict[str, int]:
    """Path (relative to ``root``) -> bytes on disk (``st_blocks``) of EVERY file under the
    root: the budget covers them all, the ledger, its lock, the leases, the geometry files
    and the quarantine included (:func:`vllm_adapter.disk.ledger.ledger_reserve`)."""
    sizes: dict[str, int] = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            sizes[os.path.relpath(path, root)] = max(st.st_size, st.st_blocks * 512)
    return sizes


def budget_files(root: Path | str) -> dict[str, int]:
    """Path (relative to ``root``) -> size of every data file (the files a ledger names,
    temporary files, orphans), leaving out the ledger's own files (:data:`METADATA_FILES`,
    the leases, a compaction's temporary journal) and a packed tier's index snapshot: listed
    whole, then stat-ed; a file gone before its stat is left out."""
    listed: list[str] = []
    for dirpath, _, names in os.walk(root):
        if os.path.basename(dirpath) == LEASE_DIR:
            continue
        for name in names:
            if name in METADATA_FILES or name.startswith((DB.LEDGER_FILE, PS.SNAPSHOT_FILE,
                                                          LS.SNAPSHOT_FILE)):
                continue
            listed.append(os.path.join(dirpath, name))
    sizes: dict[str, int] = {}
    for path in listed:
        try:
            sizes[os.path.relpath(path, root)] = os.stat(path).st_size
        except FileNotFoundError:
            continue
    return sizes


def _describe(sizes: Mapping[str, int], limit: int = 12) -> str:
    items = sorted(sizes.items())
    text = ", ".join(f"{p} ({n} B)" for p, n in items[:limit])
    return text + (f", ... {len(items) - limit} more" if len(items) > limit else "")


@dataclass
class BoundWatch:
    """Sums :func:`budget_files` after every job ``tier`` reports finished (wraps its
    ``get_finished_jobs``) and keeps every excess over ``budget``."""

    tier: Any
    root: Path
    budget: int
    name: str = "tier"
    checks: int = 0
    job_checks: int = 0
    """Checks run because jobs finished (the others: :meth:`check` called by the lane)."""
    peak: int = 0
    excesses: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def install(self) -> BoundWatch:
        real = self.tier.get_finished_jobs

        def get_finished_jobs() -> list[Any]:
            results = list(real())
            if results:
                with self._lock:
                    self.job_checks += 1
                self.check(f"{len(results)} job(s) of {self.name} finished "
                           f"({', '.join(str(r.job_id) for r in results)})")
            return results

        self.tier.get_finished_jobs = get_finished_jobs
        return self

    def check(self, when: str) -> int:
        sizes = root_bytes(self.root)
        total = sum(sizes.values())
        with self._lock:
            self.checks += 1
            self.peak = max(self.peak, total)
            if total > self.budget:
                self.excesses.append(f"{when}: {total} bytes on the root > budget {self.budget} "
                                     f"(by {total - self.budget}): {_describe(sizes)}")
        return total


class ReferenceJudge:
    """Reachability by the reference, from the requests' whole hash chains."""

    def __init__(self, chunking: Chunking) -> None:
        self.chunking = chunking
        self.structure = PrefixStructure(chunking)
        self._seen: set[tuple[bytes, ...]] = set()

    def observe(self, block_hashes: Iterable[Any]) -> None:
        chain = tuple(bytes(h) for h in block_hashes)
        if chain not in self._seen:
            self._seen.add(chain)
            self.structure.observe(list(chain))

    def stranded(self, files: Mapping[str, Sequence[bytes]]) -> dict[str, list[bytes]]:
        """File -> its keys no lookup with an empty GPU cache could load, the files being
        ``files`` (path -> keys); every key must be in one file only."""
        disk = Disk(self.structure)
        for keys in files.values():
            disk.add(tuple(keys), 1, ready=True)
        bad = disk.stranded()
        out = {p: [k for k in keys if k in bad] for p, keys in files.items()}
        return {p: ks for p, ks in out.items() if ks}


def _ledger_entry(ledger: DB.RootLedger, rel: str) -> tuple[tuple[bytes, ...], int, bool] | None:
    """The ledger's (keys, reserved bytes, written) of a file (path relative to the root)."""
    entry = ledger.entry(rel)
    return None if entry is None else entry[:3]


def tier_files(tier: S.KvchunkFileTierManager) -> tuple[dict[str, tuple[bytes, ...]], list[str]]:
    """Path (relative to the root) -> keys of every file of ``tier``'s namespace on disk, and
    what could not be read.  Packed: the keys its header names (read from the file);
    per-chunk: the ledger's key, which vLLM's ``FileMapper`` must name by that path."""
    root = tier.budget.root
    files: dict[str, tuple[bytes, ...]] = {}
    problems: list[str] = []
    if tier.layout == "packed":
        for path in P.iter_packed_files(tier.namespace_dir):
            try:
                header = P.read_packed_index(path, tier.io.namespace, tier.io.checksum)
            except OSError as exc:
                problems.append(f"{path}: header unreadable ({exc})")
                continue
            files[os.path.relpath(path, root)] = tuple(bytes(s.key) for s in header.sections)
        return files, problems
    for dirpath, _, names in os.walk(tier.namespace_dir):
        if QUARANTINE_DIR in dirpath:
            continue
        for name in names:
            if not name.endswith(".bin"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), root)
            entry = _ledger_entry(tier.budget.ledger, rel)
            if entry is None:
                problems.append(f"{rel}: a chunk file the ledger does not name (its key unknown)")
                continue
            keys = entry[0]
            named = [tier.file_mapper.get_file_name(k) for k in keys]
            if named != [os.path.join(root, rel)]:
                problems.append(f"{rel}: the ledger's keys {[k.hex()[:16] for k in keys]} are "
                                f"named {named} by vLLM's FileMapper")
            files[rel] = keys
    return files, problems


def quiescent_problems(
    tiers: Sequence[S.KvchunkFileTierManager], root: Path, budget: int, judge: ReferenceJudge,
) -> list[str]:
    """Everything wrong with the root once no I/O is in flight (an empty list: nothing):
    bytes over ``budget``; a temporary file; a ledger of one of ``tiers`` (replayed) naming
    other files than the disk holds, a reservation still pending, a file whose real size is
    not its reserved size; a key in two files; a key the reference finds stranded."""
    problems: list[str] = []
    every = root_bytes(root)
    total = sum(every.values())
    if total > budget:
        problems.append(f"{total} bytes on the root > budget {budget}: {_describe(every)}")
    sizes = budget_files(root)
    temps = sorted(p for p in sizes if p.endswith(TEMP_SUFFIX))
    if temps:
        problems.append(f"temporary files with no write in flight: {temps}")
    for i, tier in enumerate(tiers):
        ledger = tier.budget.ledger
        ledger.removed_since([])  # replays what every engine appended
        named = ledger.files()
        missing = sorted(set(named) - set(sizes))
        unnamed = sorted(set(sizes) - set(named) - set(temps))
        pending = sorted(p for p, ready in named.items() if not ready)
        if missing or unnamed or pending:
            problems.append(f"ledger {i}: names {len(named)} files, the root holds {len(sizes)}; "
                            f"named, not on disk: {missing[:6]}; on disk, not named: "
                            f"{unnamed[:6]}; still reserved: {pending[:6]}")
        for rel in sorted(set(named) & set(sizes)):
            entry = _ledger_entry(ledger, rel)
            if entry is not None and entry[1] != sizes[rel]:
                problems.append(f"ledger {i}: {rel} reserved {entry[1]} bytes, holds {sizes[rel]}")
    files: dict[str, tuple[bytes, ...]] = {}
    for tier in tiers[:1]:  # one namespace: every tier sees the same files
        found, unreadable = tier_files(tier)
        problems += unreadable
        files.update(found)
    owner: dict[bytes, str] = {}
    for path, keys in files.items():
        for k in keys:
            if k in owner:
                problems.append(f"key {k.hex()[:16]} in two files: {owner[k]} and {path}")
            owner[k] = path
    if not any("two files" in p for p in problems):
        for path, bad in judge.stranded(files).items():
            problems.append(
                f"stranded by the reference: {path} keys "
                f"{[(k.hex()[:16], split_key(k)[1]) for k in bad]} (their prefix is not on disk)")
    return problems
