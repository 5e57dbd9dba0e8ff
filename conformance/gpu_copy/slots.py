"""Which CPU sub-slots a job touches, as vLLM's ``_fill_direct_ops`` enumerates them."""

from __future__ import annotations

from dataclasses import dataclass

from reference.mathutil import cdiv
from reference.transfer import TransferLayout

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

    Group ``g`` with ``n`` blocks and ``skip = block_indices[g] % bpc`` takes the
    next ``n`` block ids and ``cdiv(n + skip, bpc)`` chunk ids; block ``k`` goes
    to chunk ``(k + skip) // bpc``, sub-slot ``(k + skip) % bpc``, once per ref
    of the group.  Raises ``ValueError`` when the ids are not consumed exactly.
    """
    if len(job.group_sizes) != layout.num_groups or len(job.block_indices) != layout.num_groups:
        raise ValueError(
            f"job has {len(job.group_sizes)} group_sizes / {len(job.block_indices)} block_indices, "
            f"layout has {layout.num_groups} groups"
        )
    out: list[SubSlot] = []
    cb = cc = 0
    for g, (n, first) in enumerate(zip(job.group_sizes, job.block_indices, strict=True)):
        if n == 0:
            continue
        b = layout.blocks_per_chunk[g]
        skip = first % b
        nch = cdiv(n + skip, b)
        blocks = job.block_ids[cb : cb + n]
        chunks = job.chunk_ids[cc : cc + nch]
        if len(blocks) != n or len(chunks) != nch:
            raise ValueError(f"{job.describe()}: ids run out in group {g}")
        for k in range(n):
            p = k + skip
            for ref in layout.group_refs[g]:
                out.append(
                    SubSlot(
                        g, first + k, blocks[k], ref.tensor_index, chunks[p // b], p % b, ref.nbytes
                    )
                )
        cb += n
        cc += nch
    if cb != len(job.block_ids) or cc != len(job.chunk_ids):
        raise ValueError(
            f"{job.describe()}: {len(job.block_ids) - cb} block ids and "
            f"{len(job.chunk_ids) - cc} chunk ids left unconsumed"
        )
    return out
