"""Harness of the tiered (disk) lanes: GPU -> CPU tier -> files -> CPU tier -> GPU.

A :class:`TieredCase` is a real-model fixture run through
:class:`vllm_adapter.tiering.ReferenceTieringOffloadingSpec` (vLLM's
``TieringOffloadingSpec`` with its file-system tier; the reference worker moves
the GPU <-> CPU bytes in vLLM's shared-region layout), with the data lane's
:class:`~conformance.harness.kvdata.SyntheticModelRunner` writing and checking every
byte.  :func:`run_round_trip` stores two prompts (the CPU tier is smaller than
what they need, so chunks are evicted and every stored chunk is cascaded to a
file), resets the GPU prefix cache and the CPU tier (draining the file writes),
poisons the whole CPU region, then asks for the same prompts again: every hit
must be promoted from a file, and every loaded block must hold its expected
bytes.

:class:`FileProbe` wraps the file tier's ``batch_store_block`` /
``batch_load_block`` (the names ``FileSystemTierManager`` calls) to count the
files read and to inject I/O faults; :func:`file_stats` reads what is on disk.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from conformance.harness import spec_option
from conformance.harness import vllm_harness_api as V
from conformance.harness.fixture_runs import FixtureCase
from conformance.harness.kv_stats import DataStats
from conformance.harness.kvdata import SyntheticModelRunner
from conformance.protocol.trace import RequestSpec

__all__ = [
    "FileProbe",
    "FileStats",
    "RoundTrip",
    "TieredCase",
    "file_stats",
    "run_round_trip",
    "run_until_idle",
    "tiering_spec",
]

TIERING_SPEC_ENTRIES = {
    "spec_name": "ReferenceTieringOffloadingSpec",
    "spec_module_path": "vllm_adapter.tiering",
}
_GROUP = re.compile(r"_g(\d+)/[0-9a-f]+\.bin$")
POISON = 0x5A


def tiering_spec(root_dir: Path, *, threads: int = 2) -> dict[str, Any]:
    """Extra-config entries selecting the reference tiering spec with one file tier at ``root_dir``.

    ``cpu_bytes_to_use`` is there because ``TieringOffloadingSpec`` requires it;
    the lanes size the CPU tier with ``num_cpu_chunks``, which wins.
    """
    return {
        **TIERING_SPEC_ENTRIES,
        "cpu_bytes_to_use": 1 << 30,
        "tier_poll_interval_s": 0,
        "secondary_tiers": [
            {
                "type": "fs",
                "root_dir": str(root_dir),
                "n_read_threads": threads,
                "n_write_threads": threads,
            }
        ],
    }


def group_of(path: str) -> int:
    """The KV-cache group a file of ``FileMapper`` holds (``.../<hh>_g<group>/<hash>.bin``)."""
    m = _GROUP.search(path)
    if m is None:
        raise ValueError(f"not a file-tier block file: {path}")
    return int(m.group(1))


@dataclass(frozen=True)
class FileStats:
    """Block files under a root: how many per group, and their sizes."""

    files_per_group: dict[int, int]
    bytes_per_file: dict[int, tuple[int, ...]]
    """Group -> the distinct file sizes seen (one, for a healthy tier)."""

    @property
    def files(self) -> int:
        return sum(self.files_per_group.values())


def block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.bin") if _GROUP.search(str(p)))


def file_stats(root: Path) -> FileStats:
    per_group: Counter[int] = Counter()
    sizes: dict[int, set[int]] = {}
    for path in block_files(root):
        g = group_of(str(path))
        per_group[g] += 1
        sizes.setdefault(g, set()).add(path.stat().st_size)
    return FileStats(dict(per_group), {g: tuple(sorted(s)) for g, s in sizes.items()})


@dataclass
class FileProbe:
    """Counts the file tier's reads and writes (thread-safe); ``before_load`` / ``store``
    hooks inject faults (they run in the tier's I/O threads, before the real call)."""

    loaded: list[str] = field(default_factory=list)
    load_failures: list[str] = field(default_factory=list)
    store_failures: list[str] = field(default_factory=list)
    before_load: Callable[[list[str]], None] | None = None
    store: Callable[..., None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def install(
        self,
        monkeypatch: Any,
        module: Any = None,
        store_name: str = "batch_store_block",
        load_name: str = "batch_load_block",
    ) -> Self:
        """Wrap ``module``'s file I/O functions (default: vLLM's fs tier's)."""
        module = V.fs_tier_module if module is None else module
        real_store, real_load = getattr(module, store_name), getattr(module, load_name)

        def store(paths: list[str], *args: Any, **kwargs: Any) -> None:
            try:
                (self.store or real_store)(paths, *args, **kwargs)
            except OSError as exc:
                with self._lock:
                    self.store_failures.append(f"{type(exc).__name__}: {exc}")
                raise

        def load(paths: list[str], *args: Any, **kwargs: Any) -> None:
            try:
                if self.before_load is not None:
                    self.before_load(list(paths))
                real_load(paths, *args, **kwargs)
            except OSError as exc:
                done = int(getattr(exc, "num_succeeded", 0))
                with self._lock:
                    self.loaded.extend(paths[:done])
                    self.load_failures.append(f"{type(exc).__name__}: {exc}")
                raise
            with self._lock:
                self.loaded.extend(paths)

        monkeypatch.setattr(module, store_name, store)
        monkeypatch.setattr(module, load_name, load)
        return self

    def read_per_group(self) -> dict[int, int]:
        with self._lock:
            return dict(Counter(group_of(p) for p in self.loaded))


@dataclass(frozen=True)
class TieredCase:
    """A fixture x knob through the tiering spec (kvchunk's connector for ``block_size``)."""

    base: FixtureCase

    def __str__(self) -> str:
        return f"{self.base}-fs"

    @property
    def knob(self) -> str:
        return f"{self.base.knob}, CPU tier {self.base.num_cpu_chunks} chunks + fs tier"

    def driver(self, root_dir: Path) -> Any:
        """The case's driver: the tiering spec (``--spec``'s, if it chose one) over one fs tier."""
        return self.base.driver(spec=spec_option.tiered_lane_entries(tiering_spec(root_dir)))


@dataclass
class RoundTrip:
    """What :func:`run_round_trip` saw."""

    stats: DataStats
    first_pass_loads: int
    """Load jobs before the CPU tier was reset (must be 0: the prompts are new)."""
    files_after_store: FileStats
    probe: FileProbe
    primary_chunks: int
    region_bytes_per_chunk: int
    finished: dict[str, bool]


def _prompts(rng: random.Random, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two prompts of ``n`` tokens with no common prefix.

    Disjoint on purpose: a load starts at the first chunk boundary at or after
    the GPU prefix hit (``reference.rules``), so a second prompt sharing a
    shorter-than-a-chunk prefix with the first (resident on the GPU again once the
    first is served) would skip its first chunk and recompute it, and half the
    stored files would never be read back.
    """
    p = tuple(rng.randrange(100, 30000) for _ in range(n))
    q = tuple(rng.randrange(30000, 60000) for _ in range(n))
    return p, q


def _poison_region(session: Any) -> tuple[int, int]:
    """Fill the worker's whole CPU region (every rank's slots) with :data:`POISON`."""
    worker = session.worker_connector.connector_worker.worker
    region = worker.region
    region.base_tensor.view(-1).fill_(POISON)
    return int(region.num_chunks), int(region.total_size_bytes) // max(1, int(region.num_chunks))


def reset_all(session: Any) -> None:
    """GPU prefix cache and the CPU tier (the manager drains the file writes first)."""
    assert session.reset_prefix_cache(reset_connector=True), "prefix-cache reset refused"


def run_until_idle(session: Any, *, max_seconds: float = 300.0) -> None:
    """``session.run_until_idle`` that lets the file tier's threads work.

    A request whose lookups or promotions wait on file I/O is deferred step
    after step; the driver's steps take no time, so they could run out of
    steps before the I/O threads finish.  Here a step that ran nothing sleeps
    briefly, and the bound is wall-clock time.
    """
    deadline = time.monotonic() + max_seconds
    while session.has_work():
        if time.monotonic() > deadline:
            raise RuntimeError(f"still busy after {max_seconds:.0f} s of steps")
        session.step()
        if not session.scheduler.running:
            time.sleep(0.002)


def drain_files(session: Any) -> None:
    """Wait for the file tier's in-flight I/O (its completions are processed at the next lookup)."""
    for tier in session.connector_scheduler.manager.secondary_tiers:
        tier.drain_jobs()


def shutdown(session: Any) -> None:
    """Stop the file tier's threads and release both views of the shared region."""
    session.worker_connector.connector_worker.worker.shutdown()
    session.connector_scheduler.manager.shutdown()


def run_round_trip(
    session: Any,
    runner: SyntheticModelRunner,
    probe: FileProbe,
    root: Path,
    *,
    prompt_len: int,
    seed: int = 0,
    between: Callable[[], None] | None = None,
) -> RoundTrip:
    """Store two prompts, reset GPU cache + CPU tier, poison the region, ask for them again.

    ``between`` runs after the reset and the poisoning (the faults lane damages
    files there).
    """
    p, q = _prompts(random.Random(seed), prompt_len)
    for name, prompt in (("a", p), ("b", q)):
        session.add_request(RequestSpec(name, prompt, max_tokens=2))
        run_until_idle(session)
        drain_files(session)  # a's cascades done: its CPU chunks may be evicted for b's
    first_loads = runner.stats.load_jobs
    reset_all(session)
    files = file_stats(root)
    chunks, row = _poison_region(session)
    if between is not None:
        between()
    for name, prompt in (("a2", p), ("b2", q)):
        session.add_request(RequestSpec(name, prompt, max_tokens=2))
        run_until_idle(session)
    finished = {r: session.scheduler.requests.get(r) is None for r in ("a2", "b2")}
    return RoundTrip(runner.stats, first_loads, files, probe, chunks, row, finished)


def open_session(driver: Any, budget: int) -> tuple[Any, SyntheticModelRunner]:
    """A session whose model runner is the synthetic one (on CUDA for a ``--spec`` whose worker
    is vLLM's)."""
    runner = SyntheticModelRunner(
        driver.worker_kv_cache_config, driver.vllm_config, device=spec_option.runner_device()
    )
    session = driver.session(model_runner=runner, max_num_batched_tokens=budget, record=False)
    return session, runner


def record(rt: RoundTrip, record_property: Callable[[str, Any], None]) -> None:
    """The round trip's file counters, for the conformance report."""
    record_property("counter:files_written", rt.files_after_store.files)
    record_property("counter:files_read", len(rt.probe.loaded))
    record_property("counter:cpu_tier_chunks", rt.primary_chunks)
    for g, n in sorted(rt.files_after_store.files_per_group.items()):
        record_property(f"files_written:g{g}", n)
    for g, n in sorted(rt.probe.read_per_group().items()):
        record_property(f"files_read:g{g}", n)
    for g, sizes in sorted(rt.files_after_store.bytes_per_file.items()):
        record_property(f"bytes_per_file:g{g}", ",".join(map(str, sizes)))


def corrupt(paths: Sequence[Path], how: str) -> None:
    """Damage block files: ``missing`` (deleted), ``truncated`` (half), ``flipped`` (inverted)."""
    for path in paths:
        if how == "missing":
            path.unlink()
        elif how == "truncated":
            os.truncate(path, path.stat().st_size // 2)
        elif how == "flipped":
            with open(path, "r+b") as f:
                data = bytearray(f.read())
                for i in range(0, len(data), 4096):
                    data[i] ^= 0xFF
                f.seek(0)
                f.write(data)
        else:
            raise ValueError(f"unknown file fault {how!r}: use missing, truncated or flipped")


# ---------------------------------------------------------------------------
# Workload passes (the economics check: predicted files == written files)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PassResult:
    """What one pass of a workload did to the file tier."""

    written: dict[int, int]
    """Files on disk per group once the pass's writes drained."""
    read: dict[int, int]
    """Files read (promoted to the CPU tier) per group during the pass."""
    store_failures: int
    load_failures: int


def run_workload_passes(
    session: Any,
    probe: FileProbe,
    root: Path,
    prompts: Sequence[tuple[tuple[int, ...], int]],
    *,
    passes: int = 2,
    after_pass: Callable[[int], None] | None = None,
    warm_gpu: bool = False,
) -> list[PassResult]:
    """Serve ``prompts`` (``(tokens, max_tokens)``) ``passes`` times.

    Cold GPU (the default): before every request the GPU prefix cache is reset
    (the offload tiers are not), so every reused token comes from offload.
    ``warm_gpu``: the GPU prefix cache is kept between the requests of a pass
    (what it holds is up to vLLM's block pool: its size and LRU eviction).
    Between passes the GPU cache and the CPU tier are reset and the CPU region
    poisoned, so the next pass is served from files.
    ``after_pass(n)`` runs once pass ``n``'s file I/O drained (a lane snapshots a
    tier's counters there).
    """
    results: list[PassResult] = []
    for n in range(passes):
        if n:
            reset_all(session)
            _poison_region(session)
        read_before = Counter(probe.read_per_group())
        failures = (len(probe.store_failures), len(probe.load_failures))
        for i, (prompt, max_tokens) in enumerate(prompts):
            if not warm_gpu:
                assert session.reset_prefix_cache(), "GPU prefix-cache reset refused between requests"
            session.add_request(RequestSpec(f"p{n}r{i}", prompt, max_tokens=max_tokens))
            run_until_idle(session)
            drain_files(session)
        if after_pass is not None:
            after_pass(n)
        read = Counter(probe.read_per_group())
        read.subtract(read_before)
        results.append(
            PassResult(
                written=dict(file_stats(root).files_per_group),
                read={g: c for g, c in read.items() if c},
                store_failures=len(probe.store_failures) - failures[0],
                load_failures=len(probe.load_failures) - failures[1],
            )
        )
    return results
