"""One holder at a time, with waiters served by caller in turn: the helper's call lock.

A plain lock wakes its waiters in no particular order, so a client that keeps
230 Scans waiting gets nearly every turn and a bystander's one call waits behind
all of them. `FairGate` keeps one line per caller and, when the holder leaves,
hands over to the first waiter of the caller after the one just served (round
robin): each caller with calls waiting gets a turn before any gets a second,
whatever their counts. A caller's own calls keep their order.

A caller is (identity, client): turns go round the verified identities
(asyncserve.Context.caller), and within one identity round its clients' own
names, so a user who sends fifty `nnd-client` names still gets one turn in
each round, and two notebooks of one user share theirs. A bare string is an
identity with one client.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterator
from contextlib import contextmanager

Line = collections.deque[threading.Event]


def _split(caller: tuple[str, str] | str) -> tuple[str, str]:
    return (caller, "") if isinstance(caller, str) else caller


class FairGate:
    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        # Identity -> its clients -> their waiters in arrival order; each dict's order is its round-robin order.
        self._lines: collections.OrderedDict[str, collections.OrderedDict[str, Line]] = collections.OrderedDict()

    def waiting(self, caller: tuple[str, str] | str | None = None) -> int:
        with self._mutex:
            if caller is None:
                return sum(len(line) for clients in self._lines.values() for line in clients.values())
            who, client = _split(caller)
            clients = self._lines.get(who, {})
            if isinstance(caller, str):
                return sum(len(line) for line in clients.values())
            return len(clients.get(client, ()))

    def acquire(self, caller: tuple[str, str] | str) -> None:
        who, client = _split(caller)
        with self._mutex:
            if not self._held and not self._lines:
                self._held = True
                return
            ticket = threading.Event()
            clients = self._lines.setdefault(who, collections.OrderedDict())
            clients.setdefault(client, collections.deque()).append(ticket)
        ticket.wait()  # ownership is handed over with the event: nobody barges in between

    def release(self) -> None:
        with self._mutex:
            if not self._lines:
                self._held = False
                return
            who, clients = next(iter(self._lines.items()))
            client, line = next(iter(clients.items()))
            ticket = line.popleft()
            del clients[client]
            if line:  # this client's next call waits for its identity's other clients
                clients[client] = line
            del self._lines[who]
            if clients:  # and this identity's next turn waits for every other identity's
                self._lines[who] = clients
            ticket.set()

    @contextmanager
    def held(self, caller: tuple[str, str] | str) -> Iterator[None]:
        self.acquire(caller)
        try:
            yield
        finally:
            self.release()
