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

from nnd.v1 import nnd_pb2


@dataclass
class Request:
    seq: int
    kind: str
    client: str
    since: float
    steps: int = 0
    step: int = 0
    running: bool = False


class Activity:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._requests: dict[int, Request] = {}
        self.idle_since = 0.0

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
                    state="running" if r.running else "queued",
                    since=r.since,
                    step=r.step,
                    steps=r.steps,
                    position=0 if r.running else ahead,
                )
            )
            if not r.running:
                ahead += 1
        return out
