"""Which rules of ``docs/semantics.md`` section 8 a corpus case reaches.

A case *covers* a rule when its recorded answers contain the situation the rule
decides (:data:`SITUATIONS`: one predicate per rule, on the trace alone).  This
is evidence that the case exercises the rule, not a proof that a wrong rule
would change an answer; the plan lane's mutation score measures that.  The
generator stores each case's ``covers``; ``tests/test_corpus.py`` recomputes
them and checks that every rule of section 8 has a case.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from conformance.protocol import trace as T
from conformance.protocol.replay import chunking_of
from reference.geometry import GroupKind

SEMANTICS = Path(__file__).resolve().parents[2] / "docs" / "semantics.md"


ENGINE_RULES: dict[str, str] = {
    "GPU hit": "the economics engine's model of the GPU prefix cache; a trace records the GPU "
               "hit vLLM's own KV cache manager found, and the reference replays it",
    "pinned junction": "the economics engine's choice of shared_prefix_boundary; a trace "
                       "records the boundary vLLM set, and the reference replays it",
}
"""Section 8 rules the Planner never decides from a trace (the economics engine's own
choices), so no corpus situation can show them; rule -> why.  Their evidence is their
direct tests, their mutants and the tiered economics lane."""


def section8_rules(path: Path = SEMANTICS) -> list[str]:
    """The rule names of section 8's table (its first column), in order, but for
    :data:`ENGINE_RULES` (each must still be a row: a stale exemption is an error)."""
    text = path.read_text()
    start = text.index("## 8.")
    end = text.index("\n## ", start + 1)
    rules = []
    for line in text[start:end].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] not in ("rule", "") and not re.fullmatch(r"-+", cells[0]):
            rules.append(cells[0])
    stale = sorted(set(ENGINE_RULES) - set(rules))
    if stale:
        raise ValueError(f"ENGINE_RULES names rules section 8 lacks: {stale}")
    return [r for r in rules if r not in ENGINE_RULES]


@dataclass(frozen=True)
class _Job:
    step: int
    req_id: str
    job_id: int
    group_sizes: tuple[int, ...]
    block_ids: tuple[int, ...]
    block_indices: tuple[int, ...]
    keys: tuple[bytes, ...]


def _groups(trace: T.Trace) -> tuple[T.TraceGroup, ...]:
    return trace.config.offloaded_groups


def _stores(trace: T.Trace) -> Iterator[_Job]:
    for m in trace.of_type(T.BuildMeta):
        for s in m.store_jobs:
            j = s.job
            yield _Job(m.step, j.req_id, s.job_id, j.group_sizes, j.block_ids, j.block_indices,
                       j.keys)


def _loads(trace: T.Trace) -> Iterator[_Job]:
    for a in trace.of_type(T.Alloc):
        if a.load is not None:
            j = a.load.job
            yield _Job(a.step, j.req_id, a.load.job_id, j.group_sizes, j.block_ids,
                       j.block_indices, j.keys)


def _kinds_with_blocks(trace: T.Trace, job: _Job) -> list[T.TraceGroup]:
    return [g for g, n in zip(_groups(trace), job.group_sizes, strict=True) if n > 0]


def _windowed(g: T.TraceGroup) -> bool:
    return g.kind not in (GroupKind.FULL, None)


def _sw(g: T.TraceGroup) -> bool:
    return g.kind is GroupKind.SLIDING_WINDOW


def _has_windowed(trace: T.Trace) -> bool:
    return any(_windowed(g) for g in _groups(trace))


def _has_full(trace: T.Trace) -> bool:
    return any(g.kind is GroupKind.FULL for g in _groups(trace))


def _hits(trace: T.Trace) -> list[T.Lookup]:
    return [lk for lk in trace.of_type(T.Lookup) if lk.hit_tokens]


def _store_in_sw(trace: T.Trace) -> bool:
    return any(_sw(g) for j in _stores(trace) for g in _kinds_with_blocks(trace, j))


def _finished_store(trace: T.Trace) -> bool:
    """A store job built for a request in the step it finished (or was aborted)."""
    for m in trace.of_type(T.BuildMeta):
        finished = {s.req_id for s in m.scheduled if not s.scheduled}
        if any(s.job.req_id in finished for s in m.store_jobs):
            return True
    return False


def _decode_store(trace: T.Trace) -> bool:
    """A store job for a request that had decoded past its prompt (the prompt cap decides)."""
    for m in trace.of_type(T.BuildMeta):
        decoding = {s.req_id for s in m.scheduled if s.num_tokens > s.num_prompt_tokens}
        if any(s.job.req_id in decoding for s in m.store_jobs):
            return True
    return False


def _dense_sw_store(trace: T.Trace) -> bool:
    return trace.config.prefix_cache_retention_interval is None and _store_in_sw(trace)


def _reconsidered(trace: T.Trace) -> bool:
    """Where a finished request's last segment is reconsidered (``reconsider_from`` returns a
    chunk: ``final_tail_blocks`` sets it, ``offered_under_prompt_horizon`` filters what it
    re-offers): dense retention, decode tokens offloaded, a non-EAGLE sliding-window group
    whose alignment segment is whole blocks, and a request that finishes with that group's
    storable chunks past its prompt's (off its prompt horizon).  Under sparse or periodic
    retention, for an EAGLE group (no tail) or a request finishing on its prompt horizon
    nothing is reconsidered, whatever those rules say."""
    config = trace.config
    prompt_only = bool(dict(config.extra_config).get("offload_prompt_only", True))
    if config.prefix_cache_retention_interval is not None or prompt_only:
        return False
    chunking = chunking_of(config)
    alignment = chunking.alignment_tokens
    tails = [gc.tokens_per_chunk for gc in chunking.groups
             if gc.group.kind is GroupKind.SLIDING_WINDOW and not gc.group.is_eagle
             and alignment is not None and alignment % gc.group.tokens_per_block == 0]
    for m in trace.of_type(T.BuildMeta):
        for s in m.scheduled:
            if s.scheduled:
                continue  # only a finished request (in finished_req_ids alone) reconsiders
            computed = min(s.num_computed_tokens, max(s.num_prompt_tokens, s.num_tokens - 1))
            if any(computed // tpc != s.num_prompt_tokens // tpc for tpc in tails):
                return True
    return False


def _null_in_sw_store(trace: T.Trace) -> bool:
    """A stored sliding-window chunk with a null (freed) block: kept as a placeholder
    (block id 0) or left out (fewer blocks than the chunks span)."""
    for j in _stores(trace):
        pos = 0
        keys_per_group = _keys_per_group(trace, j)
        for g, n, k in zip(_groups(trace), j.group_sizes, keys_per_group, strict=True):
            ids = j.block_ids[pos:pos + n]
            pos += n
            if _sw(g) and n and (0 in ids or n < k * _bpc(trace)):
                return True
    return False


def _bpc(trace: T.Trace) -> int:
    return trace.config.blocks_per_chunk


def _keys_per_group(trace: T.Trace, job: _Job) -> list[int]:
    """Keys of the job per offloaded group (a key ends in its group index, uint32-be)."""
    groups = [int.from_bytes(k[-4:], "big") for k in job.keys]
    return [groups.count(g.index) for g in _groups(trace)]


def _eagle_load(trace: T.Trace) -> bool:
    return any(g.is_eagle for j in _loads(trace) for g in _kinds_with_blocks(trace, j))


def _windowed_load(trace: T.Trace) -> bool:
    return any(_windowed(g) for j in _loads(trace) for g in _kinds_with_blocks(trace, j))


def _kept_blocks(trace: T.Trace) -> bool:
    """A load into a windowed group starting past the group's first block (earlier
    entries of the table are null blocks the window does not keep)."""
    for j in _loads(trace):
        for g, n, idx in zip(_groups(trace), j.group_sizes, j.block_indices, strict=True):
            if _windowed(g) and n and idx > 0:
                return True
    return False


def _minimum(trace: T.Trace) -> bool:
    """A lookup that found some chunk held yet answered no hit."""
    return any(lk.hit_tokens == 0 and any(m.result == "hit" for m in lk.manager_lookups)
               for lk in trace.of_type(T.Lookup))


def _aligned(trace: T.Trace) -> bool:
    """A hit for a request with ``max_load_tokens``."""
    capped = {r.req_id for r in trace.of_type(T.NewRequest)
              if dict(r.kv_transfer_params or ()).get("max_load_tokens") is not None}
    return any(lk.req_id in capped for lk in _hits(trace))


def _junction(trace: T.Trace) -> bool:
    """A pinned shared-prefix junction the stores keep, with windowed groups, not dense."""
    if trace.config.prefix_cache_retention_interval is None or not _has_windowed(trace):
        return False
    return any((s.shared_prefix_boundary or 0) > 0
               for m in trace.of_type(T.BuildMeta) for s in m.scheduled)


Situation = tuple[str, Callable[[T.Trace], bool]]

_RECONSIDERED = ("dense retention, decode tokens offloaded, a request finishing off its prompt "
                 "horizon, a non-EAGLE sliding-window group")

SITUATIONS: dict[str, Situation] = {
    "window": ("a load reads a windowed group's chunks", _windowed_load),
    "window before a boundary": ("a store writes a sliding-window group's blocks", _store_in_sw),
    "EAGLE": ("a load reads an EAGLE group's chunks", _eagle_load),
    "computed after a step": ("a store in the step its request finished or was aborted",
                              _finished_store),
    "offloadable": ("a store for a request decoding past its prompt", _decode_store),
    "storable count": ("any store job", lambda t: any(True for _ in _stores(t))),
    "store horizon": ("dense retention, a sliding-window store", _dense_sw_store),
    "re-offer": (_RECONSIDERED, _reconsidered),
    "final tail": (_RECONSIDERED, _reconsidered),
    "reachability": ("a store writes a sliding-window group's blocks", _store_in_sw),
    "acceptance": ("a stored sliding-window chunk with a null block", _null_in_sw_store),
    "storable chunks": ("any store job", lambda t: any(True for _ in _stores(t))),
    "offered before": (_RECONSIDERED, _reconsidered),
    "last token": ("a hit with a windowed group", lambda t: _has_windowed(t) and bool(_hits(t))),
    "needed chunks": ("a hit", lambda t: bool(_hits(t))),
    "loaded chunks": ("a load job", lambda t: any(True for _ in _loads(t))),
    "group holds": ("a hit", lambda t: bool(_hits(t))),
    "minimum": ("a lookup that found a chunk held yet answered no hit", _minimum),
    "alignment": ("a hit for a request with max_load_tokens", _aligned),
    "hit": ("a hit", lambda t: bool(_hits(t))),
    "deferral": ("a lookup answering 'ask again later' (None)",
                 lambda t: any(lk.hit_tokens is None for lk in t.of_type(T.Lookup))),
    "kept blocks": ("a load into a windowed group past its first block", _kept_blocks),
    "full-attention end": ("a hit with full and windowed groups",
                           lambda t: _has_full(t) and _has_windowed(t) and bool(_hits(t))),
    "junction": ("a pinned shared-prefix junction, windowed groups, sparse or periodic "
                 "retention", _junction),
}
"""Rule (section 8's name) -> (the situation in words, its predicate on a trace)."""


def covers(trace: T.Trace) -> tuple[str, ...]:
    """The rules whose situation the trace contains, in section 8's order."""
    return tuple(rule for rule, (_, reached) in SITUATIONS.items() if reached(trace))


def coverage_markdown() -> str:
    """The README's case list and coverage map, from the committed files."""
    from conformance.corpus.format import DATA_DIR, read_corpus  # it does not import this module

    by_release = {p.stem.removeprefix("vllm-"): read_corpus(p)
                  for p in sorted(DATA_DIR.glob("vllm-*.jsonl"))}
    names = [c.name for c in next(iter(by_release.values()), [])]
    lines = ["| # | case | what it exercises |", "|---|---|---|"]
    descriptions = {c.name: c.description for cases in by_release.values() for c in cases}
    lines += [f"| {i} | `{n}` | {descriptions[n]} |" for i, n in enumerate(names, 1)]
    releases = list(by_release)
    lines += ["", f"| rule | situation a case must contain | cases ({', '.join(releases)}) |",
              "|---|---|---|"]
    for rule in section8_rules():
        per = [",".join(str(names.index(c.name) + 1) for c in by_release[r] if rule in c.covers)
               for r in releases]
        cells = per[0] if len(set(per)) == 1 else " / ".join(f"{r}: {p or '-'}" for r, p in zip(releases, per, strict=True))
        situation = SITUATIONS[rule][0] if rule in SITUATIONS else "(no predicate)"
        lines.append(f"| {rule} | {situation} | {cells or '-'} |")
    return "\n".join(lines) + "\n"
