"""The packed file's header: its bytes, their checks, and what the tier keeps of them.

The header is, little-endian (the layout is :mod:`reference.packed`'s; the file around it,
its store and its loads are :mod:`vllm_adapter.disk.packed_file`'s)::

    magic "KVCPACK\\0" (8) | format version (2) | checksum id (2) | header bytes (4)
    | section count (4) | index bytes (4) | namespace digest (16) | header digest (16)
    | index: per section  key length (2) | group (4) | offset (8) | length (8)
                          | payload checksum (16) | key (key length)

The header digest is BLAKE3 (16 bytes) over the fixed fields and the index; the payload
checksums use the tier's algorithm (:data:`vllm_adapter.disk.chunk_file.CHECKSUMS`).  The
module refuses to import when its structs' sizes are not the reference's.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from reference.packed import (
    DIGEST_BYTES,
    ENTRY_FIXED_BYTES,
    FIXED_HEADER_BYTES,
    PAGE,
    header_bytes,
    page_round,
)
from vllm_adapter.disk.chunk_file import CHECKSUMS, ChunkFileError, ChunkIO, digest

FORMAT_VERSION = 2
MAGIC = b"KVCPACK\x00"
MAX_HEADER_BYTES = 64 << 20
"""A header claiming more is not a header of this format (a job's index is kilobytes)."""
FIXED_STRUCT = struct.Struct("<8sHHIII16s")
"""The header's fixed fields before its digest."""
ENTRY_STRUCT = struct.Struct("<HIQQ16s")
"""An index entry's fields before its key."""
assert FIXED_STRUCT.size + DIGEST_BYTES == FIXED_HEADER_BYTES
assert ENTRY_STRUCT.size == ENTRY_FIXED_BYTES
Preadv = Callable[[int, list[Any], int], int]
"""How a load reads (``os.preadv``'s call): the tier passes its file I/O object's."""


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
class FileIdentity:
    """Which bytes a packed file held when it was indexed: what one ``fstat`` tells
    (device, inode, size, mtime) and the digest its header carries.

    A load whose ``fstat`` matches skips the header (:func:`load_indexed`).  A rewrite
    by kvchunk is a new file renamed over the name (a new inode); a truncation or an
    append changes the size; any other in-place write changes the mtime.  The header
    digest identifies the header's content: a file parsed again whose digest is the
    indexed one holds the indexed sections (only its ``fstat`` fields changed)."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    header_digest: bytes

    @classmethod
    def of(cls, st: os.stat_result, header_digest: bytes) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, bytes(header_digest))

    def matches(self, st: os.stat_result) -> bool:
        """Whether ``st`` (an ``fstat`` of the opened file) is this file, unchanged."""
        return (st.st_ino, st.st_size, st.st_mtime_ns, st.st_dev) == (
            self.inode, self.size, self.mtime_ns, self.device)


@dataclass(frozen=True)
class HeaderIndex:
    """A packed file's header as kept outside the file (the index snapshot,
    :mod:`vllm_adapter.disk.packed_snapshot`): its size, section count and index bytes,
    exactly as the file holds them.  With the namespace, the checksum algorithm and the
    header digest (the file's :class:`FileIdentity`) they give back the file's header bytes
    (the rest of its fixed part is constant and its padding zeros), which
    :func:`parse_stored_header` checks as a header read from the file is checked."""

    header_bytes: int
    count: int
    index: bytes

    def header(self, namespace: bytes, checksum: str, header_digest: bytes) -> bytes:
        """The header bytes of a file of this index (``header_bytes`` of them, or fewer
        when the index does not fit: :func:`parse_header` then refuses it)."""
        fixed = FIXED_STRUCT.pack(MAGIC, FORMAT_VERSION, CHECKSUMS[checksum], self.header_bytes,
                            self.count, len(self.index), namespace)
        head = fixed + bytes(header_digest) + self.index
        return head + bytes(max(0, self.header_bytes - len(head)))

    def split(self) -> tuple[list[bytes], bytes] | None:
        """The keys of the index's sections in order, and the entries less their keys
        (``ENTRY_FIXED_BYTES`` each, concatenated): an index snapshot stores them
        apart (:mod:`vllm_adapter.disk.packed_snapshot`).  None when the entries are not
        all of one key length."""
        index, count = self.index, self.count
        if count == 0:
            return ([], b"") if not index else None
        if len(index) < 2:
            return None
        key_len = int.from_bytes(index[:2], "little")
        stride = ENTRY_STRUCT.size + key_len
        if count * stride != len(index):
            return None
        if index[0::stride] != index[:1] * count or index[1::stride] != index[1:2] * count:
            return None  # some entry has another key length
        keys = [index[at : at + key_len] for at in range(ENTRY_STRUCT.size, len(index), stride)]
        entries = b"".join([index[at : at + ENTRY_STRUCT.size] for at in range(0, len(index), stride)])
        return keys, entries

    @classmethod
    def joined(cls, header_bytes: int, keys: Sequence[bytes], entries: bytes) -> HeaderIndex:
        """The index of :meth:`split`'s parts."""
        size = ENTRY_STRUCT.size
        index = b"".join([entries[i * size : (i + 1) * size] + key for i, key in enumerate(keys)])
        return cls(header_bytes, len(keys), index)


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
    header_digest: bytes = b""
    """The digest the header carries (BLAKE3 of its fixed fields and index)."""
    identity: FileIdentity | None = None
    """The file this header was read from or written to (None: not known)."""
    raw: HeaderIndex | None = None
    """The header's size, section count and index bytes as in the file (what the index
    snapshot keeps of it; None: not known)."""

    def section(self, key: bytes) -> Section | None:
        for s in self.sections:
            if s.key == key:
                return s
        return None


def group_of_key(key: bytes) -> int:
    """The KV-cache group of an offload key (vLLM's ``OffloadKey``: hash, then 4-byte group)."""
    return int.from_bytes(bytes(key[-4:]), "big")


# ---------------------------------------------------------------------------
# The header
# ---------------------------------------------------------------------------


def aligned_buffer(n: int) -> mmap.mmap:
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
        index += ENTRY_STRUCT.pack(len(key), group_of_key(key), at, length, checksum) + key
        at += page_round(length)
    fixed = FIXED_STRUCT.pack(
        MAGIC, FORMAT_VERSION, CHECKSUMS[io.checksum], size, len(keys), len(index), io.namespace
    )
    page = aligned_buffer(size)
    page[: FIXED_STRUCT.size] = fixed
    page[FIXED_STRUCT.size : FIXED_HEADER_BYTES] = digest(fixed + bytes(index))
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
    fixed = head[: FIXED_STRUCT.size]
    magic, version, algo, size, count, index_len, ns = FIXED_STRUCT.unpack(fixed)
    if magic != MAGIC:
        raise ChunkFileError(path, "format")
    if version != FORMAT_VERSION:
        raise ChunkFileError(path, "version")
    if size % PAGE or size < FIXED_HEADER_BYTES + index_len or size > len(head):
        raise ChunkFileError(path, "header")
    index = head[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + index_len]
    if digest(fixed + index) != head[FIXED_STRUCT.size : FIXED_HEADER_BYTES]:
        raise ChunkFileError(path, "header")
    if namespace is not None and ns != namespace:
        raise ChunkFileError(path, "namespace")
    if checksum is not None and algo != CHECKSUMS[checksum]:
        raise ChunkFileError(path, "checksum-algorithm")
    entries: list[Section] = []
    at = 0
    for position in range(count):
        if at + ENTRY_STRUCT.size > len(index):
            raise ChunkFileError(path, "index")
        key_len, group, offset, length, sum_ = ENTRY_STRUCT.unpack_from(index, at)
        at += ENTRY_STRUCT.size
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
    return PackedHeader(path, size, file_bytes, good, tuple(bad.items()),
                        bytes(head[FIXED_STRUCT.size : FIXED_HEADER_BYTES]),
                        raw=HeaderIndex(size, count, bytes(index)))


def read_head(fd: int, path: str, file_bytes: int, preadv: Preadv | None = None) -> bytes:
    preadv = preadv or os.preadv
    page = aligned_buffer(PAGE)
    n = preadv(fd, [page], 0)
    if n < FIXED_HEADER_BYTES:
        raise ChunkFileError(path, "size")
    size = FIXED_STRUCT.unpack_from(page, 0)[3]
    if size <= PAGE:
        return bytes(page[:n])
    if size > min(MAX_HEADER_BYTES, file_bytes) or size % PAGE:
        raise ChunkFileError(path, "header")
    head = aligned_buffer(size)
    if preadv(fd, [head], 0) != size:
        raise ChunkFileError(path, "size")
    return bytes(head)


def checked_header(
    fd: int, path: str, st: os.stat_result, namespace: bytes | None, checksum: str | None,
    preadv: Preadv | None = None,
) -> PackedHeader:
    """The opened file's checked header, with its identity (``st``: its ``fstat``, taken
    before the header is read: a write after that leaves the file's mtime other than
    the identity's, so the next load parses the header again)."""
    header = parse_header(path, read_head(fd, path, st.st_size, preadv), st.st_size,
                          namespace, checksum)
    return replace(header, identity=FileIdentity.of(st, header.header_digest))


def parse_stored_header(
    path: str, raw: HeaderIndex, identity: FileIdentity, namespace: bytes, checksum: str
) -> PackedHeader:
    """The checked header of a file known by its :class:`HeaderIndex` and identity (an
    index snapshot's entry), without reading the file: the header bytes are rebuilt and
    checked as :func:`parse_header` checks a header read from the file (its digest against
    the identity's, the sections against the identity's size).  Whether the file still is
    that file is each load's ``fstat`` against the identity (:func:`load_indexed`).
    :class:`ChunkFileError` when the entry is not a header of this namespace and algorithm."""
    header = parse_header(path, raw.header(namespace, checksum, identity.header_digest),
                          identity.size, namespace, checksum)
    return replace(header, identity=identity)


def read_packed_index(
    path: str, namespace: bytes | None = None, checksum: str | None = None,
    preadv: Preadv | None = None,
) -> PackedHeader:
    """Open a packed file and return its checked header and identity (:class:`ChunkFileError` if bad)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return checked_header(fd, path, os.fstat(fd), namespace, checksum, preadv)
    finally:
        os.close(fd)


def written_header(
    path: str, head: mmap.mmap, keys: Sequence[bytes], lengths: Sequence[int],
    sums: Sequence[bytes], st: os.stat_result,
) -> PackedHeader:
    """The header of a file just written from ``head`` (:func:`encode_header`'s bytes for
    these keys, lengths and checksums), with its identity from ``st``: no bytes re-read."""
    size = len(head)
    sections, at = [], size
    for i, (key, length, checksum) in enumerate(zip(keys, lengths, sums, strict=True)):
        sections.append(Section(bytes(key), group_of_key(key), at, length, checksum, i))
        at += page_round(length)
    header_digest = bytes(head[FIXED_STRUCT.size : FIXED_HEADER_BYTES])
    index_len = FIXED_STRUCT.unpack_from(head, 0)[5]
    raw = HeaderIndex(size, len(sections),
                      bytes(head[FIXED_HEADER_BYTES : FIXED_HEADER_BYTES + index_len]))
    return PackedHeader(path, size, at, tuple(sections), (), header_digest,
                        FileIdentity.of(st, header_digest), raw)
