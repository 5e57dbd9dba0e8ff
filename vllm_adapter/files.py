"""Whole-file writes: a reader sees the old file or the new one, never part of one."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

__all__ = ["write_text_atomic"]


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same directory, renamed
    onto ``path``; the temporary name is unique per process and thread, and it is removed
    if the write fails."""
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
