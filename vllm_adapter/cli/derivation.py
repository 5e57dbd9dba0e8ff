"""vLLM's KV planning for a :class:`Request` (:func:`vllm_adapter.derive.derive_live`).

vLLM is imported on the first call, quietly; one planning run per model and engine
flags per process.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

from vllm_adapter.cli.args import CliError, Request

__all__ = ["KV_BUDGET_BYTES_PER_GPU", "derive", "describe_exception", "with_retention"]

KV_BUDGET_BYTES_PER_GPU = 1 << 40
"""Assumed GPU memory for KV per GPU while planning; only ``num_blocks`` depends on it."""




@contextlib.contextmanager
def _quiet_vllm_import(debug: bool) -> Iterator[None]:
    """First vLLM import of a CLI process: logs to stderr at ERROR, import chatter dropped."""
    if debug or "vllm" in sys.modules:
        yield
        return
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    # vLLM configures no handler outside an engine: its warnings (e.g. the KV-cache
    # layout fallback while planning DeepSeek-V4) would reach stderr via logging's
    # last-resort handler.  Planning chatter is not for the operator.
    logging.getLogger("vllm").setLevel(logging.ERROR)


def describe_exception(exc: BaseException) -> str:
    """``Type: message`` on one line; a bare assert shows its source line."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":  # pydantic
        try:
            first = errors()[0]
            where = ".".join(str(x) for x in first.get("loc", ()))
            text = f"{where + ': ' if where else ''}{first.get('msg', '')}"
        except Exception:  # pragma: no cover - pydantic shape changed
            text = str(exc)
    else:
        text = str(exc)
    if not text.strip():
        frames = traceback.extract_tb(exc.__traceback__)
        text = frames[-1].line or "" if frames else ""
    text = " ".join(text.split())
    if len(text) > 400:
        text = text[:397] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


_DERIVATIONS: dict[tuple[Any, ...], Any] = {}
"""Per process: one planning run per model and engine flags (a refusal is cached too)."""


def derive(request: Request, debug: bool) -> Any:
    """vLLM's KV planning for the request's model and engine flags (cached per process)."""
    key = request.engine_key()
    cached = _DERIVATIONS.get(key)
    if cached is None:
        try:
            cached = _derive_uncached(request, debug)
        except CliError as e:
            cached = e
        _DERIVATIONS[key] = cached
    if isinstance(cached, CliError):
        raise CliError(str(cached))
    return cached


def _derive_uncached(request: Request, debug: bool) -> Any:
    with _quiet_vllm_import(debug):
        from vllm_adapter import vllm_tools_api as V
        from vllm_adapter.derive import Recipe, derive_live
    recipe = Recipe(
        name=f"cli:{request.model_dir}:{request.engine_flags()}",
        model_dir=str(request.model_dir),
        source=request.source,
        description=f"{request.model_dir.name} ({request.architecture}), {request.engine_flags()}",
        tensor_parallel_size=request.tensor_parallel_size,
        block_size=request.block_size_gpu,
        kv_cache_dtype=request.kv_cache_dtype,
        disable_hybrid_kv_cache_manager=request.no_hybrid,
        language_model_only=request.language_model_only,
        prefix_match_unit=request.prefix_match_unit,
        mamba_cache_mode=request.mamba_cache_mode,
        max_model_len=request.max_model_len,
        kv_budget_bytes_per_gpu=KV_BUDGET_BYTES_PER_GPU,
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            derivation = derive_live(recipe)
    except Exception as e:
        if debug:
            raise
        raise CliError(
            f"vLLM {V.VLLM_VERSION} could not plan the KV cache of {request.architecture} with "
            f"{request.engine_flags()}: {describe_exception(e)}"
        ) from None
    error = derivation.fixture["resolved"]["error"]
    if error is not None:
        raise CliError(
            f"vLLM {V.VLLM_VERSION} rejects this KV-cache geometry ({request.engine_flags()}): "
            f"{error['type']}: {' '.join(str(error['message']).split())}"
        )
    return derivation


def with_retention(vllm_config: Any, retention: int | None, dense: bool = False) -> Any:
    """A shallow copy whose cache config has ``prefix_cache_retention_interval`` set
    (``dense``: ``None``, vLLM's dense retention; ``retention`` ``None``: unchanged)."""
    if dense:
        retention = None
    elif retention is None:
        return vllm_config
    out = copy.copy(vllm_config)
    out.cache_config = copy.copy(vllm_config.cache_config)
    out.cache_config.prefix_cache_retention_interval = retention
    return out
