"""Where a stored fixture and the live derivation disagree, field by field (plain JSON)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["fixture_differences"]


def fixture_differences(stored: Any, derived: Any, path: str = "") -> list[str]:
    """Every field where ``stored`` and ``derived`` (plain JSON values) disagree.

    One line each: the field's path (``resolved.groups[1].tokens_per_block``), the
    group it belongs to where it is under a group list (index, kind, tokens per
    block), and both values.
    """
    if isinstance(stored, dict) and isinstance(derived, dict):
        out = []
        for key in [*stored, *(k for k in derived if k not in stored)]:
            sub = f"{path}.{key}" if path else str(key)
            if key not in derived:
                out.append(f"{sub}: stored {_short(stored[key])}, not derived")
            elif key not in stored:
                out.append(f"{sub}: not stored, derived {_short(derived[key])}")
            else:
                out.extend(fixture_differences(stored[key], derived[key], sub))
        return out
    if isinstance(stored, list) and isinstance(derived, list) and len(stored) == len(derived):
        out = []
        for index, (a, b) in enumerate(zip(stored, derived, strict=True)):
            sub = f"{path}[{index}]"
            if path.endswith("groups") and isinstance(a, dict):
                sub += f" ({_group_label(index, a)})"
            out.extend(fixture_differences(a, b, sub))
        return out
    if stored != derived:
        return [f"{path}: stored {_short(stored)}, derived {_short(derived)}"]
    return []


def _group_label(index: int, group: Mapping[str, Any]) -> str:
    """``group 1, full_attention, 64 tokens per block`` for a ``resolved.groups`` row or
    an encoded ``kv_cache_groups`` entry (whose spec block size is its tokens per block)."""
    spec = group.get("kv_cache_spec")
    if isinstance(spec, dict):
        kind = spec.get("properties", {}).get("kind", "?")
        tokens = spec.get("fields", {}).get("block_size", "?")
    else:
        kind, tokens = group.get("kind", "?"), group.get("tokens_per_block", "?")
    return f"group {index}, {kind}, {tokens} tokens per block"


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
