"""One holder at a time, with waiters served by client in turn: the helper's call lock.

A plain lock wakes its waiters in no particular order, so a client that keeps
230 Scans waiting gets nearly every turn and a bystander's one call waits behind
all of them. `FairGate` keeps one line per client and, when the holder leaves,
hands over to the first waiter of the client after the one just served (round
robin): each client with calls waiting gets a turn before any client gets a
second, whatever their counts. A client's own calls keep their order.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class FairGate:
    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        # Client -> its waiters in arrival order; the dict's order is the round-robin order.
        self._lines: collections.OrderedDict[str, collections.deque[threading.Event]] = collections.OrderedDict()

    def waiting(self, client: str | None = None) -> int:
        with self._mutex:
            if client is not None:
                return len(self._lines.get(client, ()))
            return sum(len(line) for line in self._lines.values())

    def acquire(self, client: str) -> None:
        with self._mutex:
            if not self._held and not self._lines:
                self._held = True
                return
            ticket = threading.Event()
            self._lines.setdefault(client, collections.deque()).append(ticket)
        ticket.wait()  # ownership is handed over with the event: nobody barges in between

    def release(self) -> None:
        with self._mutex:
            if not self._lines:
                self._held = False
                return
            client, line = next(iter(self._lines.items()))
            ticket = line.popleft()
            del self._lines[client]
            if line:  # this client's next call waits for every other client's turn
                self._lines[client] = line
            ticket.set()

    @contextmanager
    def held(self, client: str) -> Iterator[None]:
        self.acquire(client)
        try:
            yield
        finally:
            self.release()
