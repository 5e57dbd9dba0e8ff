"""What a kvchunk file tier does with its root's byte budget (:mod:`vllm_adapter.disk.budget`).

:class:`TierBudget` is the tier's side: absolute paths in, ledger paths (relative to
the root) inside; the request's prefix structure from vLLM's ``ReqContext`` (the end
token of every key of the request, recorded by vLLM's offloading scheduler); the
files other engines added or removed, for the tier's index.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from reference.eviction import EvictionRule
from reference.knobs import Chunking
from vllm_adapter.disk.budget import BudgetCounters, RootLedger

__all__ = ["POLL_SECONDS", "TierBudget", "key_positions"]

POLL_SECONDS = 0.02
"""Lookups replay the ledger at most this often (another engine's evictions and files)."""


def key_positions(req_context: Any) -> dict[bytes, int]:
    """Key -> end token of every key of a request (vLLM's ``ReqContext``, both releases)."""
    positions = getattr(req_context, "_offload_key_positions", None) or {}
    return {bytes(k): int(v) for k, v in positions.items()}


class TierBudget:
    """One tier's view of its root's budget (thread-safe)."""

    def __init__(self, root: str, namespace_dir: str, budget: int, rule: EvictionRule,
                 chunking: Chunking) -> None:
        self.root = root
        self.ns = os.path.relpath(namespace_dir, root)
        self.counters = BudgetCounters()
        self.ledger = RootLedger(root, budget, rule, self.counters)
        self.ledger.set_chunking(self.ns, chunking)
        self._last_poll = 0.0
        self._poll_lock = threading.Lock()

    @property
    def budget(self) -> int:
        return self.ledger.budget

    def _rel(self, path: str) -> str:
        return os.path.relpath(path, self.root)

    def _abs(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def start(self, on_disk: Iterable[str]) -> dict[str, int]:
        """Reconcile the ledger with this namespace's files and enforce the budget (see
        :meth:`RootLedger.start`); what it did."""
        return self.ledger.start(self.ns, (self._rel(p) for p in on_disk))

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
                                  else lambda key, rel: servable(key, self._abs(rel)))
        return None if out is None else [(self._abs(p), keys) for p, keys in out]

    def complete(self, results: Sequence[tuple[str, bool]]) -> list[str]:
        gone = self.ledger.complete([(self._rel(p), ok) for p, ok in results])
        return [self._abs(p) for p in gone]

    def drop_keys(self, path: str, keys: Iterable[bytes]) -> list[str]:
        return [self._abs(p) for p in self.ledger.drop_keys(self._rel(path), keys)]

    def touch(self, paths: Iterable[str]) -> None:
        self.ledger.touch(self._rel(p) for p in paths)

    def forget(self, paths: Iterable[str]) -> None:
        self.ledger.forget(self._rel(p) for p in paths)

    def poll(self, force: bool = False) -> tuple[list[str], list[str]]:
        """The files of this namespace other engines wrote, and the files that left the
        root, since the last call (absolute paths); replays the ledger at most every
        :data:`POLL_SECONDS` unless ``force``."""
        now = time.monotonic()
        if not force and now - self._last_poll < POLL_SECONDS:
            return [], []
        with self._poll_lock:
            self._last_poll = now
            added, removed = self.ledger.drain(self.ns, refresh=True)
        return [self._abs(p) for p in added], [self._abs(p) for p in removed]

    def snapshot(self, stranded: bool = False) -> dict[str, int]:
        """The budget's numbers: bytes and files on the root (every engine's), this tier's
        evictions and refusals, and (``stranded``: O(files)) the stranded bytes."""
        out = {"disk_budget_bytes": self.ledger.budget, **self.ledger.totals(),
               **self.counters.as_dict()}
        if stranded:
            out["stranded_bytes"] = self.ledger.stranded_bytes()
        return out
