"""One memory-heavy lane per machine: the economics lanes' lock.

The two economics lanes (``test_tiered_economics``, ``test_tiered_eviction_economics``)
and the hybrid soak (``test_tiered_soak_hybrid``, whose CPU tier is small but whose
gemma-4 rows are 40 MiB) run real-model geometries (gemma-4, DeepSeek-V4) through vLLM's scheduler with a CPU tier
that holds every chunk of a pass.  One such case peaks at about :data:`PEAK_RSS_GIB` GiB
resident, against 24 GiB on the CI machine.  Measured on vLLM 0.34.0, ``ci`` profile,
2026-12-05, with ``/usr/bin/time -v python -m pytest -p conformance.plugin CASE``:

* ``test_tiered_economics.py::test_predicted_files_are_the_files_written[gemma-4-31B-it-tp2-
  block_size512-shared-prefix-retention=0]`` alone: maximum resident set 10,172,968 KiB;
* the heaviest DeepSeek-V4 eviction case alone: 4,460,588 KiB;
* both lanes in one process: 14,088,996 KiB, and up to 3.8 GiB more in ``/dev/shm``.

CI runs both releases' chains side by side (``.ci/run``), so two such processes at once
would not fit.  The lock is held for a whole lane module, as the process keeps much of its
peak until the module's engines are gone; under ``-n`` both lanes are one ``xdist_group``
(``heavy``), so one worker per chain runs them while the others run the rest of the suite.
"""

from __future__ import annotations

import fcntl
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HEAVY_LANE_LOCK = Path(tempfile.gettempdir()) / "kvchunk-heavy-lane.lock"
PEAK_RSS_GIB = 9.7
"""Peak resident memory of the heaviest economics case (the module docstring's measurement)."""
waited_s = 0.0
"""Seconds the last acquisition waited for another process; the conformance plugin moves
it into the waiting case's report (``lock_wait_s``), so case times exclude the wait."""


@pytest.fixture(autouse=True, scope="module")
def one_heavy_lane_per_machine() -> Iterator[None]:
    """Held while the importing lane module runs (autouse: importing it is using it)."""
    global waited_s
    with HEAVY_LANE_LOCK.open("w") as lock:
        start = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        waited_s = time.monotonic() - start
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
