"""The golden corpus: committed files are valid, canonical, cover every rule, and replay
on the reference without vLLM; a wrong answer fails naming its case and call."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conformance.corpus.codec import CorpusFormatError
from conformance.corpus.coverage import SITUATIONS, coverage_markdown, covers, section8_rules
from conformance.corpus.format import (
    DATA_DIR,
    FORMAT_VERSION,
    SCHEMA_PATH,
    case_schema,
    data_path,
    dumps_case,
    dumps_schema,
    loads_case,
    read_corpus,
)
from conformance.corpus.run import check_case
from conformance.protocol.backends import REFERENCE
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
