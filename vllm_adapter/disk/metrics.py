"""The kvchunk file tier's counters and disk gauges as vLLM offloading metrics.

vLLM's ``SecondaryTierManager`` has two metric hooks (0.33.0 and 0.34.0 alike):
the classmethod ``build_metric_definitions(extra_config)``, whose definitions
``TieringOffloadingSpec.build_metric_definitions`` merges for every configured
tier (the Prometheus frontend registers them), and ``get_stats()``, which returns
*and resets* the tier's observations as an ``OffloadingConnectorStats`` payload.
``TieringOffloadingManager.get_stats`` aggregates the tiers' payloads into the
scheduler's each step; the frontend feeds it to ``OffloadPromMetrics.observe``
(Prometheus) and, summed over the logging interval with ``aggregate``, to the
``reduce()`` of the "KV Transfer metrics" log line.

In that payload a counter observation is an *increment* (``aggregate`` sums them,
Prometheus ``inc``s them) and a gauge observation a snapshot (``aggregate`` keeps
the latest, Prometheus ``set``s it).  kvchunk's :class:`~vllm_adapter.disk.chunk_file.TierCounters`
and :meth:`~vllm_adapter.disk.tier_budget.TierBudget.snapshot` are cumulative, so
:class:`TierStats` reports each counter's change since its previous call.

Names follow vLLM's tier metrics (``vllm:kv_offload_tiering_<what>``, KVCR's
``vllm:kvcr_<what>``): ``vllm:kvchunk_fs_<field>``, the field of ``TierCounters``
or of the budget snapshot it reports, unlabeled.  Prometheus shows a counter with
``_total`` appended.  Only defined names are ever put on the payload: the
frontend rejects a name its spec did not define.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from vllm_adapter import names
from vllm_adapter import vllm_api as V
from vllm_adapter.disk.chunk_file import TierCounters
from vllm_adapter.disk.tier_budget import TierBudget

__all__ = [
    "BUDGET_COUNTERS",
    "GAUGES",
    "PREFIX",
    "STRANDED_SECONDS",
    "TIER_COUNTERS",
    "TierStats",
    "counter_values",
    "metric_definitions",
    "metric_name",
    "with_kvchunk_tiers",
]

PREFIX = "vllm:kvchunk_fs_"
"""Every kvchunk file tier metric's name starts with this."""

STRANDED_SECONDS = 10.0
"""``stranded_bytes`` costs O(files): :meth:`TierStats.stranded_due` allows it this often."""

TIER_COUNTERS: dict[str, str] = {
    "files_stored": "Files the kvchunk file tier wrote (chunk files, or packed files).",
    "files_loaded": "Per-chunk layout: chunk files the kvchunk file tier verified and loaded.",
    "sections_stored": "Packed layout: sections (one per key) the kvchunk file tier wrote.",
    "files_opened": "Packed layout: files the kvchunk file tier's loads opened.",
    "sections_loaded": "Packed layout: sections the kvchunk file tier verified and loaded.",
    "reads": "Packed layout: read calls of the kvchunk file tier's loads.",
    "bad_sections": "Packed layout: sections that failed verification (their keys are dropped).",
    "store_failures": (
        "Store jobs of the kvchunk file tier that failed: an I/O error, or refused by "
        "the disk budget."
    ),
    "load_failures": "Load jobs of the kvchunk file tier that failed.",
    "lookup_hits": "Lookups the kvchunk file tier answered with a hit.",
    "lookup_misses": "Lookups the kvchunk file tier answered with a miss.",
    "bad_files": (
        "Files the kvchunk file tier found bad on load (size, header, checksum, ...; "
        "all reasons summed)."
    ),
    "bad_files_removed": "Bad files the kvchunk file tier deleted or quarantined.",
    "stale_temps_removed": (
        "Temporary files of dead writers the kvchunk file tier removed when it started."
    ),
}
"""Counters from :class:`~vllm_adapter.disk.chunk_file.TierCounters` (``bad_files``: its
per-reason ``Counter``, summed)."""

BUDGET_COUNTERS: dict[str, str] = {
    "files_evicted": "Files this kvchunk file tier evicted to keep its root under the budget.",
    "bytes_evicted": "Bytes of the files this kvchunk file tier evicted, in bytes.",
    "stores_refused": (
        "Stores this kvchunk file tier refused: the disk budget was full and nothing "
        "could be evicted."
    ),
    "keys_not_admitted": (
        "Keys this kvchunk file tier's stores left out because they would arrive "
        "stranded (eviction 'reachable')."
    ),
    "orphans_removed": "Files without a ledger entry this kvchunk file tier removed.",
    "reservations_reclaimed": "Reservations of dead writers this kvchunk file tier failed.",
    "reservations_lost": (
        "Reservations of this kvchunk file tier that a peer reclaimed: the tier stalled "
        "longer than its lease (must be 0)."
    ),
    "leases_lost": "Times a peer judged this kvchunk file tier dead and removed its lease.",
    "journal_records_skipped": "Torn or damaged ledger journal lines this kvchunk file tier skipped.",
    "compactions": "Ledger journal compactions this kvchunk file tier ran.",
    "snapshot_loads": (
        "Starts of this kvchunk file tier whose ledger model was loaded from the ledger's "
        "snapshot (only the journal after it replayed)."
    ),
    "snapshot_fallbacks": (
        "Whole replays of the ledger journal by this kvchunk file tier in place of its "
        "snapshot: at a start whose snapshot was missing, stale or damaged, or when a "
        "namespace of a loaded snapshot did not hold when first used."
    ),
    "snapshots_written": "Ledger snapshots this kvchunk file tier wrote (compaction, shutdown).",
    "files_recycled": (
        "Evicted files this kvchunk file tier overwrote as a new file's temporary file "
        "(counted in files_evicted)."
    ),
    "finished_keys_dropped": (
        "Keys no lookup could load that this kvchunk file tier dropped as the request that "
        "stored them finished (window chunks whose boundary never became whole)."
    ),
    "finished_files_removed": (
        "Files this kvchunk file tier removed because every key of theirs was so dropped "
        "(counted in files_evicted)."
    ),
}
"""Counters from :meth:`~vllm_adapter.disk.tier_budget.TierBudget.snapshot` (this tier's)."""

GAUGES: dict[str, str] = {
    "disk_budget_bytes": "The kvchunk file tier's root's byte budget, in bytes.",
    "disk_bytes": (
        "Bytes on the kvchunk file tier's root (every engine's files and reservations), "
        "in bytes."
    ),
    "disk_files": "Files on the kvchunk file tier's root (every engine's).",
    "ledger_bytes": "Bytes of the root's ledger journal (inside disk_bytes_to_use).",
    "stranded_bytes": (
        "Bytes on the kvchunk file tier's root that no lookup can reach any more; "
        "must be 0 (sampled at most every 10 s)."
    ),
}
"""Gauges from :meth:`~vllm_adapter.disk.tier_budget.TierBudget.snapshot` (``stranded_bytes``
only when asked for)."""


def metric_name(field: str) -> str:
    """The vLLM metric name of a counter or gauge field: ``vllm:kvchunk_fs_<field>``."""
    return PREFIX + field


def metric_definitions() -> dict[str, V.OffloadingMetricMetadata]:
    """Every kvchunk file tier metric, as ``SecondaryTierManager.build_metric_definitions``
    returns them: counters, then gauges, unlabeled."""
    defs: dict[str, V.OffloadingMetricMetadata] = {}
    for field, doc in (TIER_COUNTERS | BUDGET_COUNTERS).items():
        defs[metric_name(field)] = V.OffloadingCounterMetadata(documentation=doc)
    for field, doc in GAUGES.items():
        defs[metric_name(field)] = V.OffloadingGaugeMetadata(documentation=doc)
    return defs


def counter_values(counters: TierCounters) -> dict[str, int]:
    """The :data:`TIER_COUNTERS` of ``counters`` now, read under its lock (one consistent
    reading; ``bad_files`` summed over its reasons)."""
    with counters._lock:
        out = {f: int(getattr(counters, f, 0)) for f in TIER_COUNTERS if f != "bad_files"}
        out["bad_files"] = sum(counters.bad_files.values())
    return out


def with_kvchunk_tiers(extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """``extra_config`` with every ``"fs"`` secondary tier typed as kvchunk's, touching no disk.

    ``TieringOffloadingSpec.build_metric_definitions`` resolves the tier classes from
    the user's ``secondary_tiers``, where ``"fs"`` is vLLM's own file tier: the kvchunk
    spec must hand it this, or kvchunk's tier metrics go undefined in the frontend.
    """
    out = dict(extra_config)
    tiers = out.get("secondary_tiers")
    if isinstance(tiers, list):
        out["secondary_tiers"] = [
            {**t, "type": names.KVCHUNK_FS_TIER}
            if isinstance(t, dict) and t.get("type") == "fs" else t
            for t in tiers
        ]
    return out


class TierStats:
    """A tier's last reported counter values: turns its cumulative counters into vLLM's
    per-call increments (``get_stats`` "returns and resets")."""

    def __init__(self, stranded_seconds: float = STRANDED_SECONDS) -> None:
        self._last: dict[str, int] | None = None
        """Counter values at the previous :meth:`collect` (``None``: never called)."""
        self._stranded_seconds = stranded_seconds
        self._stranded_at: float | None = None
        self._lock = threading.Lock()

    def stranded_due(self, now: float | None = None) -> bool:
        """Whether to compute ``stranded_bytes`` now: on the first call, then at most every
        ``stranded_seconds`` (``now``: ``time.monotonic()`` by default)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._stranded_at is not None and now - self._stranded_at < self._stranded_seconds:
                return False
            self._stranded_at = now
            return True

    def sample(self, counters: TierCounters, budget: TierBudget) -> V.OffloadingConnectorStats | None:
        """:meth:`collect` over ``budget``'s snapshot, ``stranded_bytes`` included when
        :meth:`stranded_due`: the whole of a tier's ``get_stats``.  It runs on vLLM's
        scheduler thread, so it never waits for the ledger
        (:meth:`~vllm_adapter.disk.tier_budget.TierBudget.snapshot_nowait`)."""
        return self.collect(counters, budget.snapshot_nowait(stranded=self.stranded_due()))

    def collect(
        self, counters: TierCounters, budget_snapshot: Mapping[str, int]
    ) -> V.OffloadingConnectorStats | None:
        """The payload for ``get_stats``: each counter's increase since the previous call,
        and the gauges in ``budget_snapshot`` as they are.

        The first call reports every counter, zeros included (so each series exists from
        the start); later calls only those that grew.  A counter that went down (its
        source was replaced) reports its new value, as Prometheus treats a reset.  Keys of
        ``budget_snapshot`` that are not defined here are ignored.  ``None`` when there is
        nothing to report.
        """
        now = counter_values(counters)
        for field in BUDGET_COUNTERS:
            if field in budget_snapshot:
                now[field] = int(budget_snapshot[field])
        stats = V.OffloadingConnectorStats()
        with self._lock:
            first = self._last is None
            last = self._last or {}
            for field, value in now.items():
                before = last.get(field, 0)
                delta = value - before if value >= before else value
                if delta or first:
                    stats.increase_counter(metric_name(field), delta)
            self._last = now
        for field in GAUGES:
            if field in budget_snapshot:
                stats.set_gauge(metric_name(field), int(budget_snapshot[field]))
        return None if stats.is_empty() else stats
