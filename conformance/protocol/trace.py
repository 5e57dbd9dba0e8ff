"""A neutral record of what vLLM's core asks of the offloading connector.

A :class:`Trace` is the ordered list of the *scheduler-side* connector calls
one run of vLLM's real ``Scheduler`` made -- with the inputs the connector read
and the jobs it produced -- plus the configuration it ran under.  The reference
planner replays the records in order and must produce the same jobs.

Nothing here imports vLLM: the records are plain frozen dataclasses of ints,
strings, bytes and :mod:`reference.jobs` jobs.  :mod:`conformance.harness.driver`
produces them; :class:`WorkloadSpec` is what it is asked to run.

Record order is call order.  Every record carries ``step``, the driver step
(one ``Scheduler.schedule()`` + model output + ``update_from_output``) it
happened in; records made between steps (arrivals, aborts, resets) carry the
step they precede.  Jobs carry vLLM's job id: a per-run counter shared by
loads and stores, starting at 0, in creation order -- so a job's id is also
its position among the run's jobs.  A cache reset does not restart it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from reference.geometry import Geometry, GroupKind, KVGroup
from reference.jobs import LoadJob, StoreJob
from reference.keys import split_key

Params = tuple[tuple[str, Any], ...]
"""A JSON-ish mapping frozen as sorted ``(key, value)`` pairs."""


def freeze_params(params: Mapping[str, Any] | None) -> Params | None:
    """``kv_transfer_params`` (or any small mapping) as a hashable, ordered tuple."""
    if params is None:
        return None
    return tuple(sorted(params.items()))


def thaw_params(params: Params | None) -> dict[str, Any] | None:
    return None if params is None else dict(params)


# ---------------------------------------------------------------------------
# Configuration a trace ran under
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceGroup:
    """One KV-cache group of the run's ``KVCacheConfig`` (offloaded or not).

    ``index`` is the group's position in ``kv_cache_groups``: block tables in
    :class:`Alloc` / :class:`ScheduledRequest` are indexed by it.  ``kind`` is
    ``None`` for specs the reference has no kind for (e.g. cross attention).
    """

    index: int
    spec: str
    """vLLM's spec class name, e.g. ``"SlidingWindowSpec"``."""
    kind: GroupKind | None
    tokens_per_block: int
    offloaded: bool
    sliding_window: int | None = None
    extra_retained_tokens: int = 0
    attention_chunk_size: int | None = None
    is_eagle: bool = False
    page_bytes: int = 0
    num_layers: int = 1

    def describe(self) -> str:
        kind = self.kind.value if self.kind is not None else self.spec
        window = f" w{self.sliding_window}" if self.sliding_window is not None else ""
        eagle = " eagle" if self.is_eagle else ""
        off = "" if self.offloaded else " (not offloaded)"
        return f"g{self.index} {kind}{window}{eagle} @{self.tokens_per_block}{off}"


@dataclass(frozen=True)
class TraceConfig:
    """What a trace ran under, as vLLM resolved it."""

    connector: str
    groups: tuple[TraceGroup, ...]
    tokens_per_hash: int
    scheduler_block_size: int
    blocks_per_chunk: int
    """vLLM's resolved (global) blocks per chunk."""
    extra_config: Params
    """``kv_connector_extra_config`` as given to vLLM."""
    prefix_cache_retention_interval: int | None
    num_gpu_blocks: int
    num_cpu_chunks: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True
    kv_load_failure_policy: str = "fail"
    vllm_version: str = ""
    """The vLLM release that ran the trace (selects its rules: :mod:`conformance.protocol.versions`)."""

    @property
    def offloaded_groups(self) -> tuple[TraceGroup, ...]:
        return tuple(g for g in self.groups if g.offloaded)

    def geometry(self, name: str = "") -> Geometry:
        """The offloaded groups as a reference :class:`~reference.geometry.Geometry`."""
        groups = []
        for g in self.offloaded_groups:
            if g.kind is None:
                raise ValueError(f"{g.describe()}: the reference has no kind for {g.spec}")
            groups.append(
                KVGroup(
                    index=g.index,
                    kind=g.kind,
                    tokens_per_block=g.tokens_per_block,
                    page_bytes=g.page_bytes,
                    num_layers=g.num_layers,
                    sliding_window=g.sliding_window,
                    extra_retained_tokens=g.extra_retained_tokens,
                    attention_chunk_size=g.attention_chunk_size,
                    is_eagle=g.is_eagle,
                )
            )
        return Geometry(groups=tuple(groups), tokens_per_hash=self.tokens_per_hash, name=name)

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v!r}" for k, v in self.extra_config if k != "cpu_bytes_to_use")
        return (
            f"{self.connector}: [{'; '.join(g.describe() for g in self.groups)}], "
            f"tph {self.tokens_per_hash}, sched block {self.scheduler_block_size}, "
            f"bpc {self.blocks_per_chunk}, retention {self.prefix_cache_retention_interval}, "
            f"gpu blocks {self.num_gpu_blocks}, cpu chunks {self.num_cpu_chunks}, "
            f"batch {self.max_num_batched_tokens} tok, extra {{{extra}}}"
        )


# ---------------------------------------------------------------------------
# Workload: what the driver is asked to run
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One request: added at the start of ``arrival_step``."""

    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int = 1
    arrival_step: int = 0
    kv_transfer_params: Params | None = None
    skip_reading_prefix_cache: bool = False
    """``SamplingParams.skip_reading_prefix_cache``: the request reads no cached prefix,
    neither the GPU prefix cache nor the connector's (its lookups answer 0); it still
    stores what it computes."""

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.req_id}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.req_id}: max_tokens must be >= 1")
        if self.arrival_step < 0:
            raise ValueError(f"request {self.req_id}: arrival_step must be >= 0")


@dataclass(frozen=True)
class ResetSpec:
    """``Scheduler.reset_prefix_cache`` at the start of ``step``.

    ``reset_connector=False`` clears only the GPU prefix cache (it fails,
    and is recorded as failed, while running requests hold blocks unless
    ``reset_running_requests``); ``True`` also empties the offload tier.
    """

    step: int
    reset_connector: bool = False
    reset_running_requests: bool = False


@dataclass(frozen=True)
class AbortSpec:
    """``Scheduler.finish_requests(req_id, FINISHED_ABORTED)`` at the start of ``step``."""

    step: int
    req_id: str


@dataclass(frozen=True)
class JobFault:
    """How the emulated worker finishes the run's ``job_index``-th job (= vLLM job id).

    ``delay_steps``: report it this many steps after it was submitted to the
    worker (stores are submitted the step after they are created, loads the
    step they are created).  ``fail``: report a failed *load* (vLLM 0.33.0
    workers cannot report failed stores).  ``never``: never report it.
    """

    job_index: int
    delay_steps: int = 0
    fail: bool = False
    never: bool = False


@dataclass(frozen=True)
class WorkloadSpec:
    """A neutral description of one run."""

    requests: tuple[RequestSpec, ...]
    max_num_batched_tokens: int | None = None
    """Chunked-prefill token budget per step; ``None`` keeps the driver's."""
    resets: tuple[ResetSpec, ...] = ()
    aborts: tuple[AbortSpec, ...] = ()
    faults: tuple[JobFault, ...] = ()
    default_delay_steps: int = 0
    max_steps: int = 2000

    def __post_init__(self) -> None:
        ids = [r.req_id for r in self.requests]
        if len(ids) != len(set(ids)):
            raise ValueError(f"duplicate request ids in {ids}")
        for a in self.aborts:
            if a.req_id not in ids:
                raise ValueError(f"abort of unknown request {a.req_id!r}")
        if self.default_delay_steps < 0:
            raise ValueError("default_delay_steps must be >= 0")

    @property
    def last_event_step(self) -> int:
        steps = [r.arrival_step for r in self.requests]
        steps += [r.step for r in self.resets] + [a.step for a in self.aborts]
        return max(steps, default=0)


# ---------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockRef:
    """One entry of ``KVCacheBlocks.blocks[group]`` as ``update_state_after_alloc`` saw it."""

    block_id: int
    is_null: bool
    has_block_hash: bool


@dataclass(frozen=True)
class NewRequest:
    """``on_new_request``: the request was added to the scheduler."""

    step: int
    req_id: str
    num_prompt_tokens: int
    kv_transfer_params: Params | None
    prompt_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class ManagerLookup:
    """One ``OffloadingManager.lookup`` the connector made, and its answer."""

    key: bytes
    result: str
    """``LookupResult`` name, lower case: ``hit``, ``hit_pending``, ``miss``, ``retry``."""


@dataclass(frozen=True)
class Lookup:
    """``get_num_new_matched_tokens(request, computed_tokens, max_num_new_tokens)``.

    ``hit_tokens`` ``None`` means "ask again later".  The call also resets the
    request's block table and store progress, whatever it returns.
    """

    step: int
    req_id: str
    num_tokens: int
    num_prompt_tokens: int
    block_hashes: tuple[bytes, ...]
    computed_tokens: int
    max_num_new_tokens: int | None
    skip_reading_prefix_cache: bool
    hit_tokens: int | None
    load_async: bool
    manager_lookups: tuple[ManagerLookup, ...] = ()


@dataclass(frozen=True)
class LoadJobRecord:
    """A load job the connector created (in ``update_state_after_alloc``)."""

    job_id: int
    job: LoadJob
    cpu_chunk_ids: tuple[int, ...] = ()
    """Where the manager placed the keys (CPU manager only); aligned with ``job.keys``."""
    sync: bool = False


@dataclass(frozen=True)
class Alloc:
    """``update_state_after_alloc(request, blocks, num_external_tokens)``.

    ``blocks`` has one tuple per KV-cache group of the config (all groups,
    indexed by group index).  ``load`` is the load job it created, if any.
    """

    step: int
    req_id: str
    blocks: tuple[tuple[BlockRef, ...], ...]
    num_external_tokens: int
    load: LoadJobRecord | None = None


@dataclass(frozen=True)
class ScheduledRequest:
    """Per-request data the connector reads in ``build_connector_meta``.

    Taken before the call (so before the core advances
    ``num_computed_tokens`` by this step's tokens).  ``new_block_ids`` is what
    ``yield_req_data`` yields: the full table for new / resumed requests
    (``is_full_table``), this step's new blocks for running ones, ``None`` when
    the step allocated none.  Requests present only in ``finished_req_ids``
    have ``scheduled=False`` and ``num_scheduled_tokens == 0``.
    """

    req_id: str
    new_block_ids: tuple[tuple[int, ...], ...] | None
    is_full_table: bool
    num_computed_tokens: int
    num_scheduled_tokens: int
    num_tokens: int
    num_prompt_tokens: int
    block_hashes: tuple[bytes, ...]
    status: str
    """``RequestStatus`` name, lower case: ``running``, ``finished_stopped``, ``finished_aborted``, ``preempted``, ..."""
    is_finished: bool
    shared_prefix_boundary: int | None
    scheduled: bool = True


@dataclass(frozen=True)
class BoundaryHandoff:
    """One Mamba-align boundary state offered for offload this step."""

    req_id: str
    group_index: int
    block_id: int
    boundary_tokens: int


@dataclass(frozen=True)
class StoreOffer:
    """One ``OffloadingManager.prepare_store`` call: offered keys and the answer.

    ``accepted`` is ``keys_to_store`` (``None`` when the manager refused:
    no room).
    """

    req_id: str
    offered: tuple[bytes, ...]
    accepted: tuple[bytes, ...] | None
    evicted: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class StoreJobRecord:
    """A store job the connector created in ``build_connector_meta``.

    ``kind``: ``chunks`` (the normal path), ``boundary`` (Mamba-align hand-off)
    or ``partial_tail``.  ``job.keys`` are the keys the manager accepted, in
    job order (group-major, chunk-ascending), i.e. ``keys_to_store``.
    """

    job_id: int
    job: StoreJob
    kind: str = "chunks"
    cpu_chunk_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class BuildMeta:
    """``build_connector_meta(scheduler_output)``: once per step."""

    step: int
    scheduled: tuple[ScheduledRequest, ...]
    """Scheduled requests in ``num_scheduled_tokens`` order, then finished-only
    ones in ``finished_req_ids`` order: the order store jobs are built in."""
    finished_req_ids: tuple[str, ...]
    """In vLLM's iteration order (a set: the order depends on string hashing)."""
    preempted_req_ids: tuple[str, ...]
    new_req_ids: tuple[str, ...]
    block_copy_dst_ids: tuple[int, ...]
    boundary_handoffs: tuple[BoundaryHandoff, ...]
    store_offers: tuple[StoreOffer, ...]
    store_jobs: tuple[StoreJobRecord, ...]
    load_job_ids: tuple[int, ...]
    """Load jobs dispatched with this step's metadata (created by this step's ``Alloc`` records)."""
    jobs_to_flush: tuple[int, ...]


@dataclass(frozen=True)
class JobDone:
    job_id: int
    success: bool = True
    count: int = 1
    """Workers reporting it in this call (1 worker: always 1)."""


@dataclass(frozen=True)
class JobsDone:
    """``update_connector_output``: what the worker reported this step.

    Completions travel as ``OffloadingWorkerMetadata.completed_jobs`` in
    ``KVConnectorOutput.kv_connector_worker_meta``; finished loads also name
    their request in ``finished_recving`` and failed ones in
    ``failed_recving``.  Steps that reported nothing have no record.
    """

    step: int
    done: tuple[JobDone, ...]
    finished_recving: tuple[str, ...] = ()
    failed_recving: tuple[str, ...] = ()


@dataclass(frozen=True)
class RequestFinished:
    """``request_finished``: the request stopped or was aborted (blocks not yet freed)."""

    step: int
    req_id: str
    status: str
    num_computed_tokens: int
    num_tokens: int
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class ResetPrefixCache:
    """``Scheduler.reset_prefix_cache``; ``connector_reset``: the connector's cache was reset."""

    step: int
    reset_running_requests: bool
    reset_connector: bool
    success: bool
    connector_reset: bool


Record = (
    NewRequest | Lookup | Alloc | BuildMeta | JobsDone | RequestFinished | ResetPrefixCache
)
R = TypeVar("R")


# ---------------------------------------------------------------------------
# Trace
# ---------------------------------------------------------------------------


def short_key(key: bytes) -> str:
    """``g<group>:<first 4 hash bytes in hex>``."""
    digest, group = split_key(key)
    return f"g{group}:{digest[:4].hex()}"


@dataclass(frozen=True)
class Trace:
    """One run: its config, workload and the ordered connector calls."""

    config: TraceConfig
    records: tuple[Record, ...]
    workload: WorkloadSpec | None = None
    num_steps: int = 0
    notes: tuple[str, ...] = field(default=())

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def of_type(self, cls: type[R]) -> tuple[R, ...]:
        return tuple(r for r in self.records if isinstance(r, cls))

    def store_jobs(self, req_id: str | None = None) -> tuple[StoreJobRecord, ...]:
        return tuple(
            j
            for m in self.of_type(BuildMeta)
            for j in m.store_jobs
            if req_id is None or j.job.req_id == req_id
        )

    def load_jobs(self, req_id: str | None = None) -> tuple[LoadJobRecord, ...]:
        return tuple(
            a.load
            for a in self.of_type(Alloc)
            if a.load is not None and (req_id is None or a.req_id == req_id)
        )

    def lookups(self, req_id: str | None = None) -> tuple[Lookup, ...]:
        return tuple(r for r in self.of_type(Lookup) if req_id is None or r.req_id == req_id)

    def step_of_job(self, job_id: int) -> int:
        for m in self.of_type(BuildMeta):
            if any(j.job_id == job_id for j in m.store_jobs) or job_id in m.load_job_ids:
                return m.step
        raise KeyError(job_id)

    # -- readable form -----------------------------------------------------

    def format(self, records: Iterable[Record] | None = None, *, verbose: bool = False) -> str:
        """A human-readable listing for failure reports (:mod:`conformance.protocol.trace_format`).

        One line per record (plus one per job), prefixed by the step.  Keys
        read ``g<group>:<first 4 bytes of the hash>``.  ``verbose`` adds the
        per-request lines of every ``BuildMeta``.
        """
        from conformance.protocol.trace_format import format_trace  # it imports this module

        return format_trace(self, records, verbose=verbose)

    def __str__(self) -> str:
        return self.format()

