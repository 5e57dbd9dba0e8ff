"""Wall time of one packed store job and one load job: one task vs split across threads.

Issue #30 item 1 (queue depth inside a job): the store of one job's file as the tier's
one-task path writes it (:func:`vllm_adapter.disk.packed_file.store_packed`), and split
into ``n`` sub-tasks on ``n`` threads (:class:`vllm_adapter.disk.packed_split.SplitStore`,
over a real root ledger); the load of the job's keys as one task
(:func:`vllm_adapter.disk.packed_io.load_packed_files`) and split into ``n`` sub-tasks on
``n`` threads as the tier splits it (:class:`vllm_adapter.disk.packed_split.SplitLoad`: the
slices of :func:`reference.packed_split.load_slices` with ``n`` threads, each opening the
file and reading its run of sections, every section verified).  ``--profile`` prints where a one-task store's time goes (hashing, system
calls, the rest).  Usage::

    python scripts/bench_packed_split.py --dir /tmp/bench --sections 32 --row-kib 2048 \\
        --parts 1 2 4 8 --repeat 5 [--o-direct] [--fsync] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io as _io
import mmap
import os
import pstats
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from reference import packed as RP  # noqa: E402
from reference import packed_split as RS  # noqa: E402
from reference.eviction import EvictionRule  # noqa: E402
from reference.geometry import Geometry, GroupKind, KVGroup  # noqa: E402
from reference.knobs import BlocksPerChunk, resolve  # noqa: E402
from vllm_adapter.disk import chunk_file as C  # noqa: E402
from vllm_adapter.disk import packed_file as P  # noqa: E402
from vllm_adapter.disk import packed_io as PIO  # noqa: E402
from vllm_adapter.disk.fileio import TierFileIO  # noqa: E402
from vllm_adapter.disk.packed_split import SplitLoad, SplitStore, load_job_slices  # noqa: E402
from vllm_adapter.disk.tier_budget import TierBudget, reserve_files  # noqa: E402

NS = bytes(range(16))
CHUNKING = resolve(Geometry((KVGroup(0, GroupKind.FULL, 16),), tokens_per_hash=16),
                   BlocksPerChunk(1))


def on_threads(tasks: list) -> None:
    threads = [threading.Thread(target=t) for t in tasks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def one_job(root: Path, n: int, rep: int, view: memoryview, row: int, n_keys: int,
            io: C.ChunkIO, file_io: TierFileIO) -> tuple[float, float]:
    """One store job of ``n_keys`` sections then one load job of them, ``n`` tasks each
    (1: the one-task path); their wall times, in seconds."""
    shutil.rmtree(root, ignore_errors=True)
    ns_dir = root / "ns"
    ns_dir.mkdir(parents=True)
    keys = [rep.to_bytes(4, "big") + i.to_bytes(28, "big") + bytes(4) for i in range(n_keys)]
    offsets = [i * row for i in range(n_keys)]
    offset_of = dict(zip(keys, offsets, strict=True))
    budget = TierBudget(str(root), str(ns_dir), 1 << 40, EvictionRule.LRU, CHUNKING)
    index = PIO.PackedIndex()

    def size_of(ks: object) -> int:
        return RP.packed_file_bytes([row] * n_keys, [36] * n_keys)

    def name_of(ks: object) -> str:
        return P.packed_name(str(ns_dir), keys)

    begun = time.perf_counter()
    if n == 1:
        (path, ks), = reserve_files(budget, [keys], name_of, size_of)
        index.add(path, file_io.store_packed(path, ks, view, offsets, row, io))
        budget.complete([(path, True)])
    else:
        on_threads(SplitStore(
            n, reserve=lambda: reserve_files(budget, [keys], name_of, size_of),
            complete=budget.complete, written=index.add, failed=lambda e: None,
            file_io=file_io, io=io, view=view, offset_of=offset_of, size=row).tasks)
    store_s = time.perf_counter() - begun
    dest = mmap.mmap(-1, n_keys * row)
    dview = memoryview(dest)
    if n > 1:  # as the tier's _split_load_tasks: the plan, the rule's slices, one task each
        begun = time.perf_counter()
        plan = PIO.LoadPlan.of(index, keys)
        assert plan is not None
        slices = load_job_slices(plan, keys, RS.LoadSplit(threads=n))
        assert len(slices) == n, f"{len(slices)} slices, not {n}: the job is too small"

        def load(keys_: object, offsets_: object) -> None:
            file_io.load_packed(index, keys_, dview, offsets_, row, io, plan=plan)

        on_threads(SplitLoad(keys, offsets, slices, [plan.path_of[k] for k in keys],
                             begin=lambda: None, load=load, end=lambda *_: None).tasks)
    else:
        begun = time.perf_counter()
        file_io.load_packed(index, keys, dview, offsets, row, io)
    load_s = time.perf_counter() - begun
    assert dest[:] == view.tobytes(), "the load did not read what was stored"
    budget.close()
    shutil.rmtree(root, ignore_errors=True)
    return store_s, load_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--sections", type=int, default=32)
    ap.add_argument("--row-kib", type=int, default=2048)
    ap.add_argument("--parts", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--o-direct", action="store_true")
    ap.add_argument("--fsync", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    row = args.row_kib << 10
    n_keys = args.sections
    region = mmap.mmap(-1, n_keys * row)  # page-aligned, as vLLM's region is
    region[:] = os.urandom(n_keys * row)
    view = memoryview(region)
    io = C.ChunkIO(namespace=NS, counters=C.TierCounters(), o_direct=args.o_direct,
                   fsync=args.fsync)
    file_io = TierFileIO()
    top = Path(args.dir)
    print(f"job: {n_keys} sections x {args.row_kib} KiB = {n_keys * row >> 20} MiB; "
          f"o_direct={args.o_direct} fsync={args.fsync}; load average {os.getloadavg()}")
    for n in args.parts:
        stores, loads = [], []
        for rep in range(args.repeat):
            os.sync()  # the writeback of the last repeat is not this one's
            store_s, load_s = one_job(top / f"n{n}-{rep}", n, rep, view, row, n_keys, io,
                                      file_io)
            stores.append(store_s)
            loads.append(load_s)
        mib = n_keys * row / (1 << 20)
        st, ld = statistics.median(stores), statistics.median(loads)
        print(f"parts={n}: store median {st * 1e3:7.1f} ms ({mib / st:6.0f} MiB/s), "
              f"load median {ld * 1e3:7.1f} ms ({mib / ld:6.0f} MiB/s); "
              f"stores {[round(x * 1e3, 1) for x in stores]} "
              f"loads {[round(x * 1e3, 1) for x in loads]}")
    if args.profile:
        root = top / "profile"
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        keys = [i.to_bytes(32, "big") + bytes(4) for i in range(n_keys)]
        prof = cProfile.Profile()
        prof.enable()
        for rep in range(args.repeat):
            file_io.store_packed(str(root / f"p{rep}.kvp"), keys, view,
                                 [i * row for i in range(n_keys)], row, io)
        prof.disable()
        out = _io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
        print(out.getvalue())
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
