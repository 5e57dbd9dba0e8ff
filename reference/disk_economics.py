"""A disk tier within a byte budget, and the hit rate a disk of a given size gives.

The index (:class:`BudgetedIndex`)
    The disk tier's index the :class:`~reference.plan.Planner` talks to
    (``reference.plan.ChunkIndex``): files of a :class:`~reference.eviction.Layout` on a
    :class:`~reference.eviction.Disk`, within a byte budget, evicted by an
    :class:`~reference.eviction.EvictionRule` (the rule of :mod:`reference.eviction`, or
    plain per-file LRU) when a store would not fit.

The hit rate (:func:`miss_ratio_curve`, :func:`disk_economics`)
    A workload (:func:`scaled`: sessions over time, GPU cache cold unless ``gpu_cache``
    says otherwise) served through the
    reference's :class:`~reference.economics.Engine` over such an index: tokens served
    from the disk, files read, written and evicted, tokens recomputed for lack of space,
    stranded bytes at the end (:class:`DiskEconomics`), at one disk size or a curve of
    them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from reference.curves import SNAPSHOTS, curve_from_snapshots
from reference.economics import MILLION, _Engine, hashed
from reference.eviction import Disk, EvictionRule, Layout, Overflow, prefix_closed_head
from reference.keys import split_key
from reference.knobs import Chunking
from reference.packed import store_job_files
from reference.packed_split import LoadSplit, load_counts, load_slices
from reference.plan import Planner, Policy
from reference.prefix_structure import PrefixStructure
from reference.rules import WindowRule
from reference.store import LookupResult, StorePlan
from reference.workload import GpuCache, Workload, requests

__all__ = [
    "SNAPSHOTS",
    "BudgetedIndex",
    "DiskEconomics",
    "disk_economics",
    "miss_ratio_curve",
    "scaled",
]


# ---------------------------------------------------------------------------
# The index the Planner talks to
# ---------------------------------------------------------------------------


class BudgetedIndex:
    """A disk tier's index within ``budget_bytes`` (``reference.plan.ChunkIndex``).

    ``key_bytes``: bytes per key, per group index (or one size).  A file's size is the
    sum of its keys'.  A store reserves its bytes when prepared (pending files count and
    are never evicted), evicting by ``rule`` first; when it still does not fit it is
    refused (None: the Planner retries next step), changing nothing.  A lookup hit and
    a load refresh their files' use time; files being loaded are not evicted.
    Call :meth:`observe` with each request's block hashes before its lookup, and
    :meth:`idle` whenever no store is pending (the curve does after each request).
    """

    def __init__(
        self,
        chunking: Chunking,
        key_bytes: Mapping[int, int] | int,
        budget_bytes: int,
        rule: EvictionRule = EvictionRule.REACHABLE,
        layout: Layout = Layout.PACKED,
        window_rule: WindowRule = WindowRule.TOKENS_BEFORE_END,
        *,
        admission: bool | None = None,
        overflow: Overflow = Overflow.REFUSE,
        window_siblings: bool = False,
        windows_apart: bool = True,
        load_split: LoadSplit | None = None,
    ) -> None:
        """``admission``: leave out the keys that would arrive stranded (None: under the
        rule only, as the rule states); ``overflow``: what a store that does not fit after
        eviction gets (:class:`~reference.eviction.Overflow`); ``window_siblings``:
        :meth:`Disk.arrives_stranded`'s option (admission judges a pending boundary by its
        window keys too); ``windows_apart``: the packed layout writes a store's window
        keys to a file of their own, its full-attention keys to another
        (:func:`reference.packed.store_job_files`: the tier's layout, the default); False:
        one file per store job, the layout before issue #31 (an ablation of
        ``scripts/disk_ablation.py``; ``docs/semantics.md`` §10); ``load_split``: how the
        tier splits a load job across its pool (:func:`reference.packed_split.load_slices`:
        :attr:`files_read` counts one open per file per slice; None: one per file per job)."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be an int >= 0, got {budget_bytes!r}")
        self.key_bytes = (
            {gc.group.index: key_bytes for gc in chunking.groups}
            if isinstance(key_bytes, int) else dict(key_bytes)
        )
        missing = [gc.group.index for gc in chunking.groups if gc.group.index not in self.key_bytes]
        if missing:
            raise ValueError(f"key_bytes has no size for group(s) {missing}; give one per group index")
        self.budget = budget_bytes
        self.rule = rule
        self.layout = layout
        self.admission = rule is EvictionRule.REACHABLE if admission is None else admission
        self.overflow = overflow
        self.window_siblings = window_siblings
        self.windows_apart = windows_apart
        self.structure = PrefixStructure(chunking, window_rule)
        self.disk = Disk(self.structure)
        self.files_written = 0
        self.bytes_written = 0
        """Bytes of the files written (their size when the store completed)."""
        self.files_evicted = 0
        self.files_read = 0
        """File opens by loads: per load job, each file it reads (per slice of a split job)."""
        self.load_split = load_split
        self._position: dict[bytes, int] = {}
        """Each stored key's section position in its file (as written)."""
        self.stores_refused = 0
        """Stores refused whole (nothing evictable made room)."""
        self.keys_dropped = 0
        """Keys left out of a store because they would arrive stranded (admission)."""
        self.stores_cut = 0
        """Stores that did not fit, of which a head was admitted (:attr:`Overflow.HEAD`)."""
        self.keys_cut = 0
        """Keys left out of those stores (beyond the head)."""
        self._since_idle: dict[bytes, None] = {}
        """Keys stored since :meth:`idle` last ran (and those it had to leave in files being
        read): the only keys that can be stranded then (see :meth:`idle`)."""

    def observe(self, block_hashes: Sequence[bytes]) -> None:
        self.structure.observe(block_hashes)

    def _size(self, keys: Iterable[bytes]) -> int:
        return sum(self.key_bytes[split_key(k)[1]] for k in keys)

    # -- ChunkIndex -----------------------------------------------------------

    def lookup(self, key: bytes) -> LookupResult:
        fid = self.disk.file_of.get(key)
        if fid is None:
            return LookupResult.MISS
        f = self.disk.files[fid]
        if not f.ready:
            return LookupResult.HIT_PENDING
        self.disk.touch(fid)
        return LookupResult.HIT

    def prepare_store(self, keys: Sequence[bytes]) -> StorePlan | None:
        """Room for the offered keys not on disk, evicting by the rule first; None (and
        nothing changed) when they do not fit.  Under the rule, keys that would be
        stranded on arrival are left out of the plan; a window key whose boundary is one
        store away is admitted (:meth:`Disk.arrives_stranded` ``pending_windows``: the
        Planner's chunked prefill stores a boundary's window chunks first)."""
        new = list(dict.fromkeys(k for k in keys if k not in self.disk.file_of))
        unknown = [k for k in new if self.structure.is_full(k) and k not in self.structure.parent]
        if unknown:
            raise ValueError(
                f"prepare_store: key {unknown[0].hex()} has no recorded prefix; call "
                "observe(block_hashes) with the request's block hashes first"
            )
        if self.admission and new:
            bad = (self.disk.arrives_stranded(new, pending_windows=True, window_siblings=True)
                   if self.window_siblings else
                   self.disk.arrives_stranded(new, pending_windows=True))
            self.keys_dropped += len(bad)
            new = [k for k in new if k not in bad]
        if not new:
            return StorePlan((), (), ())
        added = self._add(new)  # pending: protected
        evicted = self.disk.evict_for(0, self.budget, self.rule)
        if evicted is None:
            for fid in added:
                self.disk.remove(fid)
            head = self._head(new) if self.overflow is Overflow.HEAD else ()
            if not head:
                self.stores_refused += 1
                return None
            self.stores_cut += 1
            self.keys_cut += len(new) - len(head)
            new = list(head)
            self._add(new)
            evicted = self.disk.evict_for(0, self.budget, self.rule)
            assert evicted is not None, "a head that fits was refused"
        self.files_evicted += len(evicted)
        self._since_idle.update(dict.fromkeys(new))
        victims = tuple(k for _, ks in evicted for k in ks)
        return StorePlan(tuple(new), tuple(range(len(new))), victims)

    def _files(self, keys: Sequence[bytes]) -> list[Sequence[bytes]]:
        """The files a store of ``keys`` writes (its layout: packed, one or two files per
        store, :func:`~reference.packed.store_job_files`)."""
        if self.layout is Layout.PER_CHUNK:
            return [[k] for k in keys]
        if not self.windows_apart:
            return [keys]
        return list(store_job_files(keys, self.structure.full_groups))

    def _add(self, keys: Sequence[bytes]) -> list[int]:
        """Pending files for ``keys`` (never evicted until their store completes)."""
        files = self._files(keys)
        for f in files:  # a section's place in its file, kept when other keys leave it
            self._position.update((k, i) for i, k in enumerate(f))
        return [self.disk.add(f, self._size(f)) for f in files]

    def _head(self, keys: Sequence[bytes]) -> tuple[bytes, ...]:
        """:func:`~reference.eviction.prefix_closed_head` of a store that does not fit: the
        deepest head that fits once the rule has evicted what it may with that head pending
        (:meth:`Disk.freeable`, each head probed as the eviction that follows runs it: what
        the rule may evict depends on what is pending, and a head's last boundary can need a
        window file that the whole store's later boundaries do not)."""
        def fits(head: tuple[bytes, ...]) -> bool:
            probe = self._add(head)
            over = self.disk.bytes - self.budget
            ok = over <= 0 or self.disk.freeable(over, self.rule) >= over
            for fid in probe:
                self.disk.remove(fid)
            return ok

        return prefix_closed_head(self.disk, keys, fits)

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        """The store's files are written (their use time now, in the layout's file order:
        a packed job's full-attention file, then its window file, as the tier completes
        them) or failed."""
        fids = dict.fromkeys(self.disk.file_of[k] for f in self._files(keys) for k in f
                             if k in self.disk.file_of)
        for fid in fids:
            f = self.disk.files[fid]
            if f.ready:
                continue
            if success:
                f.ready = True
                self.files_written += 1
                self.bytes_written += f.nbytes
                self.disk.touch(fid)
            else:
                self.disk.remove(fid)
        if not success and self.rule is EvictionRule.REACHABLE:
            self._drop_stranded()

    def _drop_stranded(self) -> None:
        """After a failed store, the files it strands go too (a failed store leaves no
        trace; files being read stay until their load completes)."""
        while True:
            stranded = self.disk.stranded()
            fids = {self.disk.file_of[k] for k in stranded}
            fids = {fid for fid in fids if not self.disk.files[fid].pins}
            if not fids:
                return
            for fid in fids:
                self.disk.remove(fid)
                self.files_evicted += 1

    def idle(self) -> None:
        """No store is pending (the engine is idle, every request's stores done): under the
        rule, every key no lookup can load leaves (:meth:`Disk.stranded`: window keys
        admitted pending a boundary whose store never came, a refused one or a later
        turn's), so an idle disk strands nothing.  Files being read keep theirs.

        Only the keys stored since the last call are judged
        (:meth:`~reference.eviction.Disk.stranded_among`; a tier judges a finished
        request's keys alike): under the rule no other key can become stranded (admission
        keeps a key out unless its boundary is whole or one store away, a unit takes the
        window keys its removal strands, a failed store drops what it strands), and the
        curves' tests check that the whole disk's :meth:`~reference.eviction.Disk.stranded`
        is empty at every size."""
        if self.rule is EvictionRule.REACHABLE and self.admission:
            kept = self._drop_keys(self.disk.stranded_among(self._since_idle))
            self._since_idle = dict.fromkeys(kept)
        else:
            self._since_idle.clear()

    def _drop_keys(self, stranded: Iterable[bytes]) -> list[bytes]:
        """Drop ``stranded`` keys (a file left with none goes); the keys kept because
        their file is being written or read."""
        by_file: dict[int, list[bytes]] = {}
        for k in stranded:
            by_file.setdefault(self.disk.file_of[k], []).append(k)
        kept: list[bytes] = []
        for fid, keys in by_file.items():
            f = self.disk.files[fid]
            if not f.ready or f.pins:
                kept += keys
                continue
            if len(keys) == len(f.keys):
                self.disk.remove(fid)
                self.files_evicted += 1
            else:
                self.disk.keep_keys(fid, [k for k in f.keys if k not in keys])
        return kept

    def prepare_load(self, keys: Sequence[bytes]) -> object:
        fids = dict.fromkeys(self.disk.file_of[k] for k in keys)
        for fid in fids:
            f = self.disk.files[fid]
            if not f.ready:
                raise ValueError(f"prepare_load: a key of file {fid} is still being stored")
            f.pins += 1
            self.disk.touch(fid)
        self.files_read += self._opens(keys) if self.load_split is not None else len(fids)
        return None

    def _opens(self, keys: Sequence[bytes]) -> int:
        """The file opens of a load job of ``keys`` split by :attr:`load_split`."""
        wanted = [(self.disk.file_of[k], self._position[k], self.key_bytes[split_key(k)[1]])
                  for k in dict.fromkeys(keys)]
        return load_counts(load_slices(wanted, self.load_split))[0]

    def complete_load(self, keys: Sequence[bytes]) -> None:
        for fid in dict.fromkeys(self.disk.file_of[k] for k in keys):
            self.disk.files[fid].pins -= 1

    def reset(self) -> None:
        self.disk = Disk(self.structure)
        self._since_idle.clear()

    # -- what an operator reads ---------------------------------------------------

    def stranded_bytes(self) -> int:
        return self.disk.stranded_bytes(self.key_bytes)


# ---------------------------------------------------------------------------
# What hit rate from a disk of this size
# ---------------------------------------------------------------------------


def scaled(workload: Workload, prompt_tokens: int = MILLION,
           gpu_cache: GpuCache = GpuCache.COLD) -> Workload:
    """``workload`` with GPU cache ``gpu_cache`` (cold: every reused token must come from
    the disk) and as many sessions as give about ``prompt_tokens`` prompt tokens:
    sessions over time, turn by turn round-robin, so a session's next turn comes back
    after every other session's (its reuse distance grows with the sessions).  The
    curves take the GPU cache as their own ``gpu_cache`` parameter: pass
    ``gpu_cache=scaled_workload.gpu_cache``."""
    per_session = sum(len(r.prompt) for r in requests(workload)) / workload.sessions
    sessions = max(1, round(prompt_tokens / per_session))
    gpu = "cold GPU" if gpu_cache is GpuCache.COLD else f"GPU cache {gpu_cache.value}"
    return replace(
        workload, name=f"{workload.name} ({sessions} sessions, {gpu})", sessions=sessions,
        gpu_cache=gpu_cache,
    )


@dataclass(frozen=True)
class DiskEconomics:
    """One workload served over a disk of ``budget_bytes`` (totals; per million prompt
    tokens with :meth:`per_million`)."""

    workload: str
    rule: EvictionRule
    layout: Layout
    budget_bytes: int | None
    """None: unbounded (the chunk-granularity baseline)."""
    prompt_tokens: int
    offload_hit_tokens: int
    """Tokens served from the disk."""
    files_read: int
    files_written: int
    files_evicted: int
    recomputed_for_space_tokens: int
    """Tokens the unbounded disk served that this one did not (chunk granularity, what
    the unbounded disk also recomputes, is not counted)."""
    stranded_bytes: int
    """Bytes on disk at the end that no lookup can load."""
    bytes_on_disk: int
    """Bytes on disk at the end."""
    stores_refused: int = 0
    """Stores refused whole: nothing evictable made room (the Planner offers again)."""
    keys_dropped: int = 0
    """Keys left out of stores because they would arrive stranded (admission)."""
    stores_cut: int = 0
    """Stores that did not fit, of which a prefix-closed head was admitted
    (:attr:`~reference.eviction.Overflow.HEAD`)."""
    keys_cut: int = 0
    """Keys left out of those stores, beyond the head."""

    def per_million(self, count: int) -> float:
        return count * MILLION / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the disk, as a fraction of all prompt tokens."""
        return self.offload_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _start(
    chunking: Chunking, policy: Policy, max_num_batched_tokens: int, index: BudgetedIndex,
    gpu_cache: GpuCache = GpuCache.COLD,
) -> _Engine:
    """An engine over ``index`` whose GPU prefix cache is as ``gpu_cache`` says."""
    engine = _Engine(chunking, policy, max_num_batched_tokens)
    engine.index = index
    engine.planner = Planner(chunking, index, policy)
    engine.gpu_cache = gpu_cache
    return engine




def miss_ratio_curve(
    chunking: Chunking,
    workload: Workload,
    sizes: Sequence[int] | int,
    rule: EvictionRule = EvictionRule.REACHABLE,
    key_bytes: Mapping[int, int] | int = 1,
    layout: Layout = Layout.PACKED,
    policy: Policy = Policy(),  # noqa: B008  (a frozen dataclass)
    *,
    admission: bool | None = None,
    overflow: Overflow = Overflow.REFUSE,
    window_siblings: bool = False,
    windows_apart: bool = True,
    load_split: LoadSplit | None = None,
    gpu_cache: GpuCache = GpuCache.COLD,
) -> tuple[DiskEconomics, ...]:
    """:func:`disk_economics` at each of ``sizes`` (bytes; an int ``n``: ``n`` sizes evenly
    spaced up to the unbounded run's peak bytes, ``peak * k // n`` for ``k`` = 1..n, the
    last one the unbounded run itself).  The workload is hashed once
    and served once over an unbounded disk (the baseline for tokens recomputed for lack
    of space).  A disk of ``size`` bytes behaves exactly as the unbounded one until a
    store would take it past ``size`` (nothing is evicted nor refused before), so:

    * a size at least that run's peak bytes is that run;
    * a smaller size continues from the latest state of the unbounded run, taken before a
      request, whose peak bytes are at most ``size`` (:data:`SNAPSHOTS` states are kept,
      evenly spaced in requests; a pickled copy: the run's objects are plain data).

    The GPU prefix cache is as ``gpu_cache`` says (default cold, as :func:`scaled` makes
    it; the workload's own ``gpu_cache`` field is not read).  ``admission``, ``overflow``,
    ``window_siblings``, ``windows_apart`` and ``load_split``: :class:`BudgetedIndex`'s
    options."""
    reqs = hashed(list(requests(workload)), chunking.tokens_per_hash)
    budget_of_run = workload.max_num_batched_tokens

    def new_index(size: int) -> BudgetedIndex:
        return BudgetedIndex(chunking, key_bytes, size, rule, layout, policy.window,
                             admission=admission, overflow=overflow,
                             window_siblings=window_siblings, windows_apart=windows_apart,
                             load_split=load_split)

    def result(engine: _Engine, index: BudgetedIndex, size: int | None,
               baseline_served: int) -> DiskEconomics:
        t = engine.tally
        return DiskEconomics(
            workload=workload.name, rule=rule, layout=layout, budget_bytes=size,
            prompt_tokens=t.prompt_tokens, offload_hit_tokens=t.offload_hit,
            files_read=index.files_read, files_written=index.files_written,
            files_evicted=index.files_evicted,
            recomputed_for_space_tokens=baseline_served - (t.gpu_hit + t.offload_hit),
            stranded_bytes=index.stranded_bytes(), bytes_on_disk=index.disk.bytes,
            stores_refused=index.stores_refused, keys_dropped=index.keys_dropped,
            stores_cut=index.stores_cut, keys_cut=index.keys_cut,
        )

    def start(size: int) -> tuple[_Engine, BudgetedIndex]:
        index = new_index(size)
        return _start(chunking, policy, budget_of_run, index, gpu_cache), index

    return curve_from_snapshots(reqs, sizes, start, lambda index: index, result,
                                "miss_ratio_curve")


def disk_economics(
    chunking: Chunking,
    workload: Workload,
    budget_bytes: int,
    rule: EvictionRule = EvictionRule.REACHABLE,
    key_bytes: Mapping[int, int] | int = 1,
    layout: Layout = Layout.PACKED,
    policy: Policy = Policy(),  # noqa: B008  (a frozen dataclass)
    *,
    admission: bool | None = None,
    overflow: Overflow = Overflow.REFUSE,
    window_siblings: bool = False,
    windows_apart: bool = True,
    load_split: LoadSplit | None = None,
    gpu_cache: GpuCache = GpuCache.COLD,
) -> DiskEconomics:
    """Serve ``workload`` (GPU cache ``gpu_cache``, default cold) over a disk of ``budget_bytes`` evicting by
    ``rule``: hits, files read, written and evicted, tokens recomputed for lack of space,
    stranded bytes at the end, stores refused, keys dropped by admission (the options:
    :class:`BudgetedIndex`'s)."""
    (one,) = miss_ratio_curve(chunking, workload, (budget_bytes,), rule, key_bytes, layout, policy,
                              admission=admission, overflow=overflow,
                              window_siblings=window_siblings, windows_apart=windows_apart,
                              load_split=load_split, gpu_cache=gpu_cache)
    return one
