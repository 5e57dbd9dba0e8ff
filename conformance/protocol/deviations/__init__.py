"""Per-backend deviation files: ``<backend>-<version>.toml``, else ``<backend>.toml``.

The ``vllm`` backend's deviations depend on the installed release (a bug fixed in
0.34.0 is a deviation of 0.33.0 only), so its files are per version:
``vllm-0.33.0.toml``, ``vllm-0.34.0.toml``; a vLLM that is not a known release
uses the file of the release whose rules it runs (``conformance.protocol.versions.rules_for``).
A release with no file has no known deviations: every disagreement is reported as a finding.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import tomllib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent


def backend_version(backend: str) -> str | None:
    """The installed distribution's version for a backend named after one (``vllm``)."""
    try:
        return importlib.metadata.version(backend)
    except importlib.metadata.PackageNotFoundError:
        return None


def path_for(backend: str) -> Path:
    """The deviations file that applies to ``backend`` as installed."""
    version = backend_version(backend)
    if version is not None and backend == "vllm":
        # A dev/rc/post or newer build runs a known release's deviations (--vllm-rules).
        from vllm_adapter.releases import rules_for

        version = rules_for(version).release
    if version is not None:
        versioned = HERE / f"{backend}-{version}.toml"
        if versioned.exists():
            return versioned
    return HERE / f"{backend}.toml"


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
    path = path_for(backend)
    if not path.exists():
        return []
    data = tomllib.loads(path.read_text())
    out = []
    for d in data.get("deviation", []):
        if d["kind"] not in ("intended", "suspected-bug"):
            raise ValueError(f"{path}: deviation {d['id']} has kind {d['kind']!r}")
        out.append(Deviation(d["id"], d["lane"], tuple(d.get("cases", ())), d["kind"],
                             d["reason"], d["reproduction"]))
    return out


def find(backend: str, lane: str, case: str) -> Deviation | None:
    for d in load(backend):
        if d.lane == lane and any(fnmatch.fnmatchcase(case, c) for c in d.cases):
            return d
    return None
