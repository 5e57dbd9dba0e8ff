"""Faults lane, tiered: damaged, missing and unwritable files of vLLM's file-system tier.

:mod:`vllm_adapter.tiering` (vLLM's ``TieringOffloadingSpec`` + fs tier, the reference
worker for GPU <-> CPU) on a small synthetic full-attention model (16-token blocks,
``blocks_per_chunk`` 2, 8 CPU chunks: two 200-token prompts store 12). The round trip of
:func:`conformance.tiered.run_round_trip` stores two prompts, resets the GPU prefix
cache and the CPU tier, poisons the CPU region and asks again, with a fault in between.
Whatever the fault, a load must fail cleanly and its tokens be recomputed -- never
served wrong (the data lane's byte checks), and the engine must not crash. Full disk is
simulated with ``RLIMIT_FSIZE`` (the kernel fails the tier's own ``write`` with
``EFBIG``; ``SIGXFSZ`` ignored), an unwritable directory with a regular file where a
directory must be (the lane runs as root, so permission bits would not stop a write).
"""

from __future__ import annotations

import dataclasses
import resource
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from conformance import deviations  # noqa: E402
from conformance import driver as D  # noqa: E402
from conformance import tiered as T  # noqa: E402
from conformance.trace import RequestSpec  # noqa: E402

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
) -> Any:
    kvc = D.full_attention_kv_cache_config(block_size=16, num_blocks=NUM_GPU_BLOCKS)
    if head_scale != 1.0:
        (group,) = kvc.kv_cache_groups
        spec = group.kv_cache_spec
        group.kv_cache_spec = dataclasses.replace(
            spec, head_size=int(spec.head_size * head_scale)
        )
    extra = {
        **T.tiering_spec(root),
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
) -> T.RoundTrip:
    """The round trip on a fresh engine; ``opened`` runs once the engine (and its fs tier's
    directory) exists, ``between`` after the reset (:func:`conformance.tiered.run_round_trip`)."""
    session, runner = T.open_session(_driver(root), 128)
    try:
        if opened is not None:
            opened()
        return T.run_round_trip(
            session, runner, probe, root, prompt_len=PROMPT_LEN, between=between
        )
    finally:
        T.shutdown(session)


def _no_wrong_bytes(rt: T.RoundTrip, record_property: Any) -> str:
    T.record(rt, record_property)
    stats = rt.stats
    summary = (
        f"{stats.describe()}; files {rt.files_after_store}; read {rt.probe.read_per_group()}; "
        f"load failures {rt.probe.load_failures[:2]}; store failures {rt.probe.store_failures[:2]}"
    )
    assert all(rt.finished.values()), f"requests left unfinished: {rt.finished}; {summary}"
    assert stats.corrupted_loads == 0, f"wrong bytes served: {summary}"
    assert stats.foreign_bytes_changed == 0, summary
    return summary


@pytest.mark.parametrize("how", ["missing", "truncated", "flipped"])
def test_damaged_file_is_recomputed_never_served(
    how: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    record_property: Any,
) -> None:
    record_property("fixture", "synthetic-full")
    record_property("knob", f"blocks_per_chunk=2, fs tier, file {how}")
    _expect_deviation(request, f"fs-file-{how}")
    probe = T.FileProbe().install(monkeypatch)
    rt = _round_trip(tmp_path, probe, lambda: T.corrupt(T.block_files(tmp_path), how))
    summary = _no_wrong_bytes(rt, record_property)
    assert rt.files_after_store.files > 0, f"nothing reached the files: {summary}"
    if how != "missing":
        assert probe.loaded or probe.load_failures, f"no damaged file was read: {summary}"
    if how == "truncated":
        assert probe.load_failures, f"a truncated file loaded without error: {summary}"


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


def test_full_disk_drops_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    record_property("fixture", "synthetic-full")
    record_property("knob", "blocks_per_chunk=2, fs tier, RLIMIT_FSIZE below one file")
    probe = T.FileProbe().install(monkeypatch)
    session, runner = T.open_session(_driver(tmp_path), 128)
    undo = _limit_file_size(1024)
    try:
        rt = T.run_round_trip(
            session, runner, probe, tmp_path, prompt_len=PROMPT_LEN, between=undo
        )
    finally:
        undo()
        T.shutdown(session)
    summary = _no_wrong_bytes(rt, record_property)
    assert probe.store_failures, f"no store failed under the size limit: {summary}"
    assert rt.files_after_store.files == 0 and not probe.loaded, summary
    # The recomputed prompts are stored again once the limit is gone: whole files only.
    leftovers = [
        p for p in tmp_path.rglob("*")
        if p.is_file() and p.name != "config.json" and p.suffix != ".bin"
    ]
    assert not leftovers, f"partial files left behind: {leftovers[:3]}"
    sizes = set(T.file_stats(tmp_path).bytes_per_file.values())
    assert sizes <= {(rt.region_bytes_per_chunk,)}, f"files of sizes {sizes}: {summary}"


def test_unwritable_root_is_a_clear_error_at_start(tmp_path: Path, record_property: Any) -> None:
    record_property("fixture", "synthetic-full")
    record_property("knob", "fs tier root_dir below a regular file")
    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"")
    driver = _driver(blocker / "kv")
    with pytest.raises(OSError, match="not-a-dir"):
        T.open_session(driver, 128)


def test_directory_turned_unwritable_drops_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    record_property("fixture", "synthetic-full")
    record_property("knob", "fs tier rank directory replaced by a regular file after start")
    probe = T.FileProbe().install(monkeypatch)

    def replace_rank_dir() -> None:
        (config,) = tmp_path.rglob("config.json")
        Path(f"{config.parent}_r0").write_bytes(b"")  # where FileMapper puts rank 0's files

    rt = _round_trip(tmp_path, probe, opened=replace_rank_dir)
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


@pytest.mark.parametrize("change", list(RESTARTS))
def test_restart_loads_only_files_of_the_same_layout(
    change: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    record_property: Any,
) -> None:
    """A second engine over the first one's directory: its files only if nothing changed."""
    record_property("fixture", "synthetic-full")
    record_property("knob", f"fs tier restart, {change} changed")
    _expect_deviation(request, f"fs-restart-{change}")
    first, _ = T.open_session(_driver(tmp_path, num_cpu_chunks=16), 128)
    prompt = tuple(range(1000, 1000 + PROMPT_LEN))
    try:
        first.add_request(RequestSpec("a", prompt, max_tokens=2))
        T.run_until_idle(first)
        T.drain_files(first)
    finally:
        T.shutdown(first)
    stored = T.file_stats(tmp_path)
    probe = T.FileProbe().install(monkeypatch)
    second, runner = T.open_session(_driver(tmp_path, **RESTARTS[change]), 128)
    try:
        second.add_request(RequestSpec("a2", prompt, max_tokens=2))
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
