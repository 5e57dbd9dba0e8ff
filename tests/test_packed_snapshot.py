"""The packed tier's index snapshot (issue #30 item 4): a start without every header read.

A tier writes its index (each packed file's identity and header) to one file,
:mod:`vllm_adapter.disk.packed_snapshot`, and a restart indexes from it instead of reading
one header per file (:meth:`~vllm_adapter.disk.packed_io.PackedIndex.start`).  What these
tests hold it to: a start from a whole, current snapshot reads no header, neither at start
nor at the first load; a snapshot that is stale (a file rewritten under its name, deleted,
or written after it), damaged (truncated, a byte flipped, extended, empty), or of another
namespace or checksum algorithm never serves a wrong byte: the start falls back to the
headers of the files it does not describe (all of them when it is not used), and each load
checks the file's identity and every section's checksum.  An entry whose header does not
match its own header digest (a snapshot consistent as a file but wrong in one entry) is
loaded from the file's header: without that check the swapped entry below serves another
key's row.

The rig is ``tests/test_packed_load_identity.py``'s (the tier's index, its file I/O object
recording every read).  No vLLM needed.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
from test_packed_load_identity import A_KEYS, B_KEYS, NS, ROW, Tier, _key, _same_mtime

from reference import packed as R
from vllm_adapter.disk import chunk_file as C
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk import packed_io as PIO
from vllm_adapter.disk import packed_snapshot as PS

C_KEYS = [_key(4, 0), _key(4, 1), _key(4, 2)]


class Restart(Tier):
    """A tier started over ``root``, its index filled by :meth:`PackedIndex.start`; the
    headers the start read counted (``P.read_packed_index``, what the start calls)."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch,
                 listing: list[str] | None = None, **io: Any) -> None:
        super().__init__(root, **io)
        self.headers_read: list[str] = []
        real = P.read_packed_index

        def counted(path: str, *a: Any, **kw: Any) -> P.PackedHeader:
            self.headers_read.append(path)
            return real(path, *a, **kw)

        with monkeypatch.context() as m:
            m.setattr(P, "read_packed_index", counted)
            self.started = self.index.start(self.root, self.io, listing=listing)


def _stored(tmp_path: Path) -> tuple[Tier, dict[str, dict[bytes, bytes]]]:
    """Three files (A's, B's, C's keys) stored by a tier; path -> its rows by key."""
    tier = Tier(tmp_path)
    files = dict(tier.store(keys) for keys in (A_KEYS, B_KEYS, C_KEYS))
    return tier, files


def _save(tier: Tier) -> int:
    written = tier.index.save_snapshot(tier.root, tier.io)
    assert written is not None and written > 0
    return written


def _every_row(files: dict[str, dict[bytes, bytes]]) -> dict[bytes, bytes]:
    return {k: row for rows in files.values() for k, row in rows.items()}


def _loads_every_row(tier: Tier, rows: dict[bytes, bytes]) -> None:
    keys = list(rows)
    assert all(k in tier.index for k in keys), "a stored key is not indexed"
    got, error = tier.load(keys)
    assert error is None, error
    assert got == rows, "a load served other bytes than stored"


def test_a_start_from_a_current_snapshot_reads_no_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every file from the snapshot: no header read at start, none at the first load (the
    snapshot's identities match the files), every row as stored."""
    tier, files = _stored(tmp_path)
    _save(tier)
    again = Restart(tmp_path, monkeypatch)
    assert again.started == PIO.IndexStart(3, 0, 3, 0, 0, "used")
    assert again.headers_read == []
    assert len(again.index) == len(A_KEYS + B_KEYS + C_KEYS) and again.index.files() == 3
    _loads_every_row(again, _every_row(files))
    assert not any(again.file_io.header_reads(path) for path in files), again.file_io.reads
    for path in files:
        assert again.index.identity(path) == tier.index.identity(path)


def test_without_a_snapshot_every_header_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, files = _stored(tmp_path)
    again = Restart(tmp_path, monkeypatch)
    assert again.started == PIO.IndexStart(3, 0, 0, 3, 0, "missing")
    assert sorted(again.headers_read) == sorted(files)
    _loads_every_row(again, _every_row(files))


@pytest.mark.parametrize("snapshot", [True, False])
def test_a_start_given_the_listing_indexes_what_its_own_walk_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, snapshot: bool
) -> None:
    """A tier lists its namespace once at start and hands the index that listing: the
    index then equals a start that walks the namespace itself, from the snapshot or not."""
    tier, files = _stored(tmp_path)
    if snapshot:
        _save(tier)
    walked = Restart(tmp_path, monkeypatch)
    given = Restart(tmp_path, monkeypatch, listing=list(P.iter_packed_files(str(tmp_path))))
    assert given.started == walked.started
    assert given.started.files == 3 and given.started.from_snapshot == (3 if snapshot else 0)
    assert sorted(given.index.snapshot_entries(given.root)) == sorted(
        walked.index.snapshot_entries(walked.root))
    _loads_every_row(given, _every_row(files))


def test_a_file_the_listing_leaves_out_is_not_indexed_though_the_snapshot_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing a tier hands its index leaves out the files its ledger's start removed
    (an orphan, a file evicted for a smaller budget): their snapshot entries are dropped,
    so no lookup finds a key whose file is gone, and no header is read for them."""
    tier, files = _stored(tmp_path)
    _save(tier)
    gone = P.packed_name(str(tmp_path), B_KEYS)
    listing = [p for p in P.iter_packed_files(str(tmp_path)) if p != gone]
    again = Restart(tmp_path, monkeypatch, listing=listing)
    assert again.started == PIO.IndexStart(2, 0, 2, 0, 1, "used"), again.started
    assert not any(k in again.index for k in B_KEYS)
    assert again.headers_read == []
    _loads_every_row(again, {k: v for path, rows in files.items() if path != gone
                             for k, v in rows.items()})


def test_a_snapshot_of_a_restarted_index_describes_the_same_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tier started from a snapshot (its entries not built yet) writes them back as read:
    the next start finds the same identities and headers."""
    tier, files = _stored(tmp_path)
    first = _save(tier)
    again = Restart(tmp_path, monkeypatch)
    assert _save(again) == first
    third = Restart(tmp_path, monkeypatch)
    assert third.started.from_snapshot == 3 and third.headers_read == []
    assert sorted(third.index.snapshot_entries(third.root)) == sorted(
        tier.index.snapshot_entries(tier.root))
    _loads_every_row(third, _every_row(files))


def test_a_file_rewritten_under_its_name_after_the_snapshot_serves_its_new_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's keys stored again at A's name after the snapshot (other rows, a new inode): the
    start takes the stale entry, the first load's ``fstat`` finds another file, parses its
    header and loads the new rows; the index takes the new identity."""
    tier, files = _stored(tmp_path)
    _save(tier)
    path = next(iter(files))
    _, new_rows = Tier(tmp_path).store(A_KEYS, path)
    assert new_rows != files[path]
    again = Restart(tmp_path, monkeypatch)
    assert again.started.from_snapshot == 3 and again.headers_read == []
    _loads_every_row(again, {**_every_row(files), **new_rows})
    assert again.file_io.header_reads(path) == [(0, R.PAGE)]
    assert again.index.identity(path) == P.read_packed_index(path, NS, C.CHECKSUM).identity


def test_a_file_rewritten_with_another_layout_serves_its_new_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's name now holds A's keys in another order (other offsets and checksums): the
    snapshot's sections are stale, the load reads the file's own header."""
    tier, files = _stored(tmp_path)
    _save(tier)
    path = next(iter(files))
    _, new_rows = Tier(tmp_path).store(list(reversed(A_KEYS)), path)
    again = Restart(tmp_path, monkeypatch)
    _loads_every_row(again, {**_every_row(files), **new_rows})


def test_a_file_deleted_after_the_snapshot_leaves_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, files = _stored(tmp_path)
    _save(tier)
    gone = next(iter(files))
    os.remove(gone)
    again = Restart(tmp_path, monkeypatch)
    assert again.started == PIO.IndexStart(2, 0, 2, 0, 1, "used")
    assert not again.index.has_file(gone) and not any(k in again.index for k in files[gone])
    _loads_every_row(again, {k: r for p, rows in files.items() if p != gone
                             for k, r in rows.items()})


def test_a_file_written_after_the_snapshot_is_indexed_from_its_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails if the start trusts the snapshot alone: the new file's keys would miss."""
    tier, files = _stored(tmp_path)
    _save(tier)
    late, late_rows = tier.store([_key(5, 0), _key(5, 1)])
    again = Restart(tmp_path, monkeypatch)
    assert again.started == PIO.IndexStart(4, 0, 3, 1, 0, "used")
    assert again.headers_read == [late]
    _loads_every_row(again, {**_every_row(files), **late_rows})


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:]


DAMAGE = {
    "truncated": lambda d: d[: len(d) // 2],
    "cut-digest": lambda d: d[:-1],
    "extended": lambda d: d + b"\0",
    "flipped-body": lambda d: _flip(d, len(d) // 2),
    "flipped-digest": lambda d: _flip(d, len(d) - 1),
    "flipped-count": lambda d: _flip(d, 36),
    "empty": lambda d: b"",
    "garbage": lambda d: os.urandom(len(d)),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_snapshot_falls_back_to_every_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """Fails if the fallback is removed: the start would index nothing (or garbage) and the
    stored keys would miss."""
    tier, files = _stored(tmp_path)
    _save(tier)
    snap = tmp_path / PS.SNAPSHOT_FILE
    snap.write_bytes(DAMAGE[damage](snap.read_bytes()))
    again = Restart(tmp_path, monkeypatch)
    assert again.started == PIO.IndexStart(3, 0, 0, 3, 0, "damaged")
    assert sorted(again.headers_read) == sorted(files)
    _loads_every_row(again, _every_row(files))


@pytest.mark.parametrize("other", ["namespace", "checksum"])
def test_a_snapshot_of_another_namespace_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other: str
) -> None:
    """The same keys stored under another namespace (or checksum algorithm): the same file
    names, so its snapshot names this namespace's files; copied here, it is refused."""
    tier, files = _stored(tmp_path / "mine")
    io = {"namespace": bytes(16)} if other == "namespace" else {"checksum": "blake3"}
    assert C.CHECKSUM != "blake3" or other == "namespace"
    theirs = Tier(tmp_path / "theirs")
    theirs.io = C.ChunkIO(counters=C.TierCounters(), **{"namespace": NS, **io})
    for keys in (A_KEYS, B_KEYS, C_KEYS):
        theirs.store(keys)
    _save(theirs)
    shutil.copy(tmp_path / "theirs" / PS.SNAPSHOT_FILE, tmp_path / "mine" / PS.SNAPSHOT_FILE)
    again = Restart(tmp_path / "mine", monkeypatch)
    assert again.started == PIO.IndexStart(3, 0, 0, 3, 0, "namespace")
    _loads_every_row(again, _every_row(files))


def _tampered(tier: Tier, path: str, field: slice) -> bytes:
    """``tier``'s snapshot with ``path``'s first two entries swapping ``field`` (bytes of
    an entry less its key), re-encoded whole: a snapshot whose own digest verifies."""
    entries = []
    for name, identity, header_bytes, keys, fixed in tier.index.snapshot_entries(tier.root):
        if os.path.join(tier.root, name) == path:
            size = R.ENTRY_FIXED_BYTES
            first, second = bytearray(fixed[:size]), bytearray(fixed[size : 2 * size])
            first[field], second[field] = second[field], first[field]
            fixed = bytes(first + second) + fixed[2 * size :]
        entries.append((name, identity, header_bytes, keys, fixed))
    return PS.encode_snapshot(NS, C.CHECKSUM, entries)


def test_an_entry_that_does_not_match_its_header_digest_is_loaded_from_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's first two entries swap offset, length and checksum in the snapshot (its own
    digest recomputed).  Taken as it is, key 0's load would read key 1's row and verify it
    against key 1's checksum: a wrong row served.  The entry's header no longer matches the
    header digest the entry names, so its first load reads the file's header instead."""
    tier, files = _stored(tmp_path)
    path = next(iter(files))
    (tmp_path / PS.SNAPSHOT_FILE).write_bytes(_tampered(tier, path, slice(6, None)))
    again = Restart(tmp_path, monkeypatch)
    assert again.started == PIO.IndexStart(3, 0, 3, 0, 0, "used")
    _loads_every_row(again, _every_row(files))
    assert again.file_io.header_reads(path) == [(0, R.PAGE)]
    assert again.index.identity(path) == tier.index.identity(path)


def test_a_rewrite_in_place_that_keeps_the_identity_fails_its_key_never_serves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the snapshot, a byte of A's section 1 flipped in place and its mtime put back:
    the file still matches the snapshot's identity, so no header is read; the section fails
    its checksum (that key alone fails and leaves the index), nothing else is affected."""
    tier, files = _stored(tmp_path)
    _save(tier)
    path = next(iter(files))
    st = os.stat(path)
    at = R.PAGE + ROW + 7
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 1]))
    _same_mtime(path, st)
    again = Restart(tmp_path, monkeypatch)
    got, error = again.load(A_KEYS)
    assert error is not None and error.failed_by_file == {path: [A_KEYS[1]]}
    assert got[A_KEYS[1]] != files[path][A_KEYS[1]]
    assert all(got[k] == files[path][k] for k in A_KEYS if k != A_KEYS[1])
    assert not again.file_io.header_reads(path) and A_KEYS[1] not in again.index


def test_a_file_of_keys_of_two_lengths_is_left_out_and_read_at_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot stores keys of one length; a file whose keys differ is not in it, and
    the start reads its header (the listing names it)."""
    tier, files = _stored(tmp_path)
    odd, odd_rows = tier.store([_key(6, 0), bytes(20) + (1).to_bytes(4, "big")])
    _save(tier)
    again = Restart(tmp_path, monkeypatch)
    assert again.started == PIO.IndexStart(4, 0, 3, 1, 0, "used")
    assert again.headers_read == [odd]
    _loads_every_row(again, {**_every_row(files), **odd_rows})


def test_a_snapshot_over_its_cap_is_not_written(tmp_path: Path) -> None:
    tier, _ = _stored(tmp_path)
    size = len(PS.encode_snapshot(NS, C.CHECKSUM, tier.index.snapshot_entries(tier.root)))
    assert tier.index.save_snapshot(tier.root, tier.io, size - 1) is None
    assert not (tmp_path / PS.SNAPSHOT_FILE).exists()
    assert tier.index.save_snapshot(tier.root, tier.io, size) == size
    assert (tmp_path / PS.SNAPSHOT_FILE).stat().st_size == size


def test_the_snapshot_format_is_the_documented_one(tmp_path: Path) -> None:
    """The header fields and the columns at the offsets the module docstring gives, read
    here with struct, not with the module's reader."""
    tier, files = _stored(tmp_path)
    _save(tier)
    data = (tmp_path / PS.SNAPSHOT_FILE).read_bytes()
    magic, version, fmt, algo, key_len, ns, n, sections, name_bytes = struct.unpack_from(
        "<8sHHHH16sIQQ", data)
    assert (magic, version, fmt, ns, n, sections, key_len) == (
        b"KVCSNAP\0", 1, P.FORMAT_VERSION, NS, 3, 9, 36)
    assert algo == C.CHECKSUMS[C.CHECKSUM]
    at = 52
    counts = struct.unpack_from("<3I", data, at)
    at += 12
    records = [struct.unpack_from("<IQQQq16s", data, at + 52 * i) for i in range(3)]
    at += 52 * 3
    names = data[at : at + name_bytes].decode().split("\n")
    at += name_bytes
    keys = [data[at + 36 * i : at + 36 * (i + 1)] for i in range(9)]
    at += 36 * 9 + 38 * 9
    assert len(data) == at + 16
    for i, (name, count, record) in enumerate(zip(names, counts, records, strict=True)):
        header = P.read_packed_index(str(tmp_path / name), NS, C.CHECKSUM)
        st = os.stat(tmp_path / name)
        assert count == len(header.sections)
        assert record == (R.PAGE, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns,
                          header.header_digest)
        first = sum(counts[:i])
        assert keys[first : first + count] == [s.key for s in header.sections]
    assert sorted(str(tmp_path / n) for n in names) == sorted(files)
