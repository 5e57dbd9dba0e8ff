"""The human-readable listing of a :class:`~conformance.protocol.trace.Trace`, for failure reports.

One line per record (plus one per job), prefixed by the step.  Keys read
``g<group>:<first 4 bytes of the hash>`` (:func:`conformance.protocol.trace.short_key`).
Each record kind has its own formatter in :data:`_FORMATTERS`; a record of any
other type prints as its ``repr``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from conformance.protocol.trace import (
    Alloc,
    BuildMeta,
    JobsDone,
    Lookup,
    NewRequest,
    Record,
    RequestFinished,
    ResetPrefixCache,
    Trace,
    short_key,
)

_MAX_SHOWN_MISSES = 6


def _keys(keys: Sequence[bytes], limit: int = 12) -> str:
    shown = [short_key(k) for k in keys[:limit]]
    if len(keys) > limit:
        shown.append(f"... +{len(keys) - limit}")
    return "[" + " ".join(shown) + "]"


def _ints(xs: Sequence[int], limit: int = 24) -> str:
    shown = [str(x) for x in xs[:limit]]
    if len(xs) > limit:
        shown.append(f"... +{len(xs) - limit}")
    return "[" + ",".join(shown) + "]"


def _spec(block_ids: Sequence[int], group_sizes: Sequence[int], block_indices: Sequence[int]) -> str:
    return f"blocks {_ints(block_ids)} sizes {list(group_sizes)} idx {list(block_indices)}"


def _new_request(r: NewRequest, p: str, verbose: bool) -> list[str]:
    params = f" params {dict(r.kv_transfer_params)}" if r.kv_transfer_params else ""
    return [f"{p}new      {r.req_id}: {r.num_prompt_tokens} prompt tokens{params}"]


def _lookup(r: Lookup, p: str, verbose: bool) -> list[str]:
    cap = f" cap {r.max_num_new_tokens}" if r.max_num_new_tokens is not None else ""
    skip = " skip-read" if r.skip_reading_prefix_cache else ""
    misses = [m for m in r.manager_lookups if m.result != "hit"]
    tail = ""
    if r.manager_lookups:
        tail = f" ({len(r.manager_lookups)} key lookups"
        if misses:
            shown = misses[:_MAX_SHOWN_MISSES]
            tail += ", not hit: " + " ".join(f"{short_key(m.key)}={m.result}" for m in shown)
            if len(misses) > _MAX_SHOWN_MISSES:
                tail += f" ... +{len(misses) - _MAX_SHOWN_MISSES}"
        tail += ")"
    return [
        f"{p}lookup   {r.req_id}: N={r.num_tokens} P={r.num_prompt_tokens} "
        f"hashes={len(r.block_hashes)} C={r.computed_tokens}{cap}{skip} "
        f"-> hit {r.hit_tokens} async={r.load_async}{tail}"
    ]


def _alloc(r: Alloc, p: str, verbose: bool) -> list[str]:
    sizes = "/".join(
        f"{sum(not b.is_null for b in g)}+{sum(b.is_null for b in g)}null" for g in r.blocks
    )
    out = [f"{p}alloc    {r.req_id}: ext {r.num_external_tokens}, blocks per group {sizes}"]
    if r.load is not None:
        j = r.load.job
        out.append(
            f"{p}  LOAD  job {r.load.job_id} {j.req_id}: C={j.computed_tokens} hit={j.hit_tokens} "
            f"keys {_keys(j.keys)} -> {_spec(j.block_ids, j.group_sizes, j.block_indices)}"
            + (" sync" if r.load.sync else "")
        )
    return out


def _meta_summary(r: BuildMeta, p: str) -> str:
    """The ``meta`` line: scheduled requests, then the step's non-empty id lists."""
    sched = " ".join(
        f"{s.req_id}+{s.num_scheduled_tokens}" if s.scheduled else f"{s.req_id}(fin)"
        for s in r.scheduled
    )
    extra = []
    if r.finished_req_ids:
        extra.append(f"finished {list(r.finished_req_ids)}")
    if r.preempted_req_ids:
        extra.append(f"preempted {list(r.preempted_req_ids)}")
    if r.load_job_ids:
        extra.append(f"loads {list(r.load_job_ids)}")
    if r.jobs_to_flush:
        extra.append(f"flush {list(r.jobs_to_flush)}")
    if r.boundary_handoffs:
        extra.append(
            "handoffs "
            + " ".join(
                f"{h.req_id}:g{h.group_index}@{h.boundary_tokens}->b{h.block_id}"
                for h in r.boundary_handoffs
            )
        )
    return f"{p}meta     [{sched}]" + (" " + "; ".join(extra) if extra else "")


def _meta_details(r: BuildMeta, p: str) -> list[str]:
    """The verbose lines of a ``BuildMeta``: one per scheduled request, one per store offer."""
    out = []
    for s in r.scheduled:
        nb = "none" if s.new_block_ids is None else "/".join(_ints(g, 8) for g in s.new_block_ids)
        out.append(
            f"{p}  req {s.req_id}: {s.status} C={s.num_computed_tokens} "
            f"+{s.num_scheduled_tokens} N={s.num_tokens} P={s.num_prompt_tokens} "
            f"hashes={len(s.block_hashes)} spb={s.shared_prefix_boundary} "
            f"{'full' if s.is_full_table else 'new'} blocks {nb}"
        )
    for o in r.store_offers:
        acc = "refused" if o.accepted is None else _keys(o.accepted)
        out.append(f"{p}  offer {o.req_id}: {_keys(o.offered)} -> {acc}")
    return out


def _build_meta(r: BuildMeta, p: str, verbose: bool) -> list[str]:
    out = [_meta_summary(r, p)]
    if verbose:
        out += _meta_details(r, p)
    for sj in r.store_jobs:
        store = sj.job
        kind = "" if sj.kind == "chunks" else f" ({sj.kind})"
        out.append(
            f"{p}  STORE job {sj.job_id} {store.req_id}{kind}: keys {_keys(store.keys)} <- "
            f"{_spec(store.block_ids, store.group_sizes, store.block_indices)}"
        )
    return out


def _jobs_done(r: JobsDone, p: str, verbose: bool) -> list[str]:
    done = " ".join(
        f"{d.job_id}{'' if d.success else '(FAILED)'}{'' if d.count == 1 else f'x{d.count}'}"
        for d in r.done
    )
    recving = f" recving {list(r.finished_recving)}" if r.finished_recving else ""
    recving += f" failed {list(r.failed_recving)}" if r.failed_recving else ""
    return [f"{p}done     jobs [{done}]{recving}"]


def _request_finished(r: RequestFinished, p: str, verbose: bool) -> list[str]:
    return [
        f"{p}finished {r.req_id}: {r.status} C={r.num_computed_tokens} N={r.num_tokens} "
        f"hashes={len(r.block_hashes)}"
    ]


def _reset_prefix_cache(r: ResetPrefixCache, p: str, verbose: bool) -> list[str]:
    what = "gpu+connector" if r.reset_connector else "gpu"
    run = " preempting running" if r.reset_running_requests else ""
    return [
        f"{p}reset    {what}{run}: {'ok' if r.success else 'FAILED'}"
        f"{' (connector reset)' if r.connector_reset else ''}"
    ]


_FORMATTERS: dict[type, Callable[[Any, str, bool], list[str]]] = {
    NewRequest: _new_request,
    Lookup: _lookup,
    Alloc: _alloc,
    BuildMeta: _build_meta,
    JobsDone: _jobs_done,
    RequestFinished: _request_finished,
    ResetPrefixCache: _reset_prefix_cache,
}
"""Record type -> ``(record, step prefix, verbose) -> lines``."""


def format_record(r: Record, *, verbose: bool = False) -> list[str]:
    """The lines of one record, each prefixed ``[step] ``."""
    p = f"[{r.step:>3}] "
    formatter = next((_FORMATTERS[c] for c in type(r).__mro__ if c in _FORMATTERS), None)
    return [f"{p}{r!r}"] if formatter is None else formatter(r, p, verbose)


def format_trace(
    trace: Trace, records: Iterable[Record] | None = None, *, verbose: bool = False
) -> str:
    """See :meth:`conformance.protocol.trace.Trace.format`."""
    lines = [f"config: {trace.config.describe()}"]
    if trace.notes:
        lines += [f"note: {n}" for n in trace.notes]
    for r in trace.records if records is None else records:
        lines.extend(format_record(r, verbose=verbose))
    lines.append(f"({len(trace.records)} records, {trace.num_steps} steps)")
    return "\n".join(lines)
