"""File economics of vLLM's file-system tier (pure model; no vLLM, no I/O).

vLLM's fs tier (``vllm/v1/kv_offload/tiering/fs``) writes **one file per chunk
per offloaded group**, each file one CPU-tier chunk row: ``round_up(
worker_kv_bytes_per_block x copies x blocks_per_chunk, 4096)`` bytes (``copies``:
TP ranks, or 1 with vLLM's replicated MLA layout).  So a group whose chunk
covers ``tokens_per_chunk`` tokens costs ``1e6 / tokens_per_chunk`` files per
million tokens it stores.

Workload (:data:`WORKLOAD`): ``conversations`` multi-turn conversations, each
``turns`` turns of ``tokens_per_turn`` new tokens, all behind one shared
``system_tokens`` system prompt.  Only full chunks are stored (a partial tail
is recomputed); the system prompt's chunks are stored once (same hashes).
Windowed groups are counted like full-attention ones (every chunk prefill
passes through is stored): an upper bound for them.

Shared file system model (:class:`FsModel`): each file costs a fixed latency
``file_latency_s`` (create + write + close/rename: metadata round trips) that
``concurrency`` I/O threads overlap, plus its bytes at ``bandwidth_bps``:
``seconds per file = max(file_latency_s / concurrency, file_bytes / bandwidth_bps)``.
The deployment is IOPS-bound while the first term wins, bandwidth-bound after;
the crossover file size is ``file_latency_s x bandwidth_bps / concurrency``.
The latencies are assumptions, not measurements (see :data:`FS_MODELS`).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "FS_MODELS",
    "WORKLOAD",
    "FsModel",
    "ModelledThroughput",
    "Workload",
    "files_per_million_tokens",
    "modelled",
]


@dataclass(frozen=True)
class Workload:
    conversations: int
    turns: int
    tokens_per_turn: int
    system_tokens: int

    @property
    def tokens(self) -> int:
        """Distinct tokens offered for storing (the system prompt once)."""
        return self.system_tokens + self.conversations * self.turns * self.tokens_per_turn


WORKLOAD = Workload(conversations=64, turns=8, tokens_per_turn=2048, system_tokens=4096)
"""64 conversations x 8 turns x 2048 tokens, one shared 4096-token system prompt (~1.05M tokens)."""


def group_files(workload: Workload, tokens_per_chunk: int) -> int:
    """Files one group writes for ``workload``: full chunks only, the shared prefix's once."""
    if tokens_per_chunk <= 0:
        raise ValueError(f"tokens_per_chunk must be > 0, got {tokens_per_chunk}")
    shared = workload.system_tokens // tokens_per_chunk
    per_conversation = (
        workload.system_tokens + workload.turns * workload.tokens_per_turn
    ) // tokens_per_chunk
    return shared + workload.conversations * (per_conversation - shared)


def files_per_million_tokens(workload: Workload, tokens_per_chunk: list[int]) -> float:
    """Files per million offered tokens, summed over the groups' ``tokens_per_chunk``."""
    files = sum(group_files(workload, t) for t in tokens_per_chunk)
    return files * 1e6 / workload.tokens


@dataclass(frozen=True)
class FsModel:
    name: str
    file_latency_s: float
    concurrency: int
    bandwidth_bps: float
    source: str

    @property
    def crossover_bytes(self) -> float:
        """File size above which the model is bandwidth-bound."""
        return self.file_latency_s * self.bandwidth_bps / self.concurrency


@dataclass(frozen=True)
class ModelledThroughput:
    files_per_s: float
    bytes_per_s: float
    bound: str
    """``"IOPS"`` or ``"bandwidth"``."""


def modelled(model: FsModel, file_bytes: int) -> ModelledThroughput:
    """Files/s and bytes/s of ``model`` writing files of ``file_bytes``."""
    latency = model.file_latency_s / model.concurrency
    transfer = file_bytes / model.bandwidth_bps
    seconds = max(latency, transfer)
    return ModelledThroughput(
        1 / seconds, file_bytes / seconds, "IOPS" if latency > transfer else "bandwidth"
    )


FS_MODELS: tuple[FsModel, ...] = (
    FsModel(
        "NFS/Lustre",
        2e-3,
        16,
        2e9,
        "assumed 2 ms per file (create + write + close: 2-3 metadata round trips of ~0.5-1 ms "
        "on a datacenter network; mdtest file-create rates of a few thousand/s per client are "
        "the usual published order for Lustre and NFS), 16 fs-tier write threads, 2 GB/s "
        "per client",
    ),
    FsModel(
        "object store via FUSE",
        30e-3,
        16,
        2e9,
        "assumed 30 ms per file (S3-class PUT latency; AWS's S3 performance guidance "
        "quotes 100-200 ms first-byte for small objects at the tail, tens of ms typical), "
        "16 threads, 2 GB/s per client",
    ),
)
"""Assumed shared-file-system costs (provenance from memory, not looked up: see ``source``)."""
