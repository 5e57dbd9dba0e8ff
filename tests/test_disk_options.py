"""The disk tier's options as an operator writes them (issue #29 item 8).

* ``disk_bytes_to_use`` takes what the CLI's ``--disk-bytes`` takes (``"800GB"``,
  ``"4GiB"``, digits, ints): one parser, :func:`vllm_adapter.units.parse_bytes`.
* A budget below the files one chunk needs is refused when the tier is built, naming that
  size: per chunk, one chunk file; packed, one section per offloaded KV-cache group, the
  full-attention groups' in one file and the window groups' in another, reserved together
  (:func:`vllm_adapter.disk.budget.min_disk_bytes`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import uuid
from pathlib import Path
from typing import Any

import pytest

from reference import packed as RP
from vllm_adapter import units
from vllm_adapter.cli.args import parse_bytes as cli_parse_bytes
from vllm_adapter.disk import budget as DB
from vllm_adapter.disk.chunk_file import HEADER_SIZE

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="needs vllm importable"
)

GiB = 1 << 30


def _fits(tmp_path: Path, n: int) -> None:
    size, _ = DB._fs_bytes(str(tmp_path))
    if n > size:
        pytest.skip(f"the file system under {tmp_path} is smaller than {n} bytes")


# ---------------------------------------------------------------------------
# disk_bytes_to_use: the CLI's strings
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        (" 1048576 ", 1 << 20),
        ("4GiB", 4 * GiB),
        ("4 gib", 4 * GiB),
        ("16MiB", 16 << 20),
        ("1GB", 10**9),
        ("1.5GB", 1_500_000_000),
        ("0.5KiB", 512),
    ],
)
def test_disk_bytes_to_use_takes_what_disk_bytes_takes(
    value: Any, expected: int, tmp_path: Path
) -> None:
    _fits(tmp_path, expected)
    assert DB.parse_disk_bytes(value, str(tmp_path), "the tier") == expected
    if isinstance(value, str):
        assert cli_parse_bytes(value) == units.parse_bytes(value) == expected


def test_800gb_is_taken_where_the_disk_holds_it(tmp_path: Path) -> None:
    """The docstring's old counter-example: now bytes, refused only by the file system."""
    size, _ = DB._fs_bytes(str(tmp_path))
    if size >= 800 * 10**9:
        assert DB.parse_disk_bytes("800GB", str(tmp_path), "x") == 800 * 10**9
    else:
        with pytest.raises(ValueError, match="larger than the file system"):
            DB.parse_disk_bytes("800GB", str(tmp_path), "x")


@pytest.mark.parametrize(
    "value", ["1e12", "lots", "25G", "1.5B", "8bit", "1_0", "+64", "-1", "1 GiB x", "²", 1.5, True]
)
def test_what_disk_bytes_refuses_disk_bytes_to_use_refuses(value: Any, tmp_path: Path) -> None:
    """One parser: every string the CLI refuses, the tier refuses, with the key, a valid
    value, and a size string it takes."""
    if isinstance(value, str):
        with pytest.raises(argparse.ArgumentTypeError):
            cli_parse_bytes(value)
    with pytest.raises(ValueError) as err:
        DB.parse_disk_bytes(value, str(tmp_path), "the tier")
    msg = str(err.value)
    assert "'disk_bytes_to_use' in the tier must be a number of bytes" in msg, msg
    assert re.search(r'such as "\d+GiB"', msg), msg
    suggested = int(msg.split("e.g. ")[1].split(" ")[0])
    assert DB.parse_disk_bytes(suggested, str(tmp_path), "x") == suggested
    assert "800GB" in msg and "refused" not in msg


@pytest.mark.parametrize("value", ["0", "0GiB", 0, -5])
def test_zero_is_not_positive_however_it_is_written(value: Any, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'disk_bytes_to_use'.*(positive|number of bytes)"):
        DB.parse_disk_bytes(value, str(tmp_path), "the tier")


def test_the_tier_config_keeps_the_parsed_bytes(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    from vllm_adapter import names
    from vllm_adapter.disk import options as TO

    root = str(tmp_path / "kv")
    (out,) = TO.kvchunk_tier_configs(
        [{"type": "fs", "root_dir": root, "disk_bytes_to_use": "1GiB"}]
    )
    assert out == {"type": names.KVCHUNK_FS_TIER, "root_dir": root, "disk_bytes_to_use": GiB}


# ---------------------------------------------------------------------------
# The smallest budget: the file one chunk needs
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [1, 2, 5, 60])
@pytest.mark.parametrize("row", [4096, 16384, 3 * 4096 + 1])
def test_min_disk_bytes_is_the_file_one_full_chunk_needs(groups: int, row: int) -> None:
    packed = DB.min_disk_bytes("packed", row, groups, HEADER_SIZE)
    assert packed == DB.min_disk_bytes("packed", row, groups, HEADER_SIZE, full_groups=groups)
    assert packed == RP.packed_file_bytes([row] * groups, [DB.VLLM_KEY_BYTES] * groups)
    assert packed == RP.header_bytes([36] * groups) + groups * RP.page_round(row)
    # One section per group: more than the one-section file the tier used to require.
    if groups > 1:
        assert packed > RP.packed_file_bytes([row], [36])
    # Per chunk: one chunk file, whatever the group count.
    assert DB.min_disk_bytes("per_chunk", row, groups, HEADER_SIZE) == HEADER_SIZE + row


@pytest.mark.parametrize("groups", [2, 6, 60])
@pytest.mark.parametrize("row", [4096, 3 * 4096 + 1])
def test_min_disk_bytes_with_windows_is_two_files(groups: int, row: int) -> None:
    """A chunk's store job with windows writes its full-attention sections and its window
    sections in two files (each its own header), reserved together; window groups alone,
    one file."""
    for full in (1, groups - 1):
        got = DB.min_disk_bytes("packed", row, groups, HEADER_SIZE, full_groups=full)
        assert got == (RP.header_bytes([36] * full) + RP.header_bytes([36] * (groups - full))
                       + groups * RP.page_round(row))
        if groups < 50:  # both headers fit a page: one page more than a single file
            assert got == DB.min_disk_bytes("packed", row, groups, HEADER_SIZE) + 4096
    assert DB.min_disk_bytes("packed", row, groups, HEADER_SIZE, full_groups=0) == (
        DB.min_disk_bytes("packed", row, groups, HEADER_SIZE))
    with pytest.raises(ValueError, match="full_groups"):
        DB.min_disk_bytes("packed", row, groups, HEADER_SIZE, full_groups=groups + 1)


def test_vllms_offload_keys_are_36_bytes() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.kv_offload.base import make_offload_key

    assert len(make_offload_key(b"\x07" * 32, 3)) == DB.VLLM_KEY_BYTES


def _spec(root: Path, layout: str, budget: int) -> Any:
    """kvchunk's tiering spec over two KV-cache groups (full attention + sliding window)."""
    from conformance.harness import driver as D
    from vllm_adapter import names
    from vllm_adapter import vllm_tools_api as V
    from vllm_adapter.disk import KvchunkTieringOffloadingSpec

    extra = {
        **names.KVCHUNK_TIERING_SPEC,
        "blocks_per_chunk": 2,
        "cpu_bytes_to_use": 1 << 24,
        "secondary_tiers": [{"type": "fs", "root_dir": str(root), "layout": layout,
                             "disk_bytes_to_use": budget}],
    }
    vllm_config, resolved = D.build_vllm_config(
        D.full_swa_kv_cache_config(num_blocks=64), extra_config=extra, num_gpu_blocks=64
    )
    config = V.build_offloading_config(vllm_config, resolved)
    # A fresh engine id: its CPU region's /dev/shm name is its own.
    config = dataclasses.replace(config, engine_id=f"kvchunk-test-{uuid.uuid4().hex}")
    return KvchunkTieringOffloadingSpec(config)


def _smallest(layout: str) -> tuple[int, int]:
    """(the smallest budget, the row) of :func:`_spec`'s tier: computed here, not by the tier."""
    row = 16384  # kv_bytes_per_chunk of full_swa_kv_cache_config at 2 blocks per chunk
    if layout == "packed":
        # A full chunk's store job: the full-attention section in one file, the sliding
        # window's in another, each a page of header and its page-rounded row, reserved together.
        return 2 * (4096 + row), row
    return HEADER_SIZE + row, row


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("layout", ["packed", "per_chunk"])
def test_a_budget_below_the_file_one_chunk_needs_is_refused_when_the_tier_is_built(
    layout: str, tmp_path: Path
) -> None:
    smallest, row = _smallest(layout)
    spec = _spec(tmp_path, layout, smallest - 1)
    assert spec.cpu_page_size_per_worker == row
    assert len(spec.config.groups) == 2
    with pytest.raises(ValueError) as err:
        spec.get_manager()
    msg = str(err.value)
    assert "'disk_bytes_to_use'" in msg and f"({smallest - 1})" in msg, msg
    assert f"give at least {smallest}," in msg, msg

    manager = _spec(tmp_path, layout, smallest).get_manager()
    try:
        (tier,) = manager.secondary_tiers
        assert tier.budget.budget == smallest
        if layout == "packed":  # what the tier reserves for a full chunk's store: two files
            assert tier._file_bytes([b"\0" * 36]) + tier._file_bytes([b"\1" * 36]) == smallest
            assert tier.budget.chunking.full_groups == {0}
    finally:
        manager.shutdown()


@pytest.mark.vllm
@needs_vllm
def test_a_packed_budget_of_one_section_is_refused_for_two_groups(tmp_path: Path) -> None:
    """The old minimum (one single-section file) stores no full chunk of two groups."""
    one_section = RP.packed_file_bytes([16384], [36])
    with pytest.raises(ValueError, match=f"give at least {_smallest('packed')[0]},"):
        _spec(tmp_path, "packed", one_section).get_manager()


@needs_vllm
def test_the_packed_tier_splits_its_large_load_jobs_by_default() -> None:
    """A packed load job of at least twice the reference's part size is split across the
    tier's pool (issue #30 item 1), and the operator CLI knows the split before a tier
    starts: vLLM's pool threads (16 read + 16 write by default, or the entry's
    ``n_read_threads`` / ``n_write_threads``) and the reference's part size."""
    from reference import packed_split as RS
    from vllm_adapter.disk.tier import KvchunkFileTierManager, configured_load_split

    assert KvchunkFileTierManager.load_part_bytes == RS.PART_BYTES
    assert configured_load_split({}) == RS.LoadSplit(16 + 16, RS.PART_BYTES)
    assert configured_load_split({"n_read_threads": 3, "n_write_threads": 1}) == (
        RS.LoadSplit(4, RS.PART_BYTES))
    assert configured_load_split({"n_write_threads": 2}) == RS.LoadSplit(16 + 2, RS.PART_BYTES)


@needs_vllm
def test_vllm_fs_tier_pool_defaults_are_read_through_the_api_module() -> None:
    """vLLM's ``FileSystemTierManager`` defaults of its pool's threads, read in
    :mod:`vllm_adapter.vllm_api` (the one place that reaches vLLM)."""
    from vllm_adapter import vllm_api as V

    assert V.fs_tier_pool_defaults() == {"n_read_threads": 16, "n_write_threads": 16}


@needs_vllm
def test_a_vllm_that_renamed_the_pool_threads_parameters_says_so(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A vLLM whose ``FileSystemTierManager`` no longer takes ``n_read_threads`` (or gives it
    no default) is an error naming the parameter and the class, not a ``KeyError``."""
    from vllm_adapter import vllm_api as V
    from vllm_adapter.disk.tier import configured_pool_threads

    class Renamed:
        def __init__(self, n_readers: int = 16, n_write_threads: int = 16) -> None: ...

    monkeypatch.setattr(V, "FileSystemTierManager", Renamed)
    with pytest.raises(TypeError, match=r"FileSystemTierManager.*n_read_threads"):
        configured_pool_threads({})

    class NoDefault:
        def __init__(self, n_read_threads: int, n_write_threads: int = 16) -> None: ...

    monkeypatch.setattr(V, "FileSystemTierManager", NoDefault)
    with pytest.raises(TypeError, match=r"FileSystemTierManager.*n_read_threads"):
        V.fs_tier_pool_defaults()
