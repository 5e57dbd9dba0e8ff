"""vllm_adapter.disk.finished: a request's stored keys are handed back exactly once, when
vLLM has finished it and each of its store tasks is done, whichever comes last; never
while a store of it is in flight or it is live (its next chunked-prefill step may still
complete a boundary)."""

from __future__ import annotations

import threading

from vllm_adapter.disk.finished import FinishedRequests


def test_finished_after_the_last_task_hands_the_keys_back_then() -> None:
    r = FinishedRequests()
    r.stored("a", [b"1", b"2"], tasks=2)
    r.stored("a", [b"2", b"3"], tasks=1)
    assert r.task_done("a") is None and r.task_done("a") is None and r.task_done("a") is None
    assert len(r) == 1, "a live request is tracked"
    assert r.finished("a") == (b"1", b"2", b"3")
    assert len(r) == 0 and r.finished("a") is None, "handed back once"


def test_the_last_task_of_a_finished_request_hands_the_keys_back() -> None:
    r = FinishedRequests()
    r.stored("a", [b"1"], tasks=1)
    r.stored("b", [b"9"], tasks=1)
    r.stored("a", [b"2"], tasks=1)
    assert r.finished("a") is None, "a store task of it is in flight"
    assert r.task_done("a") is None
    assert r.task_done("b") is None, "b is live"
    assert r.task_done("a") == (b"1", b"2")
    assert r.finished("b") == (b"9",)
    assert len(r) == 0


def test_a_request_that_stored_nothing_hands_nothing() -> None:
    assert FinishedRequests().finished("x") is None


def test_concurrent_tasks_hand_the_keys_back_exactly_once() -> None:
    r = FinishedRequests()
    n = 64
    r.stored("a", [b"k"], tasks=n)
    got: list[tuple[bytes, ...] | None] = []
    lock = threading.Lock()

    def done() -> None:
        out = r.task_done("a")
        with lock:
            got.append(out)

    finished = r.finished("a")
    threads = [threading.Thread(target=done) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert finished is None
    assert [g for g in got if g is not None] == [(b"k",)]
