"""The tiering spec's CPU region loses its ``/dev/shm`` name once every opener has mapped it.

:func:`vllm_adapter.tiering.region_mapped` over vLLM's own ``SharedOffloadRegion``: in any
order of the openers (vLLM's engine maps the workers first, kvchunk's driver the scheduler
side first), the name stays while an opener has yet to map the region -- one that found no
name would create a second region -- and is gone after the last; every opener then shares
the same bytes.  An opener in another process counts (vLLM's multiprocess executor).
"""

from __future__ import annotations

import itertools
import mmap
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm_adapter import tiering  # noqa: E402
from vllm_adapter import vllm_api as V  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")

PAGE = mmap.PAGESIZE
SCHEDULER = "scheduler"


def _open(engine_id: str, opener: str) -> Any:
    """A region as the scheduler side (rank None) or worker ``w<rank>`` maps it."""
    rank = None if opener == SCHEDULER else int(opener[1:])
    return V.SharedOffloadRegion(
        engine_id=engine_id,
        num_chunks=2,
        rank=rank,
        kv_bytes_per_chunk=2 * PAGE,
        cpu_page_size=PAGE,
    )


def _number(opener: str) -> int:
    return (
        tiering.SCHEDULER_OPENER if opener == SCHEDULER else tiering.worker_opener(int(opener[1:]))
    )


@contextmanager
def _engine() -> Iterator[tuple[str, Path]]:
    """A fresh engine id and its region's path; the path is removed afterwards."""
    engine_id = f"kvchunk-test-{uuid.uuid4().hex}"
    path = Path(f"/dev/shm/vllm_offload_{engine_id}.mmap")
    try:
        yield engine_id, path
    finally:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize(
    "order", list(itertools.permutations((SCHEDULER, "w0", "w1"))), ids="-".join
)
def test_the_name_goes_with_the_last_opener_and_all_share_one_region(
    order: tuple[str, ...],
) -> None:
    with _engine() as (engine_id, path):
        regions = []
        try:
            for i, opener in enumerate(order):
                regions.append(_open(engine_id, opener))
                unlinked = tiering.region_mapped(regions[-1], opener=_number(opener), openers=3)
                last = i == len(order) - 1
                assert unlinked == last and path.exists() != last, (
                    f"after {order[: i + 1]} the name is {'there' if path.exists() else 'gone'}"
                )
            regions[0].base_tensor[5] = 42
            assert all(int(r.base_tensor[5]) == 42 for r in regions), (
                "the openers map different regions"
            )
        finally:
            for region in regions:
                region.cleanup()


def test_an_opener_in_another_process_counts() -> None:
    """A worker process maps the region and writes to it; the scheduler side, mapping last,
    unlinks the name and sees the worker's bytes."""
    with _engine() as (engine_id, path):
        code = (
            "import sys; from vllm_adapter import tiering; from vllm_adapter import vllm_api as V\n"
            f"r = V.SharedOffloadRegion(engine_id={engine_id!r}, num_chunks=2, rank=0, "
            f"kv_bytes_per_chunk={2 * PAGE}, cpu_page_size={PAGE})\n"
            "r.base_tensor[7] = 99\n"
            "print(tiering.region_mapped(r, opener=tiering.worker_opener(0), openers=2), flush=True)\n"
            "sys.stdin.read()\n"
        )
        worker = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        )
        assert worker.stdin is not None and worker.stdout is not None
        try:
            assert worker.stdout.readline().strip() == "False", "the first opener unlinked the name"
            assert path.exists()
            scheduler = _open(engine_id, SCHEDULER)
            try:
                assert tiering.region_mapped(scheduler, opener=tiering.SCHEDULER_OPENER, openers=2)
                assert not path.exists()
                assert int(scheduler.base_tensor[7]) == 99, (
                    "the scheduler side mapped another region"
                )
            finally:
                scheduler.cleanup()
        finally:
            worker.stdin.close()
            worker.wait(timeout=60)


def test_an_opener_not_among_the_openers_is_a_value_error() -> None:
    with _engine() as (engine_id, _):
        region = _open(engine_id, SCHEDULER)
        try:
            with pytest.raises(ValueError, match="opener 3 is not one of the region's 3 openers"):
                tiering.region_mapped(region, opener=3, openers=3)
        finally:
            region.cleanup()
