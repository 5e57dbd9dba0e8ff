"""The emulated transfer engine: an ``OffloadingWorker`` that moves no bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from conformance.harness import vllm_harness_api as V

if TYPE_CHECKING:
    from conformance.harness.driver.session import DriverSession


class TransferEngine(V.OffloadingWorker):
    """An ``OffloadingWorker`` that moves no bytes and finishes jobs on schedule.

    Jobs are due ``delay`` steps after submission (``JobFault.delay_steps``,
    else the session's default), never for ``JobFault.never``.  ``wait`` (a
    flush, or a sync load) finishes the named jobs at once -- the real
    ``wait`` blocks until they are done.
    """

    def __init__(self, session: DriverSession) -> None:
        self._session = session
        self.due: dict[int, int | None] = {}
        self.kinds: dict[int, str] = {}

    def _submit(self, job_id: int, kind: str) -> bool:
        fault = self._session.faults.get(job_id)
        if fault is not None and fault.fail and kind == "store" and not V.SUPPORTS_FAILED_TRANSFERS:
            raise ValueError(
                f"job {job_id} is a store: vLLM 0.33.0 cannot report a failed store "
                "(OffloadingConnectorWorker.get_finished asserts TransferResult.success); "
                "use JobFault(never=True) to lose it instead"
            )
        if fault is not None and fault.never:
            due = None
        else:
            delay = fault.delay_steps if fault is not None else self._session.default_delay_steps
            due = self._session.step_no + delay
        self.due[job_id] = due
        self.kinds[job_id] = kind
        return True

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._submit(job_id, "store")

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        return self._submit(job_id, "load")

    def get_finished(self) -> list[Any]:
        now = self._session.step_no
        done = [j for j, due in self.due.items() if due is not None and due <= now]
        for j in done:
            del self.due[j]
        return [V.TransferResult(job_id=j, success=self._succeeds(j)) for j in sorted(done)]

    def _succeeds(self, job_id: int) -> bool:
        """False for a ``JobFault(fail=True)`` job, where the worker can say so (0.34.0).

        On 0.33.0 a failed load is reported done and its request is listed in
        ``failed_recving`` by :meth:`DriverSession._worker_step` (the only way
        that release accepts one).
        """
        fault = self._session.faults.get(job_id)
        return not (V.SUPPORTS_FAILED_TRANSFERS and fault is not None and fault.fail)

    def wait(self, job_ids: set[int]) -> None:
        for j in job_ids:
            if j in self.due:
                self.due[j] = self._session.step_no

    @property
    def in_flight(self) -> set[int]:
        return set(self.due)
