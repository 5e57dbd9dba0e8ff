"""Deprecated: kvchunk's disk tier moved to :mod:`vllm_adapter.disk` (this path stays one release).

Serve configs that name ``"spec_module_path": "vllm_adapter.safe_fs"`` keep working;
use ``"vllm_adapter.disk"``.
"""

from __future__ import annotations

import warnings

from vllm_adapter.disk.tier import *  # noqa: F403
from vllm_adapter.disk.tier import KvchunkFileTierManager, KvchunkTieringOffloadingSpec

__all__ = ["KvchunkFileTierManager", "KvchunkTieringOffloadingSpec"]

warnings.warn(
    "vllm_adapter.safe_fs is deprecated: use \"spec_module_path\": \"vllm_adapter.disk\" "
    "(the disk tier is the vllm_adapter.disk package)",
    DeprecationWarning,
    stacklevel=2,
)
