"""The golden corpus: committed files are valid, canonical, cover every rule, and replay
on the reference without vLLM; a wrong answer fails naming its case and call."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conformance.corpus.codec import CorpusFormatError
from conformance.corpus.coverage import SITUATIONS, coverage_markdown, covers, section8_rules
from conformance.corpus.format import (
    DATA_DIR,
    FORMAT_VERSION,
    SCHEMA_PATH,
    CorpusCase,
    case_schema,
    data_path,
    dumps_case,
    dumps_schema,
    loads_case,
    read_corpus,
)
from conformance.corpus.run import check_case
from conformance.protocol.backends import REFERENCE, Backend
from conformance.protocol.replay import recorded_answers
from reference.jobs import StoreJob
from reference.plan import Planner
from vllm_adapter.release_list import SUPPORTED_RELEASES

ROOT = Path(__file__).resolve().parents[1]
RELEASES = SUPPORTED_RELEASES
"""Every supported release has a committed corpus (``noxfile.VLLM_VERSIONS``)."""


def _lines(release: str) -> list[str]:
    return data_path(release).read_text().splitlines()


# --- a minimal JSON Schema validator (the subset schema.json uses), for envs without jsonschema


def _errors(value: Any, schema: dict[str, Any], root: dict[str, Any], path: str = "$") -> list[str]:
    if "$ref" in schema:
        return _errors(value, root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root, path)
    errs: list[str] = []
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else types
        py = {"integer": lambda v: type(v) is int, "string": lambda v: isinstance(v, str),
              "boolean": lambda v: isinstance(v, bool), "null": lambda v: v is None,
              "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict)}
        if not any(py[n](value) for n in names):
            return [f"{path}: {value!r:.60} is not {types}"]
    if "const" in schema and value != schema["const"]:
        errs.append(f"{path}: {value!r} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errs.append(f"{path}: {value!r} not in {schema['enum']}")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        errs.append(f"{path}: {value!r:.60} does not match {schema['pattern']}")
    if "minimum" in schema and value < schema["minimum"]:
        errs.append(f"{path}: {value} < {schema['minimum']}")
    if "minLength" in schema and len(value) < schema["minLength"]:
        errs.append(f"{path}: shorter than {schema['minLength']}")
    if "anyOf" in schema and all(_errors(value, s, root, path) for s in schema["anyOf"]):
        errs.append(f"{path}: matches none of anyOf")
    if "oneOf" in schema and sum(not _errors(value, s, root, path) for s in schema["oneOf"]) != 1:
        errs.append(f"{path}: does not match exactly one of oneOf")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errs += [f"{path}: missing {k}" for k in schema.get("required", []) if k not in value]
        if len(value) < schema.get("minProperties", 0):
            errs.append(f"{path}: fewer than {schema['minProperties']} properties")
        extra = schema.get("additionalProperties", True)
        for k, v in value.items():
            if k in props:
                errs += _errors(v, props[k], root, f"{path}.{k}")
            elif extra is False:
                errs.append(f"{path}: unexpected {k}")
            elif isinstance(extra, dict):
                errs += _errors(v, extra, root, f"{path}.{k}")
    if isinstance(value, list):
        if "minItems" in schema and len(value) < schema["minItems"]:
            errs.append(f"{path}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            errs.append(f"{path}: more than {schema['maxItems']} items")
        prefix = schema.get("prefixItems", [])
        for i, v in enumerate(value):
            sub = prefix[i] if i < len(prefix) else schema.get("items")
            if sub is not None:
                errs += _errors(v, sub, root, f"{path}[{i}]")
    return errs


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
    return schema


def test_schema_file_is_generated_from_the_format() -> None:
    assert SCHEMA_PATH.read_text() == dumps_schema(case_schema(section8_rules())), (
        "schema.json is stale: python -m conformance.corpus schema"
    )


@pytest.mark.parametrize("release", RELEASES)
def test_committed_corpus_follows_the_schema(release: str) -> None:
    schema = _schema()
    lines = _lines(release)
    assert lines, f"{data_path(release)} is empty"
    try:
        import jsonschema  # type: ignore[import-untyped]
    except ImportError:
        jsonschema = None
    for number, line in enumerate(lines, 1):
        obj = json.loads(line)
        errs = _errors(obj, schema, schema)
        assert not errs, f"{data_path(release)}:{number}: {errs[:3]}"
        if jsonschema is not None:
            jsonschema.validate(obj, schema, cls=jsonschema.Draft202012Validator)


def test_the_minimal_validator_rejects_what_the_schema_forbids() -> None:
    schema = _schema()
    good = json.loads(_lines(RELEASES[-1])[0])
    assert not _errors(good, schema, schema)
    bad_float = json.loads(_lines(RELEASES[-1])[0])
    bad_float["records"][0]["step"] = 1.5
    bad_hook = json.loads(_lines(RELEASES[-1])[0])
    bad_hook["records"][0]["hook"] = "on_something_else"
    extra = {**good, "timestamp": 1}
    for bad in (bad_float, bad_hook, extra):
        assert _errors(bad, schema, schema)


@pytest.mark.parametrize("release", RELEASES)
def test_lines_are_canonical_and_name_their_release(release: str) -> None:
    """Sorted keys, no whitespace, a decode/encode round trip gives the same bytes."""
    names = []
    for line in _lines(release):
        case = loads_case(line)
        assert dumps_case(case) == line, case.name
        assert case.release == release
        assert case.trace.config.vllm_version == release
        names.append(case.name)
    assert len(names) == len(set(names)), "case names must be unique in a file"


def test_corpus_is_small() -> None:
    total = sum(p.stat().st_size for p in DATA_DIR.glob("*.jsonl"))
    assert 0 < total < 5 * 2**20, total


def test_situations_are_section8_rules() -> None:
    """One coverage predicate per rule of docs/semantics.md section 8, no more."""
    assert list(SITUATIONS) == section8_rules()


@pytest.mark.parametrize("release", RELEASES)
def test_every_section8_rule_is_covered(release: str) -> None:
    cases = read_corpus(data_path(release))
    for case in cases:
        assert case.covers == covers(case.trace), f"{case.name}: stored covers are stale"
    missing = [r for r in section8_rules() if not any(r in c.covers for c in cases)]
    assert not missing, f"vLLM {release}: no case covers {missing}"


def _class_situations(trace: Any, policy: Any) -> dict[str, bool]:
    """What each case added for a class the corpus lacked (issue #32) exists to contain."""
    from conformance.protocol import trace as T

    metas = trace.of_type(T.BuildMeta)
    offers = [o for m in metas for o in m.store_offers]
    done = [d for r in trace.of_type(T.JobsDone) for d in r.done]
    lookups = trace.of_type(T.Lookup)
    finished = trace.of_type(T.RequestFinished)
    sw = [g for g in trace.config.offloaded_groups if g.sliding_window is not None]
    stored_before = {k for m in metas for j in m.store_jobs for k in j.job.keys
                     if j.job.req_id == "a"}
    evicted = {k for o in offers if o.req_id != "a" for k in o.evicted}
    finish_step = next((r.step for r in finished if r.req_id == "a"), None)
    failed_load = next((lk.step for lk in lookups if lk.req_id == "B" and lk.hit_tokens), None)
    retried = [lk.hit_tokens for lk in lookups if lk.req_id == "B"
               and failed_load is not None and lk.step > failed_load]
    return {
        "full-tier": any(o.accepted is None for o in offers) and any(o.evicted for o in offers)
        and any(lk.hit_tokens for lk in lookups),
        "window-whole-vs-before-end": any((g.sliding_window - 1) % (
            g.tokens_per_block * trace.config.blocks_per_chunk) == 0 for g in sw),
        "window-gap": any(g.extra_retained_tokens for g in sw)
        and any(lk.req_id == "r4" and lk.hit_tokens for lk in lookups),
        "offered-before-then-evicted": bool(stored_before & evicted) and finish_step is not None
        and not any(j.job.req_id == "a" for m in metas if m.step == finish_step + 1
                    for j in m.store_jobs),
        "preempted-load-fails": any(m.preempted_req_ids for m in metas)
        and any(not d.success for d in done)
        and any(r.status == "finished_error" and r.num_computed_tokens == r.num_tokens
                for r in finished),
        "failed-load-retry": any(not d.success for d in done)
        and trace.config.kv_load_failure_policy == "recompute"
        and bool(retried) and bool(retried[0]) == policy.reload_after_failed_load,
        "skip-prefix-cache": any(lk.skip_reading_prefix_cache and lk.hit_tokens == 0
                                 for lk in lookups)
        and any(not lk.skip_reading_prefix_cache and lk.hit_tokens for lk in lookups),
    }


@pytest.mark.parametrize("release", RELEASES)
def test_each_class_case_contains_its_situation(release: str) -> None:
    """The cases added for classes the corpus lacked (a refused store, a window where the
    whole window and the tokens before the end differ, a window gap, a re-offer after an
    eviction, a preemption with a failed load, a failed load recomputed, a request that
    skips the prefix cache) still contain what they were added for after a regeneration."""
    cases = {c.name.rsplit("/", 1)[1]: c for c in read_corpus(data_path(release))}
    for name in _class_situations(next(iter(cases.values())).trace,
                                  next(iter(cases.values())).policy):
        assert name in cases, f"vLLM {release}: no case {name!r}"
        case = cases[name]
        assert _class_situations(case.trace, case.policy)[name], (
            f"vLLM {release}: {case.name} no longer contains its situation")


def test_readme_lists_the_current_coverage() -> None:
    readme = (DATA_DIR.parent / "README.md").read_text()
    assert coverage_markdown() in readme, "python -m conformance.corpus coverage, into README.md"


def test_check_names_the_first_differing_case() -> None:
    from conformance.corpus.__main__ import first_difference

    text = data_path(RELEASES[-1]).read_text()
    lines = text.splitlines()
    changed = [*lines[:2], lines[2].replace('"num_steps":', '"num_steps":1', 1), *lines[3:]]
    assert first_difference(text, text) is None
    diff = first_difference(text, "\n".join(changed) + "\n")
    assert diff is not None and "line 3" in diff and loads_case(lines[2]).name in diff, diff
    shorter = first_difference(text, "\n".join(lines[:-1]) + "\n")
    assert shorter is not None and loads_case(lines[-1]).name in shorter, shorter


def test_an_unknown_format_version_is_refused() -> None:
    obj = json.loads(_lines(RELEASES[-1])[0])
    obj["format_version"] = FORMAT_VERSION + 1
    with pytest.raises(CorpusFormatError, match="format_version"):
        loads_case(json.dumps(obj))


_BLOCK_VLLM = """
import runpy, sys
class _NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"vLLM is not installed here (blocked: {name})")
        return None
sys.meta_path.insert(0, _NoVllm())
sys.argv = ["conformance.corpus", *sys.argv[1:]]
try:
    runpy.run_module("conformance.corpus", run_name="__main__")
finally:
    assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules), "vllm imported"
"""


def test_reference_passes_every_case_without_vllm() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCK_VLLM, "replay", "--backend", "reference"],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    total = sum(len(_lines(r)) for r in RELEASES)
    assert f"reference: {total}/{total} cases passed" in proc.stdout, proc.stdout


def _corrupt_first_hit(line: str) -> tuple[str, str, str] | None:
    """The line with its first positive hit answer 16 tokens longer; (line, case, request),
    None when the case has no hit."""
    obj = json.loads(line)
    for record in obj["records"]:
        if record["hook"] == "get_num_new_matched_tokens" and record["hit_tokens"]:
            record["hit_tokens"] += 16
            return json.dumps(obj, sort_keys=True), obj["case"], record["req_id"]
    return None


def test_a_wrong_expected_answer_fails_naming_case_and_call(tmp_path: Path) -> None:
    lines = _lines(RELEASES[-1])
    index, (bad, name, req) = next(
        (i, c) for i, line in enumerate(lines) if (c := _corrupt_first_hit(line)) is not None
    )
    result = check_case(loads_case(bad), REFERENCE)
    assert result.failure is not None
    assert f"case {name!r}" in result.failure and f"lookup({req})" in result.failure, result.failure
    # Through the command line: the run fails, the other cases still pass.
    path = tmp_path / "corrupt.jsonl"
    path.write_text("\n".join([*lines[:index], bad, *lines[index + 1:]]) + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "conformance.corpus", "replay", "--backend", "reference",
         "--corpus", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 1, proc.stdout
    assert f"FAIL case {name!r}" in proc.stdout and f"lookup({req})" in proc.stdout, proc.stdout
    assert f"{len(lines) - 1}/{len(lines)} cases passed" in proc.stdout, proc.stdout


# --- the replay's reports: a deliberately wrong backend (conformance/testing/broken_planner.py)


def _newest_cases() -> list[CorpusCase]:
    return read_corpus(data_path(RELEASES[-1]))


def _case(name_part: str) -> CorpusCase:
    return next(c for c in _newest_cases() if name_part in c.name)


class _WrongIndex(Planner):
    """The reference, but the first store job holding a sliding-window block reports its
    last group's ``block_indices`` one higher (the answer only: the state stays right)."""

    wrong = False

    def step(self, *args: Any, **kwargs: Any) -> list[tuple[int, StoreJob]]:
        jobs = super().step(*args, **kwargs)
        if jobs and not self.wrong and jobs[-1][1].group_sizes[-1]:
            self.wrong = True
            job_id, job = jobs[-1]
            indices = (*job.block_indices[:-1], job.block_indices[-1] + 1)
            jobs[-1] = (job_id, replace(job, block_indices=indices))
        return jobs


def test_a_wrong_step_answer_prints_the_steps_tables_and_boundaries() -> None:
    case = _case("fa64+sw128@16/blocks_per_chunk=2/retention=0/repeat-256-budget64")
    result = check_case(case, Backend("wrong-index", _WrongIndex))
    assert result.failure is not None and not result.raised
    text = result.failure
    assert text.startswith(f"case {case.name!r} (vLLM {case.release}): answer #"), text
    assert "step(*) at step " in text and "expected (vLLM): " in text and "backend: " in text, text
    for shown in ("the call's inputs:", "config: ", "policy: retention_interval=0 ",
                  "null_blocks_in_store=placeholder", "scheduled a: status=running",
                  "shared_prefix_boundary=0", "num_computed_tokens=", "new_block_ids: g0[",
                  "block table with this step's new_block_ids", "    g1 [",
                  "block_copy_dst_ids: []", "boundary_handoffs: none", "vLLM offered a: "):
        assert shown in text, f"{shown!r} missing from:\n{text}"
    assert 0 < result.matched < result.answers
    assert f"answer #{result.matched}," in text


def test_a_window_block_allocated_again_is_marked_in_the_table() -> None:
    """A step's inputs mark with ``*`` the earlier table entries whose block id the step
    allocated again: window blocks vLLM freed (null for storing, docs/semantics.md §11)."""
    from conformance.corpus.run import call_inputs
    from conformance.protocol import trace as T

    case = _case("fa64+sw128@16/blocks_per_chunk=2/retention=0/repeat-256-budget64")
    marked, allocated = 0, set()
    for record in case.trace.records:
        if isinstance(record, T.Alloc):
            allocated |= {b.block_id for g in record.blocks for b in g if not b.is_null}
        if not isinstance(record, T.BuildMeta):
            continue
        new = allocated | {b for s in record.scheduled for g in s.new_block_ids or () for b in g}
        allocated = set()
        for line in call_inputs(case, record):
            if re.match(r"^    g\d+ \[", line):
                starred = {int(x[:-1]) for x in line.split("[", 1)[1].rstrip("]").split()
                           if x.endswith("*")}
                assert starred <= new | set(record.block_copy_dst_ids), line
                marked += len(starred)
    assert marked, "no step of the case reallocates a window block"


def _resolve_broken(name: str) -> Any:
    from conformance.testing import broken_planner

    return getattr(broken_planner, name)


def test_the_trace_is_cut_with_a_marker() -> None:
    case = _case("fa64+sw128@16/blocks_per_chunk=2/retention=0/repeat-256-budget64")
    full = check_case(case, Backend("long-hit", _resolve_broken("long_hit")), trace_lines=0)
    cut = check_case(case, Backend("long-hit", _resolve_broken("long_hit")), trace_lines=5)
    assert full.failure is not None and cut.failure is not None
    shown = full.failure.split("trace up to step", 1)[1].splitlines()[1:]
    assert len(shown) > 5 and "more lines" not in full.failure
    marker = f"  ... {len(shown) - 5} more lines (earlier records; --trace-lines 0 prints them all)"
    lines = cut.failure.splitlines()
    assert marker in lines, cut.failure
    assert lines[lines.index(marker) + 1:] == shown[-5:]


def test_a_wrong_hit_prints_the_lookups_inputs() -> None:
    case = _case("full@16/blocks_per_chunk=4/retention=0/repeat-256-budget64")
    result = check_case(case, Backend("long-hit", _resolve_broken("long_hit")))
    assert result.failure is not None
    assert re.search(r"answer #\d+, lookup\(\w+\) at step \d+ differs", result.failure), result.failure
    assert re.search(r"lookup \w+: num_tokens=\d+ num_prompt_tokens=\d+ block_hashes=\d+ "
                     r"computed_tokens=\d+", result.failure), result.failure
    assert "vLLM's manager answered (informative): " in result.failure


def test_an_exception_is_reported_at_its_call_with_the_divergence_before_it() -> None:
    """``dropped_store`` misses a store job; a later ``job_done`` of a job it does not hold
    raises KeyError.  The report names the exception at its call, then the missed job."""
    case = _case("fa64+sw128@16/blocks_per_chunk=2/retention=0/repeat-256-budget64")
    result = check_case(case, Backend("dropped", _resolve_broken("dropped_store")))
    assert result.raised and result.failure is not None
    first = result.failure.splitlines()[0]
    assert re.fullmatch(
        rf"case {re.escape(repr(case.name))} \(vLLM {case.release}\): the backend raised "
        r"KeyError: \d+ at step \d+, in job_done\(\d+, success=True\) "
        r"\(record #\d+, update_connector_output\)", first), first
    assert "  raised at " in result.failure and "reference/plan.py" in result.failure
    assert re.search(r"before it, answer #\d+, step\(\*\) at step \d+ already differed",
                     result.failure), result.failure
    assert "expected (vLLM): " in result.failure and "backend:         [step" in result.failure
    assert "block table with this step's new_block_ids" in result.failure
    assert "trace up to the call that raised" in result.failure
    assert sum(line.startswith("  >> ") for line in result.failure.splitlines()) == 1
    assert result.matched == int(re.search(r"answer #(\d+)", result.failure).group(1))  # type: ignore[union-attr]


def test_an_exception_with_no_wrong_answer_before_it() -> None:
    case = _case("full@16/blocks_per_chunk=4/retention=0/repeat-256-budget64")
    result = check_case(case, Backend("raising", _resolve_broken("raising")))
    assert result.raised and result.failure is not None
    assert re.search(r"the backend raised RuntimeError: deliberate failure at job_done\(\d+\) "
                     r"at step \d+, in job_done\(\d+, success=True\)", result.failure), result.failure
    assert f"the {result.matched} answers before it equal vLLM's" in result.failure
    assert "already differed" not in result.failure


def test_the_summary_counts_matched_answers_and_failed_cases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from conformance.corpus.__main__ import main

    path = data_path(RELEASES[-1])
    cases = read_corpus(path)
    total = len(cases)
    answers = sum(len(recorded_answers(c.trace)) for c in cases)
    assert main(["replay", "--backend", "reference", "--corpus", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"reference: {total}/{total} cases passed, 0 failed; {answers}/{answers} answers " \
           "matched" in out, out
    backend = "conformance.testing.broken_planner:raising"
    assert main(["replay", "--backend", backend, "--corpus", str(path)]) == 1
    out = capsys.readouterr().out
    failed = out.count("FAIL case ")
    raised = out.count(": the backend raised RuntimeError")
    assert failed and raised == failed, out
    summary = out.strip().splitlines()[-1]
    m = re.fullmatch(rf"{backend}: (\d+)/{total} cases passed, {failed} failed \({raised} of "
                     rf"them raised\); (\d+)/{answers} answers matched vLLM's .*", summary)
    assert m and int(m.group(1)) == total - failed and int(m.group(2)) < answers, summary
    # a backend that fails every case matches few answers, and says so
    assert main(["replay", "--backend", "conformance.testing.broken_planner:long_hit",
                 "--corpus", str(path), "--trace-lines", "3"]) == 1
    out = capsys.readouterr().out
    assert "... " in out and " more lines (earlier records" in out
