"""A packed store job split across the I/O pool (issue #30 item 1, :mod:`vllm_adapter.disk.packed_split`).

The sub-tasks are driven as vLLM's pool drives them (each task run, an exception
recorded per task, the job failed if any task raised), in any order and on threads,
over a real root ledger (:class:`~vllm_adapter.disk.tier_budget.TierBudget`) and the
tier's file I/O object, wired as :class:`~vllm_adapter.disk.tier.KvchunkFileTierManager`
wires them.  No vLLM needed.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference import packed as RP
from reference.eviction import EvictionRule
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.keys import group_keys, prefix_block_hashes
from reference.knobs import BlocksPerChunk, Chunking, resolve
from vllm_adapter.disk import chunk_file as C
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk.fileio import TierFileIO
from vllm_adapter.disk.packed_split import MAX_PARTS, Part, SplitStore, part_count, split_parts
from vllm_adapter.disk.tier_budget import StoreRefused, TierBudget, reserve_files

NS = bytes(range(16))
ROW = 2 * RP.PAGE


def _chunking() -> Chunking:
    """Full attention and a window group: a job's keys make two files."""
    groups = (KVGroup(0, GroupKind.FULL, 16),
              KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=24))
    return resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(2))


CHUNKING = _chunking()


class Probe(TierFileIO):
    """The tier's file I/O; ``fail`` names the call (and its number, from 0) that raises."""

    def __init__(self, fail: tuple[str, int] | None = None) -> None:
        self.fail = fail
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self._lock:
            n = self.calls.get(name, 0)
            self.calls[name] = n + 1
        if self.fail == (name, n):
            raise OSError(5, f"injected: {name} #{n}")

    def open_packed(self, *args: Any) -> Any:
        self._count("open_packed")
        return super().open_packed(*args)

    def store_packed_part(self, *args: Any) -> list[bytes]:
        self._count("store_packed_part")
        return super().store_packed_part(*args)

    def finish_packed(self, *args: Any) -> Any:
        self._count("finish_packed")
        return super().finish_packed(*args)


class Job:
    """One store job of a request's keys (both groups), the tier's wiring of a
    :class:`SplitStore` over a root ledger."""

    def __init__(self, root: Path, chunks: int = 7, budget: int = 1 << 30,
                 fsync: bool = False) -> None:
        self.root = root
        self.ns_dir = root / "kvchunk-v2-test"
        self.ns_dir.mkdir(parents=True, exist_ok=True)
        self.budget = TierBudget(str(root), str(self.ns_dir), budget, EvictionRule.LRU,
                                 CHUNKING)
        chain = prefix_block_hashes(list(range(32 * chunks)), CHUNKING.tokens_per_hash)
        self.positions: dict[bytes, int] = {}
        for gc in CHUNKING.groups:
            for i, key in enumerate(group_keys(chain, gc)):
                self.positions[key] = (i + 1) * gc.tokens_per_chunk
        keys = sorted(self.positions, key=lambda k: (P.group_of_key(k), self.positions[k]))
        self.keys = keys
        self.files = [list(f) for f in RP.store_job_files(keys, CHUNKING.full_groups)]
        rng = random.Random(len(keys))
        self.data = bytearray(rng.randbytes(len(keys) * ROW))
        self.offset_of = {k: i * ROW for i, k in enumerate(keys)}
        self.io = C.ChunkIO(namespace=NS, counters=C.TierCounters(), fsync=fsync)
        self.indexed: dict[str, P.PackedHeader] = {}
        self.failures: list[BaseException] = []

    def name_of(self, keys: Sequence[bytes]) -> str:
        return P.packed_name(str(self.ns_dir), keys)

    def split(self, n: int, file_io: TierFileIO) -> SplitStore:
        def size_of(ks: Sequence[bytes]) -> int:
            return RP.packed_file_bytes([ROW] * len(ks), [len(k) for k in ks])

        return SplitStore(
            n, reserve=lambda: reserve_files(self.budget, self.files, self.name_of, size_of,
                                             self.positions),
            complete=self.budget.complete, written=self.indexed.__setitem__,
            failed=self.failures.append, file_io=file_io, io=self.io,
            view=memoryview(self.data), offset_of=self.offset_of, size=ROW,
        )

    def one_task_files(self, where: Path) -> dict[str, bytes]:
        """The job's files as the one-task store writes them (``store_packed``), by name."""
        out = {}
        for keys in self.files:
            path = P.packed_name(str(where), keys)
            P.store_packed(path, keys, C.slices(memoryview(self.data),
                                                [self.offset_of[k] for k in keys], ROW),
                           self.io)
            out[os.path.basename(path)] = Path(path).read_bytes()
        return out

    def on_disk(self) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in self.ns_dir.rglob("*.kvp")}

    def temps(self) -> list[Path]:
        return list(self.root.rglob(f"*{C.TEMP_SUFFIX}"))


def run_as_pool(tasks: Sequence[Callable[[], None]], order: Sequence[int]) -> list[BaseException]:
    """Run a job's tasks in ``order`` as vLLM's pool does; the exceptions the tasks raised."""
    raised: list[BaseException] = []
    for i in order:
        try:
            tasks[i]()
        except Exception as exc:
            raised.append(exc)
    return raised


def run_on_threads(tasks: Sequence[Callable[[], None]]) -> list[BaseException]:
    """Every task on its own thread, all started together."""
    raised: list[BaseException] = []
    start = threading.Barrier(len(tasks))

    def run(task: Callable[[], None]) -> None:
        start.wait()
        try:
            task()
        except Exception as exc:
            raised.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in tasks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return raised


# ---------------------------------------------------------------------------
# How a job is cut
# ---------------------------------------------------------------------------


@given(st.lists(st.lists(st.integers(1, 5 * RP.PAGE), max_size=40), min_size=1, max_size=2),
       st.integers(1, 9))
def test_the_parts_cover_every_section_once_in_file_order(
    lengths: list[list[int]], n: int
) -> None:
    parts = split_parts(lengths, n)
    assert len(parts) == n
    flat = [(p.file, s) for ps in parts for p in ps for s in range(p.first, p.stop)]
    assert flat == [(f, s) for f, file_ in enumerate(lengths) for s in range(len(file_))]
    for ps in parts:  # one range per file a part spans, each non-empty
        assert all(p.stop > p.first for p in ps)
        assert len({p.file for p in ps}) == len(ps)


def test_equal_sections_are_cut_into_equal_parts() -> None:
    parts = split_parts([[ROW] * 6, [ROW] * 2], 4)
    assert parts == [[Part(0, 0, 2)], [Part(0, 2, 4)], [Part(0, 4, 6)], [Part(1, 0, 2)]]
    assert split_parts([[ROW] * 2], 4) == [[Part(0, 0, 1)], [], [Part(0, 1, 2)], []]


def test_a_job_is_split_only_above_the_part_size_and_at_most_the_pool_threads() -> None:
    mib = 1 << 20
    assert part_count(0, 32) == 1
    assert part_count(15 * mib, 32, 8 * mib) == 1
    assert part_count(16 * mib, 32, 8 * mib) == 2
    assert part_count(1 << 40, 32, 8 * mib) == MAX_PARTS
    assert part_count(1 << 40, 3, 8 * mib) == 3


# ---------------------------------------------------------------------------
# A split store
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n,order", [
    (2, "forward"), (3, "reverse"), (5, "shuffled"), (8, "reverse"), (20, "shuffled"),
])
def test_a_split_store_writes_the_bytes_of_the_one_task_store_in_any_order(
    tmp_path: Path, n: int, order: str
) -> None:
    job = Job(tmp_path / "root")
    expected = job.one_task_files(tmp_path / "one")
    assert len(expected) == 2, "the job should write a full-attention and a window file"
    store = job.split(n, Probe())
    ids = list(range(n))
    if order == "reverse":
        ids.reverse()
    elif order == "shuffled":
        random.Random(n).shuffle(ids)
    assert run_as_pool(store.tasks, ids) == []
    assert job.on_disk() == expected
    assert not job.temps() and not job.failures
    model = job.budget.ledger.model()
    assert sorted(os.path.basename(p) for p in model) == sorted(expected)
    assert all(written for _, _, _, written, _ in model.values())
    for path, header in job.indexed.items():  # the index gets the file as written
        assert header == P.read_packed_index(path, NS, C.CHECKSUM)


@pytest.mark.parametrize("fsync", [False, True])
def test_split_stores_on_threads_write_the_one_task_bytes(tmp_path: Path, fsync: bool) -> None:
    job = Job(tmp_path / "root", chunks=9, fsync=fsync)
    expected = job.one_task_files(tmp_path / "one")
    assert run_on_threads(job.split(6, Probe()).tasks) == []
    assert job.on_disk() == expected and not job.temps()


@pytest.mark.parametrize("fail", [
    ("store_packed_part", 0), ("store_packed_part", 3), ("open_packed", 1),
    ("finish_packed", 0), ("finish_packed", 1),
])
@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_a_failed_part_fails_the_store_once_and_leaves_no_temporary_file(
    tmp_path: Path, fail: tuple[str, int], order: str
) -> None:
    """One sub-task's I/O fails: exactly one task raises (the job fails once, the tier
    counts one failure), no temporary file is left, the failed file is not on disk and
    the ledger holds no pending reservation and not the failed file."""
    job = Job(tmp_path / "root")
    probe = Probe(fail)
    store = job.split(4, probe)
    ids = list(range(4))[:: 1 if order == "forward" else -1]
    raised = run_as_pool(store.tasks, ids)
    assert len(raised) == 1 and "injected" in str(raised[0]), raised
    assert job.failures == raised
    assert not job.temps(), job.temps()
    model = job.budget.ledger.model()
    assert all(written for _, _, _, written, _ in model.values()), "a reservation is pending"
    assert not job.budget.ledger._mine, "a reservation of this ledger is not completed"
    on_disk = job.on_disk()
    assert len(on_disk) < 2 and sorted(os.path.basename(p) for p in model) == sorted(on_disk)
    assert sorted(os.path.basename(p) for p in job.indexed) == sorted(on_disk)


def test_a_refused_store_writes_nothing_and_fails_once(tmp_path: Path) -> None:
    job = Job(tmp_path / "root", budget=64 << 10)  # far less than the job's files
    probe = Probe()
    raised = run_as_pool(job.split(4, probe).tasks, [3, 2, 1, 0])
    assert len(raised) == 1 and isinstance(raised[0], StoreRefused)
    assert job.failures == raised
    assert probe.calls == {}, "a refused store touched a file"
    assert not job.on_disk() and not job.temps() and not job.budget.ledger.model()


def test_only_the_first_sub_task_reserves(tmp_path: Path) -> None:
    job = Job(tmp_path / "root")
    reserved: list[int] = []
    store = job.split(5, Probe())
    real = store._reserve

    def reserve() -> Any:
        reserved.append(1)
        return real()

    store._reserve = reserve
    assert run_on_threads(store.tasks) == []
    assert reserved == [1]
