"""Lane 1 (config), fixture drift: each geometry fixture the lanes load equals what the
installed vLLM's own KV-cache planning derives now (:mod:`vllm_adapter.derive`).

For a known release that is its stored fixture (``vllm_adapter/fixtures/<release>/``):
a stored fixture that disagrees with vLLM is a failure naming the fixture, the group
and the field.  For a build with no stored fixtures (dev, rc, post, newer) it is the
live derivation cached for the session, re-derived.  About 4 s on CPU for all six.
"""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.config]

from conformance.testing.requires import require_vllm  # noqa: E402

require_vllm()

from vllm_adapter import fixtures as F  # noqa: E402
from vllm_adapter import vllm_api as V  # noqa: E402
from vllm_adapter.derive import derive  # noqa: E402


@pytest.mark.parametrize("name", F.fixture_names())
def test_fixture_equals_live_derivation(name: str) -> None:
    stored = F.load_fixture(name)
    derived = json.loads(json.dumps(derive(name)))
    differences = F.fixture_differences(stored, derived)
    assert not differences, (
        f"fixture {name} ({F.fixture_path(name)}) disagrees with vLLM {V.VLLM_VERSION}'s live "
        f"derivation in {len(differences)} field(s): " + "; ".join(differences[:8])
        + " (regenerate: python -m vllm_adapter.fixtures regenerate --check)"
    )
