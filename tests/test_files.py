"""``vllm_adapter.files.write_text_atomic``: the reports, fixtures and stats files kvchunk
writes are whole or absent, through the tier's one atomic write."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_adapter.disk.atomic_file import TEMP_SUFFIX
from vllm_adapter.files import write_text_atomic


def test_a_text_file_is_written_whole_and_replaced_whole(tmp_path: Path) -> None:
    path = tmp_path / "report.md"
    write_text_atomic(path, "first ünïcode\n" * 1000)
    assert path.read_text(encoding="utf-8") == "first ünïcode\n" * 1000
    write_text_atomic(str(path), "second\n")
    assert path.read_text(encoding="utf-8") == "second\n"
    assert sorted(os.listdir(tmp_path)) == ["report.md"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "report.md"
    write_text_atomic(path, "old\n")
    calls = []

    def short_then_fail(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return real(fd, data[:3])

    real = os.write
    monkeypatch.setattr(os, "write", short_then_fail)
    with pytest.raises(OSError, match="No space"):
        write_text_atomic(path, "new text\n")
    monkeypatch.undo()
    assert path.read_text() == "old\n"
    assert not [n for n in os.listdir(tmp_path) if n.endswith(TEMP_SUFFIX)]
    assert calls[0] == len("new text\n")  # the short write was retried with the rest
