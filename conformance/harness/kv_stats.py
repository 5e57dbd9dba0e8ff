"""What the synthetic model runner saw and checked (:mod:`conformance.harness.kvdata`).

:class:`DataStats` accumulates over a session; the data lane's checks
(:mod:`conformance.checks.data`) and the file-tier round trip
(:mod:`conformance.harness.tiered`) read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["DataStats"]


@dataclass
class DataStats:
    """What the runner saw and checked (summed over the session)."""

    steps: int = 0
    blocks_written: int = 0
    load_jobs: int = 0
    loaded_blocks_checked: int = 0
    """GPU blocks a load wrote (one per block id per job), each compared in every layer of its group."""
    corrupted_loads: int = 0
    """Loaded blocks with at least one layer differing from the expected bytes."""
    foreign_bytes_changed: int = 0
    """Bytes outside the loaded rows that changed while loads ran."""
    offloaded_group_ids: tuple[int, ...] = ()
    checked_per_group: dict[int, int] = field(default_factory=dict)
    """Loaded blocks checked, per KV-cache group id."""
    failures: list[str] = field(default_factory=list)
    """The first few mismatches, described."""

    def describe(self) -> str:
        return (
            f"{self.load_jobs} load jobs, {self.loaded_blocks_checked} loaded blocks checked, "
            f"{self.corrupted_loads} corrupted, {self.foreign_bytes_changed} foreign bytes changed; "
            f"checked per group {dict(sorted(self.checked_per_group.items()))} of offloaded "
            f"groups {list(self.offloaded_group_ids)}"
            + ("".join(f"\n  {f}" for f in self.failures))
        )
