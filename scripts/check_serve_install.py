"""Check an operator's install (``.[vllm]`` alone): the CLI plans both models.

``nox -s serve_install`` installs kvchunk with only its ``vllm`` extra, from the
release's lock, and runs this script.  It runs ``python -m vllm_adapter config``
as an operator would (a subprocess, JSON output) for the README's two serve
configurations, with ``block_size`` 512, and checks what vLLM's own KV planning
of that install gives:

* gemma-4-31B-it, TP2, GPU block size 16: ``blocks_per_chunk`` 16 (groups of 16
  and 32 tokens per block);
* gemma-4-31B-it, TP2, vLLM's default GPU block size: 16 on 0.33.0 (default 16
  tokens per block), 4 on 0.34.0 (vLLM 0.34.0 raised ``CacheConfig``'s default
  to 64, so its groups have 64 and 128 tokens per block);
* DeepSeek-V4-Flash, TP4, fp8, GPU block size 256: ``blocks_per_chunk`` 2;
* the disk serve config's spec: vLLM's own factories load kvchunk's
  ``KvchunkTieringOffloadingSpec`` and its ``kvchunk_fs`` file tier
  (:mod:`vllm_adapter.disk.tier`, BLAKE3 from this install), and one chunk file goes
  to disk and comes back verified.

The expected values follow from the models' geometry (``docs/semantics.md``):
512 tokens over the full-attention group's tokens per block (twice the GPU block
size for gemma-4, 256 for DeepSeek-V4).  Usage:
``python scripts/check_serve_install.py <vllm version>``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from vllm_adapter.release_list import SUPPORTED_RELEASES

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "vllm_adapter" / "models"
DEFAULT_GPU_BLOCK_SIZE = {"0.33.0": 16, "0.34.0": 64}
"""vLLM's ``CacheConfig`` default tokens per block, per release (read from each wheel)."""


@dataclass(frozen=True)
class ServeCase:
    name: str
    flags: tuple[str, ...]
    full_attention_tokens_per_block: int
    block_size: int = 512

    @property
    def expected_blocks_per_chunk(self) -> int:
        return self.block_size // self.full_attention_tokens_per_block


def cases(vllm: str) -> tuple[ServeCase, ...]:
    gemma = ("--model", str(MODELS / "gemma-4-31B-it"), "--tensor-parallel-size", "2")
    return (
        ServeCase(
            "gemma-4-31B-it TP2 (--block-size-gpu 16)",
            (*gemma, "--block-size-gpu", "16"),
            full_attention_tokens_per_block=32,
        ),
        ServeCase(
            f"gemma-4-31B-it TP2 (vLLM {vllm}'s default GPU block size)",
            gemma,
            full_attention_tokens_per_block=2 * DEFAULT_GPU_BLOCK_SIZE[vllm],
        ),
        DSV4,
    )


DSV4 = (
    ServeCase(
        "DeepSeek-V4-Flash TP4",
        (
            "--model", str(MODELS / "DeepSeek-V4-Flash"), "--tensor-parallel-size", "4",
            "--kv-cache-dtype", "fp8", "--block-size-gpu", "256",
        ),
        full_attention_tokens_per_block=256,
    )
)


def check(case: ServeCase, vllm: str, err: TextIO) -> list[str]:
    errors = _check(case, vllm)
    for e in errors:
        print(f"FAILED {e}", file=err)
    return errors


def _check(case: ServeCase, vllm: str) -> list[str]:
    cmd = [
        sys.executable, "-m", "vllm_adapter", "config", *case.flags,
        "--block-size", str(case.block_size), "--format", "json",
    ]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    took = time.monotonic() - start
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
        return [f"{case.name}: `{' '.join(cmd[1:])}` exited {proc.returncode}:\n{tail}"]
    doc = json.loads(proc.stdout)
    errors = []
    if doc["vllm"]["version"] != vllm:
        errors.append(f"{case.name}: planned by vLLM {doc['vllm']['version']}, expected {vllm}")
    got = doc["knob"]["blocks_per_chunk"]
    if got != case.expected_blocks_per_chunk:
        errors.append(
            f"{case.name}: block_size {case.block_size} gave blocks_per_chunk {got}, "
            f"expected {case.expected_blocks_per_chunk}"
        )
    per_group = sorted({g["blocks_per_chunk"] for g in doc["groups"]})
    if per_group != [case.expected_blocks_per_chunk]:
        errors.append(f"{case.name}: per-group blocks_per_chunk {per_group}")
    print(
        f"{case.name}: vLLM {doc['vllm']['version']}, block_size {case.block_size} -> "
        f"blocks_per_chunk {got} over {len(doc['groups'])} groups ({took:.0f} s)"
    )
    return errors


DISK_SPEC_PROBE = """
import os, sys, tempfile
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm_adapter import names
from vllm_adapter.disk import tier as safe_fs
spec = OffloadingSpecFactory.get_spec_cls(names.KVCHUNK_TIERING_SPEC)
tier = SecondaryTierFactory.get_tier_class({"type": names.KVCHUNK_FS_TIER})
io = safe_fs.ChunkIO(namespace=bytes(16))
path = os.path.join(tempfile.mkdtemp(), "chunk.bin")
data = memoryview(bytearray(os.urandom(8192)))
safe_fs.store_chunk(path, data, bytes(16), io)
back = memoryview(bytearray(8192))
safe_fs.load_chunk(path, back, bytes(16), io)
assert back == data
print(f"{spec.__name__} (file tier {tier.__name__}): a chunk file round trip verified")
"""


def check_disk_spec(err: TextIO) -> list[str]:
    """The README's disk serve config: vLLM's own factories load kvchunk's spec and file tier
    from this install (BLAKE3 included), and a chunk file goes to disk and back verified."""
    proc = subprocess.run(
        [sys.executable, "-c", DISK_SPEC_PROBE], capture_output=True, text=True, check=False
    )
    if proc.returncode == 0:
        print(proc.stdout.strip().splitlines()[-1])
        return []
    tail = "\n".join(proc.stderr.strip().splitlines()[-5:])
    error = f"kvchunk's disk spec did not load from this install (exit {proc.returncode}):\n{tail}"
    print(f"FAILED {error}", file=err)
    return [error]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    vllm = argv[0]
    if vllm not in SUPPORTED_RELEASES:
        print(f"vLLM {vllm} is not a supported release ({', '.join(SUPPORTED_RELEASES)})",
              file=sys.stderr)
        return 2
    if vllm not in DEFAULT_GPU_BLOCK_SIZE:
        print(f"no default GPU block size recorded for vLLM {vllm}", file=sys.stderr)
        return 2
    todo = cases(vllm)
    failed = {case.name for case in todo if check(case, vllm, sys.stderr)}
    if check_disk_spec(sys.stderr):
        failed.add("disk spec")
    total = len(todo) + 1
    print(f"serve_install: {total - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
