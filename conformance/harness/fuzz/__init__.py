"""Config fuzzing: every ``kv_connector_extra_config`` and CLI input gets the reference's
resolution or a clean error.

- :mod:`conformance.harness.fuzz.config`: hypothesis strategies over the extra config and
  the judge (:func:`check_extra_config`) that builds the kvchunk connector through
  vLLM on a fixture geometry and compares it with :mod:`reference.knobs`; plus the
  reference alone on a geometry vLLM refuses (:func:`check_reference_only`).
- :mod:`conformance.harness.fuzz.cli`: the same for ``python -m vllm_adapter config``
  (:func:`check_cli`).

Used by ``conformance/lanes/test_faults.py`` (which counts the verdicts for the
report's Reliability table) and ``tests/test_config_fuzz.py``.
"""

from __future__ import annotations

from conformance.harness.fuzz.cli import CLI_FIXTURES, check_cli, cli_cases
from conformance.harness.fuzz.config import (
    CONFIG_FIXTURES,
    OTHER_KEYS,
    ConfigTarget,
    ConfigVerdict,
    check_extra_config,
    check_reference_only,
    config_target,
    extra_configs,
    sub_hash_geometry,
)

__all__ = [
    "CLI_FIXTURES",
    "CONFIG_FIXTURES",
    "OTHER_KEYS",
    "ConfigTarget",
    "ConfigVerdict",
    "check_cli",
    "check_extra_config",
    "check_reference_only",
    "cli_cases",
    "config_target",
    "extra_configs",
    "sub_hash_geometry",
]
