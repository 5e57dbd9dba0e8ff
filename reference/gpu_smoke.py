"""GPU smoke check with torch alone: the reference gather/scatter, byte for byte, and its speed.

``python -m reference.gpu_smoke [--device cuda|cpu] [--blocks N] [--reps N]``

Needs torch (>= 2.11) and nothing else: it imports only torch, the standard
library and the torch-only :mod:`reference` modules (:mod:`reference.transfer`,
:mod:`reference.transfer_checks`, :mod:`reference.transfer_fast`,
:mod:`reference.transfer_device`).  No vLLM, no numpy, no pytest.

For each fixture page shape below (gemma-4 TP2 and DeepSeek-V4 TP4, copied
from the stored geometry fixtures) it builds "GPU" KV-cache tensors on
``--device`` filled with random bytes and a chunk pool in host memory (pinned
on CUDA, as vLLM's CPU tier), then runs one store job and one load job through

* ``spec``: :func:`reference.transfer.gather` / :func:`reference.transfer.scatter`
  (one copy at a time), and
* ``fast``: :mod:`reference.transfer_fast`'s device path
  (:func:`reference.transfer_fast.checked_plan` +
  :func:`reference.transfer_fast.device_gather` / ``device_scatter``), which
  :func:`reference.transfer_fast.gather` / ``scatter`` take whenever a tensor
  is on a GPU; ``--device cpu`` runs the same path on CPU tensors.

Both are compared byte for byte with :func:`plain_store` / :func:`plain_load`,
a per-block copy written here from the layout rule of ``docs/semantics.md``
(block at request position ``p`` -> chunk ``p // blocks_per_chunk``, sub-slot
``p % blocks_per_chunk``; tensor ``t``'s sub-slots follow the earlier
tensors' ones).  Any mismatch prints the first differing slot or block and
exits 1.  Then it times ``fast`` against a torch copy of the same number of
bytes between one contiguous device tensor and a host tensor (pinned on CUDA;
on CPU a plain copy) and prints a table of GB/s and their ratio.

``--self-test-corrupt`` flips one byte of the fast path's output before the
comparison, to show that a wrong copy is caught (the run must then exit 1).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# The fast path's host half (reference.transfer_host, used only when every tensor is on
# the CPU) imports numpy at module level; this script never calls it.  With no numpy
# installed, a stand-in that refuses to run keeps `import reference.transfer_fast`
# working with torch alone.
if importlib.util.find_spec("numpy") is None and "reference.transfer_host" not in sys.modules:

    def _host_path_needs_numpy(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("reference.transfer_host (the all-CPU fast path) needs numpy")

    _stand_in = types.ModuleType("reference.transfer_host")
    _stand_in.host_gather = _host_path_needs_numpy  # type: ignore[attr-defined]
    _stand_in.host_scatter = _host_path_needs_numpy  # type: ignore[attr-defined]
    sys.modules["reference.transfer_host"] = _stand_in

from reference import transfer as spec  # noqa: E402
from reference.transfer import TensorRef, TransferLayout  # noqa: E402
from reference.transfer_fast import (  # noqa: E402
    BATCH_BYTES,
    checked_plan,
    device_gather,
    device_scatter,
)


@dataclass(frozen=True)
class PageShape:
    """One fixture's KV-cache pages as the CPU tier's worker sees them."""

    name: str
    source: str
    page_bytes: tuple[int, ...]
    """Page (row) bytes of each canonical tensor."""
    group_tensors: tuple[tuple[int, ...], ...]
    """Canonical tensors each offloaded group copies (each copied whole: nbytes == page)."""
    blocks_per_chunk: tuple[int, ...]


# gemma-4-31B-it TP2 (vllm_adapter/fixtures/0.33.0/gemma-4-31B-it-tp2.json, model config in
# /work/shared/models/gemma-4-31B-it): 6 KV-cache groups (5 sliding-window, 1 full attention)
# of 10 layers each, page_size_bytes 131072, layout LBHNC (layer-outermost, layer_stride
# 4 GiB, block_stride 131072): one canonical tensor per layer, 60 in all; group g holds
# layers g*10 .. g*10+9 here (which layer sits in which tensor does not change the bytes).
# vLLM 0.33.0 has one blocks_per_chunk for every group; 2 = scheduler block 32 / 16 tokens.
GEMMA_4 = PageShape(
    name="gemma-4-31B-it-tp2",
    source="vllm_adapter/fixtures/0.33.0/gemma-4-31B-it-tp2.json",
    page_bytes=(131072,) * 60,
    group_tensors=tuple(tuple(range(g * 10, g * 10 + 10)) for g in range(6)),
    blocks_per_chunk=(2,) * 6,
)

# DeepSeek-V4-Flash TP4, fp8, --block-size 256
# (vllm_adapter/fixtures/0.34.0/deepseek-v4-flash-tp4.json, /work/shared/models/DeepSeek-V4-Flash):
# packed block-outermost cache (every kv_cache_tensor has block_stride 1002240), which vLLM
# folds into one canonical tensor whose page is the packed block; each of the 5 offloaded
# groups copies the whole packed block (vllm_adapter/spec.py).  Per-group blocks_per_chunk as
# 0.34.0 allows: scheduler block 256 over the groups' tokens_per_block 64, 64, 256, 4, 8,
# capped at 4 to keep a slot (max(bpc) * 1002240 bytes) small.
DEEPSEEK_V4 = PageShape(
    name="deepseek-v4-flash-tp4",
    source="vllm_adapter/fixtures/0.34.0/deepseek-v4-flash-tp4.json",
    page_bytes=(1002240,),
    group_tensors=((0,),) * 5,
    blocks_per_chunk=(4, 4, 1, 4, 4),
)

SHAPES = (GEMMA_4, DEEPSEEK_V4)


def layout_of(shape: PageShape) -> TransferLayout:
    refs = tuple(
        tuple(TensorRef(t, shape.page_bytes[t]) for t in tensors) for tensors in shape.group_tensors
    )
    return TransferLayout(shape.page_bytes, refs, shape.blocks_per_chunk)


@dataclass(frozen=True)
class Job:
    """One job's ids, as vLLM's worker receives them: every group from request position 0."""

    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    slot_ids: tuple[int, ...]


def make_job(shape: PageShape, num_blocks: int, seed: int) -> tuple[Job, int]:
    """A job listing about ``num_blocks`` distinct blocks split over the groups; and its slot count."""
    per_group = max(1, num_blocks // len(shape.group_tensors))
    gen = torch.Generator().manual_seed(seed)
    total = per_group * len(shape.group_tensors)
    block_ids = torch.randperm(total, generator=gen) + 1  # distinct, shuffled; row 0 unused
    chunks = [-(-per_group // b) for b in shape.blocks_per_chunk]
    slot_ids = torch.randperm(sum(chunks), generator=gen)
    job = Job(
        tuple(int(i) for i in block_ids),
        (per_group,) * len(shape.group_tensors),
        (0,) * len(shape.group_tensors),
        tuple(int(s) for s in slot_ids),
    )
    return job, sum(chunks)


def _plain_copies(
    shape: PageShape, job: Job
) -> list[tuple[int, int, int, int, int]]:
    """``(tensor, block_id, slot_id, offset, nbytes)`` of every block copy, written out plainly."""
    out = []
    next_block = next_slot = 0
    for g, tensors in enumerate(shape.group_tensors):
        bpc = shape.blocks_per_chunk[g]
        n = job.group_sizes[g]
        for k in range(n):
            position = job.block_indices[g] + k
            slot = job.slot_ids[next_slot + position // bpc - job.block_indices[g] // bpc]
            for t in tensors:
                offset = sum(shape.page_bytes[:t]) * bpc + (position % bpc) * shape.page_bytes[t]
                out.append((t, job.block_ids[next_block + k], slot, offset, shape.page_bytes[t]))
        next_block += n
        next_slot += -(-(job.block_indices[g] + n) // bpc) - job.block_indices[g] // bpc
    return out


def plain_store(shape: PageShape, job: Job, gpu: Sequence[torch.Tensor], pool: torch.Tensor) -> None:
    for t, block, slot, offset, nbytes in _plain_copies(shape, job):
        pool[slot, offset : offset + nbytes].copy_(gpu[t][block, :nbytes])


def plain_load(shape: PageShape, job: Job, gpu: Sequence[torch.Tensor], pool: torch.Tensor) -> None:
    for t, block, slot, offset, nbytes in _plain_copies(shape, job):
        gpu[t][block, :nbytes].copy_(pool[slot, offset : offset + nbytes])


def job_bytes(shape: PageShape, job: Job) -> int:
    return sum(nbytes for *_, nbytes in _plain_copies(shape, job))


Copier = Callable[[TransferLayout, Sequence[torch.Tensor], torch.Tensor, Job], None]


def spec_store(layout: TransferLayout, gpu: Sequence[torch.Tensor], pool: torch.Tensor, job: Job) -> None:
    spec.gather(layout, gpu, pool, job.block_ids, job.group_sizes, job.block_indices, job.slot_ids)


def spec_load(layout: TransferLayout, gpu: Sequence[torch.Tensor], pool: torch.Tensor, job: Job) -> None:
    spec.scatter(layout, gpu, pool, job.block_ids, job.group_sizes, job.block_indices, job.slot_ids)


def fast_store(layout: TransferLayout, gpu: Sequence[torch.Tensor], pool: torch.Tensor, job: Job) -> None:
    plan = checked_plan(
        layout, gpu, pool, job.block_ids, job.group_sizes, job.block_indices, job.slot_ids
    )
    device_gather(plan, gpu, pool, BATCH_BYTES)


def fast_load(layout: TransferLayout, gpu: Sequence[torch.Tensor], pool: torch.Tensor, job: Job) -> None:
    plan = checked_plan(
        layout, gpu, pool, job.block_ids, job.group_sizes, job.block_indices, job.slot_ids
    )
    device_scatter(plan, gpu, pool, BATCH_BYTES)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_difference(
    name: str, row_name: str, got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]
) -> str | None:
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        rows = (g != w).any(dim=1).nonzero().flatten()
        if rows.numel():
            row = int(rows[0])
            col = int((g[row] != w[row]).nonzero()[0])
            where = f"tensor {t} {row_name}" if len(got) > 1 else row_name
            return f"{name}: {where} {row} byte {col}: {int(g[row, col])} != {int(w[row, col])}"
    return None


@dataclass
class Tensors:
    gpu: list[torch.Tensor]
    pool: torch.Tensor


def allocate(shape: PageShape, num_rows: int, num_slots: int, device: torch.device, fill: bool) -> Tensors:
    gen = torch.Generator(device=device).manual_seed(1234)
    gpu = []
    for page in shape.page_bytes:
        if fill:
            gpu.append(torch.randint(0, 256, (num_rows, page), dtype=torch.uint8, device=device, generator=gen))
        else:
            gpu.append(torch.zeros(num_rows, page, dtype=torch.uint8, device=device))
    slot_bytes = layout_of(shape).slot_bytes
    pool = torch.zeros(num_slots, slot_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    return Tensors(gpu, pool)


def check_shape(shape: PageShape, num_blocks: int, device: torch.device, corrupt: bool) -> list[str]:
    """Store then load one job with spec, fast and plain copies; the mismatches, described."""
    layout = layout_of(shape)
    job, num_slots = make_job(shape, num_blocks, seed=len(shape.name))
    num_rows = len(job.block_ids) + 1
    source = allocate(shape, num_rows, num_slots, device, fill=True).gpu
    problems = []
    pools = {}
    for name, store in (("plain", None), ("spec", spec_store), ("fast", fast_store)):
        pool = allocate(shape, 0, num_slots, device, fill=False).pool
        if store is None:
            plain_store(shape, job, source, pool)
        else:
            store(layout, source, pool, job)
        _sync(device)
        pools[name] = pool
    if corrupt:
        pools["fast"][job.slot_ids[0], 0] ^= 0xFF
    for name in ("spec", "fast"):
        diff = _first_difference(f"{shape.name} store ({name} vs plain copy)", "slot", [pools[name]], [pools["plain"]])
        if diff:
            problems.append(diff)
    loaded = {}
    for name, load in (("plain", None), ("spec", spec_load), ("fast", fast_load)):
        gpu = allocate(shape, num_rows, 0, device, fill=False).gpu
        if load is None:
            plain_load(shape, job, gpu, pools["plain"])
        else:
            load(layout, gpu, pools["plain"], job)
        _sync(device)
        loaded[name] = gpu
    if corrupt:
        t = shape.group_tensors[0][0]
        loaded["fast"][t][job.block_ids[0], 0] ^= 0xFF
    for name in ("spec", "fast"):
        diff = _first_difference(f"{shape.name} load ({name} vs plain copy)", "block", loaded[name], loaded["plain"])
        if diff:
            problems.append(diff)
    # The plain copies themselves: every group's listed blocks came back as they were stored.
    first = 0
    for g, tensors in enumerate(shape.group_tensors):
        n = job.group_sizes[g]
        listed = torch.tensor(job.block_ids[first : first + n], device=device)
        first += n
        for t in tensors:
            back = loaded["plain"][t].index_select(0, listed)
            if not torch.equal(back, source[t].index_select(0, listed)):
                problems.append(f"{shape.name}: plain store+load did not round-trip group {g}")
                break
    return problems


def _best_seconds(run: Callable[[], object], device: torch.device, reps: int) -> float:
    run()  # warm-up: allocator, kernels, pinned staging
    _sync(device)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


@dataclass(frozen=True)
class Speed:
    shape: str
    direction: str
    nbytes: int
    fast_gbps: float
    torch_gbps: float


def measure(shape: PageShape, num_blocks: int, device: torch.device, reps: int) -> list[Speed]:
    layout = layout_of(shape)
    job, num_slots = make_job(shape, num_blocks, seed=len(shape.name))
    tensors = allocate(shape, len(job.block_ids) + 1, num_slots, device, fill=True)
    nbytes = job_bytes(shape, job)
    pinned = device.type == "cuda"
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    on_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    speeds = []
    for direction, fast, baseline in (
        ("store", lambda: fast_store(layout, tensors.gpu, tensors.pool, job),
         lambda: on_host.copy_(on_device, non_blocking=pinned)),
        ("load", lambda: fast_load(layout, tensors.gpu, tensors.pool, job),
         lambda: on_device.copy_(on_host, non_blocking=pinned)),
    ):
        fast_s = _best_seconds(fast, device, reps)
        torch_s = _best_seconds(baseline, device, reps)
        speeds.append(Speed(shape.name, direction, nbytes, nbytes / fast_s / 1e9, nbytes / torch_s / 1e9))
    return speeds


def speed_table(speeds: Sequence[Speed], device: torch.device) -> str:
    baseline = "torch pinned copy" if device.type == "cuda" else "torch plain copy"
    lines = [
        f"| fixture | direction | MiB per job | fast GB/s | {baseline} GB/s | fast / torch |",
        "|---|---|---|---|---|---|",
    ]
    for s in speeds:
        lines.append(
            f"| {s.shape} | {s.direction} | {s.nbytes / 2**20:.1f} | {s.fast_gbps:.4g} | "
            f"{s.torch_gbps:.4g} | {s.fast_gbps / s.torch_gbps:.4g} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reference.gpu_smoke", description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--blocks", type=int, default=None,
                        help="blocks per job (default: 256 on cuda, 12 on cpu)")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions (default: 5 on cuda, 1 on cpu)")
    parser.add_argument("--self-test-corrupt", action="store_true",
                        help="flip one byte of the fast path's output: the run must report it and exit 1")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: CUDA is not available (torch.cuda.is_available() is False); use --device cpu",
              file=sys.stderr)
        return 2
    num_blocks = args.blocks if args.blocks is not None else (256 if device.type == "cuda" else 12)
    reps = args.reps if args.reps is not None else (5 if device.type == "cuda" else 1)
    if num_blocks < 1 or reps < 1:
        print("--blocks and --reps must be at least 1 (e.g. --blocks 64 --reps 3)", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__} on {name}; {num_blocks} blocks per job")
    problems = []
    for shape in SHAPES:
        found = check_shape(shape, num_blocks, device, corrupt=args.self_test_corrupt)
        print(f"{shape.name} ({shape.source}): {'MISMATCH' if found else 'bytes equal'} "
              "(spec and fast vs plain per-block copy, store and load)")
        problems += found
    if problems:
        print("byte mismatch:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    speeds = [s for shape in SHAPES for s in measure(shape, num_blocks, device, reps)]
    print(speed_table(speeds, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
