"""Pure conversions from live vLLM objects to :mod:`conformance.protocol.trace` records.

Each function only reads its arguments (requests, blocks, scheduler output,
transfer jobs) and returns frozen records; :mod:`conformance.harness.driver.recorder`
decides when to call them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from conformance.harness import vllm_harness_api as V
from conformance.protocol.trace import (
    BlockRef,
    BoundaryHandoff,
    JobDone,
    JobsDone,
    LoadJobRecord,
    NewRequest,
    RequestFinished,
    ScheduledRequest,
    StoreJobRecord,
    freeze_params,
)
from reference.jobs import LoadJob, StoreJob

Keys = tuple[bytes, ...]


def request_status(req: Any) -> str:
    return str(req.status.name).lower()


def block_hashes(req: Any) -> Keys:
    return tuple(bytes(h) for h in req.block_hashes)


def as_keys(keys: Iterable[Any]) -> Keys:
    return tuple(bytes(k) for k in keys)


def keys_for(spec: Any, pairs: Iterable[tuple[Keys, Any]]) -> Keys:
    """The keys paired with ``spec`` (by identity; the last such pair), else ``()``."""
    keys: Keys = ()
    for k, s in pairs:
        if s is spec:
            keys = k
    return keys


def _ints(values: Iterable[Any]) -> tuple[int, ...]:
    return tuple(int(x) for x in values)


def new_request(step: int, request: Any) -> NewRequest:
    return NewRequest(
        step=step,
        req_id=request.request_id,
        num_prompt_tokens=request.num_prompt_tokens,
        kv_transfer_params=freeze_params(request.kv_transfer_params),
        prompt_token_ids=tuple(request.prompt_token_ids or ()),
    )


def request_finished(step: int, request: Any) -> RequestFinished:
    return RequestFinished(
        step=step,
        req_id=request.request_id,
        status=request_status(request),
        num_computed_tokens=request.num_computed_tokens,
        num_tokens=request.num_tokens,
        block_hashes=block_hashes(request),
    )


def block_refs(blocks: Any) -> tuple[tuple[BlockRef, ...], ...]:
    """``KVCacheBlocks`` as plain refs, per group."""
    return tuple(
        tuple(BlockRef(int(b.block_id), bool(b.is_null), b.block_hash is not None) for b in group)
        for group in blocks.blocks
    )


def load_job_record(
    job_id: int, tj: Any, keys: Keys, computed_tokens: int, hit_tokens: int
) -> LoadJobRecord:
    """A load transfer job (``tj``: GPU side in ``dst_spec``) as a record."""
    dst = tj.dst_spec
    return LoadJobRecord(
        job_id=job_id,
        job=LoadJob(
            req_id=tj.req_id,
            computed_tokens=computed_tokens,
            hit_tokens=hit_tokens,
            keys=keys,
            block_ids=_ints(dst.block_ids),
            group_sizes=_ints(dst.group_sizes),
            block_indices=_ints(dst.block_indices),
        ),
        cpu_chunk_ids=_ints(getattr(tj.src_spec, "block_ids", ())),
        sync=bool(tj.sync),
    )


def store_job_record(job_id: int, tj: Any, keys: Keys, kind: str) -> StoreJobRecord:
    """A store transfer job (``tj``: GPU side in ``src_spec``) as a record."""
    src = tj.src_spec
    return StoreJobRecord(
        job_id=job_id,
        job=StoreJob(
            req_id=tj.req_id,
            keys=keys,
            block_ids=_ints(src.block_ids),
            group_sizes=_ints(src.group_sizes),
            block_indices=_ints(src.block_indices),
        ),
        kind=kind,
        cpu_chunk_ids=_ints(getattr(tj.dst_spec, "block_ids", ())),
    )


def _scheduled_order(so: Any) -> list[str]:
    # _build_store_jobs visits chain(num_scheduled_tokens, finished_req_ids);
    # keep that order (finished_req_ids is a set: its order is this process's).
    order = list(so.num_scheduled_tokens)
    order += [r for r in (so.finished_req_ids or ()) if r not in so.num_scheduled_tokens]
    return order


def scheduled_requests(so: Any, requests: Mapping[str, Any]) -> tuple[ScheduledRequest, ...]:
    """The requests a scheduler output shows the connector, in its visiting order."""
    new_blocks: dict[str, tuple[Any, bool]] = {}
    for req_id, groups, is_full in V.yield_req_data(so):
        frozen = None if groups is None else tuple(_ints(g) for g in groups)
        new_blocks[req_id] = (frozen, bool(is_full))
    out = []
    for req_id in _scheduled_order(so):
        req = requests.get(req_id)
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
                block_hashes=block_hashes(req),
                status=request_status(req),
                is_finished=bool(req.is_finished()),
                shared_prefix_boundary=req.shared_prefix_boundary,
                scheduled=req_id in so.num_scheduled_tokens,
            )
        )
    return tuple(out)


def boundary_handoffs(so: Any) -> tuple[BoundaryHandoff, ...]:
    block_state = so.kv_connector_block_state
    if block_state is None:
        return ()
    return tuple(
        BoundaryHandoff(req_id, int(g), int(b), int(t))
        for req_id, entries in (block_state.boundary_state_offloads or {}).items()
        for g, b, t in entries
    )


def block_copy_dst_ids(so: Any) -> tuple[int, ...]:
    return tuple(int(c.dst_block_id) for c in (so.kv_cache_block_copies or ()))


def jobs_done(step: int, connector_output: Any, load_req: Mapping[int, str]) -> JobsDone | None:
    """The job reports in a ``KVConnectorOutput``; ``None`` when it reports nothing.

    A job fails when its worker says so, or when it is a load whose request is
    in ``failed_recving``.
    """
    wm = connector_output.kv_connector_worker_meta
    completed = dict(getattr(wm, "completed_jobs", {}) or {})
    failed = set(connector_output.failed_recving or ())
    failed_jobs = V.failed_job_ids(wm)
    recving = set(connector_output.finished_recving or ())
    if not (completed or failed or recving):
        return None
    done = tuple(
        JobDone(
            job_id=j,
            success=j not in failed_jobs and not (j in load_req and load_req[j] in failed),
            count=int(n),
        )
        for j, n in sorted(completed.items())
    )
    return JobsDone(
        step=step,
        done=done,
        finished_recving=tuple(sorted(recving)),
        failed_recving=tuple(sorted(failed)),
    )
