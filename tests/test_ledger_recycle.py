"""An evicted file recycled as a new file's temporary file (issue #30 item 4).

On a full root every store evicts; unlinking a 2 MiB victim on a file system mounted with
``discard`` cost about a third of the store (``reports/bench.md``, eviction overhead at real
section sizes).  A tier's ledger instead renames a victim no larger than a new file onto
that file's temporary name, and the writer overwrites it in place
(:meth:`~vllm_adapter.disk.ledger.RootLedger.reserve`, ``recycle``; the order that keeps
the budget is :mod:`vllm_adapter.disk.ledger`'s docstring).  The crash points of that
order are the state machine's (``tests/test_ledger_state_machine.py``:
``before-recycle-rename``, ``after-recycle-rename``); these are the rule's direct cases.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from test_ledger_state_machine import (  # noqa: I001
    BUDGET,
    KEY_BYTES,
    Engine,
    _name_of,
    _prompt_chunks,
    _write_whole,
    root_bytes,
)

from vllm_adapter.disk import chunk_file as C
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk.ledger import RootLedger


def _full_engine(root: Path, recycle: bool = True) -> tuple[Engine, list[str]]:
    """An engine over a root its budget exactly holds: four files of two keys (prompts
    1, 3, 5, 7: no shared prefix), each written."""
    e = Engine(root, "e")
    e.start()
    e.tier.recycle = recycle
    paths = []
    for prompt in (1, 3, 5, 7):
        paths += _store(e, prompt)
    assert e.ledger.totals()["disk_bytes"] == 4 * 2 * KEY_BYTES
    return e, paths


def _reserve(e: Engine, prompt: int, keys_per_file: int | None = None) -> list[tuple[str, tuple[bytes, ...]]]:
    chunks, positions = _prompt_chunks(prompt)
    files = [c[:keys_per_file] for c in chunks[:1]]
    out = e.tier.reserve(files, lambda ks: str(e.root / _name_of(ks)),
                         lambda ks: KEY_BYTES * len(ks), positions)
    assert out, "refused"
    return out


def _store(e: Engine, prompt: int) -> list[str]:
    out = _reserve(e, prompt)
    for path, keys in out:
        _write_whole(path, keys, e.tier)
    e.tier.complete([(p, True) for p, _ in out])
    return [p for p, _ in out]


def test_a_victim_no_larger_than_the_new_file_becomes_its_file(tmp_path: Path) -> None:
    """The least recently used file's inode is the new file's; it was evicted (counted) and
    recycled (counted); the root stays within its budget; a fresh replay agrees."""
    e, (oldest, *_) = _full_engine(tmp_path)
    inode = os.stat(oldest).st_ino
    (path,) = _store(e, 9)
    assert not os.path.exists(oldest)
    assert os.stat(path).st_ino == inode
    counters = e.ledger.counters.as_dict()
    assert counters["files_recycled"] == 1 and counters["files_evicted"] == 1, counters
    assert root_bytes(tmp_path) <= BUDGET
    assert RootLedger.replayed(str(tmp_path)).model() == e.ledger.model()
    assert list(tmp_path.rglob("*.tmp")) == []


def test_without_recycling_the_victim_is_unlinked(tmp_path: Path) -> None:
    e, (oldest, *_) = _full_engine(tmp_path, recycle=False)
    (path,) = _store(e, 9)
    assert os.path.exists(path) and not os.path.exists(oldest)
    assert e.ledger.counters.as_dict()["files_recycled"] == 0


def test_a_victim_larger_than_the_new_file_is_unlinked(tmp_path: Path) -> None:
    """A one-key file's reservation is half a victim: recycling it would put more bytes
    under the new file's name than the ledger counts for it."""
    e, (oldest, *_) = _full_engine(tmp_path)
    out = _reserve(e, 9, keys_per_file=1)
    assert [len(k) for _, k in out] == [1]
    assert not os.path.exists(oldest)
    assert e.tier.take_recycled(out[0][0]) is None
    assert e.ledger.counters.as_dict()["files_recycled"] == 0
    e.tier.complete([(out[0][0], False)])


def test_a_victim_this_engine_is_reading_is_not_recycled(tmp_path: Path) -> None:
    """A load of this engine holds the victim open: its bytes must stay the victim's until
    it closes them (unlinked, they do; overwritten, the load would fail its checksums)."""
    e, (oldest, *_) = _full_engine(tmp_path)
    Path(oldest).write_bytes(os.urandom(2 * KEY_BYTES))  # not the zeros a writer here writes
    with open(oldest, "rb") as reader, e.tier.reading([oldest]):
        before = reader.read()
        (path,) = _store(e, 9)
        reader.seek(0)
        assert reader.read() == before
    assert e.ledger.counters.as_dict()["files_recycled"] == 0
    assert os.path.exists(path) and not os.path.exists(oldest)


def test_a_recycled_file_no_writer_takes_is_removed_when_its_store_completes(
        tmp_path: Path) -> None:
    """A writer that writes a temporary file of its own leaves the recycled one behind: its
    bytes are the victim's, which the ledger no longer counts, so the completion removes
    it (written or failed)."""
    for ok in (True, False):
        root = tmp_path / str(ok)
        root.mkdir()
        e, _ = _full_engine(root)
        ((path, keys),) = _reserve(e, 9)
        _write_whole(path, keys)  # not e.tier: its own temporary file
        assert len(list(root.rglob("*.tmp"))) == 1
        e.tier.complete([(path, ok)])
        assert list(root.rglob("*.tmp")) == []
        assert root_bytes(root) <= BUDGET
        e.ledger.close()


def test_a_dead_writer_s_recycled_file_is_removed_by_its_reclaim(tmp_path: Path) -> None:
    """A writer died holding a recycled victim (its store reserved, not written): the next
    engine's lock acquisition reclaims the reservation and removes the recycled file."""
    e, (oldest, *_) = _full_engine(tmp_path)
    ((path, keys),) = _reserve(e, 9)
    tmp = e.tier.take_recycled(path)
    assert tmp is not None and os.path.exists(tmp)
    e.crash()
    other = Engine(tmp_path, "other")
    other.start()
    assert not os.path.exists(tmp) and not os.path.exists(path) and not os.path.exists(oldest)
    assert other.ledger.counters.as_dict()["reservations_reclaimed"] == 1
    assert root_bytes(tmp_path) <= BUDGET
    other.ledger.close()


# ---------------------------------------------------------------------------
# The writers: a recycled file, overwritten, is byte for byte a fresh one
# ---------------------------------------------------------------------------

ROW = 2 * P.PAGE
KEYS = [bytes([n]) * 32 + g.to_bytes(4, "big") for n in (1, 2) for g in (0, 1)]


def _io() -> C.ChunkIO:
    return C.ChunkIO(namespace=bytes(range(16)), counters=C.TierCounters())


FILE_BYTES = P.plan_packed(KEYS, [ROW] * len(KEYS)).file_bytes


def _fresh_and_recycled(tmp_path: Path, suffix: str, old_bytes: int,
                        write: Callable[[str, str | None], object]) -> dict[str, bytes]:
    """The file ``write(path, tmp)`` stores into a new temporary file (``fresh``) and over
    a recycled one holding ``old_bytes`` random bytes (``recycled``, which must keep the
    victim's inode)."""
    files = {}
    for name, recycled in (("fresh", False), ("recycled", True)):
        path = str(tmp_path / f"{name}{suffix}")
        tmp = C.temp_path(path) if recycled else None
        if tmp is not None:
            Path(tmp).write_bytes(os.urandom(old_bytes))
            inode = os.stat(tmp).st_ino
        write(path, tmp)
        if tmp is not None:
            assert os.stat(path).st_ino == inode, "the victim's inode was not reused"
        files[name] = Path(path).read_bytes()
    return files


@pytest.mark.parametrize("old_bytes", [0, 3 * P.PAGE, FILE_BYTES])
@pytest.mark.parametrize("way", ["one write", "in parts"])
def test_a_packed_file_written_over_a_recycled_one_equals_a_fresh_one(
        tmp_path: Path, old_bytes: int, way: str) -> None:
    """The victim's old bytes (random, as long as or shorter than the new file) leave no
    trace: the file, header and sections, equals the one written into a new temporary file,
    and its inode is the victim's."""
    payloads = [memoryview(bytearray(os.urandom(ROW))) for _ in KEYS]

    def write(path: str, tmp: str | None) -> None:
        if way == "one write":
            P.store_packed(path, KEYS, payloads, _io(), tmp)
            return
        plan = P.plan_packed(KEYS, [ROW] * len(KEYS))
        temp = P.open_packed_temp(path, plan, _io(), tmp)
        sums = P.write_packed_range(temp, plan, 2, payloads[2:], _io())
        sums = P.write_packed_range(temp, plan, 0, payloads[:2], _io()) + sums
        P.finish_packed_temp(temp, plan, sums, _io())

    files = _fresh_and_recycled(tmp_path, ".kvp", old_bytes, write)
    assert len(files["recycled"]) == len(files["fresh"]) >= old_bytes
    assert files["recycled"] == files["fresh"]


@pytest.mark.parametrize("old_bytes", [0, C.HEADER_SIZE + ROW // 2, C.HEADER_SIZE + ROW])
def test_a_chunk_file_written_over_a_recycled_one_equals_a_fresh_one(
        tmp_path: Path, old_bytes: int) -> None:
    payload = memoryview(bytearray(os.urandom(ROW)))
    files = _fresh_and_recycled(
        tmp_path, ".kv", old_bytes, lambda path, tmp: C.store_chunk(path, payload, b"k" * 36, _io(), tmp))
    assert files["recycled"] == files["fresh"]


def test_a_recycled_file_that_vanished_is_created_after_all(tmp_path: Path) -> None:
    """A peer's reclaim may remove it (this writer stalled past its lease): the writer
    creates the temporary file as it would have."""
    path = str(tmp_path / "f.kvp")
    payloads = [memoryview(bytearray(os.urandom(ROW))) for _ in KEYS]
    P.store_packed(path, KEYS, payloads, _io(), C.temp_path(path))
    assert os.path.getsize(path) == FILE_BYTES
    assert list(tmp_path.glob("*.tmp")) == []
