"""What a worker is doing now: its requests in flight and since when it has been idle.

The worker is the only process that sees every request (clients may reach it
directly), so it keeps this; the daemon reads it through Status for `nnd ps`,
keep-alive and the LRU cap. Queue positions come from the order requests
arrived in, which is the order `turns.Turns` hands the model over.

It also counts what finished (by kind and status, queue wait and run time as
histograms, tokens generated, refusals by limit) for the daemon's metrics: the
daemon never parses the traffic that reaches a worker directly.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from nnd.v1 import nnd_pb2, worker_pb2
from nnd_daemon import errors

log = logging.getLogger("nnd.requests")

# How long Status waits for the bookkeeping of calls whose answer went out before it was done.
SETTLE_S = 1.0

# Histogram bucket bounds, seconds: from a small trace's few ms to a long generation's minutes.
BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class Request:
    seq: int
    kind: str
    client: str
    since: float
    steps: int = 0
    step: int = 0
    user: str = ""
    paused_since: float = 0.0  # unix time it paused at a sync point (0: not paused)
    # Rows generated per step (a Generate's invokes), for the tokens count.
    rows: int = 1
    started: float = 0.0

    @property
    def running(self) -> bool:
        return bool(self.started)

    @running.setter
    def running(self, value: bool) -> None:
        self.started = (self.started or time.time()) if value else 0.0


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * len(BOUNDS)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.sum += seconds
        self.count += 1
        for i, bound in enumerate(BOUNDS):
            if seconds <= bound:
                self.counts[i] += 1

    def fill(self, out: worker_pb2.Histogram) -> None:
        out.bounds.extend(BOUNDS)
        out.counts.extend(self.counts)
        out.sum, out.count = self.sum, self.count


def status_of(exc: BaseException | None) -> str:
    """A finished request's status label: "ok", or its gRPC status in lower case."""
    if exc is None:
        return "ok"
    if isinstance(exc, GeneratorExit):
        return "cancelled"  # the call ended under it: the client went away
    code = getattr(exc, "code", None)
    name = getattr(code, "name", None)
    return name.lower() if isinstance(name, str) else "internal"


class Activity:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._requests: dict[int, Request] = {}
        self.idle_since = 0.0
        # The data path's admissions (gateway.py): requests in, counted against the queue depth.
        self.active = 0
        self.accepted = 0
        self.keep_alive = ""
        self.log_requests = False
        self.model = ""
        # Per user: requests in (for the queue share, `max_queue_share`).
        self._by_user: dict[str, int] = {}
        self._counts: dict[tuple[str, str], int] = {}
        self._waits: dict[str, _Histogram] = {}
        self._runs: dict[str, _Histogram] = {}
        self._tokens = 0
        self._refusals: dict[str, int] = {}
        # Calls answered before their bookkeeping ran (`hold_status`): Status waits for those open when it
        # starts, so a client that reads it after its answer sees its request counted and gone, as when
        # the answer came last (and a steady stream of later answers cannot hold Status up).
        self._answering: set[int] = set()
        self._answer_ids = itertools.count()
        self._settled = threading.Condition(self._lock)

    def hold_status(self) -> Callable[[], None]:
        """A call's answer goes out before its bookkeeping: a Status that starts before the returned
        function is called waits for it."""
        with self._lock:
            token = next(self._answer_ids)
            self._answering.add(token)

        def release() -> None:
            with self._lock:
                self._answering.discard(token)
                self._settled.notify_all()

        return release

    def _wait_settled(self) -> None:
        """Under the lock: until the calls answered before now are accounted (bounded: a thread that
        died mid-bookkeeping must not stop Status)."""
        if self._answering:
            pending = set(self._answering)
            self._settled.wait_for(lambda: not (pending & self._answering), timeout=SETTLE_S)

    def begin(self, keep_alive: str, depth: int, model: str, user: str = "", share: float = 0.0) -> None:
        """Count a request in; RESOURCE_EXHAUSTED if `depth` (0: no limit) are already in, or if
        `user` already holds `share` of them (a known user only)."""
        with self._lock:
            if depth and self.active >= depth:
                raise errors.ResourceExhausted(f"the queue of {model} is full (max_queue_depth={depth})")
            mine = self._by_user.get(user, 0)
            if user and depth and share and mine >= max(1, int(depth * share)):
                raise errors.ResourceExhausted(
                    f"{user} has {mine} requests in the queue of {model}, its share of it "
                    f"(max_queue_share={share:g} of max_queue_depth={depth}); wait for one to finish"
                )
            self.active += 1
            self.accepted += 1
            self._by_user[user] = mine + 1
            if keep_alive:
                self.keep_alive = keep_alive

    def end(self, user: str = "") -> None:
        with self._lock:
            self.active -= 1
            left = self._by_user.get(user, 1) - 1
            if left > 0:
                self._by_user[user] = left
            else:
                self._by_user.pop(user, None)
            if not self.active and not self._requests:
                self.idle_since = time.time()

    def refused(self, kind: str, exc: errors.NndError, user: str = "", client: str = "") -> None:
        """A request refused before it was counted in (over a limit, malformed...)."""
        status = status_of(exc)
        if self.log_requests:
            log.info(
                "%s by %s (%s): refused, %s: %s", kind, user or "?", client, status, exc.message[:200],
                extra={"nnd": {"event": "request", "model": self.model, "kind": kind, "user": user,
                               "client": client, "status": status}},
            )
        with self._lock:
            self._counts[(kind, status)] = self._counts.get((kind, status), 0) + 1
            if isinstance(exc, errors.ResourceExhausted):
                limit = errors.limit_name(exc.message)
                self._refusals[limit] = self._refusals.get(limit, 0) + 1

    def _finished(self, req: Request, exc: BaseException | None) -> None:
        """Called under the lock as a tracked request ends."""
        now = time.time()
        status = status_of(exc)
        self._counts[(req.kind, status)] = self._counts.get((req.kind, status), 0) + 1
        wait = (req.started or now) - req.since
        run = now - req.started if req.started else 0.0
        self._waits.setdefault(req.kind, _Histogram()).observe(max(0.0, wait))
        if req.started:
            self._runs.setdefault(req.kind, _Histogram()).observe(max(0.0, run))
        if req.kind == "generate":
            self._tokens += req.step * max(1, req.rows)
        if self.log_requests:
            log.info(
                "%s by %s (%s): %s, queued %.3f s, ran %.3f s%s",  # (the line's prefix names the model)
                req.kind, req.user or "?", req.client, status, wait, run,
                f", {req.step} steps" if req.steps else "",
                extra={"nnd": {"event": "request", "model": self.model, "kind": req.kind, "user": req.user,
                               "client": req.client, "status": status, "queue_wait_s": round(wait, 6),
                               "run_s": round(run, 6)}},
            )

    def fill(self, status: worker_pb2.WorkerStatus) -> None:
        """Status's activity fields: what runs and waits, counts, and idle time."""
        status.requests.extend(self.snapshot())  # (after the calls answered before it are accounted)
        with self._lock:
            status.active = self.active
            status.accepted = self.accepted
            status.keep_alive = self.keep_alive
            status.idle_since = self.idle_since
            stats = status.stats
            for (kind, state), n in sorted(self._counts.items()):
                stats.requests.add(kind=kind, status=state, count=n)
            for kind in sorted(set(self._waits) | set(self._runs)):
                lat = stats.latency.add(kind=kind)
                self._waits.get(kind, _Histogram()).fill(lat.queue_wait)
                self._runs.get(kind, _Histogram()).fill(lat.run)
            stats.tokens_generated = self._tokens
            stats.refusals.update(self._refusals)

    @contextlib.contextmanager
    def track(
        self, kind: str, client: str, steps: int = 0, *, user: str = "", rows: int = 1, since: float = 0.0
    ) -> Iterator[Request]:
        req = Request(next(self._seq), kind, client, since or time.time(), steps, user=user, rows=rows)
        with self._lock:
            self._requests[req.seq] = req
        failure: BaseException | None = None
        try:
            yield req
        except BaseException as exc:
            failure = exc
            raise
        finally:
            with self._lock:
                del self._requests[req.seq]
                self._finished(req, failure)
                if not self._requests:
                    self.idle_since = time.time()

    def snapshot(self) -> list[nnd_pb2.RequestInFlight]:
        """Running requests first, then the queued ones in the order they will run."""
        with self._lock:
            self._wait_settled()
            items = sorted(self._requests.values(), key=lambda r: (not r.running, r.seq))
        out = []
        ahead = sum(r.running for r in items)
        for r in items:
            out.append(
                nnd_pb2.RequestInFlight(
                    kind=r.kind,
                    client=r.client,
                    state=("paused" if r.paused_since else "running") if r.running else "queued",
                    since=r.since,
                    paused_since=r.paused_since,
                    step=r.step,
                    steps=r.steps,
                    position=0 if r.running else ahead,
                    user=r.user,
                )
            )
            if not r.running:
                ahead += 1
        return out
