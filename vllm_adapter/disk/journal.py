"""The codec of the values inside a root ledger's JSON records (:mod:`vllm_adapter.disk.ledger`).

Keys are hex strings (:func:`_hex`); a prefix-structure
:class:`~reference.prefix_structure.Fragment` is ``{"parents": [[key, parent or null],
...], "boundaries": [[key, [full keys], [window keys]], ...]}`` (:func:`_fragment_json`,
read back by :func:`_fragment_of`); a record's writer (``"owner"``) is ``[host, pid]``,
and :func:`_alive` says whether it may still be writing.  The records themselves (``op``
and its fields) are :class:`~vllm_adapter.disk.ledger.RootLedger`'s.  What these helpers
write is in every ledger on disk: they change only with the journal's format.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Sequence
from typing import Any

from reference.prefix_structure import Fragment

__all__ = ["_alive", "_fragment_json", "_fragment_of", "_hex"]


def _hex(keys: Iterable[bytes]) -> list[str]:
    return [k.hex() for k in keys]


def _fragment_json(f: Fragment) -> dict[str, Any]:
    return {"parents": [[k.hex(), None if p is None else p.hex()] for k, p in f.parents],
            "boundaries": [[b.hex(), _hex(full), _hex(win)] for b, full, win in f.boundaries]}


def _fragment_of(d: dict[str, Any]) -> Fragment:
    return Fragment(
        tuple((bytes.fromhex(k), None if p is None else bytes.fromhex(p)) for k, p in d["parents"]),
        tuple((bytes.fromhex(b), tuple(map(bytes.fromhex, full)), tuple(map(bytes.fromhex, win)))
              for b, full, win in d["boundaries"]),
    )


def _alive(owner: Sequence[Any]) -> bool:
    host, pid = owner
    if host != socket.gethostname():
        return True  # another host's writer is never presumed dead
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
