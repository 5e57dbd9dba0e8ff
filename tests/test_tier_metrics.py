"""vllm_adapter.disk.metrics: the kvchunk file tier's counters through vLLM's connector stats.

The payloads :class:`~vllm_adapter.disk.metrics.TierStats` builds go through vLLM's own
code as a running engine's would: ``OffloadingConnectorStats.aggregate`` (worker outputs
merged, tier payloads merged into the scheduler's, a logging interval's steps summed),
``reduce()`` (the "KV Transfer metrics" log line, via ``KVConnectorLogging``) and
``OffloadPromMetrics.observe`` (Prometheus, into a private registry).  Every expected
number is worked out by hand in the test.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from conformance.testing.requires import require_vllm

require_vllm()

from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client import Counter as PromCounter  # noqa: E402
from prometheus_client import Gauge as PromGauge  # noqa: E402
from prometheus_client import Histogram as PromHistogram  # noqa: E402

# Not in conformance.harness.vllm_harness_api: the frontend's logging and Prometheus
# classes, which only this test drives.
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: E402
    OffloadPromMetrics,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from conformance.harness import vllm_harness_api as H  # noqa: E402
from reference.eviction import EvictionRule  # noqa: E402
from reference.geometry import Geometry, GroupKind, KVGroup  # noqa: E402
from reference.knobs import BlocksPerChunk, resolve  # noqa: E402
from vllm_adapter import names  # noqa: E402
from vllm_adapter import vllm_api as V  # noqa: E402
from vllm_adapter.disk import metrics as TM  # noqa: E402
from vllm_adapter.disk.chunk_file import TierCounters  # noqa: E402
from vllm_adapter.disk.tier import KvchunkFileTierManager, KvchunkTieringOffloadingSpec  # noqa: E402
from vllm_adapter.disk.tier_budget import TierBudget  # noqa: E402

N = "vllm:kvchunk_fs_"
"""The names spelled out here, not taken from the module under test."""

GAUGE_FIELDS = {"disk_budget_bytes", "disk_bytes", "disk_files", "stranded_bytes", "ledger_bytes"}
PROM_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


def _counters(**values: Any) -> TierCounters:
    c = TierCounters()
    for name, value in values.items():
        setattr(c, name, value)
    return c


def _values(stats: Any) -> dict[str, Any]:
    """``{metric name: value}`` of an unlabeled payload (every label tuple must be ``()``)."""
    _, data = stats.metric_sections()
    out = {}
    for name, by_labels in data.items():
        assert set(by_labels) == {()}, (name, by_labels)
        out[name] = by_labels[()]
    return out


def _types(stats: Any) -> dict[str, str]:
    return dict(stats.metric_sections()[0])


# -- definitions ---------------------------------------------------------------------------


def test_every_definition_is_unique_documented_and_typed() -> None:
    defs = TM.metric_definitions()
    names_ = list(defs)
    assert len(names_) == len(set(names_))
    assert all(n.startswith(N) and PROM_NAME.match(n) for n in names_), names_
    fields = {n[len(N):] for n in names_}
    assert len(fields) == 35
    for name, meta in defs.items():
        assert meta.documentation.strip(), name
        assert meta.labelnames == (), name
        field = name[len(N):]
        if field in GAUGE_FIELDS:
            assert type(meta) is V.OffloadingGaugeMetadata, name
        else:
            assert type(meta) is V.OffloadingCounterMetadata, name
    assert {n[len(N):] for n, m in defs.items()
            if isinstance(m, V.OffloadingGaugeMetadata)} == GAUGE_FIELDS
    assert "must be 0" in defs[N + "stranded_bytes"].documentation
    # No clash with vLLM's own tiering / connector metrics (their names start elsewhere).
    assert not any(n.startswith("vllm:kv_offload") for n in names_)


def _budget(root: Path, budget: int = 1 << 20) -> TierBudget:
    ns = root / "kvchunk-v2-test"
    ns.mkdir()
    chunking = resolve(Geometry((KVGroup(0, GroupKind.FULL, 16),), tokens_per_hash=16),
                       BlocksPerChunk(2))
    tier_budget = TierBudget(str(root), str(ns), budget, EvictionRule.REACHABLE, chunking)
    tier_budget.start([])
    return tier_budget


def test_every_tier_counter_and_budget_number_has_a_definition(tmp_path: Path) -> None:
    """A field added to TierCounters or to the budget snapshot must get a definition."""
    defs = TM.metric_definitions()
    int_fields = {f.name for f in dataclasses.fields(TierCounters)
                  if not f.name.startswith("_") and f.type in ("int", int)}
    assert "files_stored" in int_fields and "lookup_misses" in int_fields
    assert int_fields | {"bad_files"} <= {n[len(N):] for n in defs}
    snapshot = _budget(tmp_path).snapshot(stranded=True)
    assert {"disk_bytes", "stranded_bytes", "files_evicted"} <= set(snapshot)
    assert {N + k for k in snapshot} <= set(defs), sorted(snapshot)


# -- deltas --------------------------------------------------------------------------------


def test_collect_reports_counter_increases_and_gauge_values() -> None:
    stats = TM.TierStats()
    counters = _counters(files_stored=3, bad_files=Counter({"checksum": 2, "size": 1}))
    snap = {"disk_budget_bytes": 1000, "disk_bytes": 400, "disk_files": 4, "files_evicted": 7}

    first = stats.collect(counters, snap)
    assert first is not None
    got = _values(first)
    assert got[N + "files_stored"] == 3
    assert got[N + "bad_files"] == 3  # 2 checksum + 1 size
    assert got[N + "files_evicted"] == 7
    assert got[N + "lookup_hits"] == 0  # the first call reports every counter, zeros too
    assert got[N + "disk_bytes"] == 400
    assert got[N + "disk_files"] == 4
    assert got[N + "disk_budget_bytes"] == 1000
    assert N + "stranded_bytes" not in got  # not sampled this time
    assert _types(first)[N + "files_stored"] == "counter"
    assert _types(first)[N + "disk_bytes"] == "gauge"

    counters.add(files_stored=2)  # 3 -> 5
    counters.bad("/x", "header")  # bad files 3 -> 4
    snap = {"disk_budget_bytes": 1000, "disk_bytes": 250, "disk_files": 2, "files_evicted": 9,
            "stranded_bytes": 0}
    second = stats.collect(counters, snap)
    assert second is not None
    assert _values(second) == {
        N + "files_stored": 2,
        N + "bad_files": 1,
        N + "files_evicted": 2,
        N + "disk_budget_bytes": 1000,
        N + "disk_bytes": 250,
        N + "disk_files": 2,
        N + "stranded_bytes": 0,
    }

    # Nothing grew and no gauge given: nothing to report.
    assert stats.collect(counters, {"files_evicted": 9}) is None


def test_collect_ignores_names_it_does_not_define() -> None:
    stats = TM.TierStats()
    payload = stats.collect(TierCounters(), {"disk_bytes": 1, "some_future_number": 5})
    assert payload is not None
    assert set(_values(payload)) <= set(TM.metric_definitions())


def test_stranded_bytes_is_sampled_at_most_every_interval() -> None:
    stats = TM.TierStats(stranded_seconds=10.0)
    assert stats.stranded_due(now=100.0)
    assert not stats.stranded_due(now=105.0)
    assert not stats.stranded_due(now=109.9)
    assert stats.stranded_due(now=110.0)
    assert not stats.stranded_due(now=111.0)


def test_sample_reads_a_real_budget_and_samples_stranded_bytes_once_per_interval(
    tmp_path: Path,
) -> None:
    """``TierStats.sample``: the whole of the tier's proposed ``get_stats``."""
    stats = TM.TierStats(stranded_seconds=3600.0)
    counters = _counters(lookup_misses=2)
    budget = _budget(tmp_path, budget=5000)
    first = stats.sample(counters, budget)
    assert first is not None
    got = _values(first)
    assert got[N + "disk_budget_bytes"] == 5000
    assert got[N + "disk_bytes"] == 0 and got[N + "disk_files"] == 0
    assert got[N + "stranded_bytes"] == 0
    assert got[N + "lookup_misses"] == 2
    assert got[N + "orphans_removed"] == 0
    counters.add(lookup_misses=1)
    second = stats.sample(counters, budget)  # within the hour: no stranded_bytes
    assert second is not None
    values = _values(second)
    assert values.pop(N + "ledger_bytes") == os.path.getsize(budget.ledger.ledger_path) > 0
    assert values == {N + "lookup_misses": 1, N + "disk_budget_bytes": 5000,
                      N + "disk_bytes": 0, N + "disk_files": 0}


# -- through vLLM's aggregation -------------------------------------------------------------


def _two_workers() -> tuple[Any, Any, Any, Any]:
    """Two tiers' first and second payloads: (a1, b1, a2, b2)."""
    sa, sb = TM.TierStats(), TM.TierStats()
    ca = _counters(files_stored=3, lookup_hits=10, lookup_misses=4)
    cb = _counters(files_stored=5, lookup_hits=1, load_failures=1)
    a1 = sa.collect(ca, {"disk_bytes": 100, "disk_files": 1, "disk_budget_bytes": 1000,
                         "bytes_evicted": 50})
    b1 = sb.collect(cb, {"disk_bytes": 300, "disk_files": 3, "disk_budget_bytes": 1000,
                         "stranded_bytes": 12})
    ca.add(files_stored=2, lookup_hits=6)  # a: files 3 -> 5, hits 10 -> 16
    cb.add(files_stored=1, lookup_misses=2)  # b: files 5 -> 6, misses 0 -> 2
    a2 = sa.collect(ca, {"disk_bytes": 150, "disk_files": 2, "disk_budget_bytes": 1000,
                         "bytes_evicted": 80})
    b2 = sb.collect(cb, {"disk_bytes": 350, "disk_files": 4, "disk_budget_bytes": 1000})
    return a1, b1, a2, b2


def test_worker_payloads_sum_through_vllm_aggregate_and_reduce() -> None:
    a1, b1, _, _ = _two_workers()
    # vLLM merges workers' outputs into the first one's payload (kv_connector/utils.py),
    # and a tier's payload into the manager's (TieringOffloadingManager.get_stats).
    merged = a1.aggregate(b1)
    reduced = merged.reduce()
    assert reduced[N + "files_stored"] == 8  # 3 + 5
    assert reduced[N + "lookup_hits"] == 11  # 10 + 1
    assert reduced[N + "lookup_misses"] == 4  # 4 + 0
    assert reduced[N + "load_failures"] == 1  # 0 + 1
    assert reduced[N + "bytes_evicted"] == 50  # 50 + nothing from b
    assert reduced[N + "store_failures"] == 0
    # Gauges keep the latest snapshot merged in: b's.
    assert reduced[N + "disk_bytes"] == 300
    assert reduced[N + "disk_files"] == 3
    assert reduced[N + "disk_budget_bytes"] == 1000
    assert reduced[N + "stranded_bytes"] == 12


def _kv_transfer_config(tmp_path: Path, tier_type: str) -> Any:
    return H.KVTransferConfig(
        kv_connector=names.KVCHUNK_CONNECTOR,
        kv_connector_module_path=names.KVCHUNK_CONNECTOR_MODULE,
        kv_role="kv_both",
        kv_connector_extra_config={
            **names.KVCHUNK_TIERING_SPEC,
            "cpu_bytes_to_use": 1 << 30,
            "secondary_tiers": [{"type": tier_type, "root_dir": str(tmp_path)}],
        },
    )


def test_a_logging_interval_sums_steps_through_kv_connector_logging(tmp_path: Path) -> None:
    """The "KV Transfer metrics" log line: the frontend rebuilds each step's payload with
    the connector's ``build_kv_connector_stats``, aggregates the interval, and reduces."""
    a1, b1, a2, b2 = _two_workers()
    logging = KVConnectorLogging(_kv_transfer_config(tmp_path, names.KVCHUNK_FS_TIER))
    logging.observe(a1.aggregate(b1).to_dict())  # step 1
    logging.observe(a2.aggregate(b2).to_dict())  # step 2
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1
    line = lines[0]
    for expected in (
        f"{N}files_stored=11",  # a: 3 + 2, b: 5 + 1
        f"{N}lookup_hits=17",  # a: 10 + 6, b: 1
        f"{N}lookup_misses=6",  # a: 4, b: 2
        f"{N}bytes_evicted=80",  # a: 50 + 30
        f"{N}disk_bytes=350",  # latest: step 2, b
        f"{N}disk_files=4",
        f"{N}stranded_bytes=12",  # step 1, b: not sampled again
    ):
        assert re.search(re.escape(expected) + r"(,|$)", line), (expected, line)


def _prometheus(tmp_path: Path, tier_type: str) -> tuple[Any, CollectorRegistry]:
    registry = CollectorRegistry()
    metric_types: dict[Any, Any] = {
        PromGauge: functools.partial(PromGauge, registry=registry),
        PromCounter: functools.partial(PromCounter, registry=registry),
        PromHistogram: functools.partial(PromHistogram, registry=registry),
    }
    cfg = H.VllmConfig.__new__(H.VllmConfig)  # the frontend reads kv_transfer_config only
    object.__setattr__(cfg, "kv_transfer_config", _kv_transfer_config(tmp_path, tier_type))
    prom = OffloadPromMetrics(cfg, metric_types, ["engine"], {0: ["0"]})
    return prom, registry


@pytest.fixture
def tier_defines_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    """KvchunkFileTierManager.build_metric_definitions as proposed (safe_fs is not ours)."""
    if "build_metric_definitions" not in vars(KvchunkFileTierManager):
        monkeypatch.setattr(KvchunkFileTierManager, "build_metric_definitions",
                            classmethod(lambda cls, extra_config: TM.metric_definitions()))


def test_the_kvchunk_spec_defines_the_tier_metrics(tier_defines_metrics: None) -> None:
    extra = {**names.KVCHUNK_TIERING_SPEC, "cpu_bytes_to_use": 1 << 30,
             "secondary_tiers": [{"type": names.KVCHUNK_FS_TIER, "root_dir": "/nonexistent"}]}
    spec_cls = OffloadingSpecFactory.get_spec_cls(extra)
    assert spec_cls is KvchunkTieringOffloadingSpec
    defs = spec_cls.build_metric_definitions(extra)
    assert set(TM.metric_definitions()) <= set(defs)


def test_with_kvchunk_tiers_types_fs_tiers_as_kvchunk_without_io() -> None:
    extra = {"cpu_bytes_to_use": 1, "secondary_tiers": [
        {"type": "fs", "root_dir": "/nonexistent/a"}, {"type": "obj", "x": 1}, "junk"]}
    out = TM.with_kvchunk_tiers(extra)
    assert out["secondary_tiers"] == [
        {"type": names.KVCHUNK_FS_TIER, "root_dir": "/nonexistent/a"}, {"type": "obj", "x": 1},
        "junk"]
    assert extra["secondary_tiers"][0]["type"] == "fs"  # not modified in place
    assert not os.path.exists("/nonexistent/a")
    assert TM.with_kvchunk_tiers({"cpu_bytes_to_use": 1}) == {"cpu_bytes_to_use": 1}


@pytest.mark.parametrize("tier_type", [names.KVCHUNK_FS_TIER, "fs"])
def test_prometheus_shows_the_summed_counters_and_latest_gauges(
    tmp_path: Path, tier_type: str, tier_defines_metrics: None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's own frontend path, in process: two steps of two tiers' payloads observed by
    ``OffloadPromMetrics``, read back from the registry.

    ``"fs"`` (how users configure it) reaches kvchunk's tier only through the spec: the
    spec's ``build_metric_definitions`` must type it as kvchunk's (proposed override,
    patched in while safe_fs lacks it), or the frontend would reject the tier's names.
    """
    if tier_type == "fs" and "build_metric_definitions" not in vars(
        KvchunkTieringOffloadingSpec
    ):
        def spec_defs(cls: Any, extra_config: dict[str, Any]) -> dict[str, Any]:
            parent = super(KvchunkTieringOffloadingSpec, cls)
            return parent.build_metric_definitions(TM.with_kvchunk_tiers(extra_config))

        monkeypatch.setattr(KvchunkTieringOffloadingSpec, "build_metric_definitions",
                            classmethod(spec_defs))
    prom, registry = _prometheus(tmp_path, tier_type)
    a1, b1, a2, b2 = _two_workers()
    prom.observe(a1.aggregate(b1).to_dict(), engine_idx=0)
    prom.observe(a2.aggregate(b2).to_dict(), engine_idx=0)

    def sample(name: str) -> float | None:
        return registry.get_sample_value(name, {"engine": "0"})

    assert sample(N + "files_stored_total") == 11  # 3 + 5, then 2 + 1
    assert sample(N + "lookup_hits_total") == 17  # 10 + 1, then 6
    assert sample(N + "lookup_misses_total") == 6  # 4, then 2
    assert sample(N + "load_failures_total") == 1
    assert sample(N + "bytes_evicted_total") == 80  # 50, then 30
    assert sample(N + "store_failures_total") == 0  # present from the first step
    assert sample(N + "bad_files_total") == 0
    assert sample(N + "disk_bytes") == 350  # step 2's latest (b)
    assert sample(N + "disk_files") == 4
    assert sample(N + "disk_budget_bytes") == 1000
    assert sample(N + "stranded_bytes") == 12  # step 1, b: not sampled again
