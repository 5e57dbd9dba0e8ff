"""vllm_adapter.disk.budget: one budget per root, shared by every engine; eviction by the rule.

Reachability is judged by the reference (``reference.eviction.Disk.stranded`` over a
structure built from the requests' whole hash chains), not by the ledger's own model;
bytes are the files' real sizes on disk.  No vLLM needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reference.eviction import Disk, EvictionRule
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.keys import group_keys, prefix_block_hashes
from reference.knobs import BlocksPerChunk, Chunking, resolve
from reference.prefix_structure import PrefixStructure
from vllm_adapter.disk import budget as DB

NS = "kvchunk-v2-test"
FILE = 1000


def _chunking() -> Chunking:
    """Full attention (32-token chunks) and a 24-token window: a boundary needs the window's
    last chunk."""
    groups = (KVGroup(0, GroupKind.FULL, 16),
              KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=24))
    return resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(2))


CHUNKING = _chunking()


class Engine:
    """A tier's use of the ledger, with files written for real (``FILE`` bytes per key)."""

    def __init__(self, root: Path, budget: int, rule: EvictionRule = EvictionRule.REACHABLE):
        self.root = root
        self.ledger = DB.RootLedger(str(root), budget, rule, reserve=0)
        self.ledger.set_chunking(NS, CHUNKING)

    def store(self, tokens: Sequence[int], upto_chunk: int | None = None,
              ok: bool = True) -> list[tuple[str, tuple[bytes, ...]]] | None:
        """Store the request's keys (one packed file), as a store job would."""
        chain = prefix_block_hashes(list(tokens), CHUNKING.tokens_per_hash)
        positions = {}
        for gc in CHUNKING.groups:
            for i, key in enumerate(group_keys(chain, gc)):
                positions[key] = (i + 1) * gc.tokens_per_chunk
        keys = [k for k, end in sorted(positions.items(), key=lambda kv: kv[1])
                if upto_chunk is None or end <= upto_chunk * 32]
        out = self.ledger.reserve(NS, [keys], lambda ks: f"{NS}/{ks[0].hex()[:16]}.kvp",
                                  lambda ks: FILE * len(ks), positions)
        if out is None:
            return None
        for path, ks in out:
            if ok:
                (self.root / path).parent.mkdir(parents=True, exist_ok=True)
                (self.root / path).write_bytes(b"\0" * (FILE * len(ks)))
        self.ledger.complete([(p, ok) for p, _ in out])
        return out


def _on_disk(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in (root / NS).rglob("*.kvp")}


def _stranded(root: Path, ledger: DB.RootLedger, chains: list[list[bytes]]) -> frozenset[bytes]:
    """Keys on disk that no lookup can load, judged by the reference from whole chains."""
    structure = PrefixStructure(CHUNKING)
    for chain in chains:
        structure.observe(chain)
    disk = Disk(structure)
    space = ledger._space(NS)
    on_disk = _on_disk(root)
    for fid, f in space.disk.files.items():
        if space.path_of[fid] in on_disk and f.ready:
            disk.add(f.keys, f.nbytes, ready=True)
    return disk.stranded()


# ---------------------------------------------------------------------------
# The value of disk_bytes_to_use
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "lots", "1e12", "800 gigabytes", -1, 0, True, 1.5, 10, 1 << 80])
def test_a_bad_disk_bytes_to_use_is_a_value_error_naming_the_key_and_a_value(
    value: object, tmp_path: Path
) -> None:
    with pytest.raises(ValueError) as err:
        DB.parse_disk_bytes(value, str(tmp_path), "the tier", min_bytes=4096 * 2)
    msg = str(err.value)
    assert "'disk_bytes_to_use'" in msg and "e.g. " in msg, msg
    suggested = int(msg.split("e.g. ")[1].split(" ")[0])
    assert DB.parse_disk_bytes(suggested, str(tmp_path), "x", min_bytes=4096 * 2) == suggested


def test_a_good_disk_bytes_to_use_is_taken_as_bytes(tmp_path: Path) -> None:
    assert DB.parse_disk_bytes(1 << 20, str(tmp_path), "x") == 1 << 20
    assert DB.parse_disk_bytes("1048576", str(tmp_path), "x") == 1 << 20


# ---------------------------------------------------------------------------
# One budget per root
# ---------------------------------------------------------------------------


def test_two_engines_share_one_budget_and_evict_each_others_files(tmp_path: Path) -> None:
    """Mooncake #2419 was a quota per instance: none ever evicted.  Here engine B's store
    evicts engine A's least recently used file, and the root never holds more than the
    budget."""
    budget = 3 * 4 * FILE  # three 4-key files (2 full chunks + 2 window chunks each)
    a, b = Engine(tmp_path, budget), Engine(tmp_path, budget)
    first = a.store(range(0, 64))
    a.store(range(1000, 1064))
    a.store(range(2000, 2064))
    assert first is not None and sum(_on_disk(tmp_path).values()) == budget
    got = b.store(range(3000, 3064))
    assert got is not None, "engine B's store was refused although A's files could go"
    on_disk = _on_disk(tmp_path)
    assert first[0][0] not in on_disk, f"A's least recently used file stayed: {sorted(on_disk)}"
    assert sum(on_disk.values()) <= budget
    for e in (a, b):
        e.ledger.removed_since([])  # replays what the other appended
    assert set(a.ledger.files(NS)) == set(b.ledger.files(NS)) == set(on_disk)


def test_a_store_that_cannot_fit_is_refused_and_leaves_no_trace(tmp_path: Path) -> None:
    a = Engine(tmp_path, 2 * FILE)
    assert a.store(range(0, 64)) is None
    assert _on_disk(tmp_path) == {} and a.ledger.files() == {}
    assert a.ledger.counters.stores_refused == 1


def test_a_key_whose_parent_is_not_on_the_root_is_not_admitted(tmp_path: Path) -> None:
    """The second chunk without the first would be stranded on arrival: the rule leaves
    it out of the file (plain LRU admits it)."""
    chain = prefix_block_hashes(list(range(64)), 16)
    full = group_keys(chain, CHUNKING.groups[0])
    for rule, admitted in ((EvictionRule.REACHABLE, False), (EvictionRule.LRU, True)):
        root = tmp_path / rule.value
        root.mkdir()
        e = Engine(root, 100 * FILE, rule)
        out = e.ledger.reserve(NS, [[full[1]]], lambda ks: f"{NS}/x.kvp", lambda ks: FILE,
                               {full[0]: 32, full[1]: 64})
        assert out is not None and (len(out) == 1) is admitted, (rule, out)


def _chunk_keys(tokens: Sequence[int]) -> tuple[list[list[bytes]], dict[bytes, int]]:
    """Each chunk's keys (its full-attention key, then its window key) and every key's end
    token."""
    chain = prefix_block_hashes(list(tokens), CHUNKING.tokens_per_hash)
    full, window = (group_keys(chain, gc) for gc in CHUNKING.groups)
    positions = {k: 32 * (i + 1) for keys in (full, window) for i, k in enumerate(keys)}
    return [[f, w] for f, w in zip(full, window, strict=True)], positions


def test_a_failed_store_takes_the_files_it_strands(tmp_path: Path) -> None:
    """Chunk 0 is written; chunk 1's file is reserved, and chunk 2's file, admitted because
    its parent (chunk 1) is reserved, is written; then chunk 1's write fails.  Chunk 2's
    file is stranded (no lookup reaches it without chunk 1): it leaves the ledger and the
    directory.  Chunk 0's file and another prompt's file stay."""
    e = Engine(tmp_path, 100 * FILE)
    tokens = list(range(96))
    chunks, positions = _chunk_keys(tokens)
    other = e.store(range(5000, 5064))
    assert other is not None and len(other) == 1
    names = {}

    def reserve(i: int) -> str:
        out = e.ledger.reserve(NS, [chunks[i]], lambda ks: f"{NS}/chunk{i}.kvp",
                               lambda ks: FILE * len(ks), positions)
        assert out == [(f"{NS}/chunk{i}.kvp", tuple(chunks[i]))], f"chunk {i}: {out}"
        names[i] = out[0][0]
        return names[i]

    def write(path: str) -> None:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(b"\0" * (2 * FILE))

    write(reserve(0))
    assert e.ledger.complete([(names[0], True)]) == []
    reserve(1)  # pending: its write fails below
    write(reserve(2))
    assert e.ledger.complete([(names[2], True)]) == []
    assert e.ledger.files(NS) == {other[0][0]: True, names[0]: True, names[1]: False,
                                  names[2]: True}
    gone = e.ledger.complete([(names[1], False)])
    assert names[2] in gone and set(gone) <= {names[1], names[2]}, gone
    assert e.ledger.files(NS) == {other[0][0]: True, names[0]: True}
    assert set(_on_disk(tmp_path)) == {other[0][0], names[0]}
    fresh = Engine(tmp_path, 100 * FILE).ledger  # what the journal says
    fresh.removed_since([])
    assert fresh.files(NS) == e.ledger.files(NS)
    chains = [prefix_block_hashes(list(t), 16) for t in (tokens, range(5000, 5064))]
    assert not _stranded(tmp_path, e.ledger, chains)


# ---------------------------------------------------------------------------
# The invariant, over any sequence
# ---------------------------------------------------------------------------

OPS = st.lists(
    st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(["store", "fail", "touch"]),
              st.integers(0, 5), st.integers(1, 4)),
    min_size=1, max_size=25,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, files_in_budget=st.integers(2, 8))
def test_after_any_stores_reads_and_failures_nothing_on_the_root_is_stranded(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, str, int, int]],
    files_in_budget: int,
) -> None:
    """Two engines, six prompts sharing prefixes (prompt p is prompt 0's first 32*(p+1)
    tokens then its own), random stores (up to a chunk), failed stores and reads: after
    each step the root holds at most the budget, the two engines' ledgers agree, and the
    reference finds no key on disk stranded."""
    root = tmp_path_factory.mktemp("root")
    budget = files_in_budget * 2 * FILE
    engines = {"a": Engine(root, budget), "b": Engine(root, budget)}
    base = list(range(10_000, 10_000 + 32 * 6))
    prompts = [base[: 32 * (p + 1)] + list(range(1000 * p, 1000 * p + 96)) for p in range(6)]
    chains = [prefix_block_hashes(p, 16) for p in prompts]
    for who, op, p, upto in ops:
        e = engines[who]
        if op == "touch":
            e.ledger.touch(list(e.ledger.files(NS))[:1])
        else:
            e.store(prompts[p], upto_chunk=upto + p, ok=op == "store")
        on_disk = _on_disk(root)
        assert sum(on_disk.values()) <= budget, f"{sum(on_disk.values())} > {budget} after {who} {op}"
        assert not _stranded(root, e.ledger, chains), f"stranded after {who} {op} {p}"
        other = engines["b" if who == "a" else "a"]
        other.ledger.removed_since([])
        assert other.ledger.files(NS) == e.ledger.files(NS)
        assert set(on_disk) == set(e.ledger.files(NS))


# ---------------------------------------------------------------------------
# Crashes and restarts
# ---------------------------------------------------------------------------


def test_a_dead_writers_reservation_and_orphans_are_removed_at_start(tmp_path: Path) -> None:
    """A writer killed after reserving (its file half written) and a file no ledger names:
    the next tier's start removes both and frees the bytes."""
    repo, root = str(Path(__file__).resolve().parents[1]), str(tmp_path)
    child = "\n".join([
        f"import sys; sys.path.insert(0, {repo!r})",
        "from tests.test_disk_budget import Engine",
        "from reference.eviction import EvictionRule",
        "from pathlib import Path",
        f"e = Engine(Path({root!r}), 100 * 1000, EvictionRule.LRU)",
        f"ns = {NS!r}",
        "out = e.ledger.reserve(ns, [[b'k' * 36]], lambda ks: ns + '/dead.kvp', lambda ks: 1000)",
        "assert out, out",
        f"Path({root!r}, ns).mkdir(exist_ok=True); Path({root!r}, ns, 'dead.kvp').write_bytes(b'half')",
    ])
    subprocess.run([sys.executable, "-c", child], check=True)
    (tmp_path / NS / "orphan.kvp").write_bytes(b"x" * 10)
    e = Engine(tmp_path, 100 * FILE)
    report = e.ledger.start(NS, _on_disk(tmp_path))
    assert report["orphans"] == 1 and report["reclaimed"] == 1, report
    assert _on_disk(tmp_path) == {} and e.ledger.files() == {}, (_on_disk(tmp_path), report)


def test_a_restart_with_a_smaller_budget_evicts_before_serving(tmp_path: Path) -> None:
    e = Engine(tmp_path, 10 * 4 * FILE)
    for i in range(4):
        e.store(range(1000 * i, 1000 * i + 64))
    e.ledger.close()  # the restart: no engine runs on the old budget any more
    small = Engine(tmp_path, 2 * 4 * FILE)
    report = small.ledger.start(NS, _on_disk(tmp_path))
    assert report["evicted"] == 2 and sum(_on_disk(tmp_path).values()) <= 2 * 4 * FILE, report


def test_compaction_keeps_the_model(tmp_path: Path) -> None:
    """The journal is rewritten (a new file, the failed store's records gone) and replays to
    the same files in the same recency, which reads made differ from the order written."""
    e = Engine(tmp_path, 10 * 4 * FILE)
    written = []
    for i in range(6):
        out = e.store(range(1000 * i, 1000 * i + 64))
        assert out is not None
        written.append(out[0][0])
    failed = e.store(range(9000, 9064), ok=False)
    assert failed is not None and failed[0][0].encode() in (tmp_path / DB.LEDGER_FILE).read_bytes()
    e.ledger.touch(written[:2])  # read: now the most recently used
    e.ledger.removed_since([])  # (reads may be journaled at the next locked call)
    before = e.ledger.files()
    order = [e.ledger._spaces[NS].path_of[f] for f in e.ledger._spaces[NS].disk.lru_order()]
    assert order == written[2:] + written[:2] and set(before) == set(written), order
    other = Engine(tmp_path, 10 * 4 * FILE)
    inode = os.stat(tmp_path / DB.LEDGER_FILE).st_ino
    e.ledger.compact()
    journal = tmp_path / DB.LEDGER_FILE
    assert os.stat(journal).st_ino != inode, "compact() did not rewrite the journal"
    assert failed[0][0].encode() not in journal.read_bytes(), "the failed store's records stayed"
    other.ledger.removed_since([])
    for ledger in (e.ledger, other.ledger):
        space = ledger._spaces[NS]
        assert ledger.files() == before
        assert [space.path_of[f] for f in space.disk.lru_order()] == order


def test_a_child_is_not_admitted_before_its_refused_parent_whatever_the_key_order(
    tmp_path: Path,
) -> None:
    """vLLM 0.33 hands a store job's keys as a set: chunk 2 may come before chunk 1.  With
    chunk 0 absent, neither may be admitted (chunk 2 would be stranded on arrival)."""
    full = group_keys(prefix_block_hashes(list(range(96)), 16), CHUNKING.groups[0])
    positions = {k: 32 * (i + 1) for i, k in enumerate(full)}
    for order in ([full[2], full[1]], [full[1], full[2]]):
        root = tmp_path / order[0].hex()[:8]
        root.mkdir()
        e = Engine(root, 100 * FILE)
        out = e.ledger.reserve(NS, [order], lambda ks: f"{NS}/x.kvp", lambda ks: FILE * len(ks),
                               positions)
        assert out == [], f"keys in order {[full.index(k) for k in order]} admitted: {out}"


def test_a_window_chunk_whose_earlier_sibling_never_comes_is_not_admitted(tmp_path: Path) -> None:
    """A key set with gaps, as vLLM's CPU-to-disk cascade offers one (#31): it carries only
    the chunks the CPU tier newly stored, so a window chunk the CPU tier still holds never
    reaches the disk.  A 64-token window of 32-token chunks: a hit at the prompt's last
    boundary (chunk 3) needs window chunks 2 and 3.  Chunk 2's window key is not on the
    root and ends before the store's last key: it will never come, so chunk 3's window key
    could never serve a hit.  Once the stores completed (nothing in flight), nothing on
    the root is stranded, by the ledger's own count and by the reference over the whole
    chain, and chunk 3's full-attention key (whose prefix is whole) is kept."""
    groups = (KVGroup(0, GroupKind.FULL, 16),
              KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=64))
    chunking = resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(2))
    assert chunking.groups[1].window_in_chunks == 2, chunking.groups[1]
    ledger = DB.RootLedger(str(tmp_path), 100 * FILE, EvictionRule.REACHABLE, reserve=0)
    ledger.set_chunking(NS, chunking)
    chain = prefix_block_hashes(list(range(128)), 16)
    full, window = (group_keys(chain, gc) for gc in chunking.groups)
    positions = {k: 32 * (i + 1) for keys in (full, window) for i, k in enumerate(keys)}

    def store(keys: list[bytes], name: str) -> set[bytes]:
        out = ledger.reserve(NS, [keys], lambda ks: f"{NS}/{name}.kvp",
                             lambda ks: FILE * len(ks), positions)
        assert out is not None, f"{name}: refused"
        for path, ks in out:
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_bytes(b"\0" * (FILE * len(ks)))
        ledger.complete([(p, True) for p, _ in out])
        return {k for _, ks in out for k in ks}

    # the first turn's cascade: chunks 0-2, but chunk 2's window key stays in the CPU tier
    store([full[0], window[0], full[1], window[1], full[2]], "first")
    # the next step's cascade: chunk 3's keys only (chunk 2's window key is not new there)
    admitted = store([full[3], window[3]], "next")
    assert full[3] in admitted, "a full-attention key whose prefix is on the root was left out"
    assert ledger.stranded_bytes() == 0, ledger.files(NS)
    structure = PrefixStructure(chunking)
    structure.observe(chain)
    disk = Disk(structure)
    space = ledger._space(NS)
    for f in space.disk.files.values():
        disk.add(f.keys, f.nbytes, ready=True)
    assert not disk.stranded(), "the reference finds keys on the root that no lookup can load"
