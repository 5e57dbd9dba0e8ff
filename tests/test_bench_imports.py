"""The benchmarks reach the CLI's computations through :mod:`vllm_adapter.planning`, never
through ``vllm_adapter.cli`` (issue #26: the bench imports no CLI internals); and below the
CLI the imports run one way: no module of ``vllm_adapter`` outside ``cli/`` imports it
(``vllm_adapter/__main__.py``, the CLI's entry point, aside)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "conformance" / "bench"
PACKAGE = REPO / "vllm_adapter"


def cli_imports(source: str, package: str | None = None) -> list[str]:
    """Every ``vllm_adapter.cli`` module a source file imports (at any depth: module level
    or inside a function); ``package``: the file's package, to resolve relative imports."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.level == 0 or package is not None):
            if node.level == 0:
                module = node.module or ""
            else:
                assert package is not None
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module}" if node.module else base
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        found += [n for n in names if n == "vllm_adapter.cli" or n.startswith("vllm_adapter.cli.")]
    return found


def test_the_check_sees_each_spelling_of_a_cli_import() -> None:
    assert cli_imports("import vllm_adapter.cli.sizing")
    assert cli_imports("def f():\n    from vllm_adapter.cli.economics import serve")
    assert cli_imports("from vllm_adapter import cli")
    assert not cli_imports("from vllm_adapter.planning import run_sweep")
    assert not cli_imports("from vllm_adapter.client import x")
    assert cli_imports("from . import cli", package="vllm_adapter")
    assert cli_imports("from ..cli.args import parse_bytes", package="vllm_adapter.disk")
    assert not cli_imports("from .client import x", package="vllm_adapter")


def test_no_bench_module_imports_the_cli() -> None:
    modules = sorted(BENCH.glob("*.py"))
    assert len(modules) > 5
    offenders = {p.name: cli_imports(p.read_text(encoding="utf-8")) for p in modules}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_module_below_the_cli_imports_it() -> None:
    """``vllm_adapter.planning`` once imported ``vllm_adapter.cli.economics`` lazily (and the
    CLI imports planning): a cycle.  Every module outside ``vllm_adapter/cli/`` -- the
    planning, economics, results, units, the disk tier -- stands below the CLI."""
    modules = [
        p for p in sorted(PACKAGE.rglob("*.py"))
        if "cli" not in p.relative_to(PACKAGE).parts[:-1] and p != PACKAGE / "__main__.py"
    ]
    assert PACKAGE / "planning.py" in modules and PACKAGE / "disk" / "budget.py" in modules
    offenders = {}
    for p in modules:
        package = ".".join(p.relative_to(REPO).parts[:-1])  # an __init__.py's too
        found = cli_imports(p.read_text(encoding="utf-8"), package=package)
        if found:
            offenders[str(p.relative_to(REPO))] = found
    assert offenders == {}
