"""`nnd serve --metrics HOST:PORT`: Prometheus text on /metrics, and /healthz, from a thread of
their own (an HTTP server beside gRPC, never one of its handler threads).

What a scrape reads:
- the workers' own counts (worker/activity.py, through their Status answers): requests by
  kind and status, queue-wait and run-time histograms, tokens generated, refusals by limit.
  Workers serve local clients directly, so only they see every request; the daemon adds a
  worker's last figures to its model's totals when the worker ends, so restarts keep them.
- the registry: model states, weight bytes, worker RSS, queue depth and running requests;
- `Events`, counted by the daemon as things happen: worker deaths and restarts, helper calls
  and kills, refusals the daemon itself made, dispatches and releases.

Scraping asks each dispatched worker for its Status (a short gRPC call to the worker, with a
timeout); it takes no registry lock for longer than a copy, so gRPC handling never waits on it.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from nnd.v1 import nnd_pb2, worker_pb2
from nnd_daemon.control.events import Events, add_stats

log = logging.getLogger("nnd.metrics")

__all__ = ["Collector", "Events", "MetricsServer"]

STATES = {nnd_pb2.META: "meta", nnd_pb2.DISPATCHING: "dispatching", nnd_pb2.DISPATCHED: "dispatched"}


class Collector:
    """Builds every metric family at scrape time from the registry, its workers and `events`."""

    def __init__(self, registry: Any, events: Events) -> None:
        self.registry = registry
        self.events = events

    def describe(self) -> list[Any]:
        return []  # families are built per scrape (models come and go)

    def collect(self) -> Iterator[Any]:
        reg, ev = self.registry, self.events
        requests = CounterMetricFamily(
            "nnd_requests", "Data requests finished or refused, by model, kind and status",
            labels=["model", "kind", "status"],
        )
        wait = HistogramMetricFamily(
            "nnd_request_queue_wait_seconds", "Time from a request's arrival at the worker to its turn on the model",
            labels=["model", "kind"],
        )
        run = HistogramMetricFamily(
            "nnd_request_run_seconds", "Time from a request's turn on the model to its end", labels=["model", "kind"]
        )
        tokens = CounterMetricFamily("nnd_generated_tokens", "Tokens generated (every invoke's row)", labels=["model"])
        queued = GaugeMetricFamily("nnd_queue_depth", "Requests waiting for their turn on the model", labels=["model"])
        running = GaugeMetricFamily("nnd_running_requests", "Requests running on the model now", labels=["model"])
        state = GaugeMetricFamily("nnd_model_state", "1 for the state each loaded model is in", labels=["model", "state"])
        weights = GaugeMetricFamily(
            "nnd_model_weight_bytes", "Bytes of weights a dispatched model holds, per device", labels=["model", "device"]
        )
        rss = GaugeMetricFamily("nnd_worker_rss_bytes", "Resident memory of the model's worker", labels=["model"])
        refusals: dict[str, float] = {k[0]: v for k, v in ev.snapshot(ev.refusals).items()}
        for entry in reg.entries():
            name = entry.name
            status = None
            if entry.state == nnd_pb2.DISPATCHED:
                try:
                    status = reg.activity(entry, ask=True)
                except Exception:  # noqa: BLE001 - a worker that does not answer: its last figures
                    status = entry.worker.last_status if entry.worker is not None else None
            for s in STATES.values():
                state.add_metric([name, s], 1.0 if STATES.get(entry.state) == s else 0.0)
            stats = ev.retired_stats(name)
            if status is not None and status.HasField("stats"):
                stats = add_stats(stats, status.stats)
            if stats is not None:
                for r in stats.requests:
                    requests.add_metric([name, r.kind, r.status], r.count)
                for k in stats.latency:
                    for family, h in ((wait, k.queue_wait), (run, k.run)):
                        if h.count:
                            family.add_metric([name, k.kind], _buckets(h), h.sum)
                tokens.add_metric([name], stats.tokens_generated)
                for limit, n in stats.refusals.items():
                    refusals[limit] = refusals.get(limit, 0) + n
            inflight = list(status.requests) if status is not None else []
            queued.add_metric([name], sum(r.state == "queued" for r in inflight))
            running.add_metric([name], sum(r.state == "running" for r in inflight))
            if status is not None:
                for w in status.weights:
                    weights.add_metric([name, w.device], w.bytes)
                rss.add_metric([name], status.rss_bytes)
        yield from (requests, wait, run, tokens, queued, running, state, weights, rss)
        yield _counter("nnd_refusals", "Requests refused for being over a limit, by the limit", ["limit"],
                       {(k,): v for k, v in refusals.items()})
        yield _counter("nnd_worker_deaths", "Workers that ended without being asked (crash, kill, hung)",
                       ["model"], ev.snapshot(ev.worker_deaths))
        yield _counter("nnd_worker_restarts", "Models re-dispatched after their worker hung", ["model"],
                       ev.snapshot(ev.worker_restarts))
        yield _counter("nnd_dispatches", "Dispatches, by model and outcome", ["model", "status"],
                       ev.snapshot(ev.dispatches))
        yield _counter("nnd_releases", "Workers released, by model and why", ["model", "reason"],
                       ev.snapshot(ev.releases))
        yield _counter("nnd_helper_calls", "Calls to the helper process, by method and status", ["method", "status"],
                       ev.snapshot(ev.helper_calls))
        kills = CounterMetricFamily("nnd_helper_kills", "Helper processes killed (over a limit, or half-dead)")
        kills.add_metric([], getattr(reg.helper, "kills", 0))
        yield kills
        forks = getattr(reg, "forks", None)
        yield GaugeMetricFamily("nnd_forkserver_up", "1 while workers and the helper fork from the fork server, "
                                "0 while they start by exec (turned off, not safe to fork, or it ended)",
                                value=1 if forks is not None and forks.serving else 0)
        forked = CounterMetricFamily("nnd_forked_processes", "Workers and helper processes forked from the fork server")
        forked.add_metric([], forks.forked if forks is not None else 0)
        yield forked
        yield from self._uploads()
        yield from self._gpus()

    def _uploads(self) -> Iterator[Any]:
        count, nbytes = self.registry.uploads.stored()
        yield GaugeMetricFamily("nnd_uploads_stored", "Uploaded models kept in the state directory", value=count)
        yield GaugeMetricFamily("nnd_uploads_stored_bytes", "Bytes of the uploaded models kept", value=nbytes)

    def _gpus(self) -> Iterator[Any]:
        from nnd_daemon.control import gpus

        n = self.registry.gpus.count()
        used = GaugeMetricFamily("nnd_gpu_memory_used_bytes", "GPU memory held by each model's worker, per device",
                                 labels=["model", "device"])
        free = GaugeMetricFamily("nnd_gpu_memory_free_bytes", "Free memory of each visible GPU", labels=["device"])
        if n:
            for i in range(n):
                left = self.registry.gpus.free_bytes(i)
                if left is not None:
                    free.add_metric([f"cuda:{i}"], left)
            held = gpus.process_memory()
            for entry in self.registry.entries():
                worker = entry.worker
                if worker is None:
                    continue
                total = sum(held.get(pid, 0) for pid in worker.pids)
                if total:
                    device = ",".join(sorted({w.device for w in (worker.last_status.weights if worker.last_status
                                                                 else []) if w.device.startswith("cuda")})) or "cuda"
                    used.add_metric([entry.name, device], total)
        yield used
        yield free


def _buckets(h: worker_pb2.Histogram) -> list[tuple[str, float]]:
    out = [(_bound(b), float(c)) for b, c in zip(h.bounds, h.counts, strict=False)]
    out.append(("+Inf", float(h.count)))
    return out


def _bound(b: float) -> str:
    return repr(float(b))


def _counter(name: str, doc: str, labels: list[str], values: dict[tuple[str, ...], float]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family


class MetricsServer:
    """The HTTP listener: /metrics (Prometheus text format) and /healthz (200 while serving)."""

    def __init__(self, address: str, collector: Collector, healthy: Any) -> None:
        host, _, port = address.rpartition(":")
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        registry, ok = self.registry, healthy

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    try:
                        body, code, kind = generate_latest(registry), 200, CONTENT_TYPE_LATEST
                    except Exception as exc:  # noqa: BLE001 - a scrape's failure must not end the listener
                        log.exception("metrics scrape failed")
                        body, code, kind = f"scrape failed: {exc}\n".encode(), 500, "text/plain"
                elif path == "/healthz":
                    good = ok()
                    body, code, kind = (b"ok\n", 200, "text/plain") if good else (b"stopping\n", 503, "text/plain")
                else:
                    body, code, kind = b"not found: try /metrics or /healthz\n", 404, "text/plain"
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - scrapes are not news
                pass

        server_class = ThreadingHTTPServer
        if ":" in host:  # an IPv6 address ("[::1]:9464" arrives as "::1")

            class server_class(ThreadingHTTPServer):  # noqa: N801 - a local stand-in
                address_family = socket.AF_INET6

        try:
            self.httpd = server_class((host, int(port)), Handler)
        except OSError as exc:
            raise SystemExit(f"nnd: cannot serve metrics on {address}: {exc.strerror}") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]

    def start(self) -> None:
        threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
