"""The fixture format: vLLM KV-cache values <-> JSON, and the engine config fixtures start from.

Shared by :mod:`vllm_adapter.derive` (which writes fixtures) and
:mod:`vllm_adapter.fixtures` (which reads them back); it imports neither, so the
imports run ``fixtures -> derive -> codec`` and ``fixtures -> codec`` only.

JSON encoding of vLLM values (see :func:`encode_spec`):

* a spec is ``{"class", "module", "fields": {every init field}, "properties":
  {page_size_bytes, tokens_per_state, prefix_cacheable, kind, sliding_window}}``;
  ``properties`` are informative (recomputed on rebuild, never fed back);
* per-layer spec maps (``UniformTypeKVCacheSpecs.kv_cache_specs``, the
  fixture's ``layer_specs``) are ``{"specs": [distinct specs], "layers":
  [[layer_name, index into specs], ...]}`` in layer order (:func:`encode_spec_map`);
* ``torch.dtype`` -> ``"torch.bfloat16"`` (fields ``dtype`` / ``dtypes``);
  enums -> ``{"__enum__": cls, "name": member}``; ``MultipleOf(n)`` ->
  ``{"__multiple_of__": n}``; ``Fraction`` -> ``{"__fraction__": "p/q"}``;
  tuples (Mamba ``shapes`` / ``dtypes``) -> lists.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from vllm_adapter import vllm_tools_api as V
from vllm_adapter.names import CPU_SPEC

__all__ = [
    "DEFAULT_CPU_BYTES",
    "MODELS_DIR",
    "PACKAGE_DIR",
    "SCHEMA_VERSION",
    "cpu_platform_patches",
    "decode_kv_cache_config",
    "decode_spec",
    "decode_spec_map",
    "encode_kv_cache_config",
    "encode_spec",
    "encode_spec_map",
    "engine_vllm_config",
    "kv_transfer_config",
]

PACKAGE_DIR = Path(__file__).resolve().parent
MODELS_DIR = PACKAGE_DIR / "models"
"""``config.json``-only model directories the fixtures are derived from."""
SCHEMA_VERSION = 1
"""The fixture JSON schema (``fixture["schema_version"]``)."""
DEFAULT_CPU_BYTES = 1 << 30
"""``cpu_bytes_to_use`` of the offloading spec when a caller names none."""


# ---------------------------------------------------------------------------
# vLLM values <-> JSON
# ---------------------------------------------------------------------------

_ENUMS: dict[str, type[enum.Enum]] = {
    "KVQuantMode": V.KVQuantMode,
    "SparseCacheRole": V.SparseCacheRole,
    "KVCacheGroupRole": V.KVCacheGroupRole,
    "MambaAttentionBackendEnum": V.MambaAttentionBackendEnum,
}


def _decode_dtype(text: str) -> torch.dtype:
    prefix = "torch."
    if not text.startswith(prefix):
        raise ValueError(f"not a torch dtype string: {text!r}")
    dtype = getattr(torch, text[len(prefix) :])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {text!r}")
    return dtype


def _encode_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):  # before int/str: IntEnum / str-Enum members
        name = type(value).__name__
        if name not in _ENUMS:
            raise TypeError(f"unregistered enum {name}")
        return {"__enum__": name, "name": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, V.MultipleOf):
        return {"__multiple_of__": value.base}
    if isinstance(value, Fraction):
        return {"__fraction__": f"{value.numerator}/{value.denominator}"}
    if isinstance(value, (tuple, list)):
        return [_encode_value(v) for v in value]
    raise TypeError(f"cannot encode {type(value).__name__}: {value!r}")


def _decode_value(value: Any) -> Any:
    if isinstance(value, dict):
        if "__enum__" in value:
            return _ENUMS[value["__enum__"]][value["name"]]
        if "__multiple_of__" in value:
            return V.MultipleOf(int(value["__multiple_of__"]))
        if "__fraction__" in value:
            return Fraction(value["__fraction__"])
        raise ValueError(f"unknown tagged value {value!r}")
    if isinstance(value, list):
        return [_decode_value(v) for v in value]
    return value


def _decode_field(name: str, value: Any) -> Any:
    """Field-name-aware decoding for the few non-scalar spec fields."""
    if name == "dtype" and value is not None:
        return _decode_dtype(value)
    if name == "dtypes":
        return tuple(_decode_dtype(v) for v in value)
    if name == "shapes":
        return tuple(tuple(int(x) for x in shape) for shape in value)
    return _decode_value(value)


def _spec_properties(spec: Any) -> dict[str, Any]:
    try:
        tokens_per_state = spec.tokens_per_state
    except NotImplementedError:  # UniformTypeKVCacheSpecs: per member only
        tokens_per_state = None
    return {
        "page_size_bytes": spec.page_size_bytes,
        "tokens_per_state": _encode_value(tokens_per_state),
        "prefix_cacheable": spec.prefix_cacheable,
        "kind": V.get_kv_cache_spec_kind(spec).value,
        "sliding_window": V.get_kv_cache_spec_sliding_window(spec),
    }


def encode_spec_map(specs: Mapping[str, Any]) -> dict[str, Any]:
    """Ordered ``{layer: spec}`` as a small table: distinct specs + ``[layer, index]`` rows."""
    table: list[dict[str, Any]] = []
    rows: list[list[Any]] = []
    for layer_name, spec in specs.items():
        encoded = encode_spec(spec)
        try:
            index = table.index(encoded)
        except ValueError:
            index = len(table)
            table.append(encoded)
        rows.append([layer_name, index])
    return {"specs": table, "layers": rows}


def decode_spec_map(encoded: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`encode_spec_map`: ``{layer: real vLLM spec}`` in layer order."""
    table = encoded["specs"]
    return {layer_name: decode_spec(table[index]) for layer_name, index in encoded["layers"]}


def encode_spec(spec: Any) -> dict[str, Any]:
    """A ``KVCacheSpec`` (any subclass, incl. ``UniformTypeKVCacheSpecs``) as JSON."""
    cls = type(spec)
    out: dict[str, Any] = {"class": cls.__name__, "module": cls.__module__}
    init = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    inner = init.pop("kv_cache_specs") if isinstance(spec, V.UniformTypeKVCacheSpecs) else None
    out["fields"] = {k: _encode_value(v) for k, v in init.items()}
    if inner is not None:
        out["kv_cache_specs"] = encode_spec_map(inner)
    out["properties"] = _spec_properties(spec)
    return out


def _spec_class(encoded: Mapping[str, Any]) -> type:
    module = V.import_vllm_module(encoded["module"])
    cls = getattr(module, encoded["class"])
    if not (isinstance(cls, type) and issubclass(cls, V.KVCacheSpec)):
        raise TypeError(f"{encoded['module']}.{encoded['class']} is not a KVCacheSpec")
    return cls


def decode_spec(encoded: Mapping[str, Any]) -> Any:
    """Inverse of :func:`encode_spec`: a real vLLM spec object."""
    cls = _spec_class(encoded)
    kwargs = {k: _decode_field(k, v) for k, v in encoded["fields"].items()}
    if "kv_cache_specs" in encoded:
        kwargs["kv_cache_specs"] = decode_spec_map(encoded["kv_cache_specs"])
    return cls(**kwargs)


def _encode_group(index: int, group: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"index": index}
    for f in dataclasses.fields(group):
        value = getattr(group, f.name)
        if f.name == "kv_cache_spec":
            out[f.name] = encode_spec(value)
        elif f.name == "layer_names":
            out[f.name] = list(value)
        else:
            out[f.name] = _encode_value(value)
    return out


def _decode_group(encoded: Mapping[str, Any]) -> Any:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(V.KVCacheGroupSpec):
        if f.name not in encoded:
            continue
        value = encoded[f.name]
        if f.name == "kv_cache_spec":
            kwargs[f.name] = decode_spec(value)
        elif f.name == "layer_names":
            kwargs[f.name] = list(value)
        else:
            kwargs[f.name] = _decode_value(value)
    return V.KVCacheGroupSpec(**kwargs)


def encode_kv_cache_config(config: Any) -> dict[str, Any]:
    """A ``KVCacheConfig`` as JSON: every dataclass field, groups and tensors expanded."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "kv_cache_groups":
            out[f.name] = [_encode_group(i, g) for i, g in enumerate(value)]
        elif f.name == "kv_cache_tensors":
            out[f.name] = [
                {tf.name: _encode_value(getattr(t, tf.name)) for tf in dataclasses.fields(t)}
                for t in value
            ]
        else:
            out[f.name] = _encode_value(value)
    return out


def decode_kv_cache_config(encoded: Mapping[str, Any]) -> Any:
    """Inverse of :func:`encode_kv_cache_config`.

    Fields vLLM resolves after construction (``init=False``, e.g. 0.34.0's
    ``needs_kv_cache_zeroing``, settled across workers) get their stored value back.
    """
    kwargs: dict[str, Any] = {}
    resolved: dict[str, Any] = {}
    for f in dataclasses.fields(V.KVCacheConfig):
        if f.name not in encoded:
            continue
        value = encoded[f.name]
        if f.name == "kv_cache_groups":
            kwargs[f.name] = [_decode_group(g) for g in value]
        elif f.name == "kv_cache_tensors":
            kwargs[f.name] = [
                V.KVCacheTensor(**{k: _decode_value(v) for k, v in t.items()}) for t in value
            ]
        elif f.init:
            kwargs[f.name] = _decode_value(value)
        else:
            resolved[f.name] = _decode_value(value)
    config = V.KVCacheConfig(**kwargs)
    for name, value in resolved.items():
        setattr(config, name, value)
    return config


# ---------------------------------------------------------------------------
# The engine's VllmConfig (shared by derivation and rebuild)
# ---------------------------------------------------------------------------


@contextlib.contextmanager
def cpu_platform_patches() -> Iterator[list[str]]:
    """The one platform patch a CPU-only host needs, scoped and restored.

    vLLM's ``UnspecifiedPlatform`` (what a host without an accelerator gets)
    answers ``support_hybrid_kv_cache() -> False``, so ``VllmConfig`` rejects an
    explicit ``disable_hybrid_kv_cache_manager=False`` (HMA on).  Inside this
    context the platform class answers True, as ``CudaPlatform`` does.  It is
    only read in ``VllmConfig.__post_init__``, so callers wrap just the
    ``VllmConfig(...)`` construction.  Nothing is patched when the platform
    already supports HMA.  Yields the list of patches applied (for provenance).
    """
    platform_cls = type(V.current_platform)
    applied: list[str] = []
    sentinel = object()
    saved = platform_cls.__dict__.get("support_hybrid_kv_cache", sentinel)
    if not V.current_platform.support_hybrid_kv_cache():
        platform_cls.support_hybrid_kv_cache = classmethod(lambda cls: True)  # type: ignore[method-assign, assignment]
        applied.append(
            f"{platform_cls.__name__}.support_hybrid_kv_cache -> True (as CudaPlatform) "
            "while VllmConfig is constructed"
        )
    try:
        yield applied
    finally:
        if applied:
            if saved is sentinel:
                delattr(platform_cls, "support_hybrid_kv_cache")
            else:
                platform_cls.support_hybrid_kv_cache = saved  # type: ignore[method-assign]


def kv_transfer_config(
    extra_config: Mapping[str, Any] | None,
    *,
    connector: str,
    connector_module_path: str | None,
    cpu_bytes: int,
) -> Any:
    """A ``kv_both`` ``KVTransferConfig`` for ``connector`` on the CPU offloading spec.

    ``kv_connector_extra_config`` is ``{"spec_name": CPU_SPEC, "cpu_bytes_to_use":
    cpu_bytes, **extra_config}``.
    """
    extra: dict[str, Any] = {"spec_name": CPU_SPEC, "cpu_bytes_to_use": int(cpu_bytes)}
    extra.update(extra_config or {})
    kwargs: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if connector_module_path is not None:
        kwargs["kv_connector_module_path"] = connector_module_path
    return V.KVTransferConfig(**kwargs)


def engine_vllm_config(
    model_dir: str | Path, engine_args: Mapping[str, Any], kv_transfer_config: Any
) -> tuple[Any, list[str]]:
    """The ``VllmConfig`` an engine starts with for these engine args (before KV-cache init).

    Shared by the derivation and :func:`vllm_adapter.fixtures.make_vllm_config`, so
    both start from the same state.  Returns the config and the CPU patches applied
    while building it.
    """
    model_config = V.ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        language_model_only=bool(engine_args.get("language_model_only", False)),
        max_model_len=engine_args.get("max_model_len"),
    )
    cache_kwargs: dict[str, Any] = {
        "enable_prefix_caching": bool(engine_args.get("enable_prefix_caching", True)),
        "cache_dtype": engine_args.get("kv_cache_dtype", "auto"),
    }
    for key in ("block_size", "prefix_match_unit", "mamba_cache_mode"):
        if engine_args.get(key) is not None:
            cache_kwargs[key] = engine_args[key]
    kwargs = {
        "model_config": model_config,
        "cache_config": V.CacheConfig(**cache_kwargs),
        "scheduler_config": V.SchedulerConfig(
            max_model_len=model_config.max_model_len,
            is_encoder_decoder=model_config.is_encoder_decoder,
            disable_hybrid_kv_cache_manager=bool(
                engine_args.get("disable_hybrid_kv_cache_manager", False)
            ),
        ),
        "parallel_config": V.ParallelConfig(
            tensor_parallel_size=int(engine_args.get("tensor_parallel_size", 1)),
        ),
        # UnspecifiedPlatform has no device type; vLLM's own CPU connector tests pass "cpu".
        "device_config": V.DeviceConfig(device="cpu"),
        "kv_transfer_config": kv_transfer_config,
    }
    with cpu_platform_patches() as patches:
        vllm_config = V.VllmConfig(**kwargs)
    return vllm_config, list(patches)
