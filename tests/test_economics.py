"""reference.economics and reference.workload: counts stated independently, bad files refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from reference.economics import economics, hashed, serve
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.knobs import BlocksPerChunk, resolve
from reference.plan import Policy
from reference.workload import PRESETS, GpuCache, Span, Workload, load_workload, preset, requests


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


def test_session_hash_chains_equal_per_request_hashing() -> None:
    from reference.keys import prefix_block_hashes

    reqs = list(requests(_workload(sessions=2, turns=3, turn_tokens=Span(10, 50))))
    for req, hashes in hashed(reqs, 4):
        assert tuple(prefix_block_hashes(req.prompt + req.output, 4)) == hashes


@pytest.mark.parametrize("name", PRESETS)
def test_presets_state_their_numbers_and_sources(name: str) -> None:
    w = preset(name)
    assert w.name == name and len(w.source) > 80 and w.description
    total = sum(len(r.prompt) for r in requests(w))
    assert 800_000 <= total <= 1_500_000, f"{name}: {total} prompt tokens, not about 1M"


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
