"""Developer and CI entry points for kvchunk.

Every session runs on the uv backend and reuses its environment, so a warm uv
cache makes re-runs cost seconds.  ``KVCHUNK_PROFILE`` (``ci`` by default,
``deep`` for nightly runs, ``dev`` for a quick look) picks the hypothesis
profile for both ``tests`` and ``conformance``.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "tests", "conformance"]

PYTHON = "3.11"
# One requirement set for every session: uv hard-links from its cache, so the
# 9 GB vLLM/torch stack is paid for once per machine, not once per session.
INSTALL = ("-e", ".[vllm,dev,plot]")


def _install(session: nox.Session) -> None:
    session.install(*INSTALL)


def _env() -> dict[str, str]:
    return {
        "KVCHUNK_PROFILE": os.environ.get("KVCHUNK_PROFILE", "ci"),
        # vLLM on a CPU-only host: keep it quiet and off the network.
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Unit and property tests that run on CPU (reference, adapter, helpers)."""
    _install(session)
    session.run("pytest", "tests", *session.posargs, env=_env())


@nox.session(python=PYTHON)
def conformance(session: nox.Session) -> None:
    """The main job: vLLM's real offloading path against the reference, lane by lane."""
    _install(session)
    session.run("python", "-m", "conformance", *session.posargs, env=_env())


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Throughput benchmarks (pytest-benchmark); exits non-zero when a target is missed."""
    _install(session)
    session.run("python", "-m", "conformance.bench", *session.posargs, env=_env())


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff everywhere, mypy --strict on the reference."""
    _install(session)
    session.run("ruff", "check", "reference", "vllm_adapter", "conformance", "tests", "noxfile.py")
    session.run("mypy", "--strict", "reference")
