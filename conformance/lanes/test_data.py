"""Data lane: real bytes through the installed vLLM's (0.33.0 or 0.34.0) real offloading path.

Every case runs the real ``Scheduler`` + ``OffloadingConnector`` (or kvchunk's
``KvchunkOffloadingConnector``) scheduler role and the connector's worker role
with ``vllm_adapter.spec.ReferenceOffloadingSpec``: vLLM's ``CPUOffloadingManager``
decides, vLLM's ``register_kv_caches`` builds the canonical tensors, and the
copies are :mod:`reference.transfer_fast`'s.  :class:`conformance.harness.kvdata.SyntheticModelRunner`
writes deterministic bytes for every computed token and checks every load:
each loaded block must hold the expected bytes of its position in the loading
request (in every layer of its group), and nothing else in the KV memory may
change while loads run.

Workload (:func:`conformance.checks.data.run_workload`, whose checks the meta lane
runs too): two requests sharing a prefix, prefilled in
chunks; then, each after a GPU prefix-cache reset so hits come from the CPU
tier: the prompts again (one extended), a prompt diverging late with a repeat
arriving while it runs, and several loads in one step.  Small GPU and CPU pools make blocks and chunk slots get
reused, so stale bytes would show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from conformance.testing.requires import require_vllm

require_vllm()

from conformance.checks import data as DC  # noqa: E402
from conformance.harness import cases, spec_option  # noqa: E402
from conformance.harness import driver as D  # noqa: E402
from conformance.harness.fixture_runs import FixtureCase  # noqa: E402
from conformance.harness.kv_memory import with_planned_tensors  # noqa: E402
from conformance.harness.kv_stats import DataStats  # noqa: E402
from vllm_adapter.names import REFERENCE_SPEC  # noqa: E402

# ---------------------------------------------------------------------------
# Workload and checks: conformance.checks.data (the meta lane runs them too)
# ---------------------------------------------------------------------------

def record_and_check(stats: DataStats, record_property: Any) -> None:
    """Record the runner's counters, then :func:`conformance.checks.data.loads_carry_the_stored_bytes`."""
    record_property("counter:load_jobs_seen", stats.load_jobs)
    record_property("counter:loaded_blocks_checked", stats.loaded_blocks_checked)
    record_property("counter:corrupted_loads", stats.corrupted_loads)
    record_property("counter:foreign_bytes_changed", stats.foreign_bytes_changed)
    DC.loads_carry_the_stored_bytes(stats)


# ---------------------------------------------------------------------------
# Synthetic hybrids (the driver's hand-made configs)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticCase:
    fixture: str
    builder: str
    blocks_per_chunk: int
    num_gpu_blocks: int
    num_cpu_chunks: int
    planned: bool = False
    """KV tensors placed by vLLM's planner (groups overlaid, shared canonical tensors), else one per layer."""
    retention: int | None = 0
    prompt_len: int = 600
    budget: int = 128
    worker_view: str | None = None
    """A ``conformance.harness.driver`` function giving the workers' view of the resolved config."""
    layout: str = "LBHNC"
    """The planned tensors' KV-cache layout (``BLHNC``: block-outermost, layers packed per block)."""

    @property
    def knob(self) -> str:
        text = f"blocks_per_chunk={self.blocks_per_chunk}"
        if self.planned:
            text += ", planned KV tensors"
        if self.layout != "LBHNC":
            text += f", layout {self.layout}"
        if self.retention != 0:
            text += f", retention={self.retention}"
        return text

    def __str__(self) -> str:
        return (
            f"{self.fixture}-bpc{self.blocks_per_chunk}"
            + ("-planned" if self.planned else "")
            + ("" if self.retention == 0 else f"-retention{self.retention}")
            + ("" if self.layout == "LBHNC" else f"-{self.layout}")
        )


FULL, SWA, SWA2, MAMBA, EAGLE = (
    ("synthetic-full", "full_attention_kv_cache_config"),
    ("synthetic-full-swa", "full_swa_kv_cache_config"),
    ("synthetic-full-swa-2layer", "full_swa_two_layer_kv_cache_config"),
    ("synthetic-full-mamba-align", "full_mamba_align_kv_cache_config"),
    ("synthetic-eagle", "swa_eagle_kv_cache_config"),
)
PADDED = ("synthetic-full-padded-swa", "full_padded_swa_kv_cache_config")
UNEQUAL = ("synthetic-unequal-pages", "unequal_pages_kv_cache_config")
SYNTHETIC = [
    SyntheticCase(*FULL, 1, 120, 48),
    SyntheticCase(*FULL, 4, 120, 48),
    SyntheticCase(*FULL, 2, 120, 48, planned=True),
    SyntheticCase(*SWA, 1, 160, 64),
    SyntheticCase(*SWA, 2, 160, 64),
    SyntheticCase(*SWA, 4, 160, 64),
    SyntheticCase(*SWA, 2, 160, 64, planned=True),
    SyntheticCase(*SWA, 4, 160, 64, planned=True),
    SyntheticCase(*SWA, 2, 160, 96, retention=None),
    # Two layers per group: several tensors per chunk slot (regions, sub-slot strides).
    SyntheticCase(*SWA2, 2, 160, 64),
    SyntheticCase(*SWA2, 2, 160, 64, planned=True),
    # Block-outermost layout: each block packs every layer's page, so a layer view's block
    # stride is the packed block (two pages), not its page; vLLM offloads the whole block.
    SyntheticCase(*SWA2, 2, 160, 64, planned=True, layout="BLHNC"),
    SyntheticCase(*MAMBA, 1, 96, 48),
    SyntheticCase(*MAMBA, 2, 96, 48),
    SyntheticCase(*MAMBA, 2, 96, 48, planned=True),
    SyntheticCase(*MAMBA, 4, 96, 48, planned=True),
    SyntheticCase(*EAGLE, 2, 160, 64),
    # The window layer's page padded: only its real bytes travel.
    SyntheticCase(*PADDED, 2, 160, 64),
    # Two layers of unequal pages in one group: sub-slots strided by each tensor's page.
    SyntheticCase(*UNEQUAL, 2, 120, 48, worker_view="unequal_pages_worker_view"),
]


@pytest.mark.data
@pytest.mark.parametrize("case", SYNTHETIC, ids=str)
def test_synthetic_loads_carry_the_stored_bytes(case: SyntheticCase, record_property: Any) -> None:
    record_property("fixture", case.fixture)
    record_property("knob", case.knob)
    driver = synthetic_driver(case)
    stats = DC.run_workload(driver, prompt_len=case.prompt_len, budget=case.budget,
                            device=spec_option.runner_device())
    record_and_check(stats, record_property)


def synthetic_driver(case: SyntheticCase) -> D.VllmDriver:
    """The case's driver: its synthetic config, planned tensors and worker view applied."""
    kvc = getattr(D, case.builder)(num_blocks=case.num_gpu_blocks)
    driver = D.VllmDriver.from_kv_cache_config(
        kvc,
        extra_config={**spec_option.data_lane_entries(REFERENCE_SPEC),
                      "blocks_per_chunk": case.blocks_per_chunk,
                      "num_cpu_chunks": case.num_cpu_chunks},
        prefix_cache_retention_interval=case.retention,
        num_gpu_blocks=case.num_gpu_blocks,
        num_cpu_chunks=case.num_cpu_chunks,
    )
    if case.planned:
        planned = with_planned_tensors(driver.kv_cache_config, driver.vllm_config, case.layout)
        driver = D.VllmDriver(planned, driver.vllm_config)
    if case.worker_view is not None:
        worker = getattr(D, case.worker_view)(driver.kv_cache_config)
        driver = D.VllmDriver(driver.kv_cache_config, driver.vllm_config,
                              worker_kv_cache_config=worker)
    return driver


# ---------------------------------------------------------------------------
# Null blocks inside stored window chunks
# ---------------------------------------------------------------------------


@pytest.mark.data
def test_null_blocks_in_store_jobs_keep_every_block_where_its_load_reads_it(
    monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    """A window chunk stored after its first block left the window still loads the right bytes.

    FA64 + SW40@16, blocks_per_chunk 2, sparse retention, 8 CPU chunks: the
    small tier makes stores fail to allocate and be retried steps later, by
    which time the 40-token window has freed the first block of some chunks.
    vLLM 0.34.0 sends that null block (id 0) in the store job as a placeholder
    (the scheduler's ``_build_store_jobs``: "Keep null pages inside the chunk as
    placeholders"), so the reference worker copies the null page into its
    sub-slot and every other block keeps its offset; 0.33.0 leaves null blocks
    out of the job (``reference.plan.NullBlockRule.SKIP``), so block 0 never
    reaches the worker.  Either way every loaded block must hold its expected
    bytes and nothing else may change (the lane's usual checks); on 0.34.0 the
    case must also load from a chunk whose store carried a placeholder.
    """
    from conformance.harness import vllm_harness_api as V
    from conformance.protocol.versions import rules_for
    from reference.plan import NullBlockRule
    from vllm_adapter import spec as S

    record_property("fixture", "synthetic-full-swa")
    record_property("knob", "blocks_per_chunk=2, window 40, retention=None, 8 CPU chunks")
    entries = spec_option.data_lane_entries(REFERENCE_SPEC)
    chosen = spec_option.chosen()
    if chosen is not None and not issubclass(chosen.load(), S.ReferenceOffloadingSpec):
        pytest.skip(f"counts the reference worker's store jobs; --spec {chosen} has its own worker")
    null_slots: set[int] = set()
    seen = {"null_store_jobs": 0, "loads_from_null_chunks": 0}
    real_store, real_load = (
        S.ReferenceOffloadingWorker.submit_store,
        S.ReferenceOffloadingWorker.submit_load,
    )

    def submit_store(self: Any, job_id: int, src: Any, dst: Any) -> bool:
        gpu = self.gpu_blocks(src)
        slots = [int(c) for c in dst.block_ids]
        null_slots.difference_update(slots)
        if (gpu.block_ids == 0).any():
            seen["null_store_jobs"] += 1
            cursor = slot_cursor = 0
            for n, first, b in zip(
                gpu.group_sizes, gpu.block_indices, self.layout.blocks_per_chunk, strict=True
            ):
                skip = first % b
                for k in range(n):
                    if gpu.block_ids[cursor + k] == 0:
                        null_slots.add(slots[slot_cursor + (k + skip) // b])
                cursor += n
                slot_cursor += -(-(n + skip) // b) if n else 0
        return real_store(self, job_id, src, dst)

    def submit_load(self: Any, job_id: int, src: Any, dst: Any, expedited: bool = False) -> bool:
        seen["loads_from_null_chunks"] += len(null_slots & {int(c) for c in src.block_ids})
        return real_load(self, job_id, src, dst, expedited)

    monkeypatch.setattr(S.ReferenceOffloadingWorker, "submit_store", submit_store)
    monkeypatch.setattr(S.ReferenceOffloadingWorker, "submit_load", submit_load)
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_swa_kv_cache_config(64, 16, 40, num_blocks=160),
        extra_config={**entries, "blocks_per_chunk": 2, "num_cpu_chunks": 8},
        prefix_cache_retention_interval=None,
        num_gpu_blocks=160,
        num_cpu_chunks=8,
    )
    stats = DC.run_workload(driver, prompt_len=600, budget=64)
    for key, value in seen.items():
        record_property(f"counter:{key}", value)
    record_and_check(stats, record_property)
    summary = f"{seen}; {stats.describe()}"
    if rules_for(V.VLLM_VERSION).policy.null_blocks_in_store is NullBlockRule.PLACEHOLDER:
        assert seen["null_store_jobs"] > 0, f"no store job carried a null block: {summary}"
        assert seen["loads_from_null_chunks"] > 0, (
            f"no load read a chunk stored with a null placeholder: {summary}"
        )
    else:
        assert seen["null_store_jobs"] == 0, f"this release should leave null blocks out: {summary}"


# ---------------------------------------------------------------------------
# Real-model fixtures
# ---------------------------------------------------------------------------


FIXTURES = [
    FixtureCase(c.fixture, c.knob.items, c.knob.kvchunk, c.data.num_gpu_blocks,
                c.data.num_cpu_chunks, c.data.prompt_len,
                block_tokens_base=c.data.block_tokens_base)
    for c in cases.CASES if c.data is not None
]
"""The data lane's rows of :data:`conformance.harness.cases.CASES` (sizes stated there)."""


@pytest.mark.data
@pytest.mark.parametrize("case", FIXTURES, ids=str)
def test_fixture_loads_carry_the_stored_bytes(case: FixtureCase, record_property: Any) -> None:
    record_property("fixture", case.fixture)
    record_property("knob", case.knob)
    stats = DC.run_workload(
        case.driver(spec=spec_option.data_lane_entries(REFERENCE_SPEC)),
        prompt_len=case.workload_prompt_len,
        budget=case.workload_budget,
        device=spec_option.runner_device(),
    )
    record_and_check(stats, record_property)


# ---------------------------------------------------------------------------
# The checker itself (the lane cannot pass by checking nothing)
# ---------------------------------------------------------------------------


def _swa_driver() -> D.VllmDriver:
    return D.VllmDriver.from_kv_cache_config(
        D.full_swa_kv_cache_config(num_blocks=160),
        extra_config={**REFERENCE_SPEC, "blocks_per_chunk": 2},
        prefix_cache_retention_interval=0,
        num_gpu_blocks=160,
        num_cpu_chunks=64,
    )


@pytest.mark.meta
@pytest.mark.parametrize("mutation", ["swap_slots", "skip_load", "extra_block"])
def test_checker_catches_broken_loads(
    mutation: str, monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    """A worker that loads the wrong chunk, loads nothing, or writes one block too many is caught."""
    from vllm_adapter import spec as S

    record_property("fixture", "synthetic-full-swa")
    record_property("knob", f"mutation={mutation}")
    real = S.ReferenceOffloadingWorker.submit_load

    def broken(
        self: Any, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        if mutation == "swap_slots" and len(src_spec.block_ids) > 1:
            src_spec.block_ids = src_spec.block_ids[::-1].copy()
        if mutation == "skip_load":
            self._finished.append(S.V.TransferResult(job_id=job_id, success=True))
            return True
        ok = real(self, job_id, src_spec, dst_spec, expedited)
        if mutation == "extra_block":
            loaded = self.gpu_blocks(dst_spec).block_ids.tolist()  # spec or device pointers
            free = sorted(set(range(1, self.gpu_tensors[0].shape[0])) - set(loaded))
            self.gpu_tensors[0][free[-1], :8] ^= 0xFF
        return ok

    monkeypatch.setattr(S.ReferenceOffloadingWorker, "submit_load", broken)
    stats = DC.run_workload(_swa_driver(), prompt_len=600, budget=128)
    assert stats.load_jobs > 0
    if mutation == "extra_block":
        assert stats.foreign_bytes_changed > 0, stats.describe()
    else:
        assert stats.corrupted_loads > 0, stats.describe()
    record_property("counter:data_mutations_detected", 1)
