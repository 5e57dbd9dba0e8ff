"""Shared pytest setup: hypothesis profiles selected by KVCHUNK_PROFILE."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("ci", max_examples=200, **_COMMON)
settings.register_profile("deep", max_examples=2000, **_COMMON)
settings.register_profile("dev", max_examples=30, **_COMMON)
settings.load_profile(os.environ.get("KVCHUNK_PROFILE", "ci"))


# -- Once per CI run, not once per vLLM release ------------------------------------------

RELEASE_INDEPENDENT = frozenset({
    "test_bench_packed_rows", "test_bench_stats", "test_corpus_no_torch", "test_disk_bounds", "test_disk_budget", "test_docs", "test_economics", "test_eviction", "test_finished_requests", "test_gpu_ci",
    "test_gpu_smoke", "test_invariants", "test_keys", "test_knobs", "test_ledger_state_machine",
    "test_ledger_across_hosts", "test_ledger_two_hosts", "test_plan", "test_policies", "test_report_tiers",
    "test_packed_file", "test_packed_split", "test_protocol_doc", "test_require_vllm", "test_rules", "test_semantics_coverage", "test_tiered_curve", "test_tiered_repair", "test_transfer", "test_transfer_catches",
    "test_transfer_fast", "test_transfer_shared",
})
"""Test modules that import no vLLM (``tests/test_release_independent.py`` checks it): their
outcome cannot depend on the release, so ``nox -s tests`` runs them once, on the oldest
release (the newest runs :data:`HARNESS_ONCE`; CI runs the two releases' chains side by
side, so each carries one of the two once-only sets)."""

HARNESS_ONCE = frozenset({
    "test_protocol", "test_readme", "test_spec_option", "test_unknown_release",
})
"""Tests of the suite's own options (``--spec``, ``--vllm-rules``, PROTOCOL.md's commands)
that start vLLM in subprocesses, and the README's generated CLI samples (the newest
release's output): run once, on the newest release; the lanes they drive run
on every release in ``nox -s conformance``."""


def pytest_collection_modifyitems(config: object, items: list[object]) -> None:
    release = os.environ.get("KVCHUNK_VLLM")  # set by nox's per-release sessions
    if not release:
        return
    import pytest

    from vllm_adapter.releases import NEWEST, OLDEST
    for item in items:
        name = item.module.__name__.rsplit(".", 1)[-1]  # type: ignore[attr-defined]
        if name in RELEASE_INDEPENDENT and release != OLDEST:
            why, where = "imports no vLLM", OLDEST
        elif name in HARNESS_ONCE and release != NEWEST:
            why, where = "tests the suite's options", NEWEST
        else:
            continue
        item.add_marker(pytest.mark.skip(  # type: ignore[attr-defined]
            reason=f"{why}: runs once per CI run, on vLLM {where} (tests/conftest.py)"))
