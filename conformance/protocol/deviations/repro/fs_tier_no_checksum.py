"""vLLM fs tier: a chunk file whose bytes changed after it was written loads without error.

CPU only.  FileSystemTierManager.submit_store / submit_load call exactly these two
functions of vllm/v1/kv_offload/tiering/fs/io.py.  Exit 1 and "BUG" when the changed
file loads (the load should raise OSError, so the tier marks it a miss and recomputes).
"""

import mmap
import os
import sys
import tempfile

from vllm.v1.kv_offload.tiering.fs.io import batch_load_block, batch_store_block

ROW = 8192  # one CPU-tier chunk row
stored = mmap.mmap(-1, ROW)
stored[:] = os.urandom(ROW)
path = os.path.join(tempfile.mkdtemp(), "abc", "de_g0", "abcdef.bin")
batch_store_block([path], memoryview(stored), [0], ROW, False)

with open(path, "r+b") as f:  # bit rot / a foreign write: one byte inverted
    f.seek(100)
    byte = f.read(1)[0]
    f.seek(100)
    f.write(bytes([byte ^ 0xFF]))

loaded = mmap.mmap(-1, ROW)
try:
    batch_load_block([path], memoryview(loaded), [0], ROW, False)
except OSError as exc:
    sys.exit(f"OK: the changed file was rejected: {exc}")
wrong = sum(a != b for a, b in zip(loaded[:], stored[:], strict=True))
print(f"BUG: the changed file loaded without error ({wrong} byte(s) differ from what was stored)")
sys.exit(1)
