"""Faults lane, tiered: kvchunk's file tier under a small byte budget (``disk_bytes_to_use``).

The synthetic full-attention fixture (16-token blocks, ``blocks_per_chunk`` 2: 32-token
chunks) through :class:`vllm_adapter.disk.tier.KvchunkTieringOffloadingSpec`, both layouts,
with a budget of a handful of chunk files (:mod:`vllm_adapter.disk.budget`, eviction
``"reachable"``), judged from the root and the reference (:mod:`conformance.harness.budget_checks`):

* **soak**: a few hundred short requests (a few system prefixes x many suffixes, some
  asked again soon after), the GPU prefix cache reset before each and a 4-chunk CPU
  tier, so reuse comes from files; after every job the tier reports finished, the bytes
  of the root's files are at most the budget; after every request (no I/O in flight)
  no chunk on disk is stranded by the reference (:meth:`reference.eviction.Disk.stranded`
  over the requests' whole hash chains), the ledger names exactly the files on disk at
  their real sizes, no load was wrong; files were evicted and loads served from files;
* **shared root**: two engines on one root share one budget: B's first store evicts
  A's files while B holds less than the budget, interleaved requests never put more than
  the one budget on the root, both ledgers agree with the disk, and B serves a prompt
  only A stored (packed: B learns A's file from the ledger; per-chunk: by file name);
* **SIGKILL**: a child process running an engine per layout, each with a reservation
  whose file was never written, a whole file no ledger names and a store hung mid-write,
  is killed; the next tier on each root reclaims the dead reservations, removes the
  orphan and the temporary file, leaves nothing over the budget, and serves the dead
  engine's whole files; ``/dev/shm`` keeps no region of the dead engines;
* **refused store**: a budget under the prompt's first store job (but at least one
  file) refuses it cleanly: nothing on disk, nothing advertised (the same prompt later
  misses, no load is tried), the request finishes with right bytes.

``KVCHUNK_PROFILE=deep`` soaks 1000 requests instead of 200.  The killed child is this
module run as a script (``python -m conformance.lanes.test_tiered_budget ROOT``: its
engines write under ``ROOT/packed`` and ``ROOT/per_chunk``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import mmap
import os
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from conformance.testing.requires import require_vllm  # noqa: E402

require_vllm()

from conformance.harness import budget_checks as BC  # noqa: E402
from conformance.harness import driver as D  # noqa: E402
from conformance.harness import safe_fs_faults as SF  # noqa: E402
from conformance.harness import tiered as T  # noqa: E402
from conformance.harness.kvdata import SyntheticModelRunner  # noqa: E402
from conformance.protocol.trace import RequestSpec  # noqa: E402
from reference import packed as RP  # noqa: E402
from reference.keys import make_key  # noqa: E402
from vllm_adapter.disk import budget as DB  # noqa: E402
from vllm_adapter.disk import chunk_file as CF  # noqa: E402
from vllm_adapter.disk import packed_file as P  # noqa: E402
from vllm_adapter.disk import tier as S  # noqa: E402
from vllm_adapter.disk.journal import decode  # noqa: E402
from vllm_adapter.disk.ledger import budget_for_files  # noqa: E402

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
PROFILE = os.environ.get("KVCHUNK_PROFILE", "ci")
LAYOUTS = ("packed", "per_chunk")
BLOCK_SIZE = 16
BLOCKS_PER_CHUNK = 2
CHUNK_TOKENS = BLOCK_SIZE * BLOCKS_PER_CHUNK
NUM_GPU_BLOCKS = 64
KEY_BYTES = 36
"""A key: vLLM's 32-byte block hash and the group index (``make_offload_key``)."""
TAIL = 5
"""Tokens after a prompt's last whole chunk: with the one decoded token its KV still ends
inside the chunk, so the chunks a request stores are its prompt's."""
CHUNKING = BC.full_attention_chunking(BLOCK_SIZE, BLOCKS_PER_CHUNK)

SOAK_REQUESTS = {"ci": 200, "deep": 1000, "dev": 40}.get(PROFILE, 200)
SOAK_BUDGET_CHUNKS = 8
SOAK_CPU_CHUNKS = 4
SOAK_SYSTEMS = 4
SOAK_REPEAT = 0.3
"""The share of requests asking again for one of the three prompts before them."""


# ---------------------------------------------------------------------------
# Engines and budgets
# ---------------------------------------------------------------------------


def _driver(root: Path, layout: str, budget: int, num_cpu_chunks: int = 8) -> Any:
    kvc = D.full_attention_kv_cache_config(block_size=BLOCK_SIZE, num_blocks=NUM_GPU_BLOCKS)
    extra = {
        **SF.kvchunk_tiering_spec(root, layout=layout, disk_bytes_to_use=budget),
        "blocks_per_chunk": BLOCKS_PER_CHUNK,
        "num_cpu_chunks": num_cpu_chunks,
    }
    return D.VllmDriver.from_kv_cache_config(
        kvc, extra_config=extra, prefix_cache_retention_interval=0,
        num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_chunks=num_cpu_chunks,
    )


def _open(root: Path, layout: str, budget: int, num_cpu_chunks: int = 8
          ) -> tuple[Any, SyntheticModelRunner, S.KvchunkFileTierManager]:
    session, runner = T.open_session(_driver(root, layout, budget, num_cpu_chunks), 128)
    assert session.hash_block_size == BLOCK_SIZE, (
        f"the engine hashes {session.hash_block_size}-token blocks, the reference chunking "
        f"{BLOCK_SIZE}-token ones")
    return session, runner, SF.tier_of(session)


@functools.cache
def _row_bytes() -> int:
    """The bytes one chunk of the fixture holds (a file's payload, a packed section)."""
    with tempfile.TemporaryDirectory(prefix="kvchunk-budget-probe-") as scratch:
        session, _, tier = _open(Path(scratch), "per_chunk", SF.disk_bytes(Path(scratch)))
        try:
            return int(tier.geometry["file_payload_bytes"])
        finally:
            T.shutdown(session)


def _budget(layout: str, chunks: int) -> int:
    """``disk_bytes_to_use`` whose files' part holds ``chunks`` chunks: that many chunk files,
    or one packed file of that many sections (the ledger's reserve on top)."""
    row = _row_bytes()
    if layout == "per_chunk":
        files = chunks * (S.HEADER_SIZE + row)
    else:
        files = RP.packed_file_bytes([row] * chunks, [KEY_BYTES] * chunks)
    return budget_for_files(files)


def _prompt(rng: random.Random, prefix: Sequence[int], chunks: int) -> tuple[int, ...]:
    """``prefix`` then fresh tokens up to ``chunks`` whole chunks, and :data:`TAIL` more."""
    n = chunks * CHUNK_TOKENS - len(prefix) + TAIL
    return tuple(prefix) + tuple(rng.randrange(30000, 60000) for _ in range(n))


def _serve(session: Any, judge: BC.ReferenceJudge, req_id: str, prompt: Sequence[int]) -> bool:
    """Serve one request to the end, its file I/O drained; the judge learns its hash chain.
    Whether it finished."""
    session.add_request(RequestSpec(req_id, tuple(prompt), max_tokens=2))
    request = session.scheduler.requests[req_id]
    T.run_until_idle(session)
    T.drain_files(session)
    judge.observe(request.block_hashes)
    return req_id not in session.scheduler.requests


def _record_budget(record_property: Callable[[str, Any], None], tier: S.KvchunkFileTierManager,
                   engine: str = "") -> dict[str, int]:
    """The tier's budget counters and file loads, as ``counter:budget_[<engine>_]<name>``."""
    snap = tier.budget.snapshot(stranded=True)
    counts = {name: snap[name] for name in (
        "files_evicted", "bytes_evicted", "stores_refused", "keys_not_admitted",
        "orphans_removed", "reservations_reclaimed", "stranded_bytes")}
    counts.update(file_loads=BC.file_loads(tier), load_failures=tier.counters.load_failures,
                  store_failures=tier.counters.store_failures)
    for name, value in counts.items():
        record_property(f"counter:budget_{engine + '_' if engine else ''}{name}", value)
    return snap


def _record_reserves(tier: S.KvchunkFileTierManager, into: set[str]) -> None:
    """Collect the files ``tier`` reserves (paths relative to the root)."""
    real = tier.budget.reserve

    def reserve(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        for path, _ in out or ():
            into.add(os.path.relpath(path, tier.budget.root))
        return out

    tier.budget.reserve = reserve  # type: ignore[method-assign]


def _on_disk(root: Path) -> dict[str, int]:
    return BC.budget_files(root)


# ---------------------------------------------------------------------------
# 1. Soak
# ---------------------------------------------------------------------------


def _soak_prompts(n: int, seed: int = 0) -> list[tuple[int, ...]]:
    """``n`` prompts of 3 or 4 chunks: one of :data:`SOAK_SYSTEMS` 2-chunk system prefixes
    and a fresh suffix, or (:data:`SOAK_REPEAT` of them) one of the three prompts before."""
    rng = random.Random(seed)
    systems = [tuple(rng.randrange(100, 30000) for _ in range(2 * CHUNK_TOKENS))
               for _ in range(SOAK_SYSTEMS)]
    prompts: list[tuple[int, ...]] = []
    for i in range(n):
        if i >= 3 and rng.random() < SOAK_REPEAT:
            prompts.append(prompts[i - rng.randint(1, 3)])
        else:
            prompts.append(_prompt(rng, systems[rng.randrange(SOAK_SYSTEMS)], rng.randint(3, 4)))
    return prompts


@pytest.mark.parametrize("layout", LAYOUTS)
def test_soak_small_budget_holds_strands_nothing_serves_right(
    layout: str, tmp_path: Path, record_property: Any
) -> None:
    budget = _budget(layout, SOAK_BUDGET_CHUNKS)
    record_property("fixture", "synthetic-full")
    record_property("knob", f"blocks_per_chunk=2, kvchunk {layout} fs tier, disk_bytes_to_use "
                            f"{budget} ({SOAK_BUDGET_CHUNKS} chunks), {SOAK_REQUESTS} requests")
    judge = BC.ReferenceJudge(CHUNKING)
    session, runner, tier = _open(tmp_path, layout, budget, SOAK_CPU_CHUNKS)
    watch = BC.BoundWatch(tier, tmp_path, budget, layout).install()
    prompts = _soak_prompts(SOAK_REQUESTS)
    try:
        for i, prompt in enumerate(prompts):
            assert session.reset_prefix_cache(), f"GPU prefix-cache reset refused before request {i}"
            finished = _serve(session, judge, f"r{i}", prompt)
            stats = runner.stats
            where = (f"after request {i} of {len(prompts)} ({len(prompt)} tokens; "
                     f"{tier.budget.snapshot()})")
            assert finished, f"request r{i} did not finish; {where}"
            assert not watch.excesses, f"bytes over the budget mid-flight: {watch.excesses[:3]}; {where}"
            watch.check(f"request {i} drained")
            problems = BC.quiescent_problems([tier], tmp_path, budget, judge)
            assert not problems, f"{where}: " + "; ".join(problems)
            assert stats.corrupted_loads == 0 and stats.foreign_bytes_changed == 0, (
                f"wrong bytes served {where}: {stats.describe()}")
    finally:
        T.shutdown(session)
    stats = runner.stats
    snap = _record_budget(record_property, tier)
    record_property("counter:budget_bound_checks", watch.checks)
    record_property("counter:budget_bound_checks_after_jobs", watch.job_checks)
    record_property("counter:budget_peak_disk_bytes", watch.peak)
    record_property("counter:tier_wrong_loads", stats.corrupted_loads)
    summary = (f"{snap}; {tier.counters}; {stats.describe()}; {watch.checks} bound checks "
               f"({watch.job_checks} after finished jobs), peak {watch.peak} of {budget} bytes")
    assert snap["files_evicted"] > 0 and snap["bytes_evicted"] > budget, (
        f"the budget never turned over (evicted {snap['bytes_evicted']} bytes, budget "
        f"{budget}): {summary}")
    assert BC.file_loads(tier) > 0 and stats.loaded_blocks_checked > 0, (
        f"no load was served from files: {summary}")
    assert snap["stranded_bytes"] == 0, f"the tier's own model counts stranded bytes: {summary}"
    assert not tier.counters.bad_files, (
        f"an evicted file was read as a damaged one: {tier.counters.recent_bad}; {summary}")
    assert watch.job_checks > 0, f"the bound was never checked as jobs finished: {summary}"


# ---------------------------------------------------------------------------
# 2. Two engines, one root, one budget
# ---------------------------------------------------------------------------

SHARED_BUDGET_CHUNKS = 8
SHARED_ROUNDS = 6


def _step_together(sessions: Sequence[Any]) -> None:
    """Step every session in turn until none has work (their file I/O interleaves)."""
    deadline = time.monotonic() + 300
    while any(s.has_work() for s in sessions):
        if time.monotonic() > deadline:
            raise RuntimeError("two engines still busy after 300 s of steps")
        for s in sessions:
            if s.has_work():
                s.step()
        if not any(s.scheduler.running for s in sessions):
            time.sleep(0.002)  # as T.run_until_idle: let the I/O threads work


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_engines_share_one_root_and_one_budget(
    layout: str, tmp_path: Path, record_property: Any
) -> None:
    budget = _budget(layout, SHARED_BUDGET_CHUNKS)
    record_property("fixture", "synthetic-full")
    record_property("knob", f"blocks_per_chunk=2, kvchunk {layout} fs tier, two engines on one "
                            f"root_dir, disk_bytes_to_use {budget} ({SHARED_BUDGET_CHUNKS} chunks)")
    rng = random.Random(1)
    judge = BC.ReferenceJudge(CHUNKING)
    a, a_runner, a_tier = _open(tmp_path, layout, budget)
    b, b_runner, b_tier = _open(tmp_path, layout, budget)
    tiers = [a_tier, b_tier]
    watches = [BC.BoundWatch(a_tier, tmp_path, budget, "A").install(),
               BC.BoundWatch(b_tier, tmp_path, budget, "B").install()]
    written: dict[str, set[str]] = {"A": set(), "B": set()}
    _record_reserves(a_tier, written["A"])
    _record_reserves(b_tier, written["B"])

    def check(when: str) -> None:
        for w in watches:
            w.check(when)
        excesses = [e for w in watches for e in w.excesses]
        assert not excesses, f"more than the one budget on the root: {excesses[:3]}"
        problems = BC.quiescent_problems(tiers, tmp_path, budget, judge)
        assert not problems, f"{when}: " + "; ".join(problems)
        for name, r in (("A", a_runner), ("B", b_runner)):
            s = r.stats
            assert s.corrupted_loads == 0 and s.foreign_bytes_changed == 0, (
                f"engine {name} served wrong bytes {when}: {s.describe()}")

    try:
        # A alone fills the budget (16 chunks through an 8-chunk budget).
        for i in range(4):
            assert _serve(a, judge, f"a-fill{i}", _prompt(rng, (), 4)), f"a-fill{i} unfinished"
        check("after A filled the root")
        a_files = set(_on_disk(tmp_path)) & written["A"]
        assert a_files and not written["B"], (
            f"A's files {sorted(a_files)}, B's {sorted(written['B'])} before B stored anything")
        a_evicted = a_tier.budget.counters.files_evicted
        # B's first store: it must evict A's files, though B holds less than the budget.
        assert _serve(b, judge, "b-first", _prompt(rng, (), 4)), "b-first unfinished"
        check("after B's first request")
        on_disk = _on_disk(tmp_path)
        gone = sorted(a_files - set(on_disk))
        b_bytes = sum(n for p, n in on_disk.items() if p in written["B"])
        b_snap = b_tier.budget.snapshot()
        assert gone and b_snap["files_evicted"] > 0, (
            f"B's store evicted none of A's files (A's on disk {sorted(a_files)}, gone {gone}; "
            f"B's counters {b_snap}): each engine kept its own quota")
        assert a_tier.budget.counters.files_evicted == a_evicted, (
            f"A evicted files while idle: {a_evicted} -> {a_tier.budget.counters.files_evicted}")
        assert 0 < b_bytes < budget, (
            f"B holds {b_bytes} bytes of the {budget}-byte budget after its first request")
        # Interleaved: both engines at once, prompts sharing two system prefixes.
        systems = [tuple(rng.randrange(100, 30000) for _ in range(2 * CHUNK_TOKENS))
                   for _ in range(2)]
        for rnd in range(SHARED_ROUNDS):
            pairs = []
            for name, session in (("A", a), ("B", b)):
                assert session.reset_prefix_cache(), f"GPU reset of {name} refused"
                prompt = _prompt(rng, systems[(rnd + (name == "B")) % 2], rng.randint(3, 4))
                session.add_request(RequestSpec(f"{name}-r{rnd}", prompt, max_tokens=2))
                pairs.append((session, f"{name}-r{rnd}"))
            requests = [s.scheduler.requests[r] for s, r in pairs]
            _step_together([a, b])
            for session in (a, b):
                T.drain_files(session)
            for request in requests:
                judge.observe(request.block_hashes)
            unfinished = [r for s, r in pairs if r in s.scheduler.requests]
            assert not unfinished, f"round {rnd}: requests {unfinished} unfinished"
            check(f"after interleaved round {rnd}")
        # A stores a prompt B never saw; B serves it from A's files.
        shared = _prompt(rng, (), 4)
        assert _serve(a, judge, "a-shared", shared), "a-shared unfinished"
        check("after A stored the shared prompt")
        b_loads, b_written = BC.file_loads(b_tier), set(written["B"])
        b_checked = b_runner.stats.loaded_blocks_checked
        assert b.reset_prefix_cache(), "GPU reset of B refused"
        # B's follower thread indexes A's files every POLL_SECONDS (lookups read the index
        # only); the wait is not slept out: one pass, here, off the scheduler's steps
        if b_tier.layout == "packed":
            b_tier._follow_ledger(force=True)
        assert _serve(b, judge, "b-shared", shared), "b-shared unfinished"
        check("after B served A's prompt")
        served = BC.file_loads(b_tier) - b_loads
        new_by_b = sorted(written["B"] - b_written)
    finally:
        for session in (a, b):
            T.shutdown(session)
    for engine, tier in (("A", a_tier), ("B", b_tier)):
        _record_budget(record_property, tier, engine)
    record_property("counter:budget_peak_disk_bytes", max(w.peak for w in watches))
    record_property("counter:budget_A_files_evicted_by_B", len(gone))
    record_property("counter:budget_B_file_loads_of_A_prompt", served)
    summary = (f"A {a_tier.budget.snapshot()} {a_tier.counters}; B {b_tier.budget.snapshot()} "
               f"{b_tier.counters}")
    assert served == 4 and b_runner.stats.loaded_blocks_checked > b_checked, (
        f"B loaded {served} of the shared prompt's 4 chunks from A's files: {summary}")
    assert not new_by_b, f"B rewrote files A had stored: {new_by_b}"
    for ledger in (a_tier.budget.ledger, b_tier.budget.ledger):
        ledger.removed_since([])
    files_a, files_b = a_tier.budget.ledger.files(), b_tier.budget.ledger.files()
    at_end = set(_on_disk(tmp_path))
    assert files_a == files_b and set(files_a) == at_end, (
        f"the ledgers disagree: A only {sorted(set(files_a) - set(files_b))}, B only "
        f"{sorted(set(files_b) - set(files_a))}, not on disk {sorted(set(files_a) - at_end)}, "
        f"on disk unnamed {sorted(at_end - set(files_a))}")
    assert max(w.peak for w in watches) <= budget, [w.excesses[:2] for w in watches]


# ---------------------------------------------------------------------------
# 3. SIGKILL with a budget
# ---------------------------------------------------------------------------

CRASH_BUDGET_CHUNKS = 16
READY_TIMEOUT_S = 240.0
CRASH_PROMPTS = [tuple(range(1000 * (i + 1), 1000 * (i + 1) + 4 * CHUNK_TOKENS + TAIL))
                 for i in range(3)]
"""The dead engine serves the first two whole; the third's first store hangs mid-write."""


def _stray_key(seed: int) -> bytes:
    return make_key(random.Random(seed).randbytes(32), 0)


def _doomed_engine(layout: str, root: Path) -> tuple[Any, dict[str, Any]]:
    """One engine of the child: it serves two prompts, reserves a file it never writes (a
    writer killed between its reservation and its write) and writes a whole file no ledger
    names (a crash between a write and its reservation, or a lost ledger record)."""
    session, _, tier = _open(root, layout, _budget(layout, CRASH_BUDGET_CHUNKS))
    judge = BC.ReferenceJudge(CHUNKING)
    for i, prompt in enumerate(CRASH_PROMPTS[:2]):
        _serve(session, judge, f"c{i}", prompt)
    dead_key, orphan_key = _stray_key(1), _stray_key(2)

    def name(keys: Sequence[bytes]) -> str:
        if layout == "packed":
            return P.packed_name(tier.namespace_dir, keys)
        return str(tier.file_mapper.get_file_name(keys[0]))

    reserved = tier.budget.reserve([[dead_key]], name, tier._file_bytes, {dead_key: CHUNK_TOKENS})
    assert reserved, f"the ledger refused a one-chunk reservation: {tier.budget.snapshot()}"
    payload = memoryview(mmap.mmap(-1, int(tier.geometry["file_payload_bytes"])))  # aligned
    orphan = name([orphan_key])
    if layout == "packed":
        P.store_packed(orphan, [orphan_key], [payload], tier.io)
    else:
        S.store_chunk(orphan, payload, S.key_digest(orphan_key), tier.io)
    return session, {"engine_id": session.vllm_config.kv_transfer_config.engine_id,
                     "budget": tier.budget.budget, "dead": reserved[0][0], "orphan": orphan,
                     "owner": tier.budget.ledger.owner}


def _doomed_engines(root: Path) -> None:
    """The child process: one engine per layout (:func:`_doomed_engine`), then every file
    store writes part of its file and hangs; once both engines' third prompt hangs so, it
    reports (one JSON line) and waits to be killed."""
    sessions, reports = {}, {}
    for layout in LAYOUTS:
        sessions[layout], reports[layout] = _doomed_engine(layout, root / layout)
    hung: dict[str, str] = {}
    lock = threading.Lock()

    def hang(path: str, io: CF.ChunkIO, tmp: str | None) -> None:
        def write(fd: int) -> None:
            os.write(fd, bytes(4096))  # part of the file
            with lock:
                layout = next(x for x in LAYOUTS if path.startswith(str(root / x) + os.sep))
                if layout not in hung:
                    hung[layout] = path
                    reports[layout]["hung"] = path
                    if len(hung) == len(LAYOUTS):
                        print(json.dumps({"pid": os.getpid(), **reports}), flush=True)
            while True:
                time.sleep(60)

        CF.write_atomically(path, io, write, direct=False, tmp=tmp)  # tmp: a recycled victim

    def hang_chunks(paths: Sequence[str], key_ids: Sequence[bytes], view: memoryview,
                    offsets: Sequence[int], size: int, io: CF.ChunkIO,
                    tmps: Sequence[str | None] | None = None) -> None:
        hang(paths[0], io, tmps[0] if tmps else None)

    def hang_packed(path: str, keys: Sequence[bytes], view: memoryview, offsets: Sequence[int],
                    size: int, io: CF.ChunkIO, tmp: str | None = None) -> P.PackedHeader:
        hang(path, io, tmp)
        return P.PackedHeader(path, 0, 0, (), ())  # never reached: hang() does not return

    # this process only: every store of a tier writes part of its file, then hangs
    for tier in S.live_tiers():
        tier.file_io.store_chunks = hang_chunks  # type: ignore[method-assign]
        tier.file_io.store_packed = hang_packed  # type: ignore[method-assign]
    for session in sessions.values():
        session.add_request(RequestSpec("c2", CRASH_PROMPTS[2], max_tokens=2))
        T.run_until_idle(session)
    while True:
        time.sleep(60)


def _ready_line(proc: subprocess.Popen[str], log: Path) -> dict[str, Any]:
    """The child's report (its stdout's first line), within :data:`READY_TIMEOUT_S`."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(READY_TIMEOUT_S):
            raise TimeoutError(f"the engine reported nothing in {READY_TIMEOUT_S:.0f} s: "
                               f"{log.read_text()[-3000:]}")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the engine exited ({proc.wait()}): {log.read_text()[-3000:]}")
    report: dict[str, Any] = json.loads(line)
    return report


def _pending_in_ledger(root: Path) -> dict[str, str]:
    """Reservations the ledger holds with no outcome (path -> its writer's lease id), read
    from its records (:func:`vllm_adapter.disk.journal.decode`)."""
    pending: dict[str, tuple[str, str]] = {}
    ledger = root / DB.LEDGER_FILE
    for line in ledger.read_bytes().splitlines() if ledger.exists() else ():
        rec = decode(line)
        if rec is None:
            continue  # a record torn by the kill
        if rec["op"] == "add":
            pending[rec["rid"]] = (rec["path"], rec["owner"])
        elif rec["op"] in ("done", "rm"):
            pending.pop(rec["rid"], None)
    return dict(pending.values())


def _region_files(engine_id: str) -> list[Path]:
    """The ``/dev/shm`` files of an engine's CPU tier region (as the crash lane's)."""
    name = f"vllm_offload_{engine_id}.mmap"
    return sorted(p for p in SHM.glob(f"{name}*") if p.name == name or p.name.startswith(f"{name}."))


def _kill_mid_store(tmp_path: Path) -> tuple[dict[str, Any], int, dict[str, list[Path]]]:
    """Run :func:`_doomed_engines` over ``tmp_path/<layout>``, ``SIGKILL`` it once both
    stores hang; its report, its pid and the ``/dev/shm`` files its engines left (removed
    here)."""
    log = tmp_path / "engine.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conformance.lanes.test_tiered_budget", str(tmp_path)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )
    report: dict[str, Any] = {}
    try:
        report = _ready_line(proc, log)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        left = {x: _region_files(report[x]["engine_id"]) for x in LAYOUTS}
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for x in LAYOUTS if report else ():
            for path in _region_files(report[x]["engine_id"]):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()  # the killed engine's own region only
    return report, proc.pid, left


def _restart_after_kill(layout: str, root: Path, report: dict[str, Any], pid: int,
                        record_property: Callable[[str, Any], None]) -> None:
    """What the kill left under ``root``, then a new tier's start over it: every dead
    reservation reclaimed, the orphan and the temporary file removed, nothing over the
    budget, the ledger naming the files on disk, the dead engine's whole prompts served."""
    budget = _budget(layout, CRASH_BUDGET_CHUNKS)
    temps = sorted(str(p.relative_to(root)) for p in root.rglob(f"*{CF.TEMP_SUFFIX}"))
    pending = _pending_in_ledger(root)
    dead, orphan, hung = (os.path.relpath(report[k], root) for k in ("dead", "orphan", "hung"))
    before = (f"{layout}: temporary files {temps}; pending reservations {sorted(pending)}; "
              f"report {report}")
    assert report["budget"] == budget, before
    assert temps and all(t.startswith(hung) for t in temps), (
        f"the kill left no partial file of the hung store: {before}")
    assert dead in pending and hung in pending, f"the kill left no dead reservation: {before}"
    assert all(owner == report["owner"] for owner in pending.values()), before
    assert (root / orphan).exists(), f"the dead engine left no orphan: {before}"
    session, runner, tier = _open(root, layout, budget)
    try:
        tier.sweeper.join(timeout=60)
        started = dict(tier.started)
        judge = BC.ReferenceJudge(CHUNKING)
        requests = []
        for i, prompt in enumerate(CRASH_PROMPTS):
            session.add_request(RequestSpec(f"again{i}", prompt, max_tokens=2))
            requests.append(session.scheduler.requests[f"again{i}"])
        for request in requests:  # their chains, before a step reaches the tier
            judge.observe(request.block_hashes)
        after_start = BC.quiescent_problems([tier], root, budget, judge)
        on_disk = _on_disk(root)
        stale = tier.counters.stale_temps_removed
        T.run_until_idle(session)
        T.drain_files(session)
        after_serving = BC.quiescent_problems([tier], root, budget, judge)
        unfinished = [r.request_id for r in requests if r.request_id in session.scheduler.requests]
    finally:
        T.shutdown(session)
    stats = runner.stats
    _record_budget(record_property, tier, layout)
    summary = f"started {started}; {before}; on disk after the start {sorted(on_disk)}"
    assert started["reclaimed"] == len(pending), (
        f"{started['reclaimed']} dead reservations reclaimed, the ledger held {len(pending)}: "
        f"{summary}")
    assert started["orphans"] == 1 and orphan not in on_disk, (
        f"the orphan {orphan} was not removed (orphans {started['orphans']}): {summary}")
    assert started["missing"] == 0, f"files vanished from the ledger: {summary}"
    # the dead writer's temporary files go with its reservations (the reclaim, at the start's
    # first lock) or with the sweeper
    assert stale <= len(temps) and not any(p.endswith(CF.TEMP_SUFFIX) for p in on_disk), (
        f"temporary files left after the start ({stale} swept of {len(temps)}): {summary}")
    assert not set(pending) & set(on_disk), (
        f"reserved files of the dead engine on disk: {sorted(set(pending) & set(on_disk))}")
    assert started["bytes"] == sum(on_disk.values()) <= budget, (
        f"the start reports {started['bytes']} bytes, the root holds {sum(on_disk.values())} "
        f"(budget {budget}): {summary}")
    assert not after_start, "after the start: " + "; ".join(after_start) + f"; {summary}"
    assert not after_serving, "after serving: " + "; ".join(after_serving) + f"; {summary}"
    assert not unfinished, f"{layout}: requests {unfinished} unfinished after the restart"
    assert stats.corrupted_loads == 0 and stats.foreign_bytes_changed == 0, stats.describe()
    assert BC.file_loads(tier) >= 8 and tier.counters.load_failures == 0, (
        f"the restarted engine did not serve the dead engine's two whole prompts from files "
        f"({BC.file_loads(tier)} chunks loaded, {tier.counters.load_failures} failed): {summary}")


@pytest.mark.skipif(not SHM.is_dir(), reason="vLLM's shared region lives in /dev/shm (Linux)")
def test_sigkilled_writer_leaves_nothing_the_next_start_keeps(
    tmp_path: Path, record_property: Any
) -> None:
    """One child process runs an engine per layout (one start-up of vLLM for both), each
    with a dead reservation, an orphan and a store hung mid-write, and is killed."""
    record_property("fixture", "synthetic-full")
    record_property("knob", f"kvchunk packed and per_chunk fs tiers, disk_bytes_to_use "
                            f"{CRASH_BUDGET_CHUNKS} chunks, engine killed with SIGKILL mid-store")
    report, pid, left = _kill_mid_store(tmp_path)
    record_property("counter:shm_regions_left", sum(map(len, left.values())))
    assert not any(left.values()), f"the killed engines' CPU tier regions in /dev/shm: {left}"
    for layout in LAYOUTS:
        _restart_after_kill(layout, tmp_path / layout, report[layout], pid, record_property)


# ---------------------------------------------------------------------------
# 4. A store over the budget
# ---------------------------------------------------------------------------

REFUSED_PROMPT = tuple(range(5000, 5000 + 6 * CHUNK_TOKENS + TAIL))
"""Six chunks; vLLM stores the first four in one job (a 128-token prefill step)."""
REFUSED_BUDGET_CHUNKS = 3


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_store_over_the_budget_is_refused_and_recomputed(
    layout: str, tmp_path: Path, record_property: Any
) -> None:
    budget = _budget(layout, REFUSED_BUDGET_CHUNKS)
    record_property("fixture", "synthetic-full")
    record_property("knob", f"kvchunk {layout} fs tier, disk_bytes_to_use {budget} "
                            f"({REFUSED_BUDGET_CHUNKS} chunks) under a 4-chunk store job")
    judge = BC.ReferenceJudge(CHUNKING)
    session, runner, tier = _open(tmp_path, layout, budget)
    assert budget >= tier._file_bytes([bytes(KEY_BYTES)]), "the budget holds no file"
    try:
        first = _serve(session, judge, "a", REFUSED_PROMPT)
        snap = tier.budget.snapshot()
        after_store = (_on_disk(tmp_path), tier.budget.ledger.files())
        why = BC.quiescent_problems([tier], tmp_path, budget, judge)
        hits, misses = tier.counters.lookup_hits, tier.counters.lookup_misses
        T.reset_all(session)  # GPU cache and CPU tier: only files could serve it now
        T._poison_region(session)
        second = _serve(session, judge, "a2", REFUSED_PROMPT)
        problems = BC.quiescent_problems([tier], tmp_path, budget, judge)
    finally:
        T.shutdown(session)
    stats = runner.stats
    counters = tier.counters
    _record_budget(record_property, tier)
    summary = f"{snap}; {counters}; {stats.describe()}"
    assert first and second, f"requests unfinished (a {first}, a2 {second}): {summary}"
    assert snap["stores_refused"] >= 1 and counters.store_failures >= 1, (
        f"no store was refused under a {budget}-byte budget: {summary}")
    assert after_store == ({}, {}), (
        f"the root holds files {after_store[0]} (ledger {after_store[1]}) after the prompt's "
        f"first store job was refused: {'; '.join(why) or 'no other problem'}; {summary}")
    assert counters.lookup_hits == hits == 0 and counters.lookup_misses > misses, (
        f"a refused store was advertised: {counters.lookup_hits} lookup hits "
        f"({counters.lookup_misses - misses} misses when asked again): {summary}")
    assert counters.load_failures == 0 and BC.file_loads(tier) == 0, (
        f"a load of a file never written was tried: {summary}")
    assert stats.load_jobs == 0 and stats.corrupted_loads == 0 and stats.foreign_bytes_changed == 0, (
        f"the recomputed request was not served right: {summary}")
    assert not problems, "; ".join(problems)


if __name__ == "__main__":
    (root_arg,) = sys.argv[1:]
    _doomed_engines(Path(root_arg))
