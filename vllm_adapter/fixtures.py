"""KV-cache geometry fixtures: load them, rebuild real vLLM objects, build a Scheduler.

A fixture (``vllm_adapter/fixtures/<vLLM version>/<name>.json``) is what
:func:`vllm_adapter.derive.derive` got from that vLLM release's own KV-cache
planning on CPU, serialized as plain JSON so that loading it costs no model work.
Fixtures are stored per release (each release's planning, codec fields and spec
classes are its own); loading reads the directory of the installed vLLM
(``V.VLLM_VERSION``) and fails with :class:`MissingFixturesError` when it has
none -- there is no fallback to another release's geometry.  This module turns
a fixture back into *real* vLLM objects:

* :func:`load_fixture` reads the JSON;
* :func:`rebuild_kv_cache_config` rebuilds the scheduler-view or worker-view
  ``KVCacheConfig`` (equal, field by field, to what the derivation produced);
* :func:`make_vllm_config` builds the ``VllmConfig`` the engine core would hold
  after KV-cache initialisation (resolved block size, cache dtype and layout),
  with a KV connector of your choice, for a real Scheduler;
* :func:`build_scheduler` puts both together into a real v1 ``Scheduler``.

CLI: ``python -m vllm_adapter.fixtures regenerate [--check] [NAME ...]`` re-derives
every fixture (or the named ones) with the installed vLLM and rewrites the JSON
in that release's directory; with ``--check`` it rewrites nothing and exits 1,
printing a diff, when a stored fixture differs from what vLLM derives now.  Run
it once per supported release (one virtualenv each).

JSON encoding of vLLM values (see :func:`encode_spec`):

* a spec is ``{"class", "module", "fields": {every init field}, "properties":
  {page_size_bytes, tokens_per_state, prefix_cacheable, kind, sliding_window}}``;
  ``properties`` are informative (recomputed on rebuild, never fed back);
* per-layer spec maps (``UniformTypeKVCacheSpecs.kv_cache_specs``, the
  fixture's ``layer_specs``) are ``{"specs": [distinct specs], "layers":
  [[layer_name, index into specs], ...]}`` in layer order;
* ``torch.dtype`` -> ``"torch.bfloat16"`` (fields ``dtype`` / ``dtypes``);
  enums -> ``{"__enum__": cls, "name": member}``; ``MultipleOf(n)`` ->
  ``{"__multiple_of__": n}``; ``Fraction`` -> ``{"__fraction__": "p/q"}``;
  tuples (Mamba ``shapes`` / ``dtypes``) -> lists.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import enum
import json
import sys
from collections.abc import Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch

from vllm_adapter import vllm_api as V

__all__ = [
    "FIXTURES_DIR",
    "FIXTURES_ROOT",
    "MODELS_DIR",
    "MissingFixturesError",
    "build_scheduler",
    "cpu_platform_patches",
    "decode_spec",
    "dump_fixture",
    "engine_vllm_config",
    "encode_kv_cache_config",
    "encode_spec",
    "fixture_names",
    "fixture_path",
    "fixtures_dir",
    "load_fixture",
    "make_vllm_config",
    "model_dir_path",
    "rebuild_kv_cache_config",
    "rebuild_layer_specs",
    "scheduler_block_sizes",
    "stored_versions",
]

PACKAGE_DIR = Path(__file__).resolve().parent
FIXTURES_ROOT = PACKAGE_DIR / "fixtures"
"""One directory per vLLM release: ``FIXTURES_ROOT / "0.34.0" / "<name>.json"``."""
FIXTURES_DIR = FIXTURES_ROOT / V.VLLM_VERSION
"""The installed vLLM's fixtures (may not exist: see :func:`fixtures_dir`)."""
MODELS_DIR = PACKAGE_DIR / "models"
SCHEMA_VERSION = 1
DEFAULT_CPU_BYTES = 1 << 30


# ---------------------------------------------------------------------------
# CPU patches
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


# ---------------------------------------------------------------------------
# Codec: vLLM values <-> JSON
# ---------------------------------------------------------------------------

_ENUMS: dict[str, type[enum.Enum]] = {
    "KVQuantMode": V.KVQuantMode,
    "SparseCacheRole": V.SparseCacheRole,
    "KVCacheGroupRole": V.KVCacheGroupRole,
    "MambaAttentionBackendEnum": V.MambaAttentionBackendEnum,
}


def _encode_dtype(dtype: torch.dtype) -> str:
    return str(dtype)


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
        return _encode_dtype(value)
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


def _init_fields(spec: Any) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}


def _spec_map(specs: Mapping[str, Any]) -> dict[str, Any]:
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


def _from_spec_map(encoded: Mapping[str, Any]) -> dict[str, Any]:
    table = encoded["specs"]
    return {layer_name: decode_spec(table[index]) for layer_name, index in encoded["layers"]}


def encode_spec(spec: Any) -> dict[str, Any]:
    """A ``KVCacheSpec`` (any subclass, incl. ``UniformTypeKVCacheSpecs``) as JSON."""
    cls = type(spec)
    out: dict[str, Any] = {"class": cls.__name__, "module": cls.__module__}
    init = _init_fields(spec)
    if isinstance(spec, V.UniformTypeKVCacheSpecs):
        inner = init.pop("kv_cache_specs")
        out["fields"] = {k: _encode_value(v) for k, v in init.items()}
        out["kv_cache_specs"] = _spec_map(inner)
    else:
        out["fields"] = {k: _encode_value(v) for k, v in init.items()}
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
        kwargs["kv_cache_specs"] = _from_spec_map(encoded["kv_cache_specs"])
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
# Loading and rebuilding
# ---------------------------------------------------------------------------


class MissingFixturesError(RuntimeError):
    """No fixtures are stored for a vLLM release (there is no fallback to another)."""


def stored_versions() -> list[str]:
    """The vLLM releases with a fixture directory, sorted by release number."""
    dirs = [p.name for p in FIXTURES_ROOT.iterdir() if p.is_dir() and any(p.glob("*.json"))]
    return sorted(dirs, key=lambda v: tuple(int(x) if x.isdigit() else -1 for x in v.split(".")))


def fixtures_dir(version: str | None = None) -> Path:
    """The fixture directory of ``version`` (default: the installed vLLM's); it must exist."""
    version = V.VLLM_VERSION if version is None else version
    path = FIXTURES_ROOT / version
    if not path.is_dir():
        raise MissingFixturesError(
            f"no KV-cache geometry fixtures for vLLM {version} ({path} does not exist; stored: "
            f"{', '.join(stored_versions()) or 'none'}). Derive them with that vLLM installed: "
            "python -m vllm_adapter.fixtures regenerate"
        )
    return path


def fixture_path(name: str, version: str | None = None) -> Path:
    """Where fixture ``name`` of ``version`` (default: the installed vLLM's) is stored."""
    return fixtures_dir(version) / f"{name}.json"


def fixture_names(version: str | None = None) -> list[str]:
    """Names of the stored fixtures of ``version`` (default: the installed vLLM's), sorted."""
    return sorted(p.stem for p in fixtures_dir(version).glob("*.json"))


def load_fixture(name: str, version: str | None = None) -> dict[str, Any]:
    """The stored fixture ``name`` as a plain dict (no vLLM work).

    ``version`` defaults to the installed vLLM's; another release's fixture is
    only for comparing plain JSON (its spec classes may not exist here).
    """
    with fixture_path(name, version).open(encoding="utf-8") as f:
        return json.load(f)


def dump_fixture(fixture: Mapping[str, Any]) -> str:
    """The canonical JSON text of a fixture (what the files hold)."""
    return json.dumps(fixture, indent=1, sort_keys=False) + "\n"


def model_dir_path(fixture: Mapping[str, Any]) -> Path:
    return MODELS_DIR / fixture["model_dir"]


def rebuild_kv_cache_config(fixture: Mapping[str, Any], view: str = "scheduler") -> Any:
    """The fixture's ``KVCacheConfig`` as a real vLLM object.

    ``view="scheduler"``: what ``EngineCore._initialize_kv_caches`` returned and
    the Scheduler gets (``UniformTypeKVCacheSpecs`` flattened to their first
    layer spec).  ``view="worker"``: rank 0's config as handed to the workers
    (``initialize_from_config``); identical to the scheduler view unless the
    fixture stores a separate ``worker_kv_cache_config``.  A fresh object each
    call (vLLM code mutates these).
    """
    if view == "scheduler":
        return decode_kv_cache_config(fixture["scheduler_kv_cache_config"])
    if view == "worker":
        worker = fixture.get("worker_kv_cache_config")
        return decode_kv_cache_config(
            worker if worker is not None else fixture["scheduler_kv_cache_config"]
        )
    raise ValueError(f"view must be 'scheduler' or 'worker', got {view!r}")


def rebuild_layer_specs(fixture: Mapping[str, Any]) -> dict[str, Any]:
    """The per-layer specs one worker reported (the input of vLLM's grouping), in order."""
    return _from_spec_map(fixture["layer_specs"])


# ---------------------------------------------------------------------------
# VllmConfig and Scheduler
# ---------------------------------------------------------------------------


def engine_vllm_config(
    model_dir: str | Path, engine_args: Mapping[str, Any], kv_transfer_config: Any
) -> tuple[Any, list[str]]:
    """The ``VllmConfig`` an engine starts with for these engine args (before KV-cache init).

    Shared by the derivation and :func:`make_vllm_config`, so both start from the
    same state.  Returns the config and the CPU patches applied while building it.
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


def _kv_transfer_config(
    extra_config: Mapping[str, Any] | None,
    *,
    connector: str,
    connector_module_path: str | None,
    cpu_bytes: int,
) -> Any:
    extra: dict[str, Any] = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": int(cpu_bytes)}
    extra.update(extra_config or {})
    kwargs: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if connector_module_path is not None:
        kwargs["kv_connector_module_path"] = connector_module_path
    return V.KVTransferConfig(**kwargs)


def make_vllm_config(
    fixture: Mapping[str, Any],
    extra_config: Mapping[str, Any] | None = None,
    *,
    connector: str = "OffloadingConnector",
    connector_module_path: str | None = None,
    cpu_bytes: int = DEFAULT_CPU_BYTES,
) -> Any:
    """A ``VllmConfig`` in the state the engine core leaves it after KV-cache init.

    Built like vLLM's upstream ``tests/v1/kv_connector/unit/offloading_connector``
    helpers: ``ModelConfig`` from the fixture's local model dir (config.json only,
    ``skip_tokenizer_init=True``), the fixture's engine args (TP, prefix caching,
    HMA on, ``language_model_only`` for Gemma-4), and a ``KVTransferConfig`` for
    ``connector`` (``kv_both``) whose ``kv_connector_extra_config`` is
    ``{"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": cpu_bytes, **extra_config}``.
    Then what model init and ``_initialize_kv_caches`` write back:
    ``cache_config.cache_dtype`` (DSv4: ``fp8`` -> ``fp8_ds_mla``),
    ``cache_config.block_size`` (min prefix-cacheable group block size),
    ``kv_cache_layout`` and ``num_gpu_blocks``.

    CPU deviations: ``DeviceConfig("cpu")`` and :func:`cpu_platform_patches`
    around the ``VllmConfig`` construction (HMA on needs it), nothing else.
    """
    kv_transfer_config = _kv_transfer_config(
        extra_config,
        connector=connector,
        connector_module_path=connector_module_path,
        cpu_bytes=cpu_bytes,
    )
    vllm_config, _ = engine_vllm_config(
        model_dir_path(fixture), fixture["engine_args"], kv_transfer_config
    )
    # What model init and EngineCore._initialize_kv_caches write back.
    cache_config = vllm_config.cache_config
    resolved = fixture["resolved"]
    cache_config.cache_dtype = resolved["cache_dtype"]
    cache_config.block_size = resolved["cache_config_block_size"]
    cache_config.kv_cache_layout = fixture["kv_cache_layout"]
    cache_config.num_gpu_blocks = fixture["scheduler_kv_cache_config"]["num_blocks"]
    return vllm_config


def scheduler_block_sizes(kv_cache_config: Any, vllm_config: Any) -> tuple[int, int]:
    """``(scheduler_block_size, hash_block_size)`` from vLLM's own resolver."""
    return V.resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)


def build_scheduler(
    fixture: Mapping[str, Any],
    extra_config: Mapping[str, Any] | None = None,
    *,
    connector: str = "OffloadingConnector",
    connector_module_path: str | None = None,
    cpu_bytes: int = DEFAULT_CPU_BYTES,
) -> Any:
    """A real v1 ``Scheduler`` (with its KV connector) for the fixture, on CPU.

    Mirrors ``EngineCore.__init__``: block sizes from
    ``resolve_kv_cache_block_sizes`` on the scheduler-view config, a
    ``StructuredOutputManager``, then ``Scheduler(...)``.  Whatever the connector
    raises (e.g. the stock connector's ``AssertionError`` for ``block_size``
    on mixed block sizes) propagates.
    """
    vllm_config = make_vllm_config(
        fixture,
        extra_config,
        connector=connector,
        connector_module_path=connector_module_path,
        cpu_bytes=cpu_bytes,
    )
    kv_cache_config = rebuild_kv_cache_config(fixture, "scheduler")
    block_size, hash_block_size = scheduler_block_sizes(kv_cache_config, vllm_config)
    return V.Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=V.StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _regenerate(names: list[str], check: bool) -> int:
    import time

    from vllm_adapter.derive import RECIPES, derive

    targets = names or list(RECIPES)
    unknown = [n for n in targets if n not in RECIPES]
    if unknown:
        print(
            f"unknown fixture(s): {', '.join(unknown)}; known: {', '.join(RECIPES)}",
            file=sys.stderr,
        )
        return 2
    failed = False
    for name in targets:
        start = time.perf_counter()
        text = dump_fixture(derive(name))
        elapsed = time.perf_counter() - start
        path = FIXTURES_ROOT / V.VLLM_VERSION / f"{name}.json"
        old = path.read_text(encoding="utf-8") if path.exists() else ""
        if check:
            if old == text:
                print(f"{name}: OK ({elapsed:.1f} s)")
            else:
                failed = True
                print(f"{name}: DIFFERS from what vLLM derives ({elapsed:.1f} s)")
                sys.stdout.writelines(
                    difflib.unified_diff(
                        old.splitlines(keepends=True),
                        text.splitlines(keepends=True),
                        fromfile=f"stored/{V.VLLM_VERSION}/{path.name}",
                        tofile=f"derived/{V.VLLM_VERSION}/{path.name}",
                    )
                )
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(
                f"{name}: {'unchanged' if old == text else 'written'} ({elapsed:.1f} s) -> {path}"
            )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_adapter.fixtures", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    regen = sub.add_parser("regenerate", help="re-derive fixtures with vLLM and rewrite the JSON")
    regen.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 and print a diff on any difference",
    )
    regen.add_argument("names", nargs="*", help="fixture names (default: all)")
    args = parser.parse_args(argv)
    if args.command == "regenerate":
        return _regenerate(args.names, args.check)
    return 2  # pragma: no cover


if __name__ == "__main__":
    sys.exit(main())
