"""``python -m vllm_adapter config``: the ``--kv-transfer-config`` for kvchunk's connector.

::

    python -m vllm_adapter config --model <dir with config.json> --tensor-parallel-size N \\
        [--block-size T | --blocks-per-chunk B | --chunk-bytes X] [--cpu-bytes Y] \\
        [--block-size-gpu N] [--kv-cache-dtype D] [--no-hybrid] [--prefix-match-unit N] \\
        [--mamba-cache-mode align|none] [--max-model-len N] \\
        [--prefix-cache-retention-interval N] [--format table|json|markdown]

What it does:

1. **Geometry.**  The installed vLLM's (0.33.0 or 0.34.0) own KV-cache planning
   runs on CPU for the model dir, TP size and cache flags
   (:func:`vllm_adapter.derive.derive_live` on a recipe built from the
   arguments: the model's real KV-cache layers at that TP,
   the GPU model runner's ``get_kv_cache_spec``, ``EngineCore._initialize_kv_caches``).
   Architectures it can plan on CPU: :data:`ARCHITECTURES`; any other is a
   one-line error.  ``--block-size-gpu``, ``--kv-cache-dtype``, ``--no-hybrid``
   (``--disable-hybrid-kv-cache-manager``), ``--prefix-match-unit``,
   ``--mamba-cache-mode`` and ``--max-model-len`` are vLLM's engine flags of the
   same meaning (``--block-size-gpu`` is vLLM's ``--block-size``; here
   ``--block-size`` is kvchunk's chunk knob).  Without ``--block-size-gpu`` the
   cache block size is vLLM's default for the model's attention backend, and
   that default is per release (``CacheConfig.DEFAULT_BLOCK_SIZE``: 16 on
   0.33.0, 64 on 0.34.0), so the same ``--block-size`` can resolve to a
   different ``blocks_per_chunk`` (gemma-4-31B-it TP2, 512 tokens: 16 vs 4).
   Prefix caching is on, as offloading needs.
2. **Knob.**  The chunk knob is resolved exactly as the connector will resolve it
   at startup (:func:`vllm_adapter.connector.resolve_for_vllm`, i.e. the
   reference's :mod:`reference.knobs` rules plus vLLM's one-B limit),
   then vLLM's ``build_offloading_config`` runs on the result.
   ``--chunk-bytes X`` picks the **smallest** ``blocks_per_chunk`` whose chunk
   bytes per worker (below) reach ``X``: one B for every group, since vLLM
   executes one.  Larger chunks mean fewer, bigger transfers and files
   (the disk-IOPS case); the smallest B meeting the target keeps the hit
   granularity as fine as the target allows.
3. **Bytes.**  Per vLLM's CPU tier (``vllm/v1/kv_offload/cpu/spec.py``), every
   chunk key gets one slot: per worker ``worker_kv_bytes_per_block * B`` bytes
   (``cpu_page_size_per_worker``; ``worker_kv_bytes_per_block`` is the KV
   memory of one block id on one worker, all groups' layers that share it),
   and the slot of all copies is rounded up to the page size
   (``BLOCK_SIZE_ALIGNMENT``).  MLA models at TP > 1 whose KV is replicated on
   every rank keep one copy (vLLM's replicated layout on a CUDA host); others
   keep ``world_size`` copies.  ``cpu_bytes_to_use // slot`` chunks fit.  Each
   group's own bytes per chunk (what its layers actually fill) are shown too;
   ``chunks/GiB`` is ``GiB / chunk bytes per worker``, the chunk files per GiB
   a worker writes.

Output: the JSON for ``--kv-transfer-config`` (``KvchunkOffloadingConnector``
from ``vllm_adapter.connector``, ``kv_both``, ``kv_connector_extra_config``
holding the knob as given -- or the chosen ``blocks_per_chunk`` --,
``spec_name: CPUOffloadingSpec`` and ``cpu_bytes_to_use`` when given) and a
per-group table, as ``table`` (default), ``json`` or ``markdown``.

Every user mistake is one line on stderr and exit status 2; an unexpected
failure is one line and status 1 (``KVCHUNK_DEBUG=1`` shows the traceback).
Argument checks that need no model run before vLLM is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import logging
import os
import re
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, TextIO

from reference.geometry import Geometry
from reference.knobs import BLOCK_SIZE, BLOCKS_PER_CHUNK, BlockSize, BlocksPerChunk, parse_knob

__all__ = ["ARCHITECTURES", "CliError", "build_parser", "main", "plan"]

PROG = "python -m vllm_adapter"
GiB = 1 << 30
CONNECTOR = "KvchunkOffloadingConnector"
CONNECTOR_MODULE = "vllm_adapter.connector"
SPEC_NAME = "CPUOffloadingSpec"
KV_BUDGET_BYTES_PER_GPU = 1 << 40
"""Assumed GPU memory for KV per GPU while planning; only ``num_blocks`` depends on it."""
MAX_CHUNK_BYTES_SEARCH = 4096
"""How far past the first B reaching ``--chunk-bytes`` the search for a valid B goes."""

ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "Gemma4ForConditionalGeneration": ("gemma4", True),
    "Gemma4ForCausalLM": ("gemma4", False),
    "DeepseekV4ForCausalLM": ("deepseek_v4", False),
}
"""Architectures whose KV-cache layers :mod:`vllm_adapter.derive` builds on CPU:
``architecture -> (derive source, language_model_only)``.  Gemma-4's vision tower
holds no KV cache, so the multimodal model is planned language-model-only."""

FORMATS = ("table", "json", "markdown")


class CliError(Exception):
    """A user mistake (or a configuration vLLM refuses): one line, exit status 2."""


# ---------------------------------------------------------------------------
# Arguments (no vLLM import)
# ---------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(f"{message} (see '{self.prog} --help')")


_DECIMAL = re.compile(r"^\s*\+?\d+\s*$")


def _positive_int(text: str) -> int:
    if not _DECIMAL.match(text) or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _non_negative_int(text: str) -> int:
    if not _DECIMAL.match(text):
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return int(text)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """A byte count: ``26843545600``, ``25GiB``, ``16MiB``, ``1.5GB`` (KiB = 1024, KB = 1000)."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"must be a byte count such as 26843545600, 25GiB or 16MiB, got {text!r}"
        )
    value = Fraction(match.group(1)) * _UNITS[unit]
    if value.denominator != 1 or value <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a positive whole number of bytes, got {text!r} (= {float(value):g} bytes)"
        )
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="kvchunk operator tooling (see 'config --help').",
    )
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)
    config = commands.add_parser(
        "config",
        prog=f"{PROG} config",
        help="the --kv-transfer-config JSON and per-group chunk table for a model",
        description=(
            "Derive a model's KV-cache geometry with vLLM's own planning (on CPU), resolve the "
            "chunk knob as KvchunkOffloadingConnector will, and print the --kv-transfer-config "
            "JSON and a per-group table."
        ),
    )
    config.add_argument(
        "--model", required=True, metavar="DIR", help="a model directory holding config.json"
    )
    config.add_argument(
        "--tensor-parallel-size", "-tp", required=True, type=_positive_int, metavar="N"
    )
    knob = config.add_argument_group(
        "chunk size (at most one; none means vLLM's default blocks_per_chunk 1)"
    )
    knob.add_argument(
        "--block-size",
        metavar="T",
        help="tokens per chunk of the full-attention groups (kvchunk's block_size knob)",
    )
    knob.add_argument(
        "--blocks-per-chunk", metavar="B", help="GPU blocks per chunk, every group (vLLM's knob)"
    )
    knob.add_argument(
        "--chunk-bytes",
        type=parse_bytes,
        metavar="X",
        help="pick the smallest blocks_per_chunk whose chunk bytes per worker reach X",
    )
    config.add_argument(
        "--cpu-bytes",
        type=parse_bytes,
        metavar="Y",
        help="cpu_bytes_to_use: CPU memory for offloaded KV (e.g. 25GiB)",
    )
    cache = config.add_argument_group("vLLM engine cache flags")
    cache.add_argument(
        "--block-size-gpu", type=_positive_int, metavar="N", help="vLLM's --block-size"
    )
    cache.add_argument("--kv-cache-dtype", default="auto", metavar="D", help="vLLM's flag")
    cache.add_argument(
        "--no-hybrid",
        action="store_true",
        help="vLLM's --disable-hybrid-kv-cache-manager (default: the hybrid manager is on)",
    )
    cache.add_argument("--prefix-match-unit", type=_positive_int, metavar="N")
    cache.add_argument("--mamba-cache-mode", choices=("align", "none"))
    cache.add_argument("--max-model-len", type=_positive_int, metavar="N")
    cache.add_argument(
        "--prefix-cache-retention-interval",
        type=_non_negative_int,
        metavar="N",
        help="vLLM's cache flag (default 0); windowed groups' chunk spans must divide it",
    )
    config.add_argument("--format", choices=FORMATS, default="table")
    return parser


@dataclass(frozen=True)
class Request:
    """Validated arguments: everything checkable without vLLM has been checked."""

    model_dir: Path
    model_arg: str
    """``--model`` as given (for display)."""
    architecture: str
    source: str
    language_model_only: bool
    tensor_parallel_size: int
    knob_extra: dict[str, int]
    """The knob as the user gave it (``block_size`` / ``blocks_per_chunk``), parsed."""
    chunk_bytes: int | None
    cpu_bytes: int | None
    block_size_gpu: int | None
    kv_cache_dtype: str
    no_hybrid: bool
    prefix_match_unit: int | None
    mamba_cache_mode: str | None
    max_model_len: int | None
    retention_interval: int | None
    format: str

    def engine_key(self) -> tuple[Any, ...]:
        return (
            str(self.model_dir),
            self.tensor_parallel_size,
            self.block_size_gpu,
            self.kv_cache_dtype,
            self.no_hybrid,
            self.prefix_match_unit,
            self.mamba_cache_mode,
            self.max_model_len,
        )

    def engine_flags(self) -> str:
        """The engine flags as vLLM's CLI spells them (for messages)."""
        flags = [f"--tensor-parallel-size {self.tensor_parallel_size}"]
        if self.block_size_gpu is not None:
            flags.append(f"--block-size {self.block_size_gpu}")
        if self.kv_cache_dtype != "auto":
            flags.append(f"--kv-cache-dtype {self.kv_cache_dtype}")
        flags.append(
            "--disable-hybrid-kv-cache-manager"
            if self.no_hybrid
            else "--no-disable-hybrid-kv-cache-manager"
        )
        if self.prefix_match_unit is not None:
            flags.append(f"--prefix-match-unit {self.prefix_match_unit}")
        if self.mamba_cache_mode is not None:
            flags.append(f"--mamba-cache-mode {self.mamba_cache_mode}")
        if self.max_model_len is not None:
            flags.append(f"--max-model-len {self.max_model_len}")
        return " ".join(flags)


def _architecture(model_dir: Path) -> str:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CliError(f"--model {model_dir}: no config.json in that directory")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CliError(f"--model {model_dir}: config.json is not readable JSON ({e})") from None
    archs = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise CliError(f"--model {model_dir}: config.json names no 'architectures'")
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise CliError(
        f"--model {model_dir}: cannot plan the KV cache of {', '.join(archs)} on CPU; "
        f"this tool builds the KV-cache layers of {', '.join(ARCHITECTURES)} only"
    )


def _knob_extra(args: argparse.Namespace) -> dict[str, int]:
    given = {
        flag: value
        for flag, value in (
            ("--block-size", args.block_size),
            ("--blocks-per-chunk", args.blocks_per_chunk),
            ("--chunk-bytes", args.chunk_bytes),
        )
        if value is not None
    }
    if len(given) > 1:
        listing = " and ".join(f"{flag} {value}" for flag, value in given.items())
        if "--chunk-bytes" not in given:
            # The reference's own message for both knobs.
            try:
                parse_knob(
                    {BLOCK_SIZE: args.block_size, BLOCKS_PER_CHUNK: args.blocks_per_chunk},
                    Geometry(groups=(), tokens_per_hash=1),
                )
            except ValueError as e:
                raise CliError(f"--block-size / --blocks-per-chunk: {e}") from None
        raise CliError(
            f"give at most one of --block-size, --blocks-per-chunk or --chunk-bytes (got {listing})"
        )
    for flag, key in (("--block-size", BLOCK_SIZE), ("--blocks-per-chunk", BLOCKS_PER_CHUNK)):
        value = given.get(flag)
        if value is None:
            continue
        try:
            knob = parse_knob({key: value}, Geometry(groups=(), tokens_per_hash=1))
        except ValueError as e:
            raise CliError(f"{flag}: {e}") from None
        if isinstance(knob, BlockSize):
            return {BLOCK_SIZE: knob.tokens}
        assert isinstance(knob, BlocksPerChunk)
        return {BLOCKS_PER_CHUNK: knob.value}
    return {}


def validate(args: argparse.Namespace) -> Request:
    """Everything that needs no vLLM: paths, numbers, knob exclusivity, the architecture."""
    model_dir = Path(args.model).expanduser()
    if not model_dir.exists():
        raise CliError(f"--model {args.model}: no such directory")
    if not model_dir.is_dir():
        raise CliError(f"--model {args.model}: not a directory (give the model's directory)")
    model_dir = model_dir.resolve()
    knob_extra = _knob_extra(args)
    arch = _architecture(model_dir)
    source, language_model_only = ARCHITECTURES[arch]
    dtype = str(args.kv_cache_dtype).strip()
    if not dtype or not re.fullmatch(r"[A-Za-z0-9_]+", dtype):
        raise CliError(f"argument --kv-cache-dtype: not a KV-cache dtype name: {dtype!r}")
    return Request(
        model_dir=model_dir,
        model_arg=str(args.model),
        architecture=arch,
        source=source,
        language_model_only=language_model_only,
        tensor_parallel_size=args.tensor_parallel_size,
        knob_extra=knob_extra,
        chunk_bytes=args.chunk_bytes,
        cpu_bytes=args.cpu_bytes,
        block_size_gpu=args.block_size_gpu,
        kv_cache_dtype=dtype,
        no_hybrid=bool(args.no_hybrid),
        prefix_match_unit=args.prefix_match_unit,
        mamba_cache_mode=args.mamba_cache_mode,
        max_model_len=args.max_model_len,
        retention_interval=args.prefix_cache_retention_interval,
        format=args.format,
    )


# ---------------------------------------------------------------------------
# vLLM planning
# ---------------------------------------------------------------------------


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


def _describe_exception(exc: BaseException) -> str:
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


def _derive(request: Request, debug: bool) -> Any:
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
        from vllm_adapter import derive as D
        from vllm_adapter import vllm_api as V
    name = f"cli:{request.model_dir}:{request.engine_flags()}"
    recipe = D.Recipe(
        name=name,
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
    # derive_live looks recipes up by name: register this one for the call only.
    D.RECIPES[name] = recipe
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            derivation = D.derive_live(name)
    except Exception as e:
        if debug:
            raise
        raise CliError(
            f"vLLM {V.VLLM_VERSION} could not plan the KV cache of {request.architecture} with "
            f"{request.engine_flags()}: {_describe_exception(e)}"
        ) from None
    finally:
        D.RECIPES.pop(name, None)
    error = derivation.fixture["resolved"]["error"]
    if error is not None:
        raise CliError(
            f"vLLM {V.VLLM_VERSION} rejects this KV-cache geometry ({request.engine_flags()}): "
            f"{error['type']}: {' '.join(str(error['message']).split())}"
        )
    return derivation


def _with_retention(vllm_config: Any, retention: int | None) -> Any:
    """A shallow copy whose cache config has ``prefix_cache_retention_interval`` set."""
    if retention is None:
        return vllm_config
    out = copy.copy(vllm_config)
    out.cache_config = copy.copy(vllm_config.cache_config)
    out.cache_config.prefix_cache_retention_interval = retention
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def plan(request: Request, *, debug: bool = False) -> dict[str, Any]:
    """Derive, resolve, and describe: the JSON document every format renders."""
    derivation = _derive(request, debug)
    from vllm_adapter import vllm_api as V
    from vllm_adapter.connector import resolve_for_vllm
    from vllm_adapter.geometry import geometry_from_vllm, with_extra_config

    vllm_config = _with_retention(derivation.vllm_config, request.retention_interval)
    sched_cfg = derivation.scheduler_kv_cache_config
    worker_cfg = derivation.worker_kv_cache_configs[0]
    try:
        geometry_from_vllm(sched_cfg, vllm_config)
    except ValueError as e:
        raise CliError(f"this KV-cache geometry cannot be offloaded: {e}") from None

    # cpu_bytes_to_use is required by CPUOffloadingSpec; validate with a stand-in when absent.
    cpu_bytes_for_checks = request.cpu_bytes if request.cpu_bytes is not None else GiB

    def resolve(knob_extra: dict[str, int]) -> tuple[Any, dict[str, Any]]:
        extra = {**knob_extra, "spec_name": SPEC_NAME, "cpu_bytes_to_use": cpu_bytes_for_checks}
        return resolve_for_vllm(with_extra_config(vllm_config, extra), sched_cfg)

    def offloading_config(vllm_extra: dict[str, Any]) -> Any:
        return V.build_offloading_config(with_extra_config(vllm_config, vllm_extra), sched_cfg)

    notes: list[str] = []
    if request.block_size_gpu is None:
        notes.append(
            f"no --block-size-gpu: planned with vLLM {V.VLLM_VERSION}'s default cache block size "
            f"for this model ({derivation.fixture['resolved']['cache_config_block_size_after_backend']} "
            "tokens); if the engine runs with --block-size N, pass --block-size-gpu N"
        )
    if request.chunk_bytes is not None:
        _, base_extra = _resolve_or_fail(resolve, {BLOCKS_PER_CHUNK: 1}, "--chunk-bytes")
        bytes_per_block = int(offloading_config(base_extra).worker_kv_bytes_per_block)
        if bytes_per_block <= 0:
            raise CliError("vLLM reports no KV bytes per block for this model; cannot size chunks")
        first = max(1, -(-request.chunk_bytes // bytes_per_block))
        last_error: ValueError | None = None
        for blocks in range(first, first + MAX_CHUNK_BYTES_SEARCH):
            try:
                chunking, vllm_extra = resolve({BLOCKS_PER_CHUNK: blocks})
                break
            except ValueError as e:
                last_error = e
        else:
            raise CliError(
                f"--chunk-bytes {request.chunk_bytes}: no blocks_per_chunk from {first} to "
                f"{first + MAX_CHUNK_BYTES_SEARCH - 1} is valid here ({last_error})"
            )
        knob_extra = {BLOCKS_PER_CHUNK: blocks}
        knob_given: dict[str, Any] = {"chunk_bytes": request.chunk_bytes}
        notes.append(
            f"--chunk-bytes {request.chunk_bytes}: the smallest blocks_per_chunk whose chunk "
            f"bytes per worker ({bytes_per_block} x B) reach it is {blocks}"
            + (f" ({first} was not valid)" if blocks != first else "")
        )
    else:
        knob_extra = dict(request.knob_extra)
        knob_given = dict(request.knob_extra)
        flag = "--block-size" if BLOCK_SIZE in knob_extra else "--blocks-per-chunk"
        chunking, vllm_extra = _resolve_or_fail(resolve, knob_extra, flag)
        if not knob_extra:
            notes.append("no chunk knob given: vLLM's default blocks_per_chunk 1")
    blocks = int(vllm_extra[BLOCKS_PER_CHUNK])
    off = offloading_config(vllm_extra)

    world_size = int(vllm_config.parallel_config.world_size)
    bytes_per_block = int(off.worker_kv_bytes_per_block)
    replicated = bool(off.replicated_layout)
    copies = 1 if replicated else world_size
    alignment = int(V.CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT)
    chunk_bytes = bytes_per_block * blocks
    slot_bytes = _round_up(chunk_bytes * copies, alignment)
    num_chunks = request.cpu_bytes // slot_bytes if request.cpu_bytes is not None else None
    if num_chunks == 0:
        raise CliError(
            f"--cpu-bytes {request.cpu_bytes} holds no chunk: one chunk slot takes {slot_bytes} "
            f"bytes ({copies} x {chunk_bytes}, page-aligned); give at least {slot_bytes}"
        )
    if request.cpu_bytes is None:
        notes.append(
            'add "cpu_bytes_to_use" (--cpu-bytes) before serving: CPUOffloadingSpec requires it'
        )

    extra: dict[str, Any] = {**knob_extra, "spec_name": SPEC_NAME}
    if request.cpu_bytes is not None:
        extra["cpu_bytes_to_use"] = request.cpu_bytes
    kv_transfer_config = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    # What vLLM does with --kv-transfer-config: it must parse.
    V.KVTransferConfig(**copy.deepcopy(kv_transfer_config))

    groups = []
    for gc in chunking.groups:
        g = gc.group
        group_bytes_per_block = int(V.group_kv_bytes_per_block(worker_cfg.kv_cache_groups[g.index]))
        groups.append(
            {
                "index": g.index,
                "kind": g.kind.value,
                "vllm_spec": type(sched_cfg.kv_cache_groups[g.index].kv_cache_spec).__name__,
                "sliding_window": g.sliding_window,
                "attention_chunk_size": g.attention_chunk_size,
                "is_eagle": g.is_eagle,
                "tokens_per_block": g.tokens_per_block,
                "blocks_per_chunk": gc.blocks_per_chunk,
                "tokens_per_chunk": gc.tokens_per_chunk,
                "window_in_chunks": gc.window_in_chunks,
                "group_bytes_per_block": group_bytes_per_block,
                "group_bytes_per_chunk": group_bytes_per_block * gc.blocks_per_chunk,
                "chunk_bytes_per_worker": chunk_bytes,
                "chunks_per_gib": round(GiB / chunk_bytes, 2) if chunk_bytes else None,
            }
        )

    cache = vllm_config.cache_config
    resolved = derivation.fixture["resolved"]
    return {
        "kv_transfer_config": kv_transfer_config,
        "model": {
            "dir": str(request.model_dir),
            "given": request.model_arg,
            "architecture": request.architecture,
            "language_model_only": request.language_model_only,
            "tensor_parallel_size": request.tensor_parallel_size,
        },
        "engine": {
            "flags": request.engine_flags(),
            "block_size": request.block_size_gpu,
            "kv_cache_dtype": request.kv_cache_dtype,
            "hybrid_kv_cache_manager": not request.no_hybrid,
            "prefix_match_unit": request.prefix_match_unit,
            "mamba_cache_mode": request.mamba_cache_mode,
            "max_model_len": request.max_model_len,
            "prefix_cache_retention_interval": cache.prefix_cache_retention_interval,
        },
        "vllm": {
            "version": V.VLLM_VERSION,
            "cache_block_size": int(cache.block_size),
            "resolved_cache_dtype": str(cache.cache_dtype),
            "scheduler_block_size": resolved["scheduler_block_size"],
            "tokens_per_hash": int(chunking.tokens_per_hash),
            "num_kv_cache_groups": len(sched_cfg.kv_cache_groups),
            "offloaded_group_ids": [gc.group.index for gc in chunking.groups],
        },
        "knob": {
            "given": knob_given,
            "blocks_per_chunk": blocks,
            "alignment_tokens": chunking.alignment_tokens,
        },
        "cpu_tier": {
            "spec_name": SPEC_NAME,
            "worker_kv_bytes_per_block": bytes_per_block,
            "world_size": world_size,
            "replicated_layout": replicated,
            "copies": copies,
            "chunk_bytes_per_worker": chunk_bytes,
            "page_alignment": alignment,
            "slot_bytes": slot_bytes,
            "cpu_bytes_to_use": request.cpu_bytes,
            "num_chunks": num_chunks,
        },
        "groups": groups,
        "notes": notes,
    }


def _resolve_or_fail(resolve: Any, knob_extra: dict[str, int], flag: str) -> Any:
    try:
        return resolve(knob_extra)
    except ValueError as e:
        raise CliError(f"{flag}: {e}") from None


# ---------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            text = f"{value:.0f}" if unit == "B" else f"{value:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError  # pragma: no cover


def _groups(n: int) -> str:
    return f"{n} KV-cache group" + ("" if n == 1 else "s")


def _kind(group: dict[str, Any]) -> str:
    kind = str(group["kind"])
    if group["sliding_window"] is not None:
        kind += f" {group['sliding_window']}"
    if group["attention_chunk_size"] is not None:
        kind += f" {group['attention_chunk_size']}"
    if group["is_eagle"]:
        kind += " (EAGLE)"
    return kind


COLUMNS = (
    "group",
    "kind",
    "tokens/block",
    "blocks/chunk",
    "tokens/chunk",
    "window (chunks)",
    "group bytes/chunk",
    "chunk bytes/worker",
    "chunks/GiB",
)


def _rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for g in doc["groups"]:
        window = g["window_in_chunks"]
        rows.append(
            [
                str(g["index"]),
                _kind(g),
                str(g["tokens_per_block"]),
                str(g["blocks_per_chunk"]),
                str(g["tokens_per_chunk"]),
                "-" if window is None else str(window),
                f"{g['group_bytes_per_chunk']} ({_human(g['group_bytes_per_chunk'])})",
                f"{g['chunk_bytes_per_worker']} ({_human(g['chunk_bytes_per_worker'])})",
                "-" if g["chunks_per_gib"] is None else f"{g['chunks_per_gib']:g}",
            ]
        )
    return rows


def _summary_lines(doc: dict[str, Any]) -> list[tuple[str, str]]:
    model, engine, vllm, knob, cpu = (
        doc["model"],
        doc["engine"],
        doc["vllm"],
        doc["knob"],
        doc["cpu_tier"],
    )
    given = knob["given"]
    if given:
        ((name, value),) = given.items()
        knob_text = f"{name}={value} -> blocks_per_chunk {knob['blocks_per_chunk']} (every group)"
    else:
        knob_text = f"none -> blocks_per_chunk {knob['blocks_per_chunk']} (vLLM's default)"
    if knob["alignment_tokens"] is not None:
        knob_text += f"; hits align to {knob['alignment_tokens']} tokens"
    if cpu["replicated_layout"]:
        layout = f"one copy for all {cpu['world_size']} ranks: vLLM's replicated MLA layout"
    else:
        layout = f"{cpu['copies']} rank copies"
    cpu_text = (
        f"{cpu['worker_kv_bytes_per_block']} B/block per worker; chunk "
        f"{cpu['chunk_bytes_per_worker']} B ({_human(cpu['chunk_bytes_per_worker'])}) per worker; "
        f"slot {cpu['slot_bytes']} B ({layout}; {cpu['page_alignment']}-byte aligned)"
    )
    if cpu["cpu_bytes_to_use"] is not None:
        cpu_text += (
            f"; cpu_bytes_to_use {cpu['cpu_bytes_to_use']} ({_human(cpu['cpu_bytes_to_use'])}) "
            f"-> {cpu['num_chunks']} chunks"
        )
    lm = ", language model only" if model["language_model_only"] else ""
    return [
        ("model", f"{model['given']} ({model['architecture']}{lm})"),
        (
            "engine",
            engine["flags"]
            + (
                f" --prefix-cache-retention-interval {engine['prefix_cache_retention_interval']}"
                if engine["prefix_cache_retention_interval"]
                else ""
            ),
        ),
        (
            "vLLM",
            f"{vllm['version']} KV planning on CPU: {_groups(vllm['num_kv_cache_groups'])} "
            f"(offloaded {vllm['offloaded_group_ids']}), cache block {vllm['cache_block_size']} "
            f"tokens, kv_cache_dtype {vllm['resolved_cache_dtype']}, tokens_per_hash "
            f"{vllm['tokens_per_hash']}",
        ),
        ("knob", knob_text),
        ("CPU tier", cpu_text),
        *(("note", note) for note in doc["notes"]),
    ]


def _config_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc["kv_transfer_config"])


def render_table(doc: dict[str, Any]) -> str:
    out = [f"{label:<9} {text}" for label, text in _summary_lines(doc)]
    rows = [list(COLUMNS), *_rows(doc)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    out.append("")
    for row in rows:
        cells = [
            cell.ljust(w) if i == 1 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        out.append("  ".join(cells).rstrip())
    out += ["", "--kv-transfer-config:", _config_json(doc)]
    return "\n".join(out) + "\n"


def render_markdown(doc: dict[str, Any]) -> str:
    model = doc["model"]
    out = [
        f"### kvchunk config: {Path(model['dir']).name}, TP {model['tensor_parallel_size']}",
        "",
    ]
    out += [f"* **{label}**: {text}" for label, text in _summary_lines(doc)]
    out += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(row) + " |" for row in _rows(doc)]
    out += ["", "`--kv-transfer-config`:", "", "```json", _config_json(doc), "```"]
    return "\n".join(out) + "\n"


def render(doc: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(doc, indent=2) + "\n"
    if fmt == "markdown":
        return render_markdown(doc)
    return render_table(doc)


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(
    argv: Sequence[str] | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Run the CLI; returns the exit status (0 ok, 2 user error, 1 internal error)."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = bool(os.environ.get("KVCHUNK_DEBUG"))
    label = f"{PROG} config" if argv[:1] == ["config"] else PROG
    try:
        parser = build_parser()
        try:
            with contextlib.redirect_stdout(out):
                args = parser.parse_args(argv)
        except SystemExit as e:  # --help
            return e.code if isinstance(e.code, int) else 0
        request = validate(args)
        doc = plan(request, debug=debug)
        out.write(render(doc, request.format))
        out.flush()
        return 0
    except CliError as e:
        print(f"{label}: error: {_one_line(str(e))}", file=err)
        return 2
    except KeyboardInterrupt:
        print(f"{label}: interrupted", file=err)
        return 130
    except Exception as e:
        if debug:
            raise
        print(
            f"{label}: internal error: {_one_line(_describe_exception(e))} "
            "(set KVCHUNK_DEBUG=1 for the traceback)",
            file=err,
        )
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
