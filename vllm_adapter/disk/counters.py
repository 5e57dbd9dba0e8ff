"""The base of a tier's counters: named counts, added to under one lock.

:class:`~vllm_adapter.disk.chunk_file.TierCounters` (what a file tier did) and
:class:`~vllm_adapter.disk.ledger.BudgetCounters` (what its root's budget did) declare
their fields on top of :class:`Counters`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

__all__ = ["Counters"]


@dataclass
class Counters:
    """Counts a subclass declares as dataclass fields (thread-safe: every change and
    reading of them holds ``_lock``)."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, kw_only=True)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)
