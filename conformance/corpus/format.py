"""One corpus case as one line of JSON, its schema, and reading a corpus file.

A line is an object with sorted keys and no insignificant whitespace (so the
same case is the same bytes):

``format_version``  :data:`FORMAT_VERSION`; readers refuse other versions.
``case``            the case's name (unique in a file), ``release`` the vLLM
                    release that ran it, ``description`` what it exercises.
``knob``            the offloading knob (``blocks_per_chunk`` or ``block_size``).
``policy``          the reference's policy switches the release runs
                    (:class:`reference.plan.Policy`).
``covers``          the rules of ``docs/semantics.md`` section 8 the case reaches.
``config``          the geometry (``groups``, ``tokens_per_hash``) and the engine
                    settings the trace ran under (:class:`conformance.protocol.trace.TraceConfig`).
``hashes``          the block hashes, hex, each once; ``block_hashes`` fields index it.
``records``         the hook calls in order, each naming its ``hook``; they carry
                    the inputs and vLLM's answers (``hit_tokens``, ``load``,
                    ``store_jobs``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from conformance.corpus.codec import (
    HOOKS,
    CorpusFormatError,
    HashTable,
    decode,
    decode_policy,
    decode_record,
    encode,
    encode_policy,
    encode_record,
    type_schema,
)
from conformance.protocol import trace as T
from reference.plan import Policy

FORMAT_VERSION = 1
DATA_DIR = Path(__file__).resolve().parent / "data"
SCHEMA_PATH = Path(__file__).resolve().parent / "schema.json"


def data_path(release: str) -> Path:
    """The committed corpus of one vLLM release."""
    return DATA_DIR / f"vllm-{release}.jsonl"


@dataclass(frozen=True)
class CorpusCase:
    """One decoded corpus line."""

    name: str
    release: str
    description: str
    knob: tuple[tuple[str, Any], ...]
    policy: Policy
    covers: tuple[str, ...]
    trace: T.Trace


def dumps_case(case: CorpusCase) -> str:
    """The case's line (no trailing newline)."""
    table = HashTable()
    config = encode(case.trace.config, T.TraceConfig, table)
    records = [encode_record(r, table) for r in case.trace.records]
    obj = {
        "format_version": FORMAT_VERSION,
        "case": case.name,
        "release": case.release,
        "description": case.description,
        "knob": dict(case.knob),
        "policy": encode_policy(case.policy),
        "covers": list(case.covers),
        "config": config,
        "hashes": [h.hex() for h in table.hashes],
        "records": records,
        "num_steps": case.trace.num_steps,
        "notes": list(case.trace.notes),
    }
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def loads_case(line: str) -> CorpusCase:
    """Inverse of :func:`dumps_case`; :class:`CorpusFormatError` on a malformed line."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise CorpusFormatError(f"not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise CorpusFormatError("a corpus line must be a JSON object")
    version = obj.get("format_version")
    if version != FORMAT_VERSION:
        raise CorpusFormatError(
            f"format_version {version!r}: this reader reads version {FORMAT_VERSION}"
        )
    name = obj.get("case", "?")
    try:
        table = HashTable(tuple(decode(obj["hashes"], tuple[bytes, ...], table=HashTable())))
        trace = T.Trace(
            config=decode(obj["config"], T.TraceConfig, table),
            records=tuple(decode_record(r, table) for r in obj["records"]),
            num_steps=decode(obj["num_steps"], int, table),
            notes=tuple(decode(obj["notes"], tuple[str, ...], table)),
        )
        knob = obj["knob"]
        if not isinstance(knob, dict):
            raise CorpusFormatError(f"knob: expected an object, got {knob!r}")
        return CorpusCase(
            name=decode(obj["case"], str, table),
            release=decode(obj["release"], str, table),
            description=decode(obj["description"], str, table),
            knob=tuple(knob.items()),
            policy=decode_policy(obj["policy"]),
            covers=tuple(decode(obj["covers"], tuple[str, ...], table)),
            trace=trace,
        )
    except KeyError as e:
        raise CorpusFormatError(f"case {name}: missing field {e}") from None
    except (CorpusFormatError, TypeError) as e:
        raise CorpusFormatError(f"case {name}: {e}") from None


def dumps_corpus(cases: Iterable[CorpusCase]) -> str:
    """A corpus file's text: one line per case, each ending in a newline."""
    return "".join(dumps_case(c) + "\n" for c in cases)


def read_corpus(path: Path) -> list[CorpusCase]:
    """Every case of a corpus file; errors name the file and line."""
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(loads_case(line))
        except CorpusFormatError as e:
            raise CorpusFormatError(f"{path}:{number}: {e}") from None
    return out


def case_schema(rules: Iterable[str]) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one corpus line; ``rules``: section 8's names."""
    defs: dict[str, Any] = {}
    records = [type_schema(cls, defs) for cls in HOOKS]
    props: dict[str, Any] = {
        "format_version": {"const": FORMAT_VERSION},
        "case": {"type": "string", "minLength": 1},
        "release": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+"},
        "description": {"type": "string"},
        "knob": {"type": "object", "minProperties": 1,
                 "additionalProperties": {"type": ["integer", "string"]}},
        "policy": type_schema(Policy, defs),
        "covers": {"type": "array", "items": {"enum": sorted(rules)}},
        "config": type_schema(T.TraceConfig, defs),
        "hashes": type_schema(tuple[bytes, ...], defs),
        "records": {"type": "array", "items": {"oneOf": records}},
        "num_steps": {"type": "integer", "minimum": 0},
        "notes": {"type": "array", "items": {"type": "string"}},
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"urn:kvchunk:golden-corpus:v{FORMAT_VERSION}",
        "title": f"kvchunk golden corpus case, format version {FORMAT_VERSION}",
        "description": "One line of conformance/corpus/data/vllm-<release>.jsonl; "
                       "see conformance/PROTOCOL.md, section 'Golden corpus'.",
        "type": "object",
        "additionalProperties": False,
        "required": sorted(props),
        "properties": props,
        "$defs": dict(sorted(defs.items())),
    }


def dumps_schema(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=1, sort_keys=True) + "\n"
