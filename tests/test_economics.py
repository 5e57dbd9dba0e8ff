"""reference.economics and reference.workload: counts stated independently, bad files refused."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from reference.economics import economics, hashed, serve
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.knobs import BlocksPerChunk, resolve
from reference.plan import Policy
from reference.workload import (
    PRESETS,
    GpuCache,
    Span,
    Workload,
    WorkloadRequest,
    load_workload,
    preset,
    requests,
)


def _full(tpb: int = 16, bpc: int = 2):  # type: ignore[no-untyped-def]
    geometry = Geometry(groups=(KVGroup(0, GroupKind.FULL, tpb),), tokens_per_hash=tpb)
    return resolve(geometry, BlocksPerChunk(bpc))


def _workload(**kw: object) -> Workload:
    base: dict[str, object] = dict(
        name="t", description="", source="", sessions=3, turns=1, system_tokens=0,
        turn_tokens=Span(100, 100), output_tokens=Span(1, 1),
    )
    base.update(kw)
    return Workload(**base)  # type: ignore[arg-type]


def test_disjoint_prompts_write_every_complete_chunk_and_read_nothing() -> None:
    chunking = _full(16, 2)  # 32-token chunks
    e = economics(chunking, _workload(turn_tokens=Span(100, 100)))
    assert e.files_written == 3 * (100 // 32)  # 3 prompts, 3 complete chunks each
    assert e.files_read == 0 and e.offload_hit_tokens == 0
    assert e.prompt_tokens == 300 and e.per_million(e.files_written) == 9 * 10**6 / 300


def test_a_shared_system_prompt_is_written_once_and_read_by_every_later_request() -> None:
    chunking = _full(16, 2)
    e = economics(chunking, _workload(system_tokens=64, turn_tokens=Span(40, 40)))
    # Each prompt is 104 tokens: chunks 0-1 are the shared 64 tokens, chunk 2 its own.
    assert e.files_written == 2 + 3 * 1
    assert e.files_read == 2 * 2 and e.files_read_once == 2
    assert e.offload_hit_tokens == 2 * 64
    # The ideal cache also serves 64 tokens per later request: nothing is lost.
    assert e.recomputed_tokens == 0


def test_an_unaligned_shared_prefix_recomputes_its_partial_chunk() -> None:
    chunking = _full(16, 2)
    e = economics(chunking, _workload(system_tokens=80, turn_tokens=Span(40, 40)))
    # 80 shared tokens = 2 full chunks + 16 tokens of a chunk that also holds private tokens.
    assert e.offload_hit_tokens == 2 * 64
    assert e.ideal_tokens == 2 * 80 and e.recomputed_tail_tokens == 2 * 16


def test_a_hot_shared_prefix_is_a_gpu_hit_and_needs_no_load() -> None:
    chunking = _full(16, 2)
    e = economics(chunking, _workload(system_tokens=64, turn_tokens=Span(40, 40),
                                      gpu_cache=GpuCache.HOT_SHARED_PREFIX))
    assert e.gpu_hit_tokens == 2 * 64 and e.files_read == 0


def test_decode_storing_stores_output_chunks_the_next_turn_reads() -> None:
    chunking = _full(16, 2)
    w = _workload(sessions=1, turns=2, turn_tokens=Span(64, 64), output_tokens=Span(65, 65))
    prompt_only = economics(chunking, w)
    decode = economics(chunking, w, Policy(offload_prompt_only=False))
    assert decode.files_written > prompt_only.files_written
    assert decode.offload_hit_tokens > prompt_only.offload_hit_tokens


def test_two_passes_read_back_what_the_first_stored() -> None:
    chunking = _full(16, 2)
    reqs = list(requests(_workload()))
    first, second = serve(chunking, [reqs, reqs])
    assert sum(second.written.values()) == 0
    assert sum(second.read_once.values()) == sum(first.written.values())


# ---------------------------------------------------------------------------
# The packed layout: one file per store job, each key a section in job order
# ---------------------------------------------------------------------------


def _two_groups(tpb: int = 16, bpc: int = 2):  # type: ignore[no-untyped-def]
    """Two full-attention groups of 32-token chunks: every chunk is two keys."""
    geometry = Geometry(
        groups=(KVGroup(0, GroupKind.FULL, tpb), KVGroup(1, GroupKind.FULL, tpb)),
        tokens_per_hash=tpb,
    )
    return resolve(geometry, BlocksPerChunk(bpc))


def _request(session: int, prompt: range) -> WorkloadRequest:
    return WorkloadRequest(session, 0, tuple(prompt), (1,), 0)


BASE = range(1000, 1100)
"""100 tokens: 3 complete 32-token chunks (c0, c1, c2)."""


def _packed(reqs: list[WorkloadRequest]):  # type: ignore[no-untyped-def]
    from reference.economics import summarize

    chunking = _two_groups()
    (tally,) = serve(chunking, [reqs])
    return summarize("t", chunking, tally, 8192)


def test_one_store_job_of_k_keys_is_one_packed_file_of_k_sections() -> None:
    e = _packed([_request(0, BASE)])
    # 3 chunks x 2 groups = 6 keys, stored by one job (the budget covers the prompt).
    assert e.per_chunk.files_written == 6 and e.per_chunk.sections_written == 6
    assert e.packed.files_written == 1 and e.packed.sections_written == 6
    assert e.packed_per_request.files_written == 1
    # One file: a header page (6 short index entries) + 6 sections of 2 pages each.
    assert e.packed.written_sizes(e.file_bytes) == ((4096 + 6 * 8192, 1),)
    assert e.packed.file_opens == 0 and e.packed.reads == 0


def test_a_load_spread_over_two_files_opens_both() -> None:
    # r0 stores c0 (40 tokens), r1 = r0's tokens + 30 loads c0 and stores c1 (its own job,
    # so its own file), r2 = 100 tokens loads c0 (file 1) and c1 (file 2).
    e = _packed([_request(0, BASE[:40]), _request(1, BASE[:70]), _request(2, BASE)])
    assert e.packed.files_written == 3 and e.per_chunk.files_written == 6
    # Loads: r1 reads c0 (1 file, 2 adjacent sections); r2 reads c0 and c1 (2 files).
    assert e.packed.file_opens == 1 + 2
    assert e.packed.sections_read == 2 + 4 == e.per_chunk.file_opens
    assert e.packed.reads == 1 + 2
    # Every open reads its 2 sections of 2 pages each and not the file's header: the tier's
    # index holds each file's sections, checked by one fstat.
    assert e.packed.opened_sizes(e.file_bytes) == ((2 * 8192, 3),)
    # Read once: r2's c0 was loaded by r1 already.
    assert e.packed.file_opens_once == 1 + 1 and e.packed.sections_read_once == 2 + 2


def test_adjacent_sections_are_one_read_and_a_gap_makes_two() -> None:
    # r0 stores c0-c2 in one file, group-major: [g0c0, g0c1, g0c2, g1c0, g1c1, g1c2].
    # r1 shares 70 tokens: it loads c0 and c1 of both groups, positions {0, 1, 3, 4}: 2 reads.
    # r2 shares all 100 (and has 10 more): it loads every section, {0, ..., 5}: 1 read.
    e = _packed([
        _request(0, BASE),
        _request(1, range(1000, 1070)),
        _request(2, range(1000, 1110)),
    ])
    assert e.packed.file_opens == 2 and e.packed.sections_read == 4 + 6
    assert e.packed.reads == 2 + 1
    assert e.per_chunk.reads == e.per_chunk.file_opens == 4 + 6


def test_a_pass_writes_no_file_for_keys_already_on_disk() -> None:
    chunking = _two_groups()
    reqs = [_request(0, BASE), _request(1, range(2000, 2050))]
    first, second = serve(chunking, [reqs, reqs])
    assert sum(first.packed.files.values()) == 2 and not second.packed.files
    # Pass 2 reads back all of r0's file (3 chunks: 96 tokens <= 99, the hit limit) and of
    # r1's (1 chunk), each whole file one read.
    assert sum(second.packed.opened_once.values()) == 2
    assert second.packed.reads_once == 2


@pytest.mark.parametrize("name", PRESETS)
def test_packing_never_writes_or_opens_more_files_than_per_chunk(name: str) -> None:
    chunking = _two_groups(16, 8)
    e = economics(chunking, preset(name), file_bytes=8192)
    for packed in (e.packed, e.packed_per_request):
        assert packed.sections_written == e.per_chunk.files_written == e.files_written
        assert packed.files_written <= e.per_chunk.files_written
        assert packed.sections_read == e.files_read and packed.file_opens <= e.files_read
        assert packed.sections_read_once == e.files_read_once
        assert packed.file_opens_once <= e.files_read_once
        assert packed.reads <= packed.sections_read
        # Two groups per chunk: a file holds at least two sections.
        assert 2 * packed.files_written <= packed.sections_written
    # A prompt prefilled in one step is stored by one job: one file per request either way.
    w = preset(name)
    if max(len(r.prompt) for r in requests(w)) <= w.max_num_batched_tokens:
        assert e.packed.files_written == e.packed_per_request.files_written
    # Per chunk a file is a section and an open a read.
    assert e.per_chunk.bytes_written(e.file_bytes) == 8192 * e.files_written
    assert e.per_chunk.reads == e.per_chunk.file_opens == e.files_read


def test_session_hash_chains_equal_per_request_hashing() -> None:
    from reference.keys import prefix_block_hashes

    reqs = list(requests(_workload(sessions=2, turns=3, turn_tokens=Span(10, 50))))
    for req, hashes in hashed(reqs, 4):
        assert tuple(prefix_block_hashes(req.prompt + req.output, 4)) == hashes


PRESET_STATEMENTS: dict[str, dict[str, str]] = {
    "chat": {
        "4 turns per conversation": "turns",
        "we take 4 turns": "turns",
        "1,800-token system prompt": "system_tokens",
        "user turns of 32-256": "turn_tokens",
        "outputs of 128-512 tokens": "output_tokens",
        "90 sessions": "sessions",
    },
    "rag": {
        "2 questions per session": "turns",
        "one of 16 long shared documents": "documents",
        "documents (6-10k tokens": "document_tokens",
        "600-token instruction prompt": "system_tokens",
        "questions of 16-96 tokens": "turn_tokens",
        "answers of 128-384 tokens": "output_tokens",
        "60 sessions": "sessions",
    },
    "agentic": {
        "20 tool-use turns per session": "turns",
        "3,000-token system prompt": "system_tokens",
        "20 turns": "turns",
        "tool outputs of 256-2048 tokens": "turn_tokens",
        "model outputs of 64-384 tokens": "output_tokens",
        "4 sessions": "sessions",
    },
}
"""Each phrase of a preset's description or source that states one of its fields."""

PRESET_CITATIONS: dict[str, tuple[str, ...]] = {
    "chat": ("LMSYS-Chat-1M", "(Zheng et al., 2023)", "about 2 turns per conversation", "about 70 user tokens",
             "215 response tokens", "commonly 1-3k tokens"),
    "rag": (),
    "agentic": ("contexts grow to 20-40k tokens",),
}
"""Numbers a preset's text quotes from elsewhere (not its own fields)."""

_TOTAL = re.compile(r"give about (\d+(?:\.\d+)?)M prompt tokens")


def _numbers(phrase: str) -> tuple[int, ...]:
    """The numbers a phrase states: ``1,800`` is 1800, ``6-10k`` is (6000, 10000)."""
    scale = 1000 if re.search(r"\d+k\b", phrase) else 1
    return tuple(int(n.replace(",", "")) * scale for n in re.findall(r"\d[\d,]*\d|\d", phrase))


@pytest.mark.parametrize("name", PRESETS)
def test_presets_state_their_numbers_and_sources(name: str) -> None:
    """Every number a preset's description and source state is one of its TOML fields (or
    a quoted figure from elsewhere, listed), and the stated total is what its requests hold."""
    w = preset(name)
    assert w.name == name and w.description and w.source
    text = " ".join(f"{w.description} {w.source}".split())
    for phrase, field in PRESET_STATEMENTS[name].items():
        assert phrase in text, f"{name}: {phrase!r} is no longer stated; update the statements"
        value = getattr(w, field)
        have = (value.low, value.high) if isinstance(value, Span) else (value,)
        assert _numbers(phrase) == have, f"{name}: {phrase!r} states {field} but the file has {have}"
    stated = _TOTAL.search(text)
    assert stated is not None, f"{name}: the text states no total ('give about XM prompt tokens')"
    total = sum(len(r.prompt) for r in requests(w))
    assert abs(total - float(stated[1]) * 1e6) <= 0.1e6, f"{name}: {total} prompt tokens, not {stated[0]}"
    assert 800_000 <= total <= 1_500_000, f"{name}: {total} prompt tokens, not about 1M"
    rest = text
    for phrase in (*PRESET_STATEMENTS[name], *PRESET_CITATIONS[name], stated[0]):
        rest = rest.replace(phrase, "")
    assert not re.search(r"\d", rest), f"{name}: a number not checked against the file: {rest!r}"


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('name = "x"\nsessions = 2\nturns = 1\nturn_tokens = [1, 2]\n', "output_tokens"),
        ('name = "x"\nsessions = "two"\nturns = 1\nturn_tokens = 5\noutput_tokens = 5\n',
         "sessions"),
        ('name = "x"\nsessions = 2\nturns = 1\nturn_tokens = [9, 2]\noutput_tokens = 5\n',
         "turn_tokens"),
        ('name = "x"\nsessions = 2\nturns = 1\nturn_tokens = 5\noutput_tokens = 5\nfoo = 1\n',
         "foo"),
        ('name = "x"\nsessions = 2\nturns = 1\nturn_tokens = 5\noutput_tokens = 5\n'
         'gpu_cache = "warm"\n', "gpu_cache"),
        ("sessions = [", "not valid TOML"),
    ],
)
def test_a_malformed_workload_file_names_the_field(tmp_path: Path, text: str, names: str) -> None:
    path = tmp_path / "w.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=names):
        load_workload(path)


def test_an_unknown_preset_lists_the_presets() -> None:
    with pytest.raises(ValueError, match="chat, rag, agentic"):
        preset("batch")
