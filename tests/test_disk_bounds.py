"""What the disk budget covers besides the files, and what it does not (issue #29 items 5-7).

* The quarantine is inside ``disk_bytes_to_use``: a quarter of the ledger's reserve,
  oldest bad file first out; a bad file larger than that is deleted, not kept.
* Reads are not pinned across engines: an eviction that lands during a slow load unlinks
  the file, the load still reads every byte it opened (POSIX), and the excess over the
  budget is that open file, freed at close: at most the files of the loads in flight.
* A file system without ``flock`` is not refused: the ledger runs on its held lock and
  heartbeats (``tests/test_ledger_across_hosts.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

from test_ledger_state_machine import (  # noqa: I001
    BUDGET,
    KEY_BYTES,
    RESERVE,
    Engine,
    _prompt_chunks,
    _store,
    root_bytes,
)

from vllm_adapter.disk import chunk_file as C
from vllm_adapter.disk.ledger import ledger_reserve


def _bad_file(path: Path, nbytes: int) -> os.stat_result:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\1" * nbytes)
    return os.stat(path)


def test_the_quarantine_keeps_a_quarter_of_the_reserve_oldest_out_first(tmp_path: Path) -> None:
    cap = 3 * 4096
    ios = [C.ChunkIO(namespace=bytes(16), bad_files="quarantine",
                     quarantine_dir=str(tmp_path / ns / C.QUARANTINE_DIR),
                     quarantine_bytes=cap, quarantine_root=str(tmp_path)) for ns in ("a", "b")]
    for i in range(5):  # two namespaces, one cap for the root
        io = ios[i % 2]
        path = tmp_path / ("a", "b")[i % 2] / f"f{i}.bin"
        st = _bad_file(path, 4096)
        os.utime(path, (1000 + i, 1000 + i))
        C.discard_bad_file(str(path), st, io)
        assert not path.exists()
    kept = sorted(p.name.split(".")[0] for p in tmp_path.rglob("*.bad"))
    assert kept == ["f2", "f3", "f4"], kept  # the newest three: 3 x 4096 = the cap
    big = tmp_path / "a" / "big.bin"
    C.discard_bad_file(str(big), _bad_file(big, cap + 1), ios[0])
    assert not big.exists() and not list(tmp_path.rglob("big.bin*")), "a file over the cap is kept"
    assert sum(p.stat().st_size for p in tmp_path.rglob("*.bad")) <= cap


def test_the_tiers_quarantine_cap_is_a_quarter_of_the_ledgers_reserve() -> None:
    for budget in (10 << 30, 800 << 30, 64 << 20):
        assert ledger_reserve(budget) // 4 < ledger_reserve(budget) // 2  # journal + quarantine fit


def test_an_eviction_during_a_slow_load_leaves_the_load_whole(tmp_path: Path) -> None:
    """The documented excess: the evicted file a load holds open, freed at its close."""
    a, b = Engine(tmp_path, "a"), Engine(tmp_path, "b")
    a.start()
    b.start()
    (path,) = _store(a, 1)
    a.tier.complete([(path, True)])
    with open(path, "rb") as load:  # a slow load: opened, half read
        first = load.read(KEY_BYTES)
        prompt = 3
        while os.path.exists(path):  # b stores until the rule evicts a's file
            for p in _store(b, prompt, upto=3):
                b.tier.complete([(p, True)])
            prompt += 2
            assert prompt < 100, "nothing evicted a's file"
        rest = load.read()
        st = os.fstat(load.fileno())
        assert st.st_nlink == 0  # unlinked while open: only the open descriptor holds it
        assert first + rest == b"\0" * (2 * KEY_BYTES), "the load lost bytes to the eviction"
        # the excess the docs state: this open file, beside a root within its budget
        assert root_bytes(tmp_path) <= BUDGET
        assert st.st_blocks * 512 <= 2 * KEY_BYTES + 4096
    assert os.path.relpath(path, tmp_path) not in b.ledger.files()


def test_the_journal_stays_within_the_reserve_under_many_stores(tmp_path: Path) -> None:
    e = Engine(tmp_path, "a")
    e.start()
    for prompt in range(1, 300, 2):
        chunks, _ = _prompt_chunks(prompt)
        for p in _store(e, prompt, upto=len(chunks)):
            e.tier.complete([(p, True)])
        e.tier.touch([])
        assert os.path.getsize(tmp_path / "kvchunk-ledger.jsonl") <= RESERVE
        assert root_bytes(tmp_path) <= BUDGET
