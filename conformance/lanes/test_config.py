"""Lane 1 (config): knob resolution, vLLM's real config path against the reference.

For every fixture and knob: where vLLM's ``build_offloading_config`` and
``SchedulerOffloadConfig`` accept the knob, the reference resolves it to the
same values field by field; where vLLM raises a ValueError, so does the
reference.  For knobs only kvchunk accepts, the kvchunk connector's scheduler
runs exactly what the reference resolved.  Known disagreements are strict
xfails from ``conformance/protocol/deviations/vllm-<release>.toml`` (the installed release).
The checks are :mod:`conformance.checks.config`'s (the meta lane runs them too).
"""

from __future__ import annotations

from typing import Any

import pytest

from conformance.harness import cases
from conformance.protocol import deviations
from vllm_adapter.names import KVCHUNK_CONNECTOR, KVCHUNK_CONNECTOR_MODULE

pytestmark = [pytest.mark.config]

from conformance.testing.requires import require_vllm  # noqa: E402

require_vllm()

from conformance.checks import config as C  # noqa: E402

ConfigCase = cases.Case
CASES = cases.config_cases()
"""Every fixture vLLM plans x every knob of :data:`conformance.harness.cases.CONFIG_KNOBS`."""


@pytest.mark.parametrize("case", CASES, ids=str)
def test_resolution_agrees(case: ConfigCase, backend: Any, request: pytest.FixtureRequest) -> None:
    if backend.name != "vllm" and backend.planner is not None:
        pytest.skip("the config lane compares vLLM's own config path; backends plug in at the plan lane")
    dev = deviations.find("vllm", "config", str(case))
    if dev is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=dev.xfail_reason()))
    C.resolution_agrees(case)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.knob.extra.get("block_size") == 512], ids=str
)
def test_kvchunk_connector_runs_what_the_reference_resolved(case: ConfigCase) -> None:
    C.kvchunk_connector_runs_the_reference(case, KVCHUNK_CONNECTOR, KVCHUNK_CONNECTOR_MODULE)


DEVIATION_CASES = [c for c in CASES if deviations.find("vllm", "config", str(c)) is not None]
"""Cases whose :func:`test_resolution_agrees` is a strict xfail (a recorded deviation)."""


@pytest.mark.parametrize("case", DEVIATION_CASES, ids=str)
def test_config_deviation_is_a_vllm_rejection(case: ConfigCase) -> None:
    C.deviation_holds(case)


CLEAN_REJECTIONS = [c for c in CASES if str(c.knob) in ("blocks_per_chunk=0", "block_size=100")
                    and c.fixture == "synthetic-full-mamba-align" or str(c.knob) == "blocks_per_chunk=0"]
"""Knobs vLLM refuses by validation: a zero chunk, a block_size off the (uniform) block size."""


@pytest.mark.parametrize("case", CLEAN_REJECTIONS, ids=str)
def test_vllm_rejects_the_knob_cleanly(case: ConfigCase) -> None:
    C.vllm_rejects_cleanly(case)
