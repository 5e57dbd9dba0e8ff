"""pytest plugin for the conformance lanes: ``--backend`` and shared fixtures."""

from __future__ import annotations

import os

import pytest

from conformance.backends import Backend, load_backend


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        default=os.environ.get("KVCHUNK_BACKEND", "vllm"),
        help="implementation under test: vllm (default), reference, or module:object",
    )


def pytest_configure(config: pytest.Config) -> None:
    from hypothesis import HealthCheck, settings

    checks = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    for name, examples in (("ci", 200), ("deep", 3000), ("dev", 20)):
        settings.register_profile(name, max_examples=examples, deadline=None,
                                  suppress_health_check=checks, print_blob=True,
                                  derandomize=False)
    settings.load_profile(os.environ.get("KVCHUNK_PROFILE", "ci"))
    for lane in ("config", "plan", "data", "gpu_copy", "e2e", "faults", "meta"):
        config.addinivalue_line("markers", f"{lane}: conformance lane {lane}")


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> Backend:
    return load_backend(request.config.getoption("--backend"))
