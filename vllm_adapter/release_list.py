"""The vLLM releases kvchunk supports, oldest first: the one copy of that list.

Standard library only, and nothing from the package: ``noxfile.py`` loads this file by
path where only nox is installed (``.ci/run``), and :mod:`vllm_adapter.releases` (each
release's rules), ``scripts/check_serve_install.py`` and the tests import it.
``tests/test_release_list.py`` fails on another copy.
"""

SUPPORTED_RELEASES: tuple[str, ...] = ("0.33.0", "0.34.0")
"""Oldest first; the newest is nox's default."""
