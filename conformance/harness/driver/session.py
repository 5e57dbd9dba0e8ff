"""One fresh scheduler + connector pair, stepped the way the engine core steps it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from conformance.harness import vllm_harness_api as V
from conformance.harness.driver.engine import TransferEngine
from conformance.harness.driver.model import model_output
from conformance.harness.driver.recorder import Recorder
from conformance.protocol.trace import (
    JobFault,
    RequestSpec,
    ResetPrefixCache,
    Trace,
    WorkloadSpec,
    thaw_params,
)

if TYPE_CHECKING:
    from conformance.harness.driver.driver import VllmDriver

T = TypeVar("T")
WorkerWrapper = Callable[["DriverSession", Any], Any]
"""``worker_wrapper(session, worker)``: what replaces the spec's real ``OffloadingWorker``."""


@dataclass(frozen=True)
class DispatchedJob:
    """A job as the worker received it in ``kv_connector_metadata`` (GPU side + CPU chunk ids)."""

    step: int
    kind: str
    job_id: int
    req_id: str
    block_ids: tuple[int, ...]
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]
    cpu_chunk_ids: tuple[int, ...]


def dispatched_jobs(meta: Any, step: int) -> list[DispatchedJob]:
    """The load, then store, jobs of a step's connector metadata, read straight from it."""
    out = []
    for kind, jobs in (("load", meta.load_jobs), ("store", meta.store_jobs)):
        for job_id, tj in jobs.items():
            gpu = tj.dst_spec if kind == "load" else tj.src_spec
            other = tj.src_spec if kind == "load" else tj.dst_spec
            out.append(
                DispatchedJob(
                    step=step,
                    kind=kind,
                    job_id=int(job_id),
                    req_id=tj.req_id,
                    block_ids=tuple(int(b) for b in gpu.block_ids),
                    group_sizes=tuple(int(x) for x in gpu.group_sizes),
                    block_indices=tuple(int(x) for x in gpu.block_indices),
                    cpu_chunk_ids=tuple(int(b) for b in getattr(other, "block_ids", ())),
                )
            )
    return out


def _by_step(items: Iterable[T], step: Callable[[T], int]) -> dict[int, list[T]]:
    out: dict[int, list[T]] = {}
    for item in items:
        out.setdefault(step(item), []).append(item)
    return out


def _check_worker_options(
    faults: Iterable[JobFault], model_runner: Any | None, worker_wrapper: WorkerWrapper | None
) -> None:
    if worker_wrapper is not None and model_runner is None:
        raise ValueError("worker_wrapper wraps the spec's real OffloadingWorker: give a model_runner")
    if model_runner is not None and faults:
        raise ValueError(
            "faults are emulated by the TransferEngine; a session with a model_runner "
            "runs the spec's real OffloadingWorker and cannot inject them"
        )


def _offloading_scheduler(connector: Any) -> Any:
    """The connector's scheduler half; refuses a connector that is not an offloading one."""
    cs = getattr(connector, "connector_scheduler", None)
    if cs is None or not hasattr(cs, "manager"):
        raise TypeError(
            f"{type(connector).__name__} is not an offloading connector: the driver needs "
            "connector.connector_scheduler.manager (OffloadingConnector or a subclass)"
        )
    return cs


def _block_hasher(vllm_config: Any, hash_block: int) -> Any:
    hash_fn = V.get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    V.init_none_hash(hash_fn)
    return V.get_request_block_hasher(hash_block, hash_fn, vllm_config.num_hash_lookahead_tokens)


class DriverSession:
    """One fresh scheduler + connector pair, stepped by hand or by :meth:`VllmDriver.run`.

    ``step_no`` counts steps from 0; :meth:`step` runs one engine step
    (``schedule`` -> worker side -> fake model -> ``update_from_output``) when
    the scheduler has anything to do, and advances the counter either way.
    """

    def __init__(
        self,
        driver: VllmDriver,
        vllm_config: Any,
        *,
        faults: Iterable[JobFault] = (),
        default_delay_steps: int = 0,
        record: bool = True,
        model_runner: Any | None = None,
        worker_wrapper: WorkerWrapper | None = None,
    ) -> None:
        _check_worker_options(faults, model_runner, worker_wrapper)
        self.driver = driver
        self.vllm_config = vllm_config
        self.model_runner = model_runner
        self.kv_cache_config = driver.kv_cache_config
        self.step_no = 0
        self.faults: dict[int, JobFault] = {f.job_index: f for f in faults}
        self.default_delay_steps = default_delay_steps
        sched_block, hash_block = V.resolve_kv_cache_block_sizes(self.kv_cache_config, vllm_config)
        self.scheduler_block_size = sched_block
        self.hash_block_size = hash_block
        self.scheduler = V.Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=V.StructuredOutputManager(vllm_config),
            block_size=sched_block,
            hash_block_size=hash_block,
            log_stats=False,
        )
        self.connector = self.scheduler.connector
        self.connector_scheduler = _offloading_scheduler(self.connector)
        self.recorder: Recorder | None = (
            Recorder(self, self.connector_scheduler) if record else None
        )
        self.dispatched: list[DispatchedJob] = []
        self._block_hasher = _block_hasher(vllm_config, hash_block)
        self.engine: TransferEngine | None = None
        self._install_worker_side(worker_wrapper)
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.load_req: dict[int, str] = {}

    def _install_worker_side(self, worker_wrapper: WorkerWrapper | None) -> None:
        """The connector's real worker half over an emulated transfer engine, or (with a
        model_runner) over the spec's own ``OffloadingWorker``, built by
        ``register_kv_caches`` from the runner's KV tensors as the GPU model runner does."""
        runner = self.model_runner
        worker_kv_cache_config = (
            self.kv_cache_config if runner is None else self.driver.worker_kv_cache_config
        )
        self.worker_connector = wc = V.KVConnectorFactory.create_connector(
            config=self.vllm_config,
            role=V.KVConnectorRole.WORKER,
            kv_cache_config=worker_kv_cache_config,
        )
        if runner is None:
            self.engine = TransferEngine(self)
            V.install_transfer_engine(
                wc.connector_worker, self.engine, len(self.kv_cache_config.kv_cache_groups)
            )
            return
        wc.register_kv_caches(runner.kv_caches)
        if worker_wrapper is not None:
            wc.connector_worker.worker = worker_wrapper(self, wc.connector_worker.worker)

    # -- workload events -----------------------------------------------------

    def add_request(self, spec: RequestSpec) -> None:
        kv_params = thaw_params(spec.kv_transfer_params)
        params = V.SamplingParams(
            max_tokens=spec.max_tokens,
            ignore_eos=True,
            skip_reading_prefix_cache=spec.skip_reading_prefix_cache or None,  # None: the default
            extra_args=None if kv_params is None else {"kv_transfer_params": kv_params},
        )
        request = V.Request(
            request_id=spec.req_id,
            prompt_token_ids=list(spec.prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self._block_hasher,
        )
        self.scheduler.add_request(request)

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, V.RequestStatus.FINISHED_ABORTED)

    def reset_prefix_cache(
        self, *, reset_connector: bool = False, reset_running_requests: bool = False
    ) -> bool:
        """``Scheduler.reset_prefix_cache``: GPU prefix cache; with ``reset_connector`` the offload tier too."""
        ok = bool(
            self.scheduler.reset_prefix_cache(
                reset_running_requests=reset_running_requests, reset_connector=reset_connector
            )
        )
        if self.recorder is None:
            return ok
        self.recorder.records.append(
            ResetPrefixCache(
                step=self.step_no,
                reset_running_requests=reset_running_requests,
                reset_connector=reset_connector,
                success=ok,
                connector_reset=self.recorder.take_connector_reset(),
            )
        )
        return ok

    # -- stepping ------------------------------------------------------------

    def has_work(self) -> bool:
        """True while a step could change anything.

        Unfinished requests, finished ones not yet shown to the connector, and
        jobs that will still be reported (submitted or queued for submission;
        ``JobFault.never`` jobs do not count).
        """
        if self.scheduler.has_unfinished_requests() or self.scheduler.finished_req_ids:
            return True
        unsubmitted = getattr(self.worker_connector.connector_worker, "_unsubmitted_store_jobs", ())
        if self.engine is not None:
            due = any(d is not None for d in self.engine.due.values())
        else:
            due = bool(getattr(self.worker_connector.connector_worker.worker, "in_flight", ()))
        return bool(due or unsubmitted)

    def step(self) -> None:
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            kv_output = self._worker_step(so)
            self.scheduler.update_from_output(so, self._model_output(so, kv_output))
        self.step_no += 1

    def _worker_calls(self, so: Any, meta: Any) -> tuple[Any, Any]:
        """The GPU model runner's connector calls for one step: ``(results, worker_meta)``."""
        wc = self.worker_connector
        wc.handle_preemptions(meta)
        wc.bind_connector_metadata(meta)
        runner = self.model_runner
        if runner is not None and hasattr(runner, "before_start_load_kv"):
            runner.before_start_load_kv(self, so)
        wc.start_load_kv(None)
        if runner is not None and hasattr(runner, "execute_model"):
            runner.execute_model(self, so)  # the forward pass: after loads, before stores
        wc.wait_for_save()
        results = wc.get_transfer_results(so.finished_req_ids)
        worker_meta = wc.build_connector_worker_meta()
        wc.clear_connector_metadata()
        return results, worker_meta

    def _worker_step(self, so: Any) -> Any:
        meta = so.kv_connector_metadata
        load_req = {j: tj.req_id for j, tj in meta.load_jobs.items()}
        self._note_dispatched(meta)
        results, worker_meta = self._worker_calls(so, meta)
        transfer_worker = self.worker_connector.connector_worker.worker
        if worker_meta is not None and worker_meta.completed_jobs:
            worker_meta.completed_jobs = self._rank_reports(
                transfer_worker, worker_meta.completed_jobs
            )
        failed = set(getattr(results, "failed_recving", ()) or ())
        failed |= self._failed_load_reqs(transfer_worker, worker_meta, load_req)
        return V.KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            kv_connector_worker_meta=worker_meta,
            failed_recving=failed,
        )

    def _failed_load_reqs(
        self, transfer_worker: Any, worker_meta: Any, load_req: dict[int, str]
    ) -> set[str]:
        """Requests of the completed load jobs that failed: emulated (``JobFault.fail`` where
        the worker cannot say so) or named by the worker's ``take_failed_loads()``."""
        completed = getattr(worker_meta, "completed_jobs", {}) or {}
        failed_jobs = set(getattr(transfer_worker, "take_failed_loads", lambda: ())())
        out: set[str] = set()
        for job_id in completed:
            fault = self.faults.get(job_id)
            emulated = fault is not None and fault.fail and not V.SUPPORTS_FAILED_TRANSFERS
            if emulated or job_id in failed_jobs:
                req_id = load_req.get(job_id) or self.load_req.get(job_id)
                if req_id is not None:
                    out.add(req_id)
        return out

    def _rank_reports(self, worker: Any, completed: dict[int, int]) -> dict[int, int]:
        """Per-job report counts as the executor's aggregation of every rank's worker meta sums them.

        One emulated worker stands for all ``world_size`` ranks, and vLLM's
        scheduler completes a job only after ``world_size`` reports
        (``TransferJobStatus.pending_count``).  By default every rank reports
        every job the worker finished; a worker with ``reporting_ranks(job_id,
        world_size)`` says how many do (fewer: the others lost the job; a job
        no rank reports is dropped, as vLLM asserts positive counts).
        """
        world_size = int(self.vllm_config.parallel_config.world_size)
        ranks = getattr(worker, "reporting_ranks", None)
        out: dict[int, int] = {}
        for job_id, n in completed.items():
            k = world_size if ranks is None else int(ranks(job_id, world_size))
            if k > 0:
                out[job_id] = n * k
        return out

    def _note_dispatched(self, meta: Any) -> None:
        """Keep the jobs of this step's metadata, read straight from it (no wrapper)."""
        for job in dispatched_jobs(meta, self.step_no):
            if job.kind == "load":
                self.load_req[job.job_id] = job.req_id
            self.dispatched.append(job)

    def _model_output(self, so: Any, kv_output: Any) -> Any:
        return model_output(self.scheduler, so, kv_output, self.vocab_size)

    def run_until_idle(self, max_steps: int = 1000) -> int:
        """Step until nothing is left to do; returns the steps taken."""
        start = self.step_no
        while self.has_work():
            if self.step_no - start >= max_steps:
                raise RuntimeError(f"still busy after {max_steps} steps")
            self.step()
        return self.step_no - start

    def run(self, spec: WorkloadSpec) -> Trace | None:
        """Play ``spec``'s events at their steps (arrivals, then aborts, then resets,
        before that step's ``schedule``) until idle; the trace of this session
        (``None`` with ``record=False``).  Faults and the batch budget are the
        session's (see :meth:`VllmDriver.session`)."""
        arrivals = _by_step(spec.requests, lambda r: r.arrival_step)
        aborts = _by_step(spec.aborts, lambda a: a.step)
        resets = _by_step(spec.resets, lambda x: x.step)
        notes: list[str] = []
        while True:
            n = self.step_no
            if n >= spec.max_steps:
                notes.append(f"stopped at max_steps={spec.max_steps} with work left")
                break
            for r in arrivals.get(n, ()):
                self.add_request(r)
            for a in aborts.get(n, ()):
                self.abort(a.req_id)
            for x in resets.get(n, ()):
                self.reset_prefix_cache(
                    reset_connector=x.reset_connector,
                    reset_running_requests=x.reset_running_requests,
                )
            if n >= spec.last_event_step and not self.has_work():
                break
            self.step()
        return None if self.recorder is None else self.trace(spec, notes)

    # -- results -------------------------------------------------------------

    def trace(self, workload: WorkloadSpec | None = None, notes: Sequence[str] = ()) -> Trace:
        if self.recorder is None:
            raise RuntimeError("this session was started with record=False")
        return Trace(
            config=self.driver.trace_config(self),
            records=tuple(self.recorder.records),
            workload=workload,
            num_steps=self.step_no,
            notes=tuple(notes),
        )

    def request(self, req_id: str) -> Any:
        """The live ``vllm.v1.request.Request`` (also after it finished)."""
        if req_id in self.scheduler.requests:
            return self.scheduler.requests[req_id]
        if self.recorder is None:
            raise KeyError(req_id)
        return self.recorder.requests[req_id]

    def block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's current GPU block table, per KV-cache group."""
        return self.scheduler.kv_cache_manager.get_block_ids(req_id)
