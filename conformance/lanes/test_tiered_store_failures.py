"""Faults lane, tiered: stores that fail -- full disk, I/O error, a root turned read-only, a
write cut short -- on vLLM's file-system tier and on kvchunk's, side by side.

:mod:`conformance.harness.store_failures` on the faults lane's small synthetic
full-attention model (16-token blocks, ``blocks_per_chunk`` 2, 8 CPU chunks: two 200-token
prompts store 12): the two prompts are stored under the fault, the GPU prefix cache and the
CPU tier are reset, the CPU region poisoned, and the prompts asked again (the fault lifted,
but for ``erofs``, whose root stays read-only).  Faults (``fault``): ``enospc`` and ``eio``
(the probe's ``store`` hook raising ``OSError(ENOSPC)`` on every store, ``OSError(EIO)`` on
every second one), ``erofs`` (``OSError(EROFS)`` on every store once the first prompt is
stored: a hook, since the lane runs as root and a read-only bind mount needs a mount
namespace a threaded process cannot make) and ``cut-short`` (``RLIMIT_FSIZE`` at half a
file: the kernel ends the tier's own write short and fails the next, ``EFBIG``).

Tiers (``tier``): ``vllm``, vLLM's own fs tier (``FileSystemTierManager``; known deviations
would be strict xfails, ids ``fs-store-<fault>``), and kvchunk's
(:mod:`vllm_adapter.disk.tier`) in both layouts, ``per_chunk`` and ``packed``.  After each:

* a failed store is reported failed (a job reported done advertises its keys: vLLM marks
  them present and emits ``BlockStored`` events for them), and leaves no file at its
  keys' names;
* asked again, no key of a failed store is advertised: the fs tier's lookup misses it
  (it is looked up) and no load of it is attempted; no load fails;
* every request finishes with the right bytes (the data checker: no corrupted block, no
  foreign byte changed); where some stores went through (``eio``, ``erofs``) the prompt is
  served from their files;
* nothing is left behind: no temporary file under the root, no partial chunk file, no
  reservation pending in kvchunk's ledger (an ``add`` with no ``done``).

The whole matrix (12 cases, each one short round trip) runs in every profile: it takes
a few seconds on 0.34.0.  ``--spec`` is not run here: the cases probe vLLM's and kvchunk's
own file I/O functions, which another spec's tier need not call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conformance.testing.requires import require_vllm  # noqa: E402

require_vllm()

from conformance.harness import spec_option  # noqa: E402
from conformance.harness import store_failures as SFL  # noqa: E402
from conformance.protocol import deviations  # noqa: E402

pytestmark = pytest.mark.faults

CHOSEN = spec_option.chosen()


def _expect_deviation(request: pytest.FixtureRequest, tier: str, fault: str) -> None:
    """vLLM's known store-failure deviations (``fs-store-<fault>``) apply to vLLM's tier."""
    dev = deviations.find("vllm", "faults", f"fs-store-{fault}") if tier == "vllm" else None
    if dev is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=dev.xfail_reason()))


@pytest.mark.parametrize("fault", SFL.FAULTS)
@pytest.mark.parametrize("tier", SFL.TIERS)
def test_failed_store_is_never_advertised(
    tier: str,
    fault: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    record_property: Any,
) -> None:
    record_property("fixture", "synthetic-full")
    record_property("knob", f"blocks_per_chunk=2, {tier} fs tier, store {fault}")
    if CHOSEN is not None:
        pytest.skip(f"store-failure cases probe vLLM's and kvchunk's own tiers; --spec {CHOSEN}")
    _expect_deviation(request, tier, fault)
    outcome = SFL.run_case(tier, fault, tmp_path, monkeypatch)
    record_property("counter:store_calls", outcome.store_calls)
    record_property("counter:store_calls_failed", outcome.failed_calls)
    record_property("counter:store_keys_failed", len(outcome.failed))
    record_property("counter:tier_wrong_loads", outcome.stats.corrupted_loads)
    record_property("counter:files_read", outcome.files_loaded_on_ask)
    SFL.check_outcome(outcome)
