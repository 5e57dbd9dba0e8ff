"""``require_vllm()``: vLLM for a test module, a skip only where vLLM is optional.

nox's per-release sessions set ``KVCHUNK_VLLM`` (the release under test); there a
failed ``import vllm`` means the install is broken, and it must fail the module (a
collection error is red), not turn its tests into skips.  Without ``KVCHUNK_VLLM``
(a developer's checkout with no vLLM, ``nox -s corpus_replay``) the module skips,
as ``pytest.importorskip`` does.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest

ENV = "KVCHUNK_VLLM"


def require_vllm() -> ModuleType:
    """The ``vllm`` module; skips the caller when it is missing and ``KVCHUNK_VLLM`` is unset.

    With ``KVCHUNK_VLLM`` set, an ``ImportError`` is re-raised with the release named: at
    module level it is a collection error, inside a test a failure.
    """
    release = os.environ.get(ENV)
    if not release:
        return pytest.importorskip("vllm")
    try:
        return importlib.import_module("vllm")
    except ImportError as exc:
        raise ImportError(
            f"{ENV}={release} is set (nox sets it: vLLM must be installed), but `import vllm` "
            f"failed: {exc}; fix the install, or unset {ENV} to skip the vLLM tests"
        ) from exc
