"""Input validation of the reference API: a clear ValueError, and nothing written partially.

Already covered elsewhere (not repeated here):

* ``tests/test_transfer.py`` -- ``MUTATIONS`` / ``test_each_invalid_input_raises_and_writes_nothing``
  and its hypothesis twin: wrong dtype (int8 canonical tensor or pool), 1-D / 3-D
  tensors, rows of the wrong width (canonical tensor and pool), overlapping rows
  of a canonical tensor, too few canonical tensors, canonical tensors on two
  devices, block / slot ids out of range, negative or duplicated, one id too
  many or too few, ``group_sizes`` / ``block_indices`` of the wrong length or
  negative, float block ids; ``test_layout_rejects_nonsense`` for layouts.
* ``tests/test_store.py`` -- ``test_misuse_raises_and_changes_nothing`` (repeated
  keys in one offer, a ``str`` key, loads of pending or absent keys, completing a
  load that is not in flight, ``ChunkStore(-1)``), ``test_failed_store_is_visible_to_nobody``,
  ``test_ref_counts_per_occurrence`` and ``test_evict_drops_only_ready_unpinned_entries``.

Here: arguments that are not tensors, tensors without bytes (the ``meta``
device), non-contiguous rows, an overlapping or narrow chunk pool, a pool
without slots, a bad tensor *late* in the list (so validation must finish
before the first copy), canonical tensors of different lengths, ids that are
``None``, strings, out of the int64 range, boolean / 2-D / complex tensors,
malformed ``group_sizes`` / ``block_indices``; for the store, malformed
constructor arguments and every key-taking method given ``None``, a single key,
a string or a list holding a non-``bytes`` key.  Every case checks that every
tensor (and the store's bookkeeping) is bitwise unchanged afterwards.

Last, chunk knobs longer than ``max_model_len`` (issue #16, "Bad input"): the
reference (``Geometry.max_model_len``) and the connector (vLLM's
``model_config.max_model_len``) refuse a knob whose longest chunk exceeds it,
naming the knob, that group and the largest valid value -- computed here by brute
force over the existing rules, then checked to be accepted while the next valid
value is refused.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from conformance.testing.requires import require_vllm
from reference.geometry import Geometry, GroupKind, KVGroup
from reference.knobs import (
    BlockSize,
    BlocksPerChunk,
    Knob,
    PerGroupBlocksPerChunk,
    parse_knob,
    resolve,
)
from reference.store import ChunkStore
from reference.transfer import TensorRef, TransferLayout, gather, scatter
from reference.transfer_fast import plan_copies
from reference.workload import (
    MAX_PROMPT_TOKENS,
    MAX_SESSIONS,
    MAX_TOTAL_PROMPT_TOKENS,
    MAX_TURNS,
    PRESETS,
    load_workload,
    preset,
    requests,
)

# Two canonical tensors; group 1 reads both (tensor 0 partially).  B = (2, 3).
LAYOUT = TransferLayout((8, 16), ((TensorRef(0, 8),), (TensorRef(1, 9), TensorRef(0, 3))), (2, 3))
JOB: dict[str, Any] = dict(block_ids=(3, 1, 2), group_sizes=(1, 2), block_indices=(1, 4),
                           slot_ids=(0, 1))
NUM_BLOCKS, NUM_SLOTS = 5, 3
DIRECTIONS = [gather, scatter]


def _tensors(seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gpu = [torch.randint(0, 256, (NUM_BLOCKS, p), dtype=torch.uint8, generator=g)
           for p in LAYOUT.page_bytes]
    pool = torch.randint(0, 256, (NUM_SLOTS, LAYOUT.slot_bytes), dtype=torch.uint8, generator=g)
    return gpu, pool


def test_the_base_job_is_valid() -> None:
    """Each case below changes one thing of this job; unchanged, both directions accept it."""
    for direction in DIRECTIONS:
        gpu, pool = _tensors()
        direction(LAYOUT, gpu, pool, **JOB)


def _rejects(direction: Callable[..., None], gpu: list[Any], pool: Any, job: dict[str, Any],
             needle: str) -> None:
    """ValueError mentioning ``needle``; every real tensor given is bitwise unchanged."""
    real = [t for t in [*gpu, pool] if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    before = [t.clone() for t in real]
    with pytest.raises(ValueError) as info:
        direction(LAYOUT, gpu, pool, **job)
    assert needle in str(info.value), str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(real, before, strict=True))


# -- tensors ------------------------------------------------------------------

TENSOR_CASES: dict[str, tuple[Callable[[list[torch.Tensor], torch.Tensor], tuple[Any, Any]], str]] = {
    "gpu tensor is a numpy array": (lambda g, p: ([g[0].numpy(), g[1]], p), "gpu_tensors[0] must be a torch.Tensor"),
    "gpu tensor is None": (lambda g, p: ([g[0], None], p), "gpu_tensors[1] must be a torch.Tensor"),
    "pool is a list": (lambda g, p: (g, p.tolist()), "pool must be a torch.Tensor"),
    "gpu tensors on the meta device": (
        lambda g, p: ([torch.empty_like(t, device="meta") for t in g], p), "meta device"),
    "pool on the meta device": (lambda g, p: (g, torch.empty_like(p, device="meta")), "meta device"),
    "gpu rows not contiguous": (
        lambda g, p: ([torch.zeros(NUM_BLOCKS, 16, dtype=torch.uint8)[:, ::2], g[1]], p),
        "contiguous rows"),
    "pool rows not contiguous": (
        lambda g, p: (g, torch.zeros(NUM_SLOTS, 2 * LAYOUT.slot_bytes, dtype=torch.uint8)[:, ::2]),
        "contiguous rows"),
    "pool rows overlap": (
        lambda g, p: (g, p.as_strided(p.shape, (LAYOUT.slot_bytes // 2, 1))), "rows overlap"),
    "chunk buffer too narrow": (
        lambda g, p: (g, torch.zeros(NUM_SLOTS, LAYOUT.slot_bytes - 1, dtype=torch.uint8)),
        "bytes wide"),
    "pool without slots": (lambda g, p: (g, p[:0]), "out of range for the pool"),
    "last gpu tensor float": (lambda g, p: ([g[0], g[1].float()], p), "gpu_tensors[1] has dtype"),
    "last gpu tensor too wide": (
        lambda g, p: ([g[0], torch.zeros(NUM_BLOCKS, 17, dtype=torch.uint8)], p),
        "gpu_tensors[1] rows are 17 bytes wide"),
    "second tensor shorter than a block id it holds": (
        lambda g, p: ([g[0], g[1][:2]], p), "out of range for gpu_tensors[1]"),
}


@pytest.mark.parametrize("direction", DIRECTIONS, ids=["gather", "scatter"])
@pytest.mark.parametrize("case", sorted(TENSOR_CASES))
def test_bad_tensors(direction: Callable[..., None], case: str) -> None:
    gpu, pool = _tensors()
    make, needle = TENSOR_CASES[case]
    bad_gpu, bad_pool = make(gpu, pool)
    _rejects(direction, list(bad_gpu), bad_pool, JOB, needle)
    # The untouched originals too (some cases hand over views of them).
    fresh_gpu, fresh_pool = _tensors()
    assert all(torch.equal(a, b) for a, b in zip(gpu, fresh_gpu, strict=True))
    assert torch.equal(pool, fresh_pool)


# -- ids ----------------------------------------------------------------------

ID_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "block_ids None": ({"block_ids": None}, "block_ids must be a sequence"),
    "block_ids a string": ({"block_ids": "312"}, "block_ids must be a sequence"),
    "block_ids bytes": ({"block_ids": b"\x03\x01\x02"}, "block_ids must be a sequence"),
    "block_ids an int": ({"block_ids": 3}, "block_ids must be a sequence"),
    "block id beyond int64": ({"block_ids": (3, 1, 2**63)}, "block_ids holds an id outside"),
    "block id far below int64": ({"block_ids": (3, 1, -(2**70))}, "block_ids holds an id outside"),
    "numpy uint64 block id beyond int64": (
        {"block_ids": np.array([3, 1, 2**63], dtype=np.uint64)}, "block_ids holds an id outside"),
    "block id a string": ({"block_ids": (3, "1", 2)}, "block_ids must hold integers"),
    "block id a bool": ({"block_ids": (3, True, 2)}, "block_ids must hold integers"),
    "bool tensor": ({"block_ids": torch.tensor([True, False, True])}, "must hold integers"),
    "2-D tensor": ({"block_ids": torch.tensor([[3, 1, 2]])}, "flat list"),
    "complex tensor": ({"slot_ids": torch.tensor([0, 1], dtype=torch.complex64)}, "must hold integers"),
    "integral float tensor": ({"slot_ids": torch.tensor([0.0, 1.0])}, "must hold integers"),
    "slot_ids None": ({"slot_ids": None}, "slot_ids must be a sequence"),
    "group_sizes None": ({"group_sizes": None}, "group_sizes must be a sequence"),
    "group_sizes float": ({"group_sizes": (1.0, 2)}, "group_sizes[0] must be an int"),
    "group_sizes bool": ({"group_sizes": (True, 2)}, "group_sizes[0] must be an int"),
    "block_indices a string": ({"block_indices": "14"}, "block_indices must be a sequence"),
    "block_indices None entry": ({"block_indices": (1, None)}, "block_indices[1] must be an int"),
}


@pytest.mark.parametrize("direction", DIRECTIONS, ids=["gather", "scatter"])
@pytest.mark.parametrize("case", sorted(ID_CASES))
def test_bad_ids(direction: Callable[..., None], case: str) -> None:
    change, needle = ID_CASES[case]
    gpu, pool = _tensors()
    _rejects(direction, gpu, pool, {**JOB, **change}, needle)


@pytest.mark.parametrize("case", sorted(ID_CASES))
def test_plan_copies_rejects_the_same_ids(case: str) -> None:
    change, needle = ID_CASES[case]
    with pytest.raises(ValueError, match="must|holds|flat"):
        plan_copies(LAYOUT, **{**JOB, **change})


def test_numpy_ids_are_accepted() -> None:
    """What vLLM's specs carry (numpy int arrays) is not a mistake."""
    gpu, pool = _tensors()
    job = {k: np.asarray(v) for k, v in JOB.items()}
    gather(LAYOUT, gpu, pool, **job)
    scatter(LAYOUT, gpu, pool, **job)


# -- the store ----------------------------------------------------------------

A, B, C = b"key-a", b"key-b", b"key-c"


def _snapshot(store: ChunkStore) -> tuple[Any, ...]:
    entries = tuple((k, e.slot, e.ready, e.ref_count) for k, e in store._entries.items())
    pool = None if store.pool is None else store.pool.clone()
    return entries, tuple(store._free), store._num_fresh, store.generation, pool


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    *rest_a, pool_a = a
    *rest_b, pool_b = b
    return rest_a == rest_b and (pool_a is None) == (pool_b is None) and (
        pool_a is None or torch.equal(pool_a, pool_b)
    )


def _busy_store() -> ChunkStore:
    """A ready key A (pinned once), a ready key B, a pending key C, one free slot; pool bytes random."""
    store = ChunkStore(4, 16)
    assert store.pool is not None
    store.pool.copy_(torch.randint(0, 256, store.pool.shape, dtype=torch.uint8))
    store.prepare_store([A, B])
    store.complete_store([A, B])
    store.prepare_store([C])
    store.prepare_load([A])
    return store


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((True,), "num_slots"),
        ((2.0,), "num_slots"),
        (("4",), "num_slots"),
        ((None,), "num_slots"),
        ((4, 0), "slot_bytes"),
        ((4, -16), "slot_bytes"),
        ((4, True), "slot_bytes"),
        ((4, 16.0), "slot_bytes"),
        ((4, "16"), "slot_bytes"),
    ],
)
def test_store_constructor(args: tuple[Any, ...], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        ChunkStore(*args)


BAD_KEYS: dict[str, Any] = {
    "None": None,
    "a single key": A,
    "a string": "key-a",
    "an int": 7,
    "a bytearray key": [bytearray(A)],
    "a str key after a good one": [A, "key-b"],
    "a None key": [None],
}
KEY_METHODS: dict[str, Callable[[ChunkStore, Any], Any]] = {
    "prepare_store": lambda s, k: s.prepare_store(k),
    "complete_store": lambda s, k: s.complete_store(k),
    "complete_store(success=False)": lambda s, k: s.complete_store(k, success=False),
    "prepare_load": lambda s, k: s.prepare_load(k),
    "complete_load": lambda s, k: s.complete_load(k),
    "touch": lambda s, k: s.touch(k),
}


@pytest.mark.parametrize("method", sorted(KEY_METHODS))
@pytest.mark.parametrize("keys", sorted(BAD_KEYS))
def test_store_key_lists(method: str, keys: str) -> None:
    store = _busy_store()
    before = _snapshot(store)
    with pytest.raises(ValueError, match="key"):
        KEY_METHODS[method](store, BAD_KEYS[keys])
    assert _same(_snapshot(store), before)
    store.check_invariants()


@pytest.mark.parametrize("method", ["lookup", "slot_of", "ref_count", "evict"])
@pytest.mark.parametrize("key", [None, "key-a", 7, bytearray(A)], ids=repr)
def test_store_single_key(method: str, key: Any) -> None:
    store = _busy_store()
    before = _snapshot(store)
    with pytest.raises(ValueError, match="keys are bytes"):
        getattr(store, method)(key)
    assert _same(_snapshot(store), before)


def test_store_rejections_midway_change_nothing() -> None:
    """A good key before a bad one: the good one is not processed either."""
    store = _busy_store()
    before = _snapshot(store)
    for call in (
        lambda: store.prepare_store([b"key-d", None]),
        lambda: store.complete_store([C, 3]),
        lambda: store.prepare_load([B, C]),  # C still pending
        lambda: store.complete_load([A, A]),  # one load in flight, not two
        lambda: store.touch([B, "key-a"]),
    ):
        with pytest.raises(ValueError):
            call()
        assert _same(_snapshot(store), before)
    store.check_invariants()


# -- chunk knobs against max_model_len ------------------------------------------

# Full attention at 32 tokens/block (group 0) and a 16-token/block sliding window (group 1)
# under a 64-token hash unit: every chunk must end on a hash boundary, so B is a multiple
# of 4 (16 * B % 64 == 0); group 0 has the longest chunks, 32 * B tokens.
FULL = KVGroup(0, GroupKind.FULL, 32)
SWA = KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=128)
TPH = 64
LONGEST = "group 0 (full, 32 tokens/block)"


def _geometry(max_model_len: int | None) -> Geometry:
    return Geometry((FULL, SWA), TPH, max_model_len=max_model_len)


def _valid_blocks(b: int, retention: int | None) -> bool:
    """The rules other than max_model_len, by arithmetic, for one B on every group."""
    spans = {g.index: g.tokens_per_block * b for g in (FULL, SWA)}
    on_hash = all(span % TPH == 0 for span in spans.values())
    retained = retention in (None, 0) or retention % spans[SWA.index] == 0
    return on_hash and retained


def _largest_and_next(max_model_len: int, retention: int | None) -> tuple[int | None, int]:
    """Brute force: the largest valid B whose longest chunk fits, and the next valid B above."""
    fitting = [b for b in range(1, max_model_len // FULL.tokens_per_block + 1)
               if _valid_blocks(b, retention)]
    largest = max(fitting, default=None)
    above = next(b for b in range((largest or 0) + 1, 10**6) if _valid_blocks(b, retention))
    return largest, above


def _longest_tokens(geometry: Geometry, knob: Knob, retention: int | None) -> int:
    return max(gc.tokens_per_chunk for gc in resolve(geometry, knob, retention).groups)


@pytest.mark.parametrize(("max_model_len", "retention"),
                         [(1000, 0), (1000, None), (1000, 640), (4096, 0), (200, 640)])
@pytest.mark.parametrize("knob_name", ["blocks_per_chunk", "block_size"])
def test_a_chunk_longer_than_max_model_len_is_refused(
    max_model_len: int, retention: int | None, knob_name: str
) -> None:
    """Largest valid value accepted, the next valid value refused with a message naming the
    knob, the longest group (and its chunk) and that largest value."""
    largest, above = _largest_and_next(max_model_len, retention)
    assert largest is not None
    # Distinct knobs: blocks per chunk, or the full group's chunk span in tokens.
    def make(b: int) -> Knob:
        return BlocksPerChunk(b) if knob_name == "blocks_per_chunk" else BlockSize(32 * b)

    def value(b: int) -> int:
        return b if knob_name == "blocks_per_chunk" else 32 * b

    geometry = _geometry(max_model_len)
    assert _longest_tokens(geometry, make(largest), retention) <= max_model_len
    # Without max_model_len, the refused value is valid: only the length rule refuses it.
    assert _longest_tokens(_geometry(None), make(above), retention) == 32 * above > max_model_len
    with pytest.raises(ValueError) as info:
        resolve(geometry, make(above), retention)
    message = str(info.value)
    assert f"'{knob_name}'={value(above)}" in message, message
    assert f"max_model_len={max_model_len}" in message, message
    assert f"{LONGEST} chunks of {32 * above} tokens" in message, message
    assert f"The largest valid '{knob_name}' is {value(largest)} " in message, message
    assert f'{{"{knob_name}": {value(largest)}}}' in message, message


@pytest.mark.parametrize("knob", [BlocksPerChunk(32), BlockSize(1024),
                                  PerGroupBlocksPerChunk.of({0: 32}, default=4)], ids=repr)
def test_a_chunk_exactly_max_model_len_long_is_accepted(knob: Knob) -> None:
    chunking = resolve(_geometry(32 * 32), knob)
    assert max(gc.tokens_per_chunk for gc in chunking.groups) == 32 * 32
    with pytest.raises(ValueError, match="max_model_len=1023"):
        resolve(_geometry(32 * 32 - 1), knob)


def test_no_valid_value_is_said_so() -> None:
    """max_model_len 100: B <= 3 fits, but only multiples of 4 end on a hash boundary."""
    assert _largest_and_next(100, 0)[0] is None
    for knob, name in ((BlocksPerChunk(4), "'blocks_per_chunk'"), (BlockSize(128), "'block_size'")):
        with pytest.raises(ValueError) as info:
            resolve(_geometry(100), knob)
        message = str(info.value)
        assert f"{LONGEST} chunks of 128 tokens" in message, message
        assert f"No value of {name} is valid" in message, message
    # A group whose single block is already longer than max_model_len.
    with pytest.raises(ValueError, match="No value of 'blocks_per_chunk' is valid: even 1 block"):
        resolve(Geometry((KVGroup(0, GroupKind.FULL, 256),), 16, max_model_len=100),
                BlocksPerChunk(1))


def test_per_group_map_names_the_entry_of_the_longest_group() -> None:
    """Group 0's entry must be even (32 * B % 64) and fit: the largest is the largest even
    B <= 1000 // 32; the sliding group's default stays."""
    largest = max(b for b in range(1, 1000 // 32 + 1) if 32 * b % TPH == 0)
    knob = PerGroupBlocksPerChunk.of({0: 40}, default=4)
    with pytest.raises(ValueError) as info:
        resolve(_geometry(1000), knob)
    message = str(info.value)
    assert f"'blocks_per_chunk'[0]=40 gives {LONGEST} chunks of {32 * 40} tokens" in message
    assert f"The largest valid 'blocks_per_chunk'[0] is {largest} " in message, message
    assert f'{{"blocks_per_chunk": {{"0": {largest}, "default": 4}}}}' in message, message
    resolve(_geometry(1000), PerGroupBlocksPerChunk.of({0: largest}, default=4))
    # One default for both groups: varied together, so the global rule's answer.
    global_largest = _largest_and_next(1000, 0)[0]
    with pytest.raises(ValueError) as info:
        resolve(_geometry(1000), PerGroupBlocksPerChunk.of({}, default=40))
    assert f'{{"blocks_per_chunk": {{"default": {global_largest}}}}}' in str(info.value)


def test_other_rules_are_checked_first() -> None:
    """A knob both too long and off the hash boundary gets the hash-boundary error."""
    with pytest.raises(ValueError, match="hash boundary") as info:
        resolve(_geometry(100), BlocksPerChunk(1002))
    assert "max_model_len" not in str(info.value)


def test_max_model_len_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        _geometry(0)


# -- the connector: vLLM's model_config.max_model_len ------------------------------

DSV4_FIXTURE = "deepseek-v4-flash-tp4"


def _dsv4_engine(max_model_len: int) -> tuple[Any, Any]:
    """The DeepSeek-V4 TP4 fixture's engine config (kvchunk's connector), another max_model_len."""
    from vllm_adapter import fixtures as fx
    from vllm_adapter.names import KVCHUNK_CONNECTOR, KVCHUNK_CONNECTOR_MODULE

    data = fx.load_fixture(DSV4_FIXTURE)
    data = {**data, "engine_args": {**data["engine_args"], "max_model_len": max_model_len}}
    vc = fx.make_vllm_config(data, {}, connector=KVCHUNK_CONNECTOR,
                             connector_module_path=KVCHUNK_CONNECTOR_MODULE)
    assert vc.model_config.max_model_len == max_model_len
    return vc, fx.rebuild_kv_cache_config(data, "scheduler")


def _dsv4_expected(max_model_len: int) -> tuple[dict[str, Any], int, int]:
    """From the stored fixture: the full group, and the largest / next valid B by brute force."""
    from vllm_adapter import fixtures as fx

    resolved = fx.load_fixture(DSV4_FIXTURE)["resolved"]
    groups, tph = resolved["groups"], resolved["tokens_per_hash"]
    longest = max(groups, key=lambda g: g["tokens_per_block"])
    full = [g for g in groups if "sliding" not in g["kind"]]
    assert full == [longest]  # one full (MLA) group, the longest chunks, block_size's unit

    def valid(b: int) -> bool:
        return all(g["tokens_per_block"] * b % tph == 0 for g in groups)

    largest = max(b for b in range(1, max_model_len // longest["tokens_per_block"] + 1)
                  if valid(b))
    return longest, largest, next(b for b in range(largest + 1, 10**6) if valid(b))


@pytest.mark.vllm
@pytest.mark.parametrize("knob_name", ["block_size", "blocks_per_chunk"])
def test_connector_refuses_a_chunk_longer_than_max_model_len(knob_name: str) -> None:
    require_vllm()
    from conformance.harness import vllm_harness_api as V
    from vllm_adapter.connector import KvchunkOffloadingConnector, resolve_for_vllm
    from vllm_adapter.geometry import with_extra_config

    vc, kv = _dsv4_engine(1024)
    longest, largest, above = _dsv4_expected(1024)
    tpb = longest["tokens_per_block"]

    def value(b: int) -> int:
        return b if knob_name == "blocks_per_chunk" else b * tpb

    def config(b: int) -> Any:
        return with_extra_config(vc, {**vc.kv_transfer_config.kv_connector_extra_config,
                                      knob_name: value(b)})

    chunking, vllm_extra = resolve_for_vllm(config(largest), kv)
    assert vllm_extra["blocks_per_chunk"] == largest
    assert max(gc.tokens_per_chunk for gc in chunking.groups) == tpb * largest <= 1024
    with pytest.raises(ValueError) as info:
        resolve_for_vllm(config(above), kv)
    message = str(info.value)
    group = f"group {longest['index']} (full, {tpb} tokens/block)"
    assert f"'{knob_name}'={value(above)} gives {group} chunks of {tpb * above} tokens" in message
    assert "max_model_len=1024" in message, message
    assert f"The largest valid '{knob_name}' is {value(largest)} " in message, message
    # The connector itself: a ValueError from __init__, before vLLM sees the config.
    with pytest.raises(ValueError, match="max_model_len=1024"):
        KvchunkOffloadingConnector(config(above), V.KVConnectorRole.SCHEDULER, kv)


@pytest.mark.vllm
def test_connector_accepts_a_chunk_exactly_max_model_len_long() -> None:
    require_vllm()
    from vllm_adapter.connector import resolve_for_vllm
    from vllm_adapter.geometry import with_extra_config

    longest, _, _ = _dsv4_expected(2048)
    tpb = longest["tokens_per_block"]
    vc, kv = _dsv4_engine(8 * tpb)
    extra = dict(vc.kv_transfer_config.kv_connector_extra_config)
    chunking, _ = resolve_for_vllm(with_extra_config(vc, {**extra, "block_size": 8 * tpb}), kv)
    assert max(gc.tokens_per_chunk for gc in chunking.groups) == 8 * tpb
    with pytest.raises(ValueError, match=f"max_model_len={8 * tpb}"):
        resolve_for_vllm(with_extra_config(vc, {**extra, "blocks_per_chunk": 9}), kv)


# -- Clear errors before vLLM (issue 26, item 4): the message names the key or flag --------------

NON_CANONICAL = ["++5", "+-5", "1_000", "\u0665", "\u00b2", "5.", "0x10", ""]
"""Integer spellings kvchunk refuses although Python's ``int()`` or ``str.isdecimal`` take
some of them ('1_000', Arabic-Indic five): a knob is digits, maybe one '+' and spaces."""


def _cli(argv: list[str]) -> tuple[int, str, str]:
    import io

    from vllm_adapter.cli import main

    out, err = io.StringIO(), io.StringIO()
    rc = main(["config", *argv], stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def _one_line_cli_error(argv: list[str]) -> str:
    rc, out, err = _cli(argv)
    assert rc == 2 and out == "" and "Traceback" not in err, (rc, out, err)
    assert len(err.strip().splitlines()) == 1, err
    prefix = "python -m vllm_adapter config: error: "
    assert err.startswith(prefix), err
    return err.strip().removeprefix(prefix)


REPO = Path(__file__).resolve().parents[1]
GEMMA_DIR = REPO / "vllm_adapter" / "models" / "gemma-4-31B-it"
GEMMA_ARGS = ["--model", str(GEMMA_DIR), "--tensor-parallel-size", "2"]


@pytest.mark.parametrize("text", NON_CANONICAL, ids=repr)
@pytest.mark.parametrize(("flag", "key"), [("--block-size", "'block_size'"),
                                           ("--blocks-per-chunk", "'blocks_per_chunk'")])
def test_cli_knob_strings_must_be_digits(flag: str, key: str, text: str) -> None:
    line = _one_line_cli_error([*GEMMA_ARGS, flag, text])
    assert line.startswith(f"{flag}: {key} must be a positive integer, got {text!r}"), line
    assert "for example 16" in line, line


@pytest.mark.parametrize("text", NON_CANONICAL, ids=repr)
@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--max-model-len",
                                  "--prefix-match-unit"])
def test_cli_integer_flags_must_be_digits(flag: str, text: str) -> None:
    argv = [*GEMMA_ARGS, flag, text] if flag != "--tensor-parallel-size" else [
        "--model", str(GEMMA_DIR), flag, text]
    line = _one_line_cli_error(argv)
    assert f"argument {flag}" in line and f"got {text!r}" in line, line
    assert "for example 4" in line, line


@pytest.mark.parametrize("text", ["+16", " 16 ", "16"])
def test_canonical_knob_strings_are_accepted(text: str) -> None:
    assert parse_knob({"block_size": text}, Geometry(groups=(), tokens_per_hash=1)) == BlockSize(16)


@pytest.mark.parametrize("text", NON_CANONICAL, ids=repr)
@pytest.mark.parametrize("key", ["block_size", "blocks_per_chunk"])
def test_reference_knob_strings_name_the_key(key: str, text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_knob({key: text}, Geometry(groups=(), tokens_per_hash=1))
    assert str(info.value).startswith(f"'{key}' must be a positive integer, got {text!r}")
    assert "for example 16" in str(info.value)


def _unknown_user_path() -> str:
    import pwd

    names = {p.pw_name for p in pwd.getpwall()}
    user = "kvchunk-no-such-user"
    assert user not in names
    return f"~{user}/models"


@pytest.mark.parametrize("flag", ["--model", "--fs-path", "--plot", "--workload"])
def test_unknown_user_paths_are_one_line_naming_the_flag(flag: str) -> None:
    path = _unknown_user_path()
    argv = {
        "--model": ["--model", path, "-tp", "2"],
        "--fs-path": [*GEMMA_ARGS, "--spec-name", "TieringOffloadingSpec", "--fs-path", path],
        "--plot": [*GEMMA_ARGS, "--sweep", "--plot", path],
        "--workload": [*GEMMA_ARGS, "--workload", path],
    }[flag]
    line = _one_line_cli_error(argv)
    assert line.startswith(f"{flag} {path}: cannot expand '~kvchunk-no-such-user'"), line
    assert "give an absolute path such as /" in line, line


WORKLOAD_TOML = """name = "big"
sessions = {sessions}
turns = {turns}
system_tokens = 100
turn_tokens = {turn}
output_tokens = 64
"""


@pytest.mark.parametrize(("fields", "needle"), [
    ({"sessions": 100_000, "turns": 1, "turn": 100}, "sessions must be <= 10000"),
    ({"sessions": 1, "turns": 5000, "turn": 100}, "turns must be <= 1000"),
    ({"sessions": 1, "turns": 1, "turn": 10**9}, "turn_tokens must be <= 1048576 tokens"),
    ({"sessions": 1, "turns": 1000, "turn": 4096}, "a prompt can reach 4160036 tokens"),
    ({"sessions": 10_000, "turns": 30, "turn": 4096}, "lower sessions or turns"),
], ids=["sessions", "turns", "prompt-field", "longest-prompt", "total"])
def test_oversized_workloads_are_one_line_naming_the_field_and_the_cap(
    fields: dict[str, int], needle: str, tmp_path: Path
) -> None:
    path = tmp_path / "big.toml"
    path.write_text(WORKLOAD_TOML.format(**fields))
    with pytest.raises(ValueError, match=re.escape(needle)) as info:
        load_workload(path)
    assert "the caps are sessions <= 10000, turns <= 1000" in str(info.value)
    line = _one_line_cli_error([*GEMMA_ARGS, "--workload", str(path)])
    assert line.startswith(f"--workload: workload file {path}: workload 'big': "), line
    assert needle in line and "internal error" not in line, line


def test_every_preset_is_well_under_the_caps() -> None:
    for name in PRESETS:
        w = preset(name)
        assert w.sessions * 10 <= MAX_SESSIONS and w.turns * 10 <= MAX_TURNS
        assert w.longest_prompt_bound * 10 <= MAX_PROMPT_TOKENS
        assert w.total_prompt_bound * 5 <= MAX_TOTAL_PROMPT_TOKENS
        # The bound is a bound: no drawn prompt is longer.
        assert max(len(r.prompt) for r in requests(w)) <= w.longest_prompt_bound


def test_prompts_longer_than_max_model_len_are_one_line() -> None:
    longest = max(len(r.prompt) for r in requests(preset("agentic")))
    line = _one_line_cli_error([*GEMMA_ARGS, "--workload", "agentic",
                                "--max-model-len", str(longest - 1)])
    assert line == (
        f"--max-model-len {longest - 1}: workload agentic's longest prompt is {longest} tokens, "
        f"which vLLM would refuse; give --max-model-len {longest} or more, or a workload with "
        "shorter prompts"
    )


@pytest.mark.parametrize("text", ["++5", "1_000", "\u0665", "5 5"], ids=repr)
@pytest.mark.parametrize("key", ["cpu_bytes_to_use", "sync_load_budget_bytes",
                                 "store_threshold", "max_tracker_size"])
def test_connector_integer_keys_must_be_digits(key: str, text: str) -> None:
    require_vllm()
    from vllm_adapter.connector import _check_other_keys

    extra: dict[str, Any] = {"cpu_bytes_to_use": 1 << 30, key: text}
    with pytest.raises(ValueError) as info:
        _check_other_keys(extra)
    assert str(info.value) == (
        f"'{key}' in kv_connector_extra_config must be an integer written in digits "
        f"(for example 1000), got {text!r}."
    )


def test_cpu_row_bytes_is_every_copy_of_a_chunk_page_aligned() -> None:
    from reference.geometry import cpu_row_bytes

    page = 4096
    assert cpu_row_bytes(1, 1, 1, page) == page  # one byte still takes a page
    assert cpu_row_bytes(page, 1, 1, page) == page  # an aligned row gets no padding
    for per_block, copies, blocks in [(1002240, 4, 2), (1002240, 1, 3), (1310720 * 6, 2, 16)]:
        raw = per_block * copies * blocks  # every worker's blocks of the chunk
        row = cpu_row_bytes(per_block, copies, blocks, page)
        assert row % page == 0 and row - page < raw <= row  # the fewest pages that hold it
    for args, name in [((0, 1, 1, page), "worker_kv_bytes_per_block"), ((1, 0, 1, page), "copies"),
                       ((1, 1, 0, page), "blocks_per_chunk"), ((1, 1, 1, 0), "alignment")]:
        with pytest.raises(ValueError, match=f"cpu_row_bytes: {name} must be >= 1, got 0"):
            cpu_row_bytes(*args)
