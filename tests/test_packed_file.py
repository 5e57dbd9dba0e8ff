"""The packed file (vllm_adapter.disk.packed_file): the layout of reference.packed, its checks, what a bad file fails.

The engine-level cases (the packed tier under vLLM's tiering manager: damaged
files, restarts, two engines) are the tiered faults lane's; these pin the format:
a store job's keys are sections of one file, page-aligned, each with its own
checksum; a load opens the file once and reads adjacent sections in one call; a
bad header fails every key, a bad section only its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from conformance.harness import packed_faults as PF
from reference import packed as R
from vllm_adapter.disk import chunk_file as C
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk import packed_header as PH

NS = bytes(range(16))
ROW = 2 * R.PAGE


def _key(n: int, group: int) -> bytes:
    return bytes([n]) * 32 + group.to_bytes(4, "big")


KEYS = [_key(1, 0), _key(1, 1), _key(2, 0), _key(2, 1)]


def _payloads(n: int = len(KEYS), size: int = ROW) -> list[memoryview]:
    return [memoryview(bytearray(os.urandom(size))) for _ in range(n)]


def _io(**kw: object) -> C.ChunkIO:
    return C.ChunkIO(namespace=NS, counters=C.TierCounters(), **kw)  # type: ignore[arg-type]


def _store(tmp_path: Path, keys: list[bytes] = KEYS, size: int = ROW) -> tuple[str, list[bytes]]:
    payloads = _payloads(len(keys), size)
    path = str(tmp_path / "f.kvp")
    P.store_packed(path, keys, payloads, _io())
    return path, [bytes(p) for p in payloads]


def _load(path: str, keys: list[bytes], io: C.ChunkIO, size: int = ROW) -> tuple[dict[bytes, str], dict[bytes, bytes]]:
    dests = {k: memoryview(bytearray(size)) for k in keys}
    failed = P.load_packed(path, list(dests.items()), io)
    return failed, {k: bytes(d) for k, d in dests.items()}


def test_one_file_holds_every_key_page_aligned_and_sized_as_the_reference_says(tmp_path: Path) -> None:
    path, data = _store(tmp_path)
    # By hand: 4 entries of 38 + 36 bytes after a 56-byte fixed part fit one page;
    # then 4 sections of 2 pages each.
    assert os.path.getsize(path) == R.PAGE + 4 * ROW == R.packed_file_bytes([ROW] * 4, [36] * 4)
    header = P.read_packed_index(path, NS, C.CHECKSUM)
    assert [s.key for s in header.sections] == KEYS
    assert [s.group for s in header.sections] == [0, 1, 0, 1]
    assert [s.offset for s in header.sections] == [R.PAGE + i * ROW for i in range(4)]
    raw = Path(path).read_bytes()
    for s, payload in zip(header.sections, data, strict=True):
        assert raw[s.offset : s.offset + s.length] == payload
    assert [p.name for p in tmp_path.iterdir()] == ["f.kvp"], "a temporary file was left"


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every open and read system call the packed module makes from here on: (call,
    offset, bytes asked for); ``os.open``, ``os.read`` and ``os.readv`` have no offset (-1)."""
    calls: list[tuple[str, int, int]] = []
    real = {name: getattr(os, name) for name in ("open", "preadv", "pread", "readv", "read")}

    def open_(path: str, flags: int, *a: int, **kw: int) -> int:
        calls.append(("open", -1, -1))
        return real["open"](path, flags, *a, **kw)

    def preadv(fd: int, buffers: list[memoryview], offset: int, *a: int) -> int:
        calls.append(("preadv", offset, sum(len(memoryview(b)) for b in buffers)))
        return real["preadv"](fd, buffers, offset, *a)

    def pread(fd: int, n: int, offset: int) -> bytes:
        calls.append(("pread", offset, n))
        return real["pread"](fd, n, offset)

    def readv(fd: int, buffers: list[memoryview]) -> int:
        calls.append(("readv", -1, sum(len(memoryview(b)) for b in buffers)))
        return real["readv"](fd, buffers)

    def read(fd: int, n: int) -> bytes:
        calls.append(("read", -1, n))
        return real["read"](fd, n)

    assert P.os is os, "packed_file calls the os module's functions"
    for name, fn in (("open", open_), ("preadv", preadv), ("pread", pread), ("readv", readv),
                     ("read", read)):
        monkeypatch.setattr(os, name, fn)
    return calls


def test_a_load_opens_the_file_once_and_reads_adjacent_sections_in_one_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Counted at the system calls: one open, one read of the header page, then one
    ``preadv`` per run of adjacent wanted sections, spanning the run."""
    path, data = _store(tmp_path)
    offsets = [R.PAGE + i * ROW for i in range(4)]
    calls = _count_reads(monkeypatch)
    io = _io()
    failed, got = _load(path, [KEYS[1], KEYS[2]], io)
    assert not failed and got == {KEYS[1]: data[1], KEYS[2]: data[2]}
    assert calls == [("open", -1, -1), ("preadv", 0, R.PAGE),
                     ("preadv", offsets[1], 2 * ROW)], calls
    assert (io.counters.files_opened, io.counters.reads, io.counters.sections_loaded) == (1, 1, 2)
    calls.clear()
    io = _io()
    failed, got = _load(path, [KEYS[3], KEYS[0]], io)
    assert not failed and got == {KEYS[0]: data[0], KEYS[3]: data[3]}
    assert calls == [("open", -1, -1), ("preadv", 0, R.PAGE), ("preadv", offsets[0], ROW),
                     ("preadv", offsets[3], ROW)], f"sections 0 and 3 are not adjacent: {calls}"
    assert (io.counters.files_opened, io.counters.reads) == (1, 2)
    assert io.counters.sections_loaded_per_group == {0: 1, 1: 1}


def test_a_section_not_a_page_multiple_is_padded_and_round_trips(tmp_path: Path) -> None:
    size = R.PAGE + 100
    path, data = _store(tmp_path, KEYS[:2], size)
    assert os.path.getsize(path) == R.PAGE + 2 * 2 * R.PAGE
    failed, got = _load(path, KEYS[:2], _io(), size)
    assert not failed and list(got.values()) == data


def test_a_damaged_section_fails_only_its_key(tmp_path: Path) -> None:
    path, data = _store(tmp_path)
    header = P.read_packed_index(path)
    raw = bytearray(Path(path).read_bytes())
    raw[header.sections[2].offset + 7] ^= 1
    Path(path).write_bytes(raw)
    io = _io()
    failed, got = _load(path, KEYS, io)
    assert failed == {KEYS[2]: "checksum"}
    assert [got[k] == d for k, d in zip(KEYS, data, strict=True)] == [True, True, False, True]
    assert io.counters.bad_sections == 1 and os.path.exists(path), "the other sections still serve"


def test_a_torn_index_fails_every_key_and_the_file_is_removed(tmp_path: Path) -> None:
    path, _ = _store(tmp_path)
    PF.damage_index([Path(path)], "torn-index")  # an index byte: the header digest breaks
    io = _io()
    failed, _ = _load(path, [KEYS[0], KEYS[3]], io)
    assert failed == {KEYS[0]: "header", KEYS[3]: "header"}
    assert not os.path.exists(path), "a file whose header fails is deleted (bad_files: delete)"
    assert io.counters.bad_files == {"header": 1}


def test_a_header_of_another_format_version_fails_every_key(tmp_path: Path) -> None:
    path, _ = _store(tmp_path)
    PF.damage_index([Path(path)], "other-version")
    failed, _ = _load(path, KEYS[:2], _io(bad_files="quarantine", quarantine_dir=str(tmp_path / "q")))
    assert failed == {KEYS[0]: "version", KEYS[1]: "version"}
    assert len(os.listdir(tmp_path / "q")) == 1, "quarantine keeps the bad file aside"


def test_a_section_past_the_end_fails_only_its_key(tmp_path: Path) -> None:
    path, data = _store(tmp_path)
    PF.damage_index([Path(path)], "section-past-end")  # the last section
    failed, got = _load(path, KEYS, _io())
    assert failed == {KEYS[3]: "bounds"}
    assert [got[k] for k in KEYS[:3]] == data[:3]


@pytest.mark.parametrize("change", [-R.PAGE, R.PAGE], ids=["truncated", "extended"])
def test_a_truncated_or_extended_file_fails_every_key(tmp_path: Path, change: int) -> None:
    path, _ = _store(tmp_path)
    os.truncate(path, os.path.getsize(path) + change)
    failed, _ = _load(path, KEYS[:2], _io())
    assert failed == {KEYS[0]: "size", KEYS[1]: "size"}
    assert not os.path.exists(path)


def test_two_sections_claiming_one_key_fail_that_key_alone(tmp_path: Path) -> None:
    path, data = _store(tmp_path)
    PF.damage_index([Path(path)], "duplicate-key")  # section 1 claims key 0 too
    failed, got = _load(path, [KEYS[0], KEYS[2], KEYS[3]], _io())
    assert failed == {KEYS[0]: "duplicate"}
    assert got[KEYS[2]] == data[2] and got[KEYS[3]] == data[3]


def test_another_namespace_or_checksum_fails_every_key(tmp_path: Path) -> None:
    path, _ = _store(tmp_path)
    failed, _ = _load(path, KEYS[:1], C.ChunkIO(namespace=bytes(16), counters=C.TierCounters(),
                                                  bad_files="quarantine",
                                                  quarantine_dir=str(tmp_path / "q")))
    assert failed == {KEYS[0]: "namespace"}
    path, _ = _store(tmp_path / "b")
    failed, _ = _load(path, KEYS[:1], _io(checksum="blake3", bad_files="quarantine",
                                          quarantine_dir=str(tmp_path / "q")))
    assert failed == {KEYS[0]: "checksum-algorithm"}


def test_a_section_whose_length_differs_from_the_row_fails(tmp_path: Path) -> None:
    path, _ = _store(tmp_path)
    failed, _ = _load(path, KEYS[:1], _io(), size=ROW + R.PAGE)
    assert failed == {KEYS[0]: "length"}


def test_a_missing_file_fails_its_keys_without_counting_a_bad_file(tmp_path: Path) -> None:
    io = _io()
    failed, _ = _load(str(tmp_path / "gone.kvp"), KEYS[:2], io)
    assert failed == {KEYS[0]: P.MISSING, KEYS[1]: P.MISSING} and not io.counters.bad_files


def test_a_large_job_header_spans_pages_and_every_key_round_trips(tmp_path: Path) -> None:
    keys = [_key(n, g) for n in range(40) for g in range(3)]  # 120 entries of 74 bytes: 3 pages
    size = R.PAGE
    payloads = _payloads(len(keys), size)
    path = str(tmp_path / "big.kvp")
    P.store_packed(path, keys, payloads, _io())
    assert R.header_bytes([36] * 120) == 3 * R.PAGE
    assert os.path.getsize(path) == 3 * R.PAGE + 120 * R.PAGE
    failed, got = _load(path, keys, _io(), size)
    assert not failed and [got[k] for k in keys] == [bytes(p) for p in payloads]


@pytest.mark.parametrize("fixed_bytes", [8, 40])
def test_a_file_shorter_than_a_header_fails_every_key(tmp_path: Path, fixed_bytes: int) -> None:
    """8 or 40 bytes: less than the fixed header (56 bytes), so the file is short (``size``),
    not a header that fails its digest; it is deleted."""
    path, _ = _store(tmp_path)
    os.truncate(path, fixed_bytes)
    io = _io()
    failed, _ = _load(path, KEYS[:2], io)
    assert failed == {KEYS[0]: "size", KEYS[1]: "size"}
    assert io.counters.bad_files == {"size": 1} and not os.path.exists(path)


def _le(raw: bytes, at: int, n: int) -> int:
    return int.from_bytes(raw[at : at + n], "little")


def test_a_written_header_has_the_reference_layout_byte_for_byte(tmp_path: Path) -> None:
    """The header of a real file, measured against :mod:`reference.packed`'s layout (its
    docstrings' field widths and :data:`~reference.packed.FIXED_HEADER_BYTES` /
    :data:`~reference.packed.ENTRY_FIXED_BYTES`), not against the module's own structs:
    each fixed field where the layout puts it, the header digest (BLAKE3, 16 bytes) over
    the fixed fields and the index, each index entry ``ENTRY_FIXED_BYTES`` plus its key
    long, its fields in the documented order, and zeros to the page-rounded end."""
    import blake3
    import xxhash

    keys = [_key(1, 0), _key(1, 1)[:20], _key(2, 3)]  # keys of two lengths
    sizes = [ROW, R.PAGE + 100, R.PAGE]
    payloads = [memoryview(bytearray(os.urandom(n))) for n in sizes]
    path = str(tmp_path / "f.kvp")
    P.store_packed(path, keys, payloads, _io())
    raw = Path(path).read_bytes()
    head = R.header_bytes([len(k) for k in keys])
    index = sum(R.ENTRY_FIXED_BYTES + len(k) for k in keys)
    fixed = R.FIXED_HEADER_BYTES - R.DIGEST_BYTES
    assert fixed == 8 + 2 + 2 + 4 + 4 + 4 + 16
    assert raw[:8] == b"KVCPACK\0"
    assert (_le(raw, 8, 2), _le(raw, 10, 2)) == (P.FORMAT_VERSION, C.CHECKSUMS[C.CHECKSUM])
    assert (_le(raw, 12, 4), _le(raw, 16, 4), _le(raw, 20, 4)) == (head, len(keys), index)
    assert raw[24:40] == NS
    blake = blake3.blake3(raw[:fixed] + raw[R.FIXED_HEADER_BYTES : R.FIXED_HEADER_BYTES + index])
    assert raw[fixed : R.FIXED_HEADER_BYTES] == blake.digest(R.DIGEST_BYTES)
    at = R.FIXED_HEADER_BYTES
    offsets = R.section_offsets(sizes, [len(k) for k in keys])
    assert C.CHECKSUM == "xxh3-128"
    for key, size, offset, payload in zip(keys, sizes, offsets, payloads, strict=True):
        assert _le(raw, at, 2) == len(key)
        assert _le(raw, at + 2, 4) == P.group_of_key(key)
        assert (_le(raw, at + 6, 8), _le(raw, at + 14, 8)) == (offset, size)
        assert raw[at + 22 : at + 38] == xxhash.xxh3_128(bytes(payload)).digest()
        assert raw[offset : offset + size] == payload
        assert raw[at + R.ENTRY_FIXED_BYTES : at + R.ENTRY_FIXED_BYTES + len(key)] == key
        at += R.ENTRY_FIXED_BYTES + len(key)
    assert at == R.FIXED_HEADER_BYTES + index
    assert raw[at:head] == bytes(head - at), "the header's padding is not zeros"
    assert len(raw) == R.packed_file_bytes(sizes, [len(k) for k in keys])


@pytest.mark.parametrize("constant", ["FIXED_HEADER_BYTES", "ENTRY_FIXED_BYTES"])
def test_the_module_refuses_to_import_when_its_structs_differ_from_the_reference(
    monkeypatch: pytest.MonkeyPatch, constant: str
) -> None:
    """The import-time check (``packed_header`` asserts its structs' sizes against the
    reference's constants): the module imported afresh under a reference that says one
    byte more fails; under the reference as it is, it imports."""
    import importlib.util
    import sys

    def fresh_import() -> None:
        spec = importlib.util.spec_from_file_location("_packed_header_probe", PH.__file__)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)

    fresh_import()
    monkeypatch.setattr(R, constant, getattr(R, constant) + 1)
    with pytest.raises(AssertionError):
        fresh_import()


def test_read_runs_counts_runs_of_consecutive_positions() -> None:
    assert R.read_runs([0, 1, 2, 5]) == 2 and R.read_runs([3]) == 1 and R.read_runs([]) == 0
    assert R.read_runs([5, 0, 1, 1]) == 2, "unordered, repeated positions"


def _short(real: Any, limit: int, *, from_offset: int = 0) -> Any:
    """``real`` (``os.writev``, ``os.pwritev`` or ``os.preadv``) moving at most ``limit``
    bytes a call, as a call interrupted by a signal may: at offsets of ``from_offset`` or
    more (a short read of the header is a truncated file, which has its own tests)."""

    calls = [0]

    def call(fd: int, buffers: list[Any], *offset: int) -> int:
        calls[0] += 1
        assert calls[0] < 10_000, "the loop made no progress: a short call's bytes not consumed"
        if offset and offset[0] < from_offset:
            return int(real(fd, buffers, *offset))
        cut, left = [], limit
        for b in buffers:
            view = memoryview(b).cast("B")
            if left <= 0:
                break
            cut.append(view[:left])
            left -= len(cut[-1])
        return int(real(fd, cut, *offset))

    return call


@pytest.mark.parametrize("limit", [1000, R.PAGE + 1])
def test_short_writes_and_reads_still_move_every_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int
) -> None:
    """A vectored write or read may move fewer bytes than asked: each loop resumes where
    the last call stopped, so the one-task store, the store in parts (``pwritev`` at
    offsets) and the load produce the bytes of calls that move everything."""
    payloads = _payloads()
    whole = tmp_path / "whole.kvp"
    P.store_packed(str(whole), KEYS, payloads, _io())
    monkeypatch.setattr(os, "writev", _short(os.writev, limit))
    monkeypatch.setattr(os, "pwritev", _short(os.pwritev, limit))
    monkeypatch.setattr(os, "preadv", _short(os.preadv, limit, from_offset=R.PAGE))
    one = tmp_path / "one" / "whole.kvp"
    one.parent.mkdir()
    P.store_packed(str(one), KEYS, payloads, _io())
    plan = P.plan_packed(KEYS, [len(p) for p in payloads])
    parts = tmp_path / "parts" / "whole.kvp"
    parts.parent.mkdir()
    temp = P.open_packed_temp(str(parts), plan, _io())
    sums = (P.write_packed_range(temp, plan, 0, payloads[:1], _io())
            + P.write_packed_range(temp, plan, 1, payloads[1:], _io()))
    P.finish_packed_temp(temp, plan, sums, _io())
    assert one.read_bytes() == whole.read_bytes()
    assert parts.read_bytes() == whole.read_bytes()
    failed, got = _load(str(one), KEYS, _io())
    assert failed == {}
    assert [got[k] for k in KEYS] == [bytes(p) for p in payloads]
