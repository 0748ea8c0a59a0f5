"""The worker's kept threads (worker/spares.py): work runs on a thread that waits for it, each time in
a context of its own, and concurrent work gets threads of its own."""

from __future__ import annotations

import contextvars
import threading

from nnd_daemon.worker.spares import Spares

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


def _run(spares: Spares, work) -> None:
    done = threading.Event()

    def wrapped() -> None:
        try:
            work()
        finally:
            done.set()

    spares.run(wrapped, "test")
    assert done.wait(30)


def _until_idle(spares: Spares, n: int = 1) -> None:
    """Until `n` threads wait for work (a thread goes back to waiting just after its work returns)."""
    for _ in range(3000):
        with spares._lock:
            if len(spares._idle) >= n:
                return
        threading.Event().wait(0.01)
    raise AssertionError("no thread came back to wait for work")


def test_one_thread_serves_work_after_work():
    spares = Spares()
    names = []
    for _ in range(5):
        _run(spares, lambda: names.append(threading.get_ident()))
        _until_idle(spares)
    assert spares.started == 1 and len(set(names)) == 1


def test_a_context_variable_set_by_one_request_is_not_seen_by_the_next():
    spares = Spares()
    seen = []
    _run(spares, lambda: (seen.append(VAR.get()), VAR.set("first")))
    _until_idle(spares)
    _run(spares, lambda: seen.append(VAR.get()))
    assert seen == ["unset", "unset"] and spares.started == 1


def test_concurrent_work_gets_threads_of_its_own_and_a_failure_does_not_end_the_thread():
    spares = Spares()
    both = threading.Barrier(2, timeout=30)
    _run_two = [threading.Thread(target=_run, args=(spares, both.wait)) for _ in range(2)]
    for t in _run_two:
        t.start()
    for t in _run_two:
        t.join(30)
    assert spares.started == 2
    _until_idle(spares, 2)

    def fail() -> None:
        raise RuntimeError("boom")

    spares.run(fail, "test")
    _until_idle(spares, 2)
    _run(spares, lambda: None)
    assert spares.started == 2


def test_an_idle_thread_ends_after_its_idle_time():
    spares = Spares(idle_s=0.5)
    _run(spares, lambda: None)
    _until_idle(spares)
    for _ in range(3000):  # until the idle thread has ended
        with spares._lock:
            if not spares._idle:
                break
        threading.Event().wait(0.01)
    _run(spares, lambda: None)
    assert spares.started == 2
