"""Faults lane, tiered: engines of two parallel configurations on one root share files only
where vLLM's file mapper does (issue #26, "Sharing kept").

vLLM's ``FileMapper`` keeps one directory per parallel configuration (TP/PP/PCP/DCP sizes,
rank), except where the fs tier asks for sharing and the pages are the same for every
configuration: a parallelism-agnostic canonical layout, or a replicated layout
(``replicated_layout`` on vLLM's offloading spec: MLA at TP > 1 with one KV replica per
rank, DeepSeek's latent KV).  kvchunk's file tier
(:class:`vllm_adapter.disk.tier.KvchunkTieringOffloadingSpec`) names its namespace after the
geometry (:func:`vllm_adapter.disk.options.geometry`), which leaves the parallel sizes
and the rank out exactly there (:func:`vllm_adapter.disk.options.parallel_agnostic`).

* DeepSeek-V4-Flash (the TP4 fixture; the TP2 engine is the same model with the TP
  size and ``kv_tp_replicas`` changed, :func:`conformance.harness.sharing.with_tp_size`,
  which says why its KV bytes are the same): engine 1 (TP4) stores a prompt; engine 2
  (TP2, empty GPU prefix cache and CPU tier, its CPU region poisoned) asks for it and is
  served from engine 1's files -- every one of them read, none written or rewritten, every
  loaded block byte-identical to what engine 1 stored (the data lane's checker).  Then
  the reverse: engine 2 stores another prompt, engine 1 (its CPU tier reset and region
  poisoned) is served from engine 2's files.  Both engines' specs must say
  ``replicated_layout`` (asserted, not assumed).
* gemma-4-31B-it (TP2, sliding window + full attention, KV heads sharded across ranks:
  not replicated): engine 2 at TP4 over the same root gets a namespace of its own,
  every lookup misses and no file is read.

Each case runs on a layout of kvchunk's tier (both in the deep profile; see LAYOUTS_SHARED) through the
tier's real engine path (:mod:`conformance.harness.tiered`'s sessions); ``--spec`` with a
spec other than kvchunk's file tier skips them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from conformance.testing.requires import require_vllm  # noqa: E402

require_vllm()

from conformance.harness import safe_fs_faults as SF  # noqa: E402
from conformance.harness import sharing as SH  # noqa: E402
from conformance.harness import spec_option  # noqa: E402
from conformance.harness import tiered as T  # noqa: E402
from conformance.harness.cases import DSV4, GEMMA  # noqa: E402
from conformance.harness.fixture_runs import FixtureCase  # noqa: E402
from conformance.harness.kvdata import SyntheticModelRunner  # noqa: E402

pytestmark = pytest.mark.faults

PROFILE = os.environ.get("KVCHUNK_PROFILE", "ci")
# CI (about 25 minutes for both releases) runs the sharing case on the packed layout and the
# control on the per-chunk one; ``KVCHUNK_PROFILE=deep`` runs both cases on both layouts.  The
# namespace both layouts share is one function (vllm_adapter.disk.options.namespace_digest).
LAYOUTS_SHARED = ("per_chunk", "packed") if PROFILE == "deep" else ("packed",)
LAYOUTS_APART = ("per_chunk", "packed") if PROFILE == "deep" else ("per_chunk",)
# The faults lane's model cases (test_tiered_faults.py's MODEL_CASES): 600-token prompts.
DSV4_CASE = FixtureCase(DSV4, (("block_size", 512),), True, 256, 12, 600)
GEMMA_CASE = FixtureCase(GEMMA, (("block_size", 512),), True, 256, 16, 600)


def _skip_other_tiers() -> None:
    """A case of kvchunk's file tier: skip when ``--spec`` chose a spec with another tier."""
    chosen = spec_option.chosen()
    if chosen is not None and not SF.chosen_has_kvchunk_tier():
        pytest.skip(f"a case of kvchunk's file tier; --spec {chosen} has another tier")


def _chunks(session: Any, kind: str) -> int:
    """Chunks the session's tier ``stored`` or ``loaded``: files, or sections of packed files."""
    tier = SF.tier_of(session)
    return int(getattr(tier.counters, f"{'sections' if tier.layout == 'packed' else 'files'}_{kind}"))


def _where(session: Any) -> tuple[str, str, dict[str, Any]]:
    """The tier's namespace directory, vLLM's ``FileMapper`` directory in it (relative), and
    the ``FileMapper``'s run config (what vLLM names that directory after)."""
    tier = SF.tier_of(session)
    mapper = tier.file_mapper
    return tier.namespace_dir, str(Path(mapper.base_path).relative_to(tier.namespace_dir)), (
        mapper.get_run_config()
    )


def _served_from_files(runner: SyntheticModelRunner, checked_before: int, what: str) -> None:
    """``runner``'s data checker saw loaded blocks since ``checked_before``, all of them right."""
    stats = runner.stats
    summary = f"{what}: {stats.describe()}"
    assert stats.loaded_blocks_checked > checked_before, f"no block was loaded: {summary}"
    assert stats.corrupted_loads == 0, f"wrong bytes served: {summary}"
    assert stats.foreign_bytes_changed == 0, summary


@pytest.mark.parametrize("layout", LAYOUTS_SHARED)
def test_tp2_and_tp4_deepseek_v4_engines_read_each_others_files(
    layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    """Replicated MLA: a TP4 and a TP2 DeepSeek-V4 engine on one root are served from each
    other's files, byte for byte, and write none of the chunks they read."""
    record_property("fixture", DSV4)
    record_property("knob", f"block_size=512, kvchunk fs tier ({layout}), TP4 and TP2 on one root")
    _skip_other_tiers()
    probe = (SF.PackedProbe() if layout == "packed" else SF.ChunkProbe()).install(monkeypatch)
    p, q = SF.prompts(DSV4_CASE.workload_prompt_len)
    with SH.Engines(DSV4_CASE, tmp_path, layout) as engines:
        tp4, runner4 = engines.open()
        SH.serve(tp4, "a", p)
        written = SH.data_files(tmp_path)
        stored = _chunks(tp4, "stored")
        assert written and stored, f"engine 1 (TP4) wrote no file: {SF.tier_of(tp4).counters}"
        tp2, runner2 = engines.open(tp_size=2)
        for session, tp in ((tp4, 4), (tp2, 2)):
            spec = SH.tier_spec(session)
            assert spec.config.parallel.tp_size == tp == spec.config.parallel.world_size
            assert spec.replicated_layout, f"vLLM's spec at TP{tp}: DeepSeek-V4's KV is not replicated"
        T._poison_region(tp2)
        SH.serve(tp2, "a2", p)
        summary = (f"TP4 {SF.tier_of(tp4).counters} in {_where(tp4)[:2]}; "
                   f"TP2 {SF.tier_of(tp2).counters} in {_where(tp2)[:2]}")
        _served_from_files(runner2, 0, f"TP2 from TP4's files; {summary}")
        assert _chunks(tp2, "loaded") == stored, f"TP2 did not read every TP4 file: {summary}"
        assert SH.data_files(tmp_path) == written, f"TP2 wrote chunks it read: {summary}"
        assert not probe.load_failures, f"{probe.load_failures[:2]}; {summary}"
        assert _where(tp2) == _where(tp4), f"TP2's files live apart from TP4's: {summary}"

        # The reverse: TP2 stores a prompt TP4 never saw; TP4 is served from TP2's files.
        SH.serve(tp2, "b2", q)
        written = SH.data_files(tmp_path)
        assert _chunks(tp2, "stored") > 0, f"TP2 wrote no file: {SF.tier_of(tp2).counters}"
        T.reset_all(tp4)
        T._poison_region(tp4)
        checked, loaded = runner4.stats.loaded_blocks_checked, _chunks(tp4, "loaded")
        SH.serve(tp4, "b4", q)
        summary = f"TP4 {SF.tier_of(tp4).counters}; TP2 {SF.tier_of(tp2).counters}"
        _served_from_files(runner4, checked, f"TP4 from TP2's files; {summary}")
        assert _chunks(tp4, "loaded") - loaded == _chunks(tp2, "stored"), summary
        assert SH.data_files(tmp_path) == written, f"TP4 wrote chunks it read: {summary}"
        assert not probe.load_failures, f"{probe.load_failures[:2]}; {summary}"
    record_property("counter:files_written", len(written))
    record_property("counter:files_read", len(probe.loaded))
    assert SH.namespaces(tmp_path) == [Path(SF.tier_of(tp4).namespace_dir).name]


@pytest.mark.parametrize("layout", LAYOUTS_APART)
def test_gemma_4_engines_of_two_tp_sizes_keep_their_files_apart(
    layout: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, record_property: Any
) -> None:
    """Not replicated (KV heads sharded across ranks): a TP4 gemma-4 engine over a TP2 one's
    root has a namespace of its own, and none of the TP2 engine's files is read."""
    record_property("fixture", GEMMA)
    record_property("knob", f"block_size=512, kvchunk fs tier ({layout}), TP2 and TP4 on one root")
    _skip_other_tiers()
    probe = (SF.PackedProbe() if layout == "packed" else SF.ChunkProbe()).install(monkeypatch)
    (p, _) = SF.prompts(GEMMA_CASE.workload_prompt_len)
    with SH.Engines(GEMMA_CASE, tmp_path, layout) as engines:
        tp2, _ = engines.open()
        SH.serve(tp2, "a", p)
        assert _chunks(tp2, "stored"), f"engine 1 (TP2) wrote no file: {SF.tier_of(tp2).counters}"
        tp4, runner4 = engines.open(tp_size=4)
        for session, tp in ((tp2, 2), (tp4, 4)):
            assert not SH.tier_spec(session).replicated_layout, f"gemma-4 at TP{tp} is replicated"
            parallel = SF.tier_of(session).geometry["parallel"]
            assert parallel.get("tp_size") == tp, f"TP{tp}'s namespace ignores the TP size: {parallel}"
        where2, where4 = _where(tp2), _where(tp4)
        assert where2[2] != where4[2], "vLLM's FileMapper shares gemma-4's files across TP sizes"
        assert where2[0] != where4[0], f"one namespace for TP2 and TP4: {where2[0]}"
        SH.serve(tp4, "a4", p)
        counters = SF.tier_of(tp4).counters
    summary = f"TP4 {counters}; {runner4.stats.describe()}"
    assert counters.lookup_hits == 0 and counters.lookup_misses > 0, summary
    assert not probe.loaded and runner4.stats.loaded_blocks_checked == 0, summary
    assert len(SH.namespaces(tmp_path)) == 2, f"{SH.namespaces(tmp_path)}; {summary}"
