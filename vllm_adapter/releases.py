"""The rules each supported vLLM release runs, as named reference policy switches.

The reference (:class:`reference.plan.Policy`) defaults to the *intended* rule
for every switch.  A release that deviates runs the switch that reproduces it,
so the plan lane can still compare call by call, and the operator tooling
(``python -m vllm_adapter config``) models the release the operator runs.  The
deviations themselves are listed in ``conformance/protocol/deviations/vllm-<version>.toml``
and, where two releases differ, in ``conformance.protocol.versions.CHANGES``.

One row per release; a release not listed (a dev, rc or post build, or a newer
release) runs the newest row's rules (``rules_for(...).known`` is False).  The
installed vLLM may be told to run another row's rules instead: ``KVCHUNK_VLLM_RULES``
(the suite's ``--vllm-rules RELEASE`` sets it).  ``conformance.protocol.versions``
re-exports these names (the adapter may not import the conformance suite).
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass

from reference.plan import LastTokenRule, NullBlockRule, Policy, WindowRule
from vllm_adapter.release_list import SUPPORTED_RELEASES

__all__ = [
    "NEWEST",
    "OLDEST",
    "RELEASES",
    "RULES_ENV",
    "ReleaseRules",
    "check_release",
    "installed_version",
    "rules_for",
    "rules_line",
]

RULES_ENV = "KVCHUNK_VLLM_RULES"
"""Names the release whose rules and deviations the installed vLLM runs (``--vllm-rules``)."""


@dataclass(frozen=True)
class ReleaseRules:
    version: str
    """The vLLM version asked about."""
    policy: Policy
    """The switches (other than the engine settings a trace records) this release runs."""
    known: bool = True
    """Whether ``version`` has a row of its own in :data:`RELEASES`."""
    rules_of: str = ""
    """The release whose row (switches, deviations) applies; empty: ``version`` itself."""

    @property
    def release(self) -> str:
        """The release whose rules and deviations apply to ``version``."""
        return self.rules_of or self.version


RELEASES: dict[str, ReleaseRules] = {
    "0.33.0": ReleaseRules(
        "0.33.0",
        Policy(
            last_token=LastTokenRule.AFTER_CAPS,
            null_blocks_in_store=NullBlockRule.SKIP,
            reload_after_failed_load=True,
            window=WindowRule.WHOLE_WINDOW,
            offload_junctions=False,
        ),
    ),
    "0.34.0": ReleaseRules(
        "0.34.0",
        Policy(
            last_token=LastTokenRule.REQUEST_END,
            null_blocks_in_store=NullBlockRule.PLACEHOLDER,
            reload_after_failed_load=False,
            window=WindowRule.WHOLE_WINDOW,
        ),
    ),
}
def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


if tuple(sorted(RELEASES, key=_release_key)) != SUPPORTED_RELEASES:
    raise RuntimeError(
        f"vllm_adapter/releases.py has rules for {sorted(RELEASES)}, but "
        f"vllm_adapter/release_list.py supports {list(SUPPORTED_RELEASES)}: give each "
        "supported release one row"
    )
NEWEST = max(RELEASES, key=_release_key)
OLDEST = min(RELEASES, key=_release_key)


def installed_version() -> str | None:
    """The installed vLLM's version (its distribution metadata), or None."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_release(release: str) -> str:
    """``release`` if it has a row in :data:`RELEASES`, else a ValueError listing the rows."""
    if release not in RELEASES:
        raise ValueError(
            f"--vllm-rules / {RULES_ENV}: {release!r} is not a known vLLM release; "
            f"known: {', '.join(sorted(RELEASES))}"
        )
    return release


def rules_for(version: str) -> ReleaseRules:
    """The rules of ``version``; an unknown release is assumed to be the newest known one.

    For the installed vLLM's version, ``KVCHUNK_VLLM_RULES`` (when set) names the
    release whose rules apply instead.
    """
    override = os.environ.get(RULES_ENV, "")
    if override and version == installed_version():
        chosen = RELEASES[check_release(override)]
        return ReleaseRules(version, chosen.policy, known=version in RELEASES, rules_of=override)
    rules = RELEASES.get(version)
    if rules is not None:
        return rules
    return ReleaseRules(version or "unknown", RELEASES[NEWEST].policy, known=False, rules_of=NEWEST)


def rules_line(version: str) -> str | None:
    """One line saying which release's rules (and fixtures) ``version`` runs, unless its own."""
    rules = rules_for(version)
    if rules.release == version:
        return None
    how = "--vllm-rules" if os.environ.get(RULES_ENV) else "the newest known release"
    fixtures = "stored fixtures" if rules.known else "geometry fixtures derived live"
    if rules.known:
        return f"vLLM {version}: using {rules.release}'s rules and deviations ({how}); {fixtures}"
    return (
        f"vLLM {version} is not a known release: using {rules.release}'s rules and deviations "
        f"({how}); {fixtures}"
    )
