"""vLLM fs tier: engines of another KV geometry (same model, layers) share files. CPU only.

FileMapper.from_offloading_spec (as FileSystemTierManager builds it) for two engines whose
KV bytes per block differ (head size 128 vs 64) gives one file name, and the smaller engine
loads the start of the larger one's file without error. Exit 1 and "BUG" when it does."""

import mmap
import os
import sys
import tempfile
from types import SimpleNamespace

from vllm.v1.kv_offload import config as C
from vllm.v1.kv_offload.base import make_offload_key
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.fs.io import batch_load_block, batch_store_block

root, key = tempfile.mkdtemp(), make_offload_key(b"\x07" * 32, 0)
par = C.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False)


def file_of(bytes_per_block: int) -> str:
    config = C.OffloadingConfig(
        (C.OffloadingGroupConfig(16, ("layers.0.attn",), 0),), bytes_per_block, False, {},
        "engine", C.OffloadingModelConfig("org/model", "bfloat16"), C.OffloadingCacheConfig(16, 2), par)
    mapper = FileMapper.from_offloading_spec(root, SimpleNamespace(config=config), 2, True)
    return mapper.get_file_name(key)


big, small = 2 * 8192, 2 * 4096  # one chunk row of each engine (2 blocks per chunk)
stored = mmap.mmap(-1, big)
stored[:] = os.urandom(big)
batch_store_block([file_of(8192)], memoryview(stored), [0], big, False)
loaded = mmap.mmap(-1, small)
batch_load_block([file_of(4096)], memoryview(loaded), [0], small, False)  # no error
same = file_of(8192) == file_of(4096)
print(f"BUG: same file name: {same}; the {small}-byte row loaded the first bytes of a "
      f"{big}-byte file of another geometry: {loaded[:] == stored[:small]}")
sys.exit(1 if same else 0)
