"""Recording: wrap the live connector scheduler and its manager, turn calls into records.

Each tap wraps one vLLM surface (instance attributes of the live objects),
calls the original unchanged and only reads arguments and results.  The
manager calls made inside a connector call (``lookup`` inside
``get_num_new_matched_tokens``, ``prepare_load`` inside
``update_state_after_alloc``, ``prepare_store`` inside
``build_connector_meta``) are buffered by the tap of that connector call and
folded into its record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from conformance.harness import vllm_harness_api as V
from conformance.harness.driver import records as R
from conformance.protocol.trace import (
    Alloc,
    BuildMeta,
    LoadJobRecord,
    Lookup,
    ManagerLookup,
    Record,
    StoreJobRecord,
    StoreOffer,
)

if TYPE_CHECKING:
    from conformance.harness.driver.session import DriverSession

Method = Callable[..., Any]


def wrap(obj: Any, name: str, make: Callable[[Method], Method]) -> None:
    """Replace ``obj.name`` by ``make(original)`` (an instance attribute)."""
    original = getattr(obj, name)
    setattr(obj, name, make(original))


class Recorder:
    """Wraps the connector scheduler and its manager; turns calls into :attr:`records`."""

    def __init__(self, session: DriverSession, cs: Any) -> None:
        self.s = session
        self.cs = cs
        self.records: list[Record] = []
        self.requests: dict[str, Any] = {}
        """Every request the connector saw, by id (kept after it finished)."""
        self.load_req: dict[int, str] = {}
        self.last_computed: dict[str, int] = {}
        RequestTap(self)
        LookupTap(self)
        LoadTap(self)
        StoreTap(self)
        OutputTap(self)
        self._resets = ResetTap(self)

    @property
    def step(self) -> int:
        return self.s.step_no

    def take_connector_reset(self) -> bool:
        """Whether the connector's ``reset_cache`` ran since the last call."""
        return self._resets.take()


class RequestTap:
    """``on_new_request`` and ``request_finished``."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        wrap(rec.cs, "on_new_request", self._on_new_request)
        wrap(rec.cs, "request_finished", self._request_finished)

    def _on_new_request(self, orig: Method) -> Method:
        def on_new_request(request: Any) -> Any:
            self.rec.requests[request.request_id] = request
            self.rec.records.append(R.new_request(self.rec.step, request))
            return orig(request)

        return on_new_request

    def _request_finished(self, orig: Method) -> Method:
        def request_finished(request: Any, *args: Any, **kwargs: Any) -> Any:
            self.rec.records.append(R.request_finished(self.rec.step, request))
            return orig(request, *args, **kwargs)

        return request_finished


class LookupTap:
    """``get_num_new_matched_tokens``, with the manager ``lookup`` s it makes."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self._lookups: list[ManagerLookup] | None = None
        wrap(rec.cs, "get_num_new_matched_tokens", self._get_num_new_matched_tokens)
        wrap(rec.cs.manager, "lookup", self._lookup)

    def _lookup(self, orig: Method) -> Method:
        def lookup(key: bytes, req_context: Any) -> Any:
            result = orig(key, req_context)
            if self._lookups is not None:
                self._lookups.append(ManagerLookup(bytes(key), str(result.name).lower()))
            return result

        return lookup

    def _get_num_new_matched_tokens(self, orig: Method) -> Method:
        def get_num_new_matched_tokens(
            request: Any, num_computed_tokens: int, max_num_new_tokens: int | None = None
        ) -> Any:
            num_tokens, num_prompt_tokens = request.num_tokens, request.num_prompt_tokens
            hashes = R.block_hashes(request)
            skip = V.skips_external_kv(request)
            self._lookups = []
            try:
                hit, load_async = orig(request, num_computed_tokens, max_num_new_tokens)
            finally:
                lookups, self._lookups = self._lookups, None
            self.rec.last_computed[request.request_id] = num_computed_tokens
            self.rec.records.append(
                Lookup(
                    step=self.rec.step,
                    req_id=request.request_id,
                    num_tokens=num_tokens,
                    num_prompt_tokens=num_prompt_tokens,
                    block_hashes=hashes,
                    computed_tokens=num_computed_tokens,
                    max_num_new_tokens=max_num_new_tokens,
                    skip_reading_prefix_cache=skip,
                    hit_tokens=hit,
                    load_async=bool(load_async),
                    manager_lookups=tuple(lookups or ()),
                )
            )
            return hit, load_async

        return get_num_new_matched_tokens


class LoadTap:
    """``update_state_after_alloc``, with the load job (and manager ``prepare_load``) it makes."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self._loads: list[tuple[R.Keys, Any]] = []
        wrap(rec.cs, "update_state_after_alloc", self._update_state_after_alloc)
        wrap(rec.cs.manager, "prepare_load", self._prepare_load)

    def _prepare_load(self, orig: Method) -> Method:
        def prepare_load(keys: Any, req_context: Any) -> Any:
            keys = list(keys)
            spec = orig(keys, req_context)
            self._loads.append((R.as_keys(keys), spec))
            return spec

        return prepare_load

    def _pending_loads(self) -> dict[int, Any]:
        return getattr(self.rec.cs, "_current_batch_load_jobs", {})

    def _new_load(
        self, request: Any, before: set[int], num_external_tokens: int
    ) -> LoadJobRecord | None:
        """The load job this call added to the batch, if any (at most one per request)."""
        new_ids = [j for j in self._pending_loads() if j not in before]
        if not new_ids:
            return None
        (job_id,) = new_ids
        tj = self.rec.cs._current_batch_load_jobs[job_id]
        load = R.load_job_record(
            job_id,
            tj,
            R.keys_for(tj.src_spec, self._loads),
            computed_tokens=self.rec.last_computed.get(request.request_id, 0),
            hit_tokens=num_external_tokens,
        )
        self.rec.load_req[job_id] = tj.req_id
        return load

    def _update_state_after_alloc(self, orig: Method) -> Method:
        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            refs = R.block_refs(blocks)
            before = set(self._pending_loads())
            self._loads = []
            result = orig(request, blocks, num_external_tokens)
            load = self._new_load(request, before, num_external_tokens)
            self._loads = []
            self.rec.records.append(
                Alloc(
                    step=self.rec.step,
                    req_id=request.request_id,
                    blocks=refs,
                    num_external_tokens=num_external_tokens,
                    load=load,
                )
            )
            return result

        return update_state_after_alloc


def _collect(into: set[int]) -> Callable[[Method], Method]:
    """A wrapper maker that adds the job ids a job builder returns to ``into``."""

    def make(orig: Method) -> Method:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            jobs = orig(*args, **kwargs)
            into.update(jobs)
            return jobs

        return wrapper

    return make


class StoreTap:
    """``build_connector_meta``, with its store offers (manager ``prepare_store``) and jobs.

    Job kinds come from wrapping ``_build_aligned_boundary_store_jobs`` /
    ``_build_partial_tail_store_jobs`` where the connector has them.
    """

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self._offers: list[tuple[StoreOffer, Any]] = []
        self._boundary_jobs: set[int] = set()
        self._partial_jobs: set[int] = set()
        cs = rec.cs
        wrap(cs, "build_connector_meta", self._build_connector_meta)
        if hasattr(cs, "_build_aligned_boundary_store_jobs"):
            wrap(cs, "_build_aligned_boundary_store_jobs", _collect(self._boundary_jobs))
        if hasattr(cs, "_build_partial_tail_store_jobs"):
            wrap(cs, "_build_partial_tail_store_jobs", _collect(self._partial_jobs))
        wrap(cs.manager, "prepare_store", self._prepare_store)

    def _prepare_store(self, orig: Method) -> Method:
        def prepare_store(keys: Any, req_context: Any) -> Any:
            keys = list(keys)
            out = orig(keys, req_context)
            offer = StoreOffer(
                req_id=req_context.req_id,
                offered=R.as_keys(keys),
                accepted=None if out is None else R.as_keys(out.keys_to_store),
                evicted=() if out is None else R.as_keys(out.evicted_keys),
            )
            self._offers.append((offer, None if out is None else out.store_spec))
            return out

        return prepare_store

    def _kind(self, job_id: int) -> str:
        if job_id in self._boundary_jobs:
            return "boundary"
        if job_id in self._partial_jobs:
            return "partial_tail"
        return "chunks"

    def _store_job(self, job_id: int, tj: Any) -> StoreJobRecord:
        accepted = ((o.accepted or (), s) for o, s in self._offers if s is not None)
        return R.store_job_record(
            job_id, tj, R.keys_for(tj.dst_spec, accepted), self._kind(job_id)
        )

    def _build_connector_meta(self, orig: Method) -> Method:
        def build_connector_meta(so: Any) -> Any:
            scheduled = R.scheduled_requests(so, self.rec.requests)
            handoffs = R.boundary_handoffs(so)
            copies = R.block_copy_dst_ids(so)
            self._offers = []
            self._boundary_jobs.clear()
            self._partial_jobs.clear()
            meta = orig(so)
            store_jobs = tuple(self._store_job(j, tj) for j, tj in meta.store_jobs.items())
            self.rec.records.append(
                BuildMeta(
                    step=self.rec.step,
                    scheduled=scheduled,
                    finished_req_ids=tuple(so.finished_req_ids or ()),
                    preempted_req_ids=tuple(so.preempted_req_ids or ()),
                    new_req_ids=tuple(r.req_id for r in so.scheduled_new_reqs),
                    block_copy_dst_ids=copies,
                    boundary_handoffs=handoffs,
                    store_offers=tuple(o for o, _ in self._offers),
                    store_jobs=store_jobs,
                    load_job_ids=tuple(meta.load_jobs),
                    jobs_to_flush=tuple(sorted(meta.jobs_to_flush or ())),
                )
            )
            self._offers = []
            return meta

        return build_connector_meta


class OutputTap:
    """``update_connector_output``: the job reports the worker side sent back."""

    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        wrap(rec.cs, "update_connector_output", self._update_connector_output)

    def _update_connector_output(self, orig: Method) -> Method:
        def update_connector_output(connector_output: Any) -> Any:
            done = R.jobs_done(self.rec.step, connector_output, self.rec.load_req)
            if done is not None:
                self.rec.records.append(done)
            return orig(connector_output)

        return update_connector_output


class ResetTap:
    """``reset_cache``: notes that the connector's tier was reset."""

    def __init__(self, rec: Recorder) -> None:
        self._connector_reset = False
        wrap(rec.cs, "reset_cache", self._reset_cache)

    def _reset_cache(self, orig: Method) -> Method:
        def reset_cache(*args: Any, **kwargs: Any) -> Any:
            self._connector_reset = True
            return orig(*args, **kwargs)

        return reset_cache

    def take(self) -> bool:
        flag, self._connector_reset = self._connector_reset, False
        return flag
