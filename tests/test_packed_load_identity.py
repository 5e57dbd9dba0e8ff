"""Packed loads without a header re-read (issue #30 item 1): the index's file identity.

The packed tier's index keeps each file's :class:`~vllm_adapter.disk.packed_file.FileIdentity`
(device, inode, size, mtime, header digest) from its store or its last header parse.  A
load whose ``fstat`` matches reads the indexed sections directly, never the header, and
still verifies every section's checksum; a file whose identity changed (rewritten by
rename, truncated, grown, written in place) is parsed again, its index entry refreshed
from the header or its keys failed.  Only the changed file's keys are affected.

Reads are counted through the tier's file I/O object (a
:class:`~vllm_adapter.disk.fileio.TierFileIO` whose ``preadv`` records every read of a
load), the object :class:`~vllm_adapter.disk.tier.KvchunkFileTierManager` uses; one
test checks at the system calls that no read of a load bypasses it.  No vLLM needed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from conformance.harness import packed_faults as PF
from reference import packed as R
from reference import packed_split as RS
from vllm_adapter.disk import chunk_file as C
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk import packed_io as PIO
from vllm_adapter.disk import packed_split as PS
from vllm_adapter.disk.fileio import TierFileIO

NS = bytes(range(16))
ROW = 2 * R.PAGE


def _key(n: int, group: int = 0) -> bytes:
    return bytes([n]) * 32 + group.to_bytes(4, "big")


A_KEYS = [_key(1, 0), _key(1, 1), _key(2, 0), _key(2, 1)]
B_KEYS = [_key(3, 0), _key(3, 1)]


class ReadProbe(TierFileIO):
    """The tier's file I/O, every read of a packed file recorded: (path, offset, bytes)."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, int, int]] = []

    def preadv(self, fd: int, buffers: list[Any], offset: int) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
        self.reads.append((path, offset, sum(len(memoryview(b)) for b in buffers)))
        return super().preadv(fd, buffers, offset)

    def of(self, path: str) -> list[tuple[int, int]]:
        """The reads of ``path``, (offset, bytes), in order."""
        real = os.path.realpath(path)
        return [(off, n) for p, off, n in self.reads if p == real]

    def header_reads(self, path: str, header_bytes: int = R.PAGE) -> list[tuple[int, int]]:
        """The reads of ``path`` that touch its header (bytes before ``header_bytes``)."""
        return [(off, n) for off, n in self.of(path) if off < header_bytes]


class Tier:
    """The packed tier's file work, as :class:`~vllm_adapter.disk.tier.KvchunkFileTierManager`
    does it: its index, its file I/O object, a region of ``ROW``-byte rows."""

    def __init__(self, root: Path, **io: Any) -> None:
        self.root = str(root)
        self.io = C.ChunkIO(namespace=NS, counters=C.TierCounters(), **io)
        self.file_io = ReadProbe()
        self.index = PIO.PackedIndex()

    def store(self, keys: list[bytes], path: str | None = None) -> tuple[str, dict[bytes, bytes]]:
        """One store job's file (random rows), indexed as the tier does; its rows by key."""
        data = os.urandom(len(keys) * ROW)
        path = path or P.packed_name(self.root, keys)
        header = self.file_io.store_packed(path, keys, memoryview(bytearray(data)),
                                           [i * ROW for i in range(len(keys))], ROW, self.io)
        self.index.add(path, header)
        return path, {k: data[i * ROW : (i + 1) * ROW] for i, k in enumerate(keys)}

    def load(self, keys: list[bytes], split: bool = False) -> tuple[dict[bytes, bytes], Any]:
        """One load job of ``keys``: the rows it filled, and the ``OSError`` it raised (or
        None).  ``split``: split across the pool as the tier splits a large job
        (:class:`~vllm_adapter.disk.packed_split.SplitLoad`, one slice per section here),
        its tasks run in reverse; exactly one of them may raise."""
        view = memoryview(bytearray(len(keys) * ROW))
        offsets = [i * ROW for i in range(len(keys))]
        self.file_io.reads.clear()
        error = None
        if split:
            plan = PIO.LoadPlan.of(self.index, keys)
            assert plan is not None
            slices = PS.load_job_slices(plan, keys, RS.LoadSplit(len(keys), ROW))
            assert len(slices) == len(keys)

            def load(keys_: Any, offsets_: Any) -> None:
                self.file_io.load_packed(self.index, keys_, view, offsets_, ROW, self.io,
                                         plan=plan)

            raised = []
            for task in reversed(PS.SplitLoad(keys, offsets, slices,
                                              [plan.path_of[k] for k in keys],
                                              begin=lambda: None, load=load,
                                              end=lambda *_: None).tasks):
                try:
                    task()
                except OSError as exc:
                    raised.append(exc)
            assert len(raised) <= 1, raised
            error = raised[0] if raised else None
        else:
            try:
                self.file_io.load_packed(self.index, keys, view, offsets, ROW, self.io)
            except OSError as exc:
                error = exc
        return {k: bytes(view[i * ROW : (i + 1) * ROW]) for i, k in enumerate(keys)}, error


def _same_mtime(path: str, st: os.stat_result) -> None:
    """Put ``path``'s mtime back to ``st``'s (an in-place write that keeps the identity)."""
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_load_of_an_unchanged_file_does_not_read_its_header(tmp_path: Path) -> None:
    """Stored and indexed: the load's reads are the indexed sections (one ``preadv`` of the
    four adjacent sections), none at an offset inside the header.  The probe does see
    header reads: the same file indexed from its sections alone (no identity) is parsed on
    its first load, which gives the index its identity, and the next load reads no header."""
    tier = Tier(tmp_path)
    path, data = tier.store(A_KEYS)
    got, error = tier.load(A_KEYS)
    assert error is None and got == data
    assert tier.file_io.of(path) == [(R.PAGE, 4 * ROW)], tier.file_io.reads
    assert tier.io.counters.files_opened == 1 and tier.io.counters.sections_loaded == 4

    header = P.read_packed_index(path, NS, C.CHECKSUM)
    tier.index.add(path, header.sections)  # sections only: identity unknown
    got, error = tier.load(A_KEYS[1:3])
    assert error is None and got == {k: data[k] for k in A_KEYS[1:3]}
    assert tier.file_io.of(path) == [(0, R.PAGE), (R.PAGE + ROW, 2 * ROW)], tier.file_io.reads
    assert tier.index.identity(path) == header.identity, "the parse did not refresh the index"
    got, error = tier.load(A_KEYS[1:3])
    assert error is None and not tier.file_io.header_reads(path)


def test_a_peer_s_file_indexed_by_its_keys_is_parsed_at_its_first_load(tmp_path: Path) -> None:
    """Another engine's file joins the index by the keys the root's ledger names, unopened
    (``PackedIndex.add_keys``, the tier's follower): the keys are hits at once; the first
    load reads the header, checks every section and gives the index the file's identity
    and sections, so the next load reads no header.  A key the ledger names that the file
    does not hold fails alone and leaves the index."""
    writer, reader = Tier(tmp_path), Tier(tmp_path)
    path, data = writer.store(A_KEYS)
    stray = _key(9, 0)
    reader.index.add_keys(path, [*A_KEYS, stray])
    assert all(k in reader.index for k in A_KEYS) and reader.index.identity(path) is None
    assert reader.file_io.reads == [], "indexing opened the file"
    got, error = reader.load(A_KEYS)
    assert error is None and got == data
    assert reader.file_io.header_reads(path) == [(0, R.PAGE)]
    assert reader.index.identity(path) == P.read_packed_index(path).identity
    got, error = reader.load(A_KEYS[2:])
    assert error is None and got == {k: data[k] for k in A_KEYS[2:]}
    assert not reader.file_io.header_reads(path)
    _, error = reader.load([stray])
    assert error is not None and error.num_succeeded == 0 and stray not in reader.index
    assert all(k in reader.index for k in A_KEYS)


def test_no_read_of_a_load_bypasses_the_file_io_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the system calls: every read a load makes (fast and full path) is one the tier's
    file I/O object saw, so the probe's silence about the header is the load's."""
    tier = Tier(tmp_path)
    path, _ = tier.store(A_KEYS)
    calls: list[tuple[str, int]] = []
    real_preadv = os.preadv

    def preadv(fd: int, buffers: list[Any], offset: int, *a: int) -> int:
        calls.append(("preadv", offset))
        return real_preadv(fd, buffers, offset, *a)

    def other(name: str) -> Any:
        real = getattr(os, name)

        def call(*a: Any, **kw: Any) -> Any:
            calls.append((name, -1))
            return real(*a, **kw)

        return call

    monkeypatch.setattr(os, "preadv", preadv)
    for name in ("pread", "read", "readv"):
        monkeypatch.setattr(os, name, other(name))
    for identity in (True, False):
        if not identity:
            tier.index.add(path, P.read_packed_index(path).sections)
        calls.clear()
        _, error = tier.load(A_KEYS)
        assert error is None
        assert calls == [("preadv", off) for off, _ in tier.file_io.of(path)], calls


@pytest.mark.parametrize("split", [False, True], ids=["one-task", "split"])
@pytest.mark.parametrize("mtime", ["kept", "changed"])
def test_a_flipped_payload_byte_fails_its_key_on_either_path(
    tmp_path: Path, mtime: str, split: bool
) -> None:
    """One byte of section 2's payload flipped in place (``os.pwrite``: same inode, same
    size).  ``kept``: the mtime is put back, so the identity matches and the fast path reads
    no header; the flipped byte can then only be caught by the section's checksum, so **this
    case fails if the fast path skips the checksum check** (it would load the flipped row).
    ``changed``: the write's new mtime sends the load to the full parse, which checks it too.
    Either way only that key fails, it leaves the index, the file stays and serves the rest.
    ``split``: the job split across the pool, one slice per section (a slice that skipped
    the checksum would load the flipped row), the job's error raised once."""
    tier = Tier(tmp_path)
    path, data = tier.store(A_KEYS)
    other, other_data = tier.store(B_KEYS)
    st = os.stat(path)
    offset = R.PAGE + 2 * ROW + 123
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x01]), offset)
    finally:
        os.close(fd)
    if mtime == "kept":
        _same_mtime(path, st)
    identity = tier.index.identity(path)
    assert identity is not None and identity.matches(os.stat(path)) == (mtime == "kept")
    got, error = tier.load(A_KEYS + B_KEYS, split)
    assert error is not None and error.failed_by_file == {path: [A_KEYS[2]], other: []}
    assert error.num_succeeded == 2
    assert tier.io.counters.bad_files == {"checksum": 1}
    assert bool(tier.file_io.header_reads(path)) == (mtime == "changed"), tier.file_io.reads
    assert [got[k] == data[k] for k in A_KEYS] == [True, True, False, True]
    assert all(got[k] == other_data[k] for k in B_KEYS)
    assert A_KEYS[2] not in tier.index and A_KEYS[3] in tier.index and os.path.exists(path)


def _two_files(tmp_path: Path, indexed: str) -> tuple[Tier, str, str, dict[bytes, bytes], os.stat_result]:
    """A tier with A's file and B's file stored; A's indexed by identity, or (``sections``)
    without one, or (``keys``) by its keys alone, as a peer's file the ledger names; A's
    stat."""
    tier = Tier(tmp_path)
    path, _ = tier.store(A_KEYS)
    other, other_data = tier.store(B_KEYS)
    if indexed == "sections":
        tier.index.add(path, P.read_packed_index(path).sections)
    elif indexed == "keys":
        tier.index.add_keys(path, A_KEYS)
    return tier, path, other, other_data, os.stat(path)


@pytest.mark.parametrize("indexed", ["identity", "sections", "keys", "identity-split"])
def test_a_truncated_file_fails_only_its_keys(tmp_path: Path, indexed: str) -> None:
    """A file shortened by a page (its mtime put back: the size alone differs): the fast
    path's ``fstat`` sees another size, so the header is parsed, which finds the file short
    (``size``): every key of that file fails, the file is deleted and leaves the index; the
    other file of the job loads.  ``sections``: the file indexed without an identity (the
    full path from the start), the same.  ``identity-split``: the job split across the
    pool, one slice per section: the first slice to open the file parses it, the others
    fail its keys without opening it again (the header read once, the file counted bad
    once)."""
    tier, path, other, other_data, st = _two_files(tmp_path, indexed.removesuffix("-split"))
    os.truncate(path, st.st_size - R.PAGE)
    _same_mtime(path, st)
    got, error = tier.load(B_KEYS[:1] + A_KEYS + B_KEYS[1:], indexed.endswith("-split"))
    assert error is not None and error.num_succeeded == 1
    assert error.failed_by_file == {other: [], path: A_KEYS}
    assert tier.file_io.header_reads(path) == [(0, R.PAGE)], "the size change was not re-verified"
    assert all(got[k] == other_data[k] for k in B_KEYS)
    assert tier.io.counters.bad_files == {"size": 1} and not os.path.exists(path)
    assert not tier.index.has_file(path) and not any(k in tier.index for k in A_KEYS)
    assert tier.index.has_file(other) and all(k in tier.index for k in B_KEYS)


class TruncatingProbe(ReadProbe):
    """Truncates ``victim`` to ``size`` bytes just before the first read of a load: a
    truncation after the load's ``fstat`` found the indexed identity."""

    def __init__(self, victim: str, size: int) -> None:
        super().__init__()
        self.victim, self.size = victim, size

    def preadv(self, fd: int, buffers: list[Any], offset: int) -> int:
        if self.size >= 0:
            os.truncate(self.victim, self.size)
            self.size = -1
        return super().preadv(fd, buffers, offset)


def test_a_file_truncated_during_a_fast_load_fails_only_the_short_sections(
    tmp_path: Path,
) -> None:
    """Truncated after the ``fstat`` matched (so the header is not read), in the middle of
    section 2: the reads come back short, so sections 2 and 3 fail (``size``) and 0 and 1
    load.  A short read says the file is not whole, so it leaves the index (its other
    keys miss from then on, as before the fast path); its header was not read, so it is
    not judged bad and deleted here."""
    tier = Tier(tmp_path)
    path, data = tier.store(A_KEYS)
    tier.file_io = TruncatingProbe(path, R.PAGE + 2 * ROW + 100)
    got, error = tier.load([A_KEYS[3], A_KEYS[0], A_KEYS[2], A_KEYS[1]])
    assert error is not None and error.num_succeeded == 0
    assert error.failed_by_file == {path: [A_KEYS[3], A_KEYS[2]]}
    assert not tier.file_io.header_reads(path)
    assert got[A_KEYS[0]] == data[A_KEYS[0]] and got[A_KEYS[1]] == data[A_KEYS[1]]
    assert tier.io.counters.bad_files == {"size": 1} and os.path.exists(path)
    assert not tier.index.has_file(path) and not any(k in tier.index for k in A_KEYS)


@pytest.mark.parametrize("indexed", ["identity", "sections"])
def test_a_grown_file_is_reverified_and_fails_every_key(tmp_path: Path, indexed: str) -> None:
    """A page appended to a file whose sections are intact (its mtime put back: the size
    alone differs): the new size sends the load to the full parse (on the fast path its
    sections would load), and the file fails as a whole (``size``), as the full parse has
    always failed it.  Intended: kvchunk never appends to a file (a store writes it whole
    and renames it), so a size other than the header's plus its sections' means something
    else wrote it, and nothing it says is trusted; the tiered faults lane's ``extended``
    case requires the failed load.  Its keys are recomputed and stored again.
    ``sections``: the file indexed without an identity (the full path from the start)."""
    tier, path, other, other_data, st = _two_files(tmp_path, indexed)
    with open(path, "ab") as f:
        f.write(bytes(R.PAGE))
    _same_mtime(path, st)
    got, error = tier.load(A_KEYS + B_KEYS)
    assert error is not None and error.failed_by_file == {path: A_KEYS, other: []}
    assert tier.file_io.header_reads(path) == [(0, R.PAGE)]
    assert all(got[k] == other_data[k] for k in B_KEYS)
    assert not os.path.exists(path) and not any(k in tier.index for k in A_KEYS)


def test_a_file_rewritten_by_rename_is_parsed_and_its_entry_refreshed(tmp_path: Path) -> None:
    """The same keys stored again at the same name (another engine's store: other rows,
    written aside and renamed, so a new inode; here given the old file's mtime, and it has
    its size, so the inode alone differs): the load parses the new header and loads the
    new rows against the new checksums (the indexed ones would fail them); the index takes
    the new identity, so the next load reads no header."""
    tier = Tier(tmp_path)
    path, _ = tier.store(A_KEYS)
    before = tier.index.identity(path)
    again = Tier(tmp_path)
    _, data = again.store(A_KEYS)
    assert before is not None
    os.utime(path, ns=(before.mtime_ns, before.mtime_ns))
    st = os.stat(path)
    assert (st.st_ino != before.inode, st.st_size, st.st_mtime_ns) == (True, before.size,
                                                                       before.mtime_ns)
    again.index.add(path, P.read_packed_index(path, NS, C.CHECKSUM))  # its identity now
    got, error = tier.load(A_KEYS)
    assert error is None and got == data
    assert tier.file_io.header_reads(path) == [(0, R.PAGE)]
    assert tier.index.identity(path) == again.index.identity(path)
    got, error = tier.load(A_KEYS)
    assert error is None and got == data and not tier.file_io.header_reads(path)


def test_a_file_replaced_by_rename_with_other_keys_fails_its_keys(tmp_path: Path) -> None:
    """Another valid file (other keys) renamed onto a file's name: the new inode sends the
    load to the full parse; the header verifies but holds none of the wanted keys
    (``key``): those fail, and the keys the index held there that the header does not
    serve leave the index, not loaded; the file itself is whole, so it stays."""
    tier = Tier(tmp_path)
    path, _ = tier.store(A_KEYS)
    other, other_data = tier.store(B_KEYS)
    foreign = str(tmp_path / "foreign.kvp")
    Tier(tmp_path).store([_key(9, 0), _key(9, 1)], foreign)
    os.replace(foreign, path)
    got, error = tier.load(A_KEYS[:2] + B_KEYS)
    assert error is not None and error.failed_by_file == {path: A_KEYS[:2], other: []}
    assert tier.file_io.header_reads(path) == [(0, R.PAGE)]
    assert tier.io.counters.bad_files == {"key": 1} and os.path.exists(path)
    assert all(got[k] == other_data[k] for k in B_KEYS)
    assert not any(k in tier.index for k in A_KEYS), "keys the new header lacks stayed indexed"


def test_a_header_damaged_in_place_is_found_by_the_full_parse(tmp_path: Path) -> None:
    """A torn index written in place (same inode and size, a new mtime): parsed, so every
    key of the file fails (``header``) and the file is deleted, as before the fast path."""
    tier = Tier(tmp_path)
    path, _ = tier.store(A_KEYS)
    PF.damage_index([Path(path)], "torn-index")
    _, error = tier.load(A_KEYS)
    assert error is not None and error.failed_by_file == {path: A_KEYS}
    assert tier.io.counters.bad_files == {"header": 1} and not os.path.exists(path)


def test_header_damage_that_keeps_the_identity_serves_only_verified_sections(
    tmp_path: Path,
) -> None:
    """What the fast path does not catch: the header torn in place with the mtime put
    back (``utime``).  The identity matches, so the header is not read and its damage goes
    unseen until a full parse (a restart's rebuild refuses the file); the sections are
    read where the index says and each verified against the index's checksum, so what is
    served is the stored rows."""
    tier = Tier(tmp_path)
    path, data = tier.store(A_KEYS)
    st = os.stat(path)
    PF.damage_index([Path(path)], "torn-index")
    _same_mtime(path, st)
    got, error = tier.load(A_KEYS)
    assert error is None and got == data and not tier.file_io.header_reads(path)
    with pytest.raises(C.ChunkFileError, match="header"):
        P.read_packed_index(path, NS, C.CHECKSUM)


def test_a_touched_file_with_the_same_header_keeps_its_sections(tmp_path: Path) -> None:
    """Only the mtime changed (``utime``): the load parses the header once, finds the
    indexed header digest, keeps the indexed sections and takes the new identity; the
    next load reads no header."""
    tier = Tier(tmp_path)
    path, data = tier.store(A_KEYS)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))
    got, error = tier.load(A_KEYS)
    assert error is None and got == data and tier.file_io.header_reads(path) == [(0, R.PAGE)]
    identity = tier.index.identity(path)
    assert identity is not None and identity.matches(os.stat(path))
    got, error = tier.load(A_KEYS)
    assert error is None and got == data and not tier.file_io.header_reads(path)


def test_a_rebuilt_index_loads_without_reading_headers(tmp_path: Path) -> None:
    """A restarted tier indexes the files from their headers (:meth:`PackedIndex.rebuild`),
    which records their identities: its loads read no header."""
    first = Tier(tmp_path)
    path, data = first.store(A_KEYS)
    tier = Tier(tmp_path)
    assert tier.index.rebuild(str(tmp_path), tier.io) == (1, 0)
    got, error = tier.load(A_KEYS)
    assert error is None and got == data and not tier.file_io.header_reads(path)


def test_a_refresh_from_a_stale_look_changes_nothing(tmp_path: Path) -> None:
    """A load refreshes a file's entry only if it is still the one the load looked at: a
    store (or another load) that indexed the file anew in between wins."""
    tier = Tier(tmp_path)
    path, _ = tier.store(A_KEYS)
    old = tier.index.identity(path)
    again = Tier(tmp_path)
    again.store(A_KEYS)
    tier.index.add(path, P.read_packed_index(path, NS, C.CHECKSUM))  # indexed anew
    new = tier.index.identity(path)
    assert new is not None and old is not None and new != old
    stale = P.PackedHeader(path, R.PAGE, 0, (), (), b"x" * 16, P.FileIdentity(0, 0, 0, 0, b""))
    tier.index.refresh(path, old, stale)
    assert tier.index.identity(path) == new and all(k in tier.index for k in A_KEYS)
