"""vllm_adapter.disk.tier: the chunk file format, its checks, its config errors, atomic writes.

The engine-level cases (damaged files, full disk, restarts, killed writers, two engines
on one root, gemma-4 and DeepSeek-V4) are the faults lane's
(``conformance/lanes/test_tiered_faults.py``); these pin the format itself.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import blake3
import pytest
import xxhash

from conformance.testing.requires import require_vllm  # noqa: E402

require_vllm()

from conformance.harness import vllm_harness_api as V  # noqa: E402
from vllm_adapter import names  # noqa: E402
from vllm_adapter.disk import chunk_file as C  # noqa: E402
from vllm_adapter.disk import options as TO  # noqa: E402
from vllm_adapter.disk import tier as S  # noqa: E402

NS = bytes(range(16))
KEY = S.key_digest(b"\x01" * 36)
ROW = 3 * 4096


def _payload(fill: int) -> memoryview:
    return memoryview(bytearray(bytes([fill]) * ROW))


def _load(path: Path, io: S.ChunkIO, key: bytes = KEY, size: int = ROW) -> bytes:
    dest = memoryview(bytearray(size))
    S.load_chunk(str(path), dest, key, io)
    return bytes(dest)


def test_round_trip_and_layout(tmp_path: Path) -> None:
    io = S.ChunkIO(namespace=NS)
    path = tmp_path / "a" / "b.bin"
    data = bytes(os.urandom(ROW))
    S.store_chunk(str(path), memoryview(bytearray(data)), KEY, io)
    assert path.stat().st_size == S.HEADER_SIZE + ROW
    assert path.read_bytes()[:8] == S.MAGIC and path.read_bytes()[S.HEADER_SIZE:] == data
    assert _load(path, io) == data
    assert [p.name for p in path.parent.iterdir()] == ["b.bin"], "a temporary file was left"


def test_a_directory_is_made_only_when_the_create_finds_it_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store into a missing directory makes it; a store into an existing one makes no
    directory call (each is a round trip to a shared file system's metadata server:
    ``vllm_adapter.metadata_model`` counts none for a packed file)."""
    io = S.ChunkIO(namespace=NS)
    calls: list[str] = []
    makedirs = os.makedirs

    def counted(name: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(str(name))
        makedirs(name, *args, **kwargs)

    monkeypatch.setattr(os, "makedirs", counted)
    first, second = tmp_path / "new" / "deep" / "a.bin", tmp_path / "new" / "deep" / "b.bin"
    S.store_chunk(str(first), _payload(1), KEY, io)
    assert calls[0] == str(first.parent)  # (os.makedirs makes its parent by calling itself)
    made = list(calls)
    S.store_chunk(str(second), _payload(2), KEY, io)
    assert calls == made, "a directory call before a file in an existing directory"
    assert _load(first, io) == bytes(_payload(1)) and _load(second, io) == bytes(_payload(2))


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda b: b[: len(b) // 2], "size"),
        (lambda b: b + b"\0", "size"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum"),
        (lambda b: bytes([b[0] ^ 1]) + b[1:], "header"),
        (lambda b: b[:20] + bytes([b[20] ^ 1]) + b[21:], "header"),
    ],
    ids=["truncated", "extended", "payload-bit", "magic-bit", "length-bit"],
)
def test_a_damaged_file_fails_and_is_removed(tmp_path: Path, damage: Any, why: str) -> None:
    io = S.ChunkIO(namespace=NS)
    path = tmp_path / "c.bin"
    S.store_chunk(str(path), _payload(7), KEY, io)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(S.ChunkFileError) as err:
        _load(path, io)
    assert isinstance(err.value, OSError) and err.value.why == why
    assert not path.exists() and io.counters.bad_files == {why: 1}


def test_another_namespace_key_or_size_is_a_failed_load(tmp_path: Path) -> None:
    for other, why in (
        ({"io": S.ChunkIO(namespace=bytes(16))}, "namespace"),
        ({"key": S.key_digest(b"other")}, "key"),
        ({"size": ROW - 4096}, "size"),
    ):
        path = tmp_path / f"{why}.bin"
        S.store_chunk(str(path), _payload(3), KEY, S.ChunkIO(namespace=NS))
        with pytest.raises(S.ChunkFileError, match=why):
            _load(path, other.get("io", S.ChunkIO(namespace=NS)), other.get("key", KEY),
                  other.get("size", ROW))


def test_quarantine_keeps_the_bad_file_aside(tmp_path: Path) -> None:
    io = S.ChunkIO(namespace=NS, bad_files="quarantine", quarantine_dir=str(tmp_path / "q"))
    path = tmp_path / "d.bin"
    S.store_chunk(str(path), _payload(1), KEY, io)
    os.truncate(path, 100)
    with pytest.raises(S.ChunkFileError):
        _load(path, io)
    assert not path.exists() and len(list((tmp_path / "q").iterdir())) == 1


def test_batch_load_reports_the_prefix_and_checks_every_file(tmp_path: Path) -> None:
    io = S.ChunkIO(namespace=NS)
    paths = [str(tmp_path / f"{i}.bin") for i in range(3)]
    keys = [S.key_digest(bytes([i])) for i in range(3)]
    region = memoryview(bytearray(3 * ROW))
    S.batch_store_chunks(paths, keys, region, [0, ROW, 2 * ROW], ROW, io)
    for p in paths[1:]:
        os.truncate(p, 10)
    with pytest.raises(OSError) as err:
        S.batch_load_chunks(paths, keys, region, [0, ROW, 2 * ROW], ROW, io)
    assert err.value.num_succeeded == 1  # type: ignore[attr-defined]
    assert [os.path.exists(p) for p in paths] == [True, False, False]


def _hammer(root: str, fill: int, seconds: float) -> None:
    io = S.ChunkIO(namespace=NS)
    payload = _payload(fill)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for i in range(4):
            S.store_chunk(os.path.join(root, f"{i}.bin"), payload, KEY, io)


def test_concurrent_writers_never_publish_a_torn_file(tmp_path: Path) -> None:
    """Two processes rewrite the same files (different valid contents) while this one
    reads them: every read is one writer's whole file, never a mix, never a failure."""
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_hammer, args=(str(tmp_path), f, 3.0)) for f in (0xAA, 0xBB)]
    for w in writers:
        w.start()
    io = S.ChunkIO(namespace=NS)
    seen: set[bytes] = set()
    reads = 0
    try:
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            for i in range(4):
                try:
                    data = _load(tmp_path / f"{i}.bin", io)
                except FileNotFoundError:
                    continue
                reads += 1
                seen.add(bytes(sorted(set(data))))
    finally:
        for w in writers:
            w.join()
    assert all(w.exitcode == 0 for w in writers)
    assert reads > 0 and seen <= {b"\xaa", b"\xbb"}, f"{reads} reads saw {seen}"
    assert not io.counters.bad_files, io.counters
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]


@pytest.mark.parametrize(
    "tier, match",
    [
        ({"type": "fs"}, "'root_dir' in secondary_tiers\\[0\\].*e.g."),
        ({"type": "fs", "root_dir": "/x", "checksum": "crc32c"}, "'checksum'.*'blake3'"),
        ({"type": "fs", "root_dir": "/x", "bad_files": "keep"}, "'bad_files'.*'quarantine'"),
        ({"type": "fs", "root_dir": "/x", "fsync": "yes"}, "'fsync'.*true or false"),
        ({"type": "fs", "root_dir": "/x", "n_read_threads": 0}, "'n_read_threads'.*e.g. 16"),
        ("fs", "secondary_tiers\\[0\\].*must be an object"),
        ({"type": "fs", "root_dir": "/x", "root": "/y"}, "'root' in secondary_tiers\\[0\\].*valid: type"),
    ],
)
def test_bad_tier_config_is_a_value_error_naming_the_key(tier: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TO.kvchunk_tier_configs([tier])


@pytest.mark.parametrize(
    "extra, match",
    [
        ({}, "'disk_bytes_to_use' in secondary_tiers\\[0\\] .*is required.*e.g. \\d+"),
        ({"disk_bytes_to_use": "1e11"}, "'disk_bytes_to_use'.*number of bytes.*e.g. \\d+"),
        ({"disk_bytes_to_use": 0}, "'disk_bytes_to_use'.*positive.*e.g. \\d+"),
        ({"disk_bytes_to_use": -5}, "'disk_bytes_to_use'.*positive.*e.g. \\d+"),
        ({"disk_bytes_to_use": 1 << 80}, "'disk_bytes_to_use'.*larger than the file system.*e.g."),
        ({"disk_bytes_to_use": 1 << 30, "eviction": "fifo"}, "'eviction'.*'reachable'.*'lru'"),
    ],
)
def test_a_bad_disk_budget_is_a_value_error_naming_the_key(
    extra: dict[str, Any], match: str, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=match):
        TO.kvchunk_tier_configs([{"type": "fs", "root_dir": str(tmp_path), **extra}])


def test_fs_tiers_become_kvchunks_others_stay(tmp_path: Path) -> None:
    root = str(tmp_path / "kv")
    out = TO.kvchunk_tier_configs([{"type": "fs", "root_dir": root, "disk_bytes_to_use": "4096"},
                                   {"type": "example"}])
    assert out == [{"type": names.KVCHUNK_FS_TIER, "root_dir": root, "disk_bytes_to_use": 4096},
                   {"type": "example"}]
    tier_cls = V.SecondaryTierFactory.get_tier_class({"type": names.KVCHUNK_FS_TIER})
    assert tier_cls is S.KvchunkFileTierManager


GEOMETRY_CHANGES: dict[str, tuple[str, Any]] = {
    # geometry field -> (what the spec or tier option changes, a different value)
    "format": ("layout", "packed"),
    "format_version": ("layout", "packed"),
    "checksum": ("checksum", "blake3"),
    "model": ("config.model.name", "other"),
    "kv_dtype": ("config.model.dtype", "float8_e4m3fn"),
    "kv_cache_layout": ("config.kv_cache_layout", "HND"),
    "canonical_layout": ("config.canonical_layout", True),
    "replicated_layout": ("replicated_layout", True),
    "tokens_per_hash": ("config.cache.tokens_per_hash", 32),
    "blocks_per_chunk": ("config.cache.blocks_per_chunk", 4),
    "worker_kv_bytes_per_block": ("config.worker_kv_bytes_per_block", 2048),
    "kv_bytes_per_chunk": ("kv_bytes_per_chunk", 4096),
    "cpu_page_size_per_worker": ("cpu_page_size_per_worker", 4096),
    "file_payload_bytes": ("payload_bytes", 4096),
    "groups.group_id": ("group.group_id", 1),
    "groups.tokens_per_block": ("group.tokens_per_block", 32),
    "groups.layer_names": ("group.layer_names", ("l1",)),
    "groups.sliding_window_size_in_chunks": ("group.sliding_window_size_in_chunks", 2),
    "groups.blocks_per_chunk": ("config.cache.blocks_per_chunk", 4),
    "parallel.rank": ("config.parallel.rank", 1),
    "parallel.world_size": ("config.parallel.world_size", 2),
    "parallel.tp_size": ("config.parallel.tp_size", 2),
    "parallel.pp_size": ("config.parallel.pp_size", 2),
    "parallel.pcp_size": ("config.parallel.pcp_size", 2),
    "parallel.dcp_size": ("config.parallel.dcp_size", 2),
}


def _leaf_fields(fields: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for name, value in fields.items():
        if isinstance(value, dict):
            out |= _leaf_fields(value, f"{prefix}{name}.")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            for item in value:
                out |= _leaf_fields(item, f"{prefix}{name}.")
        else:
            out.add(prefix + name)
    return out


def test_namespace_changes_with_every_geometry_field() -> None:
    """Every field :func:`geometry` returns is a case here, and changing it changes the namespace."""
    from types import SimpleNamespace as NS_

    def digest_with(change: tuple[str, Any] | None = None) -> bytes:
        group = NS_(group_id=0, tokens_per_block=16, layer_names=("l0",),
                    sliding_window_size_in_chunks=None)
        par = NS_(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1)
        config = NS_(model=NS_(name="m", dtype="bfloat16"), kv_cache_layout="NHD",
                     canonical_layout=False, cache=NS_(tokens_per_hash=16, blocks_per_chunk=2),
                     worker_kv_bytes_per_block=4096, groups=(group,), parallel=par)
        spec = NS_(config=config, replicated_layout=False, kv_bytes_per_chunk=8192,
                   cpu_page_size_per_worker=8192, group=group)
        options: dict[str, Any] = {"payload_bytes": 8192}
        if change is not None:
            path, value = change
            if path in ("layout", "checksum", "payload_bytes"):
                options[path] = value
            else:
                *head, last = path.split(".")
                obj = spec
                for h in head:
                    obj = getattr(obj, h)
                setattr(obj, last, value)
        payload = options.pop("payload_bytes")
        return TO.namespace_digest(TO.geometry(spec, payload, **options))

    from types import SimpleNamespace as NS2

    probe = TO.geometry(
        NS2(config=NS2(model=NS2(name="m", dtype="d"), kv_cache_layout=None, canonical_layout=False,
                       cache=NS2(tokens_per_hash=1, blocks_per_chunk=1), worker_kv_bytes_per_block=1,
                       groups=(NS2(group_id=0, tokens_per_block=1, layer_names=(),
                                   sliding_window_size_in_chunks=None),),
                       parallel=NS2(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1,
                                    dcp_size=1)),
            replicated_layout=False, kv_bytes_per_chunk=1, cpu_page_size_per_worker=1),
        1,
    )
    assert _leaf_fields(probe) == set(GEOMETRY_CHANGES), (
        "geometry() fields without a namespace case (or cases for fields it no longer has): "
        f"{_leaf_fields(probe) ^ set(GEOMETRY_CHANGES)}"
    )
    base = digest_with()
    same = [field for field, change in GEOMETRY_CHANGES.items() if digest_with(change) == base]
    assert not same, f"changing these geometry fields kept the namespace: {same}"


def test_a_replicated_layout_shares_the_namespace_across_parallel_configurations() -> None:
    """vLLM's FileMapper shares a replicated (MLA) model's files across TP sizes and ranks;
    kvchunk's namespace does too, there and only there."""
    from types import SimpleNamespace as NS_

    def digest_of(replicated: bool, **parallel: int) -> bytes:
        par = NS_(rank=0, world_size=4, tp_size=4, pp_size=1, pcp_size=1, dcp_size=1,
                  is_parallelism_agnostic=False)
        for name, value in parallel.items():
            setattr(par, name, value)
        group = NS_(group_id=0, tokens_per_block=256, layer_names=("l0",),
                    sliding_window_size_in_chunks=None)
        config = NS_(model=NS_(name="m", dtype="fp8_ds_mla"), kv_cache_layout="NHD",
                     canonical_layout=False, cache=NS_(tokens_per_hash=4, blocks_per_chunk=2),
                     worker_kv_bytes_per_block=4096, groups=(group,), parallel=par,
                     replicated_layout=replicated)
        spec = NS_(config=config, replicated_layout=replicated, kv_bytes_per_chunk=8192,
                   cpu_page_size_per_worker=8192)
        return TO.namespace_digest(TO.geometry(spec, 8192))

    tp2 = {"tp_size": 2, "world_size": 2, "rank": 1}
    assert digest_of(True) == digest_of(True, **tp2), "replicated: TP4 and TP2 must share"
    assert digest_of(False) != digest_of(False, **tp2), "not replicated: they must not"
    assert digest_of(True) != digest_of(False), "a replicated layout is its own namespace"
    assert digest_of(False, is_parallelism_agnostic=True) == digest_of(
        False, is_parallelism_agnostic=True, **tp2), "parallelism-invariant pages share too"


LARGE = 2 * C.SEGMENT_BYTES + 3 * 4096
"""A payload hashed beside its I/O (>= OVERLAP_BYTES) over three read segments, the last short."""


@pytest.mark.parametrize("where", [0, C.SEGMENT_BYTES, LARGE - 1], ids=["first", "second", "last"])
def test_a_large_payload_round_trips_and_any_segment_bit_fails(tmp_path: Path, where: int) -> None:
    assert LARGE >= C.OVERLAP_BYTES
    io = S.ChunkIO(namespace=NS)
    path = tmp_path / "big.bin"
    data = os.urandom(LARGE)
    S.store_chunk(str(path), memoryview(bytearray(data)), KEY, io)
    assert path.read_bytes()[S.HEADER_SIZE:] == data
    assert _load(path, io, size=LARGE) == data
    raw = bytearray(path.read_bytes())
    raw[S.HEADER_SIZE + where] ^= 0x40
    path.write_bytes(bytes(raw))
    with pytest.raises(S.ChunkFileError) as err:
        _load(path, io, size=LARGE)
    assert err.value.why == "checksum" and not path.exists()
    # the same thread's hashing helper is clean for the next file
    S.store_chunk(str(path), memoryview(bytearray(data)), KEY, io)
    assert _load(path, io, size=LARGE) == data


@pytest.mark.parametrize("size", [ROW, LARGE], ids=["small", "large"])
def test_a_load_reads_the_header_and_the_payload_in_one_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    """A chunk file's header and payload (a large payload's first segment, the rest read
    while it is hashed) come in one ``preadv`` from offset 0: one request per file where the
    payload is small, not a header read and then a payload read; every byte is still
    checked (a damaged header fails the load)."""
    io = S.ChunkIO(namespace=NS)
    path = tmp_path / "c.bin"
    data = os.urandom(size)
    S.store_chunk(str(path), memoryview(bytearray(data)), KEY, io)
    reads: list[tuple[int, int]] = []
    real = os.preadv

    def counted(fd: int, buffers: list[Any], offset: int) -> int:
        reads.append((offset, sum(len(memoryview(b)) for b in buffers)))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counted)
    assert _load(path, io, size=size) == data
    first = min(size, C.SEGMENT_BYTES)
    assert reads[0] == (0, S.HEADER_SIZE + first), reads
    assert len(reads) == 1 + (size - first + C.SEGMENT_BYTES - 1) // C.SEGMENT_BYTES, reads
    raw = bytearray(path.read_bytes())
    raw[20] ^= 0x01  # a header field (the payload length), its digest then wrong
    path.write_bytes(bytes(raw))
    with pytest.raises(S.ChunkFileError) as err:
        _load(path, io, size=size)
    assert err.value.why == "header" and not path.exists()


ONE_SHOT = {
    "xxh3-128": lambda data: xxhash.xxh3_128(data).digest(),
    "blake3": lambda data: blake3.blake3(data).digest(16),
}
"""Each payload checksum computed in one call by its library (not by the tier's helpers)."""


@pytest.mark.parametrize("checksum", sorted(ONE_SHOT))
def test_a_large_payload_digest_equals_the_one_shot_digest(tmp_path: Path, checksum: str) -> None:
    """Hashing segment by segment beside the I/O gives the digest of the whole payload, as
    the checksum's own library computes it in one call, where the header keeps it: after
    magic (8), version (2), checksum id (2), header size (4), payload length (8), namespace
    (16) and key (16)."""
    assert set(ONE_SHOT) == set(C.CHECKSUMS)
    data = os.urandom(LARGE)
    path = tmp_path / "big.bin"
    S.store_chunk(str(path), memoryview(bytearray(data)), KEY,
                  S.ChunkIO(namespace=NS, checksum=checksum))
    header = path.read_bytes()[: S.HEADER_SIZE]
    assert header[56:72] == ONE_SHOT[checksum](data)


def test_stale_temporary_files_are_swept_fresh_ones_and_chunks_kept(tmp_path: Path) -> None:
    io = S.ChunkIO(namespace=NS)
    chunk = tmp_path / "d" / "c.bin"
    S.store_chunk(str(chunk), _payload(1), KEY, io)
    live = os.getppid()  # a running writer: its fresh temporary file stays
    stale = tmp_path / "d" / f"c.bin.{live}-2-ab.tmp"
    fresh = tmp_path / "e" / f"x.bin.{live}-4-cd.tmp"
    for p in (stale, fresh):
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"partial")
    old = time.time() - C.STALE_TEMP_SECONDS - 60
    os.utime(stale, (old, old))
    assert C.sweep_stale_temps(str(tmp_path)) == 1
    assert not stale.exists() and fresh.exists() and chunk.exists()


def test_a_dead_writers_temporary_file_is_swept_at_once(tmp_path: Path) -> None:
    """A writer killed mid-write (SIGKILL) leaves its temporary file; the next sweep removes
    it whatever its age, because the pid in its name no longer runs."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    orphan = tmp_path / "d" / f"c.bin.{dead}-2-ab.tmp"
    orphan.parent.mkdir()
    orphan.write_bytes(b"partial")
    assert C.sweep_stale_temps(str(tmp_path)) == 1 and not orphan.exists()


def test_the_vllm_methods_kvchunk_mirrors_have_not_drifted() -> None:
    """KvchunkFileTierManager re-states vLLM's submit_store / submit_load bookkeeping: a change
    in the installed vLLM's FileSystemTierManager fails here, naming the method."""
    import hashlib
    import inspect
    import textwrap

    mirrored = S.VLLM_METHODS_MIRRORED.get(V.VLLM_VERSION)
    assert mirrored is not None, (
        f"vLLM {V.VLLM_VERSION}: KvchunkFileTierManager was not reviewed against this release; "
        f"known: {sorted(S.VLLM_METHODS_MIRRORED)}"
    )
    drifted = [
        name for name, digest in mirrored.items()
        if hashlib.sha256(textwrap.dedent(inspect.getsource(
            getattr(V.FileSystemTierManager, name))).encode()).hexdigest()[:16] != digest
    ]
    assert not drifted, (
        f"vLLM {V.VLLM_VERSION} changed FileSystemTierManager.{', .'.join(drifted)} since "
        "KvchunkFileTierManager mirrored it: review safe_fs.py, then VLLM_METHODS_MIRRORED"
    )

