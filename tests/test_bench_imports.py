"""The benchmarks reach the CLI's computations through :mod:`vllm_adapter.planning`, never
through ``vllm_adapter.cli`` (issue #26: the bench imports no CLI internals)."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "conformance" / "bench"


def cli_imports(source: str) -> list[str]:
    """Every ``vllm_adapter.cli`` module a source file imports (at any depth)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
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


def test_no_bench_module_imports_the_cli() -> None:
    modules = sorted(BENCH.glob("*.py"))
    assert len(modules) > 5
    offenders = {p.name: cli_imports(p.read_text(encoding="utf-8")) for p in modules}
    assert {k: v for k, v in offenders.items() if v} == {}
