"""The fast == spec comparison of tests/test_transfer_fast.py can fail, on either side.

Broken executors (a bundle without its proof, overlapping views bundled, a
wrong or stray byte) and faults in the spec's mapping (reference.transfer:
``place``, ``chunks_of``, ``TransferLayout.region_offset`` /
``sub_slot_offset``) each make :func:`check_fast_equals_spec` fail with an
assertion; unbroken, it passes.  The fast path plans its copies itself, so a
one-line fault in the spec shows here.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from test_transfer import Job
from test_transfer_fast import FAST, Case, Executor, compare

import reference.transfer as spec
import reference.transfer_fast as fast
import reference.transfer_host as host
from reference.transfer import TensorRef, TransferLayout
from reference.transfer_fast import TensorCopies

# ---------------------------------------------------------------------------
# The comparison can fail
# ---------------------------------------------------------------------------

TWO_LAYERS = Case(
    layout=TransferLayout.uniform((32, 32), [[TensorRef(0, 32)], [TensorRef(1, 32)]], 2),
    job=Job(block_ids=(1, 2, 3, 4), group_sizes=(2, 2), block_indices=(0, 0), slot_ids=(0, 1)),
    num_blocks=6,
    num_slots=3,
    element_bytes=2,
    arrangement="outer",
    row_pad=0,
    base=0,
    seed=7,
    batch_bytes=fast.BATCH_BYTES,
)
"""Two equally spaced layers of one buffer, in two groups with different blocks."""


def _bundles_without_proof(
    group: list[TensorCopies], copies: TensorCopies, tensors: Sequence[torch.Tensor]
) -> bool:
    """A broken ``_bundles_with``: same buffer, equal spacing; never checks the copies agree."""
    a, b = tensors[group[0].tensor_index], tensors[copies.tensor_index]
    return (
        copies.tensor_index == group[-1].tensor_index + 1
        and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.stride() == b.stride()
        and len(copies.runs) == len(group[0].runs)
    )


OVERLAPPING_LAYERS = Case(
    layout=TransferLayout((16, 16), ((TensorRef(0, 16), TensorRef(1, 16)),), (4,)),
    job=Job(block_ids=(0, 1, 2, 3), group_sizes=(4,), block_indices=(0,), slot_ids=(1,)),
    num_blocks=6,
    num_slots=2,
    element_bytes=1,
    arrangement="overlapping",
    row_pad=0,
    base=0,
    seed=3,
    batch_bytes=fast.BATCH_BYTES,
)
"""One group's two layers, equally spaced but half a page apart: bundling them is wrong."""


def test_comparison_passes_on_the_fixed_cases() -> None:
    """The cases below break only the executor: unbroken, the comparison passes."""
    for case in (TWO_LAYERS, OVERLAPPING_LAYERS):
        for direction in ("gather", "scatter"):
            compare(direction, FAST[(direction, "dispatch")], case, "cpu", "cpu")


@pytest.mark.parametrize("direction", ["gather", "scatter"])
def test_comparison_catches_a_bundle_without_its_proof(
    direction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host, "_bundles_with", _bundles_without_proof)
    with pytest.raises(AssertionError, match="vs the spec"):
        compare(direction, FAST[(direction, "dispatch")], TWO_LAYERS, "cpu", "cpu")


def test_comparison_catches_a_bundle_of_overlapping_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the overlap proof the two layers are bundled, and a load writes them out of order."""
    monkeypatch.setattr(host, "_disjoint", lambda sizes, strides: True)
    with pytest.raises(AssertionError, match="vs the spec"):
        compare("scatter", FAST[("scatter", "dispatch")], OVERLAPPING_LAYERS, "cpu", "cpu")


def _gather_one_byte_off(*args: object) -> None:
    fast.gather(*args)  # type: ignore[arg-type]
    pool = args[2]
    assert isinstance(pool, torch.Tensor)
    pool[0, 0] ^= 1  # slot 0, sub-slot 0 holds block 1 of group 0


def _scatter_and_touch_another_block(*args: object) -> None:
    fast.scatter(*args)  # type: ignore[arg-type]
    gpu = args[1]
    assert isinstance(gpu, list)
    gpu[0][5, 0] ^= 1  # block 5 is in no job


@pytest.mark.parametrize(
    ("direction", "broken"),
    [("gather", _gather_one_byte_off), ("scatter", _scatter_and_touch_another_block)],
)
def test_comparison_catches_a_wrong_or_stray_byte(direction: str, broken: Executor) -> None:
    with pytest.raises(AssertionError, match="vs the spec"):
        compare(direction, broken, TWO_LAYERS, "cpu", "cpu")


# ---------------------------------------------------------------------------
# A fault in the spec's mapping shows too (the fast path does not call it)
# ---------------------------------------------------------------------------

UNEQUAL_PAGES = Case(
    layout=TransferLayout(
        (16, 32, 8),
        ((TensorRef(0, 16), TensorRef(1, 32)), (TensorRef(1, 24), TensorRef(2, 8))),
        (2, 3),
    ),
    job=Job(
        block_ids=(7, 1, 4, 2, 8, 3, 5),
        group_sizes=(3, 4),
        block_indices=(1, 5),
        slot_ids=(4, 0, 2, 5),
    ),
    num_blocks=9,
    num_slots=6,
    element_bytes=8,
    arrangement="separate",
    row_pad=8,
    base=8,
    seed=11,
    batch_bytes=fast.BATCH_BYTES,
)
"""Three tensors of unequal pages, two groups of different ``B``, both skipping sub-slots."""

PACKED = Case(
    layout=TransferLayout(
        (48,), ((TensorRef(0, 48),), (TensorRef(0, 40),), (TensorRef(0, 24),)), (2, 1, 3)
    ),
    job=Job(
        block_ids=(3, 9, 1, 6, 2, 8, 4, 7, 5),
        group_sizes=(3, 2, 4),
        block_indices=(0, 7, 4),
        slot_ids=(5, 1, 0, 3, 2, 4),
    ),
    num_blocks=10,
    num_slots=7,
    element_bytes=2,
    arrangement="separate",
    row_pad=0,
    base=0,
    seed=5,
    batch_bytes=fast.BATCH_BYTES,
)
"""A packed cache folded as vLLM folds it: one canonical tensor, one partial ref per group."""

LAYOUT_CASES = (TWO_LAYERS, UNEQUAL_PAGES, PACKED)


def check_fast_equals_spec() -> None:
    """Fast == spec on :data:`LAYOUT_CASES`, both directions, both CPU paths (AssertionError else)."""
    for case in LAYOUT_CASES:
        for (direction, _), executor in FAST.items():
            compare(direction, executor, case, "cpu", "cpu")


def test_fast_equals_spec_on_the_layout_cases() -> None:
    check_fast_equals_spec()


SPEC_FAULTS: dict[str, tuple[object, str, object]] = {
    "sub-slots in reverse": (spec, "place", lambda p, b: (p // b, b - 1 - p % b)),
    "chunk of the next block": (spec, "place", lambda p, b: ((p + 1) // b, p % b)),
    "one chunk too many": (
        spec,
        "chunks_of",
        lambda first, n, b: range(first // b, (first + n - 1) // b + 2) if n else range(0),
    ),
    "regions ignore blocks_per_chunk": (
        TransferLayout,
        "region_offset",
        lambda self, g, t: sum(self.page_bytes[:t]),
    ),
    "sub-slots strided by tensor 0's page": (
        TransferLayout,
        "sub_slot_offset",
        lambda self, g, t, j: self.region_offset(g, t) + j * self.page_bytes[0],
    ),
}


@pytest.mark.parametrize("fault", sorted(SPEC_FAULTS))
def test_comparison_catches_a_fault_in_the_spec_mapping(
    fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, name, broken = SPEC_FAULTS[fault]
    monkeypatch.setattr(owner, name, broken)
    with pytest.raises(AssertionError, match="vs the spec"):
        check_fast_equals_spec()
