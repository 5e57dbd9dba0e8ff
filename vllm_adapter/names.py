"""Names that configs refer to kvchunk and vLLM parts by, defined once.

No vLLM import here: the CLI, the conformance suite and the tests spell connector
and spec names through these constants, so renaming a class changes one line.
"""

from __future__ import annotations

KVCHUNK_CONNECTOR = "KvchunkOffloadingConnector"
"""kvchunk's connector class (``kv_connector``)."""

KVCHUNK_CONNECTOR_MODULE = "vllm_adapter.connector"
"""Where vLLM imports kvchunk's connector from (``kv_connector_module_path``)."""

STOCK_CONNECTOR = "OffloadingConnector"
"""vLLM's own offloading connector."""

CPU_SPEC = "CPUOffloadingSpec"
"""vLLM's CPU-tier offloading spec (the default ``spec_name``)."""

TIERING_SPEC = "TieringOffloadingSpec"
"""vLLM's tiered (CPU + secondary tiers such as the file system) offloading spec."""

REFERENCE_SPEC_NAME = "ReferenceOffloadingSpec"
"""kvchunk's spec whose worker is the reference transfer."""

REFERENCE_SPEC_MODULE = "vllm_adapter.spec"

REFERENCE_SPEC = {"spec_name": REFERENCE_SPEC_NAME, "spec_module_path": REFERENCE_SPEC_MODULE}
"""The ``kv_connector_extra_config`` entries that select the reference worker."""


def connector_module(connector: str) -> str | None:
    """The module path a connector name needs: kvchunk's, or ``None`` for vLLM's own."""
    return KVCHUNK_CONNECTOR_MODULE if connector == KVCHUNK_CONNECTOR else None


KVCHUNK_TIERING_SPEC_NAME = "KvchunkTieringOffloadingSpec"
"""kvchunk's serving tiering spec: vLLM's tiering with a checksummed, geometry-namespaced file tier."""

KVCHUNK_TIERING_SPEC_MODULE = "vllm_adapter.disk"

KVCHUNK_TIERING_SPEC = {
    "spec_name": KVCHUNK_TIERING_SPEC_NAME,
    "spec_module_path": KVCHUNK_TIERING_SPEC_MODULE,
}
"""The ``kv_connector_extra_config`` entries that select it."""

KVCHUNK_FS_TIER = "kvchunk_fs"
"""The secondary-tier ``type`` its file tier registers under (``"fs"`` tiers become it)."""
