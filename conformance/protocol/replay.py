"""Replay a recorded vLLM trace into a planner and compare the outputs.

A :class:`~conformance.protocol.trace.Trace` holds the scheduler-side connector calls
vLLM's real core made, with the inputs the connector read.  :func:`replay`
feeds those inputs, in order, to any object that speaks the planner protocol
(:class:`reference.plan.Planner` is the oracle; see ``conformance/PROTOCOL.md``)
and collects what it answers.  :func:`first_divergence` compares two answer
lists and explains the first difference readably.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from conformance.protocol import trace as T
from conformance.protocol.versions import rules_for
from reference.jobs import LoadJob, StoreJob
from reference.knobs import Chunking, resolve_extra_config
from reference.plan import BlockRef, Planner, Policy, ScheduledRequest
from reference.store import ChunkStore, LookupResult, StorePlan


class PlannerLike(Protocol):
    """The scheduler-side protocol a backend implements (PROTOCOL.md, "The planner protocol",
    states it; ``tests/test_protocol_doc.py`` keeps the two equal)."""

    last_job_id: int | None
    """Id of the load job the last :meth:`allocated` call returned."""

    def new_request(
        self, req_id: str, num_prompt_tokens: int, max_load_tokens: int | None = None,
        max_offload_tokens: int | None = None,
    ) -> None: ...

    def lookup(
        self, req_id: str, block_hashes: Sequence[bytes], num_tokens: int, computed_tokens: int,
        max_num_new_tokens: int | None = None, skip_reading_prefix_cache: bool = False,
    ) -> int | None: ...

    def allocated(
        self, req_id: str, blocks: Sequence[Sequence[BlockRef]], num_external_tokens: int
    ) -> LoadJob | None: ...

    def step(
        self, scheduled: Sequence[ScheduledRequest], finished: Sequence[ScheduledRequest] = (),
        block_copy_dst_ids: Sequence[int] = (),
        boundary_handoffs: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
    ) -> list[tuple[int, StoreJob]]: ...

    def job_done(self, job_id: int, success: bool = True) -> None: ...

    def request_finished(self, req_id: str, block_hashes: Sequence[bytes] | None = None) -> None: ...

    def reset(self) -> None: ...


PlannerFactory = Callable[[Chunking, ChunkStore, Policy], PlannerLike]


def reference_planner(chunking: Chunking, store: ChunkStore, policy: Policy) -> PlannerLike:
    return Planner(chunking, store, policy)


@dataclass(frozen=True)
class Answer:
    """One observable output of one call."""

    step: int
    call: str
    req_id: str
    value: Any

    def describe(self) -> str:
        return f"[step {self.step}] {self.call}({self.req_id}) -> {_fmt(self.value)}"


def _fmt(value: Any) -> str:
    if isinstance(value, tuple) and value and isinstance(value[0], int) and len(value) == 2:
        job_id, job = value
        return f"job {job_id}: {_fmt(job)}"
    if isinstance(value, (StoreJob, LoadJob)):
        keys = ", ".join(T.short_key(k) for k in value.keys)
        extra = f" hit={value.hit_tokens} after {value.computed_tokens}" if isinstance(value, LoadJob) else ""
        return (
            f"{type(value).__name__}{extra} keys=[{keys}] blocks={list(value.block_ids)} "
            f"group_sizes={list(value.group_sizes)} block_indices={list(value.block_indices)}"
        )
    if isinstance(value, list):
        return "[" + "; ".join(_fmt(v) for v in value) + "]"
    return repr(value)


def chunking_of(config: T.TraceConfig) -> Chunking:
    """Resolve the trace's extra config on its geometry, as the reference does."""
    return resolve_extra_config(
        config.geometry(), dict(config.extra_config), config.prefix_cache_retention_interval
    )


def policy_of(config: T.TraceConfig) -> Policy:
    extra = dict(config.extra_config)
    return replace(
        rules_for(config.vllm_version).policy,
        retention_interval=config.prefix_cache_retention_interval,
        offload_prompt_only=bool(extra.get("offload_prompt_only", True)),
        prefix_caching=config.enable_prefix_caching,
    )


def _scheduled(s: T.ScheduledRequest) -> ScheduledRequest:
    return ScheduledRequest(
        req_id=s.req_id,
        num_prompt_tokens=s.num_prompt_tokens,
        num_tokens=s.num_tokens,
        num_computed_tokens=s.num_computed_tokens,
        num_scheduled_tokens=s.num_scheduled_tokens,
        block_hashes=s.block_hashes,
        new_block_ids=s.new_block_ids,
        is_full_table=s.is_full_table,
        is_finished=s.is_finished,
        is_aborted=s.status == "finished_aborted",
        shared_prefix_boundary=s.shared_prefix_boundary or 0,
    )


def _int_param(params: dict[str, Any] | None, name: str) -> int | None:
    raw = (params or {}).get(name)
    return raw if type(raw) is int and raw >= 0 else None


def recorded_answers(trace: T.Trace) -> list[Answer]:
    """What vLLM's connector answered, in the same shape :func:`replay` produces."""
    out: list[Answer] = []
    for r in trace.records:
        if isinstance(r, T.Lookup):
            out.append(Answer(r.step, "lookup", r.req_id, r.hit_tokens))
        elif isinstance(r, T.Alloc):
            load = (r.load.job_id, r.load.job) if r.load else None
            out.append(Answer(r.step, "allocated", r.req_id, load))
        elif isinstance(r, T.BuildMeta):
            jobs = [(j.job_id, j.job) for j in r.store_jobs]
            out.append(Answer(r.step, "step", "*", jobs))
    return out


class ReplayedEvictionStore(ChunkStore):
    """The reference store, with *capacity decisions* taken from the trace.

    Which chunks a full tier evicts is an eviction policy (vLLM's CPU manager
    ranks keys per request and token position, and also offers ARC), not chunk
    semantics; the reference store's own policy is plain LRU.  So when the
    planner offers exactly what vLLM's connector offered, this store evicts the
    keys vLLM's manager evicted and refuses when it refused.  Everything else
    -- which keys are held, pending or loadable -- stays the reference's.
    """

    def __init__(self, num_slots: int, offers: Sequence[T.StoreOffer]) -> None:
        super().__init__(num_slots)
        self._offers = list(offers)
        self._next = 0

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        offer = self._offers[self._next] if self._next < len(self._offers) else None
        self._next += 1
        if offer is None or tuple(keys) != offer.offered:
            return super().prepare_store(keys)  # the answers will show the divergence
        if offer.accepted is None:
            return None
        for key in offer.evicted:
            if self.lookup(key) is LookupResult.HIT and self.ref_count(key) == 0:
                self.evict(key)
        return super().prepare_store(keys)


@dataclass
class ReplayProgress:
    """Where a :func:`replay` is: filled in as it goes, so a caller still knows, after
    the planner raised, which call raised and what it had answered before."""

    answers: list[Answer] = field(default_factory=list)
    """The answers collected so far (those before the current call)."""
    record_index: int | None = None
    """Index in ``trace.records`` of the record being replayed (None: the factory call)."""
    step: int = 0
    call: str = ""
    """The planner call being made, in words, e.g. ``job_done(17, success=True)``."""


def _hashes(hashes: Sequence[bytes] | None) -> str:
    return "None" if hashes is None else f"<{len(hashes)} block hashes>"


def _ids(xs: Sequence[str]) -> str:
    return "[" + ", ".join(xs) + "]"


def replay(
    trace: T.Trace, factory: PlannerFactory = reference_planner, policy: Policy | None = None,
    progress: ReplayProgress | None = None,
) -> list[Answer]:
    """Feed the trace's inputs to a fresh planner; its answers, call by call.

    ``policy``: the switches to plan with (the golden corpus states them); by
    default those of the release that ran the trace (:func:`policy_of`).
    ``progress``: filled in as the replay goes (the answers so far, the call being
    made), so that when the planner raises the caller can say at which call.
    """
    progress = ReplayProgress() if progress is None else progress
    out = progress.answers
    chunking = chunking_of(trace.config)
    offers = [o for r in trace.records if isinstance(r, T.BuildMeta) for o in r.store_offers]
    store = ReplayedEvictionStore(trace.config.num_cpu_chunks, offers)
    progress.call = "factory(chunking, store, policy)"
    planner = factory(chunking, store, policy_of(trace.config) if policy is None else policy)
    for index, r in enumerate(trace.records):
        progress.record_index, progress.step = index, r.step
        if isinstance(r, T.NewRequest):
            params = T.thaw_params(r.kv_transfer_params)
            load_cap = _int_param(params, "max_load_tokens")
            offload_cap = _int_param(params, "max_offload_tokens")
            progress.call = (f"new_request({r.req_id!r}, {r.num_prompt_tokens}, "
                             f"max_load_tokens={load_cap}, max_offload_tokens={offload_cap})")
            planner.new_request(r.req_id, r.num_prompt_tokens, load_cap, offload_cap)
        elif isinstance(r, T.Lookup):
            progress.call = (
                f"lookup({r.req_id!r}, {_hashes(r.block_hashes)}, num_tokens={r.num_tokens}, "
                f"computed_tokens={r.computed_tokens}, max_num_new_tokens={r.max_num_new_tokens}, "
                f"skip_reading_prefix_cache={r.skip_reading_prefix_cache})"
            )
            hit = planner.lookup(
                r.req_id, r.block_hashes, r.num_tokens, r.computed_tokens,
                r.max_num_new_tokens, r.skip_reading_prefix_cache,
            )
            out.append(Answer(r.step, "lookup", r.req_id, hit))
        elif isinstance(r, T.Alloc):
            blocks = [[BlockRef(b.block_id, b.is_null, b.has_block_hash) for b in g] for g in r.blocks]
            progress.call = (f"allocated({r.req_id!r}, <block tables of {len(blocks)} groups>, "
                             f"num_external_tokens={r.num_external_tokens})")
            load = planner.allocated(r.req_id, blocks, r.num_external_tokens)
            job_id = getattr(planner, "last_job_id", None)
            out.append(Answer(r.step, "allocated", r.req_id, (job_id, load) if load else None))
        elif isinstance(r, T.BuildMeta):
            scheduled = [_scheduled(s) for s in r.scheduled if s.scheduled]
            finished = [_scheduled(s) for s in r.scheduled if not s.scheduled]
            handoffs: dict[str, list[tuple[int, int, int]]] = {}
            for h in r.boundary_handoffs:
                handoffs.setdefault(h.req_id, []).append((h.group_index, h.block_id, h.boundary_tokens))
            progress.call = (
                f"step(scheduled={_ids([s.req_id for s in scheduled])}, "
                f"finished={_ids([s.req_id for s in finished])}, "
                f"block_copy_dst_ids={list(r.block_copy_dst_ids)}, boundary_handoffs={handoffs})"
            )
            jobs = planner.step(scheduled, finished, r.block_copy_dst_ids, handoffs)
            out.append(Answer(r.step, "step", "*", list(jobs)))
        elif isinstance(r, T.JobsDone):
            for d in r.done:
                progress.call = f"job_done({d.job_id}, success={d.success})"
                planner.job_done(d.job_id, d.success)
        elif isinstance(r, T.RequestFinished):
            progress.call = f"request_finished({r.req_id!r}, {_hashes(r.block_hashes)})"
            planner.request_finished(r.req_id, r.block_hashes)
        elif isinstance(r, T.ResetPrefixCache):
            if r.connector_reset:
                progress.call = "reset()"
                planner.reset()
    progress.record_index, progress.call = None, ""
    return out


@dataclass(frozen=True)
class Divergence:
    index: int
    expected: Answer | None
    actual: Answer | None

    def explain(self, trace: T.Trace | None = None) -> str:
        lines = [f"first divergence at answer #{self.index}:"]
        lines.append(f"  reference: {self.expected.describe() if self.expected else '(none)'}")
        lines.append(f"  backend:   {self.actual.describe() if self.actual else '(none)'}")
        if trace is not None:
            first = self.expected or self.actual
            step = first.step if first is not None else 0
            lines.append("trace up to that step:")
            lines.extend("  " + line for line in trace.format().splitlines() if _step_of(line) <= step)
        return "\n".join(lines)


def _step_of(line: str) -> int:
    try:
        return int(line.split("]")[0].strip("[ ").split()[-1])
    except (ValueError, IndexError):
        return 0


def first_divergence(expected: list[Answer], actual: list[Answer]) -> Divergence | None:
    for i in range(max(len(expected), len(actual))):
        e = expected[i] if i < len(expected) else None
        a = actual[i] if i < len(actual) else None
        if e != a:
            return Divergence(i, e, a)
    return None
