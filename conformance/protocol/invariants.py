"""Properties any correct offloading planner satisfies, checked on one trace's answers.

Each check takes a recorded :class:`~conformance.protocol.trace.Trace` and the answers to
its calls -- vLLM's (:func:`conformance.protocol.replay.recorded_answers`) or a planner's
(:func:`conformance.protocol.replay.replay`) -- and returns human-readable violations
(empty: the property holds).  They compare no two implementations: they state
what *any* implementation must do.

* :func:`promised_hit_violations` (a) -- a prompt prefilled and stored, with nothing
  evicted, failed or reset since, is hit again (after a GPU-only reset) at least up to
  the boundary the rules promise (:func:`promised_end`).
* :func:`load_reads_stored_violations` (b) -- every key a load job reads was written by
  a completed store job and not evicted or reset since.
* :func:`monotonic_hit_violations` (c) -- more stored chunks, or a longer shared
  prefix, never end a hit earlier.
* :func:`injective_key_violations` (d) -- one key names one (group, chunk): no key
  serves two groups or two chunk-end hashes, no chunk is read under two keys.

The data property ``load(store(x)) == x`` is the data lane's
(``conformance/lanes/test_data.py``), not checked here.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field

from conformance.protocol import trace as T
from conformance.protocol.replay import Answer, chunking_of
from reference.geometry import GroupKind
from reference.jobs import LoadJob, StoreJob
from reference.knobs import Chunking
from reference.mathutil import cdiv, round_down
from reference.rules import LastTokenRule, hit_limit, needed_chunks

ABORTED = "finished_aborted"


def promised_end(
    chunking: Chunking, retention: int | None, stored_tokens: int, num_tokens: int,
    computed: int, cap: int | None, state_ends: Collection[int] | None = None,
) -> int:
    """The furthest end a lookup must reach when a prompt of ``stored_tokens`` (a prefix
    of this request's ``num_tokens``) was prefilled and stored, 0 when none is promised.

    Ends are multiples of every group's chunk span (dense retention, or no windowed
    group); under sparse retention (0) windowed groups keep only the window before the
    replay boundary ``stored_tokens - 1`` rounded down to the alignment, the one end
    promised.  An end must lie within :func:`~reference.rules.hit_limit` (intended rule,
    the last token recomputed), be at least one chunk of every group past ``computed``,
    and every chunk its :func:`~reference.rules.needed_chunks` names must be complete
    in the stored prompt.  With Mamba-align groups an end must also be one of
    ``state_ends``, where the engine handed every such group a state to store (the
    planner stores no other state).
    """
    groups = chunking.groups
    windowed = any(gc.window_in_chunks is not None for gc in groups)
    span = math.lcm(*(gc.tokens_per_chunk for gc in groups), chunking.mamba_align_tokens or 1)
    limit = hit_limit(num_tokens, computed, (cap,), windowed, LastTokenRule.REQUEST_END,
                      chunking.mamba_align_tokens)
    if windowed and retention is not None:
        align = chunking.alignment_tokens or span
        boundary = round_down(stored_tokens - 1, align)
        every = math.lcm(span, retention) if retention else None
        ends = [boundary] + (list(range(every, limit + 1, every)) if every else [])
    else:
        ends = list(range(span, limit + 1, span))
    for end in sorted(ends, reverse=True):
        if end <= limit and (state_ends is None or end in state_ends) and all(
            end - computed >= gc.tokens_per_chunk
            and needed_chunks(gc, computed, end).stop <= stored_tokens // gc.tokens_per_chunk
            for gc in groups
        ):
            return end
    return 0


@dataclass(frozen=True)
class _Event:
    """One record with its answer (None for records that answer nothing)."""

    index: int
    record: T.Record
    answer: Answer | None


def _events(trace: T.Trace, answers: Sequence[Answer]) -> Iterator[_Event]:
    """Records in call order, each lookup / alloc / build paired with its answer."""
    it = iter(answers)
    for i, r in enumerate(trace.records):
        answered = isinstance(r, (T.Lookup, T.Alloc, T.BuildMeta))
        yield _Event(i, r, next(it, None) if answered else None)


class _Tier:
    """Keys readable at each point: written by a completed store, not evicted or reset."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.pending: dict[int, StoreJob] = {}
        self.gone: dict[bytes, str] = {}
        self.last_lapse = -1
        """Index of the last record that evicted, refused, failed or reset (promises lapse)."""

    def apply(self, e: _Event) -> None:
        r = e.record
        if isinstance(r, T.BuildMeta):
            for offer in r.store_offers:
                if offer.evicted or offer.accepted is None:
                    self.last_lapse = e.index
                for key in offer.evicted:
                    self.held.discard(key)
                    self.gone[key] = f"evicted at step {r.step}"
            for job_id, job in (e.answer.value if e.answer else ()):
                self.pending[job_id] = job
        elif isinstance(r, T.JobsDone):
            for d in r.done:
                job = self.pending.pop(d.job_id, None)
                keys = job.keys if job is not None else ()
                if not d.success:
                    self.last_lapse = e.index
                if d.success:
                    self.held.update(keys)
                    for key in keys:
                        self.gone.pop(key, None)
        elif isinstance(r, T.ResetPrefixCache) and r.connector_reset:
            self.last_lapse = e.index
            for key in self.held | {k for job in self.pending.values() for k in job.keys}:
                self.gone[key] = f"connector reset at step {r.step}"
            self.held.clear()
            self.pending.clear()


def _load_groups(chunking: Chunking, job: LoadJob) -> list[tuple[int, int, bytes]] | None:
    """``(group index, chunk index, key)`` for each key of a load job, by position
    (each group's chunks are consecutive from ``block_indices // blocks_per_chunk``);
    None when the job lists a different number of keys than its blocks span."""
    out, at = [], 0
    for gc, size, start in zip(chunking.groups, job.group_sizes, job.block_indices, strict=True):
        if not size:
            continue
        bpc = gc.blocks_per_chunk
        for k in range(start // bpc, start // bpc + cdiv(start % bpc + size, bpc)):
            if at < len(job.keys):
                out.append((gc.group.index, k, job.keys[at]))
            at += 1
    return out if at == len(job.keys) else None


def _store_groups(chunking: Chunking, job: StoreJob) -> list[tuple[int, bytes]] | None:
    """``(group index, key)`` for each key of a store job whose groups list whole chunks
    (None otherwise: a job that skips null blocks or stores a boundary state)."""
    counts = []
    for gc, size in zip(chunking.groups, job.group_sizes, strict=True):
        if size % gc.blocks_per_chunk:
            return None
        counts.append((gc.group.index, size // gc.blocks_per_chunk))
    if sum(n for _, n in counts) != len(job.keys):
        return None
    keys = iter(job.keys)
    return [(g, next(keys)) for g, n in counts for _ in range(n)]


def _loads(trace: T.Trace, answers: Sequence[Answer]) -> Iterator[tuple[_Event, _Tier, LoadJob]]:
    """Each load job answered, with the tier as it stood when the job was created."""
    tier = _Tier()
    for e in _events(trace, answers):
        if isinstance(e.record, T.Alloc) and e.answer is not None and e.answer.value:
            yield e, tier, e.answer.value[1]
        tier.apply(e)


def load_reads_stored_violations(trace: T.Trace, answers: Sequence[Answer]) -> list[str]:
    """(b) Every key a load job reads was written by a completed store job and not
    evicted or reset since."""
    out = []
    for e, tier, job in _loads(trace, answers):
        for key in job.keys:
            if key not in tier.held:
                why = ("still being stored" if any(key in j.keys for j in tier.pending.values())
                       else tier.gone.get(key, "never stored"))
                out.append(f"load-reads-stored: [step {e.record.step}] load of "
                           f"{job.req_id} reads {T.short_key(key)}, {why}")
    return out


def injective_key_violations(trace: T.Trace, answers: Sequence[Answer]) -> list[str]:
    """(d) Within a trace a key names one group and one chunk-end hash, and one
    (group, chunk-end hash) is always read under the same key."""
    chunking, out = chunking_of(trace.config), []
    group_of: dict[bytes, int] = {}
    pair_of: dict[bytes, tuple[int, bytes]] = {}
    key_of: dict[tuple[int, bytes], bytes] = {}
    hashes: dict[str, tuple[bytes, ...]] = {}

    def group(key: bytes, g: int, where: str) -> None:
        if group_of.setdefault(key, g) != g:
            out.append(f"injective-keys: {where}: {T.short_key(key)} serves group "
                       f"{g} and group {group_of[key]}")

    for e in _events(trace, answers):
        r, where = e.record, f"[step {e.record.step}]"
        if isinstance(r, T.Lookup):
            hashes[r.req_id] = r.block_hashes
        elif isinstance(r, T.BuildMeta) and e.answer is not None:
            for _, job in e.answer.value:
                for g, key in _store_groups(chunking, job) or ():
                    group(key, g, f"{where} store of {job.req_id}")
        elif isinstance(r, T.Alloc) and e.answer is not None and e.answer.value:
            job = e.answer.value[1]
            placed = _load_groups(chunking, job)
            if placed is None:
                out.append(f"injective-keys: {where} load of {job.req_id} lists "
                           f"{len(job.keys)} keys, not one per chunk its blocks span")
                continue
            for g, k, key in placed:
                group(key, g, f"{where} load of {job.req_id}")
                hpc = chunking.for_index(g).hashes_per_chunk
                h = hashes.get(job.req_id, ())
                end_hash = h[(k + 1) * hpc - 1] if (k + 1) * hpc <= len(h) else b"?"
                pair = (g, end_hash)
                if pair_of.setdefault(key, pair) != pair:
                    out.append(f"injective-keys: {where} {T.short_key(key)} names group {g} "
                               f"chunk-end {end_hash[:4].hex()} and group {pair_of[key][0]} "
                               f"chunk-end {pair_of[key][1][:4].hex()}")
                if key_of.setdefault(pair, key) != key:
                    out.append(f"injective-keys: {where} group {g} chunk {k} read as "
                               f"{T.short_key(key)} and as {T.short_key(key_of[pair])}")
    return out


@dataclass(frozen=True)
class _Lookup:
    """A lookup's answer (not "ask again later") with what it depended on."""

    record: T.Lookup
    hit: int
    held: frozenset[bytes]
    capped: bool
    """A cap (``max_load_tokens``, or a step budget below the request) bounded it."""

    @property
    def end(self) -> int:
        return self.record.computed_tokens + self.hit


@dataclass
class _Request:
    new_index: int
    prompt: tuple[int, ...]
    max_load: bool
    stored: bool = False
    """Finished (not aborted, never preempted), prefilled without a GPU hit, its
    finish handled by a step (its last stores were created)."""
    finished_ok: bool = False
    gpu_hit: bool = False
    preempted: bool = False
    handoffs: set[tuple[int, int]] = field(default_factory=set)
    """``(group index, boundary tokens)`` of the states the engine handed off."""


def _lookups(trace: T.Trace, answers: Sequence[Answer]) -> Iterator[tuple[_Lookup, _Tier, dict[str, _Request]]]:
    """Each answered lookup, with the tier and the requests as they stood then."""
    tier, reqs = _Tier(), dict[str, _Request]()
    for e in _events(trace, answers):
        r = e.record
        if isinstance(r, T.NewRequest):
            max_load = (T.thaw_params(r.kv_transfer_params) or {}).get("max_load_tokens") is not None
            reqs[r.req_id] = _Request(e.index, r.prompt_token_ids, max_load)
        elif isinstance(r, T.Lookup) and e.answer is not None and e.answer.value is not None:
            req, cap = reqs.get(r.req_id), r.max_num_new_tokens
            capped = (req is None or req.max_load
                      or (cap is not None and cap < r.num_tokens - r.computed_tokens))
            if req is not None:
                req.gpu_hit |= r.computed_tokens > 0
            yield _Lookup(r, e.answer.value, frozenset(tier.held), capped), tier, reqs
        elif isinstance(r, T.RequestFinished) and r.req_id in reqs:
            reqs[r.req_id].finished_ok = r.status != ABORTED
        elif isinstance(r, T.BuildMeta):
            for h in r.boundary_handoffs:
                if h.req_id in reqs:
                    reqs[h.req_id].handoffs.add((h.group_index, h.boundary_tokens))
            for req_id in r.preempted_req_ids:
                if req_id in reqs:
                    reqs[req_id].preempted = True
            for req_id in r.finished_req_ids:
                req = reqs.get(req_id)
                if req is not None:
                    req.stored = req.finished_ok and not req.gpu_hit and not req.preempted
        tier.apply(e)


@dataclass(frozen=True)
class Promise:
    """A lookup a stored prompt promised an end to (invariant (a))."""

    lookup: T.Lookup
    end: int
    """Where the lookup's hit ended (GPU hit + offloaded hit)."""
    promised: int
    source: str
    """The request that stored the prompt."""
    stored_tokens: int

    def describe(self, retention: int | None) -> str:
        r = self.lookup
        return (f"promised-hit: [step {r.step}] {r.req_id} ({r.num_tokens} tokens, GPU hit "
                f"{r.computed_tokens}) hit {self.end - r.computed_tokens} tokens, ending at "
                f"{self.end}; {self.source}'s stored {self.stored_tokens}-token prompt promises "
                f"an end at {self.promised} (retention {retention})")


def promises(trace: T.Trace, answers: Sequence[Answer]) -> list[Promise]:
    """Every lookup whose prompt extends a prompt stored earlier (prefilled with no GPU
    hit, finished, all its stores completed, nothing evicted, refused, failed or reset
    since it arrived), with the largest :func:`promised_end` of such a prompt."""
    chunking, out = chunking_of(trace.config), []
    retention = trace.config.prefix_cache_retention_interval
    mamba = [gc.group.index for gc in chunking.groups if gc.group.kind is GroupKind.MAMBA_ALIGN]
    for lk, tier, reqs in _lookups(trace, answers):
        r, req = lk.record, reqs.get(lk.record.req_id)
        if req is None or req.max_load:
            continue
        best: Promise | None = None
        for sid, s in reqs.items():
            if (sid == r.req_id or not s.stored or s.new_index <= tier.last_lapse
                    or not s.prompt or req.prompt[: len(s.prompt)] != s.prompt
                    or any(job.req_id == sid for job in tier.pending.values())):
                continue
            states = ({b for g2, b in s.handoffs if all((g, b) in s.handoffs for g in mamba)}
                      if mamba else None)
            end = promised_end(chunking, retention, len(s.prompt), r.num_tokens,
                               r.computed_tokens, r.max_num_new_tokens, states)
            if end > r.computed_tokens and (best is None or end > best.promised):
                best = Promise(r, lk.end, end, sid, len(s.prompt))
        if best is not None:
            out.append(best)
    return out


def promised_hit_violations(trace: T.Trace, answers: Sequence[Answer]) -> list[str]:
    """(a) Every lookup of :func:`promises` ends at least where it was promised."""
    retention = trace.config.prefix_cache_retention_interval
    return [p.describe(retention) for p in promises(trace, answers) if p.end < p.promised]


def monotonic_hit_violations(trace: T.Trace, answers: Sequence[Answer]) -> list[str]:
    """(c) Of two uncapped lookups with the same GPU hit, the later one -- holding every
    key the earlier held, for a prompt whose block hashes extend the earlier's and no
    shorter -- ends no earlier."""
    seen: list[_Lookup] = []
    out = []
    for lk, _, _ in _lookups(trace, answers):
        if lk.capped:
            continue
        r2 = lk.record
        for prev in seen:
            r1 = prev.record
            if (r1.computed_tokens == r2.computed_tokens and r1.num_tokens <= r2.num_tokens
                    and r2.block_hashes[: len(r1.block_hashes)] == r1.block_hashes
                    and prev.held <= lk.held and lk.end < prev.end):
                more = len(lk.held - prev.held)
                out.append(
                    f"monotonic-hit: [step {r2.step}] {r2.req_id} ({r2.num_tokens} tokens) ends "
                    f"at {lk.end}, before {r1.req_id} ({r1.num_tokens} tokens, step {r1.step}) "
                    f"at {prev.end}, though it holds {more} more keys and extends its prefix"
                )
        seen.append(lk)
    return out


def all_violations(trace: T.Trace, answers: Sequence[Answer]) -> list[str]:
    """Every invariant's violations on one trace's answers."""
    return [
        *promised_hit_violations(trace, answers),
        *load_reads_stored_violations(trace, answers),
        *monotonic_hit_violations(trace, answers),
        *injective_key_violations(trace, answers),
    ]
