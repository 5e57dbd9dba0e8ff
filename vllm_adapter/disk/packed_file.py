"""The packed file of kvchunk's file tier: a store job's full-attention keys, or its window
keys, every key a section (one or two files per job: :func:`reference.packed.store_job_files`).

The layout is :mod:`reference.packed`'s (this module writes and reads exactly
those bytes): a page-rounded header, then each section's payload on a page
boundary, in job order (group-major, prefix order: ``KvchunkFileTierManager`` sorts
the job's keys so, then splits them into its files).  The header's bytes and checks are
:mod:`vllm_adapter.disk.packed_header`'s.

**Store** (:func:`store_packed`): every payload is hashed, then header and
payloads go to a unique temporary name in one vectored write, which is renamed
onto the file's name: a reader sees the whole file or none.  The store returns
the file's sections and its :class:`FileIdentity` (device, inode, size and mtime
of the written file, ``fstat``-ed before the rename, which keeps them; and the
header digest), what the tier's index keeps.  A store job large enough to split
across the tier's pool (:mod:`vllm_adapter.disk.packed_split`) writes the same bytes in
parts: :func:`plan_packed` places every section, :func:`open_packed_temp` creates the
temporary file at its full size, each part is hashed and written at its offsets
(:func:`write_packed_range`), and :func:`finish_packed_temp` writes the header, fsyncs
if asked, ``fstat``-s and renames.

**Load** has two paths, both reading only the wanted sections (adjacent ones in one
``preadv`` into their destination rows) and verifying **each against its own
checksum**:

* *fast* (:func:`load_indexed` with the index's :class:`IndexedFile`): one ``fstat``
  of the opened file; when its device, inode, size and mtime are the identity the
  index recorded, the header is not read: the sections come from the index, which
  holds what the header said when the file was stored or last parsed.
* *full* (:func:`load_packed`, and :func:`load_indexed` without an index entry or
  on any identity mismatch): the header is read and checked (below), and the
  sections come from it.  The parsed header (with the file's new identity) is
  returned, so the index can be refreshed from it.

Why the identity is enough: kvchunk never writes a published file in place (a
rewrite is written aside and renamed: a new inode), so an unchanged identity
means the bytes the index describes; anything else that writes the file in
place changes its mtime (and a truncation or an append its size), so it is
parsed again.  What the fast path does not catch: an in-place write that keeps
size and mtime (the mtime put back with ``utime``, or a write within the file
system's timestamp granularity on a kernel without fine-grained timestamps).
The sections are still checked against the index's checksums, so no wrong byte
is served; damage to the header alone then goes unnoticed until its next full
parse (an identity change, or a start without the index snapshot, which keeps the
header as it was stored: :mod:`vllm_adapter.disk.packed_snapshot`), and is harmless
meanwhile: the index, not the header, says where the sections are.

**What a bad file fails** (the bad-input cases of the tiered faults lane), found
by the full parse:

* a header that does not verify (torn or overwritten index, wrong digest), another
  format version or magic, another namespace or checksum algorithm, or a file whose
  size is not the header's plus its sections' (truncated or extended: not a file a
  store renamed into place): every key of the file fails, and the file is deleted or
  quarantined (the tier's bad-file policy);
* a section that points past the end of the file, is not page-aligned or overlaps
  the one before: that section's key fails;
* two sections claiming one key: that key fails (neither copy can be trusted);
* a key the file's index does not hold (``key``): that key fails.

On either path:

* a missing file: every wanted key fails (``missing``); the tier forgets the file;
* a payload whose checksum differs (or a short read): that section's key fails.

A section that fails leaves the tier's index, so only its keys are recomputed and
stored again; the file's other sections keep serving.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from reference.packed import PAGE, header_bytes, page_round
from vllm_adapter.disk.chunk_file import (
    O_DIRECT,
    ChunkFileError,
    ChunkIO,
    digest,
    discard_bad_file,
    open_temp,
    payload_digest,
    temp_path,
    write_atomically,
)
from vllm_adapter.disk.packed_header import (
    FORMAT_VERSION,
    MAGIC,
    FileIdentity,
    HeaderIndex,
    PackedHeader,
    Preadv,
    Section,
    aligned_buffer,
    checked_header,
    encode_header,
    group_of_key,
    parse_stored_header,
    read_packed_index,
    written_header,
)

__all__ = [
    "FORMAT_VERSION",
    "FileIdentity",
    "HeaderIndex",
    "IndexedFile",
    "Loaded",
    "MAGIC",
    "PACKED_DIR",
    "PACKED_SUFFIX",
    "PackedHeader",
    "PackedPlan",
    "PackedTemp",
    "Preadv",
    "Section",
    "SharedFile",
    "group_of_key",
    "iter_packed_files",
    "load_indexed",
    "discard_packed_temp",
    "finish_packed_temp",
    "load_packed",
    "open_packed_temp",
    "packed_name",
    "parse_stored_header",
    "plan_packed",
    "read_packed_index",
    "store_packed",
    "write_packed_range",
]

PACKED_DIR = "packed"
"""Packed files live under ``<namespace dir>/packed/<2 hex digits>/``."""
PACKED_SUFFIX = ".kvp"
MISSING = "missing"
"""Why the keys of a file that is gone fail (the tier forgets the whole file)."""
WHOLE_FILE = frozenset(
    {MISSING, "size", "header", "format", "version", "namespace", "checksum-algorithm", "index"}
)
"""Failures of the file rather than of a section: none of its keys can be served."""
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024


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
# Store and load
# ---------------------------------------------------------------------------


def _consume(buffers: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``buffers``: what a short read or write has moved."""
    while buffers and n >= len(buffers[0]):
        n -= len(buffers[0])
        buffers.pop(0)
    if buffers and n:
        buffers[0] = buffers[0][n:]


def _write_all(fd: int, buffers: list[memoryview], offset: int | None = None) -> None:
    """Write every byte of ``buffers``, ``_IOV_MAX`` at a time, looping while short: at the
    file's position (``writev``) or at ``offset`` (``pwritev``)."""
    at = offset
    for start in range(0, len(buffers), _IOV_MAX):
        batch = buffers[start : start + _IOV_MAX]
        while batch:
            n = os.writev(fd, batch) if at is None else os.pwritev(fd, batch, at)
            if n <= 0:
                raise OSError(28, "write made no progress")  # ENOSPC
            if at is not None:
                at += n
            _consume(batch, n)


_local = threading.local()


def _pad(n: int) -> memoryview:
    """``n`` (< PAGE) zero bytes from a page-aligned scratch page (writes) or a sink (reads)."""
    page = getattr(_local, "pad", None)
    if page is None:
        page = _local.pad = aligned_buffer(PAGE)
    return memoryview(page)[:n]


def store_packed(
    path: str, keys: Sequence[bytes], payloads: Sequence[memoryview], io: ChunkIO,
    tmp: str | None = None,
) -> PackedHeader:
    """Write one packed file atomically: ``keys[i]``'s section holds ``payloads[i]``.

    Returns its header as written: the sections (what the tier's index records) and
    the file's :class:`FileIdentity` (``fstat``-ed once every byte is written; the
    rename keeps device, inode, size and mtime).  Any failure removes the temporary
    file and raises.  ``tmp``: a recycled victim to overwrite
    (:func:`~vllm_adapter.disk.chunk_file.write_atomically`).
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
    written: list[os.stat_result] = []

    def write(fd: int) -> None:
        _write_all(fd, buffers)
        written.append(os.fstat(fd))

    write_atomically(path, io, write, direct=padded, tmp=tmp)
    return written_header(path, head, keys, lengths, sums, written[-1])


@dataclass(frozen=True)
class PackedPlan:
    """Where each section of a packed file goes, known before any payload is hashed: a
    store split across threads (:mod:`vllm_adapter.disk.packed_split`) writes each range of
    sections at its offsets, and the header last."""

    keys: tuple[bytes, ...]
    lengths: tuple[int, ...]
    header_bytes: int
    offsets: tuple[int, ...]
    """Each section's offset in the file (page-aligned, in key order)."""
    file_bytes: int

    @property
    def direct(self) -> bool:
        """Whether ``O_DIRECT`` may write it: every section a page multiple (the header is)."""
        return all(n % PAGE == 0 for n in self.lengths)


def plan_packed(keys: Sequence[bytes], lengths: Sequence[int]) -> PackedPlan:
    """The layout :func:`store_packed` writes for ``keys`` with payloads of ``lengths``."""
    keys = tuple(bytes(k) for k in keys)
    size = header_bytes([len(k) for k in keys])
    offsets, at = [], size
    for n in lengths:
        offsets.append(at)
        at += page_round(n)
    return PackedPlan(keys, tuple(lengths), size, tuple(offsets), at)


class PackedTemp:
    """A packed file being written in parts: its temporary name and open descriptor (a
    handle, not a value: :meth:`close` and :meth:`discard` may be called more than once)."""

    def __init__(self, path: str, tmp: str, fd: int) -> None:
        self.path = path
        self.tmp = tmp
        self.fd = fd
        self._lock = threading.Lock()
        self._open = True

    def close(self) -> None:
        """Close the descriptor, once (a second close could close a descriptor reused since)."""
        with self._lock:
            if not self._open:
                return
            self._open = False
        os.close(self.fd)

    def discard(self) -> None:
        """Close and remove the temporary file (a failed store)."""
        with contextlib.suppress(OSError):
            self.close()
        with contextlib.suppress(OSError):
            os.remove(self.tmp)


def open_packed_temp(path: str, plan: PackedPlan, io: ChunkIO,
                     tmp: str | None = None) -> PackedTemp:
    """Create ``path``'s temporary file (named as :func:`write_atomically` names them, so a
    dead writer's is swept), sized to the whole file (``ftruncate``: the parts may be
    written in any order); ``tmp``: a recycled victim, opened instead (no larger than the
    file: the ``ftruncate`` extends it)."""
    recycled = tmp is not None
    tmp = tmp or temp_path(path)
    fd = open_temp(tmp, O_DIRECT if io.o_direct and plan.direct else 0, recycled)
    try:
        os.ftruncate(fd, plan.file_bytes)
    except BaseException:
        discard_packed_temp(PackedTemp(path, tmp, fd))
        raise
    return PackedTemp(path, tmp, fd)


def _payload_buffers(payloads: Sequence[memoryview]) -> list[memoryview]:
    """The payloads as bytes, each padded with zeros to a page boundary."""
    buffers: list[memoryview] = []
    for p in payloads:
        buffers.append(p.cast("B") if p.format != "B" else p)
        if len(p) % PAGE:
            buffers.append(_pad(PAGE - len(p) % PAGE))
    return buffers


def write_packed_range(
    temp: PackedTemp, plan: PackedPlan, first: int, payloads: Sequence[memoryview], io: ChunkIO
) -> list[bytes]:
    """Hash the payloads of sections ``first``, ``first + 1``, ... and write them (padded)
    at their offsets in one vectored write; their checksums."""
    if [len(p) for p in payloads] != list(plan.lengths[first : first + len(payloads)]):
        raise ValueError("the payloads' lengths are not the plan's")
    sums = [payload_digest(io.checksum, p) for p in payloads]
    if payloads:
        _write_all(temp.fd, _payload_buffers(payloads), plan.offsets[first])
    return sums


def finish_packed_temp(
    temp: PackedTemp, plan: PackedPlan, sums: Sequence[bytes], io: ChunkIO
) -> PackedHeader:
    """Write the header (it needs every section's checksum), fsync if the tier asks,
    ``fstat`` and rename onto the file's name; the header as written
    (:func:`store_packed`'s).  Any failure removes the temporary file and raises."""
    try:
        head = encode_header(plan.keys, plan.lengths, sums, io)
        _write_all(temp.fd, [memoryview(head)], 0)
        if io.fsync:
            os.fsync(temp.fd)
        st = os.fstat(temp.fd)
        temp.close()
        os.replace(temp.tmp, temp.path)
    except BaseException:
        temp.discard()
        raise
    return written_header(temp.path, head, plan.keys, plan.lengths, sums, st)


def discard_packed_temp(temp: PackedTemp) -> None:
    """Close and remove a temporary file whose store failed (either may be done already)."""
    temp.discard()


@dataclass(frozen=True)
class IndexedFile:
    """What the tier's index knows of one packed file, for a load's fast path."""

    identity: FileIdentity
    """The file as indexed; a load whose ``fstat`` differs parses the header instead."""
    sections: Mapping[bytes, Section]
    """The indexed sections of (at least) the keys the load wants."""


@dataclass(frozen=True)
class Loaded:
    """What :func:`load_indexed` did with one file."""

    failed: dict[bytes, str]
    """The wanted keys that failed, with why (empty: every section loaded)."""
    header: PackedHeader | None
    """The header this load read and checked, with the file's identity (the full
    path); None when it read none (the fast path, or the file failed)."""


def _runs(wanted: list[tuple[Section, memoryview]]) -> list[list[tuple[Section, memoryview]]]:
    """Wanted sections in file order, split where a section does not follow the one before."""
    runs: list[list[tuple[Section, memoryview]]] = []
    for s, dest in sorted(wanted, key=lambda w: w[0].offset):
        if runs and runs[-1][-1][0].position == s.position - 1:
            runs[-1].append((s, dest))
        else:
            runs.append([(s, dest)])
    return runs


def _read_run(fd: int, run: list[tuple[Section, memoryview]], preadv: Preadv) -> int:
    """One ``preadv`` (looped while short) of adjacent sections; the bytes read."""
    buffers: list[memoryview] = []
    for s, dest in run:
        buffers.append(dest)
        if s.length % PAGE:
            buffers.append(memoryview(bytearray(PAGE - s.length % PAGE)))
    offset, total = run[0][0].offset, 0
    want = sum(len(b) for b in buffers)
    while buffers and total < want:
        n = preadv(fd, buffers[:_IOV_MAX], offset + total)
        if n <= 0:
            break
        total += n
        _consume(buffers, n)
    return total


def _read_sections(
    fd: int, path: str, wants: Sequence[tuple[bytes, memoryview]], by_key: Mapping[bytes, Section],
    bad: Mapping[bytes, str], io: ChunkIO, preadv: Preadv,
) -> dict[bytes, str]:
    """Read the wanted sections (``by_key``: where each is) and verify each against its
    checksum; the keys that failed, with why (``bad``: keys the header refused)."""
    counters = io.counters
    failed: dict[bytes, str] = {}
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
        got = _read_run(fd, run, preadv)
        counters.add(reads=1)
        at = 0
        for s, dest in run:
            if got < at + s.length:
                failed[s.key] = "size"
            elif payload_digest(io.checksum, dest) != s.checksum:
                failed[s.key] = "checksum"
            at += page_round(s.length)
    ok = [s for s, _ in wanted if s.key not in failed]
    counters.add(sections_loaded=len(ok), bad_sections=len(failed))
    counters.per_group("sections_loaded_per_group", [s.group for s in ok])
    for why in set(failed.values()):
        counters.bad(path, why)
    return failed


class SharedFile:
    """One packed file that several slices of one load job read, each opening it
    (:mod:`vllm_adapter.disk.packed_split`): under :attr:`lock` each slice opens and checks
    it in turn, with what the slices before it found, so that a header mismatch is parsed
    once (the others check against the parsed identity), a bad file is counted and
    discarded once and a file found gone or bad is not opened again (its keys fail with the
    same reason).  The reads run outside the lock, in parallel."""

    def __init__(self, indexed: IndexedFile | None) -> None:
        self.lock = threading.Lock()
        self.indexed = indexed
        """The identity and sections a load checks the file against (the index's, then
        the header's if a slice parsed it)."""
        self.bad: Mapping[bytes, str] = {}
        """Keys the parsed header refused, with why."""
        self.why: str | None = None
        """Why the whole file failed (every wanted key fails), once a slice found it."""


def _open_checked(
    path: str, io: ChunkIO, indexed: IndexedFile | None, direct: bool, preadv: Preadv,
) -> tuple[int, Mapping[bytes, Section], Mapping[bytes, str], PackedHeader | None] | str:
    """Open ``path`` for a load and check it: ``(fd, sections, refused keys, header)``
    (``header`` None: the fast path, ``indexed`` matched), or why the whole file failed."""
    counters = io.counters
    try:
        fd = os.open(path, os.O_RDONLY | (O_DIRECT if direct else 0))
    except FileNotFoundError:
        return MISSING
    except OSError as exc:
        return f"open: {exc.strerror}"
    try:
        st = os.fstat(fd)
        counters.add(files_opened=1)
        if indexed is not None and indexed.identity.matches(st):
            return fd, indexed.sections, {}, None
        try:
            header = checked_header(fd, path, st, io.namespace, io.checksum, preadv)
        except ChunkFileError as exc:
            counters.bad(path, exc.why)
            discard_bad_file(path, st, io)
            os.close(fd)
            return exc.why
    except BaseException:
        os.close(fd)
        raise
    return fd, {s.key: s for s in header.sections}, dict(header.bad), header


def load_indexed(
    path: str, wants: Sequence[tuple[bytes, memoryview]], io: ChunkIO,
    indexed: IndexedFile | None, preadv: Preadv | None = None,
    shared: SharedFile | None = None,
) -> Loaded:
    """Read and verify the sections of ``wants`` (key, destination) from one packed file.

    The file is opened once and ``fstat``-ed.  Fast path: ``indexed`` is given and its
    identity matches, so the header is not read; the sections are ``indexed``'s.  Full
    path otherwise: the header is read and checked, and returned in :attr:`Loaded.header`
    (a header that fails fails every wanted key and discards the file, the tier's
    bad-file policy).  Either way every section read is verified against its checksum,
    a section that fails fails its key alone, and adjacent wanted sections are one read
    (``preadv``: how, ``os.preadv`` by default).  ``shared``: the file as the other slices
    of a split load job found it (:class:`SharedFile`; ``indexed`` is then its).
    """
    preadv = preadv or os.preadv
    direct = io.o_direct and all(len(dest) % PAGE == 0 for _, dest in wants)
    if shared is None:
        opened = _open_checked(path, io, indexed, direct, preadv)
    else:
        with shared.lock:
            opened = shared.why or _open_checked(path, io, shared.indexed, direct, preadv)
            if isinstance(opened, str):
                shared.why = opened
            else:
                fd, by_key, bad, header = opened
                if header is not None:  # parsed: the next slices check against this header
                    shared.indexed = IndexedFile(header.identity or _no_identity(), by_key)
                    shared.bad = bad
                elif shared.bad:
                    opened = (fd, by_key, shared.bad, None)
    if isinstance(opened, str):
        return Loaded({k: opened for k, _ in wants}, None)
    fd, by_key, bad, header = opened
    try:
        return Loaded(_read_sections(fd, path, wants, by_key, bad, io, preadv), header)
    finally:
        os.close(fd)


def _no_identity() -> FileIdentity:
    """An identity no ``fstat`` matches (a parsed header always carries the file's)."""
    return FileIdentity(-1, -1, -1, -1, b"")


def load_packed(
    path: str, wants: Sequence[tuple[bytes, memoryview]], io: ChunkIO
) -> dict[bytes, str]:
    """Read and verify the sections of ``wants`` (key, destination) from one packed file,
    its header read and checked first (:func:`load_indexed`'s full path).

    Returns the keys that failed, with why (empty: every section loaded).  A
    header that fails fails every wanted key and discards the file (the tier's
    bad-file policy); a section that fails fails its key alone.  The file is
    opened once; adjacent wanted sections are one read.
    """
    return load_indexed(path, wants, io, None).failed
