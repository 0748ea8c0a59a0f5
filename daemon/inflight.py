"""A process-wide budget of request bytes in flight (`max_inflight_bytes`), one semantics for the
daemon and a worker: Trace/Generate/Session requests and their results are held in the daemon's
memory while it forwards them, and in a worker's while they wait for the model (with the
continuations an Interact stream has sent and its paused run has not read yet), so their sum over
all clients is bounded in each process.

One item is always let through when nothing else is held: a single request is
bounded by the per-request limits (max_request_bytes, max_saved_bytes) instead.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from nnd_daemon import errors


class InflightBudget:
    def __init__(self, limit: int, holder: str = "the daemon") -> None:
        self.limit = limit  # 0: unbounded
        self.holder = holder  # named in the refusal
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        with self._lock:
            return self._held

    def acquire(self, n: int, what: str) -> None:
        with self._lock:
            if self.limit and self._held and self._held + n > self.limit:
                raise errors.ResourceExhausted(
                    f"{what} ({n} bytes) does not fit: {self.holder} holds {self._held} bytes of other requests and "
                    f"results, and its limit is max_inflight_bytes={self.limit}; retry shortly"
                )
            self._held += n

    def release(self, n: int) -> None:
        with self._lock:
            self._held -= n

    @contextlib.contextmanager
    def hold(self, n: int, what: str) -> Iterator[None]:
        self.acquire(n, what)
        try:
            yield
        finally:
            self.release(n)

    def passing(self, chunks: Iterator[bytes], what: str) -> Iterator[bytes]:
        """`chunks`, each counted from when it arrives until the next one is asked for (gRPC took it)."""
        for chunk in chunks:
            with self.hold(len(chunk), what):
                yield chunk
