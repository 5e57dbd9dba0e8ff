"""Owners of a root: their leases (alive or dead, on this kernel or another host) and the
root's lock across hosts.

**Owners and leases** (:class:`Lease`): every ledger instance is an owner with a random id
that starts with its kernel's boot id (:func:`kernel_id`).  Its lease is an empty file,
``<root>/kvchunk-owners/<id>.lease``, that it touches every ``lease_s / 4`` seconds (a
heartbeat: the file system's clock sets the mtime) and holds an exclusive ``flock`` on.
Another owner judges it (:meth:`Lease.alive`):

* on the **same kernel**, by the ``flock`` (coherent between processes of one kernel,
  whatever their PID or UTS namespace): free means dead, at once;
* on **another kernel**, or where ``flock`` does not work: by the heartbeat, aged against
  the file system's own clock (the mtime of the judge's lease, just touched): silent for
  ``lease_s`` (:data:`LEASE_SECONDS`) means dead.  No host's clock, host name or pid is
  trusted, and no ``flock`` is trusted across hosts (Lustre's ``localflock`` grants every
  client every lock).

A dead owner's lease file is removed; an owner that finds its own removed (it stalled
longer than the lease) takes it again (:meth:`Lease.lost`), and its reservations were
reclaimed meanwhile.

**The root lock across hosts** (:class:`RootLock`): a symlink,
``<root>/kvchunk-ledger.held``, to the holder's lease.  ``symlink`` creates atomically and
fails when the name exists, on local and network file systems alike; a holder judged dead
by its lease is broken under a second symlink, so one breaker at a time.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import threading
import time
import uuid
import weakref

__all__ = [
    "HELD",
    "LEASE_DIR",
    "LEASE_SECONDS",
    "FlockUnsupported",
    "Lease",
    "LeaseIO",
    "RootLock",
    "flock",
    "kernel_id",
]

LEASE_DIR = "kvchunk-owners"
"""Under the root: one lease file per live owner."""


class FlockUnsupported(OSError):
    """The file system under the root has no working ``flock`` (``ENOLCK``, ``EOPNOTSUPP``):
    the ledger then runs on its lock file and heartbeats alone (see the module docstring)."""


_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def flock(fd: int, how: int, where: str) -> None:
    """``fcntl.flock``; a file system without it is a :class:`FlockUnsupported` naming
    ``where``."""
    try:
        fcntl.flock(fd, how)
    except OSError as exc:
        if exc.errno in _NO_FLOCK:
            raise FlockUnsupported(
                exc.errno,
                f"kvchunk disk tier: the file system under {where!r} does not support flock "
                f"({os.strerror(exc.errno or 0)})") from exc
        raise


def kernel_id() -> str:
    """This kernel's identity (its boot id, 12 hex digits): processes that share it share
    ``flock`` coherently, whatever their PID or UTS namespace.  "" when /proc does not say
    (every owner is then judged by its heartbeat)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip().replace("-", "")[:12]
    except OSError:
        return ""


class LeaseIO:
    """The lease's and the root lock's view of the host (a test makes it another host: its
    own kernel id, and a ``flock`` that is local to it as Lustre's ``localflock`` is)."""

    def kernel_id(self) -> str:
        return kernel_id()

    def flock(self, fd: int, how: int, where: str) -> None:
        flock(fd, how, where)


class _Heartbeat:
    """One daemon thread per process touching every live lease every ``period`` seconds."""

    def __init__(self) -> None:
        self._leases: weakref.WeakSet[Lease] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, lease: Lease) -> None:
        with self._lock:
            self._leases.add(lease)
            self._wake.set()  # a shorter lease shortens the period now
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="kvchunk-lease-heartbeat",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            with self._lock:
                leases = list(self._leases)
            period = min((lease.lease_s / 4 for lease in leases), default=LEASE_SECONDS / 4)
            for lease in leases:
                lease.beat()
            del leases
            self._wake.wait(period)
            self._wake.clear()


_HEARTBEAT = _Heartbeat()

LEASE_SECONDS = 30.0
"""An owner whose lease file has not been touched for this long is dead, to an owner on
another kernel (or on a file system without ``flock``).  Its heartbeat touches it every
quarter of that."""


class Lease:
    """This owner's lease on a root: ``<root>/kvchunk-owners/<id>.lease``, an empty file it
    touches every ``lease_s / 4`` seconds (its heartbeat) and holds an exclusive ``flock`` on
    while it lives (where ``flock`` works).  The id starts with the owner's kernel id."""

    def __init__(self, root: str, owner_id: str | None = None, *, io: LeaseIO | None = None,
                 lease_s: float = LEASE_SECONDS) -> None:
        self.io = io or LeaseIO()
        self.root = root
        self.kernel = self.io.kernel_id()
        self.id = owner_id or f"{self.kernel or 'k'}-{uuid.uuid4().hex[:12]}"
        self.lease_s = lease_s
        self.dir = os.path.join(root, LEASE_DIR)
        os.makedirs(self.dir, exist_ok=True)
        self.path = os.path.join(self.dir, f"{self.id}.lease")
        self.target = os.path.join(LEASE_DIR, f"{self.id}.lease")
        """The lease's path relative to the root: what the root lock's symlink points to."""
        self.flock_works = True
        self._fd: int | None = None
        self._renew()
        _HEARTBEAT.add(self)

    def _renew(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self.io.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.root)
        except FlockUnsupported:
            self.flock_works = False

    def beat(self) -> None:
        """The heartbeat: the lease file's mtime becomes the file system's now."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def now(self) -> float:
        """The file system's clock (an mtime it just set), against which peers' heartbeats
        are aged: hosts' clocks are never compared."""
        self.beat()
        try:
            return os.lstat(self.path).st_mtime
        except OSError:
            return time.time()

    def lost(self) -> bool:
        """Whether a peer judged this owner dead and removed its lease (a stall longer than
        the lease); the lease is then taken again under the same id."""
        if self._fd is None:
            return False
        try:  # on the open descriptor: no lookup at the file system's server
            if os.fstat(self._fd).st_nlink > 0:
                return False
        except OSError:  # a network file system's stale handle: removed by another client
            pass
        os.close(self._fd)
        self._renew()
        return True

    def release(self) -> None:
        """The owner is gone (a crash in a test, a tier closed): its heartbeat stops, and
        peers reclaim its reservations at their next acquisition of the ledger's lock."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def alive(self, owner: str) -> bool:
        """Whether ``owner`` may still be writing (see the module docstring).  A missing
        lease file is a dead owner; a lease found dead is removed."""
        if owner.startswith("legacy:"):
            return _legacy_alive(owner)
        path = os.path.join(self.dir, f"{owner}.lease")
        kernel, sep, _ = owner.partition("-")
        if not sep or (self.flock_works and kernel == self.kernel and kernel):
            # the same kernel (or a first-format id, written only where flock works):
            # flock is coherent, and its answer is immediate
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                return False
            try:
                try:
                    self.io.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, self.root)
                except BlockingIOError:
                    return True
                except FlockUnsupported:
                    pass  # judged by the heartbeat below
                else:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
                    return False
            finally:
                os.close(fd)
        try:
            beat = os.lstat(path).st_mtime
        except FileNotFoundError:
            return False
        if self.now() - beat <= self.lease_s:
            return True
        with contextlib.suppress(OSError):
            os.unlink(path)
        return False


def _legacy_alive(owner: str) -> bool:
    """A first-format owner (``legacy:host:pid``), judged by its pid on this host and
    presumed alive on another host."""
    _, host, pid = owner.split(":", 2)
    if host != socket.gethostname() or not pid.isdigit():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


HELD = "kvchunk-ledger.held"
"""Under the root: the root lock as every host sees it, a symlink to its holder's lease."""


class RootLock:
    """The root's lock across hosts: ``<root>/kvchunk-ledger.held`` created with
    ``symlink`` (atomic, fails when it exists, on every POSIX and network file system) and
    pointing at the holder's lease.  A holder found dead by its lease is broken: under a
    second symlink (``.breaking``, so one breaker at a time) the lock is removed if it still
    names that holder.  Released by unlinking it, if it is still ours."""

    def __init__(self, root: str, lease: Lease) -> None:
        self.path = os.path.join(root, HELD)
        self.lease = lease
        self.broken = 0
        """Locks of dead holders this owner broke."""
        self.lost = 0
        """Times this owner found its lock broken by another at release (it stalled past
        its lease)."""

    def acquire(self) -> None:
        delay = 0.0005
        while True:
            try:
                os.symlink(self.lease.target, self.path)
                return
            except FileExistsError:
                pass
            holder = _readlink(self.path)
            if holder is None:
                continue
            if _owner_of(holder) == self.lease.id or not self.lease.alive(_owner_of(holder)):
                self._break(holder)
                continue
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def _break(self, holder: str) -> None:
        breaking = self.path + ".breaking"
        try:
            os.symlink(self.lease.target, breaking)
        except FileExistsError:
            other = _readlink(breaking)
            if other is not None and not self.lease.alive(_owner_of(other)):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(breaking)
            time.sleep(0.001)
            return
        try:
            if _readlink(self.path) == holder:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
                self.broken += 1
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(breaking)

    def release(self) -> None:
        if _readlink(self.path) == self.lease.target:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        else:
            self.lost += 1


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except (FileNotFoundError, OSError):
        return None


def _owner_of(target: str) -> str:
    name = os.path.basename(target)
    return name[: -len(".lease")] if name.endswith(".lease") else name
