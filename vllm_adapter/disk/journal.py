"""The root ledger's journal: its records and their codec.

**Records** (one JSON object a line, :func:`encode` / :func:`decode`):

=========  ============================================================================
``op``     fields
=========  ============================================================================
``add``    ``rid`` (the reservation's id), ``ns``, ``path`` (relative to the root),
           ``bytes``, ``owner`` (the writer's lease id), the file's keys and the
           fragment of the prefix structure they need (:class:`~reference.prefix_structure.Fragment`),
           written compact (below); a record written before that names them in full:
           ``keys`` (hex) and ``fragment`` (:func:`fragment_json`)
``done``   ``rid``, ``ok``: the reservation's file was written (true) or failed
``rm``     ``rid``: the file left the root (evicted, discarded as bad, reclaimed)
``drop``   ``rid``, ``keys``: keys of the file no load can serve any more
``use``    ``rids``: files read (their recency), batched
``size``   ``rid``, ``bytes``: the file's real size, when a start found the record wrong
``budget`` ``bytes``: the root's budget, recorded by the first engine
=========  ============================================================================

**A compact ``add``** names each key once.  A key is a block hash and a 4-byte group
id (:func:`reference.keys.make_key`), and the keys a fragment names share a few hashes
(a boundary's keys, one per group, end at one hash), so the record carries:

=====  ================================================================================
field  holds
=====  ================================================================================
``h``  the hashes (hex): every named key's hash part (all its bytes but the last 4) and
       every boundary
``w``  the width of an index below: 1 byte (the default, left out) or 2 (big-endian)
``t``  the keys the record names (hex, pairs ``hash index, group id``: the key is
       ``h[i]`` then ``uint32_be(group)``); the first ``n`` are the file's keys, in order
``n``  how many of ``t`` are the file's keys
``p``  the fragment's parents (hex, pairs ``key index, parent key index``; a key that is
       its own parent has none: chunk 0)
``b``  the fragment's boundaries, ``[hash index, full key indices (hex), window key
       indices (hex)]``
=====  ================================================================================

Indices are hex strings rather than JSON numbers: the JSON decoder reads a string in
one step where each number is a token of its own (the record parses in well under half
the time), and an index is never negative.  A gemma-4 turn's record (11 keys; its
fragment names two boundaries of 10 and 20 window keys, 22 keys of 4 hashes in all) takes
about a fifth of its full form (750 bytes, not 3,640).  :func:`encode` writes the full
form only when the compact one cannot say the same: a key shorter than a group id or
listed twice, a key its own parent, an index or a group id past 2 bytes.

Records are built in the full form (``keys`` and ``fragment``, as :func:`hex_keys` and
:func:`fragment_json` give them) and :func:`encode` compacts them; :func:`decode` reads
both forms to the same record, line by line, so a journal written before (operators'
roots) replays as it did, new records are appended to it compact, and its next
compaction writes it compact whole.

Every record that changes a file names its reservation id, never its path alone: a
record about an older reservation of the same path (a stale ``forget`` after another
engine stored the file anew) changes nothing.  A line that is torn, not JSON, not an
object, of an unknown ``op``, or with a field of the wrong type, a key that is not hex
or an index that names nothing decodes to ``None`` and is skipped: a damaged journal
never stops a start (its files are then orphans, which a start removes).  Records of the
first format (no ``rid``; ``owner`` ``[host, pid]``) decode with the path as their id.

Owners, their leases and the root's lock are :mod:`vllm_adapter.disk.lease`'s; a record
names its writer by that owner id.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from typing import Any

from reference.keys import GROUP_ID_BYTES
from reference.prefix_structure import Fragment

__all__ = [
    "decode",
    "encode",
    "fragment_json",
    "fragment_of",
    "hex_keys",
]


_OPS = {"add", "done", "rm", "drop", "use", "size", "budget"}
_SUFFIX = [g.to_bytes(GROUP_ID_BYTES, "big") for g in range(256)]
"""The group ids of the first 256 groups, as a key's last bytes."""
_loads = json.JSONDecoder().decode


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
    """One journal line (with its newline); an ``add`` in the full form is written compact."""
    if record.get("op") == "add" and "keys" in record and "fragment" in record:
        compact = _compact_add(record)
        if compact is not None:
            record = compact
    return json.dumps(record, separators=(",", ":")).encode() + b"\n"


def _compact_add(record: dict[str, Any]) -> dict[str, Any] | None:
    """The compact form of a full ``add`` (the module docstring), or None when it cannot
    say the same (the full form is written then)."""
    hashes: dict[bytes, int] = {}
    pairs: list[int] = []
    index: dict[bytes, int] = {}

    def hash_at(h: bytes) -> int:
        return hashes.setdefault(h, len(hashes))

    def key_at(k: str) -> int:
        key = bytes.fromhex(k)  # as the full form's decoder reads it
        i = index.get(key)
        if i is None:
            if len(key) < GROUP_ID_BYTES:
                raise ValueError(k)
            pairs.extend((hash_at(key[:-GROUP_ID_BYTES]),
                          int.from_bytes(key[-GROUP_ID_BYTES:], "big")))
            i = index[key] = len(index)
        return i

    try:
        n = len([key_at(k) for k in record["keys"]])
        if n != len(index):
            return None  # a key listed twice: the full form keeps the list as it is
        frag = record["fragment"]
        parents: list[int] = []
        for k, p in frag["parents"]:
            i = key_at(k)
            j = i if p is None else key_at(p)
            if p is not None and j == i:
                return None  # a key its own parent
            parents += (i, j)
        bounds = [(hash_at(bytes.fromhex(b)), [key_at(k) for k in full], [key_at(k) for k in win])
                  for b, full, win in frag["boundaries"]]
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    top = max([*pairs, *parents, *(i for _, f, w in bounds for i in (*f, *w)), 0])
    width = 1 if top < 0x100 else 2 if top < 0x10000 else 0
    if not width:
        return None
    out = {k: v for k, v in record.items() if k not in ("keys", "fragment")}
    if width != 1:
        out["w"] = width
    out.update(h=[h.hex() for h in hashes], t=_hex(pairs, width), n=n, p=_hex(parents, width),
               b=[[b, _hex(f, width), _hex(w, width)] for b, f, w in bounds])
    return out


def _hex(values: list[int], width: int) -> str:
    return b"".join(v.to_bytes(width, "big") for v in values).hex()


def _ints(text: Any, width: int) -> Sequence[int]:
    """The indices a compact field holds (:func:`_hex`'s inverse)."""
    if not isinstance(text, str):
        raise TypeError("not hex")
    raw = bytes.fromhex(text)
    if len(raw) % width:
        raise ValueError("a torn index")
    return raw if width == 1 else struct.unpack(f">{len(raw) // 2}H", raw)


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


def _compact_keys_and_fragment(rec: dict[str, Any]) -> tuple[tuple[bytes, ...], Fragment]:
    """The file's keys and fragment of a compact ``add`` (the module docstring); an index
    that names nothing raises IndexError."""
    hashes = rec["h"]
    if not isinstance(hashes, list):
        raise TypeError("h")
    table = [bytes.fromhex(h) for h in hashes]
    width = rec.get("w", 1)
    if width not in (1, 2) or type(width) is not int:
        raise ValueError("w")
    pairs = _ints(rec["t"], width)
    keys = [table[i] + (_SUFFIX[g] if g < 0x100 else g.to_bytes(GROUP_ID_BYTES, "big"))
            for i, g in zip(pairs[0::2], pairs[1::2], strict=True)]
    n = _int(rec["n"])
    if n > len(keys):
        raise IndexError("more file keys than keys")
    flat = _ints(rec["p"], width)
    parents = tuple([(keys[k], None if p == k else keys[p])
                     for k, p in zip(flat[0::2], flat[1::2], strict=True)])
    bounds = rec["b"]
    if not isinstance(bounds, list):
        raise TypeError("b")
    boundaries = []
    for b, full, win in bounds:
        if type(b) is not int or b < 0:
            raise IndexError("a boundary names nothing")
        boundaries.append((table[b], tuple([keys[i] for i in _ints(full, width)]),
                           tuple([keys[i] for i in _ints(win, width)])))
    return tuple(keys[:n]), Fragment(parents, tuple(boundaries))


def decode(line: bytes | str) -> dict[str, Any] | None:
    """A record, checked and normalised (keys as bytes, ids as strings), or None when the
    line is not a whole, valid record (see the module docstring)."""
    try:
        rec = _loads(line.decode() if isinstance(line, bytes) else line)
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
            if "h" in rec:
                keys, fragment = _compact_keys_and_fragment(rec)
            else:
                keys, fragment = _keys(rec["keys"]), fragment_of(rec["fragment"])
            out.update(ns=_str(rec["ns"]), path=_str(rec["path"]), bytes=_int(rec["bytes"]),
                       keys=keys, fragment=fragment,
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
