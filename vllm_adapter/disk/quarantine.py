"""A bad file's end: deleted, or moved to its namespace's quarantine within a byte cap.

A file that fails its checks on load (``"bad_files"``: ``"delete"``, the default, or
``"quarantine"``) leaves the tier's directory, unless a writer replaced it since it was
opened; a quarantined file keeps its name and inode (``<name>.<inode>.bad`` under
``<namespace>/quarantine/``), and the oldest quarantined files go first when the cap
(:attr:`~vllm_adapter.disk.chunk_file.ChunkIO.quarantine_bytes`) would be exceeded.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_adapter.disk.chunk_file import ChunkIO

__all__ = ["BAD_FILE_POLICIES", "QUARANTINE_DIR", "discard_bad_file"]

logger = logging.getLogger("vllm_adapter.disk.tier")

QUARANTINE_DIR = "quarantine"
BAD_FILE_POLICIES = ("delete", "quarantine")


def discard_bad_file(path: str, st: os.stat_result, io: ChunkIO) -> None:
    """Delete or quarantine a bad file, unless a writer has replaced it since it was opened."""
    try:
        now = os.stat(path)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return
        if (io.bad_files == "quarantine" and io.quarantine_dir is not None
                and _make_room_in_quarantine(now.st_size, io)):
            os.makedirs(io.quarantine_dir, exist_ok=True)
            name = f"{os.path.basename(path)}.{st.st_ino}.bad"
            os.replace(path, os.path.join(io.quarantine_dir, name))
        else:
            os.remove(path)
        io.counters.add(bad_files_removed=1)
    except OSError as exc:
        logger.warning("kvchunk fs tier: could not remove bad chunk file %s: %s", path, exc)


def _make_room_in_quarantine(nbytes: int, io: ChunkIO) -> bool:
    """Whether a bad file of ``nbytes`` may be quarantined: the oldest quarantined files
    (of every namespace under :attr:`ChunkIO.quarantine_root`) are deleted until it fits
    :attr:`ChunkIO.quarantine_bytes`; False (delete it instead) when it alone does not."""
    if io.quarantine_bytes is None:
        return True
    if nbytes > io.quarantine_bytes:
        return False
    root = io.quarantine_root or os.path.dirname(io.quarantine_dir or "")
    held: list[tuple[float, str, int]] = []
    for q in glob.glob(os.path.join(glob.escape(root), "*", QUARANTINE_DIR)):
        for entry in os.scandir(q):
            with contextlib.suppress(OSError):
                st = entry.stat()
                held.append((st.st_mtime, entry.path, max(st.st_size, st.st_blocks * 512)))
    total = sum(n for _, _, n in held)
    for _, victim, n in sorted(held):
        if total + nbytes <= io.quarantine_bytes:
            break
        with contextlib.suppress(FileNotFoundError):
            os.remove(victim)
        total -= n
    return total + nbytes <= io.quarantine_bytes
