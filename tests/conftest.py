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
