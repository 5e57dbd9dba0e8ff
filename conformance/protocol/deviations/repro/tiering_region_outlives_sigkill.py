"""vLLM TieringOffloadingSpec: a SIGKILLed engine leaves its CPU tier in /dev/shm. CPU only.

A child process maps the scheduler side's region (get_manager, as vLLM's engine does after
its workers) and is killed with SIGKILL; vLLM unlinks the name only in cleanup(), so the
region file stays. Exit 1 and "BUG" when it does; the file is removed either way."""

import os
import signal
import subprocess
import sys
import uuid

from vllm.v1.kv_offload import config as C
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

engine = f"repro-{uuid.uuid4().hex}"
path = f"/dev/shm/vllm_offload_{engine}.mmap"
if sys.argv[1:] == ["engine"]:
    par = C.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False)
    config = C.OffloadingConfig(
        (C.OffloadingGroupConfig(16, ("layers.0.attn",), 0),), 4096, False,
        {"cpu_bytes_to_use": 1 << 20}, os.environ["ENGINE"],
        C.OffloadingModelConfig("org/model", "bfloat16"), C.OffloadingCacheConfig(16, 2), par)
    TieringOffloadingSpec(config).get_manager()  # maps /dev/shm/vllm_offload_<engine>.mmap
    print("ready", flush=True)
    signal.pause()
child = subprocess.Popen([sys.executable, __file__, "engine"], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "ENGINE": engine})
ready = child.stdout is not None and child.stdout.readline().strip() == "ready"
child.send_signal(signal.SIGKILL)
child.wait()
left = os.path.exists(path)
if left:
    os.unlink(path)
print(f"BUG: {path} (the killed engine's CPU tier) was left in /dev/shm" if left and ready
      else f"OK: engine ready: {ready}; region left: {left}")
sys.exit(1 if left and ready else 0)
