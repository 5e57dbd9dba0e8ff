"""Broken transfer workers the fault lane's checks must catch (meta tests).

:func:`install_mutation` patches :class:`conformance.harness.faults.worker.FaultyWorker`
(through pytest's ``monkeypatch``, so the break ends with the test) the way a
buggy transfer engine would behave.
"""

from __future__ import annotations

from typing import Any

from conformance.harness.faults.worker import FaultyWorker, _Job


def _report_lost_store(monkeypatch: Any) -> None:
    """A failed store (poisoned chunks) is reported as done, so its keys become loadable."""
    from conformance.harness import vllm_harness_api as V

    real_lose = FaultyWorker._lose
    real_execute = FaultyWorker._execute

    def lose(self: FaultyWorker, job: _Job) -> None:
        real_lose(self, job)
        if job.fate == "lost":
            del self.lost[job.job_id]
            self.lost_keys -= job.keys
            job.fate = "poisoned"
            self.pending[job.job_id] = job

    def execute(self: FaultyWorker, job: _Job) -> None:
        if job.store and job.fate == "poisoned":
            self._results.append(V.TransferResult(job_id=job.job_id, success=True))
            return
        real_execute(self, job)

    monkeypatch.setattr(FaultyWorker, "_lose", lose)
    monkeypatch.setattr(FaultyWorker, "_execute", execute)


def _report_load_early(monkeypatch: Any) -> None:
    """A load is reported when submitted and copied only when due, so its request runs before
    its blocks arrive."""
    from conformance.harness import vllm_harness_api as V

    real_submit = FaultyWorker.submit_load
    real_execute = FaultyWorker._execute

    def submit_load(self: FaultyWorker, job_id: int, src: Any, dst: Any,
                    expedited: bool = False) -> bool:
        ok = real_submit(self, job_id, src, dst, expedited)
        job = self.pending.get(job_id)
        if job is not None and job.fate == "ok":
            job.fate = "early"
            job.due += 2
            self._results.append(V.TransferResult(job_id=job_id, success=True))
        return ok

    def execute(self: FaultyWorker, job: _Job) -> None:
        if not job.store and job.fate == "early":
            self.inner.submit_load(job.job_id, job.src, job.dst)
            self.inner._finished = [r for r in self.inner._finished if r.job_id != job.job_id]
            return
        real_execute(self, job)

    monkeypatch.setattr(FaultyWorker, "submit_load", submit_load)
    monkeypatch.setattr(FaultyWorker, "_execute", execute)


def install_mutation(monkeypatch: Any, mutation: str) -> None:
    """Break :class:`FaultyWorker` the way a buggy transfer engine would (meta tests).

    ``report_lost_store``: a failed store (poisoned chunks) is reported as done,
    so its keys become loadable.  ``skip_flush_wait``: ``wait`` returns without
    making the named copies, so delayed stores copy blocks vLLM already reused.
    ``report_load_early``: a load is reported when submitted and copied only
    when due, so its request runs before its blocks arrive.
    """
    if mutation == "report_lost_store":
        _report_lost_store(monkeypatch)
    elif mutation == "skip_flush_wait":
        monkeypatch.setattr(FaultyWorker, "wait", lambda self, job_ids: None)
    elif mutation == "report_load_early":
        _report_load_early(monkeypatch)
    else:
        raise ValueError(f"unknown mutation {mutation!r}")
