"""``python -m vllm_adapter config``: the ``--kv-transfer-config`` for kvchunk's connector.

::

    python -m vllm_adapter config --model <dir with config.json> --tensor-parallel-size N \\
        [--block-size T | --blocks-per-chunk B | --chunk-bytes X] [--cpu-bytes Y] \\
        [--block-size-gpu N] [--kv-cache-dtype D] [--no-hybrid] [--prefix-match-unit N] \\
        [--mamba-cache-mode align|none] [--max-model-len N] \\
        [--prefix-cache-retention-interval N|None] [--format table|json|markdown] \\
        [--spec-name CPUOffloadingSpec|TieringOffloadingSpec|KvchunkTieringOffloadingSpec \\
         --fs-path DIR [--fs-read-threads N] [--fs-write-threads N]] \\
        [--workload PRESET|FILE] [--gpu-cache cold|hot_shared_prefix] [--decode-storing] \\
        [--fs-model local|nfs|object-store] [--sweep] [--disk-bytes SIZE] [--sweep-disk] \\
        [--plot PATH]
        [--prefill-tokens-per-s T [--fs-metadata-ops N]]

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

4. **Files.**  vLLM's file-system tier (``--spec-name TieringOffloadingSpec``
   with ``--fs-path``: ``secondary_tiers: [{"type": "fs", "root_dir": ...}]``,
   plus ``n_read_threads`` / ``n_write_threads`` when given -- the
   ``FileSystemTierManager`` parameters of 0.33.0 and 0.34.0) writes one file
   per chunk per group, each one CPU slot: the output states the file size; the
   files a workload writes and reads, per layout (per chunk, and kvchunk's packed
   tier), are item 5's.  ``--spec-name KvchunkTieringOffloadingSpec`` prints kvchunk's
   disk tier instead (``"spec_module_path": "vllm_adapter.disk"``, the same ``fs`` tier
   entry plus ``"disk_bytes_to_use"`` from ``--disk-bytes``; without it, a note says to
   add it before serving).
5. **Workload** (:mod:`vllm_adapter.economics`).  ``--workload`` (a preset of
   :data:`reference.workload.PRESETS`, default ``chat``: :data:`.args.DEFAULT_WORKLOAD`
   says why; or a TOML file; ``--gpu-cache`` overrides its ``gpu_cache``, for every
   figure below, the disk's included) is served through the reference Planner under the
   installed release's rules (:mod:`vllm_adapter.releases`) with the engine's
   retention (``--prefix-cache-retention-interval N|None``) and
   ``offload_prompt_only`` (``--decode-storing`` sets it false) by
   :func:`reference.economics.economics`: per group, files and bytes written and
   read per million prompt tokens; tokens recomputed (partial tail, lost chunks);
   modelled disk seconds per million prompt tokens under each disk model of
   :mod:`vllm_adapter.disk_model` (``--fs-model`` picks one), IOPS- or
   bandwidth-bound.  Also what a per-group ``blocks_per_chunk`` map (every group
   the full-attention tokens per chunk, resolved by the reference; vLLM refuses
   it) would give on the same workload.  ``--sweep`` prints the same across 8
   knob values (``--block-size``: powers of two from 256; otherwise
   ``blocks_per_chunk`` 1..128), the hit cost of each step up and, per disk
   model, the smallest chunk no longer IOPS-bound; ``--plot PATH`` draws it
   (matplotlib).
6. **Engines per file system** (:mod:`vllm_adapter.metadata_model`).  A shared file
   system's metadata service is one rate shared by every engine: per layout (vLLM's
   per-chunk fs tier, kvchunk's packed tier with its ledger), the metadata operations per
   million prompt tokens (files created, opened, renamed, unlinked, ``makedirs``, lookups,
   the ledger's root lock and appends: each event's syscalls times the reference's counts),
   and with ``--prefill-tokens-per-s T`` (one engine's prompt tokens per second; no default:
   it depends on the GPUs, the model and the batch) one engine's operations per second and
   how many engines ``--fs-metadata-ops N`` serves (default
   :data:`~vllm_adapter.metadata_model.DEFAULT_FS_METADATA_OPS`, one CephFS MDS; the
   source is printed).

Output: the JSON for ``--kv-transfer-config`` (``KvchunkOffloadingConnector``
from ``vllm_adapter.connector``, ``kv_both``, ``kv_connector_extra_config``
holding the knob as given -- or the chosen ``blocks_per_chunk`` --,
``spec_name: CPUOffloadingSpec`` and ``cpu_bytes_to_use`` when given) and a
per-group table, as ``table`` (default), ``json`` or ``markdown``.

Every user mistake is one line on stderr and exit status 2; an unexpected
failure is one line and status 1 (``KVCHUNK_DEBUG=1`` shows the traceback).
Argument checks that need no model run before vLLM is imported.

Modules: :mod:`.args` (parser, :func:`validate`), :mod:`.derivation` (vLLM's planning),
:mod:`.knob` (the knob), :mod:`.cpu_tier` (the CPU tier), :mod:`.sweeps` (``--sweep``),
:mod:`.disk` (``--disk-bytes`` / ``--sweep-disk``: hit rate per disk size,
:mod:`reference.disk_economics`), :mod:`.sizing` (:func:`plan`: orchestration; the computations
on a planned engine, shared with the bench, are :mod:`vllm_adapter.planning` and
:mod:`vllm_adapter.economics`, which never import the CLI), :mod:`.economics` (``--plot`` of
``--sweep``), :mod:`.result` (:class:`Sizing`, the typed result), :mod:`.render`
(table / markdown / json).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from typing import TextIO

from vllm_adapter.cli.args import (
    ARCHITECTURES,
    PROG,
    CliError,
    Request,
    build_parser,
    parse_bytes,
    validate,
)
from vllm_adapter.cli.derivation import describe_exception
from vllm_adapter.cli.render import render
from vllm_adapter.cli.result import Sizing
from vllm_adapter.cli.sizing import plan

__all__ = [
    "ARCHITECTURES",
    "CliError",
    "Request",
    "Sizing",
    "build_parser",
    "main",
    "parse_bytes",
    "plan",
    "render",
    "validate",
]


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
        out.write(render(plan(request, debug=debug), request.format))
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
            f"{label}: internal error: {_one_line(describe_exception(e))} "
            "(set KVCHUNK_DEBUG=1 for the traceback)",
            file=err,
        )
        return 1
