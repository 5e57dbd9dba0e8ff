"""Which CPU sub-slots a job touches, as vLLM's ``_fill_direct_ops`` enumerates them."""

from __future__ import annotations

from dataclasses import dataclass

from reference.transfer import TransferLayout, job_copies

from .jobs import Job

__all__ = ["SubSlot", "job_sub_slots"]


@dataclass(frozen=True)
class SubSlot:
    """One copy of a job: a block of one group's layer (ref) <-> one CPU sub-slot."""

    group: int
    """Offloaded-group position (index into the job's ``group_sizes``)."""
    position: int
    """The block's index in the request (``block_indices[group] + k``)."""
    block_id: int
    tensor: int
    chunk: int
    sub_slot: int
    nbytes: int

    def describe(self) -> str:
        return (
            f"group {self.group} chunk {self.chunk} sub-slot {self.sub_slot} "
            f"(tensor {self.tensor}, GPU block {self.block_id}, block position {self.position})"
        )


def job_sub_slots(layout: TransferLayout, job: Job) -> list[SubSlot]:
    """Every copy ``job`` makes, as vLLM's ``_fill_direct_ops`` / ``transfer_async`` enumerate them.

    The copies of :func:`reference.transfer.job_copies` (the spec of the byte
    layout), with the slot id read as the CPU chunk id.  Repeated ids are kept.
    Raises ``ValueError`` (naming the job) when the ids are not consumed exactly.
    """
    try:
        copies = job_copies(
            layout, job.block_ids, job.group_sizes, job.block_indices, job.chunk_ids
        )
    except ValueError as error:
        raise ValueError(f"{job.describe()}: {error}") from None
    return [
        SubSlot(c.group, c.position, c.block_id, c.tensor, c.slot_id, c.sub_slot, c.nbytes)
        for c in copies
    ]
