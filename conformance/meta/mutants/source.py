"""One-line source mutants: a function or method replaced, in process, by a copy with one edit.

A :class:`LineEdit` names a target (a module, and a function or ``Class.method``
in it) and the text to replace.  :meth:`LineEdit.install` reads the target's
source, makes the edit (the old text must occur exactly once; ``alternatives``
cover releases whose line differs), compiles the copy in the target module's
globals and monkeypatches it in: on the class for a method, and for a module
function on every module that bound the same object (``from m import f``
copies).  Nothing on disk changes.  Feature detection, not version checks:
an edit whose text occurs in no alternative raises :class:`NotApplicable`.
"""

from __future__ import annotations

import inspect
import sys
import textwrap
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

_BOUND_IN = ("vllm", "vllm_adapter", "conformance", "reference")
"""Module name prefixes searched for other bindings of a patched module function."""


class NotApplicable(LookupError):
    """The target's source has none of the edit's old texts (the target moved or changed)."""


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` (exactly one occurrence in the target's source) by ``new``."""

    old: str
    new: str


@dataclass(frozen=True)
class LineEdit:
    """``target`` = ``Class.method`` or ``function`` in the module ``module()`` returns."""

    module: Callable[[], types.ModuleType]
    target: str
    edits: tuple[Edit, ...]
    """Alternatives, first that applies wins (e.g. one per vLLM release)."""

    def resolve(self) -> tuple[Any, str, Any]:
        """``(owner, attribute, original)``: where the target lives and what it is now."""
        owner: Any = self.module()
        *path, name = self.target.split(".")
        for part in path:
            owner = getattr(owner, part)
        if isinstance(owner, type):
            return owner, name, owner.__dict__[name]
        return owner, name, getattr(owner, name)

    def faulty_copy(self) -> Any:
        owner, name, original = self.resolve()
        func = original.__func__ if isinstance(original, (classmethod, staticmethod)) else original
        func = inspect.unwrap(func)
        source = inspect.getsource(func)  # edits are written as indented in the file
        chosen = next((e for e in self.edits if source.count(e.old) == 1), None)
        if chosen is None:
            raise NotApplicable(
                f"{self.module().__name__}.{self.target}: none of the edits' old text occurs "
                f"exactly once: {[e.old for e in self.edits]}"
            )
        edited = textwrap.dedent(source.replace(chosen.old, chosen.new))
        # Wrapped in a factory with a ``__class__`` local so zero-argument super() works.
        body = textwrap.indent(edited, "    ")
        factory_src = f"def __mutant_factory__(__class__):\n{body}\n    return {func.__name__}\n"
        namespace: dict[str, Any] = {}
        module = sys.modules[func.__module__]
        exec(compile(factory_src, f"<mutant of {func.__qualname__}>", "exec"),  # noqa: S102
             module.__dict__, namespace)
        # The copy keeps the source's decorators (e.g. @classmethod).
        return namespace["__mutant_factory__"](owner if isinstance(owner, type) else None)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        owner, name, original = self.resolve()
        copy = self.faulty_copy()
        if isinstance(owner, type):
            monkeypatch.setattr(owner, name, copy)
            return
        for mod_name, mod in list(sys.modules.items()):
            if mod is None or not mod_name.startswith(_BOUND_IN):
                continue
            for attr, value in list(vars(mod).items()):
                if value is original:
                    monkeypatch.setattr(mod, attr, copy)


# Bug classes: anchors.md section 3.2 (numbered there), plus the rules the brief names.
BLOCK_HASH = "1 block-size/hash asserts"
EAGLE = "2 EAGLE/MTP groups"
ORDER_KEYS = "3 group order/key granularity"
SWA_EDGE = "4 partial chunks at the SWA edge"
CAPACITY = "5 capacity accounting"
STRIDE = "6 stride/layout"
LAST_TOKEN = "last-token rule"
PADDING = "padding"


@dataclass(frozen=True)
class Mutant:
    """One realistic single-line fault and how to install it."""

    name: str
    bug_class: str
    fault: str
    """The fault, in one line."""
    edit: LineEdit
    side: str
    """``vllm`` (vLLM's own code: traces are recorded with it applied) or ``reference``."""
    equivalent: str | None = None
    """Why no check can catch it (the argument), for a proven-equivalent mutant."""
    releases: str = ""
    """Where the target differs by release (the edit has one alternative per release)."""

    @property
    def target(self) -> str:
        return f"{self.edit.module().__name__}.{self.edit.target}"

    def apply(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.edit.install(monkeypatch)


def one(old: str, new: str) -> tuple[Edit, ...]:
    return (Edit(old, new),)
