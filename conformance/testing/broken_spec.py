"""A deliberately broken offloading spec: the suite's ``--spec`` option must catch it.

:class:`SwappedBlocksSpec` is kvchunk's :class:`~vllm_adapter.spec.ReferenceOffloadingSpec`
whose worker, on every load, exchanges the GPU destinations of the first two blocks that
share a chunk: each lands in the other's GPU block, so both hold bytes of the wrong
position.  Stores are untouched.  Run the data lane with it::

    python -m pytest -p conformance.plugin conformance/lanes/test_data.py \\
        --spec conformance.testing.broken_spec:SwappedBlocksSpec

and every case with ``blocks_per_chunk`` > 1 fails, naming the chunk and the blocks.
"""

from __future__ import annotations

from typing import Any

from vllm_adapter.spec import ReferenceOffloadingSpec, ReferenceOffloadingWorker

__all__ = ["SwappedBlocksSpec", "SwappedBlocksWorker", "swap_first_pair"]


def swap_first_pair(gpu: Any, blocks_per_chunk: tuple[int, ...]) -> Any:
    """``gpu`` (a ``vllm_api.GpuBlocks``) with the ids of the first two blocks of one group
    that fall in the same chunk exchanged; ``gpu`` itself when no chunk holds two."""
    ids = gpu.block_ids.copy()
    cursor = 0
    for n, first, per_chunk in zip(
        gpu.group_sizes, gpu.block_indices, blocks_per_chunk, strict=True
    ):
        for k in range(int(n) - 1):
            if (first + k) // per_chunk == (first + k + 1) // per_chunk:
                a = cursor + k
                ids[a], ids[a + 1] = ids[a + 1], ids[a]
                return gpu._replace(block_ids=ids)
        cursor += int(n)
    return gpu


class SwappedBlocksWorker(ReferenceOffloadingWorker):
    """The reference worker, loading two blocks of a chunk into each other's GPU block."""

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        swapped = swap_first_pair(self.gpu_blocks(dst_spec), self.layout.blocks_per_chunk)
        return super().submit_load(job_id, src_spec, swapped, expedited)


class SwappedBlocksSpec(ReferenceOffloadingSpec):
    """:class:`~vllm_adapter.spec.ReferenceOffloadingSpec` with :class:`SwappedBlocksWorker`."""

    def get_worker(self, kv_caches: Any) -> ReferenceOffloadingWorker:
        if self._worker is None:
            self._worker = SwappedBlocksWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._worker
