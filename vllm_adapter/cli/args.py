"""The CLI's arguments: parser, argument types and :func:`validate` (no vLLM import)."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from reference.geometry import Geometry
from reference.knobs import (
    BLOCK_SIZE,
    BLOCKS_PER_CHUNK,
    BlockSize,
    BlocksPerChunk,
    is_integer_string,
    parse_knob,
)
from reference.workload import (
    PRESETS,
    GpuCache,
    Workload,
    load_workload,
    preset,
    requests,
)
from vllm_adapter import units
from vllm_adapter.disk.budget import DISK_BYTES_KEY
from vllm_adapter.disk_model import FS_MODEL_KEYS, FsModel
from vllm_adapter.metadata_model import DEFAULT_FS_METADATA_OPS
from vllm_adapter.names import (
    CPU_SPEC,
    KVCHUNK_CONNECTOR,
    KVCHUNK_TIERING_SPEC,
    KVCHUNK_TIERING_SPEC_NAME,
    TIERING_SPEC,
)
from vllm_adapter.planning import DEFAULT_WORKLOAD

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_WORKLOAD",
    "DENSE",
    "FORMATS",
    "PROG",
    "CliError",
    "Request",
    "build_parser",
    "parse_bytes",
    "spec_entries",
    "validate",
]

PROG = "python -m vllm_adapter"

ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "Gemma4ForConditionalGeneration": ("gemma4", True),
    "Gemma4ForCausalLM": ("gemma4", False),
    "DeepseekV4ForCausalLM": ("deepseek_v4", False),
}
"""Architectures whose KV-cache layers :mod:`vllm_adapter.derive` builds on CPU:
``architecture -> (derive source, language_model_only)``.  Gemma-4's vision tower
holds no KV cache, so the multimodal model is planned language-model-only."""

FORMATS = ("table", "json", "markdown")
DENSE = "None"
"""``--prefix-cache-retention-interval None``: dense retention (vLLM's spelling)."""
SPEC_NAMES = (CPU_SPEC, TIERING_SPEC, KVCHUNK_TIERING_SPEC_NAME)
TIER_SPECS = (TIERING_SPEC, KVCHUNK_TIERING_SPEC_NAME)
"""The specs with secondary tiers: ``--fs-path`` adds the fs tier.  kvchunk's
(``spec_module_path`` :data:`~vllm_adapter.names.KVCHUNK_TIERING_SPEC_MODULE`) checksums and
namespaces the files and takes the tier's byte budget (``--disk-bytes``)."""
GPU_CACHES = tuple(c.value for c in GpuCache)
"""``--gpu-cache``'s values: :class:`reference.workload.GpuCache`'s."""
FS_TIER = "fs"
"""vLLM's file-system secondary tier (``SecondaryTierFactory`` name, 0.33.0 and 0.34.0)."""


class CliError(Exception):
    """A user mistake (or a configuration vLLM refuses): one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise CliError(f"{message} (see '{self.prog} --help')")


def _positive_int(text: str) -> int:
    if not is_integer_string(text) or int(text) <= 0:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, got {text!r} (digits, for example 4)"
        )
    return int(text)


def _non_negative_int(text: str) -> int:
    if not is_integer_string(text):
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 such as 0 or 16, got {text!r}")
    return int(text)


def _retention(text: str) -> int | str:
    """An integer >= 0, or ``None`` / ``none`` (dense retention, vLLM's ``None``)."""
    if text.strip().lower() == "none":
        return DENSE
    if not is_integer_string(text):
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 0 or None (dense retention), got {text!r}"
        )
    return int(text)


def parse_bytes(text: str) -> int:
    """:func:`vllm_adapter.units.parse_bytes` (the one byte parser, shared with the disk
    tier's ``disk_bytes_to_use``) as an argparse type: its ``ValueError`` becomes an
    ``ArgumentTypeError`` with the same message."""
    try:
        return units.parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="kvchunk operator tooling (see 'config --help').")
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)
    config = commands.add_parser(
        "config",
        prog=f"{PROG} config",
        help="the --kv-transfer-config JSON and per-group chunk table for a model",
        description=(
            "Derive a model's KV-cache geometry with vLLM's own planning (on CPU), resolve the "
            f"chunk knob as {KVCHUNK_CONNECTOR} will, and print the --kv-transfer-config "
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
    _add_spec_flags(config.add_argument_group("offloading spec"))
    _add_cache_flags(config.add_argument_group("vLLM engine cache flags"))
    _add_economics_flags(config.add_argument_group("file economics (reference.economics)"))
    _add_metadata_flags(config.add_argument_group(
        "engines per file system (vllm_adapter.metadata_model)"))
    config.add_argument("--format", choices=FORMATS, default="table")
    return parser


def _add_economics_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--workload",
        default=DEFAULT_WORKLOAD,
        metavar="PRESET|FILE",
        help=f"the workload served: a preset ({', '.join(PRESETS)}; default {DEFAULT_WORKLOAD}) "
        "or a TOML file in the format of reference/workloads/*.toml",
    )
    group.add_argument(
        "--gpu-cache",
        choices=GPU_CACHES,
        metavar="MODE",
        help=f"what the GPU prefix cache holds when a request arrives ({', '.join(GPU_CACHES)}); "
        "overrides the workload's gpu_cache (every preset: cold) for every figure, "
        "--disk-bytes and --sweep-disk included (both series)",
    )
    group.add_argument(
        "--decode-storing",
        action="store_true",
        help="store decoded tokens too (vLLM's offload_prompt_only false; default: prompt only)",
    )
    group.add_argument(
        "--fs-model",
        choices=tuple(FS_MODEL_KEYS),
        metavar="NAME",
        help=f"the disk model for the modelled disk time ({', '.join(FS_MODEL_KEYS)}; "
        "default: all)",
    )
    group.add_argument(
        "--sweep",
        action="store_true",
        help="the same figures across knob values: block sizes (powers of two from 256) with "
        "--block-size, else blocks_per_chunk 1..128",
    )
    group.add_argument(
        "--disk-bytes",
        type=parse_bytes,
        metavar="SIZE",
        help="serve the workload (scaled to ~1M prompt tokens of sessions over time) over a "
        "disk tier of SIZE bytes (e.g. 2TiB): hits, files read and evicted, tokens recomputed "
        "for lack of space, per million prompt tokens, under the eviction rule and plain LRU; "
        f"with --spec-name {KVCHUNK_TIERING_SPEC_NAME}, also the fs tier's {DISK_BYTES_KEY}; "
        "at least the packed files one full chunk needs (the error names that size)",
    )
    group.add_argument(
        "--sweep-disk",
        action="store_true",
        help="hit rate against disk size (the miss-ratio curve) for the chosen knob, the "
        "eviction rule and plain LRU side by side, with LRU's stranded bytes",
    )
    group.add_argument(
        "--plot",
        metavar="PATH",
        help="with --sweep or --sweep-disk: write a PNG of the sweep (needs matplotlib)",
    )


def _add_metadata_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--fs-metadata-ops",
        type=_positive_int,
        metavar="N",
        help="the shared file system's metadata operations per second, shared by every engine "
        f"(default {DEFAULT_FS_METADATA_OPS}: the low end of the 2.7k-12.5k requests/s one CephFS "
        "MDS was seen to serve, red-hat-storage/ocs-operator#471 and ceph/ceph#30592, as "
        "collected in /work/shared/design/disk-anchors.md section 4); needs "
        "--prefill-tokens-per-s",
    )
    group.add_argument(
        "--prefill-tokens-per-s",
        type=_positive_int,
        metavar="T",
        help="prompt tokens one engine takes in per second (computed or loaded: the per-million "
        "figures' denominator); no default, it depends on the GPUs, the model and the batch: "
        "without it the metadata operations are printed per million prompt tokens only, "
        "with it also per second and how many engines --fs-metadata-ops serves",
    )


def _add_spec_flags(spec: argparse._ArgumentGroup) -> None:
    spec.add_argument(
        "--spec-name",
        choices=SPEC_NAMES,
        default=CPU_SPEC,
        help=f"vLLM's offloading spec (default {CPU_SPEC}); {TIERING_SPEC} adds the file-system "
        f"tier below the CPU tier (needs --fs-path); {KVCHUNK_TIERING_SPEC_NAME} is kvchunk's "
        "disk tier: the same with checksummed, geometry-namespaced files under a byte budget "
        "(needs --fs-path, and --disk-bytes to serve)",
    )
    spec.add_argument(
        "--fs-path", metavar="DIR", help="the fs tier's root_dir: where chunk files go"
    )
    spec.add_argument(
        "--fs-read-threads", type=_positive_int, metavar="N", help="n_read_threads (vLLM: 16)"
    )
    spec.add_argument(
        "--fs-write-threads", type=_positive_int, metavar="N", help="n_write_threads (vLLM: 16)"
    )


def _fs_tier(args: argparse.Namespace) -> dict[str, Any] | None:
    """The fs tier's ``secondary_tiers`` entry (FileSystemTierManager's parameter names)."""
    fs_flags = [
        flag
        for flag, value in (
            ("--fs-path", args.fs_path),
            ("--fs-read-threads", args.fs_read_threads),
            ("--fs-write-threads", args.fs_write_threads),
        )
        if value is not None
    ]
    if args.spec_name not in TIER_SPECS:
        if fs_flags:
            raise CliError(
                f"{fs_flags[0]} needs --spec-name {TIERING_SPEC} or {KVCHUNK_TIERING_SPEC_NAME}"
            )
        return None
    if not args.fs_path or not str(args.fs_path).strip():
        raise CliError(
            f"--spec-name {args.spec_name}: give --fs-path DIR (the fs tier's root_dir)"
        )
    user_path("--fs-path", str(args.fs_path))  # the tier expands ~; an unknown ~user: fail here
    tier: dict[str, Any] = {"type": FS_TIER, "root_dir": str(args.fs_path)}
    if args.fs_read_threads is not None:
        tier["n_read_threads"] = args.fs_read_threads
    if args.fs_write_threads is not None:
        tier["n_write_threads"] = args.fs_write_threads
    if args.spec_name == KVCHUNK_TIERING_SPEC_NAME and args.disk_bytes is not None:
        tier[DISK_BYTES_KEY] = args.disk_bytes
    return tier


def spec_entries(spec_name: str) -> dict[str, str]:
    """The ``kv_connector_extra_config`` entries that select ``spec_name``: vLLM's own specs
    by name, kvchunk's disk spec with its ``spec_module_path``."""
    if spec_name == KVCHUNK_TIERING_SPEC_NAME:
        return dict(KVCHUNK_TIERING_SPEC)
    return {"spec_name": spec_name}


def _add_cache_flags(cache: argparse._ArgumentGroup) -> None:
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
        type=_retention,
        metavar="N|None",
        help="vLLM's cache flag (default 0: sparse; None: dense); windowed groups' chunk spans "
        "must divide N",
    )


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
    """``None``: not given (vLLM's default), unless :attr:`dense_retention`."""
    format: str
    spec_name: str = CPU_SPEC
    fs_tier: dict[str, Any] | None = None
    """The ``secondary_tiers`` entry of the fs tier (:data:`TIER_SPECS` only; kvchunk's
    carries ``disk_bytes_to_use`` from ``--disk-bytes``)."""
    dense_retention: bool = False
    """``--prefix-cache-retention-interval None``: vLLM's dense retention."""
    workload: Workload | None = None
    """``None``: :data:`DEFAULT_WORKLOAD`."""
    workload_given: str = DEFAULT_WORKLOAD
    decode_storing: bool = False
    fs_models: tuple[FsModel, ...] = ()
    """The disk models to print; empty: all (:data:`vllm_adapter.disk_model.FS_MODELS`)."""
    sweep: bool = False
    plot: Path | None = None
    disk_bytes: int | None = None
    """``--disk-bytes``: the disk tier's budget to serve the workload over."""
    sweep_disk: bool = False
    fs_metadata_ops: int | None = None
    """``--fs-metadata-ops``; ``None``: :data:`~vllm_adapter.metadata_model.DEFAULT_FS_METADATA_OPS`."""
    prefill_tokens_per_s: int | None = None
    """``--prefill-tokens-per-s``: one engine's prompt tokens per second."""

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
        if self.dense_retention:
            flags.append(f"--prefix-cache-retention-interval {DENSE}")
        elif self.retention_interval:
            flags.append(f"--prefix-cache-retention-interval {self.retention_interval}")
        return " ".join(flags)

    def workload_or_default(self) -> Workload:
        return self.workload if self.workload is not None else preset(DEFAULT_WORKLOAD)


def user_path(flag: str, text: str) -> Path:
    """``text`` as a path, ``~`` and ``~user`` expanded; an unknown user is one line naming ``flag``."""
    try:
        return Path(text).expanduser()
    except RuntimeError:  # pathlib: "Could not determine home directory."
        user = text.split("/", 1)[0]
        raise CliError(
            f"{flag} {text}: cannot expand {user!r} (no such user or no home directory); "
            "give an absolute path such as /data/models/gemma-4-31B-it"
        ) from None


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


_NO_GROUPS = Geometry(groups=(), tokens_per_hash=1)
"""Knob syntax checks need no geometry."""


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
                    _NO_GROUPS,
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
            knob = parse_knob({key: value}, _NO_GROUPS)
        except ValueError as e:
            raise CliError(f"{flag}: {e}") from None
        if isinstance(knob, BlockSize):
            return {BLOCK_SIZE: knob.tokens}
        assert isinstance(knob, BlocksPerChunk)
        return {BLOCKS_PER_CHUNK: knob.value}
    return {}


def _workload(text: str) -> Workload:
    """A preset name or a workload TOML file; a malformed file is one line naming the field."""
    name = str(text).strip()
    if name in PRESETS:
        return preset(name)
    path = user_path("--workload", name)
    if not path.exists():
        raise CliError(
            f"--workload {text}: neither a preset ({', '.join(PRESETS)}) nor an existing file"
        )
    try:
        return load_workload(path)
    except ValueError as e:
        raise CliError(f"--workload: {e}") from None


def _check_prompts_fit(workload: Workload, given: str, max_model_len: int) -> None:
    """vLLM refuses a prompt longer than ``max_model_len``: say so before the economics run."""
    longest = max(len(r.prompt) for r in requests(workload))
    if longest > max_model_len:
        raise CliError(
            f"--max-model-len {max_model_len}: workload {given}'s longest prompt is {longest} "
            f"tokens, which vLLM would refuse; give --max-model-len {longest} or more, or a "
            "workload with shorter prompts"
        )


def validate(args: argparse.Namespace) -> Request:
    """Everything that needs no vLLM: paths, numbers, knob exclusivity, the architecture."""
    model_dir = user_path("--model", args.model)
    if not model_dir.exists():
        raise CliError(f"--model {args.model}: no such directory")
    if not model_dir.is_dir():
        raise CliError(f"--model {args.model}: not a directory (give the model's directory)")
    model_dir = model_dir.resolve()
    knob_extra = _knob_extra(args)
    fs_tier = _fs_tier(args)
    arch = _architecture(model_dir)
    source, language_model_only = ARCHITECTURES[arch]
    workload = _workload(args.workload)
    if args.gpu_cache is not None:  # the flag overrides the workload's own gpu_cache
        workload = replace(workload, gpu_cache=GpuCache(args.gpu_cache))
    if args.plot is not None and not (args.sweep or args.sweep_disk):
        raise CliError("--plot needs --sweep or --sweep-disk (it draws the sweep)")
    if args.plot is not None and args.sweep and args.sweep_disk:
        raise CliError(
            "--plot draws one sweep: give --sweep or --sweep-disk with it, not both"
        )
    if args.fs_metadata_ops is not None and args.prefill_tokens_per_s is None:
        raise CliError(
            "--fs-metadata-ops needs --prefill-tokens-per-s T (one engine's prompt tokens per "
            "second): the engines a file system serves depend on both"
        )
    if args.sweep and args.chunk_bytes is not None:
        raise CliError("--sweep sweeps --block-size or --blocks-per-chunk, not --chunk-bytes")
    if args.max_model_len is not None:
        _check_prompts_fit(workload, str(args.workload), args.max_model_len)
    retention = args.prefix_cache_retention_interval
    dense = retention == DENSE
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
        retention_interval=None if dense else retention,
        format=args.format,
        spec_name=args.spec_name,
        fs_tier=fs_tier,
        dense_retention=dense,
        workload=workload,
        workload_given=str(args.workload),
        decode_storing=bool(args.decode_storing),
        fs_models=(FS_MODEL_KEYS[args.fs_model],) if args.fs_model else (),
        sweep=bool(args.sweep),
        plot=user_path("--plot", args.plot) if args.plot is not None else None,
        disk_bytes=args.disk_bytes,
        sweep_disk=bool(args.sweep_disk),
        fs_metadata_ops=args.fs_metadata_ops,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
    )
