"""Running nnd for a lab (issue #29), against a real `nnd serve --config` with metrics on:
loads, traces, a generation, a refused request and a killed worker each move the Prometheus
figures and leave a log line naming the user; `nnd logs` shows the worker's log; the config
file's values hold and flags override them."""

from __future__ import annotations

import getpass
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from daemonproc import Daemon, start_daemon
from prometheus_client.parser import text_string_to_metric_families

from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc
from nnd.wire.connection import Connection

ME = getpass.getuser()  # the user the daemon sees for this test's clients (SO_PEERCRED)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ops(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, int]]:
    tmp = tmp_path_factory.mktemp("ops")
    port = _free_port()
    config = tmp / "nnd.toml"
    config.write_text(
        f'metrics = "127.0.0.1:{port}"\n'
        "log-requests = true\n"
        'log-format = "json"\n'
        "max_invokes = 4\n"
        "max-queue-depth = 9  # the command line overrides this one\n"
        'keep-alive = "-1"\n'
        "watchdog-interval = 0\n"
    )
    d = start_daemon(tmp, "--config", str(config), "--max-queue-depth", "16")
    yield d, port
    assert d.stop() == 0


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def _metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape: (name, sorted labels) -> value."""
    code, text = _get(port, "/metrics")
    assert code == 200, text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _wait_for(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def _voluntary_switches(pid: int) -> int:
    """How many times the main thread of `pid` has gone to sleep (a thread that never wakes: none)."""
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def _trace_request(model: str, invokes: int = 1) -> nnd_pb2.TraceRequest:
    graph = graph_pb2.Graph()
    graph.nodes.add(id=1, module=graph_pb2.ModuleValue(path="lm_head", point=graph_pb2.OUTPUT))
    graph.nodes.add(id=2, save=graph_pb2.Save(value=graph_pb2.Arg(ref=1)))
    ids = [nnd_pb2.Invoke(tokens=nnd_pb2.TokenIds(ids=[5, 6, 7, 8 + k])) for k in range(invokes)]
    return nnd_pb2.TraceRequest(model=model, invokes=ids, graph=graph)


def _model(d: Daemon, name: str) -> nnd_pb2.ModelInfo:
    with grpc.insecure_channel(d.address) as channel:
        models = nnd_pb2_grpc.NndStub(channel).ListModels(nnd_pb2.ListModelsRequest(), timeout=30).models
    (info,) = [m for m in models if m.name == name]
    return info


def test_config_file_values_hold_and_flags_override_them(ops, tmp_path):
    d, port = ops
    # The running daemon took the file's max_invokes and the command line's queue depth.
    with grpc.insecure_channel(d.address) as channel:
        limits = nnd_pb2_grpc.NndStub(channel).GetServerInfo(nnd_pb2.GetServerInfoRequest(), timeout=30).limits
    assert (limits.max_invokes, limits.max_queue_depth) == (4, 16)
    config = tmp_path / "nnd.toml"
    config.write_text('max-invokes = 4\nallow-model = ["a/b", "/models/*"]\nmetrics = "9100"\n')
    cmd = [sys.executable, "-m", "nnd.cli", "serve", "--config", str(config), "--print-config", "--max-invokes", "7"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = {line.split("=")[0].strip(): line for line in out.stdout.splitlines() if "=" in line}
    assert lines["max-invokes"].split("#")[0].strip() == "max-invokes = 7" and "command line" in lines["max-invokes"]
    assert '["a/b", "/models/*"]' in lines["allow-model"] and f"config {config}" in lines["allow-model"]
    assert '"127.0.0.1:9100"' not in lines["metrics"] and "9100" in lines["metrics"]
    assert "max-queue-depth = 64" in lines["max-queue-depth"] and "# default" in lines["max-queue-depth"]
    # What it printed is a config file nnd serve reads back to the same values.
    again = tmp_path / "again.toml"
    again.write_text("\n".join(line.split("#")[0] for line in out.stdout.splitlines() if not line.startswith("#")))
    back = subprocess.run([*cmd[:4], "--config", str(again), "--print-config"], capture_output=True, text=True, timeout=120)
    assert back.returncode == 0, back.stderr
    assert [line.split("#")[0].strip() for line in back.stdout.splitlines()] == [
        line.split("#")[0].strip() for line in out.stdout.splitlines()
    ]
    bad = tmp_path / "bad.toml"
    bad.write_text("max-invoke = 3\n")
    res = subprocess.run([*cmd[:4], "--config", str(bad), "--print-config"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "unknown option 'max-invoke'" in res.stderr


def test_metrics_and_logs_follow_loads_traces_a_generation_a_refusal_and_a_killed_worker(ops, tiny_models):
    import nnd

    d, port = ops
    code, body = _get(port, "/healthz")
    assert (code, body) == (200, "ok\n")
    assert _get(port, "/nope")[0] == 404
    path = tiny_models["gpt2"]
    d.cli("load", path)
    assert f"loaded {path}" in d.log() and f"for {ME} in" in d.log()

    model = nnd.TransformersModel(path, address=d.address, dispatch=True)
    _wait_for("the dispatch line", lambda: f"dispatched {path} on" in d.log() and f"for {ME} in" in d.log())
    for prompt in ("hello world", "the cat sat"):
        with model.trace(prompt):
            model.lm_head.output.save()
    with model.generate("hello", max_new_tokens=3, do_sample=False):
        pass
    with pytest.raises(nnd.NndError) as refused:  # the client's own connection: it names its user
        list(Connection(d.address).stream("Trace", _trace_request(path, invokes=5), timeout=60))
    assert "max_invokes=4" in str(refused.value)
    edit = Connection(d.address).call("CreateEdit", nnd_pb2.CreateEditRequest(model=path, graph=graph_pb2.Graph()))
    assert edit.created_by == ME  # edits record their user too

    m = _metrics(port)
    assert _value(m, "nnd_requests_total", model=path, kind="trace", status="ok") == 2
    assert _value(m, "nnd_requests_total", model=path, kind="generate", status="ok") == 1
    assert _value(m, "nnd_requests_total", model=path, kind="trace", status="resource_exhausted") == 1
    assert _value(m, "nnd_refusals_total", limit="max_invokes") == 1
    assert _value(m, "nnd_generated_tokens_total", model=path) == 3
    assert _value(m, "nnd_request_run_seconds_count", model=path, kind="trace") == 2
    assert _value(m, "nnd_request_queue_wait_seconds_count", model=path, kind="trace") == 2
    assert _value(m, "nnd_request_run_seconds_bucket", model=path, kind="trace", le="+Inf") == 2
    assert _value(m, "nnd_request_run_seconds_sum", model=path, kind="generate") > 0
    assert _value(m, "nnd_model_state", model=path, state="dispatched") == 1
    assert _value(m, "nnd_model_state", model=path, state="meta") == 0
    info = _model(d, path)
    assert _value(m, "nnd_model_weight_bytes", model=path, device="cpu") == sum(w.bytes for w in info.weights) > 0
    assert _value(m, "nnd_worker_rss_bytes", model=path) > 0
    assert _value(m, "nnd_queue_depth", model=path) == 0 and _value(m, "nnd_running_requests", model=path) == 0
    assert _value(m, "nnd_dispatches_total", model=path, status="ok") == 1
    helper = {dict(k[1])["method"]: v for k, v in m.items() if k[0] == "nnd_helper_calls_total"}
    assert helper.get("Describe", 0) >= 1, helper  # the load's meta build ran in the helper
    assert _value(m, "nnd_worker_deaths_total", model=path) == 0
    assert ("nnd_uploads_stored", ()) in m and ("nnd_helper_kills_total", ()) in m  # present, at 0 here
    assert _value(m, "nnd_uploads_stored") == 0 and _value(m, "nnd_helper_kills_total") == 0
    # The helper and the worker forked from the fork server (control/forking.py), which still serves.
    assert _value(m, "nnd_forkserver_up") == 1 and _value(m, "nnd_forked_processes_total") >= 2
    assert info.dispatched_by == ME and info.loaded_by == ME
    # An idle worker's main thread sleeps until it is told to stop: it does not look ten times a
    # second (as gRPC's wait_for_termination does), which costs an idle worker CPU on a VM.
    main = info.worker_pids[0]
    woke = _voluntary_switches(main)
    time.sleep(1.0)
    assert _voluntary_switches(main) - woke <= 1

    # The worker's log, through the daemon: one line per finished request, with the user.
    logs = d.cli("logs", path).stdout
    assert logs.count(f"trace by {ME} (") == 3, logs  # two that ran, one refused
    assert "refused, resource_exhausted" in logs and "max_invokes=4" in logs
    assert f"generate by {ME} (" in logs and ": ok, queued" in logs

    # A killed worker: counted, logged with who dispatched it, and its counts kept in the totals.
    pid = info.worker_pids[0]
    os.kill(pid, signal.SIGKILL)
    _wait_for("the model back to META", lambda: _model(d, path).state == nnd_pb2.META)
    _wait_for("the death line", lambda: f"worker of {path} (pid {pid}, dispatched by {ME}) ended" in d.log())
    m = _metrics(port)
    assert _value(m, "nnd_worker_deaths_total", model=path) == 1
    assert _value(m, "nnd_model_state", model=path, state="meta") == 1
    assert _value(m, "nnd_requests_total", model=path, kind="trace", status="ok") == 2
    # The next trace brings it back (a new worker); the totals go on from the old worker's.
    with model.trace("again"):
        model.lm_head.output.save()
    m = _metrics(port)
    assert _value(m, "nnd_requests_total", model=path, kind="trace", status="ok") == 3
    assert _value(m, "nnd_dispatches_total", model=path, status="ok") == 2
    assert _value(m, "nnd_model_state", model=path, state="dispatched") == 1

    d.cli("release", path)
    _wait_for("the release line", lambda: f"released {path} for {ME} (dispatched by {ME})" in d.log())
    # --log-format json: every line an object; lifecycle lines carry event, model and user as fields.
    lines = [json.loads(line) for line in d.log().splitlines() if line.startswith("{")]
    events = {(e.get("event"), e.get("model"), e.get("user")) for e in lines}
    for event in ("load", "dispatch", "worker_death", "release"):
        assert (event, path, ME) in events, (event, sorted(map(str, events)))
    assert all({"time", "level", "logger", "message"} <= set(e) for e in lines)
    worker = [json.loads(line) for line in d.cli("logs", path).stdout.splitlines() if line.startswith("{")]
    assert any(e.get("event") == "request" and e.get("user") == ME and e.get("model") == path for e in worker)
    m = _metrics(port)
    assert _value(m, "nnd_releases_total", model=path, reason="request") == 1
    assert _value(m, "nnd_requests_total", model=path, kind="trace", status="ok") == 3
    assert _value(m, "nnd_model_state", model=path, state="meta") == 1
