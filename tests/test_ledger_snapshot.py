"""The ledger's model snapshot (:mod:`vllm_adapter.disk.ledger_snapshot`, issue #30 item 4).

The central property: a start from the snapshot (its model, then the journal's tail after
it) builds the model a full replay of the journal builds, field by field -- files, sizes,
keys, readiness, recency, pending reservations, the prefix structures, the eviction
heap, totals -- and so picks the same victims.  Checked after random runs of every
operation (stores with evictions, touches, dropped keys, forgotten files, crashes,
compactions, snapshots, another engine appending after one), then for each way a
snapshot is not used (missing, damaged, stale, another version or chunking) and a crash
at each step of writing it.
"""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from test_ledger_state_machine import (  # noqa: I001
    CHUNKING,
    KEY_BYTES,
    NS,
    Crash,
    Engine,
    _name_of,
    _prompt_chunks,
    _store,
    _write_whole,
)

from vllm_adapter.disk import ledger_snapshot as LS
from vllm_adapter.disk.ledger import LEDGER_FILE, RootLedger
from vllm_adapter.disk.ledger_model import LedgerModel
from vllm_adapter.disk.tier_budget import StoreRefused, store_files

CHUNKINGS = {NS: CHUNKING}


def state(m: LedgerModel) -> dict[str, Any]:
    """Everything a model holds, orders included (the snapshot must give it exactly)."""
    out: dict[str, Any] = {
        "budget": m._recorded_budget, "clock": m._clock, "offset": m._offset,
        "pending": sorted(m._pending), "compacted": m._compacted_bytes,
        "res": [(p, r.rid, r.ns, r.fid, r.owner, r.line_bytes) for p, r in m._res.items()],
        "by_rid": list(m._by_rid.items()),
        "skipped": m.counters.as_dict()["journal_records_skipped"],
        "totals": m.totals(), "files": m.files(), "model": m.model(),
    }
    for ns, space in m._spaces.items():
        d, s = space.disk, space.structure
        out[ns] = {
            "fields": (sorted(vars(d)), sorted(vars(s))),
            "files": [(fid, f.keys, f.nbytes, f.last_use, f.ready, f.pins)
                      for fid, f in d.files.items()],
            "file_of": list(d.file_of.items()),
            "scalars": (d.bytes, d.peak_bytes, d.clock, d._next_id),
            "dependents": list(d._dependents.items()), "leaves": list(d._leaves),
            "recency": list(d._recency), "windows_only": list(d._windows_only),
            "path_of": list(space.path_of.items()),
            "parent": list(s.parent.items()), "children": s.children,
            "full_at": list(s.full_at.items()), "windows_at": list(s.windows_at.items()),
            "serves": s.serves, "end_token": s.end_token,
            "chunking": (s.chunking, s.alignment, s.full_groups),
            "stranded": sorted(d.stranded()),
        }
    return out


def victims(m: RootLedger) -> list[tuple[str, int]]:
    """What the rule evicts first when half the files must go (the model is changed)."""
    m.files_budget = m.total_bytes // 2
    return m._plan_evictions(partial=True) or []


def assert_snapshot_start_is_a_replay(root: Path, expect: str | None = "used") -> RootLedger:
    full = RootLedger.replayed(str(root), chunkings=CHUNKINGS)
    fast = RootLedger.replayed(str(root), snapshot=True, chunkings=CHUNKINGS)
    if expect is not None:
        assert fast.snapshot_start == expect
    assert state(fast) == state(full)
    assert victims(fast) == victims(full)
    return fast


def engine(root: Path, name: str) -> Engine:
    e = Engine(root, name)
    e.start()
    return e


# ---------------------------------------------------------------------------
# The property
# ---------------------------------------------------------------------------

OPS = st.lists(st.tuples(
    st.sampled_from(["store", "store", "store", "touch", "drop", "forget", "crash", "compact",
                     "snapshot", "close", "pending"]),
    st.integers(0, 1), st.integers(0, 7), st.integers(1, 3)), min_size=1, max_size=25)


@settings(max_examples={"ci": 25, "deep": 300}.get(os.environ.get("KVCHUNK_PROFILE", "ci"), 5),
          deadline=None)
@given(ops=OPS, tail=st.booleans())
def test_a_start_from_the_snapshot_is_a_full_replay(tmp_path_factory: Any, ops: Any,
                                                    tail: bool) -> None:
    root = tmp_path_factory.mktemp("root")
    engines = [engine(root, "a"), engine(root, "b")]
    saved = False
    for op, who, prompt, upto in ops:
        e = engines[who]
        if not e.alive:
            e = engines[who] = engine(root, e.name)
        if op == "store":
            chunks, positions = _prompt_chunks(prompt)
            refused = e.ledger.counters.as_dict()["stores_refused"]
            e.ledger.sync()  # what the other engine appended: the store replays it first
            files = e.ledger.files()
            try:
                store_files(e.tier, chunks[:upto], lambda ks: str(root / _name_of(ks)),
                            lambda ks: KEY_BYTES * len(ks), _write_whole, positions)
            except StoreRefused:  # a full root: counted once, nothing reserved or evicted
                assert e.ledger.counters.as_dict()["stores_refused"] == refused + 1
                assert e.ledger.files() == files
        elif op == "pending":  # a reservation left being written (the writer lives on)
            _store_pending(e, prompt)
        elif op == "touch":
            e.ledger.touch(list(e.ledger.files())[: prompt + 1])
            e.ledger.sync()
        elif op == "drop":
            entry = _a_written_file(e, prompt)
            if entry is not None:
                path, keys = entry
                e.ledger.drop_keys(path, keys[: upto % len(keys) or 1])
        elif op == "forget":
            entry = _a_written_file(e, prompt)
            if entry is not None:
                os.unlink(root / entry[0])
                e.ledger.forget([entry[0]])
        elif op == "crash":
            e.crash()
        elif op == "compact":
            e.ledger.compact()
        elif op == "snapshot":
            saved = e.ledger.save_snapshot(None) is not None or saved
        elif op == "close":
            e.ledger.close()
            e.alive = False
            saved = True
    if tail:  # another engine appends after the last snapshot
        other = [e for e in engines if e.alive] or [engine(root, "c")]
        other[0].ledger.save_snapshot(None)
        try:
            other[0].tier.complete([(p, True) for p in _store(other[0], 9, upto=2)])
        except AssertionError:  # refused: the root is pinned by pending reservations
            other[0].ledger.touch(list(other[0].ledger.files()))
            other[0].ledger.sync()
        saved = True
    fast = assert_snapshot_start_is_a_replay(root, "used" if saved else None)
    event(f"start: {fast.snapshot_start}, tail {fast._offset > _snapshot_length(root)}")
    if fast.snapshot_start == "used":
        assert fast.counters.as_dict()["snapshot_loads"] == 1


def _snapshot_length(root: Path) -> int:
    path = root / LS.SNAPSHOT_FILE
    return LS._HEAD.unpack_from(path.read_bytes())[4] if path.exists() else 0


def _store_pending(e: Engine, prompt: int) -> None:
    chunks, positions = _prompt_chunks(prompt)
    e.tier.reserve(chunks[:1], lambda ks: str(e.root / _name_of(ks)),
                   lambda ks: KEY_BYTES * len(ks), positions)


def _a_written_file(e: Engine, pick: int) -> tuple[str, tuple[bytes, ...]] | None:
    e.ledger.sync()
    written = [p for p, ready in e.ledger.files().items() if ready]
    if not written:
        return None
    path = written[pick % len(written)]
    entry = e.ledger.entry(path)
    assert entry is not None
    return path, entry[0]


# ---------------------------------------------------------------------------
# Written where it should be, used when it binds
# ---------------------------------------------------------------------------


def _a_root_with_files(root: Path) -> Engine:
    e = engine(root, "a")
    for prompt in range(3):
        e.tier.complete([(p, True) for p in _store(e, prompt, upto=2)])
    return e


def test_close_writes_it_and_the_next_start_loads_it(tmp_path: Path) -> None:
    e = _a_root_with_files(tmp_path)
    e.ledger.close()
    assert (tmp_path / LS.SNAPSHOT_FILE).exists()
    assert e.ledger.counters.as_dict()["snapshots_written"] == 1
    again = Engine(tmp_path, "b")
    assert again.ledger.snapshot_start == "used"
    counters = again.ledger.counters.as_dict()
    assert counters["snapshot_loads"] == 1 and counters["snapshot_fallbacks"] == 0
    again.start()
    assert again.ledger.model() == RootLedger.replayed(str(tmp_path)).model()
    assert_snapshot_start_is_a_replay(tmp_path)


def test_a_compaction_writes_it(tmp_path: Path) -> None:
    e = _a_root_with_files(tmp_path)
    e.ledger.compact()
    assert e.ledger.counters.as_dict()["snapshots_written"] == 1
    assert_snapshot_start_is_a_replay(tmp_path)
    e.tier.complete([(p, True) for p in _store(e, 5)])  # appended after it: the tail
    assert_snapshot_start_is_a_replay(tmp_path)


def test_a_snapshot_past_its_share_of_the_reserve_is_not_written(tmp_path: Path) -> None:
    e = _a_root_with_files(tmp_path)
    assert e.ledger.save_snapshot(None) is not None
    assert e.ledger.save_snapshot(max_bytes=100) is None
    assert not (tmp_path / LS.SNAPSHOT_FILE).exists(), "the stale one was left"
    assert e.ledger.snapshot_max_bytes() == e.ledger.ledger_bytes // LS.RESERVE_SHARE


# ---------------------------------------------------------------------------
# Not used: the full replay, counted
# ---------------------------------------------------------------------------


def _saved(root: Path) -> tuple[Engine, bytes]:
    e = _a_root_with_files(root)
    e.ledger.save_snapshot(None)
    return e, (root / LS.SNAPSHOT_FILE).read_bytes()


@pytest.mark.parametrize("how,why", [
    ("missing", "missing"), ("truncated", "damaged"), ("flipped", "damaged"),
    ("magic", "damaged"), ("version", "version"), ("empty", "damaged"),
    ("payload", "damaged"),
])
def test_a_damaged_snapshot_falls_back_to_the_journal(tmp_path: Path, how: str, why: str) -> None:
    _, data = _saved(tmp_path)
    path = tmp_path / LS.SNAPSHOT_FILE
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        path.write_bytes(data[: len(data) - 7])
    elif how == "flipped":
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
    elif how == "magic":
        path.write_bytes(b"X" + data[1:])
    elif how == "version":
        path.write_bytes(data[:8] + struct.pack("<H", LS.VERSION + 1) + data[10:])
    elif how == "empty":
        path.write_bytes(b"")
    else:  # a payload whose digest holds but whose fields do not: rebuilt with a bad one
        head = LS._HEAD.unpack_from(data)
        payload = LS.marshal.dumps((None, 0, 0, [("x", None, (), (), [], [])], (), []), 4)
        path.write_bytes(LS._HEAD.pack(*head[:6], len(payload), LS.journal_digest(payload))
                         + payload)
    fast = assert_snapshot_start_is_a_replay(tmp_path, why)
    assert fast.counters.as_dict()["snapshot_fallbacks"] == 1
    e = Engine(tmp_path, "late")
    assert e.ledger.snapshot_start == why
    assert e.ledger.counters.as_dict()["snapshot_loads"] == 0


def test_a_journal_compacted_since_makes_it_stale(tmp_path: Path) -> None:
    e, data = _saved(tmp_path)
    e.ledger.compact()  # writes its own: put the old one back
    (tmp_path / LS.SNAPSHOT_FILE).write_bytes(data)
    assert_snapshot_start_is_a_replay(tmp_path, "stale")


@pytest.mark.parametrize("how", ["shorter", "rewritten"])
def test_a_journal_changed_under_it_makes_it_stale(tmp_path: Path, how: str) -> None:
    _saved(tmp_path)
    journal = tmp_path / LEDGER_FILE
    data = journal.read_bytes()
    if how == "shorter":
        journal.write_bytes(data[: data.rfind(b"\n", 0, len(data) - 1) + 1])
    else:  # same length, one record's bytes changed
        at = data.index(b'"bytes":') + len(b'"bytes":')
        journal.write_bytes(data[:at] + (b"9" if data[at:at + 1] != b"9" else b"8")
                            + data[at + 1:])
    assert_snapshot_start_is_a_replay(tmp_path, "stale")


def test_a_journal_rewritten_with_the_same_bytes_still_binds(tmp_path: Path) -> None:
    """The binding is the bytes, not the inode (a restore, a copy)."""
    _saved(tmp_path)
    journal = tmp_path / LEDGER_FILE
    data = journal.read_bytes()
    journal.unlink()
    journal.write_bytes(data)
    assert_snapshot_start_is_a_replay(tmp_path, "used")


def test_another_chunking_falls_back(tmp_path: Path) -> None:
    _saved(tmp_path)
    fast = RootLedger.replayed(str(tmp_path), snapshot=True)  # no chunking for NS
    assert fast.snapshot_start == "chunking"
    assert state(fast) == state(RootLedger.replayed(str(tmp_path)))


def test_a_snapshot_is_plain_data(tmp_path: Path) -> None:
    """No pickle: a payload holding anything but plain types is refused, not built."""
    _, data = _saved(tmp_path)
    head = LS._HEAD.unpack_from(data)
    payload = LS.marshal.dumps((None, 0, 0, [], ([], [], [], [], [], []),
                                [compile("1", "x", "eval")]), 4)
    (tmp_path / LS.SNAPSHOT_FILE).write_bytes(
        LS._HEAD.pack(*head[:6], len(payload), LS.journal_digest(payload)) + payload)
    assert_snapshot_start_is_a_replay(tmp_path, "damaged")


# ---------------------------------------------------------------------------
# Sizes: checked when it is written at shutdown, and for the tail's files at a start
# ---------------------------------------------------------------------------


def test_a_start_from_it_reconciles_the_files_written_after_it(tmp_path: Path) -> None:
    e = _a_root_with_files(tmp_path)
    e.ledger.close()
    b = engine(tmp_path, "b")
    (late,) = _store(b, 7)
    b.tier.complete([(late, True)])
    b.crash()  # no close: the snapshot stays the one before ``late``
    Path(late).write_bytes(b"\0" * (3 * KEY_BYTES))  # grew behind the journal's back
    c = Engine(tmp_path, "c")
    assert c.ledger.snapshot_start == "used"
    c.start()
    assert c.ledger.entry(os.path.relpath(late, tmp_path))[1] == 3 * KEY_BYTES


def test_a_file_pending_when_it_was_written_is_checked_at_the_start(tmp_path: Path) -> None:
    """A reservation being written when the shutdown wrote the snapshot was not checked
    then: its file is ``stat``-ed at the next start, though the snapshot holds its rid."""
    a = _a_root_with_files(tmp_path)
    b = engine(tmp_path, "b")
    chunks, positions = _prompt_chunks(7)
    ((path, _),) = b.tier.reserve(chunks[:1], lambda ks: str(tmp_path / _name_of(ks)),
                                  lambda ks: KEY_BYTES * len(ks), positions)
    a.ledger.close()  # the snapshot: b's file pending
    Path(path).write_bytes(b"\0" * (3 * KEY_BYTES))  # not what b reserved
    b.tier.complete([(path, True)])
    b.crash()
    c = Engine(tmp_path, "c")
    assert c.ledger.snapshot_start == "used"
    c.start()
    assert c.ledger.entry(os.path.relpath(path, tmp_path))[1] == 3 * KEY_BYTES


def test_close_checks_every_size_before_it_writes(tmp_path: Path) -> None:
    e = _a_root_with_files(tmp_path)
    path = next(p for p, ready in e.ledger.files().items() if ready)
    (tmp_path / path).write_bytes(b"\0" * (KEY_BYTES + 1))
    e.ledger.close()
    fast = assert_snapshot_start_is_a_replay(tmp_path)
    assert fast.entry(path)[1] == KEY_BYTES + 1


# ---------------------------------------------------------------------------
# A crash at each step of writing it
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("point", ["mid-write", "before-rename", "enospc", "after-rename"])
def test_a_crash_while_writing_it_leaves_a_correct_start(tmp_path: Path, point: str) -> None:
    e, old = _saved(tmp_path)
    e.tier.complete([(p, True) for p in _store(e, 7)])
    io = e.io
    write, replace = io.write, io.replace

    def faulty_write(fd: int, data: bytes) -> int:
        if data[:8] == LS.MAGIC:
            if point == "mid-write":
                os.write(fd, data[: len(data) // 2])
                raise Crash("snapshot-mid-write")
            if point == "enospc":
                os.write(fd, data[: len(data) // 2])
                raise OSError(errno.ENOSPC, "injected")
        return write(fd, data)

    def faulty_replace(src: str, dst: str) -> None:
        if src.endswith(LS.PARTIAL_SUFFIX) and point == "before-rename":
            raise Crash("snapshot-before-rename")
        replace(src, dst)
        if src.endswith(LS.PARTIAL_SUFFIX) and point == "after-rename":
            raise Crash("snapshot-after-rename")

    io.write = faulty_write  # type: ignore[method-assign]
    io.replace = faulty_replace  # type: ignore[method-assign]
    if point == "enospc":
        e.ledger.close()  # the write fails, the close goes on: the old snapshot stays
        e.alive = False
    else:
        with pytest.raises(Crash):
            e.ledger.close()
        e.crash()
    snap = (tmp_path / LS.SNAPSHOT_FILE).read_bytes()
    partial = list(tmp_path.glob(LS.SNAPSHOT_FILE + ".*" + LS.PARTIAL_SUFFIX))
    if point == "after-rename":
        assert snap != old and not partial
        assert_snapshot_start_is_a_replay(tmp_path, "used")
    else:
        assert snap == old, "a failed write replaced the snapshot"
        assert bool(partial) == (point != "enospc")
        assert_snapshot_start_is_a_replay(tmp_path, "used")  # the old one, and the tail
    b = engine(tmp_path, "b")
    assert b.ledger.model() == RootLedger.replayed(str(tmp_path)).model()
    b.ledger.close()
    assert not list(tmp_path.glob(LS.SNAPSHOT_FILE + ".*" + LS.PARTIAL_SUFFIX))
    assert_snapshot_start_is_a_replay(tmp_path, "used")
