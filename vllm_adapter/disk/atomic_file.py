"""Whole files, written atomically: a unique temporary name beside the file, then a rename.

Every file kvchunk's tier writes (chunk files, packed files, the ledger's snapshot) goes
through :func:`write_atomically`: the bytes fill a temporary file in the same directory
(:func:`temp_path`, ``<path>.<pid>-<thread>-<rand>.tmp``), fsync-ed if the tier asks, and
``os.replace`` puts it at its name, so a reader sees the old file or the new one, never
part of one.  A temporary file a crashed or killed writer left behind is removed when a
tier starts (:func:`sweep_stale_temps`: its writer's pid no longer runs on this host, or it
is older than :data:`STALE_TEMP_SECONDS`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_adapter.disk.chunk_file import ChunkIO

__all__ = [
    "O_DIRECT",
    "PLAIN",
    "STALE_TEMP_SECONDS",
    "TEMP_SUFFIX",
    "WriteOptions",
    "open_temp",
    "sweep_stale_temps",
    "temp_path",
    "write_atomically",
]

O_DIRECT = getattr(os, "O_DIRECT", 0)
TEMP_SUFFIX = ".tmp"
STALE_TEMP_SECONDS = 15 * 60
"""A temporary file this old was left by a writer that died (a write takes seconds)."""


@dataclass(frozen=True)
class WriteOptions:
    """How :func:`write_atomically` opens and finishes a file, for a writer that is not the
    tier's (whose :class:`~vllm_adapter.disk.chunk_file.ChunkIO` carries the same two)."""

    o_direct: bool = False
    fsync: bool = False


PLAIN = WriteOptions()
"""Buffered and not fsync-ed: the reports, fixtures and stats files kvchunk writes."""


def temp_path(path: str) -> str:
    """A unique temporary name for ``path``, in its directory: ``<path>.<pid>-<thread>-<rand>.tmp``
    (a dead writer's is swept: :func:`sweep_stale_temps`)."""
    return f"{path}.{os.getpid()}-{threading.get_ident()}-{os.urandom(4).hex()}{TEMP_SUFFIX}"


def open_temp(tmp: str, flags: int, recycled: bool) -> int:
    """Open a writer's temporary file: ``tmp`` created (``flags``, with ``O_CREAT |
    O_EXCL``), its directory made only when the create finds it missing; or, ``recycled``,
    the evicted file the ledger renamed there, opened to be overwritten (created after all
    if it is gone)."""
    if recycled:
        try:
            return os.open(tmp, flags | os.O_WRONLY)
        except FileNotFoundError:
            pass
    flags |= os.O_CREAT | os.O_EXCL | os.O_WRONLY
    try:
        return os.open(tmp, flags, 0o644)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(tmp), exist_ok=True)
        return os.open(tmp, flags, 0o644)


def write_atomically(
    path: str, io: ChunkIO | WriteOptions, write: Callable[[int], None], *, direct: bool = True,
    tmp: str | None = None,
) -> None:
    """Write a whole file at ``path``: ``write(fd)`` fills a unique temporary file in the same
    directory (``O_DIRECT`` when the tier uses it and ``direct``), fsync-ed if the tier asks,
    then renamed onto ``path``; on any failure the temporary file is removed and the error
    raised.  A reader sees the old file or the new one, never part of one.

    The directory is made only when the create finds it missing (no ``os.makedirs``
    before every file, as vLLM's fs tier calls: on a shared file system each of its
    ``stat`` / ``mkdir`` calls is a round trip to the metadata server, and the tier never
    removes a directory, so in steady state the create alone succeeds).  ``tmp``: an
    evicted file the ledger renamed onto this file's temporary name
    (:meth:`~vllm_adapter.disk.ledger.RootLedger.reserve`, ``recycle``), no larger than
    this file: overwritten in place."""
    recycled = tmp is not None
    tmp = tmp or temp_path(path)
    try:
        fd = open_temp(tmp, O_DIRECT if io.o_direct and direct else 0, recycled)
        try:
            write(fd)
            if io.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def sweep_stale_temps(root: str, older_than: float = STALE_TEMP_SECONDS) -> int:
    """Remove temporary files under ``root`` last written more than ``older_than`` seconds
    ago (left by a writer that crashed or was killed); returns how many.  A temporary
    file is never read as a chunk, so this only reclaims space."""
    removed, cutoff = 0, time.time() - older_than
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            if not name.endswith(TEMP_SUFFIX):
                continue
            path = os.path.join(dirpath, name)
            with contextlib.suppress(OSError):
                if _writer_is_dead(name) or os.stat(path).st_mtime < cutoff:
                    os.remove(path)
                    removed += 1
    return removed


def _writer_is_dead(temp_name: str) -> bool:
    """The process named in a temporary file's name (``<file>.<pid>-<thread>-<rand>.tmp``,
    :func:`write_atomically`) no longer runs on this host.  A root shared across hosts
    keeps the age rule alone: another host's pid says nothing here."""
    stem = temp_name[: -len(TEMP_SUFFIX)]
    pid_part = stem.rsplit(".", 1)[-1].split("-", 1)[0]
    if not pid_part.isdigit() or int(pid_part) == os.getpid():
        return False
    try:
        os.kill(int(pid_part), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False
