"""``vllm_adapter.disk`` is the disk tier: one package, its old path a warning re-export,
no private name of ``reference/`` crossing into it (issue #29 item 1)."""

from __future__ import annotations

import ast
import importlib
import sys
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_adapter" / "disk"


def _imported_names(path: Path) -> list[tuple[str, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.module, a.name) for a in node.names]
    return out


def test_no_module_of_the_disk_package_imports_a_private_name_of_another_module() -> None:
    offenders = [
        f"{p.name}: from {mod} import {name}"
        for p in sorted(PACKAGE.glob("*.py"))
        for mod, name in _imported_names(p)
        if name.startswith("_") and not name.startswith("__")
        and (mod.startswith("reference") or mod.startswith("vllm_adapter"))
    ]
    assert offenders == []


def test_no_module_reaches_a_private_attribute_of_the_reference_disk() -> None:
    private = {"_next_unit", "_lru_file", "_restore", "_push_if_leaf", "_File", "_completable",
               "_whole_without", "_dependents", "_leaves", "_recency"}
    offenders = []
    for p in sorted(PACKAGE.glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in private:
                offenders.append(f"{p.name}:{node.lineno} .{node.attr}")
    assert offenders == []


@pytest.mark.vllm
def test_the_old_spec_module_path_still_serves_and_warns() -> None:
    pytest.importorskip("vllm")
    sys.modules.pop("vllm_adapter.safe_fs", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("vllm_adapter.safe_fs")
    new = importlib.import_module("vllm_adapter.disk")
    assert old.KvchunkTieringOffloadingSpec is new.KvchunkTieringOffloadingSpec
    assert any(issubclass(w.category, DeprecationWarning) and "vllm_adapter.disk" in str(w.message)
               for w in caught)


def test_the_package_s_table_names_each_of_its_modules_once() -> None:
    """The cut in ``vllm_adapter/disk/__init__.py``'s docstring is the package's map: a
    module added or removed changes the table too."""
    import re

    import vllm_adapter.disk as D

    doc = D.__doc__ or ""
    named = re.findall(r"^``(\w+)``  ", doc, flags=re.MULTILINE)
    on_disk = sorted(p.stem for p in Path(D.__file__).parent.glob("*.py") if p.stem != "__init__")
    assert sorted(named) == on_disk
