"""Threads kept for the next request instead of started for each one.

An Interact stream needs two threads besides gRPC's (one reads the client's
messages ahead of the run, one runs the forward), a Generate or Session one.
Starting a thread costs far more than handing work to one that waits: on a
busy box a start is a millisecond or more. A thread that finishes its work
waits here for the next, and ends after `idle_s` without any.
"""

from __future__ import annotations

import contextvars
import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger("nnd.worker")


class Spares:
    def __init__(self, *, keep: int = 8, idle_s: float = 60.0) -> None:
        self.keep = keep  # idle threads kept at most; more end when their work does
        self.idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []  # each idle thread's inbox
        self.started = 0  # threads started so far (tests read it)

    def run(self, work: Callable[[], None], name: str) -> None:
        """Run `work()` on a thread of its own: an idle one, else a new one."""
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
            if inbox is None:
                self.started += 1
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=name, daemon=True).start()
        inbox.put(work)

    def _serve(self, inbox: queue.SimpleQueue[Callable[[], None]]) -> None:
        work = inbox.get()
        while True:
            try:
                # A context of its own each time: a context variable one request set (shm.py's sink) is
                # never seen by the next, as on a fresh thread.
                contextvars.Context().run(work)
            except BaseException:  # noqa: BLE001 - the work reports its own failures; this is a last resort
                log.exception("a worker thread's work failed")
            with self._lock:
                if len(self._idle) >= self.keep:
                    return
                self._idle.append(inbox)
            try:
                work = inbox.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # nobody took this thread meanwhile: end it
                        self._idle.remove(inbox)
                        return
                work = inbox.get()  # taken just as it timed out: its work is on the way
