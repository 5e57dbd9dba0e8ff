"""The corpus cases: geometry x knob x retention x one fixed workload each.

Each case is run on vLLM's real scheduler + connector (:mod:`conformance.corpus.generate`
builds the driver) and stored with its answers.  The workloads are fixed (no
drawing), chosen so that together the cases reach every rule of
``docs/semantics.md`` section 8 (:mod:`conformance.corpus.coverage` measures
which case reaches which).  Nothing here imports vLLM.
"""

from __future__ import annotations

import zlib
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
    kv_load_failure_policy: str = "fail"
    """``kv_transfer_config.kv_load_failure_policy``: what vLLM does with a request whose
    load failed (``fail``: finish it with an error; ``recompute``: compute it again)."""

    @property
    def name(self) -> str:
        knob = " ".join(f"{k}={v}" for k, v in self.knob + self.other_extra)
        tier = f"/cpu={self.num_cpu_chunks}" if self.num_cpu_chunks != 64 else ""
        gpu = f"/gpu={self.num_gpu_blocks}" if self.num_gpu_blocks != 1024 else ""
        failure = (f"/load_failure={self.kv_load_failure_policy}"
                   if self.kv_load_failure_policy != "fail" else "")
        return (f"{self.geometry}/{knob}/retention={self.retention}{tier}{gpu}{failure}/"
                f"{self.workload_name}")


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
    """Three distinct 300-token prompts into a small tier, then a repeat of the first and
    of the last after a GPU-only reset.  Jobs report 2 steps late, so while the tier is
    full of chunks still being written nothing can be evicted and vLLM's manager refuses
    the store (``prepare_store`` answers None; the request offers it again next step);
    once they are written they are evicted for newer ones, and ``last`` is served from
    what the tier kept."""
    prompts = [BASE[:300], tuple(range(31, 61)) * 10, tuple(range(61, 91)) * 10]
    return T.WorkloadSpec(
        requests=(
            *(T.RequestSpec(f"p{i}", p, 2, 2 * i) for i, p in enumerate(prompts)),
            T.RequestSpec("first", prompts[0], 2, 21),
            T.RequestSpec("last", prompts[2], 2, 22),
        ),
        max_num_batched_tokens=128,
        resets=(T.ResetSpec(step=20),),
        default_delay_steps=2,
    )


def window_gap_workload(base: tuple[int, ...] = BASE) -> T.WorkloadSpec:
    """Window chunks stored without the chunk before them; two repeats whose hit needs it
    (the plan lane runs it on ``fa64+sw32+mtp1`` and ``fa64+sw32+mtp2`` over its own ``base``).

    ``x`` shares ``base`` up to token 240 and stores (retention 0) the window chunks
    before its boundary 256: ``[192, 224)`` under ``BASE``'s key, ``[224, 256)`` under
    its own.  ``y`` stores every full chunk of ``BASE[:512]`` and the window before 512.
    After a GPU reset, ``r`` (hit end 256) finds ``[192, 224)`` alone, and ``r4``'s hit
    ends at 511, one token short of a chunk: with a 32-token window retaining 1 token
    more (32 tokens before an aligned end, 33 before 511) the window starts in chunk
    ``[448, 480)``, which no request stored, so ``r4`` may not hit at 511 (an unaligned
    end reaches one chunk further left; a window without its retained token would not).
    """
    junk = tuple(range(100, 160))
    return T.WorkloadSpec(
        requests=(
            T.RequestSpec("x", base[:240] + junk, 2, 0),
            T.RequestSpec("y", base[:560], 2, 3),
            T.RequestSpec("r", base[:257], 2, 8),
            T.RequestSpec("r4", base[:512], 2, 13),
        ),
        max_num_batched_tokens=512,
        resets=(T.ResetSpec(step=7), T.ResetSpec(step=12)),
    )


def evicted_before_reoffer_workload() -> T.WorkloadSpec:
    """A finished request re-offers its last segment, but not a chunk it offered under
    the prompt horizon, even one the tier has since evicted.

    Dense retention, decode tokens offloaded, 32-token window chunks (128-token
    segments), a 10-chunk tier.  ``a`` (210 tokens) stores its prompt: under the prompt
    horizon (chunk 6) the window tail before token 192, chunks 4 and 5.  ``b`` (389
    distinct tokens) evicts them.  ``a`` decodes to 225 tokens and finishes off its
    prompt horizon in the same segment: it re-offers from the segment's first chunk (4),
    the final horizon (chunk 7) makes chunk 5 reachable again, and it was offered before
    (under the prompt horizon), so it is not offered again: vLLM stores nothing then.
    """
    return T.WorkloadSpec(
        requests=(
            T.RequestSpec("a", BASE[:210], 15, 0),
            T.RequestSpec("b", (tuple(range(31, 61)) * 13)[:389], 1, 3),
        ),
        max_num_batched_tokens=512,
    )


def _sampled(req_id: str, position: int) -> int:
    """The token the driver's fake model samples for ``req_id`` at ``position``
    (``conformance.harness.driver.model.sampled_token``, which imports vLLM)."""
    return 3 + (zlib.crc32(req_id.encode()) + 7919 * position) % (32000 - 3)


def preempted_load_fails_workload() -> T.WorkloadSpec:
    """A preempted request resumes with a load that reaches its last token, and the load
    fails: vLLM finishes it (``kv_load_failure_policy`` ``fail``) having computed every
    one of its ``num_tokens`` (the one way found for a finished request to have done so).

    17 GPU blocks of 16 tokens, 16-token chunks, decode tokens offloaded.  ``t`` stores
    ``v``'s prompt and the 37 tokens ``v`` will sample after it (the fake model's tokens
    are a function of the request id and position), 136 tokens.  ``a`` and ``v`` decode
    80 tokens each; at 128 tokens ``v`` is preempted for ``a``.  While it waits, its
    lookups hit more and more from the tier as ``a``'s blocks evict its GPU prefix; once
    ``a`` finishes, ``v`` (128 tokens) loads chunks 4-7 (64 tokens, chunk 7 stored by
    ``t``: a full-attention hit may end at ``num_tokens``) and the load (job 7) fails:
    ``v`` finishes with ``num_computed_tokens == num_tokens == 128`` and stores nothing:
    the connector is handed a request's blocks when it is scheduled, its lookup dropped
    the old ones, and ``v`` was not scheduled again (so whether a finished request's last
    token is stored cannot show here)."""
    v = tuple(range(1000, 1099))
    twin = v + tuple(_sampled("v", i) for i in range(len(v), 136))
    return T.WorkloadSpec(
        requests=(
            T.RequestSpec("t", twin, 1, 0),
            T.RequestSpec("a", BASE[:99], 80, 3),
            T.RequestSpec("v", v, 80, 4),
        ),
        max_num_batched_tokens=512,
        faults=(T.JobFault(7, fail=True),),
    )


def failed_load_retry_workload() -> T.WorkloadSpec:
    """``A`` stores a 200-token prompt; after a GPU-only reset ``B`` sends it again and its
    load (job 1) fails.  Under ``kv_load_failure_policy`` ``recompute`` vLLM computes
    ``B`` again: 0.33.0 lets it look up and load again, 0.34.0 never loads that request
    from the tier again (``Policy.reload_after_failed_load``, change ``failed-load-retry``
    of ``conformance/protocol/versions.py``)."""
    return T.WorkloadSpec(
        requests=(
            T.RequestSpec("A", BASE[:200], 1, 0),
            T.RequestSpec("B", BASE[:200], 1, 6),
        ),
        resets=(T.ResetSpec(step=5),),
        faults=(T.JobFault(1, fail=True),),
    )


def skip_prefix_cache_workload() -> T.WorkloadSpec:
    """``a`` stores a 256-token prompt; after a GPU-only reset ``skip`` sends it again with
    ``skip_reading_prefix_cache`` (as prompt logprobs need): its lookup answers 0 though the
    tier holds every chunk, and it computes the prompt; after another reset ``again``
    (no skip) hits."""
    return T.WorkloadSpec(
        requests=(
            T.RequestSpec("a", BASE[:256], 2, 0),
            T.RequestSpec("skip", BASE[:256], 2, 11, skip_reading_prefix_cache=True),
            T.RequestSpec("again", BASE[:256], 2, 21),
        ),
        max_num_batched_tokens=512,
        resets=(T.ResetSpec(step=10), T.ResetSpec(step=20)),
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
          "A 6-chunk tier, jobs reported 2 steps late: stores refused while every held chunk "
          "is still being written, then evictions (capacity decisions replayed); a repeat "
          "is served from what the tier kept.",
          num_cpu_chunks=6),
    _spec("fa16+sw128@16", _FA_SW, (16, 16, 128), {"block_size": 64}, 0,
          "repeat-256-budget64", repeat_workload(256, 64),
          "The block_size knob (64-token chunks; vLLM's connector takes it when every group "
          "has one block size)."),
    # The classes below each exist for one rule (docs/semantics.md section 8) in a situation
    # the cases above never reach (issue #32; conformance/meta/corpus_power.py measures them).
    _spec("fa64+sw33@16", _FA_SW, (64, 16, 33), {"blocks_per_chunk": 2}, 0,
          "window-whole-vs-before-end", repeat_workload(256, 64),
          "Rule 'window': a 33-token window in 32-token chunks, where the whole window "
          "(cdiv(33, 32) = 2 chunks, vLLM's WindowRule.WHOLE_WINDOW) and the tokens before an "
          "aligned end (cdiv(32, 32) = 1, the intended TOKENS_BEFORE_END) differ: the store "
          "keeps 1 chunk before a boundary, so vLLM never hits there (deviation "
          "swa-window-one-past-a-chunk-never-hits)."),
    _spec("fa64+sw32+mtp1@16", "swa_mtp_kv_cache_config", (64, 16, 32, 1),
          {"blocks_per_chunk": 2}, 0, "window-gap", window_gap_workload(),
          "Rule 'window': windows with a chunk missing from the tier; a hit ending one token "
          "short of a chunk end needs the chunk before (32 + 1 retained tokens), which no "
          "request stored."),
    _spec("fa64+sw40@16", _FA_SW, (64, 16, 40), {"blocks_per_chunk": 2}, None,
          "offered-before-then-evicted", evicted_before_reoffer_workload(),
          "Rule 'offered before': a request finishing off its prompt horizon (dense) does not "
          "re-offer a chunk it offered under the prompt horizon, though a full 10-chunk tier "
          "evicted it since.",
          num_cpu_chunks=10, other_extra=(("offload_prompt_only", False),)),
    _spec("full@16", "full_attention_kv_cache_config", (16,), {"blocks_per_chunk": 1}, 0,
          "preempted-load-fails", preempted_load_fails_workload(),
          "Rule 'computed after a step': a preempted request resumes, its lookups grow as the "
          "GPU evicts its prefix, and its load up to its last token fails: it finishes "
          "(finished_error) with every one of its tokens computed, and stores nothing (the "
          "connector was not handed its blocks again).",
          num_gpu_blocks=17, other_extra=(("offload_prompt_only", False),)),
    _spec("fa64+sw128@16", _FA_SW, (64, 16, 128), {"blocks_per_chunk": 2}, 0,
          "failed-load-retry", failed_load_retry_workload(),
          "A failed load recomputed (kv_load_failure_policy recompute): whether the request "
          "loads from the tier again is the release's Policy.reload_after_failed_load.",
          kv_load_failure_policy="recompute"),
    _spec("fa64+sw128@16", _FA_SW, (64, 16, 128), {"blocks_per_chunk": 2}, 0,
          "skip-prefix-cache", skip_prefix_cache_workload(),
          "A request with skip_reading_prefix_cache: its lookup answers 0 though the tier "
          "holds its prompt; a later repeat without it hits."),
)
"""Every case of the corpus, in file order (the same for every release)."""
