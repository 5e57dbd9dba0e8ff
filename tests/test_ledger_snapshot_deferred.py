"""A start from the ledger's snapshot defers each namespace's model (issue #30's start).

The snapshot (:mod:`vllm_adapter.disk.ledger_snapshot`, format 2) keeps each namespace's
prefix structure and Disk apart from the reservations: a start checks and builds the
reservations and totals, and leaves each namespace to be built on first access
(:class:`~vllm_adapter.disk.ledger_model.DeferredNamespace`).  What must hold:

* what a start reads without building (totals, which files are written) is what the full
  replay says, and once built the model is the full replay's, field by field;
* a namespace whose part of the payload does not hold (a payload forged with its digest)
  is refused when it is built, never used as it is: the ledger falls back to the full
  replay of the journal (once, as a start without a snapshot would have replayed it); what
  the load checks itself is refused at the load (the journal replayed);
* a snapshot of another format version is not used (the journal is replayed whole);
* a snapshot written while a namespace is still unbuilt writes its loaded part again
  (nothing changed it), without building it, and a start from it is still a full replay.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
from test_ledger_snapshot import (  # noqa: I001
    _a_root_with_files,
    _store_pending,
    assert_snapshot_start_is_a_replay,
    state,
    victims,
)
from test_ledger_state_machine import CHUNKING, NS, Engine

from vllm_adapter.disk import ledger_snapshot as LS
from vllm_adapter.disk.ledger import RootLedger
from vllm_adapter.disk.ledger_model import DeferredNamespace


def _saved_with_a_pending_file(root: Path) -> Engine:
    """Written files, one pending (its writer alive), and the snapshot of it all."""
    e = _a_root_with_files(root)
    _store_pending(e, 7)
    assert e.ledger.save_snapshot(None) is not None
    return e


def _unbuilt(ledger: RootLedger) -> bool:
    spaces = list(ledger._spaces.values())
    return bool(spaces) and all(isinstance(s, DeferredNamespace) and not s.built for s in spaces)


def test_a_start_builds_no_namespace_and_says_what_the_replay_says(tmp_path: Path) -> None:
    _saved_with_a_pending_file(tmp_path)
    full = RootLedger.replayed(str(tmp_path))
    later = Engine(tmp_path, "later")
    assert later.ledger.snapshot_start == "used"
    later.start()
    assert _unbuilt(later.ledger), "the start built a namespace"
    assert later.ledger.totals() == full.totals()
    assert later.ledger.files() == full.files()
    assert not all(full.files().values()), "the snapshot should hold a pending file"
    assert _unbuilt(later.ledger)
    later.ledger.entry(next(iter(full.files())))  # a file's keys: built now
    assert not _unbuilt(later.ledger)
    assert later.ledger.model() == full.model()
    assert_snapshot_start_is_a_replay(tmp_path)


def _forged(data: bytes, change: Any) -> bytes:
    """``data`` with its payload changed by ``change`` and its digest made to hold."""
    head = LS._HEAD.unpack_from(data)
    state = list(LS.marshal.loads(data[LS._HEAD.size:]))
    change(state)
    payload = LS.marshal.dumps(tuple(state), LS.MARSHAL_VERSION)
    return LS._HEAD.pack(*head[:6], len(payload), LS.journal_digest(payload)) + payload


def _one_more_file(state: list[Any]) -> None:
    ns, binding, files, nbytes, stranded, blob = state[3][0]
    state[3][0] = (ns, binding, files + 1, nbytes, stranded, blob)


def _a_written_file_pending(state: list[Any]) -> None:
    state[5] = sorted({*state[5], *state[4][0]})


def _a_disk_of_other_bytes(state: list[Any]) -> None:
    ns, binding, files, nbytes, stranded, blob = state[3][0]
    state[3][0] = (ns, binding, files, nbytes + 1, stranded, blob)


def test_a_namespace_that_does_not_hold_is_refused_at_the_load(tmp_path: Path) -> None:
    """The namespaces' file counts against the reservations: checked at the load."""
    _saved_with_a_pending_file(tmp_path)
    path = tmp_path / LS.SNAPSHOT_FILE
    path.write_bytes(_forged(path.read_bytes(), _one_more_file))
    assert_snapshot_start_is_a_replay(tmp_path, "damaged")


BUILT_WRONG = [_a_written_file_pending, _a_disk_of_other_bytes]
"""Forgeries only the namespace's own build can see (its files' readiness, its Disk's bytes)."""


def _forge(root: Path, change: Any) -> None:
    path = root / LS.SNAPSHOT_FILE
    path.write_bytes(_forged(path.read_bytes(), change))


def _built_from_the_replay(ledger: RootLedger) -> None:
    """Nothing of the damaged payload is left to build: every namespace is built."""
    assert all(not isinstance(s, DeferredNamespace) or s.built for s in ledger._spaces.values())


@pytest.mark.parametrize("change", BUILT_WRONG)
def test_a_namespace_that_does_not_hold_falls_back_to_the_full_replay_when_built(
        tmp_path: Path, change: Any) -> None:
    """What only the namespace's own part says is checked when it is built: a build that
    does not hold gives up the snapshot, and the ledger becomes the full replay of the
    journal (never a model the start's answers disagree with, never an error)."""
    _saved_with_a_pending_file(tmp_path)
    _forge(tmp_path, change)
    fast = RootLedger.replayed(str(tmp_path), snapshot=True, chunkings={NS: CHUNKING})
    assert fast.snapshot_start == "used"
    full = RootLedger.replayed(str(tmp_path), chunkings={NS: CHUNKING})
    assert fast.model() == full.model()  # built now: the build fell back
    assert fast.snapshot_start == "damaged"
    _built_from_the_replay(fast)
    assert state(fast) == state(full)
    assert victims(fast) == victims(full)
    counters = fast.counters.as_dict()
    assert (counters["snapshot_loads"], counters["snapshot_fallbacks"]) == (1, 1)


@pytest.mark.parametrize("change", BUILT_WRONG)
def test_a_build_that_does_not_hold_in_the_journals_tail_replays_up_to_that_record(
        tmp_path: Path, change: Any) -> None:
    """A record after the snapshot names the namespace: its build, in the start's own replay,
    falls back to the replay of the journal before that record, then the tail goes on."""
    e = _saved_with_a_pending_file(tmp_path)
    _forge(tmp_path, change)
    with e.ledger._locked():  # first a record that names no namespace (the budget, again)
        e.ledger._append([{"op": "budget", "bytes": e.ledger.budget}])
    e.ledger.complete([(p, True) for p in e.ledger.owners()])  # a ``done``: the tail names NS
    fast = RootLedger.replayed(str(tmp_path), snapshot=True, chunkings={NS: CHUNKING})
    assert fast.snapshot_start == "damaged"
    _built_from_the_replay(fast)
    full = RootLedger.replayed(str(tmp_path), chunkings={NS: CHUNKING})
    assert state(fast) == state(full)
    assert all(fast.files().values())


@pytest.mark.parametrize("change", BUILT_WRONG)
def test_an_engine_on_a_damaged_snapshot_falls_back_once(
        tmp_path: Path, change: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine started from it: the first operation that builds the namespace falls back
    to the full replay (once: every namespace is then built from it), the operations after
    it work on that model, and the snapshot it writes next is whole again."""
    e = _saved_with_a_pending_file(tmp_path)
    _forge(tmp_path, change)
    replays = []
    replay = LS.replay
    monkeypatch.setattr(LS, "replay", lambda *a, **k: replays.append(k) or replay(*a, **k))
    later = Engine(tmp_path, "later")
    assert later.ledger.snapshot_start == "used"
    later.start()
    later.ledger.model()
    later.ledger.model()
    assert later.ledger.snapshot_start == "damaged"
    assert replays == [{"snapshot": False}]
    _built_from_the_replay(later.ledger)
    e.ledger.complete([(p, True) for p in e.ledger.owners()])
    _store_pending(later, 5)
    later.ledger.sync()
    assert replays == [{"snapshot": False}]
    assert later.ledger.model() == RootLedger.replayed(str(tmp_path)).model()
    counters = later.ledger.counters.as_dict()
    assert (counters["snapshot_loads"], counters["snapshot_fallbacks"]) == (1, 1)
    assert later.ledger.save_snapshot(None) is not None
    assert len(replays) == 2 and replays[1] == {"snapshot": False}, \
        "the next snapshot was written from the damaged one"
    monkeypatch.undo()
    assert_snapshot_start_is_a_replay(tmp_path)
    e.ledger.close()


@pytest.mark.parametrize("change", BUILT_WRONG)
def test_a_build_that_does_not_hold_in_an_own_record_replays_up_to_that_record(
        tmp_path: Path, change: Any) -> None:
    """The engine's own record (a ``use``, appended, then applied) names the namespace: the
    fallback replays the journal before that record, and the record is applied once."""
    _saved_with_a_pending_file(tmp_path)
    _forge(tmp_path, change)
    later = Engine(tmp_path, "later")
    assert later.ledger.snapshot_start == "used"
    later.ledger.touch(sorted(later.ledger.files())[:2])  # (one written in either forgery)
    later.ledger.sync()  # the ``use`` appended and applied: the namespace built
    assert later.ledger.snapshot_start == "damaged"
    full = RootLedger.replayed(str(tmp_path), chunkings={NS: CHUNKING})
    assert state(later.ledger) == state(full)


def test_the_stranded_gauge_after_a_start_builds_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's scheduler thread asks for the stranded bytes (``peek``): an unbuilt namespace
    answers what it held when the snapshot was written, without a build; once built, what
    its model says."""
    from vllm_adapter.disk.ledger_model import Namespace

    monkeypatch.setattr(Namespace, "stranded_bytes", lambda self: 4096)  # stranded when saved
    _saved_with_a_pending_file(tmp_path)
    monkeypatch.undo()
    later = Engine(tmp_path, "later")
    assert later.ledger.snapshot_start == "used"
    peeked = later.ledger.peek(stranded=True)
    assert peeked is not None and peeked["stranded_bytes"] == 4096
    assert _unbuilt(later.ledger), "the gauge built a namespace"
    later.ledger.model()
    assert later.ledger.stranded_bytes() == RootLedger.replayed(str(tmp_path)).stranded_bytes()


def test_a_namespace_claiming_more_stranded_than_its_bytes_is_refused_at_the_load(
        tmp_path: Path) -> None:
    _saved_with_a_pending_file(tmp_path)
    path = tmp_path / LS.SNAPSHOT_FILE

    def more_stranded_than_held(state: list[Any]) -> None:
        ns, binding, files, nbytes, _, blob = state[3][0]
        state[3][0] = (ns, binding, files, nbytes, nbytes + 1, blob)

    path.write_bytes(_forged(path.read_bytes(), more_stranded_than_held))
    assert_snapshot_start_is_a_replay(tmp_path, "damaged")


@pytest.mark.parametrize("version", [LS.VERSION - 1, LS.VERSION + 1])
def test_a_snapshot_of_another_version_is_not_used(tmp_path: Path, version: int) -> None:
    _saved_with_a_pending_file(tmp_path)
    path = tmp_path / LS.SNAPSHOT_FILE
    data = path.read_bytes()
    path.write_bytes(data[:8] + struct.pack("<H", version) + data[10:])
    assert_snapshot_start_is_a_replay(tmp_path, "version")


def test_a_snapshot_written_before_a_build_writes_the_loaded_part_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    e = _saved_with_a_pending_file(tmp_path)
    before = (tmp_path / LS.SNAPSHOT_FILE).read_bytes()
    builds = []
    build = LS._build
    monkeypatch.setattr(LS, "_build", lambda *a: builds.append(a[0]) or build(*a))
    later = Engine(tmp_path, "later")
    assert later.ledger.save_snapshot(None, verify=False) is not None
    assert builds == [], "writing the snapshot built a namespace"
    after = (tmp_path / LS.SNAPSHOT_FILE).read_bytes()
    loaded = LS.marshal.loads
    assert loaded(after[LS._HEAD.size:]) == loaded(before[LS._HEAD.size:])
    monkeypatch.undo()
    assert_snapshot_start_is_a_replay(tmp_path)
    e.ledger.close()
