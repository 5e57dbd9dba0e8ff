"""The root ledger's journal: its records and their codec.

**Records** (one JSON object a line, :func:`encode` / :func:`decode`):

=========  ============================================================================
``op``     fields
=========  ============================================================================
``add``    ``rid`` (the reservation's id), ``ns``, ``path`` (relative to the root),
           ``bytes``, ``keys`` (hex), ``owner`` (the writer's lease id), ``fragment``
           (the prefix structure its keys need, :func:`fragment_json`)
``done``   ``rid``, ``ok``: the reservation's file was written (true) or failed
``rm``     ``rid``: the file left the root (evicted, discarded as bad, reclaimed)
``drop``   ``rid``, ``keys``: keys of the file no load can serve any more
``use``    ``rids``: files read (their recency), batched
``size``   ``rid``, ``bytes``: the file's real size, when a start found the record wrong
``budget`` ``bytes``: the root's budget, recorded by the first engine
=========  ============================================================================

Every record that changes a file names its reservation id, never its path alone: a
record about an older reservation of the same path (a stale ``forget`` after another
engine stored the file anew) changes nothing.  A line that is torn, not JSON, not an
object, of an unknown ``op``, or with a field of the wrong type or a key that is not hex
decodes to ``None`` and is skipped: a damaged journal never stops a start (its files
are then orphans, which a start removes).  Records of the first format (no ``rid``;
``owner`` ``[host, pid]``) decode with the path as their id.

Owners, their leases and the root's lock are :mod:`vllm_adapter.disk.lease`'s; a record
names its writer by that owner id.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from reference.prefix_structure import Fragment

__all__ = [
    "decode",
    "encode",
    "fragment_json",
    "fragment_of",
    "hex_keys",
]


_OPS = {"add", "done", "rm", "drop", "use", "size", "budget"}


def hex_keys(keys: Iterable[bytes]) -> list[str]:
    return [k.hex() for k in keys]


def fragment_json(f: Fragment) -> dict[str, Any]:
    return {"parents": [[k.hex(), None if p is None else p.hex()] for k, p in f.parents],
            "boundaries": [[b.hex(), hex_keys(full), hex_keys(win)] for b, full, win in f.boundaries]}


def fragment_of(d: Any) -> Fragment:
    return Fragment(
        tuple((bytes.fromhex(k), None if p is None else bytes.fromhex(p)) for k, p in d["parents"]),
        tuple((bytes.fromhex(b), tuple(map(bytes.fromhex, full)), tuple(map(bytes.fromhex, win)))
              for b, full, win in d["boundaries"]),
    )


def encode(record: dict[str, Any]) -> bytes:
    """One journal line (with its newline)."""
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def _keys(value: Any) -> tuple[bytes, ...]:
    if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
        raise TypeError("keys")
    return tuple(bytes.fromhex(k) for k in value)


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError("not a count")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError("not a name")
    return value


def decode(line: bytes) -> dict[str, Any] | None:
    """A record, checked and normalised (keys as bytes, ids as strings), or None when the
    line is not a whole, valid record (see the module docstring)."""
    try:
        rec = json.loads(line)
        if not isinstance(rec, dict) or rec.get("op") not in _OPS:
            return None
        op = rec["op"]
        legacy = "rid" not in rec and "rids" not in rec and op != "budget"
        if op == "use":
            ids = rec["paths"] if legacy else rec["rids"]
            if not isinstance(ids, list):
                return None
            return {"op": op, "rids": [_str(r) for r in ids], "legacy": legacy}
        if op == "budget":
            return {"op": op, "bytes": _int(rec["bytes"])}
        rid = _str(rec["path"] if legacy else rec["rid"])
        out: dict[str, Any] = {"op": op, "rid": rid, "legacy": legacy}
        if op == "add":
            owner = rec.get("owner")
            out.update(ns=_str(rec["ns"]), path=_str(rec["path"]), bytes=_int(rec["bytes"]),
                       keys=_keys(rec["keys"]), fragment=fragment_of(rec["fragment"]),
                       owner=owner if isinstance(owner, str) else _legacy_owner(owner))
        elif op == "done":
            out["ok"] = bool(rec["ok"])
        elif op == "drop":
            out["keys"] = _keys(rec["keys"])
        elif op == "size":
            out["bytes"] = _int(rec["bytes"])
        return out
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        return None


def _legacy_owner(owner: Any) -> str:
    """A first-format owner ``[host, pid]``, as a lease-less id (see :func:`owner_alive`)."""
    if isinstance(owner, list) and len(owner) == 2:
        return f"legacy:{owner[0]}:{owner[1]}"
    return "legacy::0"
