"""Drivers for the real-model fixtures, and the fixture x knob cases the data lanes run.

:func:`fixture_driver` builds a :class:`conformance.harness.driver.VllmDriver` from a stored
fixture (``vllm_adapter/fixtures/<release>/``) with vLLM's own planned KV tensors;
:class:`FixtureCase` is one such run's knob and sizes (the sizes live in
:data:`conformance.harness.cases.CASES`).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from conformance.harness.cases import ConnectorChoice
from vllm_adapter.names import REFERENCE_SPEC, STOCK_CONNECTOR, connector_module


def fixture_driver(
    name: str,
    extra_config: dict[str, Any],
    *,
    num_gpu_blocks: int,
    num_cpu_chunks: int,
    connector: str = STOCK_CONNECTOR,
    connector_module_path: str | None = None,
    max_num_batched_tokens: int | None = None,
    spec: dict[str, Any] | None = None,
    retention_interval: int | None | str = "fixture",
) -> Any:
    """A :class:`~conformance.harness.driver.VllmDriver` for a stored model fixture, shrunk.

    The fixture's engine config (``vllm_adapter.fixtures.make_vllm_config``)
    with the :data:`REFERENCE_SPEC` spec and ``num_cpu_chunks`` CPU chunks
    added to ``extra_config``, ``num_gpu_blocks`` GPU blocks (KV tensors
    re-planned by vLLM for that size, scheduler and worker views alike) and
    synchronous scheduling (the driver keeps one batch in flight).  ``spec``:
    other spec entries (e.g. the tiered lane's) replacing :data:`REFERENCE_SPEC`.
    ``retention_interval``: vLLM's ``prefix_cache_retention_interval`` (``None``
    dense), set where the engine resolves it; ``"fixture"`` keeps the fixture's.
    """
    from conformance.harness import driver as D
    from conformance.harness.kv_memory import shrink_kv_cache_config
    from vllm_adapter import fixtures as fx

    data = fx.load_fixture(name)
    extra = {**extra_config, **(REFERENCE_SPEC if spec is None else spec)}
    extra["num_cpu_chunks"] = num_cpu_chunks
    vllm_config = fx.make_vllm_config(
        data, extra, connector=connector, connector_module_path=connector_module_path
    )
    sc = copy.copy(vllm_config.scheduler_config)
    sc.async_scheduling = False
    if max_num_batched_tokens is not None:
        sc.max_num_batched_tokens = max_num_batched_tokens
        sc.max_num_encoder_input_tokens = max_num_batched_tokens
        sc.encoder_cache_size = max_num_batched_tokens
    vllm_config.scheduler_config = sc
    vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
    worker = shrink_kv_cache_config(
        fx.rebuild_kv_cache_config(data, "worker"), vllm_config, num_gpu_blocks
    )
    scheduler = shrink_kv_cache_config(
        worker, vllm_config, num_gpu_blocks, like=fx.rebuild_kv_cache_config(data, "scheduler")
    )
    if retention_interval != "fixture":
        vllm_config.cache_config.prefix_cache_retention_interval = retention_interval
        for kvc in (worker, scheduler):
            kvc.prefix_cache_retention_interval = retention_interval
    return D.VllmDriver(scheduler, vllm_config, worker_kv_cache_config=worker)




@dataclass(frozen=True)
class FixtureCase(ConnectorChoice):
    """A model fixture x knob run through vLLM's real path (data and gpu_copy lanes)."""

    fixture: str
    extra: tuple[tuple[str, int], ...]
    kvchunk: bool
    """Through kvchunk's connector (True) or vLLM's stock OffloadingConnector."""
    num_gpu_blocks: int
    num_cpu_chunks: int
    prompt_len: int
    budget: int = 256
    block_tokens_base: int | None = None
    """For knobs that count blocks (``blocks_per_chunk``): the fixture's scheduler block
    size (tokens) ``prompt_len`` and ``budget`` were chosen for.  When the stored
    fixture was planned with other blocks, both scale with them, so the workload
    spans the same blocks and chunks: vLLM 0.34.0 plans gemma-4 with 64-token
    blocks (128 for the full group) where 0.33.0 used 16 (32), and an unscaled
    prompt would not fill one chunk.  ``None``: token counts are absolute."""

    def token_scale(self) -> int:
        """How many times the fixture's scheduler block exceeds :attr:`block_tokens_base`."""
        if self.block_tokens_base is None:
            return 1
        from vllm_adapter import fixtures as fx

        block = int(fx.load_fixture(self.fixture)["resolved"]["scheduler_block_size"])
        if block % self.block_tokens_base:
            raise ValueError(
                f"{self}: the fixture's {block}-token scheduler block is not a multiple of "
                f"the {self.block_tokens_base} tokens the workload was sized for"
            )
        return max(1, block // self.block_tokens_base)

    @property
    def workload_prompt_len(self) -> int:
        """:attr:`prompt_len`, scaled to the fixture's blocks (:attr:`block_tokens_base`)."""
        return self.prompt_len * self.token_scale()

    @property
    def workload_budget(self) -> int:
        """:attr:`budget` (tokens per step), scaled like :attr:`workload_prompt_len`."""
        return self.budget * self.token_scale()

    def __str__(self) -> str:
        (key, value), *_ = self.extra
        return f"{self.fixture}-{key}{value}"

    def driver(self, spec: dict[str, Any] | None = None) -> Any:
        """The case's driver; ``spec``: another offloading spec (the tiered lanes' fs tier)."""
        return fixture_driver(
            self.fixture,
            dict(self.extra),
            num_gpu_blocks=self.num_gpu_blocks,
            num_cpu_chunks=self.num_cpu_chunks,
            connector=self.connector,
            connector_module_path=connector_module(self.connector),
            spec=spec,
        )
