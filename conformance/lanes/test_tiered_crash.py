"""Faults lane, tiered: an engine killed with ``SIGKILL`` leaves nothing behind.

An engine process (the tiny Llama fixture's single full-attention group, 16-token blocks,
``blocks_per_chunk`` 2, 8 CPU chunks, a file tier under a fresh root) serves one
200-token request, so its CPU tier (vLLM's ``SharedOffloadRegion``, the ``/dev/shm`` file
``vllm_offload_<engine_id>.mmap``) is mapped and its chunks are on disk; it waits for
its file writes, reports its engine id, and is killed with ``SIGKILL``.  Afterwards
``/dev/shm`` must hold no region of that engine (nothing runs at exit: only a name
unlinked while the engine ran is gone) and the root no temporary file (``*.tmp``); the
complete chunk files stay (they are valid cache entries).

``spec``: ``kvchunk`` is kvchunk's serving spec (``KvchunkTieringOffloadingSpec``: its
file tier, the reference worker), which unlinks the region's name once every opener has
mapped it (:func:`vllm_adapter.tiering.region_mapped`).  ``vllm`` is vLLM's own
``TieringOffloadingSpec`` (scheduler side and file tier; its worker needs CUDA, so the
driver's emulated transfer engine stands in, which maps nothing): vLLM's scheduler
side is the last opener in vLLM's engine (it is built after every worker registered its
KV caches) and unlinks nothing while the engine runs, so its region survives the kill
-- the recorded deviation ``tiering-region-outlives-sigkill`` (strict xfail).

The engine is this module run as a script (``python -m conformance.lanes.test_tiered_crash
SPEC ROOT``); the test removes whatever region its engine left.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
SPECS = ("kvchunk", "vllm")
DEVIATION_CASE = "tiering-region-sigkill"
READY_TIMEOUT_S = 240.0
NUM_GPU_BLOCKS = 64
NUM_CPU_CHUNKS = 8
PROMPT_LEN = 200


def region_files(engine_id: str, shm: Path = SHM) -> list[Path]:
    """The ``/dev/shm`` files of an engine's region: vLLM's ``vllm_offload_<engine_id>.mmap``
    and its segment files (``.mmap.1``, ...)."""
    name = f"vllm_offload_{engine_id}.mmap"
    return sorted(
        p for p in shm.glob(f"{name}*") if p.name == name or p.name.startswith(f"{name}.")
    )


def _spec_entries(spec: str, root: Path) -> dict[str, Any]:
    from conformance.harness import safe_fs_faults as SF
    from conformance.harness import tiered as T
    from vllm_adapter import names

    if spec == "kvchunk":
        return SF.kvchunk_tiering_spec(root)
    return {
        **T.tiering_spec(root),
        "spec_name": names.TIERING_SPEC,
        "spec_module_path": "vllm.v1.kv_offload.tiering.spec",
    }


def serve_then_wait(spec: str, root: Path) -> None:
    """The engine process: serve one request through ``spec``'s tiers, report, wait to be killed."""
    from conformance.harness import driver as D
    from conformance.harness import tiered as T
    from conformance.protocol.trace import RequestSpec

    kvc = D.full_attention_kv_cache_config(block_size=16, num_blocks=NUM_GPU_BLOCKS)
    extra = {**_spec_entries(spec, root), "blocks_per_chunk": 2, "num_cpu_chunks": NUM_CPU_CHUNKS}
    # vLLM's spec sizes its CPU tier by bytes (num_cpu_chunks is kvchunk's key): keep it small.
    extra["cpu_bytes_to_use"] = 8 << 20
    driver = D.VllmDriver.from_kv_cache_config(
        kvc,
        extra_config=extra,
        prefix_cache_retention_interval=0,
        num_gpu_blocks=NUM_GPU_BLOCKS,
        num_cpu_chunks=NUM_CPU_CHUNKS,
    )
    if spec == "kvchunk":
        session, _ = T.open_session(driver, 128)
    else:  # vLLM's worker needs CUDA: the driver's emulated transfer engine
        session = driver.session(max_num_batched_tokens=128, record=False)
    session.add_request(RequestSpec("a", tuple(range(1, PROMPT_LEN + 1)), max_tokens=2))
    T.run_until_idle(session)
    T.drain_files(session)
    engine_id = session.vllm_config.kv_transfer_config.engine_id
    print(json.dumps({"engine_id": engine_id, "pid": os.getpid()}), flush=True)
    while True:
        time.sleep(60)


def _ready_line(proc: subprocess.Popen[str], timeout_s: float, log: Path) -> dict[str, Any]:
    """The engine's report line (its stdout's first line), within ``timeout_s``."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            raise TimeoutError(f"the engine reported nothing in {timeout_s:.0f} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the engine exited ({proc.wait()}): {log.read_text()[-3000:]}")
    report: dict[str, Any] = json.loads(line)
    return report


def _mapped_by(pid: int, engine_id: str) -> list[str]:
    """The lines of ``/proc/<pid>/maps`` that map the engine's region (``(deleted)``: unlinked)."""
    return [
        line.strip()
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
        if f"vllm_offload_{engine_id}.mmap" in line
    ]


def _expect_deviation(request: pytest.FixtureRequest, spec: str) -> None:
    from conformance.protocol import deviations

    if spec == "vllm":
        dev = deviations.find("vllm", "faults", DEVIATION_CASE)
        if dev is not None:
            request.applymarker(pytest.mark.xfail(strict=True, reason=dev.xfail_reason()))


@pytest.mark.faults
@pytest.mark.skipif(not SHM.is_dir(), reason="vLLM's shared region lives in /dev/shm (Linux)")
@pytest.mark.parametrize("spec", SPECS)
def test_sigkilled_engine_leaves_no_region_and_no_temporary_file(
    spec: str, tmp_path: Path, request: pytest.FixtureRequest, record_property: Any
) -> None:
    """After ``SIGKILL``, ``/dev/shm`` holds no region of the engine and its root no ``*.tmp``."""
    pytest.importorskip("vllm")
    record_property("fixture", "synthetic-full")
    record_property("knob", f"{spec} tiering spec, engine killed with SIGKILL")
    _expect_deviation(request, spec)
    root = tmp_path / "root"
    root.mkdir()
    log = tmp_path / "engine.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conformance.lanes.test_tiered_crash", spec, str(root)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    engine_id = ""
    try:
        report = _ready_line(proc, READY_TIMEOUT_S, log)
        engine_id = report["engine_id"]
        maps = _mapped_by(proc.pid, engine_id)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        left = region_files(engine_id)
        temporary = sorted(root.rglob("*.tmp"))
        chunk_files = [p for p in root.rglob("*") if p.is_file() and p.suffix != ".tmp"]
        summary = (
            f"engine {engine_id}: mapped {maps}; left in /dev/shm {left}; root {chunk_files[:3]}"
        )
        record_property("counter:shm_regions_left", len(left))
        record_property("counter:tmp_files_left", len(temporary))
        assert maps, f"the engine never mapped its CPU tier region: {summary}"
        assert chunk_files, f"the engine wrote no chunk file: {summary}"
        assert not temporary, f"temporary files left in the root: {temporary}"
        assert not left, f"the killed engine's CPU tier region is still in /dev/shm: {summary}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for path in region_files(engine_id) if engine_id else ():
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # this engine's own region only


if __name__ == "__main__":
    spec_name, root_dir = sys.argv[1:]
    if spec_name not in SPECS:
        sys.exit(f"spec must be one of {SPECS}, not {spec_name!r}")
    serve_then_wait(spec_name, Path(root_dir))
