"""The packed file of kvchunk's file tier: one file per store job, every key of it a section.

The layout is :mod:`reference.packed`'s (this module writes and reads exactly
those bytes): a page-rounded header, then each section's payload on a page
boundary, in job order (group-major, prefix order: ``KvchunkFileTierManager`` sorts
the job's keys so).  The header is, little-endian::

    magic "KVCPACK\\0" (8) | format version (2) | checksum id (2) | header bytes (4)
    | section count (4) | index bytes (4) | namespace digest (16) | header digest (16)
    | index: per section  key length (2) | group (4) | offset (8) | length (8)
                          | payload checksum (16) | key (key length)

The header digest is BLAKE3 (16 bytes) over the fixed fields and the index; the
payload checksums use the tier's algorithm (:data:`vllm_adapter.disk.chunk_file.CHECKSUMS`).

**Store** (:func:`store_packed`): every payload is hashed, then header and
payloads go to a unique temporary name in one vectored write, which is renamed
onto the file's name: a reader sees the whole file or none.  **Load**
(:func:`load_packed`): the header is read and checked, then only the wanted
sections are read, adjacent ones in one ``preadv`` into their destination rows, and
each is verified against its own checksum.

**What a bad file fails** (the bad-input cases of the tiered faults lane):

* a header that does not verify (torn or overwritten index, wrong digest), another
  format version or magic, another namespace or checksum algorithm, or a file whose
  size is not the header's plus its sections' (truncated or extended: not a file a
  store renamed into place): every key of the file fails, and the file is deleted or
  quarantined (the tier's bad-file policy);
* a missing file: every wanted key fails (``missing``); the tier forgets the file;
* a section that points past the end of the file, is not page-aligned or overlaps
  the one before: that section's key fails;
* two sections claiming one key: that key fails (neither copy can be trusted);
* a key the file's index does not hold (``key``): that key fails;
* a payload whose checksum differs (or a short read): that section's key fails.

A section that fails leaves the tier's index, so only its keys are recomputed and
stored again; the file's other sections keep serving.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from reference.packed import (
    DIGEST_BYTES,
    ENTRY_FIXED_BYTES,
    FIXED_HEADER_BYTES,
    PAGE,
    header_bytes,
    page_round,
)
from vllm_adapter.disk.chunk_file import (
    CHECKSUMS,
    O_DIRECT,
    ChunkFileError,
    ChunkIO,
    digest,
    discard_bad_file,
    payload_digest,
    write_atomically,
)

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "PACKED_DIR",
    "PACKED_SUFFIX",
    "PackedHeader",
    "Section",
    "group_of_key",
    "iter_packed_files",
    "load_packed",
    "packed_name",
    "read_packed_index",
    "store_packed",
]

FORMAT_VERSION = 2
MAGIC = b"KVCPACK\x00"
PACKED_DIR = "packed"
"""Packed files live under ``<namespace dir>/packed/<2 hex digits>/``."""
PACKED_SUFFIX = ".kvp"
MISSING = "missing"
"""Why the keys of a file that is gone fail (the tier forgets the whole file)."""
WHOLE_FILE = frozenset(
    {MISSING, "size", "header", "format", "version", "namespace", "checksum-algorithm", "index"}
)
"""Failures of the file rather than of a section: none of its keys can be served."""
MAX_HEADER_BYTES = 64 << 20
"""A header claiming more is not a header of this format (a job's index is kilobytes)."""
_FIXED = struct.Struct("<8sHHIII16s")
_ENTRY = struct.Struct("<HIQQ16s")
assert _FIXED.size + DIGEST_BYTES == FIXED_HEADER_BYTES
assert _ENTRY.size == ENTRY_FIXED_BYTES
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


@dataclass(frozen=True)
class Section:
    """One key's payload in a packed file."""

    key: bytes
    group: int
    offset: int
    length: int
    checksum: bytes
    position: int
    """Its place in the file's section order (0 first)."""


@dataclass(frozen=True)
class PackedHeader:
    """A packed file's checked header: its sections, and the keys it cannot serve."""

    path: str
    header_bytes: int
    file_bytes: int
    sections: tuple[Section, ...]
    """The sections that can be read (within the file, aligned, one per key)."""
    bad: tuple[tuple[bytes, str], ...]
    """Keys the index names that cannot be served, with why (``bounds``, ``duplicate``)."""

    def section(self, key: bytes) -> Section | None:
        for s in self.sections:
            if s.key == key:
                return s
        return None


def group_of_key(key: bytes) -> int:
    """The KV-cache group of an offload key (vLLM's ``OffloadKey``: hash, then 4-byte group)."""
    return int.from_bytes(bytes(key[-4:]), "big")


def packed_name(namespace_dir: str, keys: Sequence[bytes]) -> str:
    """The file of a store job's keys: named by a digest of the keys, fanned out by its first byte."""
    name = digest(b"".join(bytes(k) for k in keys)).hex()
    return os.path.join(namespace_dir, PACKED_DIR, name[:2], name + PACKED_SUFFIX)


def iter_packed_files(namespace_dir: str) -> Iterator[str]:
    """Every packed file under a namespace directory (temporary files excluded)."""
    root = os.path.join(namespace_dir, PACKED_DIR)
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            if name.endswith(PACKED_SUFFIX):
                yield os.path.join(dirpath, name)


# ---------------------------------------------------------------------------
# The header
# ---------------------------------------------------------------------------


def _aligned(n: int) -> mmap.mmap:
    """A zeroed, page-aligned buffer of ``n`` bytes (``O_DIRECT`` needs aligned memory);
    private, so a forked child does not write into its parent's buffer."""
    return mmap.mmap(-1, max(n, PAGE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def encode_header(
    keys: Sequence[bytes], lengths: Sequence[int], checksums: Sequence[bytes], io: ChunkIO
) -> mmap.mmap:
    """The header of a file holding ``keys`` (one section each, in order), page-rounded."""
    keys = [bytes(k) for k in keys]
    size = header_bytes([len(k) for k in keys])
    index = bytearray()
    at = size
    for key, length, checksum in zip(keys, lengths, checksums, strict=True):
        index += _ENTRY.pack(len(key), group_of_key(key), at, length, checksum) + key
        at += page_round(length)
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, CHECKSUMS[io.checksum], size, len(keys), len(index), io.namespace
    )
    page = _aligned(size)
    page[: _FIXED.size] = fixed
    page[_FIXED.size : FIXED_HEADER_BYTES] = digest(fixed + bytes(index))
    page[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + len(index)] = bytes(index)
    return page


def parse_header(
    path: str, head: bytes, file_bytes: int, namespace: bytes | None, checksum: str | None
) -> PackedHeader:
    """Check a packed file's header bytes; :class:`ChunkFileError` when the whole file is bad.

    ``head`` holds at least the header's ``header bytes``; ``namespace`` /
    ``checksum`` ``None``: not checked (a tool reading any namespace).
    """
    if len(head) < FIXED_HEADER_BYTES:
        raise ChunkFileError(path, "size")
    fixed = head[: _FIXED.size]
    magic, version, algo, size, count, index_len, ns = _FIXED.unpack(fixed)
    if magic != MAGIC:
        raise ChunkFileError(path, "format")
    if version != FORMAT_VERSION:
        raise ChunkFileError(path, "version")
    if size % PAGE or size < FIXED_HEADER_BYTES + index_len or size > len(head):
        raise ChunkFileError(path, "header")
    index = head[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + index_len]
    if digest(fixed + index) != head[_FIXED.size : FIXED_HEADER_BYTES]:
        raise ChunkFileError(path, "header")
    if namespace is not None and ns != namespace:
        raise ChunkFileError(path, "namespace")
    if checksum is not None and algo != CHECKSUMS[checksum]:
        raise ChunkFileError(path, "checksum-algorithm")
    entries: list[Section] = []
    at = 0
    for position in range(count):
        if at + _ENTRY.size > len(index):
            raise ChunkFileError(path, "index")
        key_len, group, offset, length, sum_ = _ENTRY.unpack_from(index, at)
        at += _ENTRY.size
        if at + key_len > len(index):
            raise ChunkFileError(path, "index")
        entries.append(Section(bytes(index[at : at + key_len]), group, offset, length,
                               bytes(sum_), position))
        at += key_len
    if at != len(index):
        raise ChunkFileError(path, "index")
    if file_bytes != size + sum(page_round(s.length) for s in entries):
        raise ChunkFileError(path, "size")  # torn or extended: not a file a store renamed
    bad: dict[bytes, str] = {}
    seen: set[bytes] = set()
    end = size
    for s in entries:
        if s.key in seen:
            bad[s.key] = "duplicate"
        seen.add(s.key)
        if s.offset % PAGE or s.offset < end or s.offset + s.length > file_bytes:
            bad.setdefault(s.key, "bounds")
        else:
            end = s.offset + page_round(s.length)
    good = tuple(s for s in entries if s.key not in bad)
    return PackedHeader(path, size, file_bytes, good, tuple(bad.items()))


def _read_head(fd: int, path: str, file_bytes: int) -> bytes:
    page = _aligned(PAGE)
    n = os.preadv(fd, [page], 0)
    if n < FIXED_HEADER_BYTES:
        raise ChunkFileError(path, "size")
    size = _FIXED.unpack_from(page, 0)[3]
    if size <= PAGE:
        return bytes(page[:n])
    if size > min(MAX_HEADER_BYTES, file_bytes) or size % PAGE:
        raise ChunkFileError(path, "header")
    head = _aligned(size)
    if os.preadv(fd, [head], 0) != size:
        raise ChunkFileError(path, "size")
    return bytes(head)


def read_packed_index(
    path: str, namespace: bytes | None = None, checksum: str | None = None
) -> PackedHeader:
    """Open a packed file and return its checked header (:class:`ChunkFileError` if bad)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        file_bytes = os.fstat(fd).st_size
        return parse_header(path, _read_head(fd, path, file_bytes), file_bytes, namespace,
                            checksum)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# Store and load
# ---------------------------------------------------------------------------


def _writev_all(fd: int, buffers: list[memoryview]) -> None:
    for start in range(0, len(buffers), _IOV_MAX):
        batch = buffers[start : start + _IOV_MAX]
        while batch:
            n = os.writev(fd, batch)
            if n <= 0:
                raise OSError(28, "write made no progress")  # ENOSPC
            while batch and n >= len(batch[0]):
                n -= len(batch[0])
                batch.pop(0)
            if batch and n:
                batch[0] = batch[0][n:]


_local = threading.local()


def _pad(n: int) -> memoryview:
    """``n`` (< PAGE) zero bytes from a page-aligned scratch page (writes) or a sink (reads)."""
    page = getattr(_local, "pad", None)
    if page is None:
        page = _local.pad = _aligned(PAGE)
    return memoryview(page)[:n]


def store_packed(
    path: str, keys: Sequence[bytes], payloads: Sequence[memoryview], io: ChunkIO
) -> tuple[Section, ...]:
    """Write one packed file atomically: ``keys[i]``'s section holds ``payloads[i]``.

    Returns the sections written (what the tier's index records).  Any failure
    removes the temporary file and raises.
    """
    sums = [payload_digest(io.checksum, p) for p in payloads]
    lengths = [len(p) for p in payloads]
    head = encode_header(keys, lengths, sums, io)
    buffers: list[memoryview] = [memoryview(head)]
    padded = True
    for p in payloads:
        buffers.append(p.cast("B") if p.format != "B" else p)
        if len(p) % PAGE:
            buffers.append(_pad(PAGE - len(p) % PAGE))
            padded = False
    write_atomically(path, io, lambda fd: _writev_all(fd, buffers), direct=padded)
    size = len(head)
    sections, at = [], size
    for i, (key, length, checksum) in enumerate(zip(keys, lengths, sums, strict=True)):
        sections.append(Section(bytes(key), group_of_key(key), at, length, checksum, i))
        at += page_round(length)
    return tuple(sections)


def _runs(wanted: list[tuple[Section, memoryview]]) -> list[list[tuple[Section, memoryview]]]:
    """Wanted sections in file order, split where a section does not follow the one before."""
    runs: list[list[tuple[Section, memoryview]]] = []
    for s, dest in sorted(wanted, key=lambda w: w[0].offset):
        if runs and runs[-1][-1][0].position == s.position - 1:
            runs[-1].append((s, dest))
        else:
            runs.append([(s, dest)])
    return runs


def _read_run(fd: int, run: list[tuple[Section, memoryview]]) -> int:
    """One ``preadv`` (looped while short) of adjacent sections; the bytes read."""
    buffers: list[memoryview] = []
    for s, dest in run:
        buffers.append(dest)
        if s.length % PAGE:
            buffers.append(memoryview(bytearray(PAGE - s.length % PAGE)))
    offset, total = run[0][0].offset, 0
    want = sum(len(b) for b in buffers)
    while buffers and total < want:
        n = os.preadv(fd, buffers[:_IOV_MAX], offset + total)
        if n <= 0:
            break
        total += n
        while buffers and n >= len(buffers[0]):
            n -= len(buffers[0])
            buffers.pop(0)
        if buffers and n:
            buffers[0] = buffers[0][n:]
    return total


def load_packed(
    path: str, wants: Sequence[tuple[bytes, memoryview]], io: ChunkIO
) -> dict[bytes, str]:
    """Read and verify the sections of ``wants`` (key, destination) from one packed file.

    Returns the keys that failed, with why (empty: every section loaded).  A
    header that fails fails every wanted key and discards the file (the tier's
    bad-file policy); a section that fails fails its key alone.  The file is
    opened once; adjacent wanted sections are one read.
    """
    counters = io.counters
    direct = io.o_direct and all(len(dest) % PAGE == 0 for _, dest in wants)
    try:
        fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    except FileNotFoundError:
        return {k: MISSING for k, _ in wants}
    except OSError as exc:
        return {k: f"open: {exc.strerror}" for k, _ in wants}
    failed: dict[bytes, str] = {}
    try:
        st = os.fstat(fd)
        counters.add(files_opened=1)
        try:
            header = parse_header(path, _read_head(fd, path, st.st_size), st.st_size,
                                  io.namespace, io.checksum)
        except ChunkFileError as exc:
            counters.bad(path, exc.why)
            discard_bad_file(path, st, io)
            return {k: exc.why for k, _ in wants}
        bad = dict(header.bad)
        by_key = {s.key: s for s in header.sections}
        wanted: list[tuple[Section, memoryview]] = []
        for key, dest in wants:
            s = by_key.get(bytes(key))
            if s is None:
                failed[bytes(key)] = bad.get(bytes(key), "key")  # not in this file's index
            elif s.length != len(dest):
                failed[bytes(key)] = "length"
            else:
                wanted.append((s, dest))
        for run in _runs(wanted):
            got = _read_run(fd, run)
            counters.add(reads=1)
            at = 0
            for s, dest in run:
                span = page_round(s.length)
                if got < at + s.length:
                    failed[s.key] = "size"
                elif payload_digest(io.checksum, dest) != s.checksum:
                    failed[s.key] = "checksum"
                at += span
        ok = [s for s, _ in wanted if s.key not in failed]
        counters.add(sections_loaded=len(ok), bad_sections=len(failed))
        counters.per_group("sections_loaded_per_group", [s.group for s in ok])
        for why in set(failed.values()):
            counters.bad(path, why)
        return failed
    finally:
        os.close(fd)
