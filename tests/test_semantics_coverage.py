"""``docs/semantics.md`` §8 is true: every rule it lists is executed, tested and mutated.

For each function the §8 table names, (a) the reference executes it: it is called,
directly or through other rules of ``reference/rules.py``, by the Planner
(``reference/plan.py``, ``reference/plan_state.py``), the transfer spec
(``reference/transfer.py``) or the economics engine (``reference/economics.py``);
(b) a test of ``tests/test_rules.py`` calls it by name; (c) the meta lane has a
mutant of it (``conformance/meta/mutants/rules.py``).  Sources are read with :mod:`ast`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from conformance.meta.mutants import rules as rule_mutants

ROOT = Path(__file__).resolve().parents[1]
RULES_MODULE = "reference.rules"
EXECUTORS = (
    "reference/plan.py", "reference/plan_state.py", "reference/transfer.py",
    "reference/economics.py",
)

def _section_8_rules() -> list[str]:
    text = (ROOT / "docs" / "semantics.md").read_text()
    section = text.split("\n## 8. ", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| [^|]+ \| `(\w+)` \|", section, re.MULTILINE)
    assert len(names) >= 20, f"§8's rule table not found or cut short: {names}"
    return names


def _tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text(), filename=path)


def _called(node: ast.AST) -> set[str]:
    """Names called in ``node``: ``f(...)`` and ``x.f(...)`` give ``f``."""
    names: set[str] = set()
    for call in ast.walk(node):
        if isinstance(call, ast.Call):
            if isinstance(call.func, ast.Name):
                names.add(call.func.id)
            elif isinstance(call.func, ast.Attribute):
                names.add(call.func.attr)
    return names


def _rules_called_by(path: str) -> set[str]:
    """Rules ``path`` calls: names it imports from ``reference.rules`` (or calls as
    ``rules.name`` after ``from reference import rules``) that it calls."""
    tree = _tree(path)
    imported: set[str] = set()
    attribute_calls: set[str] = set()
    module_aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == RULES_MODULE:
            imported.update(alias.asname or alias.name for alias in node.names)
        if isinstance(node, ast.ImportFrom) and node.module == "reference":
            module_aliases.update(a.asname or a.name for a in node.names if a.name == "rules")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id in module_aliases):
            attribute_calls.add(node.func.attr)
    return (_called(tree) & imported) | attribute_calls


def _executed_rules() -> set[str]:
    """Every function of ``reference/rules.py`` the executors reach, rule calling rule."""
    functions = {
        node.name: node for node in _tree("reference/rules.py").body
        if isinstance(node, ast.FunctionDef)
    }
    todo = set().union(*(_rules_called_by(path) for path in EXECUTORS)) & set(functions)
    reached: set[str] = set()
    while todo:
        name = todo.pop()
        reached.add(name)
        todo |= (_called(functions[name]) & set(functions)) - reached
    return reached


def _directly_tested() -> set[str]:
    """Rules a ``test_*`` function of ``tests/test_rules.py`` calls as ``rules.name``."""
    names: set[str] = set()
    for node in _tree("tests/test_rules.py").body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            for call in ast.walk(node):
                if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                        and isinstance(call.func.value, ast.Name) and call.func.value.id == "rules"):
                    names.add(call.func.attr)
    return names


def _mutated() -> set[str]:
    return {
        m.edit.target for m in rule_mutants.MUTANTS
        if m.edit.module().__name__ == RULES_MODULE
    }


def test_section_8_names_functions_of_rules_py() -> None:
    functions = {n.name for n in _tree("reference/rules.py").body if isinstance(n, ast.FunctionDef)}
    missing = [name for name in _section_8_rules() if name not in functions]
    assert not missing, f"§8 names functions reference/rules.py lacks: {missing}"


def test_every_rule_is_executed_by_the_reference() -> None:
    executed = _executed_rules()
    missing = [name for name in _section_8_rules() if name not in executed]
    assert not missing, f"§8 rules no Planner/transfer/economics call reaches: {missing}"


def test_every_rule_has_a_direct_test() -> None:
    tested = _directly_tested()
    missing = [name for name in _section_8_rules() if name not in tested]
    assert not missing, f"§8 rules no tests/test_rules.py test calls: {missing}"


def test_every_rule_has_a_mutant() -> None:
    mutated = _mutated()
    rules = _section_8_rules()
    missing = [name for name in rules if name not in mutated]
    assert not missing, f"§8 rules without a mutant in conformance/meta/mutants/rules.py: {missing}"


def test_the_walk_sees_calls_and_only_calls() -> None:
    """The AST walk itself: a called import is reached, an imported name never called is not."""
    tree = ast.parse("from reference.rules import a, b\nx = b\na(1)\n")
    assert _called(tree) == {"a"}
