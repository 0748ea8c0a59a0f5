"""When a request must end: its client cancelled or went away, or its deadline passed.

A deadline used to be a `threading.Timer` per request: a thread started for
every trace (0.45 ms median here, several ms while a forward holds the
cores) only to set a flag that nothing reads before the next hook anyway.
`Stop` keeps the deadline as a point in time instead, and whoever already
asks "should this request stop?" compares the clock: the engine at each hook
and generation step, a queued request in its wait for the model (a wait with
a timeout), a paused run in its wait for the client's next message. No
thread is created per request, and each place that can end a request ends it
as soon as it would have with the timer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Stop:
    """A request's end: `set()` by a cancellation, or by its deadline as soon as anyone asks."""

    def __init__(self, deadline_s: float | None = None) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._wakers: list[Callable[[], None]] = []
        # Monotonic time the request must end by (None: no deadline of the daemon's).
        self.at = time.monotonic() + deadline_s if deadline_s and deadline_s > 0 else None
        self.expired = False  # it ended because its deadline passed, not because its client left

    def set(self) -> None:
        with self._lock:
            self._event.set()
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            wake()

    def is_set(self) -> bool:
        if self._event.is_set():
            return True
        if self.at is not None and time.monotonic() >= self.at:
            self.expired = True
            self.set()
            return True
        return False

    def remaining(self) -> float | None:
        """Seconds to the deadline (never below 0); None without one."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def on_set(self, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake` (once) when a cancellation sets this; returns a function that forgets it."""
        with self._lock:
            if not self._event.is_set():
                self._wakers.append(wake)
                return lambda: self._forget(wake)
        wake()
        return lambda: None

    def _forget(self, wake: Callable[[], None]) -> None:
        with self._lock:
            if wake in self._wakers:
                self._wakers.remove(wake)
