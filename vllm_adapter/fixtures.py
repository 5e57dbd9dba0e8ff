"""KV-cache geometry fixtures: load them, rebuild real vLLM objects, build a Scheduler.

A fixture (``vllm_adapter/fixtures/<vLLM version>/<name>.json``) is what
:func:`vllm_adapter.derive.derive` got from that vLLM release's own KV-cache
planning on CPU, serialized as plain JSON so that loading it costs no model work.
Fixtures are stored per release (each release's planning, codec fields and spec
classes are its own); loading reads the directory of the installed vLLM
(``V.VLLM_VERSION``).  There is no fallback to another release's geometry: an
installed vLLM with no stored directory that is not older than the oldest stored
release (a dev, rc or post build, or a newer release) has its fixtures derived
live, once per version and recipe sources, into a cache outside the repository
(:func:`live_cache_dir`: ``$KVCHUNK_FIXTURES_CACHE`` or the temp dir); any
other version fails with :class:`MissingFixturesError`.
:func:`fixture_differences` names, field by field, where a stored fixture and
the live derivation disagree.  This module turns
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

The JSON codec of vLLM values and the engine config both the derivation and
the rebuild start from live in :mod:`vllm_adapter.codec` (re-exported here).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from vllm_adapter import vllm_tools_api as V
from vllm_adapter.codec import (
    DEFAULT_CPU_BYTES,
    MODELS_DIR,
    PACKAGE_DIR,
    cpu_platform_patches,
    decode_kv_cache_config,
    decode_spec,
    decode_spec_map,
    encode_kv_cache_config,
    encode_spec,
    engine_vllm_config,
    kv_transfer_config,
)
from vllm_adapter.derive import RECIPES, derive
from vllm_adapter.derive.compare import fixture_differences
from vllm_adapter.files import write_text_atomic
from vllm_adapter.names import STOCK_CONNECTOR

__all__ = [
    "FIXTURES_DIR",
    "FIXTURES_ROOT",
    "MODELS_DIR",
    "MissingFixturesError",
    "build_scheduler",
    "cpu_platform_patches",
    "decode_kv_cache_config",
    "decode_spec",
    "dump_fixture",
    "engine_vllm_config",
    "encode_kv_cache_config",
    "encode_spec",
    "fixture_differences",
    "fixture_names",
    "fixture_path",
    "fixtures_are_live",
    "fixtures_dir",
    "live_cache_dir",
    "load_fixture",
    "make_vllm_config",
    "model_dir_path",
    "rebuild_kv_cache_config",
    "rebuild_layer_specs",
    "scheduler_block_sizes",
    "stored_versions",
]

FIXTURES_ROOT = PACKAGE_DIR / "fixtures"
"""One directory per vLLM release: ``FIXTURES_ROOT / "0.34.0" / "<name>.json"``."""
FIXTURES_DIR = FIXTURES_ROOT / V.VLLM_VERSION
"""The installed vLLM's fixtures (may not exist: see :func:`fixtures_dir`)."""


# ---------------------------------------------------------------------------
# Loading and rebuilding
# ---------------------------------------------------------------------------


class MissingFixturesError(RuntimeError):
    """No fixtures are stored for a vLLM release (there is no fallback to another)."""


def stored_versions() -> list[str]:
    """The vLLM releases with a fixture directory, sorted by release number."""
    dirs = [p.name for p in FIXTURES_ROOT.iterdir() if p.is_dir() and any(p.glob("*.json"))]
    return sorted(dirs, key=_release_key)


def _release_key(version: str) -> Version:
    """PEP 440 order (``0.35.0.dev42+g1234abc`` > ``0.34.0``); unparsable: newest."""
    try:
        return Version(version)
    except InvalidVersion:
        return Version("99999")


def fixtures_are_live(version: str | None = None) -> bool:
    """Whether ``version``'s fixtures are derived live: the installed vLLM, none stored,
    and not older than the oldest stored release."""
    version = V.VLLM_VERSION if version is None else version
    stored = stored_versions()
    return (
        version == V.VLLM_VERSION
        and version not in stored
        and bool(stored)
        and _release_key(version) >= _release_key(stored[0])
    )


def live_cache_dir(version: str | None = None) -> Path:
    """Where the live derivation of ``version`` is cached: never inside the repository.

    ``$KVCHUNK_FIXTURES_CACHE`` (default: ``<temp dir>/kvchunk-fixtures``), then one
    directory per vLLM version and digest of the derivation's sources (a change to a
    recipe re-derives).
    """
    version = V.VLLM_VERSION if version is None else version
    root = Path(
        os.environ.get("KVCHUNK_FIXTURES_CACHE")
        or Path(tempfile.gettempdir()) / "kvchunk-fixtures"
    )
    digest = hashlib.sha256()
    for source in sorted((PACKAGE_DIR / "derive").glob("*.py")) + [PACKAGE_DIR / "codec.py"]:
        digest.update(source.read_bytes())
    return root / f"{version}-{digest.hexdigest()[:12]}"


def _derive_into_cache(name: str, path: Path) -> None:
    """Derive ``name`` with the installed vLLM and write it atomically to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, dump_fixture(derive(name)))


def fixtures_dir(version: str | None = None) -> Path:
    """The stored fixture directory of ``version`` (default: the installed vLLM's), or a
    live version's cache directory (:func:`fixture_path` fills it on demand)."""
    version = V.VLLM_VERSION if version is None else version
    path = FIXTURES_ROOT / version
    if path.is_dir():
        return path
    if fixtures_are_live(version):
        return live_cache_dir(version)
    raise MissingFixturesError(
        f"no KV-cache geometry fixtures for vLLM {version} ({path} does not exist; stored: "
        f"{', '.join(stored_versions()) or 'none'}; live derivation covers the installed vLLM "
        "when it is not older than the oldest stored release). Derive them with that vLLM "
        "installed: python -m vllm_adapter.fixtures regenerate"
    )


def fixture_path(name: str, version: str | None = None) -> Path:
    """Where fixture ``name`` of ``version`` (default: the installed vLLM's) is (a live
    version's is derived first, once per cache directory)."""
    path = fixtures_dir(version) / f"{name}.json"
    if not path.exists() and name in RECIPES and fixtures_are_live(version):
        _derive_into_cache(name, path)
    return path


def fixture_names(version: str | None = None) -> list[str]:
    """Names of the fixtures of ``version`` (default: the installed vLLM's; live: every recipe)."""
    directory = fixtures_dir(version)
    if fixtures_are_live(version):
        return sorted(RECIPES)
    return sorted(p.stem for p in directory.glob("*.json"))


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
    return decode_spec_map(fixture["layer_specs"])


# ---------------------------------------------------------------------------
# VllmConfig and Scheduler
# ---------------------------------------------------------------------------


def make_vllm_config(
    fixture: Mapping[str, Any],
    extra_config: Mapping[str, Any] | None = None,
    *,
    connector: str = STOCK_CONNECTOR,
    connector_module_path: str | None = None,
    cpu_bytes: int = DEFAULT_CPU_BYTES,
) -> Any:
    """A ``VllmConfig`` in the state the engine core leaves it after KV-cache init.

    Built like vLLM's upstream ``tests/v1/kv_connector/unit/offloading_connector``
    helpers: ``ModelConfig`` from the fixture's local model dir (config.json only,
    ``skip_tokenizer_init=True``), the fixture's engine args (TP, prefix caching,
    HMA on, ``language_model_only`` for Gemma-4), and a ``KVTransferConfig`` for
    ``connector`` (``kv_both``) whose ``kv_connector_extra_config`` is
    ``{"spec_name": CPU_SPEC, "cpu_bytes_to_use": cpu_bytes, **extra_config}``
    (:func:`vllm_adapter.codec.kv_transfer_config`).
    Then what model init and ``_initialize_kv_caches`` write back:
    ``cache_config.cache_dtype`` (DSv4: ``fp8`` -> ``fp8_ds_mla``),
    ``cache_config.block_size`` (min prefix-cacheable group block size),
    ``kv_cache_layout`` and ``num_gpu_blocks``.

    CPU deviations: ``DeviceConfig("cpu")`` and :func:`cpu_platform_patches`
    around the ``VllmConfig`` construction (HMA on needs it), nothing else.
    """
    transfer_config = kv_transfer_config(
        extra_config,
        connector=connector,
        connector_module_path=connector_module_path,
        cpu_bytes=cpu_bytes,
    )
    vllm_config, _ = engine_vllm_config(
        model_dir_path(fixture), fixture["engine_args"], transfer_config
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
    connector: str = STOCK_CONNECTOR,
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
