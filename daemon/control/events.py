"""What the daemon counts as it happens, for the metrics (control/metrics.py renders them):
worker deaths and restarts, helper calls, refusals the daemon made itself, dispatches and
releases, and the request counts of workers that have ended. No Prometheus import here: the
registry keeps these whether or not metrics are served."""

from __future__ import annotations

import threading
from typing import Any

from nnd.v1 import worker_pb2
from nnd_daemon import errors


class Events:
    """Counts the daemon keeps as things happen (label tuple -> count), read by the collector."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.worker_deaths: dict[tuple[str, ...], int] = {}
        self.worker_restarts: dict[tuple[str, ...], int] = {}
        self.helper_calls: dict[tuple[str, ...], int] = {}
        self.helper_kills: dict[tuple[str, ...], int] = {}
        self.refusals: dict[tuple[str, ...], int] = {}
        self.dispatches: dict[tuple[str, ...], int] = {}
        self.releases: dict[tuple[str, ...], int] = {}
        # What ended workers had counted, per model (their last Status), added to the live figures.
        self.retired: dict[str, worker_pb2.WorkerStats] = {}

    def count(self, table: dict[tuple[str, ...], int], *labels: str) -> None:
        with self._lock:
            table[labels] = table.get(labels, 0) + 1

    def snapshot(self, table: dict[tuple[str, ...], int]) -> dict[tuple[str, ...], int]:
        with self._lock:
            return dict(table)

    def retire(self, model: str, status: worker_pb2.WorkerStatus | None) -> None:
        """Keep what an ending worker counted (its last Status) in its model's totals."""
        if status is None or not status.HasField("stats"):
            return
        with self._lock:
            self.retired[model] = add_stats(self.retired.get(model), status.stats)

    def retired_stats(self, model: str) -> worker_pb2.WorkerStats | None:
        with self._lock:
            return self.retired.get(model)

    def on_error(self, method: str, err: errors.NndError) -> None:
        """The daemon's ErrorInterceptor hook: a refusal the daemon made itself. Errors a worker
        answered arrive as plain NndError (errors.relayed): the worker counted those."""
        if isinstance(err, errors.ResourceExhausted):
            self.count(self.refusals, errors.limit_name(err.message))


def add_stats(base: worker_pb2.WorkerStats | None, more: worker_pb2.WorkerStats) -> worker_pb2.WorkerStats:
    """The sum of two workers' counts."""
    out = worker_pb2.WorkerStats()
    if base is not None:
        out.CopyFrom(base)
    counts = {(r.kind, r.status): r for r in out.requests}
    for r in more.requests:
        if (r.kind, r.status) in counts:
            counts[(r.kind, r.status)].count += r.count
        else:
            out.requests.add().CopyFrom(r)
    kinds = {k.kind: k for k in out.latency}
    for k in more.latency:
        if k.kind not in kinds:
            out.latency.add().CopyFrom(k)
            continue
        for mine, theirs in ((kinds[k.kind].queue_wait, k.queue_wait), (kinds[k.kind].run, k.run)):
            if list(mine.bounds) != list(theirs.bounds):
                mine.CopyFrom(theirs)  # other buckets (another version): keep the newer
                continue
            for i, n in enumerate(theirs.counts):
                mine.counts[i] += n
            mine.sum += theirs.sum
            mine.count += theirs.count
    out.tokens_generated += more.tokens_generated
    for limit, n in more.refusals.items():
        out.refusals[limit] = out.refusals.get(limit, 0) + n
    return out


def count_helper_calls(helper: Any, events: Events) -> Any:
    """Count each of `helper`'s calls by method and status (nnd_helper_calls_total): its `call` is
    wrapped on the instance, so the helper's own convenience methods (describe, ...) count too."""
    inner = helper.call

    def call(method: str, request: Any, **kw: Any) -> Any:
        try:
            out = inner(method, request, **kw)
        except errors.NndError as exc:
            events.count(events.helper_calls, method, exc.code.name.lower())
            raise
        events.count(events.helper_calls, method, "ok")
        return out

    helper.call = call
    return helper
