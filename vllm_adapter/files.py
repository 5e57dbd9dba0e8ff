"""Whole-file writes: a reader sees the old file or the new one, never part of one."""

from __future__ import annotations

import os
from pathlib import Path

from vllm_adapter.disk.atomic_file import PLAIN, write_atomically

__all__ = ["write_text_atomic"]


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically
    (:func:`~vllm_adapter.disk.atomic_file.write_atomically`: a unique temporary file in
    the same directory, renamed onto ``path``, removed if the write fails)."""
    data = text.encode("utf-8")

    def write(fd: int) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]

    write_atomically(os.fspath(path), PLAIN, write, direct=False)
