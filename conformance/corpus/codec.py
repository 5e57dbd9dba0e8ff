"""A :class:`~conformance.protocol.trace.Trace` as one JSON object, and back (no vLLM needed).

The mapping is type-directed: every record dataclass of :mod:`conformance.protocol.trace`
becomes an object holding all its fields (defaults included) under their Python
names, with ``hook`` naming the connector call it records (:data:`HOOKS`).
Values map as: int, bool, str and null as themselves; tuples as arrays; enums
as their value; ``bytes`` as lower-case hex, except the ``block_hashes``
fields, which hold indices into the case's ``hashes`` table (each distinct
block hash once, in order of first appearance: the same prefix hashes repeat
in every call of a request).  :func:`json_schema` derives the schema from the
same types, so the schema and the codec cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from functools import cache
from typing import Any

from conformance.protocol import trace as T
from reference.plan import Policy

HOOKS: dict[type, str] = {
    T.NewRequest: "on_new_request",
    T.Lookup: "get_num_new_matched_tokens",
    T.Alloc: "update_state_after_alloc",
    T.BuildMeta: "build_connector_meta",
    T.JobsDone: "update_connector_output",
    T.RequestFinished: "request_finished",
    T.ResetPrefixCache: "reset_prefix_cache",
}
"""Record type -> the vLLM connector hook (or scheduler call) it records."""

RECORD_TYPES: dict[str, type] = {hook: cls for cls, hook in HOOKS.items()}
HASHES_FIELD = "block_hashes"
"""Fields of this name hold indices into the case's ``hashes`` table."""


class CorpusFormatError(ValueError):
    """A corpus line that does not decode (wrong shape, unknown hook, bad index)."""


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> list[tuple[str, Any]]:
    hints = _hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]


def _is_dataclass_type(tp: Any) -> typing.TypeGuard[type]:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_optional(tp: Any) -> Any | None:
    """``X`` when ``tp`` is ``X | None``, else None."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


class HashTable:
    """Block hashes interned in order of first appearance."""

    def __init__(self, hashes: tuple[bytes, ...] = ()) -> None:
        self.hashes = list(hashes)
        self._index = {h: i for i, h in enumerate(self.hashes)}

    def index(self, h: bytes) -> int:
        if h not in self._index:
            self._index[h] = len(self.hashes)
            self.hashes.append(h)
        return self._index[h]

    def get(self, i: Any) -> bytes:
        if type(i) is not int or not 0 <= i < len(self.hashes):
            raise CorpusFormatError(f"block hash index {i!r} is not in the case's hashes table")
        return self.hashes[i]


def encode(value: Any, tp: Any, table: HashTable, name: str = "") -> Any:
    """``value`` (of type ``tp``) as JSON-ready data."""
    inner = _is_optional(tp)
    if inner is not None:
        return None if value is None else encode(value, inner, table, name)
    if name == HASHES_FIELD:
        return [table.index(h) for h in value]
    if _is_dataclass_type(tp):
        out = {f: encode(getattr(value, f), ftp, table, f) for f, ftp in _fields(tp)}
        if tp in HOOKS:
            out["hook"] = HOOKS[tp]
        return out
    if isinstance(tp, type) and issubclass(tp, Enum):
        return value.value
    if tp is bytes:
        return bytes(value).hex()
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return [encode(v, args[0], table) for v in value]
        return [encode(v, a, table) for v, a in zip(value, args, strict=True)]
    if isinstance(value, float):
        raise CorpusFormatError(f"{name or tp}: floats are not part of the format, got {value!r}")
    return value


def _check(ok: bool, what: str, data: Any) -> None:
    if not ok:
        raise CorpusFormatError(f"{what}, got {data!r:.120}")


def decode(data: Any, tp: Any, table: HashTable, name: str = "") -> Any:
    """Inverse of :func:`encode`."""
    inner = _is_optional(tp)
    if inner is not None:
        return None if data is None else decode(data, inner, table, name)
    if name == HASHES_FIELD:
        _check(isinstance(data, list), f"{name}: expected an array of hash indices", data)
        return tuple(table.get(i) for i in data)
    if _is_dataclass_type(tp):
        _check(isinstance(data, dict), f"{tp.__name__}: expected an object", data)
        fields = _fields(tp)
        known = {f for f, _ in fields} | ({"hook"} if tp in HOOKS else set())
        _check(known >= set(data), f"{tp.__name__}: unknown fields {sorted(set(data) - known)}", data)
        missing = [f for f, _ in fields if f not in data]
        _check(not missing, f"{tp.__name__}: missing fields {missing}", data)
        return tp(**{f: decode(data[f], ftp, table, f) for f, ftp in fields})
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(data)
        except ValueError as e:
            raise CorpusFormatError(f"{name}: {e}") from None
    if tp is bytes:
        _check(isinstance(data, str), f"{name}: expected a hex string", data)
        try:
            return bytes.fromhex(data)
        except ValueError:
            raise CorpusFormatError(f"{name}: not hex: {data!r:.80}") from None
    if typing.get_origin(tp) is tuple:
        _check(isinstance(data, list), f"{name}: expected an array", data)
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(v, args[0], table) for v in data)
        _check(len(data) == len(args), f"{name}: expected {len(args)} items", data)
        return tuple(decode(v, a, table) for v, a in zip(data, args, strict=True))
    expected = {int: int, bool: bool, str: str}.get(tp)
    if expected is not None:
        _check(type(data) is expected, f"{name}: expected {expected.__name__}", data)
    return data


def encode_record(record: T.Record, table: HashTable) -> dict[str, Any]:
    out: dict[str, Any] = encode(record, type(record), table)
    return out


def decode_record(data: Any, table: HashTable) -> T.Record:
    _check(isinstance(data, dict) and data.get("hook") in RECORD_TYPES,
           f"a record must name its hook, one of {sorted(RECORD_TYPES)}", data)
    record: T.Record = decode(data, RECORD_TYPES[data["hook"]], table)
    return record


def encode_policy(policy: Policy) -> dict[str, Any]:
    out: dict[str, Any] = encode(policy, Policy, HashTable())
    return out


def decode_policy(data: Any) -> Policy:
    policy: Policy = decode(data, Policy, HashTable())
    return policy


# ---------------------------------------------------------------------------
# JSON Schema of the same types
# ---------------------------------------------------------------------------

_SCALAR_PARAM = {"type": ["integer", "string", "boolean", "null"]}


def _doc(cls: type) -> str:
    return (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")


def type_schema(tp: Any, defs: dict[str, Any], name: str = "") -> dict[str, Any]:
    """The JSON Schema of what :func:`encode` makes of ``tp`` (named types go to ``defs``)."""
    inner = _is_optional(tp)
    if inner is not None:
        return {"anyOf": [type_schema(inner, defs, name), {"type": "null"}]}
    if name == HASHES_FIELD:
        return {"type": "array", "items": {"type": "integer", "minimum": 0}}
    if _is_dataclass_type(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # reserve (recursion guard)
            props = {f: type_schema(ftp, defs, f) for f, ftp in _fields(tp)}
            required = sorted(props)
            if tp in HOOKS:
                props["hook"] = {"const": HOOKS[tp]}
                required = sorted([*required, "hook"])
            defs[tp.__name__] = {
                "description": _doc(tp), "type": "object", "additionalProperties": False,
                "required": required, "properties": props,
            }
        return {"$ref": f"#/$defs/{tp.__name__}"}
    if isinstance(tp, type) and issubclass(tp, Enum):
        return {"enum": [m.value for m in tp]}
    if tp is bytes:
        return {"type": "string", "pattern": "^([0-9a-f]{2})+$"}
    if typing.get_origin(tp) is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": type_schema(args[0], defs)}
        return {"type": "array", "minItems": len(args), "maxItems": len(args),
                "prefixItems": [type_schema(a, defs) for a in args]}
    simple: dict[Any, dict[str, Any]] = {
        int: {"type": "integer"}, bool: {"type": "boolean"}, str: {"type": "string"},
        Any: _SCALAR_PARAM,
    }
    if tp in simple:
        return dict(simple[tp])
    raise TypeError(f"no schema for {tp!r} ({name})")

