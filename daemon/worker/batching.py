"""Cross-client batching: concurrent Trace requests for one model run as ONE forward.

The worker runs one request at a time. While it is busy (and for a short
gathering window, `--batch-window-ms`, when it is idle) compatible Trace
requests pile up; the next one to get the model takes every compatible
request waiting with it, merges them into one `TraceRequest` whose invokes
are all of theirs, runs it once through `engine.run` (the engine's API is
unchanged), and routes the emitted responses back to each request.

Merging
    Each qualifying request is read once into the engine's request object
    (engine/prepared.py: its invokes as token ids, text tokenized here once as
    the engine tokenizes it, and its graph). The batcher merges members with
    `PreparedTrace.concatenate` (which moves each one's node ids, invokes and
    scopes past the others') and routes the merged run's responses back with
    its `split`, the inverse; it never edits a graph itself. Responses are
    held until the merged run has finished, so a failure emits nothing.

Compatibility rule (anything else runs alone, exactly as before)
    - a Trace: not a Generate, Scan or Session; no stored edits; no `shm`;
    - nodes are module values, constants, ops, saves and sets only: no
      skip, stop, backward/grad/set_grad or cache nodes (those act on the
      whole batch or the whole request);
    - every module value (read or written) names an `invoke` (the Python
      client sets invoke=0 for a single-input trace), a module path other
      than "" and a point other than RESULT, and no operation inside a forward
      (`op`, whose value need not hold the batch in dim 0): each value is a view of the
      request's own rows, never of the whole batch;
    - invokes are text or token ids (no tensor args, no keyword inputs), and every invoke of
      every merged request has the same tokenized length, so no request sees
      padding (or other position ids) it would not have had alone; requests
      are grouped by that length;
    - the merged request keeps to `max_invokes`.
    Batch rows are independent in the models nnd serves (attention, MLPs,
    norms work per row), so each request computes what it computes alone, up
    to the floating-point differences a larger matmul may bring (kernels may
    block the work differently by batch size).

The window: a request waits up to `--batch-window-ms` for companions only when
the model is idle and requests have overlapped within the last second; a lone
sequential client never waits, and a busy model gathers by itself. One more
wait: a request that queued behind a busy model and now takes it waits for the
clients of the run that just ended to send their next requests (until as many
are waiting as that run held, or `Batcher.returning_s` passed: the window, or
half the last run when that is longer, at most ten windows). Without it,
clients in a loop split into two cohorts that take turns, each forward carrying
half of them (measured: eight clients, 3.95 a forward). A wait of the window
alone (2 ms) brought back 5.1-5.2 of eight on GPT-2 4x64, whose clients take
longer than that to send again on 2 cores; half a run (4-5 ms there) brings
back 7.7-8.0, and the worker's CPU a trace fell from 2.7 to 2.0-2.2 ms, as each
forward's fixed cost is shared by more requests.

Errors stay apart: if the merged run fails for any reason, each member is run
again alone, so only the faulty one fails and the others get their normal
results. A member cancelled before the merged run starts is dropped from it
(also when the cancellation lands as it is told it has the model: grpc raises
there); one cancelled during the run is not waited on (the run continues for
the others and its results are dropped), unless every member is cancelled.
Whatever a run does, every member it claimed is finished when it ends: the
others wait on that with no timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nnd.v1 import graph_pb2, nnd_pb2, worker_pb2
from nnd_daemon.engine import prepared
from nnd_daemon.worker import turns

log = logging.getLogger("nnd.worker.batching")

Emit = Callable[[Any], None]
# Runs one original request alone (the worker's normal path), emitting into `emit`.
RunAlone = Callable[[worker_pb2.WorkerRunRequest, Emit, Callable[[], bool]], None]

_ALLOWED_KINDS = frozenset({"module", "constant", "op", "save", "set"})
MAX_MEMBERS = 64
_POLL_S = 0.002
# The gathering window applies for this long after requests last overlapped.
_OVERLAP_MEMORY_S = 1.0
# The wait for the last run's clients to come back may last this share of that run (when longer than
# the window), and at most RETURNING_MAX_WINDOWS windows.
RETURNING_SHARE = 0.5
RETURNING_MAX_WINDOWS = 10


def prepare(request: worker_pb2.WorkerRunRequest, tokenizer: Any) -> prepared.PreparedTrace | None:
    """A qualifying request as the engine merges it (one common tokenized length); None if it does not qualify."""
    if request.generate or request.HasField("session") or request.edits:
        return None
    trace = request.request
    if trace.edits or trace.shm or not trace.invokes or trace.HasField("generate"):
        return None
    for node in trace.graph.nodes:
        kind = node.WhichOneof("kind")
        if kind not in _ALLOWED_KINDS:
            return None
        mv = node.module if kind == "module" else node.set.target if kind == "set" else None
        # An operation's value need not have the batch as dim 0 (a flattened token matrix): it runs alone.
        if mv is not None and (not mv.HasField("invoke") or not mv.path or mv.point == graph_pb2.RESULT or mv.op):
            return None
    try:
        found = prepared.PreparedTrace.from_pb(trace, tokenizer)
    except Exception:  # noqa: BLE001 - not text or token ids, or untokenizable: the request alone reports it
        return None
    return found if found.length is not None else None


class _Claim:
    """What a member waiting for the model listens to besides its turn: the end of the run that claimed
    it (it needs no turn then: the model must not pass through its hands on the way to the next request)
    and its request's end (`stop`, worker/stop.py). Turns.acquire takes it as its `stop`.

    A claimed member leaves the model's line at once (`claim`, through Turns' `on_leave`) but its thread
    is woken only when its run is over (`done`): woken at the claim, it only went back to sleep until
    the run ended, and with eight clients those wake-ups were eight GIL hand-offs a forward on the
    worker's one busy core."""

    def __init__(self, stop: Any = None) -> None:
        self.stop = stop
        self._lock = threading.Lock()
        self._wakers: list[Callable[[], None]] = []
        self._leavers: list[Callable[[], None]] = []
        self.claimed = False
        self.over = False

    def claim(self) -> None:
        """Claimed into another member's run: out of the model's line, still asleep."""
        with self._lock:
            self.claimed = True
            leavers, self._leavers = self._leavers, []
        for leave in leavers:
            leave()

    def on_leave(self, leave: Callable[[], None]) -> None:
        with self._lock:
            now = self.claimed
            if not now:
                self._leavers.append(leave)
        if now:
            leave()

    def done(self) -> None:
        """The member's run is over (or it was finished without one): wake its wait for the model."""
        with self._lock:
            self.over = True
            wakers, self._wakers = self._wakers, []
            self._leavers.clear()
        for wake in wakers:
            wake()

    def on_set(self, wake: Callable[[], None]) -> Callable[[], None]:
        with self._lock:
            now = self.over
            if not now:
                self._wakers.append(wake)
        forget_stop = self.stop.on_set(wake) if self.stop is not None else (lambda: None)
        if now:
            wake()

        def forget() -> None:
            with self._lock:
                if wake in self._wakers:
                    self._wakers.remove(wake)
            forget_stop()

        return forget

    def remaining(self) -> float | None:
        return self.stop.remaining() if self.stop is not None else None


@dataclass
class Member:
    """One request waiting to run, and where its responses go."""

    request: worker_pb2.WorkerRunRequest
    trace: prepared.PreparedTrace
    emit: Emit
    cancelled: Callable[[], bool]
    started: Callable[[], None]
    claimed: bool = False
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    buffer: list[Any] = field(default_factory=list)  # its responses of a merged run, until the run ends
    stop: Any = None  # its request's Stop (worker/stop.py), when it has one: its wait ends with it
    answer: Callable[[], None] | None = None  # sends its emitted responses to its client (see _run_group)
    claim: _Claim = field(init=False)

    def __post_init__(self) -> None:
        self.claim = _Claim(self.stop)

    def finish(self) -> None:
        """Its responses are all emitted (or its error set): its thread goes on."""
        self.finished.set()
        self.claim.done()

    @property
    def length(self) -> int | None:
        return self.trace.length


def _tokenized(m: Member) -> worker_pb2.WorkerRunRequest:
    """The member's request with its text invokes replaced by the ids tokenized for it (the same input)."""
    if not any(inv.WhichOneof("input") == "text" for inv in m.request.request.invokes):
        return m.request
    request = worker_pb2.WorkerRunRequest()
    request.CopyFrom(m.request)
    del request.request.invokes[:]
    request.request.invokes.extend(m.trace.invokes_pb())
    return request


class Batcher:
    """Gathers compatible Trace requests and runs them as one; see the module docstring."""

    def __init__(
        self,
        run_lock: threading.Lock,
        run_merged: Callable[[nnd_pb2.TraceRequest, Emit, Callable[[], bool]], None],
        run_alone: RunAlone,
        *,
        window_s: float,
        max_invokes: int = 0,
    ) -> None:
        self.run_lock = run_lock
        self.run_merged = run_merged
        self.run_alone = run_alone
        self.window_s = window_s
        self.max_invokes = max_invokes
        self._cond = threading.Condition()
        self._pending: list[Member] = []
        self._overlap_at = -1e9  # when a request last arrived while another was in the worker
        # How many requests the next run may expect: those waiting when the last run ended, and that run's
        # (their clients may come back).
        self._expect = 0
        self._last_run_s = 0.0  # how long the last run took (wall), which bounds the wait for its clients
        # Counters (read by tests through the log and by status reports).
        self.merged_runs = 0
        self.merged_requests = 0

    def submit(self, member: Member) -> None:
        """Run `member` (alone or merged with others); returns when its responses are all emitted."""
        with self._cond:
            now = time.monotonic()
            busy = self.run_lock.locked()
            if busy or self._pending:
                self._overlap_at = now
            self._pending.append(member)
            if len(self._pending) >= self._expect:
                # A leader waiting for the last run's clients (`_await_returning`) goes on now. Waking it
                # at every arrival only put it back to sleep (a GIL hand-off each, mid-gathering).
                self._cond.notify_all()
            # Gather only when requests have lately overlapped and the model is idle: a busy model
            # gathers by itself (whoever takes it next takes every compatible waiting request),
            # and a lone sequential client never waits.
            gather = self.window_s > 0 and not busy and now - self._overlap_at < _OVERLAP_MEMORY_S
            # When the last run's clients are known to be coming back, the wait for them (below, with
            # the model taken) is the gathering: it ends as soon as they are here.
            nap = gather and self._expect <= 1
        if nap:
            time.sleep(self.window_s)
        while True:
            with self._cond:
                if member.claimed:
                    break
                if member.cancelled():  # cancelled or past its deadline while waiting: leave the line now
                    self._pending.remove(member)
                    from nnd_daemon import errors

                    raise errors.Cancelled("request cancelled before it ran")
            # Woken at once when the run that claimed this one is over (then `finished` is set, below)
            # or its request ends; the timeout only bounds how late a cancellation without a Stop is seen.
            if not self._take_turn(member):
                continue
            group: list[Member] = []
            try:
                with self._cond:
                    if member.claimed:
                        break
                    if self.window_s > 0 and (busy or gather):
                        self._await_returning()
                    group = self._claim(member)
                began = time.monotonic()
                self._run_group(group)
                self._last_run_s = time.monotonic() - began
            finally:
                try:
                    if group:
                        with self._cond:
                            self._expect = min(MAX_MEMBERS, len(self._pending) + len(group))
                    # Every claimed member waits on `finished` with no timeout: whatever happened in this
                    # run, none of them may be left waiting (a liveness guarantee, not error handling).
                    # Before the model is let go, so that none is still in line for it (`_Claim`).
                    _finish_all(group)
                finally:
                    self.run_lock.release()
            break
        member.finished.wait()
        if member.error is not None:
            raise member.error

    def _nothing_to_merge(self) -> bool:
        """The model idle, no request waiting, none overlapping lately: this request would run alone at
        once (`submit` would not gather), so it skips being prepared for a merge (its tokenizing, a copy
        of the request: ~0.1 ms a trace on 2 cores). One arriving while it runs sees the model busy."""
        with self._cond:
            if self._pending or self.run_lock.locked():
                return False
            return time.monotonic() - self._overlap_at >= _OVERLAP_MEMORY_S

    def _await_returning(self) -> None:
        """Hold the model for the clients of the run that just ended: until as many requests wait as that
        run held besides those waiting when it ended (under the condition), or `returning_s` passed."""
        self._cond.wait_for(lambda: len(self._pending) >= self._expect, self.returning_s())

    def returning_s(self) -> float:
        """How long a run may wait for the last run's clients: the window, or half that run when longer
        (at most RETURNING_MAX_WINDOWS windows). A client's way back (its results written, read and
        decoded, its next block recorded, sent and checked) takes a few ms whatever the model; a wait
        sized to the forward costs a bounded share of it, and each client it brings back shares the
        forward's fixed cost instead of paying one of its own."""
        share = min(RETURNING_SHARE * self._last_run_s, RETURNING_MAX_WINDOWS * self.window_s)
        return max(self.window_s, share)

    def _take_turn(self, member: Member) -> bool:
        """Wait for the model (a worker's Turns: also woken when `member` is claimed or its request ends)."""
        if not isinstance(self.run_lock, turns.Turns):  # a plain lock (tests): poll
            return self.run_lock.acquire(timeout=_POLL_S * 5)
        return self.run_lock.acquire(timeout=_POLL_S * 5 if member.stop is None else 1.0, stop=member.claim)

    def _claim(self, leader: Member) -> list[Member]:
        """Take the leader and every compatible pending member off the queue (under the condition)."""
        group: list[Member] = []
        invokes = 0
        for m in list(self._pending):
            if m is not leader and (m.length != leader.length or len(group) >= MAX_MEMBERS):
                continue
            n = len(m.trace.tokens)
            if m is not leader and self.max_invokes and invokes + n > self.max_invokes:
                continue
            group.append(m)
            invokes += n
            m.claimed = True
            self._pending.remove(m)
            if m is not leader:
                m.claim.claim()  # out of the model's line; its thread sleeps on until the run is over
        return group

    def _run_group(self, group: list[Member]) -> None:
        live = []
        for m in group:
            if m.cancelled():
                self._alone(m)  # reports the cancellation as a request alone would
            else:
                live.append(m)
        if len(live) == 1:
            self._alone(live[0])
            return
        if not live:
            return
        # `started` answers the member's RPC (initial metadata), and raises if the client cancelled it
        # after the check above: that member alone is done (cancelled); the others still run.
        live = [m for m in live if self._start(m)]
        if len(live) == 1:
            self._alone(live[0], started=True)
            return
        if not live:
            return
        try:
            merged = prepared.PreparedTrace.concatenate([m.trace for m in live])
        except prepared.Unmergeable:
            for m in live:
                self._alone(m, started=True)
            return
        split = merged.split()

        def route(response: nnd_pb2.TraceResponse) -> None:
            for part, routed in split(response):
                live[part].buffer.append(routed)

        try:
            self.run_merged(merged.to_pb(), route, lambda: all(m.cancelled() for m in live))
        except BaseException as exc:  # noqa: BLE001 - each member is rerun alone
            log.info("batched run of %d requests failed (%s); running each alone", len(live), type(exc).__name__)
            for m in live:
                m.buffer.clear()
                self._alone(m, started=True)
            return
        self.merged_runs += 1
        self.merged_requests += len(live)
        log.info(
            "batched %d requests (%d invokes) in one forward [runs=%d requests=%d]",
            len(live),
            len(merged.tokens),
            self.merged_runs,
            self.merged_requests,
        )
        for m in live:
            try:
                for response in m.buffer:
                    m.emit(response)
                if m.answer is not None:
                    # Answered from this thread, which holds the GIL: woken to answer, the members
                    # took the GIL in turns, each hand-off a context switch with the answers waiting.
                    m.answer()
            except BaseException as exc:  # noqa: BLE001 - reported to that member only
                m.error = exc
            m.buffer.clear()
        # Woken only once every answer is out: a member woken earlier unwinds on the GIL between this
        # thread's writes, and the clients answered after it wait for that.
        for m in live:
            m.finish()

    @staticmethod
    def _start(m: Member) -> bool:
        """Tell `m`'s client it has the model; False (and `m` finished, cancelled) if it has left."""
        from nnd_daemon import errors

        try:
            m.started()
        except BaseException as exc:  # noqa: BLE001 - reported to that member only
            m.error = exc if isinstance(exc, errors.NndError) else errors.Cancelled("request cancelled before it ran")
            m.finish()
            return False
        return True

    def _alone(self, m: Member, *, started: bool = False) -> None:
        from nnd_daemon import errors

        try:
            if m.cancelled():
                raise errors.Cancelled("request cancelled before it ran")
            if not started:
                m.started()
            self.run_alone(_tokenized(m), m.emit, m.cancelled)
        except BaseException as exc:  # noqa: BLE001 - reported to that member only
            m.error = exc
        m.finish()

    def offer(
        self,
        request: worker_pb2.WorkerRunRequest,
        tokenizer: Any,
        emit: Emit,
        cancelled: Callable[[], bool],
        started: Callable[[], None],
        stop: Any = None,
        answer: Callable[[], None] | None = None,
    ) -> bool:
        """Run `request` through the batcher if it qualifies (True: done, its error raised); False: not taken.
        `stop`: the request's Stop (worker/stop.py), whose end also ends its wait for the model."""
        if self._nothing_to_merge():
            return False
        trace = prepare(request, tokenizer)
        if trace is None:
            return False
        self.submit(Member(request, trace, emit, cancelled, started, stop=stop, answer=answer))
        return True


def _finish_all(group: list[Member]) -> None:
    """Finish every member of a run that is not finished yet, with an error saying so."""
    from nnd_daemon import errors

    for m in group:
        if not m.finished.is_set():
            if m.error is None:
                m.error = errors.NndError("internal error in worker: a batched run ended without running this request")
            m.finish()


def for_service(service: Any, window_ms: float, max_invokes: int = 0) -> Batcher:
    """A batcher for a WorkerService: merged runs go through `engine.run`, lone ones through its `_execute`.
    `max_invokes`: the daemon's request limit (requests.check), which a merged request keeps to as well."""

    def run_merged(merged: nnd_pb2.TraceRequest, emit: Emit, cancelled: Callable[[], bool]) -> None:
        from nnd_daemon import engine

        engine.run(
            service.model,
            service.tokenizer,
            merged,
            mode="trace",
            emit=emit,
            cancelled=cancelled,
            limits=service.limits,
        )

    return Batcher(service._run_lock, run_merged, service._execute, window_s=window_ms / 1000, max_invokes=max_invokes)
