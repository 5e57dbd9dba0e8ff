"""Per-backend deviation files: ``<backend>.toml``."""

from __future__ import annotations

import fnmatch
import tomllib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent


@dataclass(frozen=True)
class Deviation:
    id: str
    lane: str
    cases: tuple[str, ...]
    kind: str
    reason: str
    reproduction: str

    def xfail_reason(self) -> str:
        return f"{self.kind} deviation '{self.id}': {' '.join(self.reason.split())[:160]}"


def load(backend: str) -> list[Deviation]:
    path = HERE / f"{backend}.toml"
    if not path.exists():
        return []
    data = tomllib.loads(path.read_text())
    out = []
    for d in data.get("deviation", []):
        if d["kind"] not in ("intended", "suspected-bug"):
            raise ValueError(f"{path}: deviation {d['id']} has kind {d['kind']!r}")
        out.append(Deviation(d["id"], d["lane"], tuple(d["cases"]), d["kind"], d["reason"],
                             d["reproduction"]))
    return out


def find(backend: str, lane: str, case: str) -> Deviation | None:
    for d in load(backend):
        if d.lane == lane and any(fnmatch.fnmatchcase(case, c) for c in d.cases):
            return d
    return None
