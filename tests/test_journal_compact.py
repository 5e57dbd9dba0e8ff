"""The journal's compact ``add`` record (:mod:`vllm_adapter.disk.journal`): it says what
the full form says, a journal in the full form (operators' roots) replays to the same
ledger as the same history written compact, a damaged compact line is skipped, and the
record is small.

The full form is what the journal wrote before: the record as the ledger builds it
(``keys`` in hex, ``fragment`` as :func:`~vllm_adapter.disk.journal.fragment_json`),
dumped as it is (:func:`full_line`)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ledger_state_machine import (  # noqa: I001
    KEY_BYTES,
    NS,
    SYNTHETIC,
    Engine,
    Setup,
    _name_of,
    _write_whole,
)

from reference.prefix_structure import Fragment, PrefixStructure
from vllm_adapter.disk import journal as J
from vllm_adapter.disk.ledger import LEDGER_FILE, RootLedger

FULL_FIELDS = ("op", "rid", "ns", "path", "bytes", "keys", "owner", "fragment")


def full_line(rec: dict[str, Any]) -> bytes:
    """A decoded ``add`` as the journal wrote it before the compact form (the field order
    and separators of that writer)."""
    full = {"op": "add", "rid": rec["rid"], "ns": rec["ns"], "path": rec["path"],
            "bytes": rec["bytes"], "keys": J.hex_keys(rec["keys"]), "owner": rec["owner"],
            "fragment": J.fragment_json(rec["fragment"])}
    return json.dumps(full, separators=(",", ":")).encode() + b"\n"


def as_full_form(journal: bytes) -> bytes:
    """The same journal with every ``add`` in the full form (other lines as they are)."""
    out = []
    for line in journal.splitlines(keepends=True):
        rec = J.decode(line)
        out.append(full_line(rec) if rec is not None and rec["op"] == "add" else line)
    return b"".join(out)


# ---------------------------------------------------------------------------
# The codec: the compact form says what the full form says
# ---------------------------------------------------------------------------

KEYS = st.binary(min_size=0, max_size=12).flatmap(
    lambda h: st.builds(lambda g, tail: h + g.to_bytes(4, "big") if tail else h,
                        st.sampled_from([0, 1, 5, 255, 256, 70_000, 2**32 - 1]), st.booleans()))
"""Keys: mostly a hash and a group id (the ledger's), some shorter than a group id."""


@st.composite
def add_records(draw: st.DrawFn) -> dict[str, Any]:
    pool = draw(st.lists(KEYS, min_size=1, max_size=12))
    keys = draw(st.lists(st.sampled_from(pool), max_size=8))
    parents = draw(st.lists(st.tuples(st.sampled_from(pool),
                                      st.none() | st.sampled_from(pool)), max_size=3))
    boundaries = draw(st.lists(st.tuples(st.binary(max_size=8),
                                         st.lists(st.sampled_from(pool), max_size=3),
                                         st.lists(st.sampled_from(pool), max_size=6)),
                               max_size=3))
    fragment = Fragment(tuple(parents), tuple((b, tuple(f), tuple(w)) for b, f, w in boundaries))
    return {"op": "add", "rid": "o.1", "ns": NS, "path": f"{NS}/a.kvp", "bytes": 4096,
            "keys": J.hex_keys(keys), "owner": "o", "fragment": J.fragment_json(fragment)}


@settings(max_examples=300, deadline=None)
@given(add_records())
def test_any_add_record_decodes_from_what_encode_writes_as_from_its_full_form(
        record: dict[str, Any]) -> None:
    """Whatever its keys (short ones, repeated ones, group ids past a byte or two, a key
    that is its own parent), an ``add`` decodes the same from the line :func:`encode`
    writes as from the full form."""
    full = json.dumps(record, separators=(",", ":")).encode()
    expected = J.decode(full)
    assert expected is not None
    assert J.decode(J.encode(record)) == expected


def test_encode_writes_the_compact_form_for_the_ledgers_keys() -> None:
    """Keys that are a hash and a group id are written compact: none in hex in full."""
    keys = [bytes([h]) * 32 + g.to_bytes(4, "big") for h in (1, 2) for g in range(3)]
    frag = Fragment(((keys[0], None), (keys[3], keys[0])),
                    ((bytes([2]) * 32, (keys[3],), tuple(keys[1:3] + keys[4:])),))
    record = {"op": "add", "rid": "o.1", "ns": NS, "path": f"{NS}/a.kvp", "bytes": 1,
              "keys": J.hex_keys(keys), "owner": "o", "fragment": J.fragment_json(frag)}
    line = J.encode(record)
    raw = json.loads(line)
    assert "keys" not in raw and "fragment" not in raw and "h" in raw, raw
    assert keys[0].hex() not in line.decode()
    rec = J.decode(line)
    assert rec is not None and rec["keys"] == tuple(keys) and rec["fragment"] == frag


# ---------------------------------------------------------------------------
# A history written in either form replays to the same ledger
# ---------------------------------------------------------------------------


def _history(root: Path, setup: Setup, prompts: int = 6) -> Engine:
    """Stores (every few evict under the budget), reads, a failed store, a forgotten
    file, dropped keys: a journal of every record kind, left uncompacted."""
    e = Engine(root, "e", setup=setup)
    e.start()
    for prompt in range(prompts):
        chunks, positions = setup.prompt_chunks(prompt)
        for upto in range(1, len(chunks) + 1):
            out = e.tier.reserve(chunks[upto - 1:upto], lambda ks: str(root / _name_of(ks)),
                                 lambda ks: KEY_BYTES * len(ks), positions) or []
            for path, keys in out:
                _write_whole(path, keys)
            ok = not (prompt == 3 and upto == 2)  # one failed store
            e.tier.complete([(p, ok) for p, _ in out])
        e.ledger.touch([p for p in e.ledger.files() if p.endswith(".kvp")][:2])
    written = sorted(p for p, w in e.ledger.files().items() if w)
    assert len(written) >= 2, written
    os.unlink(root / written[0])  # a load found it bad and deleted it
    e.ledger.forget(written[:1])
    entry = e.ledger.entry(written[-1])
    assert entry is not None
    e.ledger.drop_keys(written[-1], entry[0][:1])  # a key no load can serve any more
    e.ledger.sync()
    return e


def _state(ledger: RootLedger) -> dict[str, Any]:
    """Everything a replay builds: the files model, each namespace's disk (keys, bytes, use
    time, written) and prefix structure, the clock and the recorded budget."""
    spaces = {}
    for ns, space in ledger._spaces.items():
        s: PrefixStructure = space.structure
        spaces[ns] = (
            {fid: (f.keys, f.nbytes, f.last_use, f.ready) for fid, f in space.disk.files.items()},
            dict(space.path_of), dict(s.parent), {k: set(v) for k, v in s.children.items()},
            dict(s.full_at), dict(s.windows_at), {k: sorted(v) for k, v in s.serves.items()},
            space.disk.bytes,
        )
    return {"model": ledger.model(), "spaces": spaces, "clock": ledger._clock,
            "budget": ledger._recorded_budget, "pending": set(ledger._pending)}


def _setups() -> list[Any]:
    out: list[Any] = [SYNTHETIC]
    needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                    reason="needs vllm importable (the fixture's chunking)")
    out.append(pytest.param("gemma-4-31B-it-tp2", marks=needs_vllm))
    return out


def _setup(which: Setup | str) -> Setup:
    if isinstance(which, Setup):
        return which
    from vllm_adapter.planning import fixture_knob

    chunking = fixture_knob(which, "block_size", 512).chunking
    return Setup(which, chunking, 1 << 40, 8 << 20)


@pytest.mark.parametrize("which", _setups())
def test_a_journal_in_the_full_form_replays_to_the_same_ledger(tmp_path: Path,
                                                               which: Setup | str) -> None:
    """One history, its journal written compact and the same journal with every ``add`` in
    the full form: both replay to the same files model, disks, prefix structures and clock
    (the format changes no ledger state)."""
    setup = _setup(which)
    e = _history(tmp_path, setup)
    e.ledger.close()
    compact = (tmp_path / LEDGER_FILE).read_bytes()
    adds = [json.loads(line) for line in compact.splitlines() if b'"op":"add"' in line]
    assert adds and all("h" in a for a in adds), "the history wrote no compact add"
    new = _state(RootLedger.replayed(str(tmp_path)))
    (tmp_path / LEDGER_FILE).write_bytes(as_full_form(compact))
    old = _state(RootLedger.replayed(str(tmp_path)))
    assert new["model"], "the history left no file"
    assert old == new


def test_a_root_journaled_in_the_full_form_starts_and_compacts_to_the_compact_form(
        tmp_path: Path) -> None:
    """An operator's root whose journal is in the full form: an engine starts on it with the
    files the journal names, and its compaction writes every ``add`` compact, the same
    ledger replayed."""
    e = _history(tmp_path, SYNTHETIC)
    e.ledger.close()
    path = tmp_path / LEDGER_FILE
    path.write_bytes(as_full_form(path.read_bytes()))
    before = _state(RootLedger.replayed(str(tmp_path)))
    again = Engine(tmp_path, "e2")
    started = again.start()
    assert started["missing"] == 0 and started["orphans"] == 0, started
    assert again.ledger.model() == before["model"]
    again.ledger.compact()
    again.ledger.close()
    adds = [json.loads(line) for line in path.read_bytes().splitlines() if b'"op":"add"' in line]
    assert adds and all("h" in a and "keys" not in a for a in adds)
    assert RootLedger.replayed(str(tmp_path)).model() == before["model"]


# ---------------------------------------------------------------------------
# A damaged compact line is skipped, never a failed start
# ---------------------------------------------------------------------------

DAMAGE = {
    "a key's hash index past the hashes": lambda r: r.update(t="ff" + r["t"][2:]),
    "a full key index past the keys": lambda r: r["b"][0].__setitem__(1, "ff"),
    "a window key index past the keys": lambda r: r["b"][0].__setitem__(2, r["b"][0][2] + "ff"),
    "a parent index past the keys": lambda r: r.update(p="00ff"),
    "a parent pair torn": lambda r: r.update(p="00"),
    "a key pair torn": lambda r: r.update(t=r["t"][:-2]),
    "an index not hex": lambda r: r.update(t="zz" + r["t"][2:]),
    "an odd hex index": lambda r: r.update(t=r["t"][:-1]),
    "indices as numbers": lambda r: r.update(t=list(bytes.fromhex(r["t"]))),
    "a boundary index past the hashes": lambda r: r["b"][0].__setitem__(0, 255),
    "a negative boundary index": lambda r: r["b"][0].__setitem__(0, -1),
    "a boundary index as text": lambda r: r["b"][0].__setitem__(0, "0"),
    "a boundary of two fields": lambda r: r["b"].__setitem__(0, r["b"][0][:2]),
    "more file keys than keys": lambda r: r.update(n=10_000),
    "a negative file key count": lambda r: r.update(n=-1),
    "a width of 3": lambda r: r.update(w=3),
    "a 2-byte width over 1-byte indices": lambda r: r.update(w=2, t=r["t"] + "00"),
    "a hash not hex": lambda r: r.update(h=["zz"] + r["h"][1:]),
    "a hash not text": lambda r: r.update(h=[7] + r["h"][1:]),
    "no hashes": lambda r: r.pop("h") and r.pop("keys", None),
    "no boundaries": lambda r: r.pop("b"),
}


def _one_compact_add(root: Path) -> tuple[Engine, str, dict[str, Any]]:
    e = Engine(root, "e")
    e.start()
    chunks, positions = SYNTHETIC.prompt_chunks(0)
    out = e.tier.reserve(chunks[:2], lambda ks: str(root / _name_of(ks)),
                         lambda ks: KEY_BYTES * len(ks), positions) or []
    for path, keys in out:
        _write_whole(path, keys)
    e.tier.complete([(p, True) for p, _ in out])
    e.ledger.close()
    lines = (root / LEDGER_FILE).read_bytes().splitlines()
    last = [json.loads(line) for line in lines if b'"op":"add"' in line][-1]
    assert "h" in last and last["b"], last
    return e, out[-1][0], last


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_compact_add_is_skipped_and_the_engine_starts(tmp_path: Path, how: str) -> None:
    """A compact ``add`` with an index that names nothing, a torn or non-hex index field, a
    wrong width, a boundary of the wrong shape... decodes to None; appended to a root's
    journal, the next engine starts over it, skips the line, and keeps the other files."""
    _, kept, record = _one_compact_add(tmp_path)
    damaged = json.loads(json.dumps(record))
    damaged.update(rid="x.9", path=f"{NS}/damaged.kvp")
    DAMAGE[how](damaged)
    line = json.dumps(damaged, separators=(",", ":")).encode()
    assert J.decode(line) is None, how
    with open(tmp_path / LEDGER_FILE, "ab") as f:
        f.write(line + b"\n")
    again = Engine(tmp_path, "e2")
    again.start()
    files = again.ledger.files()
    assert os.path.relpath(kept, tmp_path) in files and f"{NS}/damaged.kvp" not in files
    assert again.ledger.counters.as_dict()["journal_records_skipped"] >= 1
    again.ledger.close()


# ---------------------------------------------------------------------------
# Size: a gemma-4 turn's record
# ---------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="needs vllm importable (the fixture's chunking)")
def test_a_gemma_4_turns_add_record_is_at_most_a_third_of_its_full_form(tmp_path: Path) -> None:
    """gemma-4-31B-it TP2 at ``block_size`` 512, turns of one session stored one file each
    (11 keys: the full-attention key and ten window keys; the fragment names the turn's
    boundary and the next, 22 keys of 4 hashes): each ``add`` is at most a third of its
    full form.  Why a third: the full form spells each of the ~50 key mentions in 72 hex
    digits; the compact one spells each hash once (64 digits, four of them) and a mention
    in 4 digits, so its keys take about a tenth, and the fields every record has (rid, ns,
    path, owner: ~250 bytes) keep the whole above that."""
    setup = _setup("gemma-4-31B-it-tp2")
    e = Engine(tmp_path, "e", setup=setup)
    e.start()
    chunks, positions = setup.prompt_chunks(1, chunks=4)
    for upto in range(1, len(chunks) + 1):
        out = e.tier.reserve(chunks[upto - 1:upto], lambda ks: str(tmp_path / _name_of(ks)),
                             lambda ks: KEY_BYTES * len(ks), positions) or []
        for path, keys in out:
            _write_whole(path, keys)
        e.tier.complete([(p, True) for p, _ in out])
    e.ledger.close()
    lines = [line + b"\n" for line in (tmp_path / LEDGER_FILE).read_bytes().splitlines()
             if b'"op":"add"' in line]
    assert len(lines) == len(chunks)
    for line in lines:
        rec = J.decode(line)
        assert rec is not None
        full = full_line(rec)
        assert len(rec["keys"]) == 11 or line is lines[0], len(rec["keys"])
        assert len(line) <= len(full) / 3, (len(line), len(full))
