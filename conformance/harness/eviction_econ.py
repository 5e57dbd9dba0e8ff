"""The reference's prediction for a budgeted packed disk tier behind a large CPU tier.

What :mod:`conformance.lanes.test_tiered_eviction_economics` holds kvchunk's tier to,
built from the reference's own pieces only: :class:`reference.economics.Engine` (the
one engine loop: lookup, allocate, chunked prefill in ``budget`` steps, decode,
finish) over a :class:`reference.plan.Planner`, whose chunk index is
:class:`reference.tiered_index.TieredIndex` (the intent, stated there; re-exported here):
an unbounded CPU tier (a set of keys) in front of a
:class:`reference.disk_economics.BudgetedIndex` (the disk: its files, its byte budget, its
eviction rule, its prefix structure), in the order vLLM's ``TieringOffloadingManager``
drives a secondary tier:

* **stores**: a key the CPU tier does not hold is stored there (the Planner's store
  job); when the job completes, the same keys are cascaded to the disk as one store
  (:meth:`BudgetedIndex.prepare_store`: keys already on disk left out, keys that would
  arrive stranded left out under the rule, a packed file of its full-attention keys and
  one of its window keys (:func:`reference.packed.store_job_files`), evicting by the
  rule first, refused when nothing evictable makes it fit), completed at once
  (:meth:`BudgetedIndex.complete_store`).  Stores reserve in job order, each one
  written before the next reserves (a file being written cannot be evicted: stores
  that overlap are not modelled).
* **admission**: a key that would arrive stranded is left out under the rule, with
  *pending windows* admitted (:class:`ChunkedPrefillDisk`): the Planner, in
  ``budget``-token steps, stores a boundary's window chunks before its full-attention
  chunk, as vLLM does; a boundary is judged by its window siblings too
  (``window_siblings``: one that ends before the store's last key and is not on disk
  never comes, vLLM's CPU tier cascading only the chunks it newly stored), as the
  tier's ledger admits.
* **finish**: after each request (its stores done, I/O drained) the disk strands
  nothing (:meth:`BudgetedIndex.idle`): window chunks admitted pending a boundary that
  never became whole leave, as the tier drops a finished request's stranded keys
  (:meth:`vllm_adapter.disk.ledger.RootLedger.drop_finished`).
* **lookups**: a key the CPU tier holds is a hit there (the disk is not asked); any
  other key is looked up on the disk (:meth:`BudgetedIndex.lookup`: a hit refreshes
  its file's use time).
* **promotions**: a key the disk holds is promoted to the CPU tier *when a lookup finds
  it*, whatever hit the request ends with: ``TieringOffloadingManager.lookup`` starts
  the promotion (a secondary-to-primary load job, batched per request and step) and
  answers HIT_PENDING, before the connector has asked the other groups.  So a
  full-attention chunk whose boundary's window chunks are gone is read although the
  windows cut the hit (the windows-apart layout keeps such a chunk as the prefix of a
  deeper boundary).  The promotions a lookup starts land before the next
  step (:meth:`TieredIndex.finish_promotions`: a read per distinct file of the batch,
  use times refreshed; the keys are then held by the CPU tier).  A lookup whose hit
  needs a chunk being promoted is deferred and asked again once they landed
  (:class:`PromotingPlanner`); one that is not (the windows cut the hit short of the
  promoted chunks) registers no shared-prefix junction when its full-attention scan
  started a promotion (vLLM's ``full_attention_hit_boundary`` is 0 when that scan
  deferred; :class:`PromotingEngine`).
* **loads**: the keys of a load job the CPU tier does not hold are read from the disk
  (:meth:`BudgetedIndex.prepare_load`: a read per distinct file of the job, use times
  refreshed) and are then held by the CPU tier (it keeps what it promoted); with
  promotions at lookup, a load job finds its keys in the CPU tier.
* **passes**: between passes the CPU tier is emptied (vLLM's ``reset_cache``); the
  disk keeps its files, its use times and its prefix structure.  In pass 1 the CPU
  tier holds everything stored, so the disk is never hit nor read: it only takes
  stores (and evicts for them).  In pass 2 the disk is looked up and read, and every
  chunk recomputed is stored to the CPU tier again and cascaded to the disk again
  (rewritten if it was evicted).
* **sizes**: a packed file of ``n`` keys is :func:`reference.packed.packed_file_bytes`
  of ``n`` sections of one CPU-tier row (:func:`reference.geometry.cpu_row_bytes`) and
  the keys' lengths: the header and the page-rounded sections (each of a store's two
  files its own header).
* **structure**: the disk's :class:`~reference.prefix_structure.PrefixStructure` is
  fed each request's whole hash chain (prompt and output) before its lookup.

Counts per pass (:class:`PassCounts`): files written, evicted, on disk at the end,
files read, stores refused, keys left out as stranded on arrival, and the prompt
tokens recomputed (not served by the GPU prefix cache nor by an offload hit, the CPU
and the disk tiers together).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reference.disk_economics import BudgetedIndex
from reference.economics import Tally, hashed
from reference.eviction import Disk, EvictionRule, Layout
from reference.knobs import Chunking
from reference.packed import packed_file_bytes
from reference.packed_split import LoadSplit
from reference.plan import Policy
from reference.tiered_index import PromotingEngine, PromotingPlanner, TieredIndex
from reference.workload import GpuCache, WorkloadRequest

__all__ = [
    "PackedBudgetedIndex",
    "PassCounts",
    "PromotingEngine",
    "PromotingPlanner",
    "TieredIndex",
    "budgets",
    "predict",
]


class ChunkedPrefillDisk(Disk):
    """:class:`Disk` whose stores admit pending windows: ``arrives_stranded`` with
    ``pending_windows=True`` (chunked prefill stores a boundary's window chunks in
    steps before its full-attention chunk; see :meth:`Disk.arrives_stranded`)."""

    def arrives_stranded(self, keys: Sequence[bytes], *, pending_windows: bool = True,
                         window_siblings: bool = False) -> set[bytes]:
        return super().arrives_stranded(keys, pending_windows=pending_windows,
                                        window_siblings=window_siblings)


class PackedBudgetedIndex(BudgetedIndex):
    """:class:`BudgetedIndex` (packed layout, windows apart as the tier writes them: a
    store's full-attention keys in one file, its window keys in another) whose files are
    sized as packed files
    (:func:`packed_file_bytes` of one ``row_bytes`` section per key: the index's own
    ``_size`` sums a size per key, without the packed header), over a
    :class:`ChunkedPrefillDisk` (``pending_windows``: the Planner, in ``budget``-token
    steps, stores a boundary's window chunks before its full-attention chunk, and
    :meth:`BudgetedIndex.prepare_store` would leave them all out)."""

    def __init__(self, chunking: Chunking, row_bytes: int, budget_bytes: int,
                 rule: EvictionRule, policy: Policy, *, pending_windows: bool = True,
                 window_siblings: bool = False, load_split: LoadSplit | None = None) -> None:
        super().__init__(chunking, row_bytes, budget_bytes, rule, Layout.PACKED, policy.window,
                         window_siblings=window_siblings, load_split=load_split)
        self.row_bytes = row_bytes
        if pending_windows:
            self.disk = ChunkedPrefillDisk(self.structure)

    def _size(self, keys: Any) -> int:
        keys = list(keys)
        return packed_file_bytes([self.row_bytes] * len(keys), [len(k) for k in keys])


@dataclass(frozen=True)
class PassCounts:
    """One pass over a budgeted packed disk (see the module docstring)."""

    files_written: int
    files_evicted: int
    files_on_disk: int
    """Files on disk when the pass ended."""
    bytes_on_disk: int
    files_read: int
    stores_refused: int
    keys_not_admitted: int
    prompt_tokens: int
    recomputed_tokens: int
    """Prompt tokens neither the GPU prefix cache nor an offload hit served."""
    cpu_keys: int
    """Keys the CPU tier holds when the pass ended (stored and promoted in the pass)."""


def predict(
    chunking: Chunking,
    reqs: Sequence[WorkloadRequest],
    policy: Policy,
    *,
    row_bytes: int,
    budget_bytes: int,
    budget_tokens: int,
    passes: int = 2,
    rule: EvictionRule = EvictionRule.REACHABLE,
    pending_windows: bool = True,
    window_siblings: bool = True,
    load_split: LoadSplit | None = None,
) -> list[PassCounts]:
    """Serve ``reqs`` ``passes`` times (cold GPU: the GPU prefix cache empty before every
    request) over :class:`TieredIndex` with a disk of ``budget_bytes``; counts per pass
    (``window_siblings``: :meth:`Disk.arrives_stranded`'s option, on as the tier runs it:
    :meth:`vllm_adapter.disk.ledger.RootLedger.reserve`; ``load_split``: the tier's split of
    its load jobs, so that files read counts its opens, one per file per slice:
    :func:`reference.packed_split.load_slices`)."""
    disk = PackedBudgetedIndex(chunking, row_bytes, budget_bytes, rule, policy,
                               pending_windows=pending_windows, window_siblings=window_siblings,
                               load_split=load_split)
    tiered = TieredIndex(disk)
    engine = PromotingEngine(chunking, policy, budget_tokens, tiered)
    engine.gpu_cache = GpuCache.COLD
    chains = hashed(list(reqs), chunking.tokens_per_hash)
    out: list[PassCounts] = []
    for n in range(passes):
        if n:
            engine.planner.reset()  # the CPU tier: empty; the disk: kept
        engine.tally = Tally()
        engine.loaded.clear()
        before = (disk.files_written, disk.files_evicted, disk.files_read, disk.stores_refused,
                  disk.keys_dropped)
        for req, all_hashes in chains:
            disk.observe(all_hashes)
            engine.serve(req, all_hashes)
            disk.idle()  # the request finished, its stores done: the tier drops its strands
        t = engine.tally
        out.append(PassCounts(
            files_written=disk.files_written - before[0],
            files_evicted=disk.files_evicted - before[1],
            files_on_disk=len(disk.disk.files),
            bytes_on_disk=disk.disk.bytes,
            files_read=disk.files_read - before[2],
            stores_refused=disk.stores_refused - before[3],
            keys_not_admitted=disk.keys_dropped - before[4],
            prompt_tokens=t.prompt_tokens,
            recomputed_tokens=t.prompt_tokens - t.gpu_hit - t.offload_hit,
            cpu_keys=len(tiered.cpu),
        ))
    return out


def budgets(
    chunking: Chunking,
    reqs: Sequence[WorkloadRequest],
    policy: Policy,
    *,
    row_bytes: int,
    budget_tokens: int,
    fractions: Sequence[float],
) -> tuple[int, list[int]]:
    """The bytes pass 1 writes on an unbounded disk, and ``fractions`` of them, each at
    least the largest file of that run (so one file always fits)."""
    disk = PackedBudgetedIndex(chunking, row_bytes, 2**62, EvictionRule.REACHABLE, policy,
                               window_siblings=True)
    engine = PromotingEngine(chunking, policy, budget_tokens, TieredIndex(disk))
    engine.gpu_cache = GpuCache.COLD
    for req, all_hashes in hashed(list(reqs), chunking.tokens_per_hash):
        disk.observe(all_hashes)
        engine.serve(req, all_hashes)
    total = disk.disk.bytes
    largest = max((f.nbytes for f in disk.disk.files.values()), default=0)
    return total, [max(largest, int(total * f)) for f in fractions]
