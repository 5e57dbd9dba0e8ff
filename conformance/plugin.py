"""pytest plugin for the conformance lanes: ``--backend``, ``--vllm-rules``,
``--require-cuda``, ``--spec`` and shared fixtures."""

from __future__ import annotations

import os
from typing import Any

import pytest

from conformance.protocol.backends import Backend, load_backend


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        default=os.environ.get("KVCHUNK_BACKEND", "vllm"),
        help="implementation under test: vllm (default), reference, or module:object",
    )
    parser.addoption(
        "--vllm-rules",
        default=os.environ.get("KVCHUNK_VLLM_RULES") or None,
        metavar="RELEASE",
        help="run the installed vLLM with this known release's rules and deviations "
        "(default: its own; an unknown build uses the newest known release's); "
        "env KVCHUNK_VLLM_RULES",
    )
    parser.addoption(
        "--require-cuda",
        action="store_true",
        default=False,
        help="fail at start, instead of skipping the gpu_copy and e2e lanes, when CUDA is absent",
    )
    parser.addoption(
        "--spec",
        default=os.environ.get("KVCHUNK_SPEC") or None,
        metavar="MODULE:CLASS",
        help="the OffloadingSpec the byte lanes (data, tiered, faults) run, e.g. "
        "vllm_adapter.spec:ReferenceOffloadingSpec (default: kvchunk's reference specs); "
        "env KVCHUNK_SPEC",
    )


def _require_cuda() -> None:
    try:
        import torch
    except ImportError:
        raise pytest.UsageError("--require-cuda: torch is not importable") from None
    if not torch.cuda.is_available():
        raise pytest.UsageError(
            "--require-cuda: CUDA is not available (torch.cuda.is_available() is False); "
            "the gpu_copy and e2e lanes cannot run here"
        )


def _choose_spec(value: str | None) -> None:
    """Check ``--spec`` and hand it to every process of the run (``$KVCHUNK_SPEC``)."""
    from conformance.harness.spec_option import SPEC_ENV, SpecUnderTest

    if not value:
        os.environ.pop(SPEC_ENV, None)
        return
    try:
        spec = SpecUnderTest.parse(value)
        spec.load()
    except ValueError as err:
        raise pytest.UsageError(str(err)) from None
    os.environ[SPEC_ENV] = str(spec)


def pytest_configure(config: pytest.Config) -> None:
    from hypothesis import HealthCheck, settings

    from conformance.protocol.versions import RULES_ENV, check_release

    rules = config.getoption("--vllm-rules")
    if rules:
        try:
            os.environ[RULES_ENV] = check_release(rules)
        except ValueError as err:
            raise pytest.UsageError(str(err)) from None
    if config.getoption("--require-cuda"):
        _require_cuda()
    _choose_spec(config.getoption("--spec"))
    checks = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    for name, examples in (("ci", 200), ("deep", 3000), ("dev", 20)):
        settings.register_profile(name, max_examples=examples, deadline=None,
                                  suppress_health_check=checks, print_blob=True,
                                  derandomize=False)
    settings.load_profile(os.environ.get("KVCHUNK_PROFILE", "ci"))
    for lane in ("config", "plan", "data", "gpu_copy", "e2e", "faults", "meta"):
        config.addinivalue_line("markers", f"{lane}: conformance lane {lane}")
    # pytest-xdist registers it; registered here too, so a GPU CI image without xdist
    # (docs/gpu-ci.md installs only pytest and hypothesis) still collects under --strict-markers.
    config.addinivalue_line("markers", "xdist_group(name): cases one -n worker runs together")


def rules_line() -> str | None:
    """The one line saying the installed vLLM runs another release's rules, if it does."""
    from conformance.protocol.versions import rules_line as line
    from vllm_adapter.releases import installed_version

    version = installed_version()
    return None if version is None else line(version)


def header_lines() -> list[str]:
    """The header's lines: another release's rules, the spec ``--spec`` chose (each if any)."""
    from conformance.harness.spec_option import header_line

    return [line for line in (rules_line(), header_line()) if line is not None]


def pytest_report_header(config: pytest.Config) -> list[str]:
    return header_lines()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    header_shown = terminalreporter.showheader and not terminalreporter.no_header
    if not header_shown:  # -q hides the header: say it once here
        for line in header_lines():
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> Backend:
    return load_backend(request.config.getoption("--backend"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tag each case for the report: its lane marker, and the ``fixture`` and ``knob`` of its
    parameters.  Here, not in the report plugin, so that every pytest-xdist worker tags its
    cases (the report plugin lives in the controller and reads the tags off the reports)."""
    from conformance.report import LANES

    lane = next((name for name in LANES if item.get_closest_marker(name)), "other")
    item.user_properties.append(("lane", lane))
    group = item.get_closest_marker("xdist_group")
    if group is not None and group.args:
        item.user_properties.append(("xdist_group", str(group.args[0])))
    case: Any = getattr(item, "callspec", None)
    params = case.params if case is not None else {}
    for value in params.values():
        for attr in ("fixture", "knob"):
            if hasattr(value, attr) and not any(k == attr for k, _ in item.user_properties):
                item.user_properties.append((attr, str(getattr(value, attr))))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A setup that waited for the economics lanes' machine-wide lock says how long
    (``lock_wait_s``): the report's case times leave the wait out."""
    outcome = yield
    if call.when == "setup":
        from conformance.harness import heavy_lock

        if heavy_lock.waited_s:
            report = outcome.get_result()
            report.user_properties.append(("lock_wait_s", round(heavy_lock.waited_s, 3)))
            heavy_lock.waited_s = 0.0
