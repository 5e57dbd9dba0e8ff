"""The README's serve commands are the one copy: they must name this connector and parse.

Two fenced blocks of ``vllm serve`` commands under "Serving with kvchunk's connector":
the CPU tier (``CPUOffloadingSpec``), then the disk variant (``TieringOffloadingSpec``
with vLLM's file-system tier), each gemma-4-31B-it then DeepSeek-V4-Flash.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from reference.knobs import BLOCK_SIZE
from vllm_adapter.names import (
    CPU_SPEC,
    KVCHUNK_CONNECTOR,
    KVCHUNK_CONNECTOR_MODULE,
    KVCHUNK_TIERING_SPEC,
)
from vllm_adapter.units import parse_bytes

README = Path(__file__).resolve().parent.parent / "README.md"
MODELS = ["google/gemma-4-31B-it", "deepseek-ai/DeepSeek-V4-Flash"]
FS_TIER_PARAMETERS = {"root_dir", "n_read_threads", "n_write_threads", "enable_kv_events"}
"""vLLM 0.33.0 / 0.34.0 ``FileSystemTierManager.__init__`` parameters a config may set."""


def _serve_blocks() -> list[list[list[str]]]:
    """The argv of every command, per fenced block holding ``vllm serve``."""
    text = README.read_text()
    section = text[text.index("## Serving with kvchunk's connector") :]
    section = section[: section.index("\n## ", 1)]
    blocks = section.split("```")[1::2]  # the fenced code blocks
    out = []
    for block in (b for b in blocks if "vllm serve" in b):
        commands = [c for c in block.replace("\\\n", " ").split("\n\n") if c.strip()]
        out.append([shlex.split(c) for c in commands])
    return out


def _serve_commands() -> list[list[str]]:
    """The CPU-tier commands (the first block)."""
    return _serve_blocks()[0]


def _config(argv: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config


def test_readme_has_a_cpu_and_a_disk_block() -> None:
    blocks = _serve_blocks()
    assert len(blocks) == 2
    assert [[c[2] for c in block] for block in blocks] == [MODELS, MODELS]


@pytest.mark.parametrize("variant", [0, 1], ids=["cpu", "disk"])
def test_readme_serve_commands_name_kvchunks_connector(variant: int) -> None:
    for argv in _serve_blocks()[variant]:
        assert argv[:2] == ["vllm", "serve"]
        config = _config(argv)
        assert config["kv_connector"] == KVCHUNK_CONNECTOR
        assert config["kv_connector_module_path"] == KVCHUNK_CONNECTOR_MODULE
        assert config["kv_role"] == "kv_both"
        assert int(config["kv_connector_extra_config"]["cpu_bytes_to_use"]) > 0
        assert "--enable-prefix-caching" in argv
        assert "--no-disable-hybrid-kv-cache-manager" in argv


def test_readme_cpu_commands_use_the_seeds_block_size() -> None:
    for argv in _serve_commands():
        extra = _config(argv)["kv_connector_extra_config"]
        assert extra[BLOCK_SIZE] == 512
        assert extra["spec_name"] == CPU_SPEC
        assert "secondary_tiers" not in extra


def test_readme_disk_commands_use_kvchunks_checksummed_fs_tier() -> None:
    """#17: the disk commands select kvchunk's tier (vLLM's stock fs tier serves wrong KV)."""
    gemma, dsv4 = _serve_blocks()[1]
    sizes = [_config(argv)["kv_connector_extra_config"][BLOCK_SIZE] for argv in (gemma, dsv4)]
    assert sizes == [512, 1024]  # DeepSeek-V4: 1024 tokens, half the files of 512
    for argv in (gemma, dsv4):
        extra = _config(argv)["kv_connector_extra_config"]
        assert extra["spec_name"] == KVCHUNK_TIERING_SPEC["spec_name"]
        assert extra["spec_module_path"] == KVCHUNK_TIERING_SPEC["spec_module_path"]
        (tier,) = extra["secondary_tiers"]
        assert tier["type"] == "fs"
        assert tier["root_dir"].startswith("/")
        assert set(tier) - {"type"} <= FS_TIER_PARAMETERS | {"disk_bytes_to_use"}
        budget = tier.get("disk_bytes_to_use")  # #25: an unbounded disk tier refuses to start
        # A size string the tier takes (#29: "100GiB" starts on most machines), not 2 TB.
        assert isinstance(budget, str) and parse_bytes(budget) == 100 << 30, tier


@pytest.mark.parametrize("variant", [0, 1], ids=["cpu", "disk"])
def test_readme_deepseek_command_pins_its_gpu_block_size_and_tokenizer(variant: int) -> None:
    (_, dsv4) = _serve_blocks()[variant]
    assert dsv4[dsv4.index("--block-size") + 1] == "256"
    assert dsv4[dsv4.index("--kv-cache-dtype") + 1] == "fp8"
    assert dsv4[dsv4.index("--tokenizer-mode") + 1] == "deepseek_v4"


def test_first_screen_holds_the_problem_the_commands_and_what_you_get() -> None:
    """#12: the first 40 lines carry the AssertionError, both commands and the report path."""
    first = "\n".join(README.read_text().splitlines()[:40])
    assert "AssertionError" in first and "gemma-4" in first and "DeepSeek-V4" in first
    assert "nox -s conformance" in first and "nox -s tests" in first
    assert "reports/conformance.md" in first and "faults" in first
    assert f'"kv_connector": "{KVCHUNK_CONNECTOR}"' in first


# ---------------------------------------------------------------------------
# Generated regions (#26 item 3): every figure about performance or the CLI's output is
# written by scripts/gen_readme.py (`nox -s docs`) from reports/ and real CLI runs.
# ---------------------------------------------------------------------------


def _gen() -> Any:
    """scripts/gen_readme.py as a module (scripts/ is no package)."""
    import importlib.util
    import sys

    if "gen_readme" in sys.modules:
        return sys.modules["gen_readme"]
    path = README.parent / "scripts" / "gen_readme.py"
    spec = importlib.util.spec_from_file_location("gen_readme", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_readme"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _stale_message(gen: Any, bodies: dict[str, str]) -> str:
    return (
        "README.md differs from what scripts/gen_readme.py writes (run `nox -s docs`):\n"
        + "\n".join(gen.stale(README.read_text(), bodies))
    )


def test_bench_regions_say_what_the_reports_say() -> None:
    gen = _gen()
    bodies = gen.bench_regions(*gen.load_bench())
    have = gen.read_regions(README.read_text())
    assert set(bodies) <= set(have), f"README lacks regions {set(bodies) - set(have)}"
    assert not gen.stale(README.read_text(), bodies), _stale_message(gen, bodies)


def test_checksum_sentence_names_every_confirmed_miss_of_the_report() -> None:
    """The checksummed tier's sentence: each miss in bench.json's target checks is named
    (geometry, direction, B), and the verdict word is not 'met' when one exists."""
    gen = _gen()
    bench, _ = gen.load_bench()
    text = gen.read_regions(README.read_text())["bench-checksum"]
    checks = [c for c in bench["kvchunk"]["target_checks"] if "checksummed fs tier" in c["target"]]
    missed = [c for c in checks if c["verdict"] == "missed"]
    for c in missed:
        m = re.search(r"\[(.+)-bpc(\d+)-(read|write)\]", c["benchmark"])
        assert m is not None, c["benchmark"]
        assert f"{m[3]} at B={m[2]}" in text, (c["benchmark"], text)
    assert f"{len(missed)} missed of {len(checks)}" in text
    if missed:
        assert "**not met**" in text


def _bench_without(bench: dict[str, Any], *kinds: str) -> dict[str, Any]:
    out = dict(bench)
    out["benchmarks"] = [
        b for b in bench["benchmarks"] if (b.get("extra_info") or {}).get("kind") not in kinds
    ]
    return out


@pytest.mark.parametrize(
    "kinds",
    [("transfer",), ("oracle",), ("disk",), ("disk_checksum",), ("suite",), ("sweep",), ("files",)],
)
def test_a_kind_absent_from_the_report_is_not_measured(kinds: tuple[str, ...]) -> None:
    """The report may lack any kind (a partial run, a table added later): the generator says
    "not measured" for it and still writes every other region."""
    gen = _gen()
    bench, bench_md = gen.load_bench()
    full = gen.bench_regions(bench, bench_md)
    partial = gen.bench_regions(_bench_without(bench, *kinds), bench_md)
    assert set(partial) == set(full)
    changed = [name for name in full if partial[name] != full[name]]
    assert changed, kinds
    assert all(gen.NOT_MEASURED in partial[name] for name in changed), changed


def test_packed_rows_are_read_by_kind() -> None:
    """A packed-layout row (conformance/bench/report.py `_packed`) shows up in the results
    with its target's verdict; without any, the packed line says "not measured"."""
    gen = _gen()
    bench, bench_md = gen.load_bench()
    bare = gen.bench_regions(_bench_without(bench, *gen._PACKED_KINDS), bench_md)["bench-results"]
    assert f"**Packed fs tier** vs vLLM's per-chunk tier: {gen.NOT_MEASURED}." in bare
    row = {"kind": "packed_files_written", "label": "DeepSeek-V4-Flash TP4", "workload": "chat",
           "blocks_per_chunk": 2, "ratio": 0.5, "ratio_ci": [0.5, 0.5]}
    without = _bench_without(bench, *gen._PACKED_KINDS)
    with_row = dict(without, benchmarks=[*without["benchmarks"], {"extra_info": row}])
    text = gen.bench_regions(with_row, bench_md)["bench-results"]
    assert "files written <= 1/4" in text and "**missed** (0 met, 0 inconclusive, 1 missed of 1)" in text


def test_mutation_score_sentence_says_what_the_reports_say() -> None:
    """The meta bullet's score is each release's report's "Score (caught by assertion /
    non-equivalent mutants)" line, read back here without the generator's parser."""
    gen = _gen()
    reports = gen.load_conformance_reports()
    bodies = gen.regions_in(gen.README, gen.report_regions(reports))
    assert not gen.stale(README.read_text(), bodies), _stale_message(gen, bodies)
    text = gen.read_regions(README.read_text())["meta-mutation-score"]
    for release, md in reports.items():
        line = next(x for x in md.splitlines() if x.startswith("Score (caught by assertion"))
        caught, scored = line.split(": ", 1)[1].split(" ")[0].split("/")
        assert f"{caught} of {scored}" in text, (release, line, text)
        assert f"`reports/conformance-{release}.md`" in text


def test_gpu_ci_timing_says_what_the_reports_say() -> None:
    """docs/gpu-ci.md's expected wall times are each report's timing line, read back here
    without the generator's parser: the serial wall time, the longest case, and for ``-n``
    workers at least the longest case and at most the serial wall time."""
    gen = _gen()
    reports = gen.load_conformance_reports()
    bodies = gen.regions_in(gen.GPU_CI, gen.report_regions(reports))
    doc = gen.GPU_CI.read_text()
    assert not gen.stale(doc, bodies), "\n".join(gen.stale(doc, bodies))
    text = gen.read_regions(doc)["conformance-timing"]
    for release, md in reports.items():
        line = next((x for x in md.splitlines() if x.startswith("Wall time ")), None)
        if line is None:
            assert f"vLLM {release}: not measured" in text
            continue
        wall = int(line.split(" ")[2])
        longest = float(line.split("longest case ")[1].split(" ")[0])
        row = next(x for x in text.splitlines() if x.startswith(f"* vLLM {release} "))
        assert f"{wall} s wall" in row and f"longest case {longest:.0f} s" in row, (line, row)
        with_two = int(row.split("about ")[1].split(" s with `-n 2`")[0])
        assert longest <= with_two + 1 and with_two <= wall, (line, row)


def test_the_reports_timing_line_is_what_the_generator_reads() -> None:
    """conformance/report.py writes the line scripts/gen_readme.py parses: a change to one
    that the other does not follow fails here, not as a silently "not measured" doc."""
    from conformance.report import ConformanceReport

    report = ConformanceReport()
    report.case_seconds.update({"a.py::x": 40.0, "a.py::y": 20.0, "b.py::z": 5.0})
    report.call_seconds.update({"a.py::x": 39.0, "a.py::y": 19.0, "b.py::z": 4.0})
    report.groups.update({"a.py::x": "heavy", "a.py::y": "heavy"})
    report.lock_wait_s = 12.0
    t = _gen().suite_timing(report.timings())
    assert t is not None, report.timings()
    assert (t.processes, t.summed_s, t.longest_s, t.longest_case, t.group_s, t.group,
            t.waited_s) == ("one process", 65, 39.0, "a.py::x", 60, "heavy", 12)


def test_expected_wall_time_is_the_summed_seconds_shared_out() -> None:
    gen = _gen()
    md = ("Wall time 700 s (one process); cases' seconds summed 600 s; longest case 80.0 s "
          "(`conformance/lanes/x.py::y`); largest xdist group 120 s (`heavy`, one worker runs "
          "it whole). Setups waited 50 s for another process's economics lane (`x`), left "
          "out of the cases' seconds.\n")
    t = gen.suite_timing(md)
    assert (t.wall_s, t.summed_s, t.longest_s, t.group_s, t.group, t.waited_s) == (
        700, 600, 80.0, 120, "heavy", 50)
    # 50 s of start (700 - 50 waited - 600); 600 s shared out; never below the group (120 s)
    # or the longest case
    assert t.expected_s(1) == 650 and t.expected_s(2) == 350 and t.expected_s(32) == 170


def test_mutation_score_of_a_report_without_one_is_not_measured() -> None:
    gen = _gen()
    reports = gen.load_conformance_reports()
    newest = list(reports)[-1]
    text = gen.report_regions({**reports, newest: "# no meta lane ran\n"})["meta-mutation-score"]
    assert text.startswith(gen.NOT_MEASURED) and f"vLLM {newest} has no score" in text, text


def test_mutation_scores_that_differ_are_given_per_release() -> None:
    gen = _gen()
    md = ("Score (caught by assertion / non-equivalent mutants): {}/70 (passed)\n\n"
          "Not caught by an assertion:\n\n- `a`: vLLM asserts first\n\n## Next\n\n- `b`: x\n")
    text = gen.report_regions({"0.1.0": md.format(66), "0.2.0": md.format(65)})[
        "meta-mutation-score"]
    assert text.startswith("66 of 70 on vLLM 0.1.0; 65 of 70 on vLLM 0.2.0 ("), text
    assert text.endswith("; the one survivor only makes vLLM's own code assert before any "
                         "answer differs"), text


_PERFORMANCE_FIGURE = re.compile(
    r"\d\s*(GB/s|ms/step|files of|files/s|x faster|% slower)|(?<!torch )(?<![\d.])\d\.\d\d(?![\d.])|"
    r"load average \d|"
    r"\d[\d,.]*k? (more )?recomputed|\d+ (met|missed|inconclusive)"
)


def test_performance_and_cli_figures_live_in_generated_regions() -> None:
    """Outside generated regions and the serve commands, the README's prose states no
    measured figure (a ratio, a rate, a size per file, a verdict count)."""
    gen = _gen()
    text = gen.REGION.sub("", README.read_text())
    prose = "\n".join(text.split("```")[0::2])  # outside fenced blocks (the serve commands)
    hits = [m.group(0) for m in _PERFORMANCE_FIGURE.finditer(prose)]
    assert not hits, f"figures outside generated regions: {hits}"



def _newest_release() -> str:
    from vllm_adapter.release_list import SUPPORTED_RELEASES

    return SUPPORTED_RELEASES[-1]


def test_cli_samples_are_the_clis_output() -> None:
    """The README's CLI samples and the sentences about them are what the CLI prints today on
    the stored model configs (run in-process, as `nox -s docs` runs it). They are the newest
    release's output; on an older release only the samples' vLLM line is checked."""
    gen = _gen()
    installed = gen.installed_vllm()
    have = gen.read_regions(README.read_text())
    for sample in gen.SAMPLES:
        assert f"# vLLM {_newest_release()}\n" in have[sample.name], sample.name
    if installed != _newest_release():
        pytest.skip(f"the README's CLI samples are vLLM {_newest_release()}'s output; "
                    f"installed: {installed}")
    bodies = gen.cli_regions()
    assert not gen.stale(README.read_text(), bodies), _stale_message(gen, bodies)
