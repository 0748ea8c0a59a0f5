"""Sync points: a run the client steers while it runs (Nnd.Interact).

The forward runs on its own thread. Once every value the client asked for
exists, the executor sends them and blocks here until the client's next
message: more nodes (attached to hooks the forward has not passed yet) and
what to send next, or `finish`. A run that waits longer than its pause
timeout, or whose client went away, is cancelled where it stands.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nnd.v1 import graph_pb2, nnd_pb2

from .. import errors

DEFAULT_PAUSE_TIMEOUT_S = 60.0
# What `receive` returns when the client is gone (stream closed without `finish`, or cancelled).
GONE: Any = object()

Receive = Callable[[float], Any]  # blocks up to the timeout; InteractContinue, GONE, or None on timeout


class Interaction:
    def __init__(self, start: nnd_pb2.InteractStart, receive: Receive) -> None:
        self.want: list[int] = list(start.want)
        self.finished = start.finish or not start.want
        self.timeout = start.pause_timeout_s if start.pause_timeout_s > 0 else DEFAULT_PAUSE_TIMEOUT_S
        self.receive = receive
        # The node whose value the last pause sent: an out-of-order error names its line.
        self.paused_at: graph_pb2.Node | None = None

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
        self.want = list(msg.want)
        self.finished = msg.finish or not msg.want
        return msg
