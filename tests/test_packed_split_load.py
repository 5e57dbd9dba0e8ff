"""A packed load job split across the I/O pool (issue #30 item 1): the rule and the tier.

The rule is :mod:`reference.packed_split`'s (how many parts, where a job is cut, a split
load's slices and hence its opens and reads); :mod:`reference.layout_economics` counts
split loads with it, and the tier (:mod:`vllm_adapter.disk.packed_split`) slices its load
jobs with it.  The tier's side is driven as vLLM's pool drives a job's tasks (each run,
an exception recorded per task), forward, reversed, shuffled and on threads, over a
packed index and the tier's file I/O object, wired as
:class:`~vllm_adapter.disk.tier.KvchunkFileTierManager` wires them.  No vLLM needed.
"""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from reference import packed as RP
from reference import packed_split as RS
from reference.keys import make_key
from reference.layout_economics import LayoutTally, PackedLoads, _PackedFiles
from vllm_adapter.disk import chunk_file as C
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk import packed_io as PIO
from vllm_adapter.disk import packed_split as TS
from vllm_adapter.disk.fileio import TierFileIO

NS = bytes(range(16))
ROW = 2 * RP.PAGE
MIB = 1 << 20


# ---------------------------------------------------------------------------
# The rule (reference.packed_split)
# ---------------------------------------------------------------------------


def test_the_tier_takes_the_part_size_and_the_cut_from_the_reference() -> None:
    """One fact in one place: the store split's sizes are the reference's objects."""
    assert TS.PART_BYTES is RS.PART_BYTES and TS.MAX_PARTS is RS.MAX_PARTS
    assert TS.part_count is RS.part_count


def test_a_job_below_twice_the_part_size_stays_one_task() -> None:
    assert RS.part_count(0, 32) == 1
    assert RS.part_count(2 * RS.PART_BYTES - 1, 32) == 1
    assert RS.part_count(2 * RS.PART_BYTES, 32) == 2
    assert RS.part_count(1 << 40, 32) == RS.MAX_PARTS
    assert RS.part_count(1 << 40, 3) == 3
    assert RS.part_count(1 << 40, 0) == 1


def test_cut_gives_contiguous_parts_of_about_equal_bytes() -> None:
    assert RS.cut([4] * 8, 4) == (0, 0, 1, 1, 2, 2, 3, 3)
    assert RS.cut([4] * 2, 4) == (0, 2)
    assert RS.cut([30, 1, 1, 1, 1], 2) == (0, 1, 1, 1, 1)
    assert RS.cut([], 3) == ()
    with pytest.raises(ValueError):
        RS.cut([1], 0)


def _wanted(files: Sequence[Sequence[tuple[int, int]]]) -> list[tuple[int, int, int]]:
    """A load job's wanted sections: ``files[f]`` the ``(position, bytes)`` of file ``f``'s."""
    return [(f, p, b) for f, file_ in enumerate(files) for p, b in file_]


def test_a_large_job_of_one_file_is_cut_into_runs_of_part_bytes() -> None:
    """32 sections of 2 MiB (64 MiB) with 8 threads: 8 slices of 4 adjacent sections,
    so 8 opens and 8 reads (one task: 1 and 1)."""
    sections = _wanted([[(p, 2 * MIB) for p in range(32)]])
    slices = RS.load_slices(sections, RS.LoadSplit(threads=8))
    assert slices == tuple(((0, tuple(range(4 * i, 4 * i + 4))),) for i in range(8))
    assert RS.load_counts(slices) == (8, 8)
    assert RS.load_counts(RS.load_slices(sections, None)) == (1, 1)
    assert RS.load_counts(RS.load_slices(sections, RS.LoadSplit(threads=2))) == (2, 2)
    small = _wanted([[(p, 2 * MIB) for p in range(7)]])  # 14 MiB < 16 MiB: one task
    assert RS.load_slices(small, RS.LoadSplit(threads=8)) == (((0, tuple(range(7))),),)


def test_a_slice_opens_each_file_it_touches_and_reads_each_run_in_it() -> None:
    """Two files of 1 MiB sections, file 0's wanted at positions 3, 0, 1, 2 (read in
    position order) and file 1's at 0, 1 (read first: its positions sort before file 0's),
    cut in two: the first slice reads file 1's 0-1 and file 0's 0 (two opens, two reads),
    the second file 0's 1-3 (one open, one read): the cut falls inside file 0's run, so 3
    opens and 3 reads where one task makes 2 and 2."""
    files = _wanted([[(3, MIB), (0, MIB), (1, MIB), (2, MIB)], [(0, MIB), (1, MIB)]])
    split = RS.LoadSplit(threads=2, part_bytes=MIB)
    slices = RS.load_slices(files, split)
    assert slices == (((1, (0, 1)), (0, (0,))), ((0, (1, 2, 3)),))
    assert RS.load_counts(slices) == (3, 3)
    assert RS.load_counts(RS.load_slices(files, None)) == (2, 2)


def test_files_are_taken_in_a_canonical_order() -> None:
    """Not the order the job names its keys (0.33.0 hands sets), nor the keys' hashes (the
    reference's are not vLLM's): by the positions and bytes wanted of each file.  File
    "a" wants positions 0-2, "b" position 0 only: "a" sorts after "b" ((0, 1) < (0, 1),
    then "b" has no more), so "b" is read first and the cut falls in "a"."""
    wanted = [("a", 2, MIB), ("a", 1, MIB), ("b", 0, MIB), ("a", 0, MIB)]
    split = RS.LoadSplit(threads=2, part_bytes=MIB)
    assert RS.load_slices(wanted, split) == ((("b", (0,)), ("a", (0,))), (("a", (1, 2)),))
    assert RS.load_slices(wanted[::-1], split) == RS.load_slices(wanted, split)


sections_of_files = st.lists(
    st.dictionaries(st.integers(0, 40), st.integers(1, 5 * RP.PAGE), min_size=1, max_size=12),
    min_size=1, max_size=4,
)


@given(sections_of_files, st.integers(1, 12), st.integers(1, 64 * RP.PAGE),
       st.integers(1, 10), st.randoms())
def test_slices_cover_every_wanted_section_once_in_read_order(
    files: list[dict[int, int]], threads: int, part_bytes: int, max_parts: int,
    rng: random.Random,
) -> None:
    split = RS.LoadSplit(threads, part_bytes, max_parts)
    wanted = _wanted([list(f.items()) for f in files])
    slices = RS.load_slices(wanted, split)
    flat = [(f, p) for s in slices for f, ps in s for p in ps]
    order = list(dict.fromkeys(f for f, _ in flat))  # file after file, each in position order
    assert sorted(order) == list(range(len(files)))
    assert flat == [(f, p) for f in order for p in sorted(files[f])]
    assert order == sorted(order, key=lambda f: sorted(files[f].items()))
    total = sum(RP.page_round(b) for f in files for b in f.values())
    n = RS.part_count(total, threads, part_bytes, max_parts)
    assert 1 <= len(slices) <= n
    for s in slices:  # each file a slice touches once, none empty
        assert len({f for f, _ in s}) == len(s) and all(ps for _, ps in s)
    one = RS.load_counts(RS.load_slices(wanted, None))
    assert one == (len(files), sum(RP.read_runs(f) for f in files))
    opens, reads = RS.load_counts(slices)
    assert one[0] <= opens <= one[0] + len(slices) - 1
    assert one[1] <= reads <= one[1] + len(slices) - 1  # a cut splits at most one run
    shuffled = list(wanted)
    rng.shuffle(shuffled)  # files that tie may swap: the counts may not change
    assert RS.load_counts(RS.load_slices(shuffled, split)) == (opens, reads), "order mattered"


def test_the_economics_count_a_split_load_by_the_rule() -> None:
    """:mod:`reference.layout_economics`' packed files: one file of 12 sections of 4 MiB
    (group 0) loaded whole; unsplit 1 open and 1 read, split (4 threads, 8 MiB parts) the
    rule's 4 and 4, each open recording the sections it reads."""
    keys = [make_key(bytes([i]) * 32, 0) for i in range(12)]

    def tally(loads: PackedLoads | None) -> LayoutTally:
        files, t = _PackedFiles(loads), LayoutTally()
        assert files.write(keys, t)
        files.read(keys, t, keys)
        return t

    one = tally(None)
    assert (sum(one.opened.values()), one.reads) == (1, 1)
    split = tally(PackedLoads(RS.LoadSplit(threads=4), {0: 4 * MIB}))
    want = RS.load_slices(_wanted([[(p, 4 * MIB) for p in range(12)]]), RS.LoadSplit(threads=4))
    assert (sum(split.opened.values()), split.reads) == RS.load_counts(want) == (4, 4)
    assert (sum(split.opened_once.values()), split.reads_once) == (4, 4)
    assert sorted(len(s) for (s, _), n in split.opened.items() for _ in range(n)) == [3] * 4


# ---------------------------------------------------------------------------
# The tier's split load (vllm_adapter.disk.packed_split.SplitLoad)
# ---------------------------------------------------------------------------


def _key(n: int, group: int = 0) -> bytes:
    return n.to_bytes(32, "big") + group.to_bytes(4, "big")


class ReadProbe(TierFileIO):
    """The tier's file I/O: every read of a packed file recorded (path, offset, bytes);
    ``fail``: the read number (from 0) that raises ``EIO``."""

    def __init__(self, fail: int | None = None) -> None:
        self.reads: list[tuple[str, int, int]] = []
        self.fail = fail
        self._lock = threading.Lock()

    def preadv(self, fd: int, buffers: list[Any], offset: int) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
        with self._lock:
            n = len(self.reads)
            self.reads.append((path, offset, sum(len(memoryview(b)) for b in buffers)))
        if n == self.fail:
            raise OSError(5, "injected: read failed")
        return super().preadv(fd, buffers, offset)


class Tier:
    """The packed tier's file work: its index, its file I/O object, ``ROW``-byte rows."""

    def __init__(self, root: Path, file_io: TierFileIO | None = None) -> None:
        self.root = str(root)
        self.io = C.ChunkIO(namespace=NS, counters=C.TierCounters())
        self.file_io = file_io or ReadProbe()
        self.index = PIO.PackedIndex()

    def store(self, keys: list[bytes]) -> tuple[str, dict[bytes, bytes]]:
        data = os.urandom(len(keys) * ROW)
        path = P.packed_name(self.root, keys)
        header = self.file_io.store_packed(path, keys, memoryview(bytearray(data)),
                                           [i * ROW for i in range(len(keys))], ROW, self.io)
        self.index.add(path, header)
        return path, {k: data[i * ROW : (i + 1) * ROW] for i, k in enumerate(keys)}


def run_as_pool(tasks: Sequence[Callable[[], None]], order: str) -> list[BaseException]:
    """Run a job's tasks as vLLM's pool does (in ``order``: forward, reverse, shuffled,
    or each on its own thread); the exceptions they raised."""
    raised: list[BaseException] = []

    def run(task: Callable[[], None]) -> None:
        try:
            task()
        except Exception as exc:
            raised.append(exc)

    if order == "threads":
        start = threading.Barrier(len(tasks))
        threads = [threading.Thread(target=lambda t=t: (start.wait(), run(t))) for t in tasks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return raised
    ids = list(range(len(tasks)))
    if order == "reverse":
        ids.reverse()
    elif order == "shuffled":
        random.Random(len(tasks)).shuffle(ids)
    for i in ids:
        run(tasks[i])
    return raised


def split_load(tier: Tier, keys: Sequence[bytes], view: memoryview, split: RS.LoadSplit,
               order: str) -> tuple[list[BaseException], list[list[int]], list[Any]]:
    """One load job of ``keys`` split as the tier splits it (``LoadPlan``,
    ``load_job_slices``, ``SplitLoad``), run in ``order``: the exceptions its tasks
    raised, its slices (key places) and what ``end`` got (once)."""
    offsets = [i * ROW for i in range(len(keys))]
    plan = PIO.LoadPlan.of(tier.index, keys)
    assert plan is not None
    slices = TS.load_job_slices(plan, keys, split)
    ends: list[Any] = []

    def load(keys_: Sequence[Any], offsets_: Sequence[int]) -> None:
        tier.file_io.load_packed(tier.index, keys_, view, offsets_, ROW, tier.io, plan=plan)

    job = TS.SplitLoad(keys, offsets, slices, [plan.path_of[k] for k in keys],
                       begin=lambda: "rids", load=load, end=lambda b, e: ends.append((b, e)))
    return run_as_pool(job.tasks, order), slices, ends


def one_task_load(tier: Tier, keys: Sequence[bytes], view: memoryview) -> BaseException | None:
    try:
        tier.file_io.load_packed(tier.index, keys, view, [i * ROW for i in range(len(keys))],
                                 ROW, tier.io)
    except OSError as exc:
        return exc
    return None


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


A_KEYS = [_key(i) for i in range(10)]
B_KEYS = [_key(100 + i, 1) for i in range(6)]
SPLIT = RS.LoadSplit(threads=4, part_bytes=2 * ROW)
"""16 sections of 8 KiB with 16 KiB parts and 4 threads: 4 slices."""


@pytest.mark.parametrize("order", ["forward", "reverse", "shuffled", "threads"])
def test_a_split_load_fills_the_one_task_load_s_bytes_and_counts_the_rule_s_io(
    tmp_path: Path, order: str
) -> None:
    """Two files, the job's keys interleaved and one key of A left out (a gap: two runs):
    the split load's destination rows are the one-task load's, byte for byte; its opens
    and reads (the tier's counters, and the reads its file I/O object saw) are the rule's
    :func:`reference.packed_split.load_counts` of the slices it ran."""
    tier = Tier(tmp_path)
    a, a_data = tier.store(A_KEYS)
    b, b_data = tier.store(B_KEYS)
    data = a_data | b_data
    keys = [*A_KEYS[:3], B_KEYS[0], *A_KEYS[4:], *B_KEYS[1:]]
    one = memoryview(bytearray(len(keys) * ROW))
    assert one_task_load(tier, keys, one) is None
    assert one.tobytes() == b"".join(data[k] for k in keys)
    before = (tier.io.counters.files_opened, tier.io.counters.reads)
    assert before == (2, 3)
    fds = _open_fds()
    view = memoryview(bytearray(len(keys) * ROW))
    raised, slices, ends = split_load(tier, keys, view, SPLIT, order)
    assert raised == [] and ends == [("rids", None)]
    assert view.tobytes() == one.tobytes()
    assert len(slices) == 4 and sorted(i for s in slices for i in s) == list(range(len(keys)))
    rule = RS.load_slices(_wanted([[(p, ROW) for p in (0, 1, 2, 4, 5, 6, 7, 8, 9)],
                                   [(p, ROW) for p in range(6)]]), SPLIT)
    opens, reads = RS.load_counts(rule)
    assert (opens, reads) == (5, 6)
    counters = tier.io.counters
    assert (counters.files_opened - before[0], counters.reads - before[1]) == (opens, reads)
    assert len(tier.file_io.reads) == 3 + reads, "a read bypassed the file I/O object"
    assert counters.sections_loaded == 2 * len(keys) and not counters.bad_files
    assert _open_fds() == fds, "a split load left a file open"
    assert all(off >= RP.PAGE for _, off, _ in tier.file_io.reads), "a header was read"


@pytest.mark.parametrize("order", ["forward", "reverse", "threads"])
def test_a_flipped_payload_byte_fails_its_key_on_the_split_path(
    tmp_path: Path, order: str
) -> None:
    """One byte of A's section 7 flipped in place, the mtime put back (the identity
    matches: no header is read, only the checksum can catch it; **this fails if a slice
    skips the checksum**).  That key alone fails, once: one task raises, ``num_succeeded``
    is the keys before it in job order, ``failed_by_file`` names it (and B's none), it
    leaves the index, and every other row is loaded."""
    tier = Tier(tmp_path)
    a, a_data = tier.store(A_KEYS)
    b, b_data = tier.store(B_KEYS)
    st_ = os.stat(a)
    offset = RP.PAGE + 7 * ROW + 55
    fd = os.open(a, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, offset)[0] ^ 0x40]), offset)
    finally:
        os.close(fd)
    os.utime(a, ns=(st_.st_atime_ns, st_.st_mtime_ns))
    keys = [*B_KEYS, *A_KEYS]
    view = memoryview(bytearray(len(keys) * ROW))
    raised, slices, ends = split_load(tier, keys, view, SPLIT, order)
    assert len(slices) > 1 and len(raised) == 1 and len(ends) == 1 and ends[0][1] is raised[0]
    error = raised[0]
    assert error.failed_by_file == {b: [], a: [A_KEYS[7]]}
    assert error.num_succeeded == len(B_KEYS) + 7
    assert tier.io.counters.bad_files == {"checksum": 1}
    assert all(off >= RP.PAGE for _, off, _ in tier.file_io.reads), "a header was read"
    rows = {k: view[i * ROW : (i + 1) * ROW].tobytes() for i, k in enumerate(keys)}
    assert [rows[k] == a_data[k] for k in A_KEYS] == [i != 7 for i in range(10)]
    assert all(rows[k] == b_data[k] for k in B_KEYS)
    assert A_KEYS[7] not in tier.index and A_KEYS[6] in tier.index and os.path.exists(a)


@pytest.mark.parametrize("change", ["truncated", "grown"])
@pytest.mark.parametrize("order", ["forward", "reverse", "threads"])
def test_a_truncated_or_grown_file_fails_only_its_keys_on_the_split_path(
    tmp_path: Path, change: str, order: str
) -> None:
    """A's file shortened or grown by a page, its mtime put back (the size alone differs):
    the first slice to open it parses its header and finds the size wrong; every key of A
    fails (``size``), counted once, its header read once, the file discarded once and
    dropped from the index; the slices after it do not open it again; B loads."""
    tier = Tier(tmp_path)
    a, _ = tier.store(A_KEYS)
    b, b_data = tier.store(B_KEYS)
    st_ = os.stat(a)
    if change == "truncated":
        os.truncate(a, st_.st_size - RP.PAGE)
    else:
        with open(a, "ab") as f:
            f.write(bytes(RP.PAGE))
    os.utime(a, ns=(st_.st_atime_ns, st_.st_mtime_ns))
    keys = [*A_KEYS, *B_KEYS]
    view = memoryview(bytearray(len(keys) * ROW))
    fds = _open_fds()
    raised, slices, _ = split_load(tier, keys, view, SPLIT, order)
    assert len([s for s in slices if any(i < len(A_KEYS) for i in s)]) > 1, slices
    assert len(raised) == 1
    assert raised[0].failed_by_file == {a: A_KEYS, b: []} and raised[0].num_succeeded == 0
    counters = tier.io.counters
    assert counters.bad_files == {"size": 1} and counters.bad_files_removed == 1
    assert counters.files_opened == 1 + len([s for s in slices if any(i >= 10 for i in s)])
    assert [off for p, off, _ in tier.file_io.reads if off < RP.PAGE] == [0], "header reads"
    assert not os.path.exists(a) and not tier.index.has_file(a)
    assert not any(k in tier.index for k in A_KEYS) and all(k in tier.index for k in B_KEYS)
    rows = {k: view[i * ROW : (i + 1) * ROW].tobytes() for i, k in enumerate(keys)}
    assert all(rows[k] == b_data[k] for k in B_KEYS)
    assert _open_fds() == fds


def test_a_touched_file_is_parsed_once_and_its_entry_refreshed(tmp_path: Path) -> None:
    """Only A's mtime changed: the first slice that opens it parses its header (the same
    digest), the next ones check against that identity (no more header reads); every row
    loads and the index takes the new identity."""
    tier = Tier(tmp_path)
    a, a_data = tier.store(A_KEYS)
    st_ = os.stat(a)
    os.utime(a, ns=(st_.st_atime_ns, st_.st_mtime_ns - 10**9))
    view = memoryview(bytearray(len(A_KEYS) * ROW))
    raised, slices, _ = split_load(tier, A_KEYS, view, RS.LoadSplit(4, 2 * ROW), "forward")
    assert raised == [] and len(slices) == 4
    assert view.tobytes() == b"".join(a_data[k] for k in A_KEYS)
    assert [off for _, off, _ in tier.file_io.reads if off < RP.PAGE] == [0]
    identity = tier.index.identity(a)
    assert identity is not None and identity.matches(os.stat(a))


@pytest.mark.parametrize("fail", [0, 2])
def test_a_read_error_fails_the_job_once_and_leaves_nothing_open(
    tmp_path: Path, fail: int
) -> None:
    """A slice's read raises ``EIO`` (the file I/O object's ``preadv``): the job fails
    once (one task raises, ``end`` sees it), no file is left open, and the other slices
    still load their rows."""
    tier = Tier(tmp_path, ReadProbe(fail=fail))
    _, data = tier.store(A_KEYS)
    view = memoryview(bytearray(len(A_KEYS) * ROW))
    fds = _open_fds()
    raised, slices, ends = split_load(tier, A_KEYS, view, RS.LoadSplit(4, 2 * ROW), "forward")
    assert len(raised) == 1 and "injected" in str(raised[0]) and ends[0][1] is raised[0]
    assert _open_fds() == fds
    bad = set(slices[fail])
    assert raised[0].num_succeeded == min(bad)
    rows = [view[i * ROW : (i + 1) * ROW].tobytes() for i in range(len(A_KEYS))]
    assert all(rows[i] == data[k] for i, k in enumerate(A_KEYS) if i not in bad)


def test_a_job_whose_file_is_not_parsed_yet_is_not_split(tmp_path: Path) -> None:
    """A peer's file indexed by its keys alone (no sections): the job has no plan, so the
    tier loads it as one task (which parses the header)."""
    tier = Tier(tmp_path)
    a, _ = tier.store(A_KEYS)
    reader = Tier(tmp_path)
    reader.index.add_keys(a, A_KEYS)
    assert PIO.LoadPlan.of(reader.index, A_KEYS) is None
    assert PIO.LoadPlan.of(tier.index, A_KEYS) is not None
    assert PIO.LoadPlan.of(tier.index, [*A_KEYS, _key(999)]) is None


def test_the_split_path_reads_with_the_same_runs_the_rule_names(tmp_path: Path) -> None:
    """The reads the file I/O object saw, per slice: each is one run the rule's slices
    hold (offset and bytes of its adjacent sections), none other."""
    tier = Tier(tmp_path)
    a, _ = tier.store(A_KEYS)
    keys = [A_KEYS[i] for i in (9, 0, 1, 2, 3, 5, 6, 7)]
    view = memoryview(bytearray(len(keys) * ROW))
    raised, _, _ = split_load(tier, keys, view, RS.LoadSplit(3, 2 * ROW), "shuffled")
    assert raised == []
    rule = RS.load_slices(_wanted([[(p, ROW) for p in (9, 0, 1, 2, 3, 5, 6, 7)]]),
                          RS.LoadSplit(3, 2 * ROW))
    want: Counter[tuple[int, int]] = Counter()
    for s in rule:
        for _, ps in s:
            run: list[int] = []
            for p in [*ps, -2]:
                if run and p != run[-1] + 1:
                    want[(RP.PAGE + run[0] * ROW, len(run) * ROW)] += 1
                    run = []
                run.append(p)
    assert Counter((off, n) for _, off, n in tier.file_io.reads) == want


def test_the_budgeted_disk_counts_a_split_load_s_opens_by_the_rule() -> None:
    """:class:`reference.disk_economics.BudgetedIndex` (the eviction lane's model): a load
    job of one store job's keys (a full-attention file and a window file, 4 MiB sections)
    counts one file read per file unsplit and the rule's opens when split."""
    from reference.disk_economics import BudgetedIndex
    from reference.geometry import Geometry, GroupKind, KVGroup
    from reference.keys import group_keys, prefix_block_hashes
    from reference.knobs import BlocksPerChunk, resolve

    groups = (KVGroup(0, GroupKind.FULL, 16),
              KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=24))
    chunking = resolve(Geometry(groups, tokens_per_hash=16), BlocksPerChunk(2))
    chain = prefix_block_hashes(list(range(32 * 7)), chunking.tokens_per_hash)
    keys = [k for gc in chunking.groups for k in group_keys(chain, gc)]

    def files_read(split: RS.LoadSplit | None) -> tuple[int, list[tuple[int, int, int]]]:
        index = BudgetedIndex(chunking, 4 * MIB, 1 << 40, load_split=split)
        index.observe(chain)
        plan = index.prepare_store(keys)
        assert plan is not None
        index.complete_store(keys)
        stored = [k for k in keys if k in index.disk.file_of]
        index.prepare_load(stored)
        return index.files_read, [(index.disk.file_of[k], index._position[k], 4 * MIB)
                                  for k in stored]

    one, wanted = files_read(None)
    assert one == len({f for f, _, _ in wanted}) == 2
    split = RS.LoadSplit(threads=4)
    opens, _ = RS.load_counts(RS.load_slices(wanted, split))
    assert files_read(split)[0] == opens > one
