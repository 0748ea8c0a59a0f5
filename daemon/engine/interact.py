"""Sync points: a run the client steers while it runs (Nnd.Interact).

The forward runs on its own thread. Once every value the client asked for
exists, the executor sends them and blocks here until the client's next
message: more nodes (attached to hooks the forward has not passed yet) and
what to send next, or `finish`. A run that waits longer than its pause
timeout, or whose client went away, is cancelled where it stands.

In a session, a message may bring the session's next traces: the trace
running now then runs to its end, and the pauses asked for apply to the last
new one (`advance`, when the session starts it). Such a message carries the
graphs of the stored edits its traces name (WorkerInteractContinue.edits),
added to `edits`, the table the run looks edits up in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nnd.v1 import graph_pb2, nnd_pb2, worker_pb2

from .. import errors

DEFAULT_PAUSE_TIMEOUT_S = 60.0
# What `receive` returns when the client is gone (stream closed without `finish`, or cancelled).
GONE: Any = object()

# Blocks up to the timeout; WorkerInteractContinue (or a bare InteractContinue), GONE, None on timeout,
# or an NndError (a bad later message).
Receive = Callable[[float], Any]


class Interaction:
    def __init__(self, start: nnd_pb2.InteractStart, receive: Receive) -> None:
        self.start = start  # as the client sent it (a tensor-parallel rank 0 passes it on)
        self.want: list[int] = list(start.want)
        self.finished = start.finish or not start.want
        self.timeout = start.pause_timeout_s if start.pause_timeout_s > 0 else DEFAULT_PAUSE_TIMEOUT_S
        self.receive = receive
        # The node whose value the last pause sent: an out-of-order error names its line.
        self.paused_at: graph_pb2.Node | None = None
        # A session's traces the client sent that have not started, and what to do in the last of them.
        self.next_traces: list[nnd_pb2.SessionTrace] = []
        self._later: tuple[list[int], bool] = ([], True)
        # Stored edits by id: the run's (run_worker sets it), and those later messages bring.
        self.edits: dict[str, worker_pb2.EditStack] = {}

    def due(self, has: Callable[[int], bool]) -> bool:
        """Whether every wanted value exists (time to pause)."""
        return bool(self.want) and all(has(i) for i in self.want)

    def wait(self) -> nnd_pb2.InteractContinue:
        """The client's next message; raises when it does not come."""
        msg = self.receive(self.timeout)
        if msg is None:
            raise errors.DeadlineExceeded(
                f"the run was paused at a sync point for more than {self.timeout:g} s without a message from "
                "the client; it was cancelled and the model freed (raise `pause_timeout` for longer pauses)"
            )
        if msg is GONE:
            raise errors.Cancelled("the client went away while the run was paused; it was cancelled")
        if isinstance(msg, errors.NndError):
            raise msg
        if isinstance(msg, worker_pb2.WorkerInteractContinue):
            for edit_id, stack in msg.edits.items():
                self.edits[edit_id] = stack
            msg = msg.more
        if msg.traces:
            self.next_traces.extend(msg.traces)
            self._later = (list(msg.want), msg.finish or not msg.want)
            self.want, self.finished = [], True  # the trace running now runs to its end
            return msg
        self.want = list(msg.want)
        self.finished = msg.finish or not msg.want
        return msg

    def advance(self) -> None:
        """The session starts the last of the traces a message brought: its pauses apply now."""
        self.want, self.finished = self._later
        self._later = ([], True)
        self.paused_at = None
