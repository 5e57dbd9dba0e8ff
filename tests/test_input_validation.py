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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from reference.store import ChunkStore
from reference.transfer import TensorRef, TransferLayout, gather, plan_copies, scatter

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
