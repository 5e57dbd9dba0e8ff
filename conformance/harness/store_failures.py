"""Store failures of a file tier: full disk, I/O error, a root turned read-only, a cut write.

The faults lane's store-failure cases (``conformance/lanes/test_tiered_store_failures.py``)
and the meta lane's check of the same case (:mod:`conformance.meta.mutants.catalogue`) run
:func:`run_case` and judge its :class:`Outcome` with :func:`check_outcome`, which raises
:class:`conformance.checks.CheckFailed` (an assertion the mutation score counts).

Three tiers (:data:`TIERS`): ``vllm`` (vLLM's fs tier, ``batch_store_block``), and
kvchunk's (:mod:`vllm_adapter.disk.tier`) in its two layouts, ``per_chunk``
(``TierFileIO.store_chunks``, one call per chunk file) and ``packed``
(``TierFileIO.store_packed``, one call per store job's file; ``finish_packed`` for a
file of a job split across the pool).  The probe of the tier's file
I/O (:class:`conformance.harness.tiered.FileProbe` and kvchunk's) carries a ``store`` hook,
:class:`StoreFaults`, that injects the fault (:data:`FAULTS`):

* ``enospc``: every store raises ``OSError(ENOSPC)`` before it writes a byte (a full
  disk) while the first two prompts are stored; lifted before they are asked again;
* ``eio``: every second store call raises ``OSError(EIO)`` (an intermittent device
  error), so some keys reach the files and some do not; lifted as ``enospc``;
* ``erofs``: the root turns read-only once the first prompt is stored: every later store
  raises ``OSError(EROFS)``, to the end of the case.  A hook, not ``chmod`` (the lanes run
  as root, which permission bits do not stop) nor a read-only bind mount: that needs
  ``CAP_SYS_ADMIN`` and a mount namespace of its own, which a process with threads (vLLM's
  and torch's) cannot ``unshare``, and a mount in the shared namespace outlives a crashed
  run;
* ``cut-short``: while the first two prompts are stored, ``RLIMIT_FSIZE`` is set to about
  half a file (page aligned, ``SIGXFSZ`` ignored): the kernel ends the tier's own write of
  each file short and fails the next one (``EFBIG``), whichever code writes it (vLLM's
  C extension ``fs_io_C`` included, which a Python-level hook cannot reach), so the tier's
  own clean-up is what is judged; lifted before the prompts are asked again.  The limit
  cuts kvchunk's ledger journal too once it passes it (its records name the namespace,
  whose length follows the checkout's path: a clone at ``/check/work/main`` did, one at
  ``/tmp/ci/main`` did not): a ``done`` record refused then is journaled by the ledger's
  next locked operation, so no reservation is left pending either way
  (``tests/test_ledger_state_machine.py``'s ``done-enospc`` fault holds that on its own).

:class:`TierWatch` wraps the tier object's ``lookup`` / ``submit_store`` /
``submit_load`` / ``get_finished_jobs`` to see what the tier advertises: lookup verdicts,
store job results and the keys of every load it is asked for.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conformance.checks import expect
from conformance.harness import driver as D
from conformance.harness import safe_fs_faults as SF
from conformance.harness import tiered as T
from conformance.harness import vllm_harness_api as V
from conformance.harness.kv_stats import DataStats
from conformance.protocol.trace import RequestSpec
from vllm_adapter.disk import chunk_file as CF
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk.budget import LEDGER_FILE
from vllm_adapter.disk.fileio import TierFileIO
from vllm_adapter.disk.tier import KvchunkFileTierManager

__all__ = [
    "FAULTS",
    "TIERS",
    "Outcome",
    "StoreFaults",
    "TierWatch",
    "check_outcome",
    "pending_in_ledger",
    "run_case",
    "run_checked",
]

FAULTS = ("enospc", "eio", "erofs", "cut-short")
TIERS = ("vllm", "per_chunk", "packed")
NUM_GPU_BLOCKS = 64
NUM_CPU_CHUNKS = 8
PROMPT_LEN = 200
PAGE = 4096
_ERRNO = {"enospc": errno.ENOSPC, "eio": errno.EIO, "erofs": errno.EROFS}


# ---------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------


def driver(root: Path, tier: str) -> Any:
    """The faults lane's engine (``test_tiered_faults.py``): FA16, ``blocks_per_chunk`` 2,
    8 CPU chunks, one fs tier at ``root``: vLLM's, or kvchunk's in layout ``tier``."""
    kvc = D.full_attention_kv_cache_config(block_size=16, num_blocks=NUM_GPU_BLOCKS)
    spec = (T.tiering_spec(root) if tier == "vllm"
            else SF.kvchunk_tiering_spec(root, layout=tier))
    extra = {**spec, "blocks_per_chunk": 2, "num_cpu_chunks": NUM_CPU_CHUNKS}
    return D.VllmDriver.from_kv_cache_config(
        kvc, extra_config=extra, prefix_cache_retention_interval=0,
        num_gpu_blocks=NUM_GPU_BLOCKS, num_cpu_chunks=NUM_CPU_CHUNKS,
    )


def packed_name(key: Any) -> str:
    """A key's name in kvchunk's packed layout, as :class:`~conformance.harness.safe_fs_faults.PackedProbe`
    records its loads."""
    return f"packed_g{P.group_of_key(bytes(key))}/{bytes(key).hex()}.bin"


# ---------------------------------------------------------------------------
# The fault: a store hook of the probe
# ---------------------------------------------------------------------------


@dataclass
class StoreFaults:
    """The probe's ``store`` hook: the real store, or the fault (:data:`FAULTS`) instead.

    Every call that raises (the fault, or the real store failing under ``RLIMIT_FSIZE``)
    adds its keys' names to :attr:`failed`.  ``failing`` is switched by the case."""

    fault: str
    real: Callable[..., Any]
    names: Callable[..., list[str]]
    failing: bool = False
    calls: int = 0
    failed: set[str] = field(default_factory=set)
    failed_calls: int = 0
    phase: str = "store"
    """``store`` (the prompts stored under the fault), then ``ask`` (asked again)."""
    failed_in: dict[str, set[str]] = field(default_factory=dict)
    """Phase -> the names of the keys whose store failed in it."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _fails(self, n: int) -> bool:
        if self.fault == "eio":
            return n % 2 == 1
        return self.fault in ("enospc", "erofs")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        names = self.names(*args)
        with self._lock:
            n, failing = self.calls, self.failing
            self.calls += 1
        try:
            if failing and self._fails(n):
                code = _ERRNO[self.fault]
                raise OSError(code, f"{os.strerror(code)} (injected: {self.fault})", names[0])
            return self.real(*args, **kwargs)
        except OSError:
            self.record_failure(names)
            raise

    def record_failure(self, names: list[str]) -> None:
        """The store of ``names`` failed (this hook's call, or a split file's other write)."""
        with self._lock:
            self.failed.update(names)
            self.failed_in.setdefault(self.phase, set()).update(names)
            self.failed_calls += 1

    def recording(self, real: Callable[..., Any]) -> Callable[..., Any]:
        """``real`` (a split packed file's ``open_packed`` or ``store_packed_part``, its
        plan the second argument), its failures recorded as the failure of the whole file."""

        def call(first: Any, plan: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return real(first, plan, *args, **kwargs)
            except OSError:
                self.record_failure([packed_name(k) for k in plan.keys])
                raise

        return call


def _packed_store(store: Callable[..., Any], finish: Callable[..., Any]) -> Callable[..., Any]:
    """The packed tier's write of one file, either kind (:class:`~conformance.harness.safe_fs_faults.PackedProbe`
    hands its ``store`` hook a one-task store's ``store_packed`` call and a split store's
    ``finish_packed`` call, whose first argument is the file's temporary file)."""

    def real(first: Any, *args: Any, **kwargs: Any) -> Any:
        return (finish if isinstance(first, P.PackedTemp) else store)(first, *args, **kwargs)

    return real


def install(tier: str, monkeypatch: pytest.MonkeyPatch, fault: str
            ) -> tuple[T.FileProbe, StoreFaults]:
    """The probe of ``tier``'s file I/O with a :class:`StoreFaults` hook (every tier of that
    kind built from now on)."""
    if tier == "vllm":
        module: Any = V.fs_tier_module
        probe: T.FileProbe = T.FileProbe()
        real = module.batch_store_block
        names: Callable[..., list[str]] = lambda paths, *_: list(paths)  # noqa: E731
    else:
        module = TierFileIO()
        monkeypatch.setattr(KvchunkFileTierManager, "file_io_factory", lambda: module)
        if tier == "packed":
            probe = SF.PackedProbe()
            real = _packed_store(module.store_packed, module.finish_packed)
            names = lambda first, keys, *_: [  # noqa: E731
                packed_name(k) for k in (keys.keys if isinstance(first, P.PackedTemp) else keys)]
        else:
            probe = SF.ChunkProbe()
            real = module.store_chunks
            names = lambda paths, *_: list(paths)  # noqa: E731
    probe.install(monkeypatch, module)
    faults = StoreFaults(fault, real, names)
    if tier == "packed":  # a split file's writes before its finish_packed fail it too
        for name in ("open_packed", "store_packed_part"):
            monkeypatch.setattr(module, name, faults.recording(getattr(module, name)))
    probe.store = faults
    return probe, faults


# ---------------------------------------------------------------------------
# What the tier advertises
# ---------------------------------------------------------------------------


@dataclass
class TierWatch:
    """Lookup verdicts, store job results and load jobs of one secondary tier object."""

    tier: Any
    name_of: Callable[[Any], str]
    lookups: list[tuple[str, str]] = field(default_factory=list)
    """``(name, HIT | MISS)`` in call order (``RETRY`` left out)."""
    phase: str = "store"
    store_jobs: dict[int, list[str]] = field(default_factory=dict)
    store_phase: dict[int, str] = field(default_factory=dict)
    store_results: dict[int, bool] = field(default_factory=dict)
    loads: list[list[str]] = field(default_factory=list)
    """The names of every load (promotion) job the tier was given."""

    def install(self, monkeypatch: pytest.MonkeyPatch) -> TierWatch:
        tier = self.tier
        lookup, submit_store = tier.lookup, tier.submit_store
        submit_load, finished = tier.submit_load, tier.get_finished_jobs

        def watched_lookup(key: Any, req_context: Any) -> Any:
            result = lookup(key, req_context)
            if result.name in ("HIT", "MISS"):
                self.lookups.append((self.name_of(key), result.name))
            return result

        def watched_store(job: Any) -> None:
            self.store_jobs[int(job.job_id)] = [self.name_of(k) for k in job.keys]
            self.store_phase[int(job.job_id)] = self.phase
            submit_store(job)

        def watched_load(job: Any) -> None:
            self.loads.append([self.name_of(k) for k in job.keys])
            submit_load(job)

        def watched_finished() -> Any:
            results = list(finished())
            for r in results:
                if int(r.job_id) in self.store_jobs:
                    self.store_results[int(r.job_id)] = bool(r.success)
            return results

        monkeypatch.setattr(tier, "lookup", watched_lookup)
        monkeypatch.setattr(tier, "submit_store", watched_store)
        monkeypatch.setattr(tier, "submit_load", watched_load)
        monkeypatch.setattr(tier, "get_finished_jobs", watched_finished)
        return self


def name_function(tier: str, tier_object: Any) -> Callable[[Any], str]:
    if tier == "packed":
        return packed_name
    mapper = tier_object.file_mapper
    return lambda key: str(mapper.get_file_name(key))


# ---------------------------------------------------------------------------
# Files left behind
# ---------------------------------------------------------------------------


def pending_in_ledger(root: Path) -> dict[str, Any]:
    """Reservations kvchunk's ledger holds with no outcome (path -> writer): an ``add`` with
    no ``done`` / ``rm`` (``conformance/lanes/test_tiered_budget.py``'s reading, for both
    record formats: a reservation named by its ``rid``, or by its ``path`` in the first)."""
    pending: dict[str, tuple[str, Any]] = {}
    ledger = root / LEDGER_FILE
    for line in ledger.read_text().splitlines() if ledger.exists() else ():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn record
        if not isinstance(rec, dict):
            continue
        rid = rec.get("rid", rec.get("path"))
        if rec.get("op") == "add":
            pending[str(rid)] = (str(rec.get("path")), rec.get("owner"))
        elif rec.get("op") in ("done", "rm"):
            pending.pop(str(rid), None)
    return dict(pending.values())


def temporary_files(root: Path) -> list[str]:
    """Temporary files under ``root``: vLLM's ``<name>_<n>.tmp``, kvchunk's ``<name>.<...>.tmp``
    (both end in ``.tmp``; kvchunk's ledger keeps no temporary file between writes)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and p.name.endswith((".tmp", CF.TEMP_SUFFIX)))


def _limit_file_size(limit: int) -> Callable[[], None]:
    """``RLIMIT_FSIZE`` for this process (a write past ``limit`` is cut short, the next one
    fails ``EFBIG``; ``SIGXFSZ`` ignored); returns the (idempotent) undo."""
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
    undone: list[bool] = []

    def undo() -> None:
        if not undone:
            undone.append(True)
            resource.setrlimit(resource.RLIMIT_FSIZE, old)
            signal.signal(signal.SIGXFSZ, old_handler)

    return undo


def whole_file_bytes(tier: str, row: int) -> int | None:
    """A whole chunk file's size (None for packed files, whose size depends on the job)."""
    if tier == "packed":
        return None
    return SF.file_bytes(tier != "vllm", row)


def cut_limit(tier: str, row: int) -> int:
    """About half a file, page aligned: the cut falls inside the first file's payload."""
    header = 0 if tier == "vllm" else CF.HEADER_SIZE
    return header + max(PAGE, row // 2 // PAGE * PAGE)


# ---------------------------------------------------------------------------
# The case
# ---------------------------------------------------------------------------


@dataclass
class Outcome:
    """What :func:`run_case` saw."""

    tier: str
    fault: str
    stats: DataStats
    finished: dict[str, bool]
    failed_before_ask: set[str]
    """Names of the keys whose store failed before the prompts were asked again."""
    failed: set[str]
    failed_in: dict[str, set[str]]
    failed_calls: int
    store_calls: int
    store_jobs: dict[int, list[str]]
    store_phase: dict[int, str]
    store_results: dict[int, bool]
    lookups_on_ask: list[tuple[str, str]]
    loads_on_ask: list[list[str]]
    files_loaded_on_ask: int
    load_failures_on_ask: list[str]
    failed_on_disk: list[str]
    """Failed keys' files that existed when the prompts were asked again (path-named tiers)."""
    temporary_files: list[str]
    odd_sizes: dict[str, int]
    """Chunk files whose size is not a whole file's (per-file tiers)."""
    pending: dict[str, Any]
    row: int
    limit: int | None

    def summary(self) -> str:
        ok = sum(self.store_results.values())
        return (f"{self.tier} tier, {self.fault}: {self.stats.describe()}; store calls "
                f"{self.store_calls} ({self.failed_calls} failed, {len(self.failed)} keys); "
                f"store jobs {len(self.store_jobs)} ({ok} reported done, "
                f"{len(self.store_results) - ok} failed, "
                f"{len(self.store_jobs) - len(self.store_results)} unreported); asked again: "
                f"{len(self.lookups_on_ask)} fs lookups "
                f"({sum(r == 'HIT' for _, r in self.lookups_on_ask)} hits), "
                f"{len(self.loads_on_ask)} load jobs, {self.files_loaded_on_ask} keys loaded, "
                f"load failures {self.load_failures_on_ask[:2]}; row {self.row} bytes"
                + (f", RLIMIT_FSIZE {self.limit}" if self.limit else ""))


def _serve(session: Any, name: str, prompt: Sequence[int]) -> None:
    session.add_request(RequestSpec(name, tuple(prompt), max_tokens=2))
    T.run_until_idle(session)
    T.drain_files(session)


def run_case(tier: str, fault: str, root: Path, monkeypatch: pytest.MonkeyPatch,
             *, prompt_len: int = PROMPT_LEN) -> Outcome:
    """Two prompts stored under the fault, GPU cache and CPU tier reset, the CPU region
    poisoned, the prompts asked again (fault lifted, but for ``erofs``)."""
    if tier not in TIERS or fault not in FAULTS:
        raise ValueError(f"unknown tier {tier!r} or fault {fault!r}")
    probe, faults = install(tier, monkeypatch, fault)
    session, runner = T.open_session(driver(root, tier), 128)
    undo: Callable[[], None] = lambda: None  # noqa: E731
    limit = None
    try:
        (tier_object,) = session.connector_scheduler.manager.secondary_tiers
        row = int(tier_object._block_size)
        watch = TierWatch(tier_object, name_function(tier, tier_object)).install(monkeypatch)
        p, q = SF.prompts(prompt_len)
        if fault == "cut-short":
            limit = cut_limit(tier, row)
            undo = _limit_file_size(limit)
        faults.failing = fault != "erofs"
        try:
            _serve(session, "a", p)
            if fault == "erofs":
                faults.failing = True  # the root is read-only from here to the end
            _serve(session, "b", q)
        finally:
            undo()
        faults.failing = fault == "erofs"
        failed_before = set(faults.failed)
        on_disk = sorted(n for n in failed_before if tier != "packed" and os.path.exists(n))
        T.reset_all(session)
        T._poison_region(session)
        faults.phase = watch.phase = "ask"  # every store of the first phase has drained
        lookups, loads = len(watch.lookups), len(watch.loads)
        loaded, load_failures = len(probe.loaded), len(probe.load_failures)
        for name, prompt in (("a2", p), ("b2", q)):
            session.add_request(RequestSpec(name, prompt, max_tokens=2))
            T.run_until_idle(session)
        finished = {r: session.scheduler.requests.get(r) is None for r in ("a2", "b2")}
        T.drain_files(session)
        faults.failing = False
    finally:
        undo()
        T.shutdown(session)
    whole = whole_file_bytes(tier, row)
    odd = ({} if whole is None else
           {str(f.relative_to(root)): f.stat().st_size for f in T.block_files(root)
            if f.stat().st_size != whole})
    return Outcome(
        tier, fault, runner.stats, finished, failed_before, set(faults.failed),
        {k: set(v) for k, v in faults.failed_in.items()}, faults.failed_calls, faults.calls,
        dict(watch.store_jobs), dict(watch.store_phase), dict(watch.store_results),
        watch.lookups[lookups:], watch.loads[loads:], len(probe.loaded) - loaded,
        probe.load_failures[load_failures:], on_disk, temporary_files(root), odd,
        pending_in_ledger(root) if tier != "vllm" else {}, row, limit,
    )


def check_outcome(o: Outcome) -> None:
    """The store-failure properties; :class:`conformance.checks.CheckFailed` on the first
    that does not hold."""
    summary = o.summary()
    expect(bool(o.failed_before_ask), f"no store failed: the fault was never injected; {summary}")
    expect(all(o.finished.values()), f"requests left unfinished: {o.finished}; {summary}")
    expect(o.stats.corrupted_loads == 0 and o.stats.foreign_bytes_changed == 0,
           f"wrong bytes served: {summary}")
    # A failed store is reported failed: a job reported done advertises its keys
    # (vLLM's fs tier marks them present in its lookup cache and emits BlockStored events).
    # A key is stored once per phase (each phase's stores drain before the next begins).
    done_but_failed = sorted(
        j for j, ok in o.store_results.items()
        if ok and set(o.store_jobs[j]) & o.failed_in.get(o.store_phase[j], set()))
    expect(not done_but_failed,
           f"store jobs {done_but_failed[:5]} reported done though their files were not "
           f"written: {o.store_jobs[done_but_failed[0]][:2] if done_but_failed else ''}; {summary}")
    expect(any(not ok for ok in o.store_results.values()),
           f"no store job was reported failed: {summary}")
    expect(not o.failed_on_disk,
           f"failed stores left chunk files at their keys' names: {o.failed_on_disk[:3]}; {summary}")
    # Asked again (GPU cache and CPU tier reset): every failed key misses in the fs tier.
    advertised = sorted({n for n, r in o.lookups_on_ask if r == "HIT" and n in o.failed_before_ask})
    expect(not advertised,
           f"keys of failed stores advertised (fs-tier lookup HIT): {advertised[:3]}; {summary}")
    missed = {n for n, r in o.lookups_on_ask if r == "MISS"} & o.failed_before_ask
    expect(bool(missed),
           f"no key of a failed store was looked up in the fs tier when asked again: {summary}")
    tried = sorted({n for job in o.loads_on_ask for n in job} & o.failed_before_ask)
    expect(not tried, f"loads of failed stores' keys were attempted: {tried[:3]}; {summary}")
    expect(not o.load_failures_on_ask, f"a load failed when asked again: {summary}")
    # The stores that went through serve the prompt: a key of a store job reported done
    # never misses, and a hit is loaded from files.  Under ``eio`` which calls fail depends
    # on the order vLLM's pool threads reach the hook, so a prompt's first chunk may be a
    # failed one (no hit at all, as intended); ``erofs`` stores the first prompt whole.
    stored = {n for j, ok in o.store_results.items() if ok and o.store_phase.get(j) == "store"
              for n in o.store_jobs[j]} - o.failed_before_ask
    missed_stored = sorted({n for n, r in o.lookups_on_ask if r == "MISS"} & stored)
    expect(not missed_stored,
           f"keys whose store was reported done missed when asked again: {missed_stored[:3]}; "
           f"{summary}")
    hit = any(r == "HIT" for _, r in o.lookups_on_ask)
    if o.fault == "erofs" or (o.fault == "eio" and hit):
        expect(o.files_loaded_on_ask > 0 and o.stats.loaded_blocks_checked > 0,
               f"the stores that succeeded were not served from files: {summary}")
    # Nothing left behind.
    expect(not o.temporary_files,
           f"temporary files left under the root: {o.temporary_files[:3]}; {summary}")
    expect(not o.odd_sizes, f"partial chunk files under the root: "
                            f"{sorted(o.odd_sizes.items())[:3]}; {summary}")
    expect(not o.pending,
           f"reservations left pending in {LEDGER_FILE}: {sorted(o.pending)[:3]}; {summary}")


def run_checked(tier: str, fault: str) -> Outcome:
    """The case in a fresh temporary root, judged (the meta lane's check)."""
    with tempfile.TemporaryDirectory(prefix="kvchunk-store-fail-") as scratch, \
            pytest.MonkeyPatch.context() as mp:
        outcome = run_case(tier, fault, Path(scratch), mp)
    check_outcome(outcome)
    return outcome
