"""What a kvchunk file tier does with its root's byte budget (:mod:`vllm_adapter.disk.budget`).

:class:`TierBudget` is the tier's side: absolute paths in, ledger paths (relative to
the root) inside; the request's prefix structure from vLLM's ``ReqContext`` (the end
token of every key of the request, recorded by vLLM's offloading scheduler); the
files other engines added or removed, for the tier's index.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from reference.eviction import EvictionRule
from reference.knobs import Chunking
from vllm_adapter.disk.budget import BudgetCounters, RootLedger

__all__ = ["POLL_SECONDS", "StoreRefused", "TierBudget", "key_positions", "reserve_files",
           "store_files"]

POLL_SECONDS = 0.5
"""A packed tier's ``kvchunk-fs-follow`` thread replays the ledger this often (another
engine's evictions and files); lookups never do (:meth:`TierBudget.poll`).

Half a second: every poll is a ``stat`` of the journal at the file system's metadata
server, and one that finds it grown a replay under the root's lock (7 operations), per
engine (:mod:`vllm_adapter.metadata_model`); at 20 ms these were 50 stats and up to 350
replay operations a second per engine, whatever its traffic, and halved the engines a
2,700 operations/s server carries.  What staleness costs is bounded and safe: another
engine's new file is a miss (recomputed) for at most this long, and a file it evicted a
hit whose load fails (recomputed, and dropped from the index).  A store replays the
ledger under its reservation anyway, so the tier's own budget is never stale."""


def key_positions(req_context: Any) -> dict[bytes, int]:
    """Key -> end token of every key of a request (vLLM's ``ReqContext``, both releases)."""
    positions = getattr(req_context, "_offload_key_positions", None) or {}
    return {bytes(k): int(v) for k, v in positions.items()}


class TierBudget:
    """One tier's view of its root's budget (thread-safe)."""

    def __init__(self, root: str, namespace_dir: str, budget: int, rule: EvictionRule,
                 chunking: Chunking, *, adopt_budget: bool = False,
                 ledger: RootLedger | None = None, recycle: bool = False) -> None:
        self.root = root
        self._root_prefix = root.rstrip("/") + "/"
        self.ns = os.path.relpath(namespace_dir, root)
        self.chunking = chunking
        """The reference chunking of the tier's ``OffloadingConfig`` (the ledger's prefix
        structure of this namespace; its :attr:`~reference.knobs.Chunking.full_groups` split
        a packed store job's files)."""
        self.counters = ledger.counters if ledger is not None else BudgetCounters()
        self.ledger = ledger or RootLedger(root, budget, rule, self.counters,
                                           adopt_budget=adopt_budget,
                                           chunkings={self.ns: chunking})
        self.ledger.set_chunking(self.ns, chunking)
        self.recycle = recycle
        """A victim no larger than a new file becomes its temporary file
        (:meth:`RootLedger.reserve`); the writer takes it with :meth:`take_recycled`."""
        self._last_poll = 0.0
        self._poll_lock = threading.Lock()
        self._totals: dict[str, int] = {}
        """The ledger's totals :meth:`snapshot_nowait` read last."""

    @property
    def budget(self) -> int:
        return self.ledger.budget

    def _rel(self, path: str) -> str:
        # the tier's paths are joined under its root: slicing is exact and ~10x cheaper than
        # relpath, which a start calls once per file (8 % of a 20k-file ledger start; 60 %
        # of it when the fast path also refused a root under a hidden directory).  Only the
        # part below the root can hold a "." or ".." relpath would resolve.
        prefix = self._root_prefix
        if path.startswith(prefix):
            rel = path[len(prefix):]
            if "/." not in rel and not rel.startswith("."):
                return rel
        return os.path.relpath(path, self.root)

    def _abs(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def start(self, on_disk: Iterable[str], temps: Iterable[str] = ()) -> dict[str, int]:
        """Reconcile the ledger with this namespace's files (and its writers' temporary
        files) and enforce the budget (see :meth:`RootLedger.start`); what it did."""
        return self.ledger.start(self.ns, (self._rel(p) for p in on_disk),
                                 (self._rel(p) for p in temps))

    def held(self, paths: Sequence[str]) -> list[str]:
        """Of ``paths`` (absolute), those the ledger holds after replaying it: a start's
        listing less the files the start removed (orphans, evictions) and the files other
        engines removed since."""
        rel = [self._rel(p) for p in paths]
        gone = set(self.ledger.removed_since(rel))
        return [p for p, r in zip(paths, rel, strict=True) if r not in gone]

    def reserve(
        self, files: Sequence[Sequence[bytes]], name_of: Callable[[Sequence[bytes]], str],
        size_of: Callable[[Sequence[bytes]], int], positions: dict[bytes, int] | None = None,
        servable: Callable[[bytes, str], bool] | None = None,
    ) -> list[tuple[str, tuple[bytes, ...]]] | None:
        """:meth:`RootLedger.reserve` with absolute paths; ``positions``: :func:`key_positions`
        of the store job's request."""
        out = self.ledger.reserve(self.ns, files, lambda keys: self._rel(name_of(keys)), size_of,
                                  positions,
                                  None if servable is None
                                  else lambda key, rel: servable(key, self._abs(rel)),
                                  recycle=self.recycle)
        return None if out is None else [(self._abs(p), keys) for p, keys in out]

    def take_recycled(self, path: str) -> str | None:
        """The temporary file a recycled victim became for the pending file ``path``
        (absolute paths), or None: create one."""
        return self.ledger.take_recycled(self._rel(path))

    def reading(self, paths: Iterable[str]) -> Any:
        """A context in which a load of this engine reads ``paths`` (absolute): none is
        recycled meanwhile."""
        return self.ledger.reading(self._rel(p) for p in paths)

    def begin_reading(self, paths: Iterable[str]) -> None:
        """:meth:`reading` entered (a split load's first sub-task)."""
        self.ledger.begin_reading([self._rel(p) for p in paths])

    def end_reading(self, paths: Iterable[str]) -> None:
        """:meth:`reading` left (a split load's last sub-task)."""
        self.ledger.end_reading([self._rel(p) for p in paths])

    def complete(self, results: Sequence[tuple[str, bool]]) -> list[str]:
        gone = self.ledger.complete([(self._rel(p), ok) for p, ok in results])
        return [self._abs(p) for p in gone]

    def keys_of(self, path: str) -> tuple[bytes, ...]:
        """The keys the ledger says ``path`` holds (none: it does not hold the file)."""
        entry = self.ledger.entry(self._rel(path))
        return () if entry is None else entry[0]

    def rids(self, paths: Iterable[str]) -> dict[str, str]:
        """Path -> reservation id of the files a load is about to read (absolute paths):
        what the load reports later touches those reservations only."""
        return {self._abs(p): rid
                for p, rid in self.ledger.rids(self._rel(p) for p in paths).items()}

    def drop_keys(self, path: str, keys: Iterable[bytes], rid: str | None = None) -> list[str]:
        return [self._abs(p) for p in self.ledger.drop_keys(self._rel(path), keys, rid)]

    def drop_finished(self, keys: Iterable[bytes]) -> list[str]:
        """A finished request's stranded keys leave (:meth:`RootLedger.drop_finished`);
        the paths removed (absolute)."""
        return [self._abs(p) for p in self.ledger.drop_finished(self.ns, keys)]

    def touch(self, paths: Iterable[str], rids: dict[str, str] | None = None) -> None:
        self.ledger.touch([self._rel(p) for p in paths],
                          None if rids is None else {self._rel(p): r for p, r in rids.items()})

    def forget(self, paths: Iterable[str], rids: dict[str, str] | None = None) -> None:
        """Files a load found gone; ``rids`` (:meth:`rids` when the load began): only those
        reservations, never a newer one of the same path."""
        rels = [self._rel(p) for p in paths]
        if rids is None:
            self.ledger.forget(rels)
        else:
            self.ledger.forget({self._rel(p): r for p, r in rids.items() if self._rel(p) in rels})

    def close(self) -> None:
        self.ledger.close()

    def poll(self, force: bool = False) -> tuple[list[str], list[str]]:
        """The files of this namespace other engines wrote, and the files that left the
        root, since the last call (absolute paths); replays the ledger at most every
        :data:`POLL_SECONDS` unless ``force``.

        When the ledger changed this takes the root's lock (another engine may hold it
        for a whole eviction): the tier calls it from its follower thread and its store
        tasks, never from vLLM's scheduler thread."""
        now = time.monotonic()
        if not force and now - self._last_poll < POLL_SECONDS:
            return [], []
        with self._poll_lock:
            self._last_poll = now
            added, removed = self.ledger.drain(self.ns, refresh=True)
        return [self._abs(p) for p in added], [self._abs(p) for p in removed]

    def snapshot_nowait(self, stranded: bool = False) -> dict[str, int]:
        """:meth:`snapshot` without waiting, for vLLM's scheduler thread (``get_stats``, every
        step).  While another thread of this process changes the ledger's model, the root's numbers
        are the last ones read and ``stranded_bytes`` is left out; this tier's counters are
        always current."""
        root: dict[str, int] = {}
        peeked = self.ledger.peek(stranded)
        if peeked is not None:
            if stranded:
                root["stranded_bytes"] = peeked.pop("stranded_bytes")
            self._totals = peeked
        return {"disk_budget_bytes": self.ledger.budget, **self._totals,
                **self.counters.as_dict(), **root}

    def snapshot(self, stranded: bool = False) -> dict[str, int]:
        """The budget's numbers: bytes and files on the root (every engine's), this tier's
        evictions and refusals, and (``stranded``: O(files)) the stranded bytes."""
        out = {"disk_budget_bytes": self.ledger.budget, **self.ledger.totals(),
               **self.counters.as_dict()}
        if stranded:
            out["stranded_bytes"] = self.ledger.stranded_bytes()
        return out


class StoreRefused(OSError):
    """The budget is full and nothing can be evicted: nothing written, nothing advertised."""


def reserve_files(
    budget: TierBudget, files: Sequence[Sequence[bytes]], name_of: Callable[[Sequence[bytes]], str],
    size_of: Callable[[Sequence[bytes]], int], positions: dict[bytes, int] | None = None,
    servable: Callable[[bytes, str], bool] | None = None,
) -> list[tuple[str, tuple[bytes, ...]]]:
    """:meth:`TierBudget.reserve`, a refusal raised as :class:`StoreRefused`: the files to
    write, ``(path, keys)``."""
    admitted = budget.reserve(files, name_of, size_of, positions, servable)
    if admitted is None:
        raise StoreRefused(errno.ENOSPC, f"kvchunk fs tier: disk_bytes_to_use "
                           f"({budget.budget}) is full and nothing can be evicted")
    return admitted


def store_files(
    budget: TierBudget, files: Sequence[Sequence[bytes]], name_of: Callable[[Sequence[bytes]], str],
    size_of: Callable[[Sequence[bytes]], int], write: Callable[[str, tuple[bytes, ...]], Any],
    positions: dict[bytes, int] | None = None,
    servable: Callable[[bytes, str], bool] | None = None,
    written: Callable[[str, Any], None] | None = None,
) -> list[str]:
    """The store protocol, one place: reserve (evicting by the rule), write each admitted
    file (``write(path, keys)``, atomic), complete.  Any exception of a write, not only an
    ``OSError``, completes that file's reservation as failed and is raised once every file
    is completed; a refused store raises :class:`StoreRefused`.  ``written(path, out)``
    runs for each file written (the packed index), before its reservation completes.
    Returns the paths the completions removed (files a failure stranded)."""
    admitted = reserve_files(budget, files, name_of, size_of, positions, servable)
    results: list[tuple[str, bool]] = []
    error: Exception | None = None
    for path, keys in admitted:
        try:
            out = write(path, keys)
            if written is not None:
                written(path, out)
            results.append((path, True))
        except Exception as exc:  # any failure fails the reservation (a dying process does not)
            results.append((path, False))
            error = error or exc
    gone = budget.complete(results)
    if error is not None:
        raise error
    return gone
