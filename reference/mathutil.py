"""Integer helpers, named as vLLM names them."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def round_down(a: int, b: int) -> int:
    return a // b * b


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b
