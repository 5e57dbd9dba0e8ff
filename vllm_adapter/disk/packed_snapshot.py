"""The packed tier's index snapshot: every packed file's header and identity in one file.

**Why** (issue #30 item 4): a packed tier answers lookups from its in-memory index, key ->
(file, section).  Rebuilt from the files' headers, a start reads one header per file:
15 s per 100k files with a cold page cache, 4.7 s warm (``reports/bench.md``, "a tier's
start over a full root").  The snapshot is one file per namespace,
``<namespace dir>/kvchunk-packed-index.snap``, written when the tier shuts down and every
:data:`vllm_adapter.disk.tier.SNAPSHOT_SECONDS` by its follower thread while the index
changes; a start reads it (one sequential read) instead of the headers.

**What it holds**, per packed file: its name (relative to the namespace directory), its
:class:`~vllm_adapter.disk.packed_file.FileIdentity` (device, inode, size, mtime, header
digest) and its header as the file holds it (:class:`~vllm_adapter.disk.packed_file.HeaderIndex`:
size, section count, index entries).  Nothing is pickled (the root may be shared): the
format is fixed little-endian fields, column by column, so that a start reads 100k files'
keys with a few C-speed passes, not a Python loop per entry::

    magic "KVCSNAP\0" (8) | snapshot version (2) | packed format version (2)
    | checksum id (2) | key bytes (2) | namespace digest (16) | files (4) | sections (8)
    | names bytes (8)
    | sections per file: files x 4
    | per file: header bytes (4) | device (8) | inode (8) | size (8) | mtime ns (8)
                | header digest (16)
    | names: the files' names, joined by "\n"
    | keys: sections x key bytes, file by file, in section order
    | entries: sections x 38, each index entry less its key
    | digest (16): BLAKE3 of everything before it

A file whose keys are not all ``key bytes`` long is left out (its header is read at start).

**How a start trusts it** (:meth:`vllm_adapter.disk.packed_io.PackedIndex.start`):

* the whole file is checked first (magic, versions, the namespace and checksum algorithm
  of the tier, its length, its digest); a snapshot missing, damaged, of another
  namespace, algorithm or format is not used: every file's header is read, as before;
* it is validated against the directory listing: a listed file it does not describe
  (written after it) has its header read; an entry whose file is not listed (evicted,
  removed) is dropped;
* an entry's header is checked as a header read from the file (its digest, its sections
  against the file's size) when the file is first loaded, and an entry that fails is
  loaded as a file of unknown identity (the load reads the file's header);
* whether the file still is the one the entry describes is each load's ``fstat`` against
  the entry's identity (:func:`vllm_adapter.disk.packed_file.load_indexed`): a file
  rewritten under its name (a new inode), truncated, extended or written in place (a new
  mtime) is parsed from its own header and its index entry refreshed; every section read
  is verified against its checksum whatever the path, so a stale entry never serves a
  wrong byte.

**Cost**: per file 57 bytes and its name (~100 bytes), per section 38 bytes and its key
(~74): about 0.01 % of the files' bytes with 2 MiB sections.  The tier writes it only
when it fits in an eighth of the ledger's reserve (:func:`vllm_adapter.disk.ledger.ledger_reserve`:
1/1024 of ``disk_bytes_to_use`` up to 1 GiB of reserve), which holds it inside the budget:
sections of 180 KiB and more always fit, the budget bench's 4 KiB sections do not (its
start from the snapshot is what a tier with larger sections does).  A start reads it in
one pass instead of one header per file (the times: ``reports/bench.md``, "a tier's start
over a full root", ``conformance/bench/test_bench_budget.py``).
"""

from __future__ import annotations

import array
import itertools
import os
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from reference.packed import ENTRY_FIXED_BYTES
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk.chunk_file import CHECKSUMS, ChunkIO, digest, write_atomically

__all__ = [
    "SNAPSHOT_FILE",
    "Snapshot",
    "SnapshotEntry",
    "encode_snapshot",
    "entry_of",
    "read_snapshot",
    "write_snapshot",
]

SNAPSHOT_FILE = "kvchunk-packed-index.snap"
"""In the namespace directory (not under ``packed/``: the listing never names it)."""
MAGIC = b"KVCSNAP\x00"
VERSION = 1
_HEAD = struct.Struct("<8sHHHH16sIQQ")
_RECORD = struct.Struct("<IQQQq16s")
_ENTRY = ENTRY_FIXED_BYTES
_DIGEST = 16

SnapshotEntry = tuple[str, P.FileIdentity, int, Sequence[bytes], bytes]
"""One file: its name (relative to the namespace directory), identity, header bytes, and
its index apart (:meth:`~vllm_adapter.disk.packed_file.HeaderIndex.split`: the keys, the
entries less their keys)."""


def entry_of(name: str, identity: P.FileIdentity, raw: P.HeaderIndex) -> SnapshotEntry | None:
    """A file's snapshot entry (None: its keys are not of one length; it is left out)."""
    parts = raw.split()
    return None if parts is None else (name, identity, raw.header_bytes, *parts)


def _counts(raw: bytes) -> list[int]:
    counts = array.array("I")
    assert counts.itemsize == 4
    counts.frombytes(raw)
    if sys.byteorder != "little":
        counts.byteswap()
    return counts.tolist()


@dataclass(frozen=True)
class Snapshot:
    """A checked snapshot, its columns as read (a start touches each file's record only
    when that file is first loaded: :meth:`file`)."""

    names: list[str]
    counts: list[int]
    """Sections per file."""
    starts: list[int]
    """Per file, its first key's place in :attr:`keys` (and, last, the number of keys)."""
    keys: list[bytes]
    data: bytes
    records_at: int
    entries_at: int

    def entry(self, i: int, name: str) -> SnapshotEntry:
        """File ``i``'s entry, as read (``name``: what to call it)."""
        header_bytes, dev, ino, size, mtime, header_digest = _RECORD.unpack_from(
            self.data, self.records_at + i * _RECORD.size)
        first, last = self.starts[i], self.starts[i + 1]
        entries = self.data[self.entries_at + first * _ENTRY : self.entries_at + last * _ENTRY]
        return (name, P.FileIdentity(dev, ino, size, mtime, header_digest), header_bytes,
                self.keys[first:last], entries)

    def file(self, i: int) -> tuple[P.FileIdentity, P.HeaderIndex]:
        """File ``i``'s identity and header."""
        _, identity, header_bytes, keys, entries = self.entry(i, "")
        return identity, P.HeaderIndex.joined(header_bytes, keys, entries)


def encode_snapshot(namespace: bytes, checksum: str, entries: Iterable[SnapshotEntry]) -> bytes:
    """The snapshot file's bytes for ``entries`` (a tier's namespace and algorithm); a file
    whose keys are not of the first file's key length, or whose name holds a newline, is
    left out."""
    counts = array.array("I")
    records: list[bytes] = []
    names: list[str] = []
    keys: list[bytes] = []
    fixed: list[bytes] = []
    key_len: int | None = None
    for name, identity, header_bytes, file_keys, file_entries in entries:
        if "\n" in name:
            continue
        if file_keys:
            if key_len is None:
                key_len = len(file_keys[0])
            if len(file_keys[0]) != key_len:
                continue
        counts.append(len(file_keys))
        records.append(_RECORD.pack(header_bytes, identity.device, identity.inode,
                                    identity.size, identity.mtime_ns, identity.header_digest))
        names.append(name)
        keys += file_keys
        fixed.append(file_entries)
    if sys.byteorder != "little":
        counts.byteswap()
    name_block = "\n".join(names).encode()
    head = _HEAD.pack(MAGIC, VERSION, P.FORMAT_VERSION, CHECKSUMS[checksum], key_len or 0,
                      bytes(namespace), len(names), len(keys), len(name_block))
    data = b"".join([head, counts.tobytes(), *records, name_block, *keys, *fixed])
    return data + digest(memoryview(data))


def read_snapshot(path: str, namespace: bytes, checksum: str) -> Snapshot | str:
    """The checked snapshot at ``path``, or why it is not used (``missing``, ``damaged``,
    ``version``, ``namespace``): a tier uses only a whole snapshot of its own namespace,
    algorithm and formats."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    if len(data) < _HEAD.size + _DIGEST:
        return "damaged"
    magic, version, fmt, algo, key_len, ns, files, sections, name_bytes = _HEAD.unpack_from(data)
    if magic != MAGIC:
        return "damaged"
    at = _HEAD.size
    records_at = at + 4 * files
    names_at = records_at + _RECORD.size * files
    keys_at = names_at + name_bytes
    entries_at = keys_at + key_len * sections
    if entries_at + _ENTRY * sections + _DIGEST != len(data):
        return "damaged"
    if digest(memoryview(data)[:-_DIGEST]) != data[-_DIGEST:]:
        return "damaged"
    if version != VERSION or fmt != P.FORMAT_VERSION:
        return "version"
    if ns != namespace or algo != CHECKSUMS[checksum]:
        return "namespace"
    counts = _counts(data[at:records_at])
    names = data[names_at:keys_at].decode("utf-8", "replace").split("\n") if files else []
    if len(names) != files or sum(counts) != sections:
        return "damaged"
    starts = list(itertools.accumulate(counts, initial=0))
    keys = ([data[i : i + key_len] for i in range(keys_at, entries_at, key_len)]
            if key_len else [b""] * sections)
    return Snapshot(names, counts, starts, keys, data, records_at, entries_at)


def write_snapshot(namespace_dir: str, io: ChunkIO, entries: Sequence[SnapshotEntry],
                   max_bytes: int | None = None) -> int | None:
    """Write the snapshot of ``entries`` atomically (a temporary file renamed over
    :data:`SNAPSHOT_FILE`; a reader sees the old one or the new one); its bytes, or None
    when it would pass ``max_bytes`` (nothing written; an older snapshot stays, validated
    like any stale one when a tier starts)."""
    data = encode_snapshot(io.namespace, io.checksum, entries)
    if max_bytes is not None and len(data) > max_bytes:
        return None
    path = os.path.join(namespace_dir, SNAPSHOT_FILE)
    view = memoryview(data)

    def write(fd: int) -> None:
        at = 0
        while at < len(view):
            n = os.write(fd, view[at:])
            if n <= 0:
                raise OSError(28, "write made no progress")  # ENOSPC
            at += n

    write_atomically(path, io, write, direct=False)
    return len(data)
