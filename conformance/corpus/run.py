"""Replay corpus cases into a backend and compare with the answers vLLM gave (no vLLM).

Each case's records are fed, in order, to a fresh planner built by the backend
(:func:`conformance.protocol.replay.replay`, with the case's own policy switches); its
answers -- hit tokens, load jobs, store jobs -- must equal the recorded ones
(:func:`conformance.protocol.replay.recorded_answers`).

A failure report names the case, the first answer that differs (call, request,
step), both answers, the inputs the backend was given at that call (for a step:
every request's status, token counts, ``shared_prefix_boundary`` and block tables,
the hand-offs, the copies, vLLM's store offers) and the trace up to that step, its
earlier lines cut with an explicit ``... N more lines`` marker.  A backend that
raises is reported as that exception at that call (case, step, call, where it was
raised), with the first answer that had already differed before it, if any: an
exception is often the consequence of an earlier wrong answer.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from conformance.corpus.codec import HOOKS
from conformance.corpus.format import CorpusCase
from conformance.protocol import trace as T
from conformance.protocol.backends import Backend
from conformance.protocol.replay import (
    Answer,
    Divergence,
    ReplayProgress,
    first_divergence,
    recorded_answers,
    replay,
)
from conformance.protocol.trace_format import format_record

TRACE_LINES = 40
"""Trace lines shown before a failure (the last ones up to its step); 0 shows all."""
_TABLE_ENTRIES = 64
"""Block-table entries shown per group before ``... +N``."""


@dataclass(frozen=True)
class CaseResult:
    case: str
    release: str
    answers: int
    """vLLM's recorded answers in the case (the answers compared)."""
    failure: str | None
    matched: int = 0
    """The backend's answers equal to vLLM's before the case's first divergence (or
    before the call that raised); all of them when the case passed."""
    raised: bool = False
    """The backend raised (``failure`` reports the exception)."""


def check_case(case: CorpusCase, backend: Backend, trace_lines: int = TRACE_LINES) -> CaseResult:
    """Replay one case into ``backend``; the failure names the case and the first call that
    differs, or the call that raised.  ``trace_lines``: trace lines shown (0: all)."""
    if backend.planner is None:
        raise ValueError("the corpus replays into a planner: --backend reference or module:object")
    expected = recorded_answers(case.trace)
    where = f"case {case.name!r} (vLLM {case.release})"
    progress = ReplayProgress()
    try:
        actual = replay(case.trace, backend.planner, policy=case.policy, progress=progress)
    except Exception as e:  # a backend's crash is a failed case, reported at its call
        return _raised(case, where, expected, progress, e, trace_lines)
    div = first_divergence(expected, actual)
    if div is None:
        return CaseResult(case.name, case.release, len(expected), None, len(expected))
    step = _step(div)
    lines = [f"{where}: answer #{div.index}, {_call(div)} at step {step} differs",
             *_divergence_lines(case, div)]
    lines += _trace_lines(case.trace, lambda i, r: r.step <= step, f"up to step {step}", trace_lines)
    return CaseResult(case.name, case.release, len(expected), "\n".join(lines), div.index)


def _raised(case: CorpusCase, where: str, expected: list[Answer], progress: ReplayProgress,
            error: Exception, trace_lines: int) -> CaseResult:
    """The report of a backend that raised: the exception at its call, with the first
    answer that already differed before it."""
    got = progress.answers
    index = progress.record_index
    hook = "" if index is None else f" (record #{index}, {_hook(case.trace.records[index])})"
    at = "" if index is None else f" at step {progress.step}"
    lines = [f"{where}: the backend raised {type(error).__name__}: {error}{at}, "
             f"in {progress.call}{hook}"]
    frame = _backend_frame(error)
    if frame:
        lines.append(f"  raised at {frame}")
    div = first_divergence(expected[: len(got)], got)
    if div is None:
        lines.append(f"  the {len(got)} answers before it equal vLLM's")
        matched = len(got)
    else:
        differing = [i for i, (e, a) in enumerate(zip(expected, got, strict=False)) if e != a]
        last = ""
        if len(differing) > 1:
            last = (f"; the last, answer #{differing[-1]}, "
                    f"{got[differing[-1]].call}({got[differing[-1]].req_id}) at step "
                    f"{got[differing[-1]].step}")
        lines.append(f"before it, answer #{div.index}, {_call(div)} at step {_step(div)} "
                     f"already differed ({len(differing)} of the {len(got)} answers before "
                     f"the exception differ{last}):")
        lines += _divergence_lines(case, div)
        matched = div.index
    if index is None:
        return CaseResult(case.name, case.release, len(expected), "\n".join(lines), 0, True)
    lines += _trace_lines(case.trace, lambda i, r: i <= index,
                          f"up to the call that raised (step {progress.step}, marked >>)",
                          trace_lines, mark=index)
    return CaseResult(case.name, case.release, len(expected), "\n".join(lines), matched, True)


def _backend_frame(error: BaseException) -> str:
    """Where the exception was raised: the innermost frame outside the replay itself."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.endswith(("conformance/protocol/replay.py", "conformance/corpus/run.py"))]
    if not frames:
        return ""
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}" + (f": {f.line}" if f.line else "")


def _hook(record: T.Record) -> str:
    return HOOKS.get(type(record), type(record).__name__)


def _step(div: Divergence) -> int:
    first = div.expected or div.actual
    return first.step if first is not None else 0


def _call(div: Divergence) -> str:
    first = div.expected or div.actual
    return f"{first.call}({first.req_id})" if first is not None else "?"


def _divergence_lines(case: CorpusCase, div: Divergence) -> list[str]:
    lines = [
        f"  expected (vLLM): {div.expected.describe() if div.expected else '(no answer)'}",
        f"  backend:         {div.actual.describe() if div.actual else '(no answer)'}",
    ]
    record = _answer_record(case.trace, div.index)
    if record is not None:
        lines += ["the call's inputs:", *("  " + line for line in call_inputs(case, record))]
    return lines


def _answer_record(trace: T.Trace, index: int) -> T.Record | None:
    """The record whose answer is answer #``index`` (:func:`recorded_answers`' order)."""
    answering = [r for r in trace.records if isinstance(r, (T.Lookup, T.Alloc, T.BuildMeta))]
    return answering[index] if index < len(answering) else None


def _ints(xs: Sequence[object]) -> str:
    shown = [str(x) for x in xs[:_TABLE_ENTRIES]]
    if len(xs) > _TABLE_ENTRIES:
        shown.append(f"... +{len(xs) - _TABLE_ENTRIES}")
    return "[" + " ".join(shown) + "]"


def call_inputs(case: CorpusCase, record: T.Record) -> list[str]:
    """What the backend was given at ``record``'s call, in words: the lines a failure
    report prints under "the call's inputs"."""
    trace = case.trace
    p = case.policy
    lines = [
        f"config: {trace.config.describe()}",
        f"policy: retention_interval={p.retention_interval} "
        f"null_blocks_in_store={p.null_blocks_in_store.value} last_token={p.last_token.value} "
        f"window={p.window.value} offload_prompt_only={p.offload_prompt_only} "
        f"reload_after_failed_load={p.reload_after_failed_load}",
    ]
    groups = [g.index for g in trace.config.groups]
    if isinstance(record, T.Lookup):
        cap = record.max_num_new_tokens
        lines.append(
            f"lookup {record.req_id}: num_tokens={record.num_tokens} "
            f"num_prompt_tokens={record.num_prompt_tokens} block_hashes={len(record.block_hashes)} "
            f"computed_tokens={record.computed_tokens} max_num_new_tokens={cap} "
            f"skip_reading_prefix_cache={record.skip_reading_prefix_cache}"
        )
        params = next((r.kv_transfer_params for r in trace.records
                       if isinstance(r, T.NewRequest) and r.req_id == record.req_id), None)
        if params:
            lines.append(f"kv_transfer_params of {record.req_id}: {dict(params)}")
        if record.manager_lookups:
            lines.append("vLLM's manager answered (informative): " + " ".join(
                f"{T.short_key(m.key)}={m.result}" for m in record.manager_lookups))
    elif isinstance(record, T.Alloc):
        lines.append(f"allocated {record.req_id}: num_external_tokens={record.num_external_tokens}; "
                     "blocks per group (0 = null block, h = has_block_hash):")
        for g, table in zip(groups, record.blocks, strict=False):
            shown = [f"{b.block_id}h" if b.has_block_hash else str(b.block_id) for b in table]
            lines.append(f"  g{g} {_ints(shown)}")
    elif isinstance(record, T.BuildMeta):
        lines += _step_inputs(trace, record, groups)
    return lines


def _tables_before(trace: T.Trace, meta: T.BuildMeta) -> tuple[dict[str, list[list[int]]], set[int]]:
    """Every request's block tables as handed to the connector before ``meta`` (new_block_ids
    accumulated, cleared by a lookup or a full table), and the block ids allocated since the
    previous step (by ``update_state_after_alloc``)."""
    tables: dict[str, list[list[int]]] = {}
    allocated: set[int] = set()
    for r in trace.records:
        if r is meta:
            break
        if isinstance(r, T.Lookup):
            tables.pop(r.req_id, None)
        elif isinstance(r, T.Alloc):
            allocated.update(b.block_id for g in r.blocks for b in g if not b.is_null)
        elif isinstance(r, T.BuildMeta):
            _extend(tables, r)
            allocated = set()
    return tables, allocated


def _extend(tables: dict[str, list[list[int]]], meta: T.BuildMeta) -> None:
    """Apply one step's ``new_block_ids`` to the tables, as the connector does."""
    for s in meta.scheduled:
        if not s.scheduled:
            continue
        if s.is_full_table:
            tables[s.req_id] = []
        if s.new_block_ids:
            table = tables.setdefault(s.req_id, [])
            if not table:
                table.extend([] for _ in s.new_block_ids)
            for ids, new in zip(table, s.new_block_ids, strict=True):
                ids.extend(new)


def _step_inputs(trace: T.Trace, meta: T.BuildMeta, groups: list[int]) -> list[str]:
    tables, allocated = _tables_before(trace, meta)
    offloaded = [g.offloaded for g in trace.config.groups]
    for s in meta.scheduled:
        for is_offloaded, ids in zip(offloaded, s.new_block_ids or (), strict=False):
            allocated.update(b for b in ids if b and is_offloaded)
    allocated.update(meta.block_copy_dst_ids)
    before = {req: [len(ids) for ids in table] for req, table in tables.items()}
    _extend(tables, meta)
    lines = []
    for s in meta.scheduled:
        role = "scheduled" if s.scheduled else "finished"
        lines.append(
            f"{role} {s.req_id}: status={s.status} num_computed_tokens={s.num_computed_tokens} "
            f"num_scheduled_tokens={s.num_scheduled_tokens} num_tokens={s.num_tokens} "
            f"num_prompt_tokens={s.num_prompt_tokens} block_hashes={len(s.block_hashes)} "
            f"shared_prefix_boundary={s.shared_prefix_boundary or 0} "
            f"is_full_table={s.is_full_table} is_finished={s.is_finished}"
        )
        shown = "None" if s.new_block_ids is None else " ".join(
            f"g{g}{_ints(b)}" for g, b in zip(groups, s.new_block_ids, strict=False))
        lines.append(f"  new_block_ids: {shown}")
        table = tables.get(s.req_id)
        if table:
            old = before.get(s.req_id) if not s.is_full_table else None
            lines.append("  block table with this step's new_block_ids (0 = null block; "
                         "* = an earlier entry whose block id is allocated again this step)")
            for n, (g, entries) in enumerate(zip(groups, table, strict=False)):
                end = old[n] if old else 0
                lines.append(f"    g{g} " + _ints([
                    f"{b}*" if b and b in allocated and j < end else str(b)
                    for j, b in enumerate(entries)]))
    lines.append(f"block_copy_dst_ids: {list(meta.block_copy_dst_ids)}")
    handoffs = " ".join(f"{h.req_id}:(group {h.group_index}, block {h.block_id}, "
                        f"boundary {h.boundary_tokens})" for h in meta.boundary_handoffs)
    lines.append(f"boundary_handoffs: {handoffs or 'none'}")
    for o in meta.store_offers:
        accepted = "refused" if o.accepted is None else " ".join(T.short_key(k) for k in o.accepted)
        evicted = " ".join(T.short_key(k) for k in o.evicted)
        lines.append(f"vLLM offered {o.req_id}: {' '.join(T.short_key(k) for k in o.offered)} "
                     f"-> accepted {accepted}" + (f", evicted {evicted}" if evicted else ""))
    return lines


def _trace_lines(trace: T.Trace, keep: Callable[[int, T.Record], bool], what: str, limit: int,
                 mark: int | None = None) -> list[str]:
    """The trace's lines for the records ``keep(index, record)`` selects, the last ``limit``
    of them (0: all) after a ``... N more lines`` marker; the record ``mark`` is flagged."""
    shown: list[str] = []
    for i, r in enumerate(trace.records):
        if keep(i, r):
            shown += [(">> " if i == mark else "   ") + line for line in format_record(r)]
    lines = [f"trace {what}:"]
    if limit and len(shown) > limit:
        cut = len(shown) - limit
        lines.append(f"  ... {cut} more lines (earlier records; --trace-lines 0 prints them all)")
        shown = shown[cut:]
    return lines + ["  " + line for line in shown]
