"""Data lane, tiered: a chunk survives GPU -> CPU tier -> file -> CPU tier -> GPU.

vLLM's ``TieringOffloadingSpec`` with its file-system tier
(:mod:`vllm_adapter.tiering`: the reference worker moves the GPU <-> CPU bytes
in vLLM's shared-region layout) on the gemma-4 and DeepSeek-V4 fixtures:
``block_size: 512`` through kvchunk's connector and ``blocks_per_chunk``
through the stock one.  The CPU tier holds fewer chunks than the two prompts
store, so chunks are evicted and every stored chunk is cascaded to a file; the
GPU prefix cache and the CPU tier are then reset and the whole CPU region is
poisoned, so a hit for the same prompts can only be served from files, and
every file written must be read back (both prompts served from files).  Every
loaded block must hold its expected bytes and no other byte may change (the
data lane's :class:`~conformance.harness.kvdata.SyntheticModelRunner` checks); the
files written and read, per group, and their sizes go to the report.

``--spec module:Class`` (a ``TieringOffloadingSpec``; kvchunk's
``KvchunkTieringOffloadingSpec`` included, its files counted with their header)
replaces the spec; the fs tier config stays the lane's.  Any other spec is skipped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conformance.testing.requires import require_vllm

require_vllm()

from conformance.harness import safe_fs_faults as SF  # noqa: E402
from conformance.harness import tiered as T  # noqa: E402
from conformance.harness.fixture_runs import FixtureCase  # noqa: E402

pytestmark = pytest.mark.data

from conformance.harness.cases import DSV4, GEMMA  # noqa: E402

CASES = [
    # gemma (0.34.0: 64-token SWA and 128-token full blocks): 11 keys per 600-token prompt
    # (2 chunks in each of the 5 SWA groups, 1 full-attention chunk); 16 CPU chunks hold
    # 16 of the two prompts' 22.
    T.TieredCase(FixtureCase(GEMMA, (("block_size", 512),), True, 384, 16, 600)),
    # Sized for 0.33.0's 32-token scheduler blocks, scaled with the fixture's (150 -> 600
    # tokens on 0.34.0): 11 keys per prompt on both releases.
    T.TieredCase(
        FixtureCase(GEMMA, (("blocks_per_chunk", 4),), False, 224, 16, 150, block_tokens_base=32)
    ),
    # DeepSeek-V4: 5 groups, 256-token blocks; 12 CPU chunks hold fewer than the two
    # prompts store (the test asserts it: files written > CPU chunks).
    T.TieredCase(FixtureCase(DSV4, (("block_size", 512),), True, 256, 12, 600)),
    T.TieredCase(FixtureCase(DSV4, (("blocks_per_chunk", 2),), False, 256, 12, 600)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_chunks_come_back_from_files(
    case: T.TieredCase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    record_property("fixture", case.base.fixture)
    record_property("knob", case.knob)
    driver = case.driver(tmp_path)  # skips a --spec that cannot run here
    kvchunk_tier = SF.chosen_has_kvchunk_tier()
    probe = SF.probe_for(kvchunk_tier).install(monkeypatch)
    session, runner = T.open_session(driver, case.base.workload_budget)
    try:
        rt = T.run_round_trip(
            session, runner, probe, tmp_path, prompt_len=case.base.workload_prompt_len
        )
    finally:
        T.shutdown(session)
    T.record(rt, record_property)
    stats = rt.stats
    summary = f"{stats.describe()}; files {rt.files_after_store}; read {probe.read_per_group()}"
    assert rt.first_pass_loads == 0, f"new prompts loaded something: {summary}"
    assert rt.files_after_store.files > rt.primary_chunks, (
        f"the CPU tier ({rt.primary_chunks} chunks) held everything; nothing was cascaded "
        f"beyond it: {summary}"
    )
    whole = SF.file_bytes(kvchunk_tier, rt.region_bytes_per_chunk)
    for g, sizes in rt.files_after_store.bytes_per_file.items():
        assert sizes == (whole,), (
            f"group {g}: files of {sizes} bytes, whole files of the CPU tier's "
            f"{rt.region_bytes_per_chunk}-byte rows have {whole}: {summary}"
        )
    assert not probe.load_failures and not probe.store_failures, summary
    assert probe.loaded, f"no file was read back: {summary}"
    assert stats.load_jobs > 0 and stats.loaded_blocks_checked > 0, summary
    assert stats.corrupted_loads == 0 and stats.foreign_bytes_changed == 0, summary
    read_groups = set(probe.read_per_group())
    unchecked = set(stats.offloaded_group_ids) - set(stats.checked_per_group)
    assert not unchecked, f"no load reached groups {sorted(unchecked)}: {summary}"
    assert read_groups >= set(stats.checked_per_group), (
        f"groups loaded to the GPU without a file read: {summary}"
    )
    assert all(rt.finished.values()), f"requests left unfinished: {rt.finished}"
    written = {str(path.resolve()) for path in T.block_files(tmp_path)}
    read = {str(Path(path).resolve()) for path in probe.loaded}
    assert read == written, (
        f"both prompts must come back from files: {len(written - read)} of {len(written)} "
        f"files never read, {len(read - written)} read but not written: {summary}"
    )
