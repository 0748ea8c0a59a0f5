"""The model's turns: one request at a time, in arrival order, and long ones lend the model between steps.

A worker runs one forward at a time. A plain lock would let a 600-token
generation hold the model for its whole length while a one-step trace from
another notebook waits; and a plain lock's waiters are woken in no particular
order. `Turns` is that lock made fair:

- `acquire`/`release` hand the model over in arrival order (ownership passes
  straight to the first waiter, so nobody can barge in between);
- `lend()` is called by a long request between two of its steps (the engine
  calls it after each generated token): when anyone is waiting it hands the
  model to the first waiter and queues behind everyone waiting at that moment,
  so each of them gets one turn before the generation's next step. With no
  waiter it returns at once, without taking the mutex.

The engine makes a lent turn invisible to the lender (its hooks are
suppressed and its random-number state kept; engine/generation.py), so what a
generation computes does not depend on what ran between its steps.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable
from typing import Any


class _Ticket:
    """A waiter's place in line: `granted` once the model is handed to it, woken either way."""

    __slots__ = ("event", "granted")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.granted = False


class Turns:
    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        self._queue: collections.deque[_Ticket] = collections.deque()
        self.lent = 0  # turns lent so far (tests and `nnd ps` read it)

    def locked(self) -> bool:
        return self._held

    def waiting(self) -> int:
        """Requests waiting for the model now."""
        return len(self._queue)

    def acquire(self, blocking: bool = True, timeout: float = -1, stop: Any = None) -> bool:
        """Take the model, waiting up to `timeout` (None or < 0: no limit). With `stop` (a worker/stop.py
        Stop), a waiter also gives up when its request is cancelled or its deadline passes: no thread
        waits on for a request that has ended."""
        with self._mutex:
            if not self._held and not self._queue:
                self._held = True
                return True
            if not blocking:
                return False
            ticket = _Ticket()
            self._queue.append(ticket)
        limit = None if timeout is None or timeout < 0 else timeout
        forget: Any = None
        if stop is not None and hasattr(stop, "on_set"):  # a bare threading.Event (tests) is only checked after
            forget = stop.on_set(lambda: self._withdraw(ticket))
            if hasattr(stop, "on_leave"):  # out of line without being woken (worker/batching.py's claim)
                stop.on_leave(lambda: self._leave(ticket))
            left = stop.remaining()
            if left is not None:
                limit = left if limit is None else min(limit, left)
        try:
            ticket.event.wait(limit)
        finally:
            if forget is not None:
                forget()
        with self._mutex:
            if ticket.granted:  # handed over (perhaps just as the wait ended): the turn is ours
                return True
            if ticket in self._queue:  # not withdrawn already
                self._queue.remove(ticket)
            return False

    def _withdraw(self, ticket: _Ticket) -> None:
        """`ticket`'s request ended (or needs the model no more) while it waited: out of line now, so the
        model is never handed to a waiter that has gone (it would only pass it on, a wake-up later)."""
        with self._mutex:
            if not ticket.granted and ticket in self._queue:
                self._queue.remove(ticket)
        ticket.event.set()

    def _leave(self, ticket: _Ticket) -> None:
        """`ticket` needs the model no more but its thread sleeps on (it is woken later, by its `stop`)."""
        with self._mutex:
            if not ticket.granted and ticket in self._queue:
                self._queue.remove(ticket)

    def _hand_over(self) -> None:
        # Under the mutex: ownership passes straight to the first waiter; the model never looks free.
        ticket = self._queue.popleft()
        ticket.granted = True
        ticket.event.set()

    def release(self) -> None:
        with self._mutex:
            if self._queue:
                self._hand_over()
            else:
                self._held = False

    def lend(self, around: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext) -> None:
        """Between two steps of a long request (holding the turn): let every current waiter run first.
        `around` is entered just before the model is handed over and left once it is back (the lender
        sets its hooks and random state aside there); with nobody waiting, the usual case, neither
        happens: a generation asks this at every step."""
        if not self._queue:  # a waiter that comes just after this read is let in at the next step
            return
        with contextlib.ExitStack() as lent:
            with self._mutex:
                if not self._queue:
                    return
                lent.enter_context(around())
                ticket = _Ticket()
                self._hand_over()
                self._queue.append(ticket)
                self.lent += 1
            ticket.event.wait()

    def __enter__(self) -> Turns:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()
