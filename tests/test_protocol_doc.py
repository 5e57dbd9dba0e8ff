"""conformance/PROTOCOL.md states the planner interface exactly, and docs/semantics.md §11
names real functions: a backend team adopts the corpus from the documents alone.

* Every ``#### `dotted.Name` `` heading of PROTOCOL.md followed by a table documents that
  dataclass (rows = its fields, in order, with their annotations) or enum (rows = its
  members and values).
* Every type a backend receives or returns -- reachable from the factory's arguments, the
  planner protocol's signatures and the store's methods -- has such a table.
* Every fenced Python block announced by ``<!-- checked: dotted.Name -->`` equals that
  class's declarations in the source (attributes, method names, parameters, defaults,
  annotations).
* The skeleton backend (``<!-- checked: skeleton -->``) runs: it replays every corpus case
  without raising and has the protocol's signatures.
* docs/semantics.md §11 has a row for every ``Policy`` switch, and every ``reference.``
  name it cites exists.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any

import pytest

from conformance.corpus.format import DATA_DIR, read_corpus
from conformance.corpus.run import check_case
from conformance.protocol.backends import Backend
from conformance.protocol.replay import PlannerLike
from reference.knobs import Chunking
from reference.plan import Policy
from reference.plan_inputs import ChunkIndex
from reference.store import ChunkStore

ROOT = Path(__file__).resolve().parents[1]
PROTOCOL = ROOT / "conformance" / "PROTOCOL.md"
SEMANTICS = ROOT / "docs" / "semantics.md"


def _resolve(dotted: str) -> Any:
    """``a.b.C.d`` -> the object, importing the longest module prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _cells(line: str) -> list[str]:
    cells = re.split(r"(?<!\\)\|", line.strip().strip("|"))
    return [c.strip().replace("\\|", "|").strip("`") for c in cells]


def documented_tables(text: str) -> dict[str, list[list[str]]]:
    """``#### `name` `` heading -> the rows of the first table under it (header dropped)."""
    out: dict[str, list[list[str]]] = {}
    for m in re.finditer(r"^#### `([\w.]+)`\n(.*?)(?=^#{2,4} |\Z)", text, re.MULTILINE | re.DOTALL):
        rows = [_cells(line) for line in m.group(2).splitlines() if line.startswith("|")]
        out[m.group(1)] = rows[2:]  # header and rule
    return out


def checked_blocks(text: str) -> dict[str, str]:
    """``<!-- checked: name -->`` -> the fenced block right after it."""
    return dict(re.findall(r"<!-- checked: ([\w.]+) -->\n```python\n(.*?)```", text, re.DOTALL))


def _protocol() -> str:
    return PROTOCOL.read_text()


# --------------------------------------------------------------------------- tables


def test_every_table_matches_its_type() -> None:
    tables = documented_tables(_protocol())
    assert len(tables) >= 15, sorted(tables)
    for name, rows in tables.items():
        obj = _resolve(name)
        if dataclasses.is_dataclass(obj):
            want = [[f.name, str(f.type)] for f in dataclasses.fields(obj)]
            got = [row[:2] for row in rows]
            assert got == want, f"PROTOCOL.md's table of {name} is not its fields:\n{got}\n{want}"
        elif isinstance(obj, type) and issubclass(obj, Enum):
            want = [[m.name, str(m.value)] for m in obj]
            got = [row[:2] for row in rows]
            assert got == want, f"PROTOCOL.md's table of {name} is not its members:\n{got}\n{want}"
        else:
            assert not rows, f"{name} is neither a dataclass nor an enum, yet has a table"
        assert all(len(row) >= 3 and row[2] for row in rows), f"{name}: a row without a meaning"


def _reachable(tp: Any, seen: set[type]) -> None:
    """Every dataclass and enum of ``reference`` that ``tp`` mentions, recursively."""
    for arg in typing.get_args(tp):
        _reachable(arg, seen)
    origin = typing.get_origin(tp)
    if origin is not None and origin not in (typing.Union, types.UnionType):
        _reachable(origin, seen)
    if not isinstance(tp, type) or tp in seen or not tp.__module__.startswith("reference"):
        return
    if dataclasses.is_dataclass(tp):
        seen.add(tp)
        for hint in typing.get_type_hints(tp).values():
            _reachable(hint, seen)
    elif issubclass(tp, Enum):
        seen.add(tp)


def _method_hints(cls: type) -> list[Any]:
    out: list[Any] = []
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_"):
            out += typing.get_type_hints(fn).values()
    return out


def test_every_type_a_backend_receives_or_returns_is_tabled() -> None:
    seen: set[type] = set()
    for tp in (Chunking, Policy, *_method_hints(PlannerLike), *_method_hints(ChunkIndex)):
        _reachable(tp, seen)
    documented = {_resolve(name) for name in documented_tables(_protocol())}
    missing = sorted(t.__qualname__ for t in seen - documented)
    assert not missing, f"PROTOCOL.md has no table for {missing}"
    assert ChunkStore in documented, "PROTOCOL.md has no section for the store"


# --------------------------------------------------------------------------- signatures


def _declarations(cls_node: ast.ClassDef) -> dict[str, str]:
    """Attribute and method declarations of a class, as comparable strings."""
    out: dict[str, str] = {}
    for node in cls_node.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = ast.unparse(node.annotation)
        elif isinstance(node, ast.FunctionDef):
            args = node.args
            params = [*args.posonlyargs, *args.args]
            defaults = [None] * (len(params) - len(args.defaults)) + list(args.defaults)
            shown = [
                a.arg + (f": {ast.unparse(a.annotation)}" if a.annotation else "")
                + (f" = {ast.unparse(d)}" if d is not None else "")
                for a, d in zip(params, defaults, strict=True)
            ]
            returns = ast.unparse(node.returns) if node.returns else ""
            out[node.name] = f"({', '.join(shown)}) -> {returns}"
    return out


def _class_node(source: str, name: str) -> ast.ClassDef:
    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"no class {name}")


@pytest.mark.parametrize("name", ["conformance.protocol.replay.PlannerLike",
                                  "reference.plan_inputs.ChunkIndex"])
def test_protocol_blocks_equal_the_source(name: str) -> None:
    blocks = checked_blocks(_protocol())
    assert name in blocks, f"PROTOCOL.md has no checked block of {name}"
    cls = _resolve(name)
    doc = _declarations(_class_node(blocks[name], cls.__name__))
    code = _declarations(_class_node(inspect.getsource(cls), cls.__name__))
    assert doc == code, f"PROTOCOL.md's {name} differs from the source:\n{doc}\n{code}"


def test_the_factory_is_as_documented() -> None:
    from conformance.protocol.replay import PlannerFactory

    args, returns = typing.get_args(PlannerFactory)
    assert (args, returns) == ([Chunking, ChunkStore, Policy], PlannerLike)
    assert ("def backend(chunking: Chunking, store: ChunkStore, policy: Policy) -> PlannerLike"
            in _protocol())


def test_every_checked_block_is_tested() -> None:
    assert set(checked_blocks(_protocol())) == {
        "conformance.protocol.replay.PlannerLike", "reference.plan_inputs.ChunkIndex", "skeleton"}


# --------------------------------------------------------------------------- the skeleton


def _skeleton() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "skeleton_backend"}
    exec(compile(checked_blocks(_protocol())["skeleton"], "PROTOCOL.md skeleton", "exec"), namespace)
    return namespace


def _params(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_skeleton_has_the_protocols_signatures() -> None:
    planner = _skeleton()["SkeletonPlanner"]
    for name, fn in inspect.getmembers(PlannerLike, inspect.isfunction):
        if not name.startswith("_"):
            assert _params(getattr(planner, name)) == _params(fn), name


def test_the_skeletons_key_is_the_reference_key() -> None:
    from reference.geometry import Geometry, GroupKind, KVGroup
    from reference.keys import chunk_key
    from reference.knobs import resolve_extra_config

    geometry = Geometry((KVGroup(0, GroupKind.FULL, 64),
                         KVGroup(1, GroupKind.SLIDING_WINDOW, 16, sliding_window=128)), 16)
    chunking = resolve_extra_config(geometry, {"blocks_per_chunk": 2}, 0)
    hashes = [bytes([i]) * 8 for i in range(20)]
    key = _skeleton()["chunk_key"]
    for gc in chunking.groups:
        for k in range(len(hashes) // gc.hashes_per_chunk):
            assert key(hashes, gc, k) == chunk_key(hashes, gc, k)


def test_the_skeleton_replays_every_case_without_raising() -> None:
    backend = Backend("skeleton", _skeleton()["backend"])
    for path in sorted(DATA_DIR.glob("vllm-*.jsonl")):
        for case in read_corpus(path):
            result = check_case(case, backend)
            assert not result.raised, result.failure
            assert result.failure is not None and result.matched >= 1, (case.name, result)


# --------------------------------------------------------------------------- semantics §11


def _section_11() -> str:
    return SEMANTICS.read_text().split("\n## 11. ", 1)[1].split("\n## ", 1)[0]


def test_section_11_has_a_row_per_policy_switch() -> None:
    rows = [_cells(line) for line in _section_11().splitlines() if line.startswith("| `")]
    switches = [row[0] for row in rows]
    assert switches == [f.name for f in dataclasses.fields(Policy)], switches
    for row in rows:
        assert re.search(r"reference\.\w", row[-1]), f"§11: {row[0]} names no function"


def test_section_11_names_real_functions() -> None:
    names = set(re.findall(r"`(reference\.[\w.]+)`", _section_11()))
    assert len(names) >= 15, names
    for name in sorted(names):
        assert callable(_resolve(name)), name
    bullets = re.findall(r"^\* \*\*(.+?)\*\* \(", _section_11(), re.MULTILINE)
    for rule in ("Freed window blocks are null", "Null blocks in a store job",
                 "Store-mask boundaries and `shared_prefix_boundary`",
                 "The final segment's tail", "EAGLE's +1", "A failed load"):
        assert rule in bullets, f"§11 lost its rule {rule!r}: {bullets}"
