"""Harness of the faults lane's cases against kvchunk's file tier (:mod:`vllm_adapter.disk.tier`).

The same round trips as :mod:`conformance.harness.tiered` (vLLM's tiering manager, CPU
tier and fs-tier machinery; the reference worker), with the spec swapped for
:class:`vllm_adapter.disk.tier.KvchunkTieringOffloadingSpec`:

* :func:`kvchunk_tiering_spec`: the extra-config entries (``"fs"`` tier, which the
  spec turns into kvchunk's);
* :class:`ChunkProbe`: :class:`conformance.harness.tiered.FileProbe`'s counts and fault
  hooks, on kvchunk's ``batch_store_chunks`` / ``batch_load_chunks``;
* :func:`serve_again`: after a round trip, reset GPU cache and CPU tier again,
  poison the region and ask for the same prompts a third time (the files the
  recompute rewrote must serve them);
* :func:`damage`: the file faults (:func:`conformance.harness.tiered.corrupt`'s, plus
  ``extended`` and ``swapped``: another key's whole, valid file);
* :func:`kill_mid_write`: a separate process writing chunk files, ``SIGKILL``-ed in
  the middle of a write.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

from conformance.harness import spec_option
from conformance.harness import tiered as T
from conformance.protocol.trace import RequestSpec
from vllm_adapter import names
from vllm_adapter.disk import packed_file as P
from vllm_adapter.disk import tier as S
from vllm_adapter.disk.fileio import TierFileIO

__all__ = [
    "FAULTS",
    "ChunkProbe",
    "PackedProbe",
    "chosen_has_kvchunk_tier",
    "damage",
    "file_bytes",
    "kill_mid_write",
    "kvchunk_tiering_spec",
    "packed_files",
    "probe_for",
    "serve_again",
    "tier_of",
]

FAULTS = ("missing", "truncated", "flipped", "bitrot", "extended", "swapped")
"""File faults: :func:`conformance.harness.tiered.corrupt`'s three, one bit flipped in the middle
of each file (the payload, never a header), a file grown by a page, and every file
replaced by another key's (whole, valid) file."""


def kvchunk_tiering_spec(root_dir: Path, *, threads: int = 2, **tier: Any) -> dict[str, Any]:
    """:func:`conformance.harness.tiered.tiering_spec` with kvchunk's spec (``tier``: extra tier keys)."""
    spec = T.tiering_spec(root_dir, threads=threads)
    (fs,) = spec["secondary_tiers"]
    tier = {"disk_bytes_to_use": disk_bytes(root_dir), **tier}
    return {**spec, **names.KVCHUNK_TIERING_SPEC, "secondary_tiers": [{**fs, **tier}]}


def disk_bytes(root_dir: Path) -> int:
    """The lanes' disk budget where a case does not size one: the whole file system under
    ``root_dir`` (the largest value the tier accepts), so nothing is evicted."""
    probe = Path(root_dir)
    while not probe.is_dir():  # the root may not exist yet (or be a bad path a case tests)
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_blocks * st.f_frsize


def tier_of(session: Any) -> S.KvchunkFileTierManager:
    """The session's (only) secondary tier, which must be kvchunk's."""
    (tier,) = session.connector_scheduler.manager.secondary_tiers
    if not isinstance(tier, S.KvchunkFileTierManager):
        raise TypeError(f"the session's file tier is {type(tier).__name__}, not kvchunk's")
    return tier


class ChunkProbe(T.FileProbe):
    """:class:`~conformance.harness.tiered.FileProbe` on kvchunk's tier (``before_load`` / ``store`` hooks too)."""

    def install(
        self,
        monkeypatch: Any,
        module: Any = None,
        store_name: str = "store_chunks",
        load_name: str = "load_chunks",
    ) -> Self:
        """Wrap the file I/O object of every kvchunk tier built from now on (``module``:
        that object, a fresh :class:`~vllm_adapter.disk.fileio.TierFileIO` by default)."""
        file_io = _wrapped_file_io(monkeypatch) if module is None else module
        return super().install(monkeypatch, file_io, store_name, load_name)


def _wrapped_file_io(monkeypatch: Any) -> TierFileIO:
    """One :class:`~vllm_adapter.disk.fileio.TierFileIO` that every kvchunk tier built from
    now on uses (a probe wraps its methods)."""
    file_io = TierFileIO()
    monkeypatch.setattr(S.KvchunkFileTierManager, "file_io_factory", lambda: file_io)
    return file_io


def prompts(prompt_len: int, seed: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The two prompts :func:`conformance.harness.tiered.run_round_trip` used with ``seed``."""
    return T._prompts(random.Random(seed), prompt_len)


def serve_again(session: Any, prompt_len: int, *, seed: int = 0, tag: str = "3") -> None:
    """Reset GPU cache + CPU tier (draining the file writes), poison the region, ask again."""
    T.drain_files(session)
    T.reset_all(session)
    T._poison_region(session)
    for name, prompt in zip(("a", "b"), prompts(prompt_len, seed), strict=True):
        session.add_request(RequestSpec(f"{name}{tag}", prompt, max_tokens=2))
        T.run_until_idle(session)


def damage(paths: Sequence[Path], how: str) -> None:
    """:func:`conformance.harness.tiered.corrupt`, plus ``bitrot`` (one bit of the middle byte),
    ``extended`` (a page of zeros appended) and ``swapped`` (each file replaced by the next
    one's bytes: whole files of other keys)."""
    if how == "bitrot":
        for path in paths:
            with open(path, "r+b") as f:
                f.seek(path.stat().st_size // 2 + 1)
                byte = f.read(1)[0]
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte ^ 0x10]))
    elif how == "extended":
        for path in paths:
            with open(path, "ab") as f:
                f.write(bytes(4096))
    elif how == "swapped":
        if len(paths) < 2:
            raise ValueError("swapping needs at least two files")
        data = [p.read_bytes() for p in paths]
        for path, other in zip(paths, data[1:] + data[:1], strict=True):
            path.write_bytes(other)
    else:
        T.corrupt(paths, how)


def _writer(path: str, namespace: bytes, key_id: bytes, payload_bytes: int, started: str) -> None:
    """The killed writer (a forked child): half of the header, then it hangs until killed."""
    real = os.writev

    def half_then_hang(fd: int, buffers: Any) -> int:
        n = real(fd, [memoryview(buffers[0])[: len(buffers[0]) // 2]])
        Path(started).touch()
        time.sleep(600)
        return n

    os.writev = half_then_hang  # this process only
    payload = memoryview(bytearray(os.urandom(payload_bytes)))
    S.store_chunk(path, payload, key_id, S.ChunkIO(namespace=namespace))


def kill_mid_write(path: Path, namespace: bytes, key_id: bytes, payload_bytes: int) -> list[Path]:
    """Run :func:`vllm_adapter.disk.tier.store_chunk` of ``path`` in a forked child process,
    ``SIGKILL`` it once it has written part of the file, and return what it left beside
    ``path`` (files whose name starts with ``path``'s)."""
    started = path.parent / f".started-{os.getpid()}"
    started.unlink(missing_ok=True)
    child = multiprocessing.get_context("fork").Process(
        target=_writer, args=(str(path), namespace, key_id, payload_bytes, str(started))
    )
    child.start()
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            if not child.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the writer exited ({child.exitcode}) before writing")
            time.sleep(0.01)
        assert child.pid is not None
        os.kill(child.pid, signal.SIGKILL)
        child.join(timeout=30)
    finally:
        if child.is_alive():
            child.kill()
            child.join()
    started.unlink()
    if child.exitcode != -signal.SIGKILL:
        raise RuntimeError(f"the writer was not killed (exit code {child.exitcode})")
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(path.name))


def chosen_has_kvchunk_tier() -> bool:
    """Whether ``--spec`` chose a spec with kvchunk's file tier (a ``KvchunkTieringOffloadingSpec``)."""
    spec = spec_option.chosen()
    return spec is not None and issubclass(spec.load(), S.KvchunkTieringOffloadingSpec)


def probe_for(kvchunk_tier: bool) -> T.FileProbe:
    """The probe of the tier's file I/O: kvchunk's chunk files, or vLLM's fs tier's blocks."""
    return ChunkProbe() if kvchunk_tier else T.FileProbe()


def file_bytes(kvchunk_tier: bool, row: int) -> int:
    """A whole file of the tier for a ``row``-byte CPU-tier row (kvchunk's adds its header)."""
    return row + (S.HEADER_SIZE if kvchunk_tier else 0)


class PackedProbe(T.FileProbe):
    """:class:`~conformance.harness.tiered.FileProbe`'s counts on kvchunk's packed tier.

    Wraps the tiers' :class:`~vllm_adapter.disk.fileio.TierFileIO` ``store_packed`` and
    ``finish_packed`` (one call per file written: a one-task store job's file, or the last
    step of a file a job split across the pool writes, :mod:`vllm_adapter.disk.packed_split`)
    and ``load_packed`` (one call per load job); a loaded key is recorded as a name of its group
    (``packed_g<group>/<key>.bin``), so ``read_per_group`` counts sections read per group.
    ``files_written`` counts files.  The ``store`` hook sees both kinds of call (a split
    file's: ``(temp, plan, sums, io)``, its keys ``plan.keys``); a split file's
    ``open_packed`` and ``store_packed_part`` calls that raise are store failures too.
    """

    files_written: int = 0

    def install(
        self,
        monkeypatch: Any,
        module: Any = None,
        store_name: str = "store_packed",
        load_name: str = "load_packed",
    ) -> Self:
        module = _wrapped_file_io(monkeypatch) if module is None else module
        real_store, real_load = getattr(module, store_name), getattr(module, load_name)
        real_finish = module.finish_packed

        def names_of(keys: Sequence[bytes]) -> list[str]:
            return [f"packed_g{P.group_of_key(k)}/{bytes(k).hex()}.bin" for k in keys]

        def store(path: Any, *args: Any, **kwargs: Any) -> Any:
            real = real_finish if isinstance(path, P.PackedTemp) else real_store
            try:
                out = (self.store or real)(path, *args, **kwargs)
            except OSError as exc:
                with self._lock:
                    self.store_failures.append(f"{type(exc).__name__}: {exc}")
                raise
            with self._lock:
                self.files_written += 1
            return out

        def load(index: Any, keys: Sequence[bytes], *args: Any, **kwargs: Any) -> None:
            paths = names_of(keys)
            try:
                if self.before_load is not None:
                    self.before_load(list(paths))
                real_load(index, keys, *args, **kwargs)
            except OSError as exc:
                done = int(getattr(exc, "num_succeeded", 0))
                with self._lock:
                    self.loaded.extend(paths[:done])
                    self.load_failures.append(f"{type(exc).__name__}: {exc}")
                raise
            with self._lock:
                self.loaded.extend(paths)

        def failing_part(real: Any) -> Any:
            def part(*args: Any, **kwargs: Any) -> Any:
                try:
                    return real(*args, **kwargs)
                except OSError as exc:
                    with self._lock:
                        self.store_failures.append(f"{type(exc).__name__}: {exc}")
                    raise

            return part

        monkeypatch.setattr(module, store_name, store)
        monkeypatch.setattr(module, "finish_packed", store)
        for name in ("open_packed", "store_packed_part"):  # a split file's other writes
            monkeypatch.setattr(module, name, failing_part(getattr(module, name)))
        monkeypatch.setattr(module, load_name, load)
        return self


def packed_files(root: Path) -> list[Path]:
    """Every packed file under ``root`` (any namespace)."""
    return sorted(root.rglob(f"*{P.PACKED_SUFFIX}"))
