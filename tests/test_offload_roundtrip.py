"""The issue's done-when check, per model geometry.

For both model geometries, a real vLLM Scheduler with the kvchunk connector and
``{"block_size": 512}`` builds, giving gemma-4 B=16 and DeepSeek-V4 B=2.  A
5000-token prompt is stored.  After a GPU prefix-cache reset it is loaded back
through the reference spec's worker, and the loaded bytes equal the stored bytes.

Path: :func:`conformance.harness.fixture_runs.fixture_driver` (the stored fixture's engine
config, ``KvchunkOffloadingConnector``, ``ReferenceOffloadingSpec``, KV tensors
re-planned by vLLM for a small GPU pool) and
:class:`conformance.harness.kvdata.SyntheticModelRunner` (deterministic bytes for every
computed token, poisoned load destinations, per-position expected-bytes checks).
On top of the runner's checks, this test keeps a copy of every GPU block the
reference worker stores (all layers of its group, read through the runner's
view of vLLM's KV memory) and compares every block it loads with that copy,
byte for byte, at the same (group, position).

Expected numbers (docs/semantics.md, worked examples): the reload hit is 4608
tokens (the last 512-token boundary below 5000); gemma-4 loads chunks 0-8 of the
full group and chunks 14-17 of each sliding-window group (144 and 64 blocks
each with vLLM 0.33.0's 16-token blocks); DeepSeek-V4 loads 18 blocks of the MLA
group, 2 of each 64-token and 4-token sliding group (one chunk each) and 16 of
the 8-token one (8 chunks).

The block counts follow the stored fixture's geometry (its resolved scheduler
block size, see :class:`Geometry`): vLLM 0.34.0 plans gemma-4 with 64-token
blocks (0.33.0: 16), so ``block_size: 512`` gives B=4 instead of 16 and the same
chunks hold a quarter of the blocks.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from conformance.testing.requires import require_vllm

require_vllm()

import torch  # noqa: E402

from conformance.harness.fixture_runs import fixture_driver  # noqa: E402
from conformance.harness.kvdata import SyntheticModelRunner  # noqa: E402
from conformance.protocol.trace import RequestSpec  # noqa: E402
from vllm_adapter.fixtures import load_fixture  # noqa: E402

pytestmark = pytest.mark.vllm

KVCHUNK = "KvchunkOffloadingConnector"
KVCHUNK_MODULE = "vllm_adapter.connector"
PROMPT_TOKENS = 5000
HIT_TOKENS = 4608
BUDGET = 512  # chunked prefill keeps the sliding-window groups' GPU footprint small


@dataclass(frozen=True)
class Geometry:
    """The expected numbers for one stored geometry of a fixture."""

    blocks_per_chunk: int
    loaded_blocks: dict[int, int]
    num_gpu_blocks: int


@dataclass(frozen=True)
class Case:
    fixture: str
    geometries: dict[int, Geometry]
    """By the fixture's resolved scheduler block size (tokens)."""
    num_cpu_chunks: int

    def __str__(self) -> str:
        return self.fixture

    def geometry(self) -> Geometry:
        block = int(load_fixture(self.fixture)["resolved"]["scheduler_block_size"])
        if block not in self.geometries:
            pytest.fail(
                f"{self.fixture}: no expected numbers for a {block}-token scheduler block "
                f"(known: {sorted(self.geometries)}); work them out as docs/semantics.md does"
            )
        return self.geometries[block]


CASES = [
    Case(
        "gemma-4-31B-it-tp2",
        {
            # vLLM 0.33.0: 16-token sliding-window blocks, 32-token full-attention blocks.
            32: Geometry(
                16,
                {0: 64, 1: 64, 2: 64, 3: 64, 4: 64, 5: 144},
                num_gpu_blocks=672,  # 1.25 MiB blocks; the prefill peaks near 650
            ),
            # vLLM 0.34.0 raised gemma-4's block size to 64 tokens (128 for the full
            # group): B=4, the same chunks (256 / 512 tokens) of a quarter the blocks.
            128: Geometry(
                4,
                {0: 16, 1: 16, 2: 16, 3: 16, 4: 16, 5: 36},
                num_gpu_blocks=168,  # 5 MiB blocks: the same bytes as 672 above
            ),
        },
        num_cpu_chunks=48,  # 29 chunks stored, 20 MiB slots
    ),
    Case(
        "deepseek-v4-flash-tp4",
        {
            256: Geometry(
                2,
                {0: 2, 1: 2, 2: 18, 3: 2, 4: 16},
                num_gpu_blocks=512,  # 1002240-byte packed blocks
            ),
        },
        num_cpu_chunks=64,  # 20 chunks stored
    ),
]


@dataclass
class ByteLedger:
    """GPU bytes the reference worker stored, by (group, position), and the load comparisons."""

    stored: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    stored_blocks: dict[int, int] = field(default_factory=dict)
    loaded_blocks: dict[int, int] = field(default_factory=dict)
    bytes_compared: int = 0
    mismatches: list[str] = field(default_factory=list)
    never_stored: list[tuple[int, int]] = field(default_factory=list)


def _group_blocks(
    runner: SyntheticModelRunner, worker: Any, gpu_side: Any
) -> list[tuple[int, list[int]]]:
    """``(group id, block ids)`` per offloaded group of a job's GPU side (group-major).

    ``gpu_side`` is what the worker's ``submit_*`` got (a ``GPULoadStoreSpec``
    on vLLM 0.33.0, ``DevicePointers`` on 0.34.0), decoded by the worker.
    """
    gpu = worker.gpu_blocks(gpu_side)
    out = []
    cursor = 0
    ids = [int(b) for b in gpu.block_ids]
    for pos, n in enumerate(gpu.group_sizes):
        n = int(n)
        if n:
            out.append((runner.offloaded_group_ids[pos], ids[cursor : cursor + n]))
        cursor += n
    return out


def _rows(runner: SyntheticModelRunner, gid: int, block_ids: list[int]) -> list[torch.Tensor]:
    """Per layer of the group, ``[len(block_ids), words]``: the blocks' bytes (a copy).

    Read through ``LayerPages.data`` (int64 words where the page allows, else
    uint8), exactly the unpadded page bytes the runner writes and checks.
    """
    idx = torch.tensor(block_ids, dtype=torch.int64)
    return [layer.data.index_select(0, idx) for layer in runner.group_layers[gid]]


def _positions(session: Any, req_id: str, gid: int, block_ids: list[int]) -> list[int]:
    """Positions of ``block_ids`` in the request's current block table of group ``gid``."""
    table = list(session.block_ids(req_id)[gid])
    where = {b: i for i, b in enumerate(table) if b != 0}
    missing = [b for b in block_ids if b not in where]
    assert not missing, f"group {gid}: blocks {missing[:5]} of a job are not in {req_id}'s table"
    return [where[b] for b in block_ids]


def _job_req_id(session: Any, job_id: int, kind: str) -> str:
    for job in reversed(session.dispatched):
        if job.job_id == job_id and job.kind == kind:
            return str(job.req_id)
    raise AssertionError(f"{kind} job {job_id} was not dispatched")


def _install_ledger(session: Any, runner: SyntheticModelRunner) -> ByteLedger:
    """Wrap the reference worker's submit_store / submit_load (instance attributes)."""
    ledger = ByteLedger()
    worker = session.worker_connector.connector_worker.worker
    real_store, real_load = worker.submit_store, worker.submit_load

    def submit_store(job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        req_id = _job_req_id(session, job_id, "store")
        for gid, job_block_ids in _group_blocks(runner, worker, src_spec):
            # vLLM 0.34.0 keeps null blocks (id 0) inside a stored chunk as placeholders
            # (0.33.0 left them out): they hold nothing of the request, so nothing to record.
            block_ids = [b for b in job_block_ids if b != 0]
            if not block_ids:
                continue
            positions = _positions(session, req_id, gid, block_ids)
            rows = _rows(runner, gid, block_ids)
            for k, position in enumerate(positions):  # rows are copies: views suffice
                ledger.stored[(gid, position)] = [r[k] for r in rows]
            ledger.stored_blocks[gid] = ledger.stored_blocks.get(gid, 0) + len(block_ids)
        return bool(real_store(job_id, src_spec, dst_spec))

    def submit_load(job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        ok = bool(real_load(job_id, src_spec, dst_spec, expedited))
        req_id = _job_req_id(session, job_id, "load")
        for gid, block_ids in _group_blocks(runner, worker, dst_spec):
            positions = _positions(session, req_id, gid, block_ids)
            rows = _rows(runner, gid, block_ids)
            ledger.loaded_blocks[gid] = ledger.loaded_blocks.get(gid, 0) + len(block_ids)
            missing = [(gid, p) for p in positions if (gid, p) not in ledger.stored]
            if missing:
                ledger.never_stored += missing
                continue
            for i, (layer, after) in enumerate(zip(runner.group_layers[gid], rows, strict=True)):
                before = torch.stack([ledger.stored[(gid, p)][i] for p in positions])
                ledger.bytes_compared += before.numel() * before.element_size()
                if not torch.equal(before, after):
                    bad = (before != after).any(dim=1).nonzero().flatten().tolist()
                    ledger.mismatches += [
                        f"group {gid} position {positions[k]} layer {layer.name}" for k in bad
                    ]
        return ok

    worker.submit_store = submit_store
    worker.submit_load = submit_load
    return ledger


def _record_hits(session: Any) -> list[tuple[str, Any]]:
    """Every answer of the connector scheduler's ``get_num_new_matched_tokens``."""
    cs = session.connector_scheduler
    real = cs.get_num_new_matched_tokens
    hits: list[tuple[str, Any]] = []

    def get_num_new_matched_tokens(request: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(request, *args, **kwargs)
        hits.append((request.request_id, result))
        return result

    cs.get_num_new_matched_tokens = get_num_new_matched_tokens
    return hits


@pytest.mark.parametrize("case", CASES, ids=str)
def test_5000_token_prompt_round_trips_through_the_reference_worker(
    case: Case, record_property: Any
) -> None:
    start = time.perf_counter()
    geo = case.geometry()
    driver = fixture_driver(
        case.fixture,
        {"block_size": 512},
        num_gpu_blocks=geo.num_gpu_blocks,
        num_cpu_chunks=case.num_cpu_chunks,
        connector=KVCHUNK,
        connector_module_path=KVCHUNK_MODULE,
    )
    runner = SyntheticModelRunner(driver.worker_kv_cache_config, driver.vllm_config)
    session = driver.session(model_runner=runner, max_num_batched_tokens=BUDGET, record=False)

    # The Scheduler built with the kvchunk connector; block_size 512 became one B.
    connector = session.scheduler.connector
    assert type(connector).__name__ == KVCHUNK
    assert connector.kvchunk_extra_config["blocks_per_chunk"] == geo.blocks_per_chunk
    assert "block_size" not in connector.kvchunk_extra_config
    assert session.connector_scheduler.config.blocks_per_chunk == geo.blocks_per_chunk
    worker = session.worker_connector.connector_worker.worker
    assert type(worker).__name__ == "ReferenceOffloadingWorker"
    assert set(worker.layout.blocks_per_chunk) == {geo.blocks_per_chunk}

    ledger = _install_ledger(session, runner)
    hits = _record_hits(session)
    rng = random.Random(5000)
    prompt = tuple(rng.randrange(100, 30000) for _ in range(PROMPT_TOKENS))

    # Store: prefill the prompt (chunked), let its stores finish.
    built = time.perf_counter()
    session.add_request(RequestSpec("store", prompt, max_tokens=1))
    session.run_until_idle()
    assert ledger.stored, "nothing was stored"
    # Load: empty the GPU prefix cache, send the same prompt again.
    stored = time.perf_counter()
    assert session.reset_prefix_cache(), "GPU prefix-cache reset refused"
    session.add_request(RequestSpec("load", prompt, max_tokens=1))
    session.run_until_idle()
    loaded = time.perf_counter()

    load_hits = [r for req, r in hits if req == "load" and r[0] is not None]
    assert load_hits, f"no lookup answered for the reloaded prompt: {hits}"
    hit_tokens = int(load_hits[-1][0])
    stats = runner.stats
    summary = (
        f"{case.fixture} block_size=512 -> B={geo.blocks_per_chunk}: prompt {PROMPT_TOKENS}, "
        f"reload hit {hit_tokens} tokens; stored blocks per group "
        f"{dict(sorted(ledger.stored_blocks.items()))}; loaded blocks per group "
        f"{dict(sorted(ledger.loaded_blocks.items()))}; {ledger.bytes_compared} bytes compared "
        f"stored vs loaded, {len(ledger.mismatches)} mismatched blocks; runner: "
        f"{stats.describe()}; build {built - start:.1f}s, store {stored - built:.1f}s, "
        f"reload {loaded - stored:.1f}s"
    )
    print(summary)
    record_property("summary", summary)

    assert hit_tokens == HIT_TOKENS, summary
    assert stats.load_jobs == 1, summary
    assert ledger.loaded_blocks == geo.loaded_blocks, summary
    assert dict(stats.checked_per_group) == geo.loaded_blocks, summary
    assert not ledger.never_stored, f"loaded blocks never stored: {ledger.never_stored[:5]}"
    assert not ledger.mismatches, f"{ledger.mismatches[:5]}; {summary}"
    page_bytes = {
        gid: sum(layer.nbytes for layer in runner.group_layers[gid]) for gid in geo.loaded_blocks
    }
    expected_bytes = sum(n * page_bytes[gid] for gid, n in geo.loaded_blocks.items())
    assert ledger.bytes_compared == expected_bytes, summary
    assert stats.corrupted_loads == 0, summary
    assert stats.foreign_bytes_changed == 0, summary
