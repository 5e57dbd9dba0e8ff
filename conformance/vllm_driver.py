"""Drive vLLM 0.33.0's real ``Scheduler`` + offloading connector on CPU, and record it.

:class:`VllmDriver` builds the real ``vllm.v1.core.sched.scheduler.Scheduler``
with the KV connector named in ``kv_transfer_config`` (``OffloadingConnector``
by default), runs a :class:`~conformance.trace.WorkloadSpec` step by step the
way the engine core does, and returns a :class:`~conformance.trace.Trace` of
every scheduler-side connector call.

What is real and what is emulated:

* Scheduler side, all real: the core ``Scheduler`` (prefix cache, chunked
  prefill, preemption), the connector's ``OffloadingConnectorScheduler`` and
  its manager, which for the default spec is vLLM's ``CPUOffloadingManager``
  built by ``CPUOffloadingSpec.get_manager()`` (constructing the spec and
  the manager needs no GPU; only ``CPUOffloadingSpec.get_worker`` does).
* Worker side: the connector's real worker half (``OffloadingConnectorWorker``,
  created through ``KVConnectorFactory`` with role ``WORKER``) runs the same
  call sequence as the GPU model runner (``handle_preemptions``,
  ``bind_connector_metadata``, ``start_load_kv``, ``wait_for_save``,
  ``get_transfer_results``, ``build_connector_worker_meta``,
  ``clear_connector_metadata``).  Only the transfer engine below it -- the
  ``OffloadingWorker`` that would copy bytes -- is replaced by
  :class:`TransferEngine`, which moves nothing and reports each job done when
  the workload says so.  ``register_kv_caches`` is not called (there are no
  KV tensors); the engine is installed directly.  With a ``model_runner``
  (:meth:`VllmDriver.session`; :class:`conformance.kvdata.SyntheticModelRunner`)
  the worker side is real instead: the runner's KV tensors go through
  ``register_kv_caches`` and the spec's own ``OffloadingWorker`` moves bytes
  (``vllm_adapter.spec.ReferenceOffloadingSpec`` does so on CPU).
* The model: deterministic sampled tokens, :func:`sampled_token`.

Recording wraps methods of the live objects (instance attributes), calls the
original unchanged and only reads arguments and results; it never alters
behaviour.  Wrapped: the connector scheduler's ``on_new_request``,
``get_num_new_matched_tokens``, ``update_state_after_alloc``,
``build_connector_meta``, ``update_connector_output``, ``request_finished``,
``reset_cache`` (and, to label job kinds, ``_build_aligned_boundary_store_jobs``
/ ``_build_partial_tail_store_jobs``); the manager's ``lookup``,
``prepare_load`` and ``prepare_store``.  A few private attributes of the
connector scheduler are read (``_current_batch_load_jobs``, ``config``).

How a job's completion reaches the connector in vLLM 0.33.0: the worker's
``get_finished`` turns each ``TransferResult`` into
``OffloadingWorkerMetadata.completed_jobs[job_id] = 1``; the model runner puts
that in ``KVConnectorOutput.kv_connector_worker_meta`` (loads also name their
request in ``finished_recving``); ``Scheduler.update_from_output`` passes the
output to ``connector.update_connector_output``, which completes a job when
``world_size`` workers reported it.  The worker asserts
``TransferResult.success``: failures cannot be reported per job.  A failed
*load* is emulated the way the core accepts it for hybrid layouts: the job is
reported done and its request is put in ``KVConnectorOutput.failed_recving``.
A failed store has no representation and is refused (``JobFault(never=True)``
loses the job instead; on the runner path :mod:`conformance.faults` does the
same with real bytes, see there).  One emulated worker stands for every rank:
with ``world_size > 1`` each job it finishes is reported ``world_size`` times
(:meth:`DriverSession._rank_reports`), as the executor's aggregation of the
ranks' worker meta would; a worker may report fewer ranks for a job.
"""

from __future__ import annotations

import copy
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from conformance.trace import (
    AbortSpec,
    Alloc,
    BlockRef,
    BoundaryHandoff,
    BuildMeta,
    JobDone,
    JobFault,
    JobsDone,
    LoadJobRecord,
    Lookup,
    ManagerLookup,
    NewRequest,
    Record,
    RequestFinished,
    RequestSpec,
    ResetPrefixCache,
    ResetSpec,
    ScheduledRequest,
    StoreJobRecord,
    StoreOffer,
    Trace,
    TraceConfig,
    TraceGroup,
    WorkloadSpec,
    freeze_params,
    thaw_params,
)
from reference.geometry import GroupKind
from reference.jobs import LoadJob, StoreJob
from vllm_adapter import vllm_api as V

MODELS_DIR = Path(__file__).resolve().parent.parent / "vllm_adapter" / "models"
TINY_LLAMA = MODELS_DIR / "tiny-llama"
"""A ``config.json``-only Llama dir: the model the synthetic KV configs pretend to serve."""

DEFAULT_NUM_CPU_CHUNKS = 4096
VOCAB_SIZE = 32000
FIRST_SAMPLED_TOKEN = 3  # stay clear of bos/eos


def sampled_token(req_id: str, position: int, vocab_size: int = VOCAB_SIZE) -> int:
    """The token the fake model samples for ``req_id`` at sequence ``position``."""
    span = vocab_size - FIRST_SAMPLED_TOKEN
    return FIRST_SAMPLED_TOKEN + (zlib.crc32(req_id.encode()) + 7919 * position) % span


# ---------------------------------------------------------------------------
# Synthetic KVCacheConfigs
# ---------------------------------------------------------------------------

_DTYPE = torch.float16
_ELEM = 2
# Every group's page (block) is this many bytes, as vLLM's hybrid allocator
# requires (one shared block pool); head sizes are derived from it.
_PAGE_BYTES = 4096


def _attn_kwargs(block_size: int) -> dict[str, Any]:
    # page = 2 (K and V) * block_size * heads * head_size * elem
    num_kv_heads = 1
    head_size = _PAGE_BYTES // (2 * block_size * num_kv_heads * _ELEM)
    if head_size < 1:
        raise ValueError(f"block_size {block_size} too large for a {_PAGE_BYTES}-byte page")
    return dict(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=_DTYPE)


def _group(name: str, spec: Any, *, is_eagle_group: bool = False, num_layers: int = 1) -> Any:
    layers = [f"model.layers.{name}.{i}.attn" for i in range(num_layers)]
    return V.KVCacheGroupSpec(layers, spec, is_eagle_group=is_eagle_group)


def _kv_cache_config(groups: list[Any], num_blocks: int) -> Any:
    return V.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def full_attention_kv_cache_config(block_size: int = 16, num_blocks: int = 1024) -> Any:
    """One full-attention group at ``block_size`` tokens per block."""
    return _kv_cache_config(
        [_group("full", V.FullAttentionSpec(**_attn_kwargs(block_size)))], num_blocks
    )


def full_swa_kv_cache_config(
    full_block_size: int = 64,
    swa_block_size: int = 16,
    sliding_window: int = 128,
    num_blocks: int = 1024,
    *,
    eagle_group: int | None = None,
) -> Any:
    """Group 0 full attention, group 1 sliding window (the notes' FA64 + SW128@16).

    ``eagle_group`` marks group 0 or 1 as an EAGLE/MTP draft group.
    """
    return _kv_cache_config(
        [
            _group(
                "full",
                V.FullAttentionSpec(**_attn_kwargs(full_block_size)),
                is_eagle_group=eagle_group == 0,
            ),
            _group(
                "swa",
                V.SlidingWindowSpec(**_attn_kwargs(swa_block_size), sliding_window=sliding_window),
                is_eagle_group=eagle_group == 1,
            ),
        ],
        num_blocks,
    )


def swa_eagle_kv_cache_config(
    full_block_size: int = 64,
    swa_block_size: int = 16,
    sliding_window: int = 128,
    num_blocks: int = 1024,
) -> Any:
    """FA + one SWA group that is an EAGLE draft group (``is_eagle_group``)."""
    return full_swa_kv_cache_config(
        full_block_size, swa_block_size, sliding_window, num_blocks, eagle_group=1
    )


def full_mamba_align_kv_cache_config(
    full_block_size: int = 64, mamba_block_size: int = 64, num_blocks: int = 1024
) -> Any:
    """Group 0 full attention, group 1 Mamba in ``align`` cache mode."""
    # One state tensor whose size fills the page exactly.
    state = (_PAGE_BYTES // _ELEM,)
    mamba = V.MambaSpec(
        block_size=mamba_block_size,
        shapes=(state,),
        dtypes=(_DTYPE,),
        mamba_cache_mode="align",
    )
    return _kv_cache_config(
        [_group("full", V.FullAttentionSpec(**_attn_kwargs(full_block_size))), _group("mamba", mamba)],
        num_blocks,
    )


# ---------------------------------------------------------------------------
# vLLM configs
# ---------------------------------------------------------------------------


def _prefix_cacheable_block_sizes(kv_cache_config: Any) -> list[int]:
    groups = kv_cache_config.kv_cache_groups
    sizes = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
    return sizes or [g.kv_cache_spec.block_size for g in groups]


def _has_mamba_align(kv_cache_config: Any) -> bool:
    return any(
        isinstance(g.kv_cache_spec, V.MambaSpec) and g.kv_cache_spec.mamba_cache_mode == "align"
        for g in kv_cache_config.kv_cache_groups
    )


def build_vllm_config(
    kv_cache_config: Any,
    *,
    model_dir: str | Path = TINY_LLAMA,
    extra_config: dict[str, Any] | None = None,
    prefix_cache_retention_interval: int | None = 0,
    num_gpu_blocks: int | None = None,
    num_cpu_chunks: int = DEFAULT_NUM_CPU_CHUNKS,
    max_num_batched_tokens: int = 8192,
    max_model_len: int = 8192,
    max_num_seqs: int = 16,
    connector: str = "OffloadingConnector",
    connector_module_path: str | None = None,
    kv_load_failure_policy: str = "fail",
    enable_prefix_caching: bool = True,
) -> tuple[Any, Any]:
    """A ``VllmConfig`` for ``kv_cache_config``, and the config resolved as the engine would.

    Mirrors ``EngineCore._initialize_kv_caches`` on what the scheduler reads:
    ``cache_config.block_size`` = smallest prefix-cacheable group block size,
    ``cache_config.num_gpu_blocks``, and on the ``KVCacheConfig``:
    ``num_blocks``, ``prefix_cache_retention_interval``, ``hash_block_size``,
    ``cache_hit_alignment_tokens``.  Synchronous scheduling (one batch in
    flight).  ``cpu_bytes_to_use`` is sized for ``num_cpu_chunks`` CPU chunks
    unless ``extra_config`` sets it.  Returns ``(vllm_config, kv_cache_config)``.
    """
    num_blocks = num_gpu_blocks if num_gpu_blocks is not None else kv_cache_config.num_blocks
    extra = dict(extra_config or {})
    model_config = V.ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="float16",
        seed=0,
    )
    cache_kwargs: dict[str, Any] = dict(
        block_size=min(_prefix_cacheable_block_sizes(kv_cache_config)),
        enable_prefix_caching=enable_prefix_caching,
        prefix_cache_retention_interval=prefix_cache_retention_interval,
    )
    if _has_mamba_align(kv_cache_config):
        cache_kwargs["mamba_cache_mode"] = "align"
    cache_config = V.CacheConfig(**cache_kwargs)
    scheduler_config = V.SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    transfer_kwargs: dict[str, Any] = dict(
        kv_connector=connector,
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        kv_load_failure_policy=kv_load_failure_policy,
    )
    if connector_module_path is not None:
        transfer_kwargs["kv_connector_module_path"] = connector_module_path
    vllm_config = V.VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=scheduler_config,
        kv_transfer_config=V.KVTransferConfig(**transfer_kwargs),
        device_config=V.DeviceConfig("cpu"),
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks

    resolved = copy.deepcopy(kv_cache_config)
    resolved.num_blocks = num_blocks
    resolved.prefix_cache_retention_interval = prefix_cache_retention_interval
    sched_block, hash_block = V.resolve_kv_cache_block_sizes(resolved, vllm_config)
    resolved.hash_block_size = hash_block
    resolved.cache_hit_alignment_tokens = V.resolve_cache_hit_alignment_tokens(
        resolved, vllm_config, sched_block, hash_block
    )

    live_extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    uses_cpu_spec = live_extra.get("spec_name", "CPUOffloadingSpec") == "CPUOffloadingSpec"
    if uses_cpu_spec and "cpu_bytes_to_use" not in live_extra:
        # Size the CPU tier in chunks: ask vLLM's own spec what one chunk takes.
        live_extra["cpu_bytes_to_use"] = 1
        probe = V.CPUOffloadingSpec(V.build_offloading_config(vllm_config, resolved))
        live_extra["cpu_bytes_to_use"] = max(1, probe.kv_bytes_per_chunk * num_cpu_chunks)
    uses_reference_spec = live_extra.get("spec_name") == "ReferenceOffloadingSpec"
    if uses_reference_spec and not ({"num_cpu_chunks", "cpu_bytes_to_use"} & set(live_extra)):
        # vllm_adapter.spec.ReferenceOffloadingSpec takes the chunk count directly.
        live_extra["num_cpu_chunks"] = num_cpu_chunks
    return vllm_config, resolved


# ---------------------------------------------------------------------------
# The emulated transfer engine
# ---------------------------------------------------------------------------


class TransferEngine(V.OffloadingWorker):
    """An ``OffloadingWorker`` that moves no bytes and finishes jobs on schedule.

    Jobs are due ``delay`` steps after submission (``JobFault.delay_steps``,
    else the session's default), never for ``JobFault.never``.  ``wait`` (a
    flush, or a sync load) finishes the named jobs at once -- the real
    ``wait`` blocks until they are done.
    """

    def __init__(self, session: DriverSession) -> None:
        self._session = session
        self.due: dict[int, int | None] = {}
        self.kinds: dict[int, str] = {}

    def _submit(self, job_id: int, kind: str) -> bool:
        fault = self._session.faults.get(job_id)
        if fault is not None and fault.fail and kind == "store" and not V.SUPPORTS_FAILED_TRANSFERS:
            raise ValueError(
                f"job {job_id} is a store: vLLM 0.33.0 cannot report a failed store "
                "(OffloadingConnectorWorker.get_finished asserts TransferResult.success); "
                "use JobFault(never=True) to lose it instead"
            )
        if fault is not None and fault.never:
            due = None
        else:
            delay = fault.delay_steps if fault is not None else self._session.default_delay_steps
            due = self._session.step_no + delay
        self.due[job_id] = due
        self.kinds[job_id] = kind
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._submit(job_id, "store")

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        return self._submit(job_id, "load")

    def get_finished(self) -> list[Any]:
        now = self._session.step_no
        done = [j for j, due in self.due.items() if due is not None and due <= now]
        for j in done:
            del self.due[j]
        return [V.TransferResult(job_id=j, success=self._succeeds(j)) for j in sorted(done)]

    def _succeeds(self, job_id: int) -> bool:
        """False for a ``JobFault(fail=True)`` job, where the worker can say so (0.34.0).

        On 0.33.0 a failed load is reported done and its request is listed in
        ``failed_recving`` by :meth:`DriverSession._worker_step` (the only way
        that release accepts one).
        """
        fault = self._session.faults.get(job_id)
        return not (V.SUPPORTS_FAILED_TRANSFERS and fault is not None and fault.fail)

    def wait(self, job_ids: set[int]) -> None:
        for j in job_ids:
            if j in self.due:
                self.due[j] = self._session.step_no

    @property
    def in_flight(self) -> set[int]:
        return set(self.due)


# ---------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------


def _status(req: Any) -> str:
    return str(req.status.name).lower()


def _hashes(req: Any) -> tuple[bytes, ...]:
    return tuple(bytes(h) for h in req.block_hashes)


def _wrap(obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(obj, name)
    setattr(obj, name, make(original))


class _Recorder:
    """Wraps the connector scheduler and its manager; turns calls into records."""

    def __init__(self, session: DriverSession, cs: Any) -> None:
        self.s = session
        self.cs = cs
        self.records: list[Record] = []
        self.requests: dict[str, Any] = {}
        self._lookups: list[ManagerLookup] | None = None
        self._loads: list[tuple[tuple[bytes, ...], Any]] = []
        self._offers: list[tuple[StoreOffer, Any]] = []
        self._boundary_jobs: set[int] = set()
        self._partial_jobs: set[int] = set()
        self._connector_reset = False
        self.load_req: dict[int, str] = {}
        self.last_computed: dict[str, int] = {}
        self._install()

    # -- installation --------------------------------------------------------

    def _install(self) -> None:
        cs, mgr = self.cs, self.cs.manager
        _wrap(cs, "on_new_request", self._on_new_request)
        _wrap(cs, "get_num_new_matched_tokens", self._get_num_new_matched_tokens)
        _wrap(cs, "update_state_after_alloc", self._update_state_after_alloc)
        _wrap(cs, "build_connector_meta", self._build_connector_meta)
        _wrap(cs, "update_connector_output", self._update_connector_output)
        _wrap(cs, "request_finished", self._request_finished)
        _wrap(cs, "reset_cache", self._reset_cache)
        if hasattr(cs, "_build_aligned_boundary_store_jobs"):
            _wrap(cs, "_build_aligned_boundary_store_jobs", self._collect(self._boundary_jobs))
        if hasattr(cs, "_build_partial_tail_store_jobs"):
            _wrap(cs, "_build_partial_tail_store_jobs", self._collect(self._partial_jobs))
        _wrap(mgr, "lookup", self._lookup)
        _wrap(mgr, "prepare_load", self._prepare_load)
        _wrap(mgr, "prepare_store", self._prepare_store)

    def _collect(self, into: set[int]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                jobs = orig(*args, **kwargs)
                into.update(jobs)
                return jobs

            return wrapper

        return make

    # -- manager -------------------------------------------------------------

    def _lookup(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def lookup(key: bytes, req_context: Any) -> Any:
            result = orig(key, req_context)
            if self._lookups is not None:
                self._lookups.append(ManagerLookup(bytes(key), str(result.name).lower()))
            return result

        return lookup

    def _prepare_load(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def prepare_load(keys: Any, req_context: Any) -> Any:
            keys = list(keys)
            spec = orig(keys, req_context)
            self._loads.append((tuple(bytes(k) for k in keys), spec))
            return spec

        return prepare_load

    def _prepare_store(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def prepare_store(keys: Any, req_context: Any) -> Any:
            keys = list(keys)
            out = orig(keys, req_context)
            offer = StoreOffer(
                req_id=req_context.req_id,
                offered=tuple(bytes(k) for k in keys),
                accepted=None if out is None else tuple(bytes(k) for k in out.keys_to_store),
                evicted=() if out is None else tuple(bytes(k) for k in out.evicted_keys),
            )
            self._offers.append((offer, None if out is None else out.store_spec))
            return out

        return prepare_store

    # -- connector scheduler -------------------------------------------------

    def _on_new_request(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def on_new_request(request: Any) -> Any:
            self.requests[request.request_id] = request
            self.records.append(
                NewRequest(
                    step=self.s.step_no,
                    req_id=request.request_id,
                    num_prompt_tokens=request.num_prompt_tokens,
                    kv_transfer_params=freeze_params(request.kv_transfer_params),
                    prompt_token_ids=tuple(request.prompt_token_ids or ()),
                )
            )
            return orig(request)

        return on_new_request

    def _get_num_new_matched_tokens(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def get_num_new_matched_tokens(
            request: Any, num_computed_tokens: int, max_num_new_tokens: int | None = None
        ) -> Any:
            before = dict(
                num_tokens=request.num_tokens,
                num_prompt_tokens=request.num_prompt_tokens,
                block_hashes=_hashes(request),
                skip=V.skips_external_kv(request),
            )
            self._lookups = []
            try:
                hit, load_async = orig(request, num_computed_tokens, max_num_new_tokens)
            finally:
                lookups, self._lookups = self._lookups, None
            self.last_computed[request.request_id] = num_computed_tokens
            self.records.append(
                Lookup(
                    step=self.s.step_no,
                    req_id=request.request_id,
                    num_tokens=before["num_tokens"],
                    num_prompt_tokens=before["num_prompt_tokens"],
                    block_hashes=before["block_hashes"],
                    computed_tokens=num_computed_tokens,
                    max_num_new_tokens=max_num_new_tokens,
                    skip_reading_prefix_cache=before["skip"],
                    hit_tokens=hit,
                    load_async=bool(load_async),
                    manager_lookups=tuple(lookups or ()),
                )
            )
            return hit, load_async

        return get_num_new_matched_tokens

    def _update_state_after_alloc(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            refs = tuple(
                tuple(
                    BlockRef(int(b.block_id), bool(b.is_null), b.block_hash is not None)
                    for b in group
                )
                for group in blocks.blocks
            )
            pending = getattr(self.cs, "_current_batch_load_jobs", {})
            before = set(pending)
            self._loads = []
            result = orig(request, blocks, num_external_tokens)
            new_ids = [j for j in getattr(self.cs, "_current_batch_load_jobs", {}) if j not in before]
            load = None
            if new_ids:
                (job_id,) = new_ids
                tj = self.cs._current_batch_load_jobs[job_id]
                keys: tuple[bytes, ...] = ()
                for k, spec in self._loads:
                    if spec is tj.src_spec:
                        keys = k
                dst = tj.dst_spec
                load = LoadJobRecord(
                    job_id=job_id,
                    job=LoadJob(
                        req_id=tj.req_id,
                        computed_tokens=self.last_computed.get(request.request_id, 0),
                        hit_tokens=num_external_tokens,
                        keys=keys,
                        block_ids=tuple(int(b) for b in dst.block_ids),
                        group_sizes=tuple(int(x) for x in dst.group_sizes),
                        block_indices=tuple(int(x) for x in dst.block_indices),
                    ),
                    cpu_chunk_ids=tuple(int(b) for b in getattr(tj.src_spec, "block_ids", ())),
                    sync=bool(tj.sync),
                )
                self.load_req[job_id] = tj.req_id
            self._loads = []
            self.records.append(
                Alloc(
                    step=self.s.step_no,
                    req_id=request.request_id,
                    blocks=refs,
                    num_external_tokens=num_external_tokens,
                    load=load,
                )
            )
            return result

        return update_state_after_alloc

    def _snapshot(self, so: Any) -> tuple[ScheduledRequest, ...]:
        new_blocks: dict[str, tuple[Any, bool]] = {}
        for req_id, groups, is_full in V.yield_req_data(so):
            frozen = None if groups is None else tuple(tuple(int(b) for b in g) for g in groups)
            new_blocks[req_id] = (frozen, bool(is_full))
        out = []
        # _build_store_jobs visits chain(num_scheduled_tokens, finished_req_ids);
        # keep that order (finished_req_ids is a set: its order is this process's).
        order = list(so.num_scheduled_tokens)
        order += [r for r in (so.finished_req_ids or ()) if r not in so.num_scheduled_tokens]
        for req_id in order:
            req = self.requests.get(req_id)
            if req is None:
                continue
            blocks, is_full = new_blocks.get(req_id, (None, False))
            out.append(
                ScheduledRequest(
                    req_id=req_id,
                    new_block_ids=blocks,
                    is_full_table=is_full,
                    num_computed_tokens=req.num_computed_tokens,
                    num_scheduled_tokens=int(so.num_scheduled_tokens.get(req_id, 0)),
                    num_tokens=req.num_tokens,
                    num_prompt_tokens=req.num_prompt_tokens,
                    block_hashes=_hashes(req),
                    status=_status(req),
                    is_finished=bool(req.is_finished()),
                    shared_prefix_boundary=req.shared_prefix_boundary,
                    scheduled=req_id in so.num_scheduled_tokens,
                )
            )
        return tuple(out)

    def _build_connector_meta(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def build_connector_meta(so: Any) -> Any:
            scheduled = self._snapshot(so)
            block_state = so.kv_connector_block_state
            handoffs = tuple(
                BoundaryHandoff(req_id, int(g), int(b), int(t))
                for req_id, entries in (block_state.boundary_state_offloads or {}).items()
                for g, b, t in entries
            ) if block_state is not None else ()
            copies = tuple(int(c.dst_block_id) for c in (so.kv_cache_block_copies or ()))
            self._offers = []
            self._boundary_jobs.clear()
            self._partial_jobs.clear()
            meta = orig(so)
            store_jobs = []
            for job_id, tj in meta.store_jobs.items():
                keys: tuple[bytes, ...] = ()
                for offer, spec in self._offers:
                    if spec is not None and spec is tj.dst_spec:
                        keys = offer.accepted or ()
                src = tj.src_spec
                kind = (
                    "boundary"
                    if job_id in self._boundary_jobs
                    else "partial_tail"
                    if job_id in self._partial_jobs
                    else "chunks"
                )
                store_jobs.append(
                    StoreJobRecord(
                        job_id=job_id,
                        job=StoreJob(
                            req_id=tj.req_id,
                            keys=keys,
                            block_ids=tuple(int(b) for b in src.block_ids),
                            group_sizes=tuple(int(x) for x in src.group_sizes),
                            block_indices=tuple(int(x) for x in src.block_indices),
                        ),
                        kind=kind,
                        cpu_chunk_ids=tuple(int(b) for b in getattr(tj.dst_spec, "block_ids", ())),
                    )
                )
            self.records.append(
                BuildMeta(
                    step=self.s.step_no,
                    scheduled=scheduled,
                    finished_req_ids=tuple(so.finished_req_ids or ()),
                    preempted_req_ids=tuple(so.preempted_req_ids or ()),
                    new_req_ids=tuple(r.req_id for r in so.scheduled_new_reqs),
                    block_copy_dst_ids=copies,
                    boundary_handoffs=handoffs,
                    store_offers=tuple(o for o, _ in self._offers),
                    store_jobs=tuple(store_jobs),
                    load_job_ids=tuple(meta.load_jobs),
                    jobs_to_flush=tuple(sorted(meta.jobs_to_flush or ())),
                )
            )
            self._offers = []
            return meta

        return build_connector_meta

    def _update_connector_output(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def update_connector_output(connector_output: Any) -> Any:
            wm = connector_output.kv_connector_worker_meta
            completed = dict(getattr(wm, "completed_jobs", {}) or {})
            failed = set(connector_output.failed_recving or ())
            failed_jobs = V.failed_job_ids(wm)
            recving = set(connector_output.finished_recving or ())
            if completed or failed or recving:
                done = tuple(
                    JobDone(
                        job_id=j,
                        success=j not in failed_jobs
                        and not (j in self.load_req and self.load_req[j] in failed),
                        count=int(n),
                    )
                    for j, n in sorted(completed.items())
                )
                self.records.append(
                    JobsDone(
                        step=self.s.step_no,
                        done=done,
                        finished_recving=tuple(sorted(recving)),
                        failed_recving=tuple(sorted(failed)),
                    )
                )
            return orig(connector_output)

        return update_connector_output

    def _request_finished(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def request_finished(request: Any, *args: Any, **kwargs: Any) -> Any:
            self.records.append(
                RequestFinished(
                    step=self.s.step_no,
                    req_id=request.request_id,
                    status=_status(request),
                    num_computed_tokens=request.num_computed_tokens,
                    num_tokens=request.num_tokens,
                    block_hashes=_hashes(request),
                )
            )
            return orig(request, *args, **kwargs)

        return request_finished

    def _reset_cache(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def reset_cache(*args: Any, **kwargs: Any) -> Any:
            self._connector_reset = True
            return orig(*args, **kwargs)

        return reset_cache

    def take_connector_reset(self) -> bool:
        flag, self._connector_reset = self._connector_reset, False
        return flag


# ---------------------------------------------------------------------------
# Sessions and the driver
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class DispatchedJob:
    """A job as the worker received it in ``kv_connector_metadata`` (GPU side + CPU chunk ids)."""

    step: int
    kind: str
    job_id: int
    req_id: str
    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    cpu_chunk_ids: tuple[int, ...]


class DriverSession:
    """One fresh scheduler + connector pair, stepped by hand or by :meth:`VllmDriver.run`.

    ``step_no`` counts steps from 0; :meth:`step` runs one engine step
    (``schedule`` -> worker side -> fake model -> ``update_from_output``) when
    the scheduler has anything to do, and advances the counter either way.
    """

    def __init__(
        self,
        driver: VllmDriver,
        vllm_config: Any,
        *,
        faults: Iterable[JobFault] = (),
        default_delay_steps: int = 0,
        record: bool = True,
        model_runner: Any | None = None,
        worker_wrapper: Callable[[DriverSession, Any], Any] | None = None,
    ) -> None:
        self.driver = driver
        self.vllm_config = vllm_config
        self.model_runner = model_runner
        if worker_wrapper is not None and model_runner is None:
            raise ValueError("worker_wrapper wraps the spec's real OffloadingWorker: give a model_runner")
        if model_runner is not None and faults:
            raise ValueError(
                "faults are emulated by the TransferEngine; a session with a model_runner "
                "runs the spec's real OffloadingWorker and cannot inject them"
            )
        self.kv_cache_config = driver.kv_cache_config
        self.step_no = 0
        self.faults: dict[int, JobFault] = {f.job_index: f for f in faults}
        self.default_delay_steps = default_delay_steps
        sched_block, hash_block = V.resolve_kv_cache_block_sizes(self.kv_cache_config, vllm_config)
        self.scheduler_block_size = sched_block
        self.hash_block_size = hash_block
        self.scheduler = V.Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=V.StructuredOutputManager(vllm_config),
            block_size=sched_block,
            hash_block_size=hash_block,
            log_stats=False,
        )
        connector = self.scheduler.connector
        cs = getattr(connector, "connector_scheduler", None)
        if cs is None or not hasattr(cs, "manager"):
            raise TypeError(
                f"{type(connector).__name__} is not an offloading connector: the driver needs "
                "connector.connector_scheduler.manager (OffloadingConnector or a subclass)"
            )
        self.connector = connector
        self.connector_scheduler = cs
        self.recorder: _Recorder | None = _Recorder(self, cs) if record else None
        self.dispatched: list[DispatchedJob] = []
        hash_fn = V.get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        V.init_none_hash(hash_fn)
        self._block_hasher = V.get_request_block_hasher(
            hash_block, hash_fn, vllm_config.num_hash_lookahead_tokens
        )
        # Worker side: the connector's real worker half over an emulated transfer engine,
        # or (with a model_runner) over the spec's own OffloadingWorker, built by
        # register_kv_caches from the runner's KV tensors as the GPU model runner does.
        worker_kv_cache_config = (
            self.kv_cache_config if model_runner is None else driver.worker_kv_cache_config
        )
        self.worker_connector = V.KVConnectorFactory.create_connector(
            config=vllm_config, role=V.KVConnectorRole.WORKER, kv_cache_config=worker_kv_cache_config
        )
        self.engine: TransferEngine | None
        if model_runner is None:
            self.engine = TransferEngine(self)
            V.install_transfer_engine(
                self.worker_connector.connector_worker,
                self.engine,
                len(self.kv_cache_config.kv_cache_groups),
            )
        else:
            self.engine = None
            self.worker_connector.register_kv_caches(model_runner.kv_caches)
            if worker_wrapper is not None:
                cw = self.worker_connector.connector_worker
                cw.worker = worker_wrapper(self, cw.worker)
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.load_req: dict[int, str] = {}

    # -- workload events -----------------------------------------------------

    def add_request(self, spec: RequestSpec) -> None:
        kv_params = thaw_params(spec.kv_transfer_params)
        params = V.SamplingParams(
            max_tokens=spec.max_tokens,
            ignore_eos=True,
            extra_args=None if kv_params is None else {"kv_transfer_params": kv_params},
        )
        request = V.Request(
            request_id=spec.req_id,
            prompt_token_ids=list(spec.prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._block_hasher,
        )
        self.scheduler.add_request(request)

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, V.RequestStatus.FINISHED_ABORTED)

    def reset_prefix_cache(
        self, *, reset_connector: bool = False, reset_running_requests: bool = False
    ) -> bool:
        """``Scheduler.reset_prefix_cache``: GPU prefix cache; with ``reset_connector`` the offload tier too."""
        ok = bool(
            self.scheduler.reset_prefix_cache(
                reset_running_requests=reset_running_requests, reset_connector=reset_connector
            )
        )
        if self.recorder is None:
            return ok
        self.recorder.records.append(
            ResetPrefixCache(
                step=self.step_no,
                reset_running_requests=reset_running_requests,
                reset_connector=reset_connector,
                success=ok,
                connector_reset=self.recorder.take_connector_reset(),
            )
        )
        return ok

    # -- stepping ------------------------------------------------------------

    def has_work(self) -> bool:
        """True while a step could change anything.

        Unfinished requests, finished ones not yet shown to the connector, and
        jobs that will still be reported (submitted or queued for submission;
        ``JobFault.never`` jobs do not count).
        """
        if self.scheduler.has_unfinished_requests() or self.scheduler.finished_req_ids:
            return True
        unsubmitted = getattr(self.worker_connector.connector_worker, "_unsubmitted_store_jobs", ())
        if self.engine is not None:
            due = any(d is not None for d in self.engine.due.values())
        else:
            due = bool(getattr(self.worker_connector.connector_worker.worker, "in_flight", ()))
        return bool(due or unsubmitted)

    def step(self) -> None:
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            kv_output = self._worker_step(so)
            self.scheduler.update_from_output(so, self._model_output(so, kv_output))
        self.step_no += 1

    def _worker_step(self, so: Any) -> Any:
        wc = self.worker_connector
        meta = so.kv_connector_metadata
        load_req = {j: tj.req_id for j, tj in meta.load_jobs.items()}
        self._note_dispatched(meta)
        wc.handle_preemptions(meta)
        wc.bind_connector_metadata(meta)
        runner = self.model_runner
        if runner is not None and hasattr(runner, "before_start_load_kv"):
            runner.before_start_load_kv(self, so)
        wc.start_load_kv(None)
        if runner is not None and hasattr(runner, "execute_model"):
            runner.execute_model(self, so)  # the forward pass: after loads, before stores
        wc.wait_for_save()
        results = wc.get_transfer_results(so.finished_req_ids)
        worker_meta = wc.build_connector_worker_meta()
        wc.clear_connector_metadata()
        transfer_worker = wc.connector_worker.worker
        if worker_meta is not None and worker_meta.completed_jobs:
            worker_meta.completed_jobs = self._rank_reports(
                transfer_worker, worker_meta.completed_jobs
            )
        failed = set(getattr(results, "failed_recving", ()) or ())
        completed = getattr(worker_meta, "completed_jobs", {}) or {}
        failed_jobs = set(getattr(transfer_worker, "take_failed_loads", lambda: ())())
        for job_id in completed:
            fault = self.faults.get(job_id)
            emulated = fault is not None and fault.fail and not V.SUPPORTS_FAILED_TRANSFERS
            if emulated or job_id in failed_jobs:
                req_id = load_req.get(job_id) or self.load_req.get(job_id)
                if req_id is not None:
                    failed.add(req_id)
        return V.KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            kv_connector_worker_meta=worker_meta,
            failed_recving=failed,
        )

    def _rank_reports(self, worker: Any, completed: dict[int, int]) -> dict[int, int]:
        """Per-job report counts as the executor's aggregation of every rank's worker meta sums them.

        One emulated worker stands for all ``world_size`` ranks, and vLLM's
        scheduler completes a job only after ``world_size`` reports
        (``TransferJobStatus.pending_count``).  By default every rank reports
        every job the worker finished; a worker with ``reporting_ranks(job_id,
        world_size)`` says how many do (fewer: the others lost the job; a job
        no rank reports is dropped, as vLLM asserts positive counts).
        """
        world_size = int(self.vllm_config.parallel_config.world_size)
        ranks = getattr(worker, "reporting_ranks", None)
        out: dict[int, int] = {}
        for job_id, n in completed.items():
            k = world_size if ranks is None else int(ranks(job_id, world_size))
            if k > 0:
                out[job_id] = n * k
        return out

    def _note_dispatched(self, meta: Any) -> None:
        """Keep the jobs of this step's metadata, read straight from it (no wrapper)."""
        for kind, jobs in (("load", meta.load_jobs), ("store", meta.store_jobs)):
            for job_id, tj in jobs.items():
                gpu = tj.dst_spec if kind == "load" else tj.src_spec
                other = tj.src_spec if kind == "load" else tj.dst_spec
                if kind == "load":
                    self.load_req[job_id] = tj.req_id
                self.dispatched.append(
                    DispatchedJob(
                        step=self.step_no,
                        kind=kind,
                        job_id=int(job_id),
                        req_id=tj.req_id,
                        block_ids=tuple(int(b) for b in gpu.block_ids),
                        group_sizes=tuple(int(x) for x in gpu.group_sizes),
                        block_indices=tuple(int(x) for x in gpu.block_indices),
                        cpu_chunk_ids=tuple(int(b) for b in getattr(other, "block_ids", ())),
                    )
                )

    def _model_output(self, so: Any, kv_output: Any) -> Any:
        req_ids = list(so.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            req = self.scheduler.requests[req_id]
            if req.is_prefill_chunk:
                sampled.append([])
            else:
                sampled.append([sampled_token(req_id, req.num_tokens, self.vocab_size)])
        return V.model_runner_output(req_ids, sampled, kv_output)

    def run_until_idle(self, max_steps: int = 1000) -> int:
        """Step until nothing is left to do; returns the steps taken."""
        start = self.step_no
        while self.has_work():
            if self.step_no - start >= max_steps:
                raise RuntimeError(f"still busy after {max_steps} steps")
            self.step()
        return self.step_no - start

    def run(self, spec: WorkloadSpec) -> Trace | None:
        """Play ``spec``'s events at their steps (arrivals, then aborts, then resets,
        before that step's ``schedule``) until idle; the trace of this session
        (``None`` with ``record=False``).  Faults and the batch budget are the
        session's (see :meth:`VllmDriver.session`)."""
        arrivals: dict[int, list[RequestSpec]] = {}
        for r in spec.requests:
            arrivals.setdefault(r.arrival_step, []).append(r)
        aborts: dict[int, list[AbortSpec]] = {}
        for a in spec.aborts:
            aborts.setdefault(a.step, []).append(a)
        resets: dict[int, list[ResetSpec]] = {}
        for x in spec.resets:
            resets.setdefault(x.step, []).append(x)
        notes: list[str] = []
        while True:
            n = self.step_no
            if n >= spec.max_steps:
                notes.append(f"stopped at max_steps={spec.max_steps} with work left")
                break
            for r in arrivals.get(n, ()):
                self.add_request(r)
            for a in aborts.get(n, ()):
                self.abort(a.req_id)
            for x in resets.get(n, ()):
                self.reset_prefix_cache(
                    reset_connector=x.reset_connector,
                    reset_running_requests=x.reset_running_requests,
                )
            if n >= spec.last_event_step and not self.has_work():
                break
            self.step()
        return None if self.recorder is None else self.trace(spec, notes)

    # -- results -------------------------------------------------------------

    def trace(self, workload: WorkloadSpec | None = None, notes: Sequence[str] = ()) -> Trace:
        if self.recorder is None:
            raise RuntimeError("this session was started with record=False")
        return Trace(
            config=self.driver.trace_config(self),
            records=tuple(self.recorder.records),
            workload=workload,
            num_steps=self.step_no,
            notes=tuple(notes),
        )

    def request(self, req_id: str) -> Any:
        """The live ``vllm.v1.request.Request`` (also after it finished)."""
        if req_id in self.scheduler.requests:
            return self.scheduler.requests[req_id]
        if self.recorder is None:
            raise KeyError(req_id)
        return self.recorder.requests[req_id]

    def block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's current GPU block table, per KV-cache group."""
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)


class VllmDriver:
    """Runs workloads through vLLM 0.33.0's real scheduler-side offloading path.

    ``kv_cache_config`` and ``vllm_config`` are real vLLM objects, resolved as
    the engine core would (see :func:`build_vllm_config`, or use
    :meth:`from_kv_cache_config`).  Every :meth:`run` / :meth:`session` starts
    from a fresh scheduler, connector and CPU tier.
    """

    def __init__(
        self, kv_cache_config: Any, vllm_config: Any, *, worker_kv_cache_config: Any | None = None
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.vllm_config = vllm_config
        self.worker_kv_cache_config = (
            kv_cache_config if worker_kv_cache_config is None else worker_kv_cache_config
        )
        """What the workers get (``UniformTypeKVCacheSpecs`` unflattened); used with a model_runner."""

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any, **kwargs: Any) -> VllmDriver:
        """Build the vLLM configs with :func:`build_vllm_config` (same keyword arguments)."""
        vllm_config, resolved = build_vllm_config(kv_cache_config, **kwargs)
        return cls(resolved, vllm_config)

    def session(
        self,
        *,
        max_num_batched_tokens: int | None = None,
        faults: Iterable[JobFault] = (),
        default_delay_steps: int = 0,
        record: bool = True,
        model_runner: Any | None = None,
        worker_wrapper: Callable[[DriverSession, Any], Any] | None = None,
    ) -> DriverSession:
        """A fresh scheduler + connector; ``record=False`` installs no wrappers.

        ``model_runner`` (e.g. :class:`conformance.kvdata.SyntheticModelRunner`)
        switches the worker side to real bytes: its ``kv_caches`` go to the
        worker connector's ``register_kv_caches`` (so the spec in the extra
        config builds its real ``OffloadingWorker``, e.g.
        ``vllm_adapter.spec.ReferenceOffloadingSpec``), and each step calls its
        optional ``before_start_load_kv(session, scheduler_output)`` and
        ``execute_model(session, scheduler_output)`` (after ``start_load_kv``,
        before ``wait_for_save``).  ``JobFault`` s need the emulated engine and
        are refused then; ``worker_wrapper(session, worker)`` instead replaces
        the spec's worker with what it returns (e.g.
        :class:`conformance.faults.FaultyWorker`, which injects faults around
        the real copies).  A worker may define ``reporting_ranks(job_id,
        world_size)`` (how many ranks report a finished job) and
        ``take_failed_loads()`` (load job ids to report in ``failed_recving``).

        With ``world_size > 1`` each finished job is reported once per rank, as
        the executor's aggregation of the ranks' ``kv_connector_worker_meta``
        would (vLLM completes a job after ``world_size`` reports).
        """
        vllm_config = self.vllm_config
        if (
            max_num_batched_tokens is not None
            and max_num_batched_tokens != vllm_config.scheduler_config.max_num_batched_tokens
        ):
            # What SchedulerConfig.__post_init__ derives from the budget, set alike.
            sc = copy.copy(vllm_config.scheduler_config)
            sc.max_num_batched_tokens = max_num_batched_tokens
            sc.max_num_encoder_input_tokens = max_num_batched_tokens
            sc.encoder_cache_size = max_num_batched_tokens
            vllm_config = copy.copy(vllm_config)
            vllm_config.scheduler_config = sc
        return DriverSession(
            self,
            vllm_config,
            faults=faults,
            default_delay_steps=default_delay_steps,
            record=record,
            model_runner=model_runner,
            worker_wrapper=worker_wrapper,
        )

    def run(self, spec: WorkloadSpec) -> Trace:
        """Run ``spec`` on a fresh scheduler to completion (or ``spec.max_steps``); its trace."""
        s = self.session(
            max_num_batched_tokens=spec.max_num_batched_tokens,
            faults=spec.faults,
            default_delay_steps=spec.default_delay_steps,
        )
        trace = s.run(spec)
        assert trace is not None
        return trace

    # -- config description --------------------------------------------------

    def trace_config(self, session: DriverSession | None = None) -> TraceConfig:
        kvc, vc = self.kv_cache_config, self.vllm_config
        offloaded = set(V.get_offloading_group_ids(kvc))
        groups = tuple(
            _trace_group(i, g, i in offloaded) for i, g in enumerate(kvc.kv_cache_groups)
        )
        sched_block, hash_block = V.resolve_kv_cache_block_sizes(kvc, vc)
        extra = dict(vc.kv_transfer_config.kv_connector_extra_config or {})
        bpc = 0
        num_cpu_chunks = 0
        max_batched = vc.scheduler_config.max_num_batched_tokens
        if session is not None:
            cs = session.connector_scheduler
            bpc = int(getattr(getattr(cs, "config", None), "blocks_per_chunk", 0))
            num_cpu_chunks = int(getattr(cs.manager, "_num_chunks", 0))
            max_batched = session.vllm_config.scheduler_config.max_num_batched_tokens
        return TraceConfig(
            connector=str(vc.kv_transfer_config.kv_connector),
            groups=groups,
            tokens_per_hash=hash_block,
            scheduler_block_size=sched_block,
            blocks_per_chunk=bpc,
            extra_config=tuple(sorted(extra.items())),
            prefix_cache_retention_interval=vc.cache_config.prefix_cache_retention_interval,
            num_gpu_blocks=kvc.num_blocks,
            num_cpu_chunks=num_cpu_chunks,
            max_num_batched_tokens=max_batched,
            max_model_len=vc.model_config.max_model_len,
            enable_prefix_caching=bool(vc.cache_config.enable_prefix_caching),
            kv_load_failure_policy=str(vc.kv_transfer_config.kv_load_failure_policy),
            vllm_version=V.VLLM_VERSION,
        )


def _trace_group(index: int, group: Any, offloaded: bool) -> TraceGroup:
    spec = group.kv_cache_spec
    kind: GroupKind | None
    window = None
    extra = 0
    chunk = None
    if isinstance(spec, V.SlidingWindowSpec):
        kind = GroupKind.SLIDING_WINDOW
        window = spec.sliding_window
        extra = spec.extra_retained_tokens
    elif isinstance(spec, V.ChunkedLocalAttentionSpec):
        kind = GroupKind.CHUNKED_LOCAL
        chunk = spec.attention_chunk_size
    elif isinstance(spec, V.MambaSpec):
        kind = GroupKind.MAMBA_ALIGN if spec.mamba_cache_mode == "align" else GroupKind.MAMBA
    elif isinstance(spec, V.FullAttentionSpec):
        kind = GroupKind.FULL
    else:
        kind = None
    return TraceGroup(
        index=index,
        spec=type(spec).__name__,
        kind=kind,
        tokens_per_block=spec.block_size,
        offloaded=offloaded,
        sliding_window=window,
        extra_retained_tokens=extra,
        attention_chunk_size=chunk,
        is_eagle=bool(group.is_eagle_group),
        page_bytes=int(spec.page_size_bytes),
        num_layers=len(group.layer_names),
    )
