"""Faults lane, tiered: damaged, missing and unwritable files of vLLM's file-system tier.

:mod:`vllm_adapter.tiering` (vLLM's ``TieringOffloadingSpec`` + fs tier, the reference
worker for GPU <-> CPU) on a small synthetic full-attention model (16-token blocks,
``blocks_per_chunk`` 2, 8 CPU chunks: two 200-token prompts store 12). The round trip of
:func:`conformance.harness.tiered.run_round_trip` stores two prompts, resets the GPU prefix
cache and the CPU tier, poisons the CPU region and asks again, with a fault in between.
Whatever the fault, a load must fail cleanly and its tokens be recomputed -- never
served wrong (the data lane's byte checks), and the engine must not crash. Full disk is
simulated with ``RLIMIT_FSIZE`` (the kernel fails the tier's own ``write`` with
``EFBIG``; ``SIGXFSZ`` ignored), an unwritable directory with a regular file where a
directory must be (the lane runs as root, so permission bits would not stop a write).

Every case runs on two file tiers (``tier``): ``vllm``, vLLM's own (its known deviations
``fs-tier-no-checksum`` and ``fs-tier-namespace-ignores-kv-geometry`` are strict xfails),
and ``kvchunk``, :mod:`vllm_adapter.disk.tier` (checksummed, geometry-namespaced, atomic
chunk files; :mod:`conformance.harness.safe_fs_faults`), which must pass all of them: on top,
a damaged file must fail its load, be removed, and a third request must be served from
the rewritten file without a failure.  kvchunk's tier also runs a writer process killed
mid-write, two engines sharing one root, and gemma-4 / DeepSeek-V4 through kvchunk's
connector with every file damaged.

``--spec module:Class`` (a ``TieringOffloadingSpec``) runs that spec instead of both
tiers, over the same fs tier config (ids ``[spec-<Class>]``); a spec with kvchunk's file
tier (a ``KvchunkTieringOffloadingSpec``) also runs kvchunk's tier-only cases, which skip
for any other.  The known deviations are vLLM's stock fs tier's: they stay strict xfails
when the chosen spec is vLLM's ``TieringOffloadingSpec`` itself (or kvchunk's
``ReferenceTieringOffloadingSpec``, the same tier with the reference worker); any other
spec -- a third party's, even one reusing vLLM's fs tier -- must pass every case, since a
spec author ships the tier they chose, and a strict xfail would turn its fixes red.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conformance.testing.requires import require_vllm  # noqa: E402

require_vllm()

from conformance.harness import driver as D  # noqa: E402
from conformance.harness import safe_fs_faults as SF  # noqa: E402
from conformance.harness import spec_option  # noqa: E402
from conformance.harness import tiered as T  # noqa: E402
from conformance.harness.cases import DSV4, GEMMA  # noqa: E402
from conformance.harness.fixture_runs import FixtureCase  # noqa: E402
from conformance.protocol import deviations  # noqa: E402
from conformance.protocol.trace import RequestSpec  # noqa: E402
from vllm_adapter.disk import budget as DB  # noqa: E402
from vllm_adapter.disk import ledger_snapshot as LS  # noqa: E402
from vllm_adapter.disk import options as TO  # noqa: E402
from vllm_adapter.disk import packed_snapshot as PS  # noqa: E402
from vllm_adapter.disk import tier as S  # noqa: E402
from vllm_adapter.disk.lease import LEASE_DIR  # noqa: E402

LEDGER_FILES = (DB.LEDGER_FILE, DB.LOCK_FILE, LS.SNAPSHOT_FILE)
"""The root's budget ledger and its lock (kvchunk's tier state, not partial files)."""

pytestmark = pytest.mark.faults

NUM_GPU_BLOCKS = 64
NUM_CPU_CHUNKS = 8
PROMPT_LEN = 200


def _expect_deviation(request: pytest.FixtureRequest, case: str) -> None:
    dev = deviations.find("vllm", "faults", case)
    if dev is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=dev.xfail_reason()))


def _driver(
    root: Path,
    *,
    blocks_per_chunk: int = 2,
    head_scale: float = 1.0,
    num_cpu_chunks: int = NUM_CPU_CHUNKS,
    tier: str = "vllm",
) -> Any:
    kvc = D.full_attention_kv_cache_config(block_size=16, num_blocks=NUM_GPU_BLOCKS)
    if head_scale != 1.0:
        (group,) = kvc.kv_cache_groups
        spec = group.kv_cache_spec
        group.kv_cache_spec = dataclasses.replace(
            spec, head_size=int(spec.head_size * head_scale)
        )
    # kvchunk's tier, or --spec's over the same fs tier config (skips one that cannot run).
    spec = (
        T.tiering_spec(root)
        if tier == "vllm"
        else spec_option.tiered_lane_entries(SF.kvchunk_tiering_spec(root))
    )
    extra = {
        **spec,
        "blocks_per_chunk": blocks_per_chunk,
        "num_cpu_chunks": num_cpu_chunks,
    }
    return D.VllmDriver.from_kv_cache_config(
        kvc,
        extra_config=extra,
        prefix_cache_retention_interval=0,
        num_gpu_blocks=NUM_GPU_BLOCKS,
        num_cpu_chunks=num_cpu_chunks,
    )


def _round_trip(
    root: Path,
    probe: T.FileProbe,
    between: Callable[[], None] | None = None,
    opened: Callable[[], None] | None = None,
    *,
    tier: str = "vllm",
    after: Callable[[Any], None] | None = None,
) -> T.RoundTrip:
    """The round trip on a fresh engine; ``opened`` runs once the engine (and its fs tier's
    directory) exists, ``between`` after the reset (:func:`conformance.harness.tiered.run_round_trip`),
    ``after`` (with the session) once the round trip is done, before the engine stops."""
    session, runner = T.open_session(_driver(root, tier=tier), 128)
    try:
        if opened is not None:
            opened()
        rt = T.run_round_trip(
            session, runner, probe, root, prompt_len=PROMPT_LEN, between=between
        )
        if after is not None:
            after(session)
        return rt
    finally:
        T.shutdown(session)


def _no_wrong_bytes(rt: T.RoundTrip, record_property: Any) -> str:
    T.record(rt, record_property)
    stats = rt.stats
    record_property("counter:tier_wrong_loads", stats.corrupted_loads)
    record_property("counter:tier_failed_loads", len(rt.probe.load_failures))
    record_property("counter:tier_unfinished_requests", sum(not f for f in rt.finished.values()))
    summary = (
        f"{stats.describe()}; files {rt.files_after_store}; read {rt.probe.read_per_group()}; "
        f"load failures {rt.probe.load_failures[:2]}; store failures {rt.probe.store_failures[:2]}"
    )
    assert all(rt.finished.values()), f"requests left unfinished: {rt.finished}; {summary}"
    assert stats.corrupted_loads == 0, f"wrong bytes served: {summary}"
    assert stats.foreign_bytes_changed == 0, summary
    return summary


CHOSEN = spec_option.chosen()
TIERS = ["vllm", "kvchunk"] if CHOSEN is None else [CHOSEN.id]
"""vLLM's fs tier, and kvchunk's (``vllm_adapter.disk.tier``): every fault case runs on both;
with ``--spec``, on that spec only."""


def _kvchunk(tier: str) -> bool:
    """Whether ``tier`` is kvchunk's file tier (``--spec``: a spec with kvchunk's tier)."""
    return SF.chosen_has_kvchunk_tier() if CHOSEN is not None else tier == "kvchunk"


def _stock(tier: str) -> bool:
    """Whether ``tier`` is vLLM's stock fs tier as the deviations were recorded on it."""
    if CHOSEN is None:
        return tier == "vllm"
    return any(
        CHOSEN.module == module and CHOSEN.name == name
        for module, name in (
            ("vllm.v1.kv_offload.tiering.spec", "TieringOffloadingSpec"),
            (T.TIERING_SPEC_ENTRIES["spec_module_path"], T.TIERING_SPEC_ENTRIES["spec_name"]),
        )
    )


def _kvchunk_tier_only() -> None:
    """Skip a case of kvchunk's tier alone when ``--spec`` chose a spec with another tier."""
    if CHOSEN is not None and not SF.chosen_has_kvchunk_tier():
        pytest.skip(f"a case of kvchunk's file tier; --spec {CHOSEN} has another tier")


def _expect_stock_deviation(request: pytest.FixtureRequest, tier: str, case: str) -> None:
    """vLLM's known deviations apply to vLLM's tier; any other tier must pass every case."""
    if _stock(tier):
        _expect_deviation(request, case)


def _files_on_disk(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


@pytest.mark.parametrize("how", SF.FAULTS)
@pytest.mark.parametrize("tier", TIERS)
def test_damaged_file_is_recomputed_never_served(
    tier: str,
    how: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    record_property: Any,
) -> None:
    """A damaged file is a failed load (recompute), never wrong KV; on kvchunk's tier it is
    removed and rewritten, so a third request is served from files without a failure."""
    record_property("fixture", "synthetic-full")
    record_property("knob", f"blocks_per_chunk=2, {tier} fs tier, file {how}")
    _expect_stock_deviation(request, tier, f"fs-file-{how}")
    probe = _probe(tier).install(monkeypatch)
    seen: dict[str, Any] = {}

    def damage() -> None:
        SF.damage(T.block_files(tmp_path), how)
        seen["damaged"] = {str(p): p.stat().st_ino for p in T.block_files(tmp_path)}

    def serve_again(session: Any) -> None:
        counters = SF.tier_of(session).counters
        seen["recompute"] = (len(probe.loaded), len(probe.load_failures), counters.bad_paths())
        # a rewrite is a new file (written aside, renamed over): a new inode
        seen["untouched"] = {p for p, ino in seen["damaged"].items()
                             if os.path.exists(p) and os.stat(p).st_ino == ino}
        SF.serve_again(session, PROMPT_LEN)
        seen["counters"] = counters

    rt = _round_trip(
        tmp_path,
        probe,
        damage,
        tier=tier,
        after=serve_again if _kvchunk(tier) else None,
    )
    summary = _no_wrong_bytes(rt, record_property)
    assert rt.files_after_store.files > 0, f"nothing reached the files: {summary}"
    if how != "missing":
        assert probe.loaded or probe.load_failures, f"no damaged file was read: {summary}"
    if how == "truncated":
        assert probe.load_failures, f"a truncated file loaded without error: {summary}"
    if not _kvchunk(tier):
        return
    read, failed, bad = seen["recompute"]
    _recomputed_then_served(probe, how, read, failed, bad, seen["counters"], summary,
                            record_property)
    # A damaged file fails at most once: the damaged round may not reach every file (when
    # vLLM's CPU tier is full it refuses a recomputed request's stores, and loads only what
    # fits), so the third request may meet one the damaged round did not read, never one
    # it did (checked by _recomputed_then_served) nor the same file twice.
    failed_paths = seen["counters"].bad_paths()
    twice = sorted({p for p in failed_paths if failed_paths.count(p) > 1})
    assert not twice, f"a file failed twice: {twice}; {summary}"
    fresh = sorted(set(failed_paths[len(bad):]) - seen["untouched"])
    assert not fresh, f"the third request failed on files written after the damage: {fresh}; {summary}"


def _recomputed_then_served(
    probe: T.FileProbe,
    how: str,
    read: int,
    failed: int,
    bad: list[str],
    counters: S.TierCounters,
    summary: str,
    record_property: Any,
) -> None:
    """kvchunk's tier after damaged files (``read`` / ``failed`` / ``bad``: the probe's counts
    and the tier's bad files once the damaged round was served): no damaged file loaded, each
    bad one removed, and the third request served from files, none of which is one that
    failed before (those were rewritten by the recompute; a damaged file the damaged round
    did not reach may still fail, once)."""
    summary += f"; kvchunk tier {counters}; after the recompute: {read} read, {failed} failed"
    record_property("counter:kvchunk_bad_files", sum(counters.bad_files.values()))
    if how == "missing":
        assert failed == 0 and read == 0, f"missing files were read: {summary}"
    else:
        assert failed > 0 and read == 0, f"a damaged file loaded: {summary}"
        assert counters.bad_files_removed == sum(counters.bad_files.values()) > 0, summary
    again = sorted(set(counters.bad_paths()[len(bad):]) & set(bad))
    assert not again, f"files failed again after the recompute rewrote them: {again}; {summary}"
    assert len(probe.loaded) - read > 0, f"the third request was not served from files: {summary}"


MODEL_CASES = [
    # As the tiered data lane's block_size cases (conformance/lanes/test_tiered.py): the CPU
    # tier holds fewer chunks than the two prompts store, so both come back from files.
    FixtureCase(GEMMA, (("block_size", 512),), True, 384, 16, 600),
    FixtureCase(DSV4, (("block_size", 512),), True, 256, 12, 600),
]


@pytest.mark.parametrize("how", ["flipped", "swapped"])
@pytest.mark.parametrize("case", MODEL_CASES, ids=str)
def test_kvchunk_tier_damaged_files_on_models(
    case: FixtureCase,
    how: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    record_property: Any,
) -> None:
    """gemma-4 and DeepSeek-V4 through kvchunk's connector and tier: every file damaged after
    the store; recomputed, never served, then served from the rewritten files."""
    record_property("fixture", case.fixture)
    record_property("knob", f"{case.extra[0][0]}={case.extra[0][1]}, kvchunk fs tier, file {how}")
    _kvchunk_tier_only()
    probe = SF.ChunkProbe().install(monkeypatch)
    session, runner = T.open_session(
        case.driver(spec=spec_option.tiered_lane_entries(SF.kvchunk_tiering_spec(tmp_path))),
        case.workload_budget,
    )
    try:
        rt = T.run_round_trip(
            session, runner, probe, tmp_path, prompt_len=case.workload_prompt_len,
            between=lambda: SF.damage(T.block_files(tmp_path), how),
        )
        counters = SF.tier_of(session).counters
        read, failed, bad = len(probe.loaded), len(probe.load_failures), counters.bad_paths()
        SF.serve_again(session, case.workload_prompt_len)
    finally:
        T.shutdown(session)
    summary = _no_wrong_bytes(rt, record_property)
    assert rt.files_after_store.files > rt.primary_chunks, f"nothing beyond the CPU tier: {summary}"
    _recomputed_then_served(probe, how, read, failed, bad, counters, summary, record_property)


def _limit_file_size(limit: int) -> Callable[[], None]:
    """``RLIMIT_FSIZE`` for this process (larger writes fail with ``EFBIG``, ``SIGXFSZ``
    ignored); returns the (idempotent) undo."""
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


def _probe(tier: str) -> T.FileProbe:
    return SF.probe_for(_kvchunk(tier))


def _file_bytes(tier: str, row: int) -> int:
    """A whole chunk file of ``tier`` for a ``row``-byte CPU-tier row."""
    return SF.file_bytes(_kvchunk(tier), row)


@pytest.mark.parametrize("tier", TIERS)
def test_full_disk_drops_the_store(
    tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    record_property("fixture", "synthetic-full")
    record_property("knob", f"blocks_per_chunk=2, {tier} fs tier, RLIMIT_FSIZE below one file")
    probe = _probe(tier).install(monkeypatch)
    session, runner = T.open_session(_driver(tmp_path, tier=tier), 128)
    undo = _limit_file_size(1024)
    kvchunk_failures = 0
    try:
        rt = T.run_round_trip(
            session, runner, probe, tmp_path, prompt_len=PROMPT_LEN, between=undo
        )
    finally:
        undo()
        if _kvchunk(tier):
            kvchunk_failures = SF.tier_of(session).counters.store_failures
        T.shutdown(session)
    summary = _no_wrong_bytes(rt, record_property)
    # kvchunk's tier fails the store at its reservation (the ledger's append passes the
    # limit first), before the probed file write; its own counter says so
    assert probe.store_failures or kvchunk_failures, (
        f"no store failed under the size limit: {summary}")
    assert rt.files_after_store.files == 0 and not probe.loaded, summary
    # The recomputed prompts are stored again once the limit is gone: whole files only.
    leftovers = [
        p for p in _files_on_disk(tmp_path)
        if p.name not in ("config.json", S.GEOMETRY_FILE, PS.SNAPSHOT_FILE, *LEDGER_FILES)
        and p.suffix != ".bin"
        and p.parent.name != LEASE_DIR
    ]
    assert not leftovers, f"partial files left behind: {leftovers[:3]}"
    sizes = set(T.file_stats(tmp_path).bytes_per_file.values())
    whole = (_file_bytes(tier, rt.region_bytes_per_chunk),)
    assert sizes <= {whole}, f"files of sizes {sizes}, whole files have {whole}: {summary}"


@pytest.mark.parametrize("tier", TIERS)
def test_unwritable_root_is_a_clear_error_at_start(
    tier: str, tmp_path: Path, record_property: Any
) -> None:
    record_property("fixture", "synthetic-full")
    record_property("knob", f"{tier} fs tier root_dir below a regular file")
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    if _kvchunk(tier):  # kvchunk's spec: a ValueError naming the key, before vLLM sees it
        with pytest.raises(ValueError, match="'root_dir' in secondary_tiers.*not-a-dir"):
            T.open_session(_driver(blocker / "kv", tier=tier), 128)
        return
    with pytest.raises(OSError, match="not-a-dir"):
        T.open_session(_driver(blocker / "kv", tier=tier), 128)


@pytest.mark.parametrize("tier", TIERS)
def test_directory_turned_unwritable_drops_stores(
    tier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    record_property("fixture", "synthetic-full")
    record_property("knob", f"{tier} fs tier rank directory replaced by a regular file after start")
    probe = _probe(tier).install(monkeypatch)

    def replace_rank_dir() -> None:
        (config,) = tmp_path.rglob("config.json")
        Path(f"{config.parent}_r0").write_bytes(b"")  # where FileMapper puts rank 0's files

    rt = _round_trip(tmp_path, probe, opened=replace_rank_dir, tier=tier)
    summary = _no_wrong_bytes(rt, record_property)
    assert probe.store_failures, f"stores into a non-directory did not fail: {summary}"
    assert rt.files_after_store.files == 0 and not probe.loaded, summary


# Both engines hold the whole prompt in the CPU tier (16 chunks): the property here is
# which files a restarted engine reads.
RESTARTS: dict[str, dict[str, Any]] = {
    "same": {"num_cpu_chunks": 16},
    "block_size": {"blocks_per_chunk": 4, "num_cpu_chunks": 16},
    "geometry": {"head_scale": 0.5, "num_cpu_chunks": 16},
}
RESTART_PROMPT = tuple(range(1000, 1000 + PROMPT_LEN))


def _store_and_stop(root: Path, tier: str) -> T.FileStats:
    """A first engine stores :data:`RESTART_PROMPT` to files and stops."""
    first, _ = T.open_session(_driver(root, num_cpu_chunks=16, tier=tier), 128)
    try:
        first.add_request(RequestSpec("a", RESTART_PROMPT, max_tokens=2))
        T.run_until_idle(first)
        T.drain_files(first)
    finally:
        T.shutdown(first)
    return T.file_stats(root)


@pytest.mark.parametrize("change", list(RESTARTS))
@pytest.mark.parametrize("tier", TIERS)
def test_restart_loads_only_files_of_the_same_layout(
    tier: str,
    change: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    record_property: Any,
) -> None:
    """A second engine over the first one's directory: its files only if nothing changed."""
    record_property("fixture", "synthetic-full")
    record_property("knob", f"{tier} fs tier restart, {change} changed")
    _expect_stock_deviation(request, tier, f"fs-restart-{change}")
    stored = _store_and_stop(tmp_path, tier)
    probe = _probe(tier).install(monkeypatch)
    second, runner = T.open_session(_driver(tmp_path, tier=tier, **RESTARTS[change]), 128)
    try:
        second.add_request(RequestSpec("a2", RESTART_PROMPT, max_tokens=2))
        T.run_until_idle(second)
    finally:
        T.shutdown(second)
    stats = runner.stats
    summary = f"{stats.describe()}; stored {stored}; read {probe.read_per_group()}"
    record_property("counter:files_written", stored.files)
    record_property("counter:files_read", len(probe.loaded))
    assert stored.files > 0, summary
    assert stats.corrupted_loads == 0 and stats.foreign_bytes_changed == 0, summary
    if change == "same":
        assert probe.loaded and stats.loaded_blocks_checked > 0, f"no file reused: {summary}"
    else:
        assert not probe.loaded, f"files of another {change} were loaded: {summary}"
    if _kvchunk(tier) and change != "same":
        namespaces = sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and p.name != LEASE_DIR)
        assert len(namespaces) == 2, f"one namespace directory per geometry: {namespaces}"


def test_kvchunk_tier_writer_killed_mid_write_leaves_no_file_to_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    """A writer ``SIGKILL``-ed in the middle of a chunk file leaves a temporary file only: the
    restarted engine misses that chunk (recompute), never reads half a file, and rewrites it."""
    record_property("fixture", "synthetic-full")
    record_property("knob", "kvchunk fs tier, writer process killed mid-write")
    _kvchunk_tier_only()
    stored = _store_and_stop(tmp_path, "kvchunk")
    victims = T.block_files(tmp_path)[:2]
    geometry = json.loads(next(tmp_path.rglob(S.GEOMETRY_FILE)).read_text())
    namespace = TO.namespace_digest(geometry)
    left: list[Path] = []
    for path in victims:
        path.unlink()
        left += SF.kill_mid_write(path, namespace, bytes(16), geometry["file_payload_bytes"])
    assert left and all(p.suffix == ".tmp" for p in left), f"the killed writer left {left}"
    assert not any(p.exists() for p in victims), "a killed writer published a file"
    probe = SF.ChunkProbe().install(monkeypatch)
    second, runner = T.open_session(_driver(tmp_path, num_cpu_chunks=16, tier="kvchunk"), 128)
    try:
        second.add_request(RequestSpec("a2", RESTART_PROMPT, max_tokens=2))
        T.run_until_idle(second)
        read_before = len(probe.loaded)
        T.drain_files(second)
        T.reset_all(second)
        T._poison_region(second)
        second.add_request(RequestSpec("a3", RESTART_PROMPT, max_tokens=2))
        T.run_until_idle(second)
    finally:
        T.shutdown(second)
    stats = runner.stats
    summary = f"{stats.describe()}; stored {stored}; read {len(probe.loaded)}; {probe.load_failures}"
    assert stats.corrupted_loads == 0 and stats.foreign_bytes_changed == 0, summary
    assert not probe.load_failures, f"a file failed (half a file was published?): {summary}"
    assert not any(p in map(str, victims) for p in probe.loaded[:read_before]), summary
    assert all(p.exists() for p in victims), f"the recomputed chunks were not rewritten: {summary}"
    assert len(probe.loaded) - read_before >= stored.files, (
        f"the request after the recompute was not served from files: {summary}"
    )


def test_kvchunk_tier_two_engines_share_a_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    """Two engines of the same geometry store and load the same prompts over one root at once
    (their file I/O threads interleave): every load is whole and right, none fails."""
    record_property("fixture", "synthetic-full")
    record_property("knob", "kvchunk fs tier, two engines on one root_dir")
    _kvchunk_tier_only()
    probe = SF.ChunkProbe().install(monkeypatch)
    sessions = [T.open_session(_driver(tmp_path, tier="kvchunk"), 128) for _ in range(2)]
    try:
        for rnd in range(3):
            for i, prompt in enumerate(SF.prompts(PROMPT_LEN)):
                for e, (session, _) in enumerate(sessions):
                    session.add_request(RequestSpec(f"e{e}r{rnd}p{i}", prompt, max_tokens=2))
            while any(s.has_work() for s, _ in sessions):
                for session, _ in sessions:
                    if session.has_work():
                        session.step()
                time.sleep(0.001)
            for session, _ in sessions:  # the next round must come from files
                T.drain_files(session)
                T.reset_all(session)
                T._poison_region(session)
    finally:
        for session, _ in sessions:
            T.shutdown(session)
    stats = [runner.stats for _, runner in sessions]
    summary = "; ".join(s.describe() for s in stats) + f"; read {len(probe.loaded)}"
    assert all(s.corrupted_loads == 0 and s.foreign_bytes_changed == 0 for s in stats), summary
    assert not probe.load_failures, f"a shared file failed: {probe.load_failures[:2]}; {summary}"
    assert all(s.loaded_blocks_checked > 0 for s in stats), f"an engine read no file: {summary}"
