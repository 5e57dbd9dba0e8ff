"""Tiered lane, economics: the files the reference predicts are the files vLLM's fs tier writes.

The operator's disk numbers (``python -m vllm_adapter config``) come from
:mod:`reference.economics`: a workload served through the reference's own store
and lookup rules.  Here the same workload (:mod:`reference.workload`, expanded
to the same requests) runs through vLLM's real scheduler, connector and
``TieringOffloadingSpec`` with its file-system tier, on the gemma-4 and
DeepSeek-V4 fixtures with ``block_size: 512``, under retention 0 (vLLM's
default), a periodic interval and ``None`` (dense), for two workload shapes:
disjoint prompts, and conversations behind a shared system prompt (and, on
DeepSeek-V4, the ``junction`` shape, where the releases' ``offload_junctions``
rules write different files).

Pass 1 serves the workload with the GPU prefix cache reset before every request
(every reuse comes from offload); the files on disk per group must **equal**
the chunks the reference stores.  Then the CPU tier is reset and poisoned, and
pass 2 serves the workload again from files: the files read per group must equal
the chunks the reference loads for the first time in that pass (the CPU tier,
large here, keeps what it promoted).  Tiers are large enough that nothing is
refused: capacity effects are not part of this comparison.

The same passes run through kvchunk's tier (``KvchunkTieringOffloadingSpec``)
with the **packed** layout (per store job a file of its full-attention keys and one of
its window keys, each key a section): the
packed files and sections on disk (per group), and pass 2's file opens and
sections loaded, must equal what :mod:`reference.economics` counts from its own
store and load jobs (read-once: the CPU tier keeps what it promoted), and so must
pass 2's reads (runs of adjacent sections of one file); a load job large enough to split
across the tier's pool opens a file once per slice and reads each run within a slice
(:func:`reference.packed_split.load_slices`, with the tier's threads and part size).

A warm-GPU variant (``-warm_gpu`` cases, DeepSeek-V4, shared-prefix shape)
keeps the GPU prefix cache between requests, with a GPU block pool sized so
that older sessions are evicted (:data:`WARM_GPU_BLOCKS`); the reference predicts
it with ``GpuCache.HOT_SHARED_PREFIX`` (the system prompt rounded down to the lcm
of the groups' tokens per block is a GPU hit, a junction pinned there).  vLLM's
LRU block pool does not keep that (its hits are the sessions' own earlier
prompts): a recorded deviation, so the presets and the CLI default to the cold GPU
this lane checks, and the CLI labels the hot mode "modelled, not checked".

The predicted-versus-written table goes to the report (``econ:`` properties).
A disagreement is a finding: a deviation with its smallest case in
``conformance/protocol/deviations/``, or a fix to the reference.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from conformance.harness import tiered as T  # noqa: E402
from conformance.harness import vllm_harness_api as V  # noqa: E402
from conformance.harness.cases import DSV4, GEMMA  # noqa: E402
from conformance.harness.fixture_runs import FixtureCase  # noqa: E402
from conformance.harness.heavy_lock import one_heavy_lane_per_machine  # noqa: E402,F401 (autouse)
from conformance.protocol import deviations  # noqa: E402
from conformance.protocol.versions import RELEASES, rules_for  # noqa: E402
from reference.economics import serve  # noqa: E402
from reference.layout_economics import PACKED, PackedLoads, layout_economics  # noqa: E402
from reference.workload import GpuCache, Span, Workload, WorkloadRequest, requests  # noqa: E402
from vllm_adapter.disk.fileio import TierFileIO  # noqa: E402

pytestmark = [pytest.mark.data, pytest.mark.xdist_group("heavy")]

OUTPUT_TOKENS = 2
"""Outputs are not stored (prompt-only storing, vLLM's default): two tokens suffice."""

SHAPES: dict[str, Workload] = {
    "disjoint": Workload(
        name="disjoint", description="two unrelated prompts", source="conformance shape",
        sessions=2, turns=1, system_tokens=0, turn_tokens=Span(600, 700),
        output_tokens=Span(OUTPUT_TOKENS, OUTPUT_TOKENS), seed=11,
    ),
    "shared-prefix": Workload(
        name="shared-prefix",
        description="two conversations of two turns behind one unaligned system prompt",
        source="conformance shape", sessions=2, turns=2, system_tokens=700,
        turn_tokens=Span(150, 350), output_tokens=Span(OUTPUT_TOKENS, OUTPUT_TOKENS), seed=12,
    ),
    "junction": Workload(
        name="junction",
        description="three one-turn conversations behind one unaligned system prompt",
        source="conformance shape", sessions=3, turns=1, system_tokens=700,
        turn_tokens=Span(400, 600), output_tokens=Span(OUTPUT_TOKENS, OUTPUT_TOKENS), seed=13,
    ),
}
"""``junction``: under sparse retention the second request's offload hit is cut short of
the full-attention end by windows the first never stored there; vLLM 0.34.0 pins a
junction at that end (``Policy.offload_junctions``), so the third request loads the
system prompt, and 0.33.0 does not, so it recomputes it (the release switch reached
through vLLM: ``tests/test_release_switches.py``)."""
COLD_SHAPES = ("disjoint", "shared-prefix")
"""The shapes every fixture and retention runs."""
RETENTIONS: dict[str, int | None] = {"retention=0": 0, "retention=1024": 1024, "retention=None": None}
BUDGET = 256
"""Prefill tokens per step, vLLM's and the reference's alike."""


@dataclass(frozen=True)
class EconomicsCase:
    fixture: str
    shape: str
    retention: str
    num_cpu_chunks: int
    num_gpu_blocks: int
    gpu_cache: GpuCache = GpuCache.COLD
    """COLD: the GPU prefix cache is reset before every request; HOT_SHARED_PREFIX:
    it is kept between requests (``num_gpu_blocks`` sized so only the shared prefix stays)."""
    switch: str | None = None
    """A :class:`reference.plan.Policy` switch on which the releases differ that this case
    reaches through vLLM: the other releases' setting must predict other files
    (``tests/test_release_switches.py`` holds every such switch to a case)."""

    def __str__(self) -> str:
        warm = "" if self.gpu_cache is GpuCache.COLD else "-warm_gpu"
        return f"{self.fixture}-block_size512-{self.shape}-{self.retention}{warm}"

    @property
    def base(self) -> FixtureCase:
        return FixtureCase(self.fixture, (("block_size", 512),), True, self.num_gpu_blocks,
                           self.num_cpu_chunks,
                           0, budget=BUDGET)

    @property
    def workload(self) -> Workload:
        return SHAPES[self.shape]

    @property
    def retention_interval(self) -> int | None:
        return RETENTIONS[self.retention]


WARM_GPU_BLOCKS = 448
"""DeepSeek-V4's GPU block pool for the warm cases (one pool for its five groups): a
request of the shared-prefix shape allocates about 300-580 blocks over its prefill
(sliding-window blocks are freed as the window moves, most of them in groups 3 and 4),
so blocks are evicted between requests.  Sized for "the shared prefix stays, older
sessions go"; vLLM's LRU pool does otherwise whatever the size (deviation
``gpu-cache-keeps-recent-requests-not-the-shared-prefix``)."""

DEEP = os.environ.get("KVCHUNK_PROFILE", "ci") == "deep"
WARM_RETENTIONS = tuple(RETENTIONS) if DEEP else ("retention=0",)
GEMMA_RETENTIONS = tuple(RETENTIONS) if DEEP else ("retention=0",)
"""gemma-4's files are 40 MiB (2 ranks x 20 MiB) and a case takes minutes on a 2-core
runner: CI runs vLLM's default retention (0), the nightly ``deep`` profile all three."""

CASES = [
    # gemma-4: the CPU tier holds every chunk of a pass.
    *(EconomicsCase(GEMMA, s, r, 48, 512) for s in COLD_SHAPES for r in GEMMA_RETENTIONS),
    # DeepSeek-V4: 2 MiB files, 8- and 16-token chunks in groups 3 and 4 (dense: ~130 per
    # prompt).  GPU blocks: every group of a request fits (one pool; 4-token blocks in group 3).
    *(EconomicsCase(DSV4, s, r, 640, 1024) for s in COLD_SHAPES for r in RETENTIONS),
    EconomicsCase(DSV4, "junction", "retention=0", 640, 1024, switch="offload_junctions"),
    # DeepSeek-V4, GPU prefix cache kept between requests: vLLM keeps other blocks than the
    # modelled shared prefix (a recorded deviation, a strict xfail on both releases).
    *(EconomicsCase(DSV4, "shared-prefix", r, 640, WARM_GPU_BLOCKS, GpuCache.HOT_SHARED_PREFIX)
      for r in WARM_RETENTIONS),
]
PACKED_CASES = [c for c in CASES if c.gpu_cache is GpuCache.COLD]
"""kvchunk's packed tier: the cold cases (the warm question is vLLM's GPU cache, not the tier)."""


def _prompts(workload: Workload) -> list[WorkloadRequest]:
    return list(requests(workload))


def predicted(
    case: EconomicsCase, chunking: Any, reqs: list[WorkloadRequest],
    packed_loads: PackedLoads | None = None, **switches: Any
) -> tuple[Any, Any]:
    """The reference's two passes (GPU cache as the case says, both caches reset between
    passes) under the installed release's rules, ``switches`` changed; ``packed_loads``: how
    the packed tier splits its load jobs (its opens and reads)."""
    policy = dataclasses.replace(
        rules_for(V.VLLM_VERSION).policy, retention_interval=case.retention_interval,
        **switches,
    )
    first, second = serve(chunking, [reqs, reqs], policy, gpu_cache=case.gpu_cache,
                          budget=BUDGET, packed_loads=packed_loads)
    return first, second


@pytest.mark.parametrize("case", CASES, ids=str)
def test_predicted_files_are_the_files_written(
    case: EconomicsCase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    record_property: Any,
    request: pytest.FixtureRequest,
) -> None:
    dev = deviations.find("vllm", "data", str(case))
    if dev is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=dev.xfail_reason()))
    record_property("fixture", case.fixture)
    record_property("knob", f"block_size=512, {case.retention}, {case.shape}")
    reqs = _prompts(case.workload)
    driver = _with_retention(case, tmp_path)
    from vllm_adapter.connector import resolve_for_vllm

    chunking, _ = resolve_for_vllm(driver.vllm_config, driver.kv_cache_config)
    first, second = predicted(case, chunking, reqs)
    probe = T.FileProbe().install(monkeypatch)
    session, runner = T.open_session(driver, BUDGET)
    gpu_hits = _record_gpu_hits(session, monkeypatch)
    try:
        passes = T.run_workload_passes(
            session, probe, tmp_path, [(r.prompt, OUTPUT_TOKENS) for r in reqs],
            warm_gpu=case.gpu_cache is not GpuCache.COLD,
        )
    finally:
        T.shutdown(session)
    groups = [gc.group.index for gc in chunking.groups]
    want_written = {g: first.written[g] + second.written[g] for g in groups}
    want_read = {g: second.read_once[g] for g in groups}
    got_written = {g: passes[-1].written.get(g, 0) for g in groups}
    got_read = {g: passes[-1].read.get(g, 0) for g in groups}
    for g in groups:
        record_property(f"econ:predicted_written:g{g}", want_written[g])
        record_property(f"econ:written:g{g}", got_written[g])
        record_property(f"econ:predicted_read:g{g}", want_read[g])
        record_property(f"econ:read:g{g}", got_read[g])
    record_property("econ:prompt_tokens", first.prompt_tokens)
    if case.switch is not None:
        _assert_separates(case, chunking, reqs, (want_written, want_read))
    stats = runner.stats
    summary = (
        f"{case}: written {got_written} (reference {want_written}); read {got_read} "
        f"(reference {want_read}); GPU hits {gpu_hits} (reference, per pass: "
        f"{first.gpu_hit}, {second.gpu_hit} tokens); {stats.describe()}"
    )
    assert not probe.store_failures and not probe.load_failures, (
        f"file I/O failed, the comparison needs a healthy tier: {probe.store_failures[:2]} "
        f"{probe.load_failures[:2]}; {summary}"
    )
    assert stats.corrupted_loads == 0 and stats.foreign_bytes_changed == 0, summary
    assert passes[0].written == passes[-1].written, (
        f"pass 2 wrote new files (everything was stored in pass 1): {passes[0].written} -> "
        f"{passes[-1].written}; {summary}"
    )
    assert got_written == want_written, f"files written per group differ: {summary}"
    assert got_read == want_read, f"files read per group differ: {summary}"


def _assert_separates(
    case: EconomicsCase, chunking: Any, reqs: list[WorkloadRequest], want: tuple[Any, Any]
) -> None:
    """The other releases' setting of ``case.switch`` predicts other files than this one's."""
    assert case.switch is not None
    mine = getattr(rules_for(V.VLLM_VERSION).policy, case.switch)
    others = {getattr(r.policy, case.switch) for r in RELEASES.values()} - {mine}
    assert others, f"{case}: the releases agree on {case.switch}: the case separates nothing"
    groups = [gc.group.index for gc in chunking.groups]
    for other in others:
        first, second = predicted(case, chunking, reqs, **{case.switch: other})
        alt = ({g: first.written[g] + second.written[g] for g in groups},
               {g: second.read_once[g] for g in groups})
        assert alt != want, (
            f"{case}: {case.switch}={other!r} predicts the same files as {mine!r}: "
            f"the case does not separate the releases"
        )


def _record_gpu_hits(session: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The GPU prefix hit (``num_computed_tokens``) of every offload lookup, in order."""
    connector = session.connector_scheduler
    real = connector.get_num_new_matched_tokens
    hits: list[int] = []

    def lookup(request: Any, num_computed_tokens: int, *args: Any, **kwargs: Any) -> Any:
        hits.append(num_computed_tokens)
        return real(request, num_computed_tokens, *args, **kwargs)

    monkeypatch.setattr(connector, "get_num_new_matched_tokens", lookup)
    return hits


def _with_retention(case: EconomicsCase, root: Path, spec: dict[str, Any] | None = None) -> Any:
    from conformance.harness.fixture_runs import fixture_driver
    from vllm_adapter.names import connector_module

    base = case.base
    return fixture_driver(
        base.fixture, dict(base.extra), num_gpu_blocks=base.num_gpu_blocks,
        num_cpu_chunks=base.num_cpu_chunks, connector=base.connector,
        connector_module_path=connector_module(base.connector),
        spec=T.tiering_spec(root) if spec is None else spec,
        retention_interval=case.retention_interval,
    )


# ---------------------------------------------------------------------------
# kvchunk's tier, packed layout: one or two files per store job (full attention, windows)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TierSnapshot:
    """A packed tier's counters at one moment (:class:`vllm_adapter.disk.chunk_file.TierCounters`)."""

    files_stored: int
    sections_stored: int
    files_opened: int
    sections_loaded: int
    reads: int
    sections_stored_per_group: dict[int, int]
    sections_loaded_per_group: dict[int, int]

    @classmethod
    def of(cls, counters: Any) -> TierSnapshot:
        return cls(
            counters.files_stored, counters.sections_stored, counters.files_opened,
            counters.sections_loaded, counters.reads,
            dict(counters.sections_stored_per_group), dict(counters.sections_loaded_per_group),
        )

    def minus(self, before: TierSnapshot) -> TierSnapshot:
        def sub(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
            return {g: a.get(g, 0) - b.get(g, 0) for g in a.keys() | b.keys()
                    if a.get(g, 0) != b.get(g, 0)}

        return TierSnapshot(
            self.files_stored - before.files_stored,
            self.sections_stored - before.sections_stored,
            self.files_opened - before.files_opened,
            self.sections_loaded - before.sections_loaded,
            self.reads - before.reads,
            sub(self.sections_stored_per_group, before.sections_stored_per_group),
            sub(self.sections_loaded_per_group, before.sections_loaded_per_group),
        )


def packed_on_disk(tier: Any) -> tuple[int, dict[int, int]]:
    """The packed files under the tier's namespace, and their sections per group (headers read)."""
    from vllm_adapter.disk.packed_file import iter_packed_files, read_packed_index

    files = 0
    per_group: dict[int, int] = {}
    for path in iter_packed_files(tier.namespace_dir):
        files += 1
        for section in read_packed_index(path).sections:
            per_group[section.group] = per_group.get(section.group, 0) + 1
    return files, per_group


def _nonzero(counts: dict[int, int]) -> dict[int, int]:
    return {g: n for g, n in sorted(counts.items()) if n}


class CountedReads(TierFileIO):
    """The tier's file I/O, counting the bytes its packed reads return (headers and
    sections: every ``preadv`` of a packed file goes through :meth:`preadv`)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_read = 0
        self._lock = threading.Lock()

    def preadv(self, fd: int, buffers: list[Any], offset: int) -> int:
        n = super().preadv(fd, buffers, offset)
        with self._lock:
            self.bytes_read += n
        return n


@pytest.mark.parametrize("case", PACKED_CASES, ids=lambda c: f"{c}-packed")
def test_predicted_packed_files_are_the_files_kvchunks_tier_writes(
    case: EconomicsCase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    record_property: Any,
    request: pytest.FixtureRequest,
) -> None:
    from conformance.harness import safe_fs_faults as SF

    dev = deviations.find("kvchunk", "data", f"{case}-packed")
    if dev is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=dev.xfail_reason()))
    record_property("fixture", case.fixture)
    record_property("knob", f"block_size=512, {case.retention}, {case.shape}, packed tier")
    reqs = _prompts(case.workload)
    # Nothing is evicted here (the budget is the whole file system); "lru" admits every key,
    # as vLLM's tier writes them.  The rule's admissions ("reachable", the default, leaves
    # out a window chunk that serves no boundary: dense retention's tail) are checked
    # against the reference in test_tiered_eviction_economics.py.
    spec = SF.kvchunk_tiering_spec(tmp_path, layout="packed", eviction="lru")
    driver = _with_retention(case, tmp_path, spec)
    from vllm_adapter.connector import resolve_for_vllm
    from vllm_adapter.disk.tier import KvchunkFileTierManager, configured_load_split

    chunking, _ = resolve_for_vllm(driver.vllm_config, driver.kv_cache_config)
    probe = T.FileProbe().install(monkeypatch)
    monkeypatch.setattr(KvchunkFileTierManager, "file_io_factory", CountedReads)
    session, runner = T.open_session(driver, BUDGET)
    tier = SF.tier_of(session)
    assert tier.layout == "packed", tier.layout
    file_io = tier.file_io
    assert isinstance(file_io, CountedReads)
    # A load job large enough to split across the tier's pool opens a file once per slice
    # and reads each run within a slice (reference.packed_split.load_slices, the tier's rule).
    # The split is the one the operator CLI predicts with, from the tier's entry alone.
    split = tier.load_split
    (entry,) = spec["secondary_tiers"]
    assert split == configured_load_split(entry), (split, entry)
    section_bytes = {gc.group.index: tier.section_bytes for gc in chunking.groups}
    first, second = predicted(case, chunking, reqs, None if split is None else PackedLoads(
        split, section_bytes))
    snapshots: list[TierSnapshot] = []
    bytes_read: list[int] = []

    def after_pass(_: Any) -> None:
        snapshots.append(TierSnapshot.of(tier.counters))
        bytes_read.append(file_io.bytes_read)

    try:
        T.run_workload_passes(
            session, probe, tmp_path, [(r.prompt, OUTPUT_TOKENS) for r in reqs],
            after_pass=after_pass, warm_gpu=case.gpu_cache is not GpuCache.COLD,
        )
        files_on_disk, sections_on_disk = packed_on_disk(tier)
    finally:
        T.shutdown(session)
    pass1, pass2 = snapshots[0], snapshots[1].minus(snapshots[0])
    counters = tier.counters
    groups = [gc.group.index for gc in chunking.groups]
    packed1, packed2 = (layout_economics(PACKED, t.packed) for t in (first, second))
    want = {
        "files written": packed1.files_written + packed2.files_written,
        "sections written": _nonzero({g: first.written[g] + second.written[g] for g in groups}),
        "file opens (pass 2, read once)": packed2.file_opens_once,
        "sections read (pass 2, read once)": _nonzero({g: second.read_once[g] for g in groups}),
        "reads (pass 2, read once)": packed2.reads_once,
        # What the CLI prices a load's reads at (LayoutEconomics.read_size).
        "bytes read (pass 2, read once)": packed2.bytes_read(section_bytes, once=True),
    }
    got = {
        "files written": files_on_disk,
        "sections written": _nonzero(sections_on_disk),
        "file opens (pass 2, read once)": pass2.files_opened,
        "sections read (pass 2, read once)": _nonzero(pass2.sections_loaded_per_group),
        "reads (pass 2, read once)": pass2.reads,
        "bytes read (pass 2, read once)": bytes_read[1] - bytes_read[0],
    }
    for name in want:
        record_property(f"econ:packed:predicted {name}", want[name])
        record_property(f"econ:packed:{name}", got[name])
    stats = runner.stats
    summary = f"{case} packed: tier {got} (reference {want}); pass 1 {pass1}; {stats.describe()}"
    assert counters.store_failures == 0 and counters.load_failures == 0, (
        f"file I/O failed, the comparison needs a healthy tier: {list(counters.recent_bad)[:2]}; "
        f"{summary}"
    )
    assert counters.bad_sections == 0 and not counters.bad_files, summary
    assert stats.corrupted_loads == 0 and stats.foreign_bytes_changed == 0, summary
    assert pass2.files_stored == 0, f"pass 2 wrote new files (pass 1 stored everything): {summary}"
    # The tier's own counters agree with what is on disk.
    assert (pass1.files_stored, _nonzero(pass1.sections_stored_per_group)) == (
        files_on_disk, _nonzero(sections_on_disk)), summary
    assert got == want, f"the packed tier differs from the reference: {summary}"
