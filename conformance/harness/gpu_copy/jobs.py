"""Store and load jobs as vLLM's offloading worker receives them: random, or recorded."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from conformance.harness import vllm_harness_api as V
from reference.mathutil import cdiv

__all__ = ["Job", "jobs_from_dispatched", "random_jobs", "record_jobs"]


@dataclass(frozen=True)
class Job:
    """One store (GPU -> CPU) or load (CPU -> GPU) job, as the worker receives it.

    ``block_ids`` / ``group_sizes`` / ``block_indices`` are the
    ``GPULoadStoreSpec`` (group-major, one entry per offloaded group);
    ``chunk_ids`` the ``CPULoadStoreSpec`` (CPU chunk slots, group-major).
    """

    kind: str
    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    chunk_ids: tuple[int, ...]
    origin: str = "random"
    step: int = -1

    def __post_init__(self) -> None:
        if self.kind not in ("store", "load"):
            raise ValueError(f"kind must be 'store' or 'load', got {self.kind!r}")

    def gpu_spec(self) -> Any:
        return V.GPULoadStoreSpec(
            list(self.block_ids),
            group_sizes=list(self.group_sizes),
            block_indices=list(self.block_indices),
        )

    def cpu_spec(self) -> Any:
        return V.CPULoadStoreSpec(list(self.chunk_ids))

    def specs(self, kv_caches: Any = None) -> tuple[Any, Any]:
        """``(src, dst)`` as ``submit_store`` / ``submit_load`` take them (fresh objects).

        The GPU side is what vLLM's connector worker passes for this job over
        ``kv_caches`` (the workers' ``CanonicalKVCaches``): the
        ``GPULoadStoreSpec`` on 0.33.0, ``DevicePointers`` resolved over
        ``kv_caches`` on 0.34.0 (``vllm_shims.worker_gpu_arg``), which then
        needs ``kv_caches``.  Without it, the ``GPULoadStoreSpec``.
        """
        gpu = self.gpu_spec()
        if kv_caches is not None:
            gpu = V.worker_gpu_arg(gpu, kv_caches)
        if self.kind == "store":
            return gpu, self.cpu_spec()
        return self.cpu_spec(), gpu

    def describe(self) -> str:
        where = self.origin if self.step < 0 else f"{self.origin}, step {self.step}"
        return (
            f"{self.kind} [{where}] group_sizes={list(self.group_sizes)} "
            f"block_indices={list(self.block_indices)} chunks={list(self.chunk_ids)}"
        )


def jobs_from_dispatched(dispatched: Iterable[Any], origin: str) -> list[Job]:
    """:class:`Job` s from :attr:`conformance.harness.driver.DriverSession.dispatched`, in order."""
    return [
        Job(
            kind=d.kind,
            block_ids=tuple(d.block_ids),
            group_sizes=tuple(d.group_sizes),
            block_indices=tuple(d.block_indices),
            chunk_ids=tuple(d.cpu_chunk_ids),
            origin=f"{origin} {d.req_id}",
            step=int(d.step),
        )
        for d in dispatched
    ]


def random_jobs(
    rng: random.Random,
    *,
    num_groups: int,
    blocks_per_chunk: int,
    num_gpu_blocks: int,
    num_chunks: int,
    count: int,
    kinds: Sequence[str] = ("store", "load"),
    max_chunks_per_group: int = 3,
) -> list[Job]:
    """``count`` valid jobs: distinct GPU blocks (never block 0) and distinct chunks per job.

    Each group moves 0..``max_chunks_per_group`` chunks' worth of blocks,
    starting at a random ``block_indices`` (so partial first chunks, skipped
    sub-slots and partial last chunks all occur); at least one group moves
    something.  The first jobs take each of ``kinds`` once, then kinds are random.
    """
    b = blocks_per_chunk
    if num_gpu_blocks < 2 or num_chunks < 1:
        raise ValueError("need at least 2 GPU blocks and 1 chunk")
    jobs = []
    for k in range(count):
        sizes, firsts, chunks_per_group = [], [], []
        for _g in range(num_groups):
            n = rng.choice([0, 1, rng.randint(1, max_chunks_per_group * b)])
            first = rng.randrange(0, 6 * b)
            sizes.append(n)
            firsts.append(first)
            chunks_per_group.append(cdiv(n + first % b, b) if n else 0)
        if not any(sizes):
            g = rng.randrange(num_groups)
            sizes[g] = rng.randint(1, b + 1)
            chunks_per_group[g] = cdiv(sizes[g] + firsts[g] % b, b)
        # Trim to what the pools hold.
        while sum(sizes) > num_gpu_blocks - 1 or sum(chunks_per_group) > num_chunks:
            g = max(range(num_groups), key=lambda i: sizes[i])
            sizes[g] -= 1
            chunks_per_group[g] = cdiv(sizes[g] + firsts[g] % b, b) if sizes[g] else 0
        blocks = rng.sample(range(1, num_gpu_blocks), sum(sizes))
        chunks = rng.sample(range(num_chunks), sum(chunks_per_group))
        jobs.append(
            Job(
                kind=kinds[k] if k < len(kinds) else rng.choice(list(kinds)),
                block_ids=tuple(blocks),
                group_sizes=tuple(sizes),
                block_indices=tuple(firsts),
                chunk_ids=tuple(chunks),
            )
        )
    return jobs


def record_jobs(
    driver: Any, *, prompt_len: int, budget: int, seed: int = 0, origin: str = ""
) -> list[Job]:
    """The store and load jobs vLLM's scheduler dispatches for a small workload, in order.

    Runs on CPU through :class:`conformance.harness.driver.VllmDriver` (real
    ``Scheduler`` + connector, no bytes moved): two requests sharing a prefix
    (chunked prefill, stores), then after GPU prefix-cache resets the prompts
    again (one extended), a late-diverging prompt and several requests at
    once (loads), like the data lane's workload.
    """
    from conformance.protocol.trace import RequestSpec

    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(100, 30000) for _ in range(n))

    p = tokens(prompt_len)
    q = p[: prompt_len // 2] + tokens(prompt_len - prompt_len // 2)
    longer = p + tokens(prompt_len // 3)
    diverging = p[: prompt_len - prompt_len // 8] + tokens(prompt_len // 4)
    s = driver.session(max_num_batched_tokens=budget, record=False)

    def reset() -> None:
        if not s.reset_prefix_cache():
            raise RuntimeError("GPU prefix-cache reset refused")

    s.add_request(RequestSpec("a", p, max_tokens=3))
    s.add_request(RequestSpec("b", q, max_tokens=3))
    s.run_until_idle()
    for name, prompt in (("a2", longer), ("b2", q), ("c", diverging)):
        reset()
        s.add_request(RequestSpec(name, prompt, max_tokens=2))
        s.run_until_idle()
    reset()
    for name, prompt in (("a4", p), ("b4", q), ("c4", diverging)):
        s.add_request(RequestSpec(name, prompt, max_tokens=2))
    s.run_until_idle()
    return jobs_from_dispatched(s.dispatched, origin or "recorded")
