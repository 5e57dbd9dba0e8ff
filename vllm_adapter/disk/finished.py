"""When a request's stores can strand nothing more: the moment its window chunks are judged.

vLLM's chunked prefill stores a boundary's window chunks in steps before its
full-attention chunk, so the ledger admits window keys *pending* their boundary
(:meth:`reference.eviction.Disk.arrives_stranded`).  If the full-attention store is then
refused (it does not fit) or a sibling window chunk never comes, those keys stay on disk
and no lookup can load them.  They may leave only once no store of theirs can still come:
the request that stored them is finished (vLLM calls ``on_request_finished`` once no
cascade of it can follow: ``SecondaryTierManager.on_request_finished``) and each of its
store tasks is done.  Between chunked-prefill steps of a live request they must stay: the
next step may store the boundary's full-attention chunk.

:class:`FinishedRequests` tracks, per request, the store tasks not yet done and the keys
its store jobs carried (the tier gives it their window keys: only those can be left so); :meth:`~FinishedRequests.task_done` and
:meth:`~FinishedRequests.finished` return those keys exactly once, at whichever of the two
comes last.  The tier then drops the stranded ones off vLLM's scheduler thread
(:meth:`vllm_adapter.disk.ledger.RootLedger.drop_finished`).  Thread-safe; no I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = ["FinishedRequests"]


@dataclass
class _Request:
    tasks: int = 0
    """Store tasks submitted and not yet done."""
    keys: dict[bytes, None] = field(default_factory=dict)
    """The keys of the request's store jobs, in the order they came."""
    finished: bool = False


class FinishedRequests:
    """Per request: store tasks in flight, the keys stored, whether vLLM finished it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}

    def stored(self, req_id: str, keys: Iterable[bytes], tasks: int) -> None:
        """A store job of ``req_id`` with ``keys`` was submitted as ``tasks`` pool tasks."""
        with self._lock:
            r = self._requests.setdefault(req_id, _Request())
            r.tasks += tasks
            r.keys.update(dict.fromkeys(keys))

    def task_done(self, req_id: str) -> tuple[bytes, ...] | None:
        """One store task of ``req_id`` is done (written, failed or refused); the request's
        keys when it was its last and vLLM had already finished the request."""
        with self._lock:
            r = self._requests[req_id]
            r.tasks -= 1
            return self._take(req_id, r)

    def finished(self, req_id: str) -> tuple[bytes, ...] | None:
        """vLLM finished ``req_id`` (no store of it follows); its keys when no store task of
        it is in flight.  None for a request that stored nothing."""
        with self._lock:
            r = self._requests.get(req_id)
            if r is None:
                return None
            r.finished = True
            return self._take(req_id, r)

    def _take(self, req_id: str, r: _Request) -> tuple[bytes, ...] | None:
        if not r.finished or r.tasks:
            return None
        del self._requests[req_id]
        return tuple(r.keys)

    def __len__(self) -> int:
        """Requests tracked: live, or finished with store tasks in flight."""
        with self._lock:
            return len(self._requests)
