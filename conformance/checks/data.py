"""Data lane checks: real bytes through the installed vLLM's offloading path (needs vLLM).

:func:`run_workload` drives the lane's workload (a fresh session, a synthetic model
runner writing deterministic bytes and checking every load);
:func:`loads_carry_the_stored_bytes` states what its stats must show.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from conformance.checks import expect
from conformance.harness.kv_stats import DataStats
from conformance.harness.kvdata import SyntheticModelRunner
from conformance.protocol.trace import RequestSpec

if TYPE_CHECKING:
    from conformance.harness.driver import VllmDriver

__all__ = ["loads_carry_the_stored_bytes", "run_workload"]


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(100, 30000) for _ in range(n))


def run_workload(
    driver: VllmDriver, *, prompt_len: int, budget: int, seed: int = 0, device: str = "cpu"
) -> DataStats:
    """The data lane's workload on a fresh session; the runner's stats.

    Two requests sharing a prefix, prefilled in chunks; then, each after a GPU
    prefix-cache reset so hits come from the CPU tier: the prompts again (one
    extended), a prompt diverging late with a repeat arriving while it runs, and
    several loads in one step.  ``device``: where the runner keeps the KV cache.
    """
    rng = random.Random(seed)
    p = _tokens(rng, prompt_len)
    q = p[: prompt_len // 2] + _tokens(rng, prompt_len - prompt_len // 2)
    longer = p + _tokens(rng, prompt_len // 3)
    cut = prompt_len - prompt_len // 8
    diverging = p[:cut] + _tokens(rng, prompt_len // 4)
    runner = SyntheticModelRunner(driver.worker_kv_cache_config, driver.vllm_config, device=device)
    s = driver.session(model_runner=runner, max_num_batched_tokens=budget, record=False)

    def reset() -> None:
        expect(s.reset_prefix_cache(), "vLLM refused a GPU prefix-cache reset")

    # 1. Two requests sharing half a prompt, chunked prefill: stores.
    s.add_request(RequestSpec("a", p, max_tokens=3))
    s.add_request(RequestSpec("b", q, max_tokens=3))
    s.run_until_idle()
    # 2.-3. The prompts again, one extended, one at a time: loads.
    reset()
    s.add_request(RequestSpec("a2", longer, max_tokens=2))
    s.run_until_idle()
    reset()
    s.add_request(RequestSpec("b2", q, max_tokens=2))
    s.run_until_idle()
    # 4. A prompt diverging late, and a repeat arriving while it runs.
    reset()
    s.add_request(RequestSpec("c", diverging, max_tokens=2))
    s.step()
    s.step()
    s.add_request(RequestSpec("a3", p, max_tokens=2))
    s.run_until_idle()
    # 5. Several loads in one step.
    reset()
    for name, prompt in (("a4", p), ("b4", q), ("c4", diverging)):
        s.add_request(RequestSpec(name, prompt, max_tokens=2))
    s.run_until_idle()
    return runner.stats


def loads_carry_the_stored_bytes(stats: DataStats) -> None:
    """Loads happened, in every offloaded group; each loaded block held the bytes stored
    for its position; nothing outside the loaded blocks changed."""
    expect(stats.load_jobs > 0, f"no load happened, the data lane checked nothing: "
                                f"{stats.describe()}")
    expect(stats.loaded_blocks_checked > 0, f"no loaded block was checked: {stats.describe()}")
    expect(stats.corrupted_loads == 0, f"loads carried other bytes: {stats.describe()}")
    expect(stats.foreign_bytes_changed == 0,
           f"bytes outside the loaded blocks changed: {stats.describe()}")
    unchecked = set(stats.offloaded_group_ids) - set(stats.checked_per_group)
    expect(not unchecked, f"no load reached groups {sorted(unchecked)}: {stats.describe()}")
