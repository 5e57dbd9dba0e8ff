"""Remove vLLM CPU-tier regions (``/dev/shm/vllm_offload_*``) that no process holds.

A SIGKILLed vLLM tiering engine (a crash test, a killed run) leaves its CPU tier's region
in ``/dev/shm``: gigabytes of shared memory that stay until removed, and a later run on
the same machine is killed for memory.  ``.ci/run`` calls this before the sessions; a
region some process still has open or mapped is left alone.  Prints what it removed.
"""

from __future__ import annotations

import glob
import os
import sys


def held_paths() -> set[str]:
    """Paths any process has open (``/proc/*/fd``) or mapped (``/proc/*/maps``)."""
    held: set[str] = set()
    for proc in glob.glob("/proc/[0-9]*"):
        try:
            for fd in os.listdir(f"{proc}/fd"):
                try:
                    held.add(os.readlink(f"{proc}/fd/{fd}"))
                except OSError:
                    continue
            with open(f"{proc}/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    parts = line.split(maxsplit=5)
                    if len(parts) == 6:
                        held.add(parts[5].strip().removesuffix(" (deleted)"))
        except OSError:
            continue
    return held


def main(pattern: str = "/dev/shm/vllm_offload_*") -> int:
    held = held_paths()
    for path in sorted(glob.glob(pattern)):
        if path not in held:
            try:
                size = os.path.getsize(path)
                os.remove(path)
            except OSError:
                continue
            print(f"clean_shm: removed {path} ({size} bytes), held by no process")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
