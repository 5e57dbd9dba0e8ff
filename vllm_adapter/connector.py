"""``KvchunkOffloadingConnector``: vLLM's OffloadingConnector with kvchunk's knobs.

Supported: vLLM 0.33.0 and 0.34.0; every limit named below holds on both.

vLLM's ``{"block_size": 512}`` dies with a bare ``AssertionError`` in
``build_offloading_config`` on models whose offloaded KV groups disagree on
tokens per block (gemma-4, DeepSeek-V4).  This connector reads the same
``kv_connector_extra_config`` through the reference's knob rules
(:func:`reference.knobs.resolve_extra_config`):

* ``"block_size": T`` is the chunk span of the full-attention groups, so it
  works on mixed-block-size models (gemma-4-31B-it TP2: 512 -> 16 blocks per
  chunk with vLLM 0.33.0's default 16-token cache blocks, 4 with 0.34.0's
  default 64; DeepSeek-V4-Flash TP4 ``--block-size 256``: 512 -> 2);
* ``"blocks_per_chunk": B`` is vLLM's own knob;
* ``"blocks_per_chunk": {"<group index>": B, "default": B}`` is accepted when
  every offloaded group ends up with the same B (vLLM's scheduler and CPU
  tier execute one blocks-per-chunk value), rejected otherwise.

Every mistake is a ``ValueError`` naming the knob, the group and a valid
value.  The resolved chunking is handed to vLLM as one global
``blocks_per_chunk`` on a shallow copy of the config (``block_size`` removed);
from there on this *is* vLLM's OffloadingConnector: same scheduler, same
worker, same CPU tier, nothing forked.  ``self.kvchunk_chunking`` holds the
reference :class:`~reference.knobs.Chunking`.

The ``vllm serve`` commands for both models live in one place, README.md
("Serving with kvchunk's connector"); ``tests/test_readme.py`` checks that their
``--kv-transfer-config`` is valid JSON naming this class and module.

(``vllm_adapter`` must be importable in the engine and worker processes, e.g.
``pip install -e .`` of kvchunk.)  The same JSON with ``"kv_connector":
"OffloadingConnector"`` and no module path is vLLM's stock connector, which
raises ``AssertionError: If 'block_size' is specified in
kv_connector_extra_config, there must be at least one KV cache group, and all
groups must have the same block size.`` on both models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from reference.knobs import (
    BLOCK_SIZE,
    BLOCKS_PER_CHUNK,
    DEFAULT_KEY,
    Chunking,
    is_integer_string,
    resolve_extra_config,
)
from vllm_adapter import vllm_api as V
from vllm_adapter.geometry import geometry_from_vllm, retention_interval_from, with_extra_config

__all__ = ["KvchunkOffloadingConnector", "resolve_for_vllm", "translate_extra_config"]

# Specs whose __init__ reads cpu_bytes_to_use (TieringOffloadingSpec subclasses CPUOffloadingSpec).
_CPU_SPECS = ("CPUOffloadingSpec", "TieringOffloadingSpec")
# Specs whose manager is vLLM's CPUOffloadingManager (eviction_policy, max_tracker_size).
_MANAGER_SPECS = (*_CPU_SPECS, "ReferenceOffloadingSpec")


def _knob_used(extra: Mapping[str, Any]) -> str:
    return BLOCK_SIZE if extra.get(BLOCK_SIZE) is not None else BLOCKS_PER_CHUNK


def _int_like(key: str, value: Any, *, positive: bool = False, non_negative: bool = False) -> None:
    """``value`` must survive vLLM's ``int(value)``: ints and decimal strings, no bools."""
    if isinstance(value, bool):
        raise ValueError(f"'{key}' in kv_connector_extra_config must be an integer, got {value!r}.")
    if isinstance(value, str) and not is_integer_string(value, signed=True):
        raise ValueError(
            f"'{key}' in kv_connector_extra_config must be an integer written in digits "
            f"(for example 1000), got {value!r}."
        )
    try:
        n = int(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(
            f"'{key}' in kv_connector_extra_config must be an integer, got {value!r} "
            f"({type(value).__name__})."
        ) from None
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"'{key}' in kv_connector_extra_config must be an integer, got {value!r}.")
    if positive and n <= 0:
        raise ValueError(f"'{key}' in kv_connector_extra_config must be greater than 0, got {value!r}.")
    if non_negative and n < 0:
        raise ValueError(f"'{key}' in kv_connector_extra_config must be >= 0, got {value!r}.")


def _check_other_keys(extra: Mapping[str, Any]) -> None:
    """The non-chunk keys vLLM's offloading path would choke on with a non-ValueError.

    ``spec_name`` / ``spec_module_path`` (string keys of the spec factory),
    ``cpu_bytes_to_use`` (required and ``int()``-ed by the CPU/tiering specs,
    which raise a bare ``Exception`` when it is missing), ``sync_load_budget_bytes``
    and ``store_threshold`` (``int()``-ed by the scheduler / CPU spec).
    """
    for key in ("spec_name", "spec_module_path"):
        if key in extra and not isinstance(extra[key], str):
            raise ValueError(
                f"'{key}' in kv_connector_extra_config must be a string, got {extra[key]!r}."
            )
    if extra.get("spec_name", "CPUOffloadingSpec") in _CPU_SPECS:
        if not extra.get("cpu_bytes_to_use"):
            raise ValueError(
                "'cpu_bytes_to_use' must be specified in kv_connector_extra_config "
                f"(bytes of CPU memory for offloaded KV), got {extra.get('cpu_bytes_to_use')!r}."
            )
        _int_like("cpu_bytes_to_use", extra["cpu_bytes_to_use"], positive=True)
    if "sync_load_budget_bytes" in extra:
        _int_like("sync_load_budget_bytes", extra["sync_load_budget_bytes"], non_negative=True)
    if "store_threshold" in extra:
        _int_like("store_threshold", extra["store_threshold"])
    if extra.get("spec_name", "CPUOffloadingSpec") in _MANAGER_SPECS:
        _check_cache_policy(extra)


def _check_cache_policy(extra: Mapping[str, Any]) -> None:
    """``max_tracker_size`` (``int()``-ed) and ``eviction_policy`` / ``cache_policy_module_path``.

    vLLM's CPU manager resolves the policy through ``CachePolicyFactory``; a
    bad name is a ``ValueError`` that does not say which key, an unhashable one
    a ``TypeError``, a bad module path an ``ImportError``.  Resolved here the
    same way, each becomes a ``ValueError`` naming the key.
    """
    if "max_tracker_size" in extra:
        _int_like("max_tracker_size", extra["max_tracker_size"])
    if "eviction_policy" not in extra and "cache_policy_module_path" not in extra:
        return
    name = extra.get("eviction_policy", "lru")
    module = extra.get("cache_policy_module_path")
    if not isinstance(name, str):
        raise ValueError(
            f"'eviction_policy' in kv_connector_extra_config must be a string, got {name!r}."
        )
    if module is not None and not isinstance(module, str):
        raise ValueError(
            "'cache_policy_module_path' in kv_connector_extra_config must be a string, "
            f"got {module!r}."
        )
    try:
        V.CachePolicyFactory.get_cache_policy_cls(name, module)
    except (ValueError, ImportError, AttributeError) as e:
        raise ValueError(
            f"'eviction_policy'={name!r} (cache_policy_module_path={module!r}) in "
            f"kv_connector_extra_config does not name a cache policy: {type(e).__name__}: {e}"
        ) from None


def resolve_for_vllm(vllm_config: Any, kv_cache_config: Any) -> tuple[Chunking, dict[str, Any]]:
    """The reference chunking of the engine config and the extra config vLLM must run.

    Raises ``ValueError`` for every user mistake: the reference's knob errors,
    per-group values vLLM cannot execute (unequal ``blocks_per_chunk``), chunkings
    the reference accepts but vLLM's ``tokens_per_block % tokens_per_hash``
    assert would reject, and malformed non-chunk keys (see :func:`_check_other_keys`).
    """
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        raise ValueError("kv_transfer_config must be set for KvchunkOffloadingConnector.")
    extra = ktc.kv_connector_extra_config
    if not isinstance(extra, Mapping):
        raise ValueError(
            f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}."
        )
    geometry = geometry_from_vllm(kv_cache_config, vllm_config)
    chunking = resolve_extra_config(geometry, extra, retention_interval_from(vllm_config))
    knob = _knob_used(extra)

    blocks_per_chunk = chunking.uniform_blocks_per_chunk
    if blocks_per_chunk is None:
        listing = "; ".join(
            f"{gc.group.describe()} -> {gc.blocks_per_chunk}" for gc in chunking.groups
        )
        values = sorted({gc.blocks_per_chunk for gc in chunking.groups})
        raise ValueError(
            f"'{BLOCKS_PER_CHUNK}' gives the offloaded groups different blocks per chunk "
            f"({listing}), but vLLM {V.VLLM_VERSION}'s offloading scheduler and CPU tier execute one "
            f"blocks_per_chunk for every group. Use the global form, e.g. "
            f"{{\"{BLOCKS_PER_CHUNK}\": {values[0]}}} (or {values[-1]}), or give every group "
            f"the same value (e.g. {{\"{BLOCKS_PER_CHUNK}\": {{\"{DEFAULT_KEY}\": {values[0]}}}}})."
        )

    tph = chunking.tokens_per_hash
    for gc in chunking.groups:
        tpb = gc.group.tokens_per_block
        if tpb % tph:
            raise ValueError(
                f"'{knob}' gives {gc.group.describe()} chunks of {gc.tokens_per_chunk} tokens, "
                f"which kvchunk accepts, but vLLM {V.VLLM_VERSION} requires every offloaded group's "
                f"tokens per block to be a multiple of tokens_per_hash={tph}, and this group "
                f"has {tpb} (vLLM issue #54413). Hybrid models (e.g. Mamba+Attention) need "
                f"--enable-prefix-caching and Mamba cache mode 'align' so that tokens_per_hash "
                f"divides every group's block size."
            )

    _check_other_keys(extra)

    vllm_extra = {k: v for k, v in extra.items() if k != BLOCK_SIZE}
    vllm_extra[BLOCKS_PER_CHUNK] = blocks_per_chunk
    return chunking, vllm_extra


def translate_extra_config(vllm_config: Any, kv_cache_config: Any) -> Any:
    """A copy of ``vllm_config`` carrying the extra config vLLM runs (caller's untouched)."""
    _, vllm_extra = resolve_for_vllm(vllm_config, kv_cache_config)
    return with_extra_config(vllm_config, vllm_extra)


class KvchunkOffloadingConnector(V.OffloadingConnector):
    """vLLM's OffloadingConnector, configured through kvchunk's knob rules.

    Only ``__init__`` differs: it resolves the knob with the reference and
    hands vLLM a shallow copy of ``vllm_config`` whose
    ``kv_connector_extra_config`` carries the resolved global
    ``blocks_per_chunk`` and no ``block_size``.  ``KVConnectorBase_V1`` keeps
    that copy as ``self._vllm_config`` / ``self._kv_transfer_config`` and the
    offloading scheduler/worker read the extra config only through it, so the
    copy is all vLLM ever sees; its sub-configs are the caller's own objects.
    """

    kvchunk_chunking: Chunking
    """The reference chunking this connector runs."""
    kvchunk_extra_config: dict[str, Any]
    """The ``kv_connector_extra_config`` handed to vLLM."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        chunking, vllm_extra = resolve_for_vllm(vllm_config, kv_cache_config)
        self.kvchunk_chunking = chunking
        self.kvchunk_extra_config = vllm_extra
        translated = with_extra_config(vllm_config, vllm_extra)
        try:
            super().__init__(translated, role, kv_cache_config)
        except (ImportError, AttributeError) as e:
            if "spec_module_path" not in vllm_extra:
                raise
            raise ValueError(
                f"'spec_name'={vllm_extra.get('spec_name')!r} from 'spec_module_path'="
                f"{vllm_extra['spec_module_path']!r} in kv_connector_extra_config could not be "
                f"loaded: {type(e).__name__}: {e}"
            ) from e
        except AssertionError as e:
            # Everything the extra config decides was validated above; an assert
            # here is still a configuration rejection, never a bare crash.
            raise ValueError(
                f"vLLM's OffloadingConnector rejected kv_connector_extra_config "
                f"{dict(vllm_config.kv_transfer_config.kv_connector_extra_config)!r} "
                f"(run as {vllm_extra!r}): AssertionError: {e}"
            ) from e
