"""The rules each supported vLLM release runs, as named reference policy switches.

The reference (:class:`reference.plan.Policy`) defaults to the *intended* rule
for every switch.  A release that deviates runs the switch that reproduces it,
so the plan lane can still compare call by call, and the operator tooling
(``python -m vllm_adapter config``) models the release the operator runs.  The
deviations themselves are listed in ``conformance/deviations/vllm-<version>.toml``
and, where two releases differ, in ``conformance.versions.CHANGES``.

One row per release; a release not listed runs the newest row's rules
(``rules_for(...).known`` is False).  ``conformance.versions`` re-exports these
names (the adapter may not import the conformance suite).
"""

from __future__ import annotations

from dataclasses import dataclass

from reference.plan import LastTokenRule, NullBlockRule, Policy, WindowRule

__all__ = ["NEWEST", "RELEASES", "ReleaseRules", "rules_for"]


@dataclass(frozen=True)
class ReleaseRules:
    version: str
    policy: Policy
    """The switches (other than the engine settings a trace records) this release runs."""
    known: bool = True


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
NEWEST = max(RELEASES, key=lambda v: tuple(int(x) for x in v.split(".")))


def rules_for(version: str) -> ReleaseRules:
    """The rules of ``version``; an unknown release is assumed to be the newest known one."""
    rules = RELEASES.get(version)
    if rules is not None:
        return rules
    newest = RELEASES[NEWEST]
    return ReleaseRules(version or "unknown", newest.policy, known=False)
