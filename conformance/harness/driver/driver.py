"""``VllmDriver``: builds sessions over fixed vLLM configs and describes them for traces."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

from conformance.harness import vllm_harness_api as V
from conformance.harness.driver.session import DriverSession, WorkerWrapper
from conformance.harness.driver.vllm_config import build_vllm_config
from conformance.protocol.trace import JobFault, Trace, TraceConfig, TraceGroup, WorkloadSpec
from vllm_adapter.geometry import kind_fields_of


class VllmDriver:
    """Runs workloads through vLLM's real scheduler-side offloading path.

    ``kv_cache_config`` and ``vllm_config`` are real vLLM objects, resolved as
    the engine core would (see :func:`build_vllm_config`, or use
    :meth:`from_kv_cache_config`).  Every :meth:`run` / :meth:`session` starts
    from a fresh scheduler, connector and CPU tier.
    """

    def __init__(
        self, kv_cache_config: Any, vllm_config: Any, *, worker_kv_cache_config: Any | None = None
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.vllm_config = vllm_config
        self.worker_kv_cache_config = (
            kv_cache_config if worker_kv_cache_config is None else worker_kv_cache_config
        )
        """What the workers get (``UniformTypeKVCacheSpecs`` unflattened); used with a model_runner."""

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any, **kwargs: Any) -> VllmDriver:
        """Build the vLLM configs with :func:`build_vllm_config` (same keyword arguments)."""
        vllm_config, resolved = build_vllm_config(kv_cache_config, **kwargs)
        return cls(resolved, vllm_config)

    def session(
        self,
        *,
        max_num_batched_tokens: int | None = None,
        faults: Iterable[JobFault] = (),
        default_delay_steps: int = 0,
        record: bool = True,
        model_runner: Any | None = None,
        worker_wrapper: WorkerWrapper | None = None,
    ) -> DriverSession:
        """A fresh scheduler + connector; ``record=False`` installs no wrappers.

        ``model_runner`` (e.g. :class:`conformance.harness.kvdata.SyntheticModelRunner`)
        switches the worker side to real bytes: its ``kv_caches`` go to the
        worker connector's ``register_kv_caches`` (so the spec in the extra
        config builds its real ``OffloadingWorker``, e.g.
        ``vllm_adapter.spec.ReferenceOffloadingSpec``), and each step calls its
        optional ``before_start_load_kv(session, scheduler_output)`` and
        ``execute_model(session, scheduler_output)`` (after ``start_load_kv``,
        before ``wait_for_save``).  ``JobFault`` s need the emulated engine and
        are refused then; ``worker_wrapper(session, worker)`` instead replaces
        the spec's worker with what it returns (e.g.
        :class:`conformance.harness.faults.FaultyWorker`, which injects faults around
        the real copies).  A worker may define ``reporting_ranks(job_id,
        world_size)`` (how many ranks report a finished job) and
        ``take_failed_loads()`` (load job ids to report in ``failed_recving``).

        With ``world_size > 1`` each finished job is reported once per rank, as
        the executor's aggregation of the ranks' ``kv_connector_worker_meta``
        would (vLLM completes a job after ``world_size`` reports).
        """
        vllm_config = self.vllm_config
        if (
            max_num_batched_tokens is not None
            and max_num_batched_tokens != vllm_config.scheduler_config.max_num_batched_tokens
        ):
            # What SchedulerConfig.__post_init__ derives from the budget, set alike.
            sc = copy.copy(vllm_config.scheduler_config)
            sc.max_num_batched_tokens = max_num_batched_tokens
            sc.max_num_encoder_input_tokens = max_num_batched_tokens
            sc.encoder_cache_size = max_num_batched_tokens
            vllm_config = copy.copy(vllm_config)
            vllm_config.scheduler_config = sc
        return DriverSession(
            self,
            vllm_config,
            faults=faults,
            default_delay_steps=default_delay_steps,
            record=record,
            model_runner=model_runner,
            worker_wrapper=worker_wrapper,
        )

    def run(self, spec: WorkloadSpec) -> Trace:
        """Run ``spec`` on a fresh scheduler to completion (or ``spec.max_steps``); its trace."""
        s = self.session(
            max_num_batched_tokens=spec.max_num_batched_tokens,
            faults=spec.faults,
            default_delay_steps=spec.default_delay_steps,
        )
        trace = s.run(spec)
        assert trace is not None
        return trace

    # -- config description --------------------------------------------------

    def trace_config(self, session: DriverSession | None = None) -> TraceConfig:
        kvc, vc = self.kv_cache_config, self.vllm_config
        offloaded = set(V.get_offloading_group_ids(kvc))
        dcp = vc.parallel_config.decode_context_parallel_size
        groups = tuple(
            _trace_group(i, g, i in offloaded, dcp) for i, g in enumerate(kvc.kv_cache_groups)
        )
        sched_block, hash_block = V.resolve_kv_cache_block_sizes(kvc, vc)
        extra = dict(vc.kv_transfer_config.kv_connector_extra_config or {})
        bpc = 0
        num_cpu_chunks = 0
        max_batched = vc.scheduler_config.max_num_batched_tokens
        if session is not None:
            cs = session.connector_scheduler
            bpc = int(getattr(getattr(cs, "config", None), "blocks_per_chunk", 0))
            num_cpu_chunks = int(getattr(cs.manager, "_num_chunks", 0))
            max_batched = session.vllm_config.scheduler_config.max_num_batched_tokens
        return TraceConfig(
            connector=str(vc.kv_transfer_config.kv_connector),
            groups=groups,
            tokens_per_hash=hash_block,
            scheduler_block_size=sched_block,
            blocks_per_chunk=bpc,
            extra_config=tuple(sorted(extra.items())),
            prefix_cache_retention_interval=vc.cache_config.prefix_cache_retention_interval,
            num_gpu_blocks=kvc.num_blocks,
            num_cpu_chunks=num_cpu_chunks,
            max_num_batched_tokens=max_batched,
            max_model_len=vc.model_config.max_model_len,
            enable_prefix_caching=bool(vc.cache_config.enable_prefix_caching),
            kv_load_failure_policy=str(vc.kv_transfer_config.kv_load_failure_policy),
            vllm_version=V.VLLM_VERSION,
        )


def _trace_group(index: int, group: Any, offloaded: bool, dcp: int) -> TraceGroup:
    """One group as the adapter's geometry reads it (:func:`vllm_adapter.geometry.kind_fields_of`:
    the kind of the first layer spec; tokens per block resolved for DCP); kind ``None`` for a
    spec vLLM's offloading has no kind for."""
    spec = group.kv_cache_spec
    fields = kind_fields_of(spec) or {"kind": None}
    return TraceGroup(
        index=index,
        spec=type(spec).__name__,
        tokens_per_block=V.resolve_dcp_kv_block_size(spec, dcp),
        offloaded=offloaded,
        is_eagle=bool(group.is_eagle_group),
        page_bytes=int(spec.page_size_bytes),
        num_layers=len(group.layer_names),
        **fields,
    )
