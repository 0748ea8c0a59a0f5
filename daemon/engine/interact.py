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

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nnd.v1 import graph_pb2, nnd_pb2, worker_pb2

from .. import errors

DEFAULT_PAUSE_TIMEOUT_S = 60.0
# Tensor dtypes whose one element goes as a number (Value float, int or bool hold every value of them exactly).
_NUMBERS = frozenset({
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
})
# What `receive` returns when the client is gone (stream closed without `finish`, or cancelled).
GONE: Any = object()

# Blocks up to the timeout; WorkerInteractContinue (or a bare InteractContinue), GONE, None on timeout,
# or an NndError (a bad later message).
Receive = Callable[[float], Any]


@dataclass(frozen=True)
class PauseCaps:
    """The server's bounds on a paused run (a paused run holds its model; other clients wait on it).
    `max_pause_s`: one pause, whatever the client asked; `max_paused_total_s`: all of one request's
    pauses together; `remaining`: seconds to the request's deadline (None: none). 0: no cap."""

    max_pause_s: float = 0.0
    max_paused_total_s: float = 0.0
    remaining: Callable[[], float | None] = lambda: None
    deadline_s: float = 0.0  # the deadline's length, for the message


class Interaction:
    def __init__(
        self,
        start: nnd_pb2.InteractStart,
        receive: Receive,
        caps: PauseCaps | None = None,
        on_pause: Callable[[float], None] = lambda since: None,
    ) -> None:
        self.start = start  # as the client sent it (a tensor-parallel rank 0 passes it on)
        self.want: list[int] = list(start.want)
        # Of `want`, the values the client reads as one number (`.item()`, `bool(...)`): see `sent_as`.
        self.items: frozenset[int] = frozenset(start.items)
        self.finished = start.finish or not start.want
        self.timeout = start.pause_timeout_s if start.pause_timeout_s > 0 else DEFAULT_PAUSE_TIMEOUT_S
        self.receive = receive
        self.caps = caps or PauseCaps()
        # Called with the monotonic time a pause began, and with 0 when it ends (`nnd ps`, waiting clients).
        self.on_pause = on_pause
        self.paused_s = 0.0  # time spent paused so far, all pauses (max_paused_total_s)
        # Bytes of saved values sent so far, all pauses (max_saved_bytes holds for the whole request).
        self.saved_bytes = 0
        # The node whose value the last pause sent: an out-of-order error names its line.
        self.paused_at: graph_pb2.Node | None = None
        # A session's traces the client sent that have not started, and what to do in the last of them.
        self.next_traces: list[nnd_pb2.SessionTrace] = []
        self._later: tuple[list[int], bool, frozenset[int]] = ([], True, frozenset())
        # Stored edits by id: the run's (run_worker sets it), and those later messages bring.
        self.edits: dict[str, worker_pb2.EditStack] = {}

    def sent_as(self, node_id: int, value: Any) -> Any:
        """What a pause sends for `value`, node `node_id`'s: a tensor of one element the client reads as one
        number goes as that number (`.item()` here: the client decodes no tensor and calls nothing);
        anything else, a dtype the wire has no number for included, as it is."""
        if node_id in self.items and isinstance(value, torch.Tensor) and value.dtype in _NUMBERS and value.numel() == 1:
            return value.item()
        return value

    def due(self, has: Callable[[int], bool]) -> bool:
        """Whether every wanted value exists (time to pause)."""
        return bool(self.want) and all(has(i) for i in self.want)

    def bound(self) -> tuple[float, str]:
        """How long the next pause may last, and which bound that is ("client", "pause", "total", "deadline")."""
        caps = self.caps
        bounds = [(self.timeout, "client")]
        if caps.max_pause_s > 0:
            bounds.append((caps.max_pause_s, "pause"))
        if caps.max_paused_total_s > 0:
            bounds.append((caps.max_paused_total_s - self.paused_s, "total"))
        left = caps.remaining()
        if left is not None:
            bounds.append((left, "deadline"))
        seconds, which = min(bounds, key=lambda b: b[0])
        return max(0.0, seconds), which

    def wait(self) -> nnd_pb2.InteractContinue:
        """The client's next message; raises when it does not come within the pause's bound."""
        seconds, which = self.bound()
        began = time.monotonic()
        self.on_pause(began)
        try:
            msg = self.receive(seconds)  # even at 0: a tensor-parallel rank 0 relays what ended the wait
        finally:
            self.paused_s += time.monotonic() - began
            self.on_pause(0.0)
        if msg is None:
            raise self._expired(which)
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
            self._later = (list(msg.want), msg.finish or not msg.want, frozenset(msg.items))
            self.want, self.finished = [], True  # the trace running now runs to its end
            return msg
        self.want = list(msg.want)
        self.items = frozenset(msg.items)
        self.finished = msg.finish or not msg.want
        return msg

    def _expired(self, which: str) -> errors.NndError:
        freed = "it was cancelled and the model freed"
        if which == "pause":
            return errors.DeadlineExceeded(
                f"the run was paused at a sync point for {self.caps.max_pause_s:g} s without a message from the "
                f"client, the daemon's cap on one pause (nnd serve --max-pause: a paused run holds the model for "
                f"every other client); {freed}. Compute what the block needs between sync points sooner, or ask "
                "for a longer --max-pause"
            )
        if which == "total":
            return errors.DeadlineExceeded(
                f"the request spent {self.caps.max_paused_total_s:g} s paused at its sync points in all, the "
                f"daemon's budget per request (nnd serve --max-paused-total); {freed}. Use fewer sync points "
                "(save values and read them after the block), or split the work into several blocks"
            )
        if which == "deadline":
            return errors.DeadlineExceeded(
                f"the request reached its deadline ({self.caps.deadline_s:g} s: its timeout, else nnd serve "
                f"--deadline) while paused at a sync point; {freed}"
            )
        return errors.DeadlineExceeded(
            f"the run was paused at a sync point for more than {self.timeout:g} s without a message from "
            f"the client; {freed} (raise the request's `pause_timeout_s`, the Python client's `pause_timeout=`, for longer pauses)"
        )

    def advance(self) -> None:
        """The session starts the last of the traces a message brought: its pauses apply now."""
        self.want, self.finished, self.items = self._later
        self._later = ([], True, frozenset())
        self.paused_at = None
