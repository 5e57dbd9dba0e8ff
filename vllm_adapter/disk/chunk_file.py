"""The chunk file of kvchunk's file tier: its format, and how one is stored and loaded.

**Chunk file** (format version :data:`FORMAT_VERSION`): a :data:`HEADER_SIZE`
(4096) byte header, then the payload (one CPU-tier row, page-aligned in the file,
so ``O_DIRECT`` works where the directory supports it, as vLLM's tier probes).
The header holds :data:`MAGIC`, the format version, the checksum algorithm, the
header size, the payload length, the geometry namespace digest, a digest of the
chunk's key (a file renamed or copied under another key fails), a 128-bit
checksum of the payload (:data:`CHECKSUM`, XXH3-128 by default) and a BLAKE3
digest of the header fields.

*Why XXH3-128* (format version 1 carries the algorithm's id, so ``"checksum":
"blake3"`` stays selectable): the payload checksum guards against torn, stale and
foreign bytes, not against an adversary who can write the disk, so it need not be
cryptographic; it must be cheap beside the I/O.  On the development VM (one core)
XXH3-128 hashes a 2 MiB payload at about 30-45 GB/s, BLAKE3 at about 7.8 GB/s
(14 GB/s on all cores) and zlib's CRC-32 at 5.4 GB/s, against a disk that reads
about 1.2 GB/s: BLAKE3 costs a read about 1/7 of its time when it cannot overlap,
XXH3 about 1/30 (``nox -s bench``, ``disk_checksum`` rows, compare them).  A 128-bit
digest also catches a whole foreign or stale file of the right length, where a
32-bit CRC (CRC32C, as vllm#54363 proposes) lets one in 2^32 through.  Namespace,
key and header digests stay BLAKE3 (a few bytes each).

**Store**: header + payload go to a unique temporary name in the same directory,
which is then ``os.replace``-d onto the chunk's name (atomic): a reader sees a
whole file or none (a temporary file a crash left behind is swept by
:func:`sweep_stale_temps` when a tier starts).  Unlike vLLM's tier, a file already at the name is replaced,
not kept: the tier stores a chunk only when it was just computed, and a file
there that the lookup did not reach (so was never verified) may be damaged.  Any
failure removes the temporary file and fails the store job.

**Load**: the file must be exactly ``HEADER_SIZE + payload`` bytes, its header
must match (magic, version, algorithm, sizes, namespace, key) and its payload
digest must equal the header's.  Otherwise the load raises :class:`ChunkFileError`
(an ``OSError``, ``EBADMSG``) carrying ``num_succeeded``, exactly the failure
vLLM's fs tier raises for a short file: ``FileSystemTierManager`` keeps the chunks
before it, marks the rest a miss and the tokens are recomputed through vLLM's own
failed-promotion path.  The bad file is deleted (``"bad_files": "delete"``, the
default) or moved to ``<namespace>/quarantine/`` (``"quarantine"``), unless a
writer replaced it in the meantime, so the recomputed chunk is stored again and
the next request is served from the new file.

**Hashing beside the I/O**: a payload of :data:`OVERLAP_BYTES` or more is
hashed on a second thread while the I/O thread moves its bytes: on store the
payload is written at ``HEADER_SIZE`` while it is hashed, then the header; on
load the header is read and checked first, then the payload is read in
:data:`SEGMENT_BYTES` segments, each hashed (in order, BLAKE3 is incremental)
while the next is read.  A file costs about the larger of its I/O and its hash,
not their sum (``nox -s bench``, ``disk_checksum`` rows).
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import queue
import struct
import threading
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3
import xxhash

from vllm_adapter.disk.atomic_file import (
    O_DIRECT,
    STALE_TEMP_SECONDS,
    TEMP_SUFFIX,
    open_temp,
    sweep_stale_temps,
    temp_path,
    write_atomically,
)
from vllm_adapter.disk.counters import Counters
from vllm_adapter.disk.quarantine import BAD_FILE_POLICIES, QUARANTINE_DIR, discard_bad_file

# Also the names of its atomic writes (vllm_adapter.disk.atomic_file) and bad-file end
# (vllm_adapter.disk.quarantine), which every file the tier writes shares.
__all__ = [
    "BAD_FILE_POLICIES",
    "CHECKSUM",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "MAGIC",
    "OVERLAP_BYTES",
    "QUARANTINE_DIR",
    "SEGMENT_BYTES",
    "STALE_TEMP_SECONDS",
    "TEMP_SUFFIX",
    "batch_load_chunks",
    "batch_store_chunks",
    "ChunkFileError",
    "ChunkIO",
    "digest",
    "discard_bad_file",
    "key_digest",
    "load_chunk",
    "open_temp",
    "store_chunk",
    "sweep_stale_temps",
    "temp_path",
    "TierCounters",
    "write_atomically",
]

logger = logging.getLogger("vllm_adapter.disk.tier")

FORMAT_VERSION = 1
MAGIC = b"KVCHUNK\x00"
HEADER_SIZE = 4096
"""Bytes before the payload: one page, so the payload stays page-aligned in the file."""
CHECKSUMS: dict[str, int] = {"xxh3-128": 2, "blake3": 1}
"""The payload checksums a file may carry, by name, and the id its header stores."""
CHECKSUM = "xxh3-128"
"""The default payload checksum (see the module docstring: *Why XXH3-128*)."""
DIGEST_BYTES = 16
_FIELDS = struct.Struct("<8sHHIQ16s16s16s")
"""magic, format version, checksum id, header size, payload length, namespace, key, payload digest."""
_HEADER_USED = _FIELDS.size + DIGEST_BYTES


MULTITHREAD_BYTES = 1 << 20
"""Payloads from this size on are hashed on all cores (BLAKE3's tree hashing), so the hash
of one large chunk file does not serialize behind one core while its I/O waits."""


OVERLAP_BYTES = 1 << 20
"""Payloads from this size on are hashed on a second thread, beside their I/O."""
SEGMENT_BYTES = 8 << 20
"""A load reads this much of the payload while the segment before it is hashed."""


class _Xxh3:
    """XXH3-128 with BLAKE3's ``update`` / ``digest(n)`` calls."""

    def __init__(self) -> None:
        self.h = xxhash.xxh3_128()

    def update(self, data: Any) -> None:
        self.h.update(data)

    def digest(self, n: int) -> bytes:
        return bytes(self.h.digest()[:n])


def _blake3(size: int) -> Any:
    return blake3.blake3(max_threads=blake3.blake3.AUTO if size >= MULTITHREAD_BYTES else 1)


def payload_hasher(checksum: str, size: int) -> Any:
    """A fresh incremental hasher of a payload of ``size`` bytes (``update``, ``digest(16)``)."""
    if checksum == "xxh3-128":
        return _Xxh3()
    if checksum == "blake3":
        return _blake3(size)
    raise ValueError(f"unknown checksum {checksum!r}; valid: {', '.join(CHECKSUMS)}")


def payload_digest(checksum: str, data: Any) -> bytes:
    """The 16-byte ``checksum`` of a payload."""
    h = payload_hasher(checksum, len(data))
    h.update(data)
    return bytes(h.digest(DIGEST_BYTES))


def digest(data: Any) -> bytes:
    """BLAKE3 of ``data``, 16 bytes (all cores for :data:`MULTITHREAD_BYTES` and more)."""
    h = _blake3(len(data))
    h.update(data)
    return bytes(h.digest(DIGEST_BYTES))



def key_digest(key: bytes) -> bytes:
    """The 16-byte identity of an offload key a chunk file's header carries."""
    return digest(bytes(key))



# ---------------------------------------------------------------------------
# One chunk file
# ---------------------------------------------------------------------------


class ChunkFileError(OSError):
    """A chunk file that is not a whole, intact file of this namespace and key (``EBADMSG``)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(errno.EBADMSG, f"bad chunk file ({why})", path)
        self.why = why


@dataclass
class TierCounters(Counters):
    """What a :class:`KvchunkFileTierManager` did (thread-safe; for metrics and the lanes)."""

    files_stored: int = 0
    files_loaded: int = 0
    """Per-chunk layout: chunk files verified and loaded."""
    sections_stored: int = 0
    """Packed layout: sections written (one per key); ``files_stored`` counts the files."""
    files_opened: int = 0
    """Packed layout: files opened by loads (one per file a load job reads from; a job
    split across the pool, one per file per slice: :func:`reference.packed_split.load_slices`)."""
    sections_loaded: int = 0
    """Packed layout: sections verified and loaded."""
    reads: int = 0
    """Packed layout: read calls of loads (adjacent sections of one file, within a slice of
    a split job, are one read)."""
    sections_stored_per_group: Counter[int] = field(default_factory=Counter)
    sections_loaded_per_group: Counter[int] = field(default_factory=Counter)
    bad_sections: int = 0
    """Packed layout: sections that failed verification (their keys leave the index)."""
    store_failures: int = 0
    """Store jobs that failed: an I/O error, or refused by the disk budget."""
    load_failures: int = 0
    lookup_hits: int = 0
    lookup_misses: int = 0
    bad_files: Counter[str] = field(default_factory=Counter)
    """Why files failed verification (``size``, ``header``, ``checksum``, ...)."""
    bad_files_removed: int = 0
    stale_temps_removed: int = 0
    """Temporary files of dead writers removed when the tier started."""
    recent_bad: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=256))
    """The last 256 bad files seen: ``(path, why)``."""

    def per_group(self, name: str, groups: Sequence[int]) -> None:
        """Count ``groups`` (one per section) in the per-group counter ``name``."""
        with self._lock:
            getattr(self, name).update(groups)

    def bad(self, path: str, why: str) -> None:
        with self._lock:
            self.bad_files[why] += 1
            self.recent_bad.append((path, why))

    def bad_paths(self) -> list[str]:
        with self._lock:
            return [p for p, _ in self.recent_bad]


@dataclass(frozen=True)
class ChunkIO:
    """How a tier's files are written and checked."""

    namespace: bytes
    checksum: str = CHECKSUM
    """The payload checksum written, and required on load (a name of :data:`CHECKSUMS`)."""
    o_direct: bool = False
    fsync: bool = False
    bad_files: str = "delete"
    quarantine_dir: str | None = None
    quarantine_bytes: int | None = None
    """The most bytes every quarantine under :attr:`quarantine_root` holds together (the
    oldest bad files go first; a bad file larger than this is deleted): the quarantine is
    inside ``disk_bytes_to_use``, a quarter of the ledger's reserve.  None: unbounded."""
    quarantine_root: str | None = None
    counters: TierCounters = field(default_factory=TierCounters)


_local = threading.local()


def _header_page() -> mmap.mmap:
    """This thread's page-aligned header buffer (``O_DIRECT`` needs aligned memory)."""
    page = getattr(_local, "page", None)
    if page is None:
        # Private: an anonymous mmap is shared by default, and a forked child would
        # then write its headers into its parent's buffer.
        page = mmap.mmap(-1, HEADER_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        _local.page = page
    return page


def encode_header(
    page: Any, payload_len: int, payload_sum: bytes, key_id: bytes, namespace: bytes,
    checksum: str = CHECKSUM,
) -> None:
    """Write a payload's header into the first bytes of ``page`` (the rest stays zero)."""
    fields = _FIELDS.pack(
        MAGIC, FORMAT_VERSION, CHECKSUMS[checksum], HEADER_SIZE, payload_len, namespace, key_id,
        payload_sum,
    )
    page[: _FIELDS.size] = fields
    page[_FIELDS.size : _HEADER_USED] = digest(fields)


def check_header(
    path: str, page: Any, payload_len: int, key_id: bytes, namespace: bytes,
    checksum: str = CHECKSUM,
) -> bytes:
    """The payload digest of a header that matches; :class:`ChunkFileError` otherwise."""
    fields = bytes(page[: _FIELDS.size])
    if digest(fields) != bytes(page[_FIELDS.size : _HEADER_USED]):
        raise ChunkFileError(path, "header")
    magic, version, algo, hsize, plen, ns, kid, want = _FIELDS.unpack(fields)
    if (magic != MAGIC or version != FORMAT_VERSION or algo != CHECKSUMS[checksum]
            or hsize != HEADER_SIZE):
        raise ChunkFileError(path, "format")
    if plen != payload_len:
        raise ChunkFileError(path, "length")
    if ns != namespace:
        raise ChunkFileError(path, "namespace")
    if kid != key_id:
        raise ChunkFileError(path, "key")
    return bytes(want)


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    """``writev`` until every byte is written; a write that makes no progress is ``ENOSPC``."""
    while buffers:
        n = os.writev(fd, buffers)
        if n <= 0:
            raise OSError(errno.ENOSPC, "write made no progress")
        while buffers and n >= len(buffers[0]):
            n -= len(buffers[0])
            buffers.pop(0)
        if buffers and n:
            buffers[0] = buffers[0][n:]


class _Beside:
    """A hashing thread of the calling I/O thread: ``update`` calls run there, in order."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.todo: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        self.done: queue.SimpleQueue[bytes | BaseException | None] = queue.SimpleQueue()
        self.pending = 0
        threading.Thread(target=self._run, name="kvchunk-fs-hash", daemon=True).start()

    def _run(self) -> None:
        while True:
            h, data = self.todo.get()
            try:
                if data is None:
                    self.done.put(bytes(h.digest(DIGEST_BYTES)))
                else:
                    h.update(data)
                    self.done.put(None)
            except BaseException as exc:  # handed to the I/O thread, which raises it
                self.done.put(exc)

    def update(self, h: Any, data: Any) -> None:
        self.todo.put((h, data))
        self.pending += 1

    def result(self, h: Any) -> bytes:
        """The digest, once every update before it ran (raises what a failed step raised)."""
        self.update(h, None)
        outs = [self.done.get() for _ in range(self.pending)]
        self.pending = 0
        for out in outs:
            if isinstance(out, BaseException):
                raise out
        assert isinstance(outs[-1], bytes)
        return outs[-1]

    @staticmethod
    def get() -> _Beside:
        """This thread's hashing thread (a forked child starts its own)."""
        beside: _Beside | None = getattr(_local, "beside", None)
        if beside is None or beside.pid != os.getpid():
            beside = _local.beside = _Beside()
        return beside


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, "write made no progress")
        data, offset = data[n:], offset + n


def _write_file(fd: int, payload: memoryview, key_id: bytes, io: ChunkIO) -> None:
    """Header and payload into ``fd``; a large payload is hashed while it is written."""
    page = _header_page()
    if len(payload) < OVERLAP_BYTES:
        encode_header(page, len(payload), payload_digest(io.checksum, payload), key_id,
                      io.namespace, io.checksum)
        _write_all(fd, [memoryview(page), payload])
        return
    beside, h = _Beside.get(), payload_hasher(io.checksum, len(payload))
    beside.update(h, payload)
    _pwrite_all(fd, payload, HEADER_SIZE)
    encode_header(page, len(payload), beside.result(h), key_id, io.namespace, io.checksum)
    _pwrite_all(fd, memoryview(page), 0)


def store_chunk(path: str, payload: memoryview, key_id: bytes, io: ChunkIO,
                tmp: str | None = None) -> None:
    """Write one chunk file atomically (replacing any file at ``path``: a freshly computed
    chunk is never second to a file that may be damaged and was never read); ``tmp``: a
    recycled victim (:func:`write_atomically`)."""
    write_atomically(path, io, lambda fd: _write_file(fd, payload, key_id, io), tmp=tmp)


def _pread_all(fd: int, buffers: list[memoryview], offset: int) -> None:
    """Fill ``buffers`` in order from ``offset`` on, looping while a read is short
    (:class:`ChunkFileError` ``size`` at the end of the file)."""
    buffers = [b for b in buffers if len(b)]
    while buffers:
        n = os.preadv(fd, buffers, offset)
        if n <= 0:
            raise ChunkFileError("", "size")
        offset += n
        while buffers and n >= len(buffers[0]):
            n -= len(buffers.pop(0))
        if buffers and n:
            buffers[0] = buffers[0][n:]


def _read_file(fd: int, page: memoryview, dest: memoryview, checksum: str) -> bytes | None:
    """Read a chunk file: its header into ``page`` and its payload into ``dest``, header and
    payload in one request (the payload's first segment, when it is hashed while read);
    the payload's digest, or None for a large payload whose header must be checked first
    (its other segments are read by :func:`_read_rest`)."""
    if len(dest) < OVERLAP_BYTES:
        _pread_all(fd, [page, dest], 0)
        return payload_digest(checksum, dest)
    _pread_all(fd, [page, dest[:SEGMENT_BYTES]], 0)
    return None


def _read_rest(fd: int, dest: memoryview, checksum: str) -> bytes:
    """A large payload's digest, hashed beside its reads: the first segment (read with the
    header) is hashed while the second is read, and so on."""
    beside, h = _Beside.get(), payload_hasher(checksum, len(dest))
    try:
        for start in range(0, len(dest), SEGMENT_BYTES):
            segment = dest[start : start + SEGMENT_BYTES]
            if start:
                _pread_all(fd, [segment], HEADER_SIZE + start)
            beside.update(h, segment)
    finally:
        got = beside.result(h)  # the hashing thread is idle again either way
    return got


def load_chunk(path: str, dest: memoryview, key_id: bytes, io: ChunkIO) -> None:
    """Read and verify one chunk file into ``dest``; :class:`ChunkFileError` if it is bad.

    The size is checked first (``fstat``), then the header and the payload are read in
    one request (the first segment of a payload large enough to be hashed beside its
    reads), and the header is checked before the payload's checksum.  ``dest`` may hold
    some of the file's bytes after a failure (the caller's load job fails, so they are
    never used).
    """
    fd = os.open(path, os.O_RDONLY | (O_DIRECT if io.o_direct else 0))
    st = os.fstat(fd)
    try:
        if st.st_size != HEADER_SIZE + len(dest):
            raise ChunkFileError(path, "size")
        page = memoryview(_header_page())
        try:
            got = _read_file(fd, page, dest, io.checksum)
            expected = check_header(path, page, len(dest), key_id, io.namespace, io.checksum)
            if got is None:
                got = _read_rest(fd, dest, io.checksum)
        except ChunkFileError as exc:
            raise ChunkFileError(path, exc.why) from None
        if got != expected:
            raise ChunkFileError(path, "checksum")
    except ChunkFileError as exc:
        io.counters.bad(path, exc.why)
        logger.warning("kvchunk fs tier: %s: %s; the chunk is recomputed", path, exc.strerror)
        discard_bad_file(path, st, io)
        raise
    finally:
        os.close(fd)


def slices(view: memoryview, offsets: Sequence[int], size: int) -> list[memoryview]:
    flat = view.cast("B")
    for off in offsets:
        if off < 0 or off + size > len(flat):
            raise ValueError(f"chunk offset {off} (+{size}) is outside a {len(flat)}-byte region")
    return [flat[off : off + size] for off in offsets]


def batch_store_chunks(
    paths: Sequence[str],
    key_ids: Sequence[bytes],
    view: memoryview,
    offsets: Sequence[int],
    size: int,
    io: ChunkIO,
    tmps: Sequence[str | None] | None = None,
) -> None:
    """Store a job's chunks (region rows at ``offsets``); raises on the first error.
    ``tmps``: per file, a recycled victim to overwrite (:func:`write_atomically`)."""
    for i, (path, kid, payload) in enumerate(zip(paths, key_ids, slices(view, offsets, size),
                                                 strict=True)):
        store_chunk(path, payload, kid, io, tmps[i] if tmps else None)
        io.counters.add(files_stored=1)


def batch_load_chunks(
    paths: Sequence[str],
    key_ids: Sequence[bytes],
    view: memoryview,
    offsets: Sequence[int],
    size: int,
    io: ChunkIO,
) -> None:
    """Load a job's chunks; on failure the ``OSError`` carries ``num_succeeded``
    (the chunks loaded before the first failing one), as vLLM's ``batch_load_block``.

    After a failure the job's remaining files are still read and verified (and
    discarded when bad), though vLLM will not use them: a bad file is never
    left behind unread, so a later request does not fail on it again.
    """
    first: OSError | None = None
    for i, (path, kid, dest) in enumerate(
        zip(paths, key_ids, slices(view, offsets, size), strict=True)
    ):
        try:
            load_chunk(path, dest, kid, io)
        except OSError as exc:
            if first is None:
                exc.num_succeeded = i  # type: ignore[attr-defined]
                first = exc
            continue
        if first is None:
            io.counters.add(files_loaded=1)
    if first is not None:
        raise first
