"""What a worker is doing now: its requests in flight and since when it has been idle.

The worker is the only process that sees every request (clients may reach it
directly), so it keeps this; the daemon reads it through Status for `nnd ps`,
keep-alive and the LRU cap. Queue positions come from the order requests
arrived in, which is the order `turns.Turns` hands the model over.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from nnd.v1 import nnd_pb2, worker_pb2
from nnd_daemon import errors


@dataclass
class Request:
    seq: int
    kind: str
    client: str
    since: float
    steps: int = 0
    step: int = 0
    running: bool = False
    paused_since: float = 0.0  # unix time it paused at a sync point (0: not paused)


class Activity:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._requests: dict[int, Request] = {}
        self.idle_since = 0.0
        # The data path's admissions (gateway.py): requests in, counted against the queue depth.
        self.active = 0
        self.accepted = 0
        self.keep_alive = ""

    def begin(self, keep_alive: str, depth: int, model: str) -> None:
        """Count a request in; RESOURCE_EXHAUSTED if `depth` (0: no limit) are already in."""
        with self._lock:
            if depth and self.active >= depth:
                raise errors.ResourceExhausted(f"the queue of {model} is full (max_queue_depth={depth})")
            self.active += 1
            self.accepted += 1
            if keep_alive:
                self.keep_alive = keep_alive

    def end(self) -> None:
        with self._lock:
            self.active -= 1
            if not self.active and not self._requests:
                self.idle_since = time.time()

    def fill(self, status: worker_pb2.WorkerStatus) -> None:
        """Status's activity fields: what runs and waits, counts, and idle time."""
        status.requests.extend(self.snapshot())
        with self._lock:
            status.active = self.active
            status.accepted = self.accepted
            status.keep_alive = self.keep_alive
            status.idle_since = self.idle_since

    @contextlib.contextmanager
    def track(self, kind: str, client: str, steps: int = 0) -> Iterator[Request]:
        req = Request(next(self._seq), kind, client, time.time(), steps)
        with self._lock:
            self._requests[req.seq] = req
        try:
            yield req
        finally:
            with self._lock:
                del self._requests[req.seq]
                if not self._requests:
                    self.idle_since = time.time()

    def snapshot(self) -> list[nnd_pb2.RequestInFlight]:
        """Running requests first, then the queued ones in the order they will run."""
        with self._lock:
            items = sorted(self._requests.values(), key=lambda r: (not r.running, r.seq))
        out = []
        ahead = sum(r.running for r in items)
        for r in items:
            out.append(
                nnd_pb2.RequestInFlight(
                    kind=r.kind,
                    client=r.client,
                    state=("paused" if r.paused_since else "running") if r.running else "queued",
                    since=r.since,
                    paused_since=r.paused_since,
                    step=r.step,
                    steps=r.steps,
                    position=0 if r.running else ahead,
                )
            )
            if not r.running:
                ahead += 1
        return out
