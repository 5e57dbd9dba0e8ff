"""The corpus cases: geometry x knob x retention x one fixed workload each.

Each case is run on vLLM's real scheduler + connector (:mod:`conformance.corpus.generate`
builds the driver) and stored with its answers.  The workloads are fixed (no
drawing), chosen so that together the cases reach every rule of
``docs/semantics.md`` section 8 (:mod:`conformance.corpus.coverage` measures
which case reaches which).  Nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from conformance.protocol import trace as T

BASE = tuple((7 * i) % 30 for i in range(700))
"""Shared token stream: prompts are prefixes of it (shared prefixes hash alike)."""


@dataclass(frozen=True)
class CorpusSpec:
    """One corpus case before it is run: what the driver builds and what it runs."""

    geometry: str
    """Label of the geometry, e.g. ``fa64+sw128@16``."""
    builder: str
    """A synthetic ``KVCacheConfig`` builder of :mod:`conformance.harness.driver`."""
    builder_args: tuple[int, ...]
    knob: tuple[tuple[str, Any], ...]
    retention: int | None
    workload_name: str
    workload: T.WorkloadSpec
    description: str
    num_gpu_blocks: int = 1024
    num_cpu_chunks: int = 64
    other_extra: tuple[tuple[str, Any], ...] = ()
    """Other ``kv_connector_extra_config`` entries (e.g. ``offload_prompt_only``)."""

    @property
    def name(self) -> str:
        knob = " ".join(f"{k}={v}" for k, v in self.knob + self.other_extra)
        tier = f"/cpu={self.num_cpu_chunks}" if self.num_cpu_chunks != 64 else ""
        return f"{self.geometry}/{knob}/retention={self.retention}{tier}/{self.workload_name}"


def repeat_workload(n: int, budget: int, max_load_tokens: int = 100) -> T.WorkloadSpec:
    """Store a prompt, then serve repeats of it from the offload tier.

    ``a`` (``n`` tokens, 6 decoded) stores its prompt; ``b`` shares half of it
    (a GPU prefix hit, a junction) and adds its own tokens.  After a GPU-only
    reset, ``again`` repeats ``a`` (an offload hit), after another one ``longer``
    extends it by 40 tokens, and after a third ``capped`` repeats it with
    ``max_load_tokens`` (a hit cut to chunk ends).  ``budget`` tokens per step:
    small budgets end prefill steps mid-chunk.
    """
    return T.WorkloadSpec(
        requests=(
            T.RequestSpec("a", BASE[:n], max_tokens=6),
            T.RequestSpec("b", BASE[: n // 2] + tuple(range(31, 31 + n // 3)), 6, 2),
            T.RequestSpec("again", BASE[:n], 2, 31),
            T.RequestSpec("longer", BASE[: n + 40], 2, 36),
            T.RequestSpec("capped", BASE[: n + 20], 2, 41,
                          kv_transfer_params=(("max_load_tokens", max_load_tokens),)),
        ),
        max_num_batched_tokens=budget,
        resets=(T.ResetSpec(step=30), T.ResetSpec(step=35), T.ResetSpec(step=40)),
    )


def decode_workload() -> T.WorkloadSpec:
    """A 200-token prompt decoding 20 tokens (decode stores, an EAGLE group's volatile
    tail chunk), then repeats after GPU-only resets."""
    return T.WorkloadSpec(
        requests=(
            T.RequestSpec("a", BASE[:200], max_tokens=20),
            T.RequestSpec("again", BASE[:200], 2, 31),
            T.RequestSpec("longer", BASE[:240], 2, 36),
        ),
        max_num_batched_tokens=512,
        resets=(T.ResetSpec(step=30), T.ResetSpec(step=35)),
    )


def abort_while_loading_workload() -> T.WorkloadSpec:
    """``z`` hits ``a``'s chunks and waits 3 steps for its load; a connector reset at
    step 13 restarts every request's stores; ``z`` is aborted at 14 (an aborted
    request's computed tokens, no block allocated: nothing may be stored)."""
    return T.WorkloadSpec(
        requests=(T.RequestSpec("a", BASE[:300], 2, 0), T.RequestSpec("z", BASE[:300], 2, 12)),
        max_num_batched_tokens=512,
        resets=(T.ResetSpec(step=11), T.ResetSpec(step=13, reset_connector=True)),
        aborts=(T.AbortSpec(step=14, req_id="z"),),
        default_delay_steps=3,
    )


def deferral_workload() -> T.WorkloadSpec:
    """Lookups that must wait: jobs report 3 steps late.  ``b`` repeats ``a`` while
    ``a``'s store is still being written; after a reset ``c`` and ``d`` repeat it in
    one step, so ``d`` needs chunks ``c`` is loading."""
    return T.WorkloadSpec(
        requests=(
            T.RequestSpec("a", BASE[:256], 1, 0),
            T.RequestSpec("b", BASE[:256], 2, 2),
            T.RequestSpec("c", BASE[:300], 2, 13),
            T.RequestSpec("d", BASE[:280], 2, 13),
        ),
        max_num_batched_tokens=512,
        resets=(T.ResetSpec(step=2), T.ResetSpec(step=12)),
        default_delay_steps=3,
    )


def full_tier_workload() -> T.WorkloadSpec:
    """Three distinct 300-token prompts into a small tier (evictions, refusals), then a
    repeat of the first and of the last after a GPU-only reset."""
    prompts = [BASE[:300], tuple(range(31, 61)) * 10, tuple(range(61, 91)) * 10]
    return T.WorkloadSpec(
        requests=(
            *(T.RequestSpec(f"p{i}", p, 2, 2 * i) for i, p in enumerate(prompts)),
            T.RequestSpec("first", prompts[0], 2, 21),
            T.RequestSpec("last", prompts[2], 2, 22),
        ),
        max_num_batched_tokens=128,
        resets=(T.ResetSpec(step=20),),
    )


_FA_SW = "full_swa_kv_cache_config"


def _spec(geometry: str, builder: str, args: tuple[int, ...], knob: dict[str, Any],
          retention: int | None, workload_name: str, workload: T.WorkloadSpec,
          description: str, **kw: Any) -> CorpusSpec:
    return CorpusSpec(geometry, builder, args, tuple(knob.items()), retention, workload_name,
                      workload, description, **kw)


SPECS: tuple[CorpusSpec, ...] = (
    _spec("full@16", "full_attention_kv_cache_config", (16,), {"blocks_per_chunk": 4}, 0,
          "repeat-256-budget64", repeat_workload(256, 64),
          "One full-attention group: stores, prefix-run hits, max_load_tokens."),
    _spec("fa64+sw128@16", _FA_SW, (64, 16, 128), {"blocks_per_chunk": 2}, 0,
          "repeat-256-budget64", repeat_workload(256, 64),
          "Full attention + a 128-token window, sparse retention: store masks, window hits."),
    _spec("fa64+sw128@16", _FA_SW, (64, 16, 128), {"blocks_per_chunk": 2}, 0,
          "repeat-257-budget96", repeat_workload(257, 96),
          "As above with a prompt one token past a chunk end."),
    _spec("fa64+sw128@16", _FA_SW, (64, 16, 128), {"blocks_per_chunk": 2}, None,
          "repeat-256-budget64", repeat_workload(256, 64),
          "Dense retention: store horizons, chunks not offered twice."),
    _spec("fa64+sw128@16", _FA_SW, (64, 16, 128), {"blocks_per_chunk": 1}, 128,
          "repeat-300-budget512", repeat_workload(300, 512),
          "Periodic retention (every 128 tokens)."),
    _spec("fa64+sw16@16", _FA_SW, (64, 16, 16), {"blocks_per_chunk": 4}, 0,
          "repeat-256-budget32", repeat_workload(256, 32),
          "A window under one chunk: steps ending mid-chunk store chunks with null blocks."),
    _spec("fa64+sw40@16", _FA_SW, (64, 16, 40), {"blocks_per_chunk": 2}, None,
          "repeat-300-budget64", repeat_workload(300, 64),
          "A window that is not a whole number of blocks, dense retention."),
    _spec("fa64+sw16@16", _FA_SW, (64, 16, 16), {"blocks_per_chunk": 1}, None,
          "decode-200", decode_workload(),
          "Dense retention, decode tokens offloaded: a request finishing off its prompt "
          "horizon re-offers its last segment.",
          other_extra=(("offload_prompt_only", False),)),
    _spec("fa64+eagle-sw128@16", "swa_eagle_kv_cache_config", (64, 16, 128),
          {"blocks_per_chunk": 1}, 0, "decode-200", decode_workload(),
          "An EAGLE draft group, decode tokens offloaded too.",
          other_extra=(("offload_prompt_only", False),)),
    _spec("fa64+eagle-sw128@16", "swa_eagle_kv_cache_config", (64, 16, 128),
          {"blocks_per_chunk": 2}, None, "repeat-256-budget64", repeat_workload(256, 64),
          "An EAGLE draft group under dense retention."),
    _spec("fa64+sw32+mtp2@16", "swa_mtp_kv_cache_config", (64, 16, 32, 2),
          {"blocks_per_chunk": 2}, 0, "repeat-256-budget512", repeat_workload(256, 512),
          "Extra retained tokens (MTP): a 32-token window retaining 2 more spans 2 chunks."),
    _spec("fa64+mamba-align@64", "full_mamba_align_kv_cache_config", (64, 64),
          {"blocks_per_chunk": 2}, 0, "repeat-300-budget96", repeat_workload(300, 96),
          "Mamba (align mode): boundary hand-offs stored one state per job."),
    _spec("fa64+sw128@16", _FA_SW, (64, 16, 128), {"blocks_per_chunk": 2}, 0,
          "abort-while-loading", abort_while_loading_workload(),
          "An abort while a load is in flight, after a connector reset."),
    _spec("fa64+sw128@16", _FA_SW, (64, 16, 128), {"blocks_per_chunk": 2}, 0,
          "deferral", deferral_workload(),
          "Jobs reported 3 steps late: hits wait for stores being written and loads in flight."),
    _spec("full@16", "full_attention_kv_cache_config", (16,), {"blocks_per_chunk": 4}, 0,
          "full-tier", full_tier_workload(),
          "A 4-chunk tier: evictions and refused stores (capacity decisions replayed).",
          num_cpu_chunks=4),
    _spec("fa16+sw128@16", _FA_SW, (16, 16, 128), {"block_size": 64}, 0,
          "repeat-256-budget64", repeat_workload(256, 64),
          "The block_size knob (64-token chunks; vLLM's connector takes it when every group "
          "has one block size)."),
)
"""Every case of the corpus, in file order (the same for every release)."""
