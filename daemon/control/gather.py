"""Cross-client batching, the daemon's half: gather concurrent Traces of one model into one worker call.

Concurrent Trace requests that may be merged (worker/batching.py `qualifies`)
queue here per worker. One of them at a time leads: it takes every request
waiting (up to batching.MAX_MEMBERS) and sends them to the worker as one
`RunBatch` call, which merges the compatible ones into one forward
(worker/batching.py); then it hands the lead to the oldest request that came
in meanwhile. A lone request goes through the ordinary `Run` call, as it
would without batching. Paying gRPC's per-call cost once per batch (in the
daemon and in the worker) instead of once per client is most of what
batching saves on a small model.

The window: when the worker is idle and requests have overlapped within the
last second, a new leader waits `--batch-window-ms` for companions; a lone
sequential client never waits, and while a batch runs the next one gathers
by itself.

A request whose client goes away (or whose deadline passes) before its batch
is sent leaves the queue; once sent it runs with its batch and its results
are dropped.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from nnd.v1 import worker_pb2
from nnd_daemon import errors

# The gathering window applies for this long after requests last overlapped.
_OVERLAP_MEMORY_S = 1.0
_LEAD = object()  # "you lead the next batch"
_END = object()  # "your results are all here"
_CODES = {code.value[0]: code for code in grpc.StatusCode}

RunAlone = Callable[[worker_pb2.WorkerRunRequest, "float | None", Any], Iterator[bytes]]
CallBatch = Callable[[worker_pb2.WorkerBatchRequest, "float | None"], Iterator[worker_pb2.WorkerBatchResponse]]
Translate = Callable[[grpc.RpcError, "bool | None"], errors.NndError]


@dataclass(eq=False)
class _Waiting:
    request: worker_pb2.WorkerRunRequest
    timeout: float | None
    client: Any  # the caller's gRPC context: cancels a lone request's worker call when it goes away
    inbox: queue.SimpleQueue[Any] = field(default_factory=queue.SimpleQueue)
    taken: bool = False  # sent (or being sent) to the worker
    gone: bool = False  # left the queue before being sent


class Gatherer:
    def __init__(
        self, alone: RunAlone, call_batch: CallBatch, translate: Translate, *, window_s: float, max_batch: int
    ) -> None:
        self._alone = alone
        self._call_batch = call_batch
        self._translate = translate
        self.window_s = window_s
        self.max_batch = max_batch
        self._lock = threading.Lock()
        self._pending: list[_Waiting] = []
        self._busy = False  # a leader is taking or running a batch
        self._overlap_at = -1e9

    def run(self, request: worker_pb2.WorkerRunRequest, *, timeout: float | None, client: Any) -> Iterator[bytes]:
        """The serialized responses to `request`, run alone or in a batch with concurrent ones."""
        me = _Waiting(request, timeout, client)
        with self._lock:
            now = time.monotonic()
            if self._busy:
                self._overlap_at = now
            self._pending.append(me)
            lead = not self._busy
            self._busy = True
            gather = lead and self.window_s > 0 and now - self._overlap_at < _OVERLAP_MEMORY_S
        if client is not None and not client.add_callback(lambda: self._leave(me, "the client went away")):
            self._leave(me, "the client went away")
        if lead:
            if gather:
                time.sleep(self.window_s)
            if (yield from self._lead(me)):
                return
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                wait = None if deadline is None or me.taken else max(0.0, deadline - time.monotonic())
                item = me.inbox.get(timeout=wait)
            except queue.Empty:
                self._leave(me, "its deadline passed while it waited for the model", deadline=True)
                deadline = None
                continue
            if item is _LEAD:
                if (yield from self._lead(me)):
                    return
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _leave(self, me: _Waiting, why: str, *, deadline: bool = False) -> None:
        """Take `me` off the queue if it is still there, and tell its thread."""
        with self._lock:
            if me.taken or me.gone:
                return
            me.gone = True
            self._pending.remove(me)
        kind = errors.DeadlineExceeded if deadline else errors.Cancelled
        me.inbox.put(kind(f"request {why}; none of it ran"))

    def _hand_over(self) -> None:
        with self._lock:
            if self._pending:
                self._pending[0].inbox.put(_LEAD)
            else:
                self._busy = False

    def _lead(self, me: _Waiting) -> Iterator[bytes]:
        """Send the waiting requests; True if `me`'s own responses were yielded here (it ran alone)."""
        with self._lock:
            batch = self._pending[: self.max_batch]
            del self._pending[: len(batch)]
            for w in batch:
                w.taken = True
        if not batch:
            self._hand_over()
            return False
        if len(batch) == 1 and batch[0] is me:
            handed = False
            try:
                for message in self._alone(me.request, me.timeout, me.client):
                    if not handed:  # the worker is done with the model: the next batch may go
                        self._hand_over()
                        handed = True
                    yield message
            finally:
                if not handed:
                    self._hand_over()
            return True
        try:
            self._send(batch)
        finally:
            self._hand_over()
        return False

    def _send(self, batch: list[_Waiting]) -> None:
        """One RunBatch call for `batch`; every member's responses (or error) go to its inbox."""
        if len(batch) == 1:  # its own client left; it still leads this one
            w = batch[0]
            try:
                for message in self._alone(w.request, w.timeout, w.client):
                    w.inbox.put(message)
                w.inbox.put(_END)
            except BaseException as exc:  # noqa: BLE001 - that request's error
                w.inbox.put(exc)
            return
        timeouts = [w.timeout for w in batch]
        timeout = None if None in timeouts else max(t for t in timeouts if t is not None)
        started = False
        failed: set[int] = set()
        try:
            call = self._call_batch(worker_pb2.WorkerBatchRequest(requests=[w.request for w in batch]), timeout)
            for response in call:
                kind = response.WhichOneof("kind")
                if kind == "started":
                    started = True
                elif kind == "response":
                    batch[response.index].inbox.put(response.response)
                elif kind == "failed":
                    failed.add(response.index)
                    batch[response.index].inbox.put(_failure(response.failed))
        except grpc.RpcError as err:
            exc = self._translate(err, started)
            for i, w in enumerate(batch):
                if i not in failed:
                    w.inbox.put(exc)
            return
        except BaseException as exc:  # noqa: BLE001 - every member must hear of it
            for w in batch:
                w.inbox.put(exc)
            raise
        for w in batch:
            w.inbox.put(_END)


def _failure(f: worker_pb2.WorkerFailure) -> errors.NndError:
    err = errors.NndError(f.message, exc_type=f.exc_type)
    err.code = _CODES.get(f.code, grpc.StatusCode.INTERNAL)
    return err
