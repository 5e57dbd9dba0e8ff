"""The root ledger's journal: its records, their codec, and the owners' leases.

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

**Owners and leases** (:class:`Lease`): every ledger instance is an owner with a random
id; it holds an exclusive ``flock`` on ``<root>/kvchunk-owners/<id>.lease`` while it
lives.  An owner is alive while that lock is held (:func:`owner_alive`): no host name, no
pid, so a restarted container that gets the same pid, or an engine in another PID or UTS
namespace, is judged by its lease alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import uuid
from collections.abc import Iterable
from typing import Any

from reference.prefix_structure import Fragment

__all__ = [
    "LEASE_DIR",
    "Lease",
    "decode",
    "encode",
    "fragment_json",
    "fragment_of",
    "hex_keys",
    "owner_alive",
]

LEASE_DIR = "kvchunk-owners"
"""Under the root: one lease file per live owner."""

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


class FlockUnsupported(OSError):
    """The file system under the root has no working ``flock``."""


_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def flock(fd: int, how: int, where: str) -> None:
    """``fcntl.flock``; a file system without it is a :class:`FlockUnsupported` naming
    ``where``: the ledger never runs unprotected."""
    try:
        fcntl.flock(fd, how)
    except OSError as exc:
        if exc.errno in _NO_FLOCK:
            raise FlockUnsupported(
                exc.errno,
                f"kvchunk disk tier: the file system under {where!r} does not support flock "
                f"({os.strerror(exc.errno or 0)}); the root's byte budget is shared through a "
                f"flock-protected ledger, so the tier does not start there. Use a local file "
                f"system, or a shared one whose flock works across clients (NFSv4, CephFS)",
            ) from exc
        raise


class Lease:
    """This owner's lease on a root: an exclusive ``flock`` held while the owner lives."""

    def __init__(self, root: str, owner_id: str | None = None) -> None:
        self.id = owner_id or uuid.uuid4().hex[:16]
        self.dir = os.path.join(root, LEASE_DIR)
        os.makedirs(self.dir, exist_ok=True)
        self.path = os.path.join(self.dir, f"{self.id}.lease")
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, root)

    def release(self) -> None:
        """The owner is gone (a crash in a test, a tier closed): peers reclaim its
        reservations at their next acquisition of the ledger's lock."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def owner_alive(root: str, owner: str) -> bool:
    """Whether ``owner`` may still be writing: its lease is held.  A missing lease file is a
    dead owner; a lease found free is removed.  A first-format owner (``legacy:host:pid``)
    is judged by its pid on this host, and presumed alive on another host."""
    if owner.startswith("legacy:"):
        _, host, pid = owner.split(":", 2)
        if host != socket.gethostname() or not pid.isdigit():
            return True
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    path = os.path.join(root, LEASE_DIR, f"{owner}.lease")
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        with contextlib.suppress(OSError):
            os.unlink(path)
        return False
    finally:
        os.close(fd)
