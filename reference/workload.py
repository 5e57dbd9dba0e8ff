"""Workloads for the economics engine: data, not code.

A :class:`Workload` is a small description an operator can read and write (a
TOML file, or one of the presets in ``reference/workloads/``): how many
conversations (sessions), how many turns each, the shared prefixes every
request starts with, and the lengths of user turns and model outputs.
:func:`requests` expands it, deterministically from its ``seed``, into the
requests an engine serves, in arrival order.

Token ids are drawn at random from a large range, so distinct segments never
share a prefix by accident; equal segments (the system prompt, a shared
document) are the same tokens wherever they appear.  A session's turn ``t``
prompt is its whole history: the shared prefix, then every earlier user turn and
output, then turn ``t``'s user tokens.
"""

from __future__ import annotations

import random
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "PRESETS",
    "GpuCache",
    "Span",
    "Workload",
    "WorkloadRequest",
    "load_workload",
    "preset",
    "requests",
]

TOKEN_RANGE = 100_000
"""Token ids are drawn from ``[1, TOKEN_RANGE)``: inside every real vocabulary (and vLLM's
int32 token buffers); two segments share a first hash unit with odds of 1e-20 per pair
at 4 tokens per hash unit."""


class GpuCache(Enum):
    """What the GPU prefix cache still holds when a request arrives."""

    COLD = "cold"
    """Nothing: every reused token must come from offload (the disk tier's worst case,
    and what a busy server sees once other conversations have pushed a session out)."""
    HOT_SHARED_PREFIX = "hot_shared_prefix"
    """The system prompt (used by every request) stays on the GPU; everything else
    comes from offload.  The GPU hit is the system prompt rounded down to the GPU's
    hit granularity (the least common multiple of the groups' tokens per block)."""


@dataclass(frozen=True)
class Span:
    """An inclusive range of lengths, drawn uniformly (``low == high``: a fixed length)."""

    low: int
    high: int

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2


MAX_SESSIONS = 10_000
MAX_TURNS = 1_000
MAX_PROMPT_TOKENS = 1 << 20
"""The longest prompt a workload may give (1M tokens: the longest context of the models here)."""
MAX_TOTAL_PROMPT_TOKENS = 20_000_000
"""All prompts of a workload together, at the spans' highs (the presets reach at most 2.3M)."""
CAPS = (
    f"the caps are sessions <= {MAX_SESSIONS}, turns <= {MAX_TURNS}, prompts <= "
    f"{MAX_PROMPT_TOKENS} tokens and {MAX_TOTAL_PROMPT_TOKENS} prompt tokens in all, "
    "so that a run fits in memory; the presets use at most 90 sessions, 20 turns and 52k-token prompts"
)
"""Why a workload is refused, in the words of its error (the presets are far below)."""


@dataclass(frozen=True)
class Workload:
    """A stated workload (see the module docstring); every length is in tokens."""

    name: str
    description: str
    source: str
    """Where the numbers come from (an operator must be able to judge them)."""
    sessions: int
    """Conversations; requests = sessions x turns."""
    turns: int
    system_tokens: int
    """One system prompt shared by every request (0: none)."""
    turn_tokens: Span
    """New user tokens per turn (tool output, question, ...)."""
    output_tokens: Span
    """Tokens the model generates per turn (part of the next turn's prompt)."""
    documents: int = 0
    """Distinct shared documents (RAG): each session starts, after the system prompt,
    with one of them, chosen uniformly (0: none)."""
    document_tokens: Span = Span(0, 0)
    seed: int = 0
    gpu_cache: GpuCache = GpuCache.COLD
    max_num_batched_tokens: int = 8192
    """The engine's prefill step budget (vLLM's ``max_num_batched_tokens``)."""

    def __post_init__(self) -> None:
        for name in ("sessions", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload {self.name!r}: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("system_tokens", "documents"):
            if getattr(self, name) < 0:
                raise ValueError(f"workload {self.name!r}: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("turn_tokens", "output_tokens", "document_tokens"):
            span = getattr(self, name)
            if not 0 <= span.low <= span.high:
                raise ValueError(
                    f"workload {self.name!r}: {name} must be [low, high] with 0 <= low <= high, "
                    f"got [{span.low}, {span.high}]"
                )
        if self.turn_tokens.low < 1:
            raise ValueError(f"workload {self.name!r}: turn_tokens must be >= 1 (a turn says something)")
        if self.output_tokens.low < 1:
            raise ValueError(f"workload {self.name!r}: output_tokens must be >= 1 (a request samples a token)")
        if self.documents and self.document_tokens.low < 1:
            raise ValueError(f"workload {self.name!r}: documents need document_tokens >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"workload {self.name!r}: max_num_batched_tokens must be >= 1")
        self._check_caps()

    def _check_caps(self) -> None:
        """:data:`CAPS`: a workload a run can hold in memory, each field named when over."""
        for name, cap in (("sessions", MAX_SESSIONS), ("turns", MAX_TURNS)):
            if getattr(self, name) > cap:
                raise ValueError(
                    f"workload {self.name!r}: {name} must be <= {cap} ({CAPS}), "
                    f"got {getattr(self, name)}"
                )
        for name in ("system_tokens", "turn_tokens", "output_tokens", "document_tokens"):
            value = getattr(self, name)
            longest = value.high if isinstance(value, Span) else value
            if longest > MAX_PROMPT_TOKENS:
                raise ValueError(
                    f"workload {self.name!r}: {name} must be <= {MAX_PROMPT_TOKENS} tokens "
                    f"({CAPS}), got {longest}"
                )
        if self.longest_prompt_bound > MAX_PROMPT_TOKENS:
            raise ValueError(
                f"workload {self.name!r}: a prompt can reach {self.longest_prompt_bound} tokens "
                f"(system_tokens + document_tokens + turns x turn_tokens + (turns - 1) x "
                f"output_tokens, at their highs), over {MAX_PROMPT_TOKENS} ({CAPS}); "
                "lower turns or turn_tokens"
            )
        if self.total_prompt_bound > MAX_TOTAL_PROMPT_TOKENS:
            raise ValueError(
                f"workload {self.name!r}: sessions x the turns' prompts can reach "
                f"{self.total_prompt_bound} prompt tokens, over {MAX_TOTAL_PROMPT_TOKENS} "
                f"({CAPS}); lower sessions or turns"
            )

    @property
    def longest_prompt_bound(self) -> int:
        """The longest prompt any draw can give: the last turn's, every span at its high."""
        return self._prompt_bound(self.turns)

    @property
    def total_prompt_bound(self) -> int:
        """Every request's prompt added up, every span at its high."""
        return self.sessions * sum(self._prompt_bound(t) for t in range(1, self.turns + 1))

    def _prompt_bound(self, turn: int) -> int:
        """The prompt of turn ``turn`` (counted from 1), every span at its high."""
        return (
            self.system_tokens
            + (self.document_tokens.high if self.documents else 0)
            + turn * self.turn_tokens.high
            + (turn - 1) * self.output_tokens.high
        )

    def describe(self) -> str:
        """One line: the shape in numbers."""
        doc = (
            f", one of {self.documents} shared documents of {_span(self.document_tokens)}"
            if self.documents
            else ""
        )
        return (
            f"{self.name}: {self.sessions} sessions x {self.turns} turns, system prompt "
            f"{self.system_tokens}{doc}, turns of {_span(self.turn_tokens)}, outputs of "
            f"{_span(self.output_tokens)} tokens; GPU cache {self.gpu_cache.value}"
        )


def _span(span: Span) -> str:
    return str(span.low) if span.low == span.high else f"{span.low}-{span.high}"


@dataclass(frozen=True)
class WorkloadRequest:
    """One request: its prompt, the tokens it generates, and the shared prefix it starts with."""

    session: int
    turn: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    system_tokens: int


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(1, TOKEN_RANGE) for _ in range(n))


def requests(workload: Workload) -> Iterator[WorkloadRequest]:
    """The workload's requests in arrival order: turn by turn, sessions round-robin."""
    rng = random.Random(workload.seed)
    system = _tokens(rng, workload.system_tokens)
    docs = [_tokens(rng, workload.document_tokens.draw(rng)) for _ in range(workload.documents)]
    history: list[tuple[int, ...]] = []
    for _ in range(workload.sessions):
        doc = docs[rng.randrange(len(docs))] if docs else ()
        history.append(system + doc)
    for turn in range(workload.turns):
        for session in range(workload.sessions):
            prompt = history[session] + _tokens(rng, workload.turn_tokens.draw(rng))
            output = _tokens(rng, workload.output_tokens.draw(rng))
            history[session] = prompt + output
            yield WorkloadRequest(session, turn, prompt, output, workload.system_tokens)


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------

_SPANS = ("turn_tokens", "output_tokens", "document_tokens")
_INTS = ("sessions", "turns", "system_tokens", "documents", "seed", "max_num_batched_tokens")
_STRS = ("name", "description", "source")


def workload_from_mapping(data: Mapping[str, Any], where: str) -> Workload:
    """A :class:`Workload` from a parsed TOML table; a mistake names the field and a valid form."""
    known = {f.name for f in fields(Workload)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown workload field(s) {unknown}; known: {sorted(known)}")
    missing = sorted(
        name for name in ("name", "sessions", "turns", "turn_tokens", "output_tokens")
        if name not in data
    )
    if missing:
        raise ValueError(f"{where}: missing workload field(s) {missing}")
    values: dict[str, Any] = {"description": "", "source": "", "system_tokens": 0}
    for key, value in data.items():
        if key in _SPANS:
            values[key] = _parse_span(where, key, value)
        elif key in _INTS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{where}: {key} must be an integer, e.g. {key} = 4; got {value!r}")
            values[key] = value
        elif key in _STRS:
            if not isinstance(value, str):
                raise ValueError(f"{where}: {key} must be a string; got {value!r}")
            values[key] = value
        elif key == "gpu_cache":
            choices = [c.value for c in GpuCache]
            if value not in choices:
                raise ValueError(f"{where}: gpu_cache must be one of {choices}; got {value!r}")
            values[key] = GpuCache(value)
    try:
        return Workload(**values)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _parse_span(where: str, key: str, value: Any) -> Span:
    if isinstance(value, int) and not isinstance(value, bool):
        return Span(value, value)
    if (
        isinstance(value, list)
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        return Span(value[0], value[1])
    raise ValueError(
        f"{where}: {key} must be a length or an inclusive [low, high] range, e.g. "
        f"{key} = [128, 512]; got {value!r}"
    )


def load_workload(path: Path | str) -> Workload:
    """A workload TOML file (``reference/workloads/*.toml`` shows the format)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"workload file {path}: cannot read it ({e.strerror or e})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"workload file {path}: not valid TOML ({e})") from None
    return workload_from_mapping(data, f"workload file {path}")


PRESETS = ("chat", "rag", "agentic")
"""The named presets shipped in ``reference/workloads/``."""


def preset(name: str) -> Workload:
    """A shipped preset by name (:data:`PRESETS`)."""
    if name not in PRESETS:
        raise ValueError(f"no workload preset {name!r}; presets: {', '.join(PRESETS)}")
    text = resources.files("reference").joinpath("workloads", f"{name}.toml").read_text("utf-8")
    return workload_from_mapping(tomllib.loads(text), f"preset {name!r}")
