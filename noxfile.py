"""Developer and CI entry points for kvchunk.

Every vLLM-facing session is parametrized by the vLLM release it runs
against (:data:`VLLM_VERSIONS`), so ``nox -s tests`` and ``nox -s conformance``
run every supported release, and one is picked with, e.g.::

    nox -s "conformance(vllm='0.34.0')"

Installs are reproducible: each release has a full lock under
``constraints/`` (``nox -s lock`` regenerates them) that every session installs
with.  Sessions run on the uv backend and reuse their environments; both
releases pin torch 2.14.0, so uv's cache holds the 9 GB stack once.
``KVCHUNK_PROFILE`` (``ci`` by default, ``deep`` for nightly runs, ``dev`` for
a quick look) picks the hypothesis profile for ``tests`` and ``conformance``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_venv = "yes"
nox.options.sessions = ["lint", "corpus_replay", "tests", "conformance", "serve_install"]

PYTHON = "3.11"
ROOT = Path(__file__).resolve().parent
CONSTRAINTS = ROOT / "constraints"


def _supported_releases() -> tuple[str, ...]:
    """``vllm_adapter/release_list.py``'s list, loaded by path: nox runs without kvchunk."""
    path = ROOT / "vllm_adapter" / "release_list.py"
    spec = importlib.util.spec_from_file_location("_kvchunk_release_list", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.SUPPORTED_RELEASES)


VLLM_VERSIONS = _supported_releases()
"""The vLLM releases kvchunk supports, oldest first (the newest is the default)."""

# The extras every development session installs.  One set for all sessions: uv
# hard-links from its cache, so the vLLM/torch stack is paid for once per machine.
DEV_EXTRAS = "vllm,dev,plot"


def lock_file(vllm: str) -> Path:
    """The full pinned resolution for one vLLM release (``nox -s lock`` writes it)."""
    return CONSTRAINTS / f"vllm-{vllm}.txt"


def override_file(vllm: str) -> Path | None:
    """Overrides of a release's own pins that the registry cannot satisfy (see the file)."""
    path = CONSTRAINTS / f"overrides-vllm-{vllm}.txt"
    return path if path.exists() else None


def _resolution_args(vllm: str) -> list[str]:
    args = ["-c", str(lock_file(vllm))]
    override = override_file(vllm)
    if override is not None:
        args += ["--override", str(override)]
    return args


def _install(session: nox.Session, vllm: str, extras: str = DEV_EXTRAS) -> None:
    session.install("-e", f".[{extras}]", *_resolution_args(vllm))


def _env(vllm: str | None = None) -> dict[str, str]:
    """The sessions' environment; ``KVCHUNK_VLLM`` names the release (none without vLLM)."""
    return {
        "KVCHUNK_PROFILE": os.environ.get("KVCHUNK_PROFILE", "ci"),
        **({"KVCHUNK_VLLM": vllm} if vllm else {}),
        # vLLM on a CPU-only host: keep it quiet and off the network.
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # PYTHONDONTWRITEBYTECODE (set on our CI machines) makes every process recompile
        # the vLLM and torch modules it imports (most of a minute each); an empty value
        # lets the first process cache them in the session's environment.
        "PYTHONDONTWRITEBYTECODE": "",
    }


@nox.session(python=PYTHON)
@nox.parametrize("vllm", VLLM_VERSIONS)
def tests(session: nox.Session, vllm: str) -> None:
    """Unit and property tests that run on CPU (reference, adapter, helpers)."""
    _install(session, vllm)
    session.run("pytest", "tests", *session.posargs, env=_env(vllm))


@nox.session(python=PYTHON)
@nox.parametrize("vllm", VLLM_VERSIONS)
def conformance(session: nox.Session, vllm: str) -> None:
    """The main job: vLLM's real offloading path against the reference, lane by lane."""
    _install(session, vllm)
    session.run("python", "-m", "conformance", *session.posargs, env=_env(vllm))


@nox.session(python=PYTHON)
@nox.parametrize("vllm", VLLM_VERSIONS)
def serve_install(session: nox.Session, vllm: str) -> None:
    """An operator's install, ``.[vllm]`` alone: the CLI plans gemma-4 and DeepSeek-V4."""
    _install(session, vllm, extras="vllm")
    session.run("python", "scripts/check_serve_install.py", vllm, env=_env(vllm))


@nox.session(python=PYTHON)
@nox.parametrize("vllm", VLLM_VERSIONS)
def corpus(session: nox.Session, vllm: str) -> None:
    """Regenerate the golden corpus (``conformance/corpus/data/vllm-<release>.jsonl``).

    Deterministic (the same bytes on a rerun); ``nox -s corpus -- check`` compares
    instead of writing (CI runs that check in the conformance session's plan lane).
    """
    _install(session, vllm)
    session.run("python", "-m", "conformance.corpus", *(session.posargs or ["generate"]),
                env=_env(vllm))


@nox.session(python=PYTHON, reuse_venv=False)
def corpus_replay(session: nox.Session) -> None:
    """A backend author's install, no vLLM and no torch: the reference passes the corpus.

    Proves the golden corpus needs nothing but ``reference/`` and the backend: kvchunk is
    installed without its dependencies (the replay imports only the standard library; the
    pool of ``reference.store.ChunkStore``, the one torch user on its path, imports it
    lazily), plus pytest and hypothesis (``tests/conftest.py``) pinned like the other
    sessions.  The session fails if vLLM or torch is importable, then replays every case
    into the reference and runs the corpus tests.  A fresh environment each run
    (``reuse_venv=False``): one reused from a ``.[dev]`` install would still hold torch.
    """
    session.install("--no-deps", "-e", ".")
    session.install("pytest", "hypothesis", *_resolution_args(VLLM_VERSIONS[-1]))
    session.run("python", "-c", NO_VLLM_CHECK)
    session.run("python", "-c", NO_TORCH_CHECK)
    session.run("python", "-m", "conformance.corpus", "replay", "--backend", "reference", env=_env())
    session.run("pytest", "tests/test_corpus.py", *session.posargs, env=_env())


NO_VLLM_CHECK = (
    "import importlib.util, sys; "
    "sys.exit('corpus_replay: vllm is importable; this session must run without it' "
    "if importlib.util.find_spec('vllm') else 0)"
)
NO_TORCH_CHECK = (
    "import importlib.util, sys; "
    "sys.exit('corpus_replay: torch is importable; this session must run without it' "
    "if importlib.util.find_spec('torch') else 0)"
)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Throughput benchmarks (pytest-benchmark) on the newest vLLM; non-zero when a target is missed."""
    vllm = VLLM_VERSIONS[-1]
    _install(session, vllm)
    session.run("python", "-m", "conformance.bench", *session.posargs, env=_env(vllm))


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """README.md's generated regions from ``reports/`` and real CLI runs on the newest release.

    ``scripts/gen_readme.py`` rewrites every ``<!-- generated:NAME -->`` region;
    ``nox -s docs -- --check`` only compares (``tests/test_readme.py`` checks the same).
    """
    vllm = VLLM_VERSIONS[-1]
    _install(session, vllm)
    session.run("python", "scripts/gen_readme.py", *session.posargs, env=_env(vllm))


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff everywhere; mypy --strict on the reference, default strictness on the rest.

    The adapter and the suite are checked at mypy's default strictness (the ratchet
    starts there: no error today), with vLLM and other untyped dependencies skipped
    (``[tool.mypy]`` overrides in pyproject.toml).
    """
    _install(session, VLLM_VERSIONS[-1])
    session.run(
        "ruff", "check", "reference", "vllm_adapter", "conformance", "tests", "scripts", "noxfile.py"
    )
    session.run("mypy", "--strict", "reference")
    session.run("mypy", "vllm_adapter", "conformance")


@nox.session(python=PYTHON, venv_backend="uv")
def lock(session: nox.Session) -> None:
    """Re-resolve ``constraints/vllm-*.txt``: one full lock per supported vLLM release."""
    session.install("uv")
    for vllm in VLLM_VERSIONS:
        pin = CONSTRAINTS / f"pin-vllm-{vllm}.txt"
        pin.write_text(f"vllm=={vllm}\n")
        try:
            args = [
                "uv", "pip", "compile", "pyproject.toml", "--quiet",
                "--extra", "vllm", "--extra", "dev", "--extra", "plot",
                "--python-version", PYTHON, "--python-platform", "x86_64-manylinux_2_28",
                "-c", str(pin.relative_to(ROOT)),
                "--custom-compile-command", "nox -s lock",
                "-o", str(lock_file(vllm).relative_to(ROOT)),
            ]
            override = override_file(vllm)
            if override is not None:
                args += ["--override", str(override.relative_to(ROOT))]
            session.run(*args, external=False)
        finally:
            pin.unlink()
