"""An emulated metadata-bound file system: a FUSE passthrough whose metadata queues at one server.

A shared file system's metadata service (a CephFS MDS, a Lustre MDT, an NFS server) is a
**rate shared by every client**, not a per-thread latency
(:mod:`vllm_adapter.metadata_model`).  This module mounts a directory (the *backing*
directory) onto a mount point with FUSE and serves every request the kernel sends by
doing the same call on the backing directory, with one difference:

* **metadata** requests (:data:`METADATA_KINDS`: lookups and ``stat`` -- both reach
  the server as ``getattr`` --, ``access``, ``create``, ``open``, ``opendir``, ``readdir``,
  ``mkdir``, ``rmdir``, ``unlink``, ``rename``, ``fsync``, ``fsyncdir``, ``truncate``,
  ``chmod``, ``chown``, ``utimens``, ``statfs``, ``fallocate``, links) queue at **one
  server** that serves one request per ``1 / ops_per_s`` seconds, whichever client
  thread sent it: a request arriving at ``t`` is served at ``max(t, end of the previous
  service) + service time``, and its thread waits until then (the schedule is kept in
  virtual time, so a late wake-up of one thread does not slow the next request: over
  any interval the server serves at most ``ops_per_s`` requests, and exactly that many
  while requests wait);
* **data** requests (``read``, ``write``) and the file-handle releases that close sends
  (``flush``, ``release``, ``releasedir``: on CephFS a close is a capability release
  that does not wait for the MDS, and :mod:`vllm_adapter.metadata_model` counts no
  close) pass straight through, never queued.

Every request is **counted by kind**, metadata or not.

What the kernel caches (the mount's ``fuse_config``): ``entry_timeout``, ``attr_timeout``
and ``negative_timeout`` are 0, so every path component of every path a client names is
looked up at the server again (a ``getattr``), every ``stat`` reaches it, and nothing is
remembered about names that do not exist -- no client-side metadata cache, the upper
end, as :mod:`vllm_adapter.metadata_model` counts; ``hard_remove`` (an unlink of an open
file is an unlink, not a rename to ``.fuse_hidden*``).  Data may sit in the kernel's page
cache as on any FUSE mount (``direct_io`` off): reads of a file opened without
``O_DIRECT`` can be served from it.  The server opens the backing files without
``O_DIRECT`` (its buffers are not aligned), so the backing directory's page cache holds
what was written until it is dropped.  ``max_write`` is raised to 1 MiB (fewer, larger
write requests) and the FUSE loop runs up to 64 threads, so requests waiting at the
metadata server do not hold back data requests.

The server runs in a child process (``python -P metafs.py serve ...``: its own
interpreter, so its GIL does not compete with the client's I/O threads; it imports only
the standard library and ``mfusepy``, the ctypes binding over libfuse3).  The parent
talks to it over the child's stdin and stdout, one JSON line each way
(:meth:`MetaMount.counts`, :meth:`MetaMount.reset`, :meth:`MetaMount.set_rate`); when
the parent dies, the child sees its stdin close and unmounts itself.

Use::

    with MetaMount(backing, mountpoint, ops_per_s=2000) as fs:
        ...  # I/O under mountpoint
        fs.counts()  # {"getattr": 312, "create": 40, "write": 160, ...}

:func:`unavailable` says why a mount cannot be had here (no ``/dev/fuse``, no
``fusermount3``, no libfuse3, no ``mfusepy``); :class:`MetaMount` raises
:class:`MountUnavailable` with the reason when the mount fails.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

__all__ = [
    "DATA_KINDS",
    "METADATA_KINDS",
    "MetaMount",
    "MountUnavailable",
    "label",
    "metadata_ops",
    "unavailable",
]

METADATA_KINDS = frozenset({
    "getattr", "access", "readlink", "mknod", "mkdir", "unlink", "rmdir", "symlink", "rename",
    "link", "chmod", "chown", "truncate", "open", "create", "opendir", "readdir", "statfs",
    "fsync", "fsyncdir", "utimens", "fallocate",
})
"""Requests that queue at the one metadata server."""
DATA_KINDS = frozenset({"read", "write"})
"""Requests that pass straight through (counted, never queued)."""
RELEASE_KINDS = frozenset({"flush", "release", "releasedir"})
"""What a close sends: counted, never queued (a close waits for no metadata server)."""

MAX_WRITE = 1 << 20
"""The largest write request the kernel sends (libfuse3's buffer allows 1 MiB)."""
MAX_THREADS = 64
"""FUSE worker threads: more than the bench's 16 + 16 I/O threads, so requests waiting
at the metadata server never keep a data request from a worker."""
START_TIMEOUT_S = 20.0
CONTROL_TIMEOUT_S = 30.0


def label(ops_per_s: float) -> str:
    """``"emulated metadata-bound file system, 2,000 operations/s"``."""
    return f"emulated metadata-bound file system, {ops_per_s:,.0f} operations/s"


def metadata_ops(counts: Mapping[str, int]) -> int:
    """The requests of ``counts`` that queued at the metadata server."""
    return sum(n for kind, n in counts.items() if kind in METADATA_KINDS)


class MountUnavailable(RuntimeError):
    """No emulated mount can be had here; the message says why."""


def _fusermount() -> str | None:
    return shutil.which("fusermount3")


def unavailable(python: str | None = None) -> str | None:
    """Why no emulated mount can be had on this host (``None``: it can).

    Checks ``/dev/fuse``, ``fusermount3`` (Debian's ``fuse3``), libfuse3 and the
    ``mfusepy`` binding in ``python`` (default: this interpreter).
    """
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this host"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user"
    if _fusermount() is None:
        return "no fusermount3 on PATH (Debian: apt-get install fuse3)"
    import ctypes.util

    if ctypes.util.find_library("fuse3") is None:
        return "no libfuse3 (Debian: apt-get install fuse3)"
    if python is None or os.path.realpath(python) == os.path.realpath(sys.executable):
        import importlib.util

        if importlib.util.find_spec("mfusepy") is None:
            return "the mfusepy binding is not installed (pip install mfusepy; kvchunk's dev extra)"
    return None


# ---------------------------------------------------------------------------
# The client: mount, talk to the server, unmount
# ---------------------------------------------------------------------------


class MetaMount:
    """``backing`` mounted on ``mountpoint`` with metadata served at ``ops_per_s`` (``None``
    or 0: unthrottled, every request still counted).  A context manager: :meth:`close`
    unmounts (lazily if the mount is busy) and ends the server."""

    def __init__(self, backing: str, mountpoint: str, ops_per_s: float | None) -> None:
        self.backing = os.path.realpath(backing)
        self.mountpoint = os.path.realpath(mountpoint)
        self.ops_per_s = ops_per_s or None
        self._proc: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._mounted = False

    # -- life -----------------------------------------------------------------

    def __enter__(self) -> MetaMount:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Mount; raise :class:`MountUnavailable` (with the reason) when it cannot."""
        reason = unavailable()
        if reason is not None:
            raise MountUnavailable(reason)
        try:
            os.makedirs(self.backing, exist_ok=True)
            os.makedirs(self.mountpoint, exist_ok=True)
        except OSError as e:
            raise MountUnavailable(f"cannot make the directories to mount: {e}") from None
        env = {**os.environ, "FUSE_LIBRARY_NAME": "fuse3"}
        self._proc = subprocess.Popen(
            [sys.executable, "-P", os.path.abspath(__file__), "serve", self.backing,
             self.mountpoint, repr(float(self.ops_per_s or 0))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=env, start_new_session=True,
        )
        try:
            line = self._readline(START_TIMEOUT_S)
        except MountUnavailable as e:
            self._stop()
            raise MountUnavailable(f"the FUSE server did not mount {self.mountpoint}: {e}") from None
        if json.loads(line).get("ready") is not True:
            self._stop()
            raise MountUnavailable(f"the FUSE server said {line!r} instead of ready")
        self._mounted = True
        if not os.path.ismount(self.mountpoint):
            self.close()
            raise MountUnavailable(f"{self.mountpoint} is not a mount point after the server started")

    def close(self) -> None:
        """Unmount (``fusermount3 -u``, then lazily with ``-uz`` when busy) and end the server."""
        if self._proc is None:
            return
        if self._mounted or os.path.ismount(self.mountpoint):
            self._unmount()
        self._stop()

    def _unmount(self) -> None:
        fusermount = _fusermount() or "fusermount3"
        for args in ([fusermount, "-u", self.mountpoint], [fusermount, "-uz", self.mountpoint],
                     ["umount", "-l", self.mountpoint]):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                done = subprocess.run(args, capture_output=True, timeout=30)
                if done.returncode == 0 or not os.path.ismount(self.mountpoint):
                    break
        self._mounted = False

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

    # -- control ----------------------------------------------------------------

    def _readline(self, timeout: float) -> str:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if not line:
            if proc.poll() is None and not ready:
                reason = f"no answer within {timeout:.0f} s"
            else:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
                err = proc.stderr.read() if proc.stderr is not None and proc.poll() is not None else ""
                tail = " ".join(err.strip().splitlines()[-3:]) or "no message"
                reason = f"the server exited ({proc.returncode}): {tail}"
            raise MountUnavailable(reason)
        return line

    def _call(self, command: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            proc = self._proc
            if proc is None or proc.stdin is None:
                raise RuntimeError("the emulated file system is not mounted")
            proc.stdin.write(json.dumps(command) + "\n")
            proc.stdin.flush()
            answer: dict[str, Any] = json.loads(self._readline(CONTROL_TIMEOUT_S))
        return answer

    def counts(self) -> dict[str, int]:
        """Requests served so far (since the last :meth:`reset`), by kind."""
        return {str(k): int(v) for k, v in self._call({"op": "counts"})["counts"].items()}

    def reset(self) -> dict[str, int]:
        """Zero the counts; the counts before."""
        return {str(k): int(v) for k, v in self._call({"op": "reset"})["counts"].items()}

    def set_rate(self, ops_per_s: float | None) -> None:
        """Serve metadata at ``ops_per_s`` from now on (``None`` or 0: unthrottled)."""
        self._call({"op": "rate", "ops_per_s": float(ops_per_s or 0)})
        self.ops_per_s = ops_per_s or None


# ---------------------------------------------------------------------------
# The server (the child process; standard library and mfusepy only)
# ---------------------------------------------------------------------------


class MetadataServer:
    """One server: metadata requests are served one at a time, ``service_s`` each."""

    def __init__(self, ops_per_s: float) -> None:
        self._lock = threading.Lock()
        self.service_s = 1.0 / ops_per_s if ops_per_s > 0 else 0.0
        self._free_at = 0.0
        self.counts: dict[str, int] = {}

    def set_rate(self, ops_per_s: float) -> None:
        with self._lock:
            self.service_s = 1.0 / ops_per_s if ops_per_s > 0 else 0.0
            self._free_at = 0.0

    def snapshot(self, reset: bool = False) -> dict[str, int]:
        with self._lock:
            counts = dict(self.counts)
            if reset:
                self.counts = {}
        return counts

    def serve(self, kind: str) -> None:
        """Count a request; a metadata one waits for its turn at the server and its service."""
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if kind not in METADATA_KINDS or not self.service_s:
                return
            start = max(time.monotonic(), self._free_at)
            done = self._free_at = start + self.service_s
        delay = done - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def _operations(root: str, server: MetadataServer) -> Any:  # pragma: no cover - the child
    """The passthrough operations (an ``mfusepy.Operations``) over ``root``."""
    import ctypes

    import mfusepy

    no_direct = ~getattr(os, "O_DIRECT", 0)

    def real(path: str) -> str:
        return os.path.join(root, path.lstrip("/"))

    class Passthrough(mfusepy.Operations):
        use_ns = True

        def init_with_config(self, conn: Any, config: Any) -> None:
            if config is not None:
                config.entry_timeout = 0.0
                config.attr_timeout = 0.0
                config.negative_timeout = 0.0
                config.hard_remove = 1
            if conn is not None:
                conn.max_write = MAX_WRITE
            _say({"ready": True})

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            server.serve("getattr")
            st = os.fstat(fh) if fh is not None else os.lstat(real(path))
            attrs = {k: getattr(st, k) for k in (
                "st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_dev",
                "st_blocks", "st_blksize", "st_rdev")}
            attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
            return attrs

        def access(self, path: str, amode: int) -> int:
            server.serve("access")
            if not os.access(real(path), amode):
                raise mfusepy.FuseOSError(errno.EACCES)
            return 0

        def readlink(self, path: str) -> str:
            server.serve("readlink")
            return os.readlink(real(path))

        def mknod(self, path: str, mode: int, dev: int) -> int:
            server.serve("mknod")
            os.mknod(real(path), mode, dev)
            return 0

        def mkdir(self, path: str, mode: int) -> int:
            server.serve("mkdir")
            os.mkdir(real(path), mode)
            return 0

        def unlink(self, path: str) -> int:
            server.serve("unlink")
            os.unlink(real(path))
            return 0

        def rmdir(self, path: str) -> int:
            server.serve("rmdir")
            os.rmdir(real(path))
            return 0

        def symlink(self, target: str, source: str) -> int:
            server.serve("symlink")
            os.symlink(source, real(target))
            return 0

        def rename(self, old: str, new: str) -> int:
            server.serve("rename")
            os.rename(real(old), real(new))
            return 0

        def link(self, target: str, source: str) -> int:
            server.serve("link")
            os.link(real(source), real(target))
            return 0

        def chmod(self, path: str, mode: int) -> int:
            server.serve("chmod")
            os.chmod(real(path), mode)
            return 0

        def chown(self, path: str, uid: int, gid: int) -> int:
            server.serve("chown")
            os.chown(real(path), uid, gid)
            return 0

        def truncate(self, path: str, length: int, fh: int | None = None) -> int:
            server.serve("truncate")
            if fh is not None:
                os.ftruncate(fh, length)
            else:
                os.truncate(real(path), length)
            return 0

        def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
            server.serve("utimens")
            if times is None:
                os.utime(real(path))
            else:
                os.utime(real(path), ns=times)
            return 0

        def open(self, path: str, flags: int) -> int:
            server.serve("open")
            return os.open(real(path), flags & no_direct)

        def create(self, path: str, mode: int, flags: int = os.O_WRONLY) -> int:
            server.serve("create")
            return os.open(real(path), (flags & no_direct) | os.O_CREAT, mode)

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            server.serve("read")
            return os.pread(fh, size, offset)

        def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
            server.serve("write")
            return os.pwrite(fh, data, offset)

        def statfs(self, path: str) -> dict[str, int]:
            server.serve("statfs")
            sv = os.statvfs(real(path))
            return {k: getattr(sv, k) for k in (
                "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files",
                "f_flag", "f_frsize", "f_namemax")}

        def flush(self, path: str, fh: int) -> int:
            server.serve("flush")
            return 0

        def release(self, path: str, fh: int) -> int:
            server.serve("release")
            os.close(fh)
            return 0

        def fsync(self, path: str, datasync: int, fh: int) -> int:
            server.serve("fsync")
            if datasync:
                os.fdatasync(fh)
            else:
                os.fsync(fh)
            return 0

        def fallocate(self, path: str, mode: int, offset: int, size: int, fh: int) -> int:
            server.serve("fallocate")
            if mode:
                raise mfusepy.FuseOSError(errno.EOPNOTSUPP)
            os.posix_fallocate(fh, offset, size)
            return 0

        def opendir(self, path: str) -> int:
            server.serve("opendir")
            if not os.path.isdir(real(path)):
                raise mfusepy.FuseOSError(errno.ENOTDIR)
            return 0

        def readdir(self, path: str, fh: int) -> list[str]:
            server.serve("readdir")
            return [".", "..", *os.listdir(real(path))]

        def releasedir(self, path: str, fh: int) -> int:
            server.serve("releasedir")
            return 0

        def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
            server.serve("fsyncdir")
            return 0

    class ZeroCopy(mfusepy.FUSE):
        """mfusepy's FUSE with ``read`` / ``write`` that move the bytes between the kernel's
        buffer and the backing file directly (no Python ``bytes`` copy in between)."""

        def read(self, path: bytes | None, buf: Any, size: int, offset: int, fip: Any) -> int:
            server.serve("read")
            view = (ctypes.c_char * size).from_address(ctypes.cast(buf, ctypes.c_void_p).value or 0)
            return os.preadv(fip.contents.fh, [memoryview(view).cast("B")], offset)

        def write(self, path: bytes | None, buf: Any, size: int, offset: int, fip: Any) -> int:
            server.serve("write")
            view = (ctypes.c_char * size).from_address(ctypes.cast(buf, ctypes.c_void_p).value or 0)
            return os.pwrite(fip.contents.fh, memoryview(view).cast("B"), offset)

    return Passthrough(), ZeroCopy


_say_lock = threading.Lock()


def _say(message: dict[str, Any]) -> None:  # pragma: no cover - the child
    with _say_lock:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()


def _control(server: MetadataServer, mountpoint: str) -> None:  # pragma: no cover - the child
    """Answer the parent's commands; when its pipe closes, unmount (ending the FUSE loop)."""
    for line in sys.stdin:
        try:
            command = json.loads(line)
            op = command["op"]
            if op == "rate":
                server.set_rate(float(command["ops_per_s"]))
                _say({"ok": True})
            else:
                _say({"counts": server.snapshot(reset=op == "reset")})
        except (ValueError, KeyError, TypeError) as e:
            _say({"error": str(e)})
    fusermount = _fusermount() or "fusermount3"
    subprocess.run([fusermount, "-uz", mountpoint], capture_output=True, check=False)


def serve(backing: str, mountpoint: str, ops_per_s: float) -> int:  # pragma: no cover - the child
    """The child: mount ``backing`` on ``mountpoint`` and serve until unmounted."""
    server = MetadataServer(ops_per_s)
    operations, fuse = _operations(backing, server)
    threading.Thread(target=_control, args=(server, mountpoint), daemon=True).start()
    import warnings

    warnings.simplefilter("ignore", DeprecationWarning)
    fuse(operations, mountpoint, foreground=True, nothreads=False, fsname="kvchunk-metafs",
         max_threads=MAX_THREADS, default_permissions=False)
    return 0


if __name__ == "__main__":  # pragma: no cover - the child
    if len(sys.argv) != 5 or sys.argv[1] != "serve":
        sys.exit("usage: python -P metafs.py serve BACKING MOUNTPOINT OPS_PER_S")
    sys.exit(serve(sys.argv[2], sys.argv[3], float(sys.argv[4])))
