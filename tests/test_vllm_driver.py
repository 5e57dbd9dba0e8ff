"""The vLLM driver: vLLM 0.33.0's real scheduler + OffloadingConnector on CPU, recorded.

Reproduces the worked examples of the semantics notes (§7) through
:mod:`conformance.harness.driver` and checks the recorded jobs against keys
computed by :mod:`reference.keys` from the request's own block hashes and
against the request's own block table.
"""

from __future__ import annotations

import re

import pytest

from conformance.testing.requires import require_vllm

require_vllm()

from conformance.harness import driver as D  # noqa: E402
from conformance.harness import vllm_harness_api as V  # noqa: E402
from conformance.protocol.trace import (  # noqa: E402
    AbortSpec,
    Alloc,
    BuildMeta,
    JobFault,
    JobsDone,
    Lookup,
    NewRequest,
    RequestFinished,
    RequestSpec,
    ResetPrefixCache,
    ResetSpec,
    Trace,
    WorkloadSpec,
)
from reference.geometry import GroupKind  # noqa: E402
from reference.keys import chunk_key  # noqa: E402
from reference.knobs import BlocksPerChunk, Chunking, resolve  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = tuple(range(1000, 1300))  # 300 tokens, distinct


@pytest.fixture(scope="module")
def fa_swa() -> D.VllmDriver:
    """FA 64 + SW 128 @ 16, tph 16, bpc 2, retention 0 (the notes' §7 setup)."""
    return D.VllmDriver.from_kv_cache_config(
        D.full_swa_kv_cache_config(),
        extra_config={"blocks_per_chunk": 2},
        prefix_cache_retention_interval=0,
        max_num_batched_tokens=1024,
    )


def chunking_of(trace: Trace) -> Chunking:
    c = trace.config
    return resolve(
        c.geometry(), BlocksPerChunk(c.blocks_per_chunk), c.prefix_cache_retention_interval
    )


def keys_of(hashes: tuple[bytes, ...], chunking: Chunking, wanted: dict[int, range]) -> tuple[bytes, ...]:
    """Group-major, chunk-ascending keys of ``wanted = {group: chunk range}``."""
    return tuple(
        chunk_key(hashes, chunking.for_index(g), i) for g in sorted(wanted) for i in wanted[g]
    )


def test_resolved_config_matches_the_notes(fa_swa: D.VllmDriver) -> None:
    cfg = fa_swa.session().trace().config
    assert cfg.tokens_per_hash == 16 and cfg.scheduler_block_size == 64
    assert cfg.blocks_per_chunk == 2 and cfg.prefix_cache_retention_interval == 0
    assert [(g.index, g.kind, g.tokens_per_block, g.offloaded) for g in cfg.groups] == [
        (0, GroupKind.FULL, 64, True),
        (1, GroupKind.SLIDING_WINDOW, 16, True),
    ]
    assert cfg.num_cpu_chunks == D.DEFAULT_NUM_CPU_CHUNKS
    chunking = resolve(cfg.geometry(), BlocksPerChunk(2), 0)
    assert [gc.tokens_per_chunk for gc in chunking.groups] == [128, 32]
    assert [gc.hashes_per_chunk for gc in chunking.groups] == [8, 2]
    assert [gc.window_in_chunks for gc in chunking.groups] == [None, 4]


def test_7_1_single_prefill_store(fa_swa: D.VllmDriver) -> None:
    """§7.1: one 300-token prefill step stores g0 c0,c1 and g1 c4..c7."""
    s = fa_swa.session()
    s.add_request(RequestSpec("A", PROMPT, max_tokens=2))
    s.step()  # the whole prompt in one step; A keeps running (one more token to go)
    trace = s.trace()
    table = s.block_ids("A")
    req = s.request("A")
    hashes = tuple(bytes(h) for h in req.block_hashes)
    assert len(hashes) == 18  # floor(300 / 16)

    (meta,) = trace.of_type(BuildMeta)
    (sched,) = meta.scheduled
    assert (sched.req_id, sched.num_computed_tokens, sched.num_scheduled_tokens) == ("A", 0, 300)
    assert sched.is_full_table and sched.new_block_ids == tuple(tuple(g) for g in table)
    assert [len(g) for g in table] == [5, 19]
    (rec,) = meta.store_jobs
    job = rec.job
    assert rec.kind == "chunks" and job.req_id == "A"
    assert job.group_sizes == (4, 8)
    assert job.block_indices == (0, 8)
    assert job.block_ids == tuple(table[0][0:4]) + tuple(table[1][8:16])
    assert job.keys == keys_of(hashes, chunking_of(trace), {0: range(2), 1: range(4, 8)})
    # g0.c0 and g1.c3 would share h7, g0.c1 and g1.c7 share h15: same hash, other group.
    assert job.keys[1][:-4] == job.keys[5][:-4] and job.keys[1] != job.keys[5]
    assert rec.cpu_chunk_ids == (0, 1, 2, 3, 4, 5)
    (offer,) = meta.store_offers
    assert offer.offered == offer.accepted == job.keys
    # The worker got exactly what was recorded.
    (sent,) = [d for d in s.dispatched if d.kind == "store"]
    assert (sent.job_id, sent.block_ids, sent.group_sizes, sent.block_indices) == (
        rec.job_id,
        job.block_ids,
        job.group_sizes,
        job.block_indices,
    )


def test_7_4_load_after_gpu_prefix_cache_reset(fa_swa: D.VllmDriver) -> None:
    """§7.4: after a GPU-only reset the same prompt loads 256 tokens, g1 blocks 0..7 null."""
    s = fa_swa.session()
    s.add_request(RequestSpec("A", PROMPT, max_tokens=1))
    s.run_until_idle()
    assert s.reset_prefix_cache()  # GPU only: the CPU tier keeps A's chunks
    s.add_request(RequestSpec("B", PROMPT, max_tokens=3))
    s.step()  # lookup, allocation, load dispatched and (no delay) reported done
    s.step()  # B computes its last 44 prompt tokens
    table = s.block_ids("B")
    s.run_until_idle()
    trace = s.trace()

    (reset,) = trace.of_type(ResetPrefixCache)
    assert reset.success and not reset.connector_reset
    (lookup,) = trace.lookups("B")
    assert (lookup.computed_tokens, lookup.hit_tokens, lookup.load_async) == (0, 256, True)
    assert all(m.result == "hit" for m in lookup.manager_lookups)

    (load,) = trace.load_jobs("B")
    job = load.job
    hashes = tuple(bytes(h) for h in lookup.block_hashes)
    assert (job.computed_tokens, job.hit_tokens) == (0, 256)
    assert job.group_sizes == (4, 8)
    assert job.block_indices == (0, 8)
    assert job.keys == keys_of(hashes, chunking_of(trace), {0: range(2), 1: range(4, 8)})
    assert job.block_ids == tuple(table[0][0:4]) + tuple(table[1][8:16])
    (alloc,) = [a for a in trace.of_type(Alloc) if a.req_id == "B" and a.load is not None]
    assert [b.is_null for b in alloc.blocks[1][:8]] == [True] * 8  # 256-128+1 tokens skipped
    assert alloc.num_external_tokens == 256
    # Same keys as A stored, read back from the same CPU chunks.
    (stored,) = trace.store_jobs("A")
    assert stored.job.keys == job.keys and load.cpu_chunk_ids == stored.cpu_chunk_ids
    # The load is reported done with B in finished_recving; B then computes 44 tokens.
    done = [d for r in trace.of_type(JobsDone) for d in r.done if d.job_id == load.job_id]
    assert done and done[0].success
    first_compute = next(
        r for m in trace.of_type(BuildMeta) for r in m.scheduled if r.req_id == "B" and r.scheduled
    )
    assert (first_compute.num_computed_tokens, first_compute.num_scheduled_tokens) == (256, 44)
    assert trace.store_jobs("B") == ()  # everything B could store is already on CPU


def test_chunked_prefill_shared_prefix_reset_and_abort_run_to_completion(
    fa_swa: D.VllmDriver,
) -> None:
    other = tuple(range(5000, 5200))
    spec = WorkloadSpec(
        requests=(
            RequestSpec("A", PROMPT, max_tokens=3),
            RequestSpec("Q", PROMPT[:200] + other, max_tokens=4, arrival_step=1),
            RequestSpec("R", PROMPT, max_tokens=30, arrival_step=2),
        ),
        max_num_batched_tokens=100,
        resets=(ResetSpec(9, reset_connector=True, reset_running_requests=True),),
        aborts=(AbortSpec(12, "R"),),
    )
    trace = fa_swa.run(spec)
    assert not trace.notes  # finished before max_steps
    assert trace.config.max_num_batched_tokens == 100
    assert {r.req_id for r in trace.of_type(NewRequest)} == {"A", "Q", "R"}
    finished = {r.req_id: r.status for r in trace.of_type(RequestFinished)}
    assert finished == {
        "A": "finished_length_capped",
        "Q": "finished_length_capped",
        "R": "finished_aborted",
    }
    # §7.3 for A (100 tokens a step, retention 0): nothing, then g0.c0 + g1.c4,c5, then g0.c1 + g1.c6,c7.
    a_jobs = trace.store_jobs("A")
    assert [(trace.step_of_job(j.job_id), j.job.group_sizes, j.job.block_indices) for j in a_jobs] == [
        (1, (2, 4), (0, 8)),
        (2, (2, 4), (2, 12)),
    ]
    metas = trace.of_type(BuildMeta)
    assert any(m.preempted_req_ids for m in metas)  # the reset preempted the running requests
    (reset,) = trace.of_type(ResetPrefixCache)
    assert reset.success and reset.connector_reset
    # Every job created was reported done (none outstanding at the end).
    created = {j.job_id for j in trace.store_jobs()} | {j.job_id for j in trace.load_jobs()}
    done = {d.job_id for r in trace.of_type(JobsDone) for d in r.done}
    assert created and created <= done
    # Every BuildMeta snapshot for a request before a reset reflects its stored hashes.
    for m in metas:
        for r in m.scheduled:
            assert len(r.block_hashes) == r.num_tokens // 16 or r.status != "running"

    text = trace.format(verbose=True)
    assert text.startswith("config: OffloadingConnector")
    for needle in ("new      A", "lookup   Q", "STORE job", "reset    gpu+connector", "finished R"):
        assert needle in text, needle
    assert re.search(r"\[\s*1\]   STORE job \d+ A: keys \[g0:[0-9a-f]{8} g1:[0-9a-f]{8}", text)
    assert len(text.splitlines()) > len(trace.records)


def test_recording_does_not_change_behaviour(fa_swa: D.VllmDriver) -> None:
    spec = WorkloadSpec(
        requests=(
            RequestSpec("A", PROMPT, max_tokens=5),
            RequestSpec("B", PROMPT[:150] + tuple(range(7000, 7100)), max_tokens=3, arrival_step=2),
        ),
        max_num_batched_tokens=64,
        resets=(ResetSpec(30),),
    )
    recorded = fa_swa.session(max_num_batched_tokens=64)
    recorded.run(spec)
    plain = fa_swa.session(max_num_batched_tokens=64, record=False)
    plain.run(spec)
    assert plain.dispatched == recorded.dispatched
    assert recorded.dispatched  # and there was something to compare


def test_preemption_with_few_gpu_blocks() -> None:
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_attention_kv_cache_config(block_size=16),
        extra_config={"blocks_per_chunk": 2},
        num_gpu_blocks=64,
    )
    spec = WorkloadSpec(
        requests=tuple(
            RequestSpec(f"r{i}", tuple(range(i * 1000, i * 1000 + 300)), max_tokens=120)
            for i in range(3)
        ),
        max_num_batched_tokens=512,
    )
    trace = driver.run(spec)
    assert not trace.notes
    assert any(m.preempted_req_ids for m in trace.of_type(BuildMeta))
    assert {r.req_id for r in trace.of_type(RequestFinished)} == {"r0", "r1", "r2"}
    # The preempted request comes back with a GPU hit and loads the rest from CPU.
    resumed = [lk for lk in trace.lookups() if lk.num_tokens > lk.num_prompt_tokens]
    assert resumed and any(lk.hit_tokens for lk in resumed)
    for rec in trace.load_jobs():
        j = rec.job
        assert sum(j.group_sizes) == len(j.block_ids)
        assert j.block_indices[0] == j.computed_tokens // 16


def test_delayed_and_failed_jobs(fa_swa: D.VllmDriver) -> None:
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_swa_kv_cache_config(),
        extra_config={"blocks_per_chunk": 2},
        kv_load_failure_policy="recompute",
    )
    spec = WorkloadSpec(
        requests=(
            RequestSpec("A", PROMPT, max_tokens=1),
            RequestSpec("B", PROMPT, max_tokens=1, arrival_step=6),
        ),
        resets=(ResetSpec(5),),
        faults=(JobFault(0, delay_steps=2), JobFault(1, fail=True)),
    )
    trace = driver.run(spec)
    done = {d.job_id: (r.step, d.success) for r in trace.of_type(JobsDone) for d in r.done}
    # Store job 0 is created in step 0, submitted in step 1 (deferred store), due 2 steps later.
    assert done[0] == (3, True)
    # Load job 1 fails: B is reported in failed_recving, recomputes and looks up again.
    assert done[1][1] is False
    loads = trace.load_jobs("B")
    assert len(trace.lookups("B")) == 2
    if V.SUPPORTS_FAILED_TRANSFERS:
        # vLLM 0.34.0: the worker reports the failure (failed_jobs); the request's later
        # lookups skip the offloaded cache ("load_failed"), so nothing is loaded again.
        assert [rec.job_id for rec in loads] == [1]
        assert [rec.hit_tokens for rec in trace.lookups("B")][1] == 0
    else:
        # vLLM 0.33.0: the second lookup hits again and loads again.
        assert [rec.job_id for rec in loads] == [1, 2] and done[2][1] is True

    failed_store = WorkloadSpec(
        requests=(RequestSpec("A", PROMPT, max_tokens=1),), faults=(JobFault(0, fail=True),)
    )
    if V.SUPPORTS_FAILED_TRANSFERS:
        # vLLM 0.34.0 reports a failed store: done but unsuccessful, never published.
        failed = driver.run(failed_store)
        results = [d for r in failed.of_type(JobsDone) for d in r.done if d.job_id == 0]
        assert [d.success for d in results] == [False]
    else:
        with pytest.raises(ValueError, match="cannot report a failed store"):
            driver.run(failed_store)
    lost = driver.run(
        WorkloadSpec(requests=(RequestSpec("A", PROMPT, max_tokens=1),), faults=(JobFault(0, never=True),))
    )
    assert not lost.of_type(JobsDone) and not lost.notes


@pytest.mark.parametrize(
    "make, extra",
    [
        (D.full_attention_kv_cache_config, {"blocks_per_chunk": 4}),
        (D.full_mamba_align_kv_cache_config, {"blocks_per_chunk": 2}),
        (D.swa_eagle_kv_cache_config, {"blocks_per_chunk": 2}),
    ],
)
def test_synthetic_configs_store_then_load(make, extra) -> None:  # type: ignore[no-untyped-def]
    driver = D.VllmDriver.from_kv_cache_config(make(), extra_config=extra, max_num_batched_tokens=128)
    trace = driver.run(
        WorkloadSpec(
            requests=(
                RequestSpec("A", PROMPT, max_tokens=2),
                RequestSpec("B", PROMPT, max_tokens=2, arrival_step=8),
            ),
            resets=(ResetSpec(7),),
        )
    )
    assert trace.store_jobs("A")
    (load,) = trace.load_jobs("B")
    assert load.job.hit_tokens == 256
    stored = {k for j in trace.store_jobs("A") for k in j.job.keys}
    assert set(load.job.keys) <= stored
    if make is D.full_mamba_align_kv_cache_config:
        kinds = {j.kind for j in trace.store_jobs("A")}
        assert kinds == {"chunks", "boundary"}
        assert load.job.group_sizes == (4, 1) and load.job.block_indices == (0, 3)
    lookups = trace.of_type(Lookup)
    assert all(lk.block_hashes for lk in lookups)


def test_kv_transfer_params_reach_the_connector() -> None:
    """``max_load_tokens`` in kv_transfer_params caps the hit (full attention, tpc 64)."""
    driver = D.VllmDriver.from_kv_cache_config(
        D.full_attention_kv_cache_config(block_size=16), extra_config={"blocks_per_chunk": 4}
    )
    trace = driver.run(
        WorkloadSpec(
            requests=(
                RequestSpec("A", PROMPT, max_tokens=1),
                RequestSpec(
                    "B",
                    PROMPT,
                    max_tokens=1,
                    arrival_step=5,
                    kv_transfer_params=(("max_load_tokens", 128),),
                ),
            ),
            resets=(ResetSpec(4),),
        )
    )
    new_b = next(r for r in trace.of_type(NewRequest) if r.req_id == "B")
    assert new_b.kv_transfer_params == (("max_load_tokens", 128),)
    (lookup,) = trace.lookups("B")
    assert lookup.hit_tokens == 128
    (load,) = trace.load_jobs("B")
    assert load.job.group_sizes == (8,) and load.job.block_indices == (0,)
    assert len(load.job.keys) == 2


def test_world_size_above_one_reports_each_job_once_per_worker() -> None:
    """gemma-4 TP2 without a model runner: the TransferEngine reports every job once per worker.

    vLLM's scheduler completes a job after ``world_size`` reports (one per rank);
    one report per job left every store pending while the session said it was idle.
    """
    from conformance.harness.fixture_runs import fixture_driver
    driver = fixture_driver(
        "gemma-4-31B-it-tp2", {"blocks_per_chunk": 1}, num_gpu_blocks=224, num_cpu_chunks=256
    )
    assert driver.vllm_config.parallel_config.world_size == 2
    s = driver.session()
    s.add_request(RequestSpec("A", tuple(range(1000, 1300)), max_tokens=2))
    s.run_until_idle()
    cs = s.connector_scheduler
    assert not cs._jobs, f"jobs still pending after the session went idle: {sorted(cs._jobs)}"
    done = [d for r in s.trace().of_type(JobsDone) for d in r.done]
    assert done and all(d.count == 2 for d in done)
    stores = [d for d in s.dispatched if d.kind == "store"]
    assert stores and cs.manager._num_write_pending_chunks == 0
