"""`nnd serve`'s options; defined on the client side so `nnd serve --help`
works where only the client is installed."""

from __future__ import annotations

import argparse

# The file `nnd serve` reads its options from when --config is not given (a missing one is fine).
DEFAULT_CONFIG = "/etc/nnd/nnd.toml"
# Options that only steer the command line itself: never read from a config file.
NOT_IN_CONFIG = frozenset({"config", "print_config", "token", "fn", "command", "help"})
# The namespace attribute naming the options given on the command line (config.py fills the rest).
GIVEN = "_serve_given"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        help=f"a TOML file holding any of these options (keys as the flags without '--'); flags override it "
        f"(default: {DEFAULT_CONFIG} if it exists)",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the effective configuration, each value's source, and exit"
    )
    p.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics and /healthz (off by default; a bare port "
        "binds 127.0.0.1)",
    )
    p.add_argument(
        "--log-format", choices=("text", "json"), default="text", help="log lines as text or one JSON object each"
    )
    p.add_argument(
        "--log-requests",
        action="store_true",
        help="log one line per finished request (model, kind, client, queue wait, run time, status) at INFO",
    )
    p.add_argument(
        "--max-models-per-user",
        type=int,
        default=0,
        metavar="N",
        help="models one user may have dispatched at once (0: no per-user cap; --max-dispatched still applies)",
    )
    p.add_argument(
        "--max-memory-per-user",
        default="0",
        metavar="SIZE",
        help="estimated weight bytes one user's dispatched models may take, all devices (0: no per-user cap)",
    )
    p.add_argument(
        "--max-queue-share",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="share of a model's queue (--max-queue-depth) one user's requests may take, e.g. 0.5 (0: no cap)",
    )
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help="also listen on TCP (the unix socket stays); needs --token-file or --tls-client-ca, "
        "or --insecure on a loopback address",
    )
    p.add_argument(
        "--state-dir", help="registry, worker sockets and logs (default: $STATE_DIRECTORY, else ~/.local/state/nnd)"
    )
    p.add_argument(
        "--keep-alive", default="30m", help="default idle time before a dispatched model is released (5m, 1h, -1 never)"
    )
    p.add_argument(
        "--max-memory",
        action="append",
        metavar="DEVICE=SIZE",
        help="weight budget per device, e.g. cpu=16GiB, cuda:0=70GiB (repeatable)",
    )
    p.add_argument(
        "--max-dispatched",
        type=int,
        default=8,
        help="cap on models dispatched at once; the least recently used idle one is released beyond it",
    )
    p.add_argument("--max-new-tokens", type=int, default=1024, help="largest max_new_tokens a Generate may ask for")
    p.add_argument("--max-invokes", type=int, default=4096, help="invokes (prompts) per request (the batch is bounded by tokens: 64 x --max-sequence-length)")
    p.add_argument("--max-request-bytes", default="256MiB", help="largest request")
    p.add_argument("--max-saved-bytes", default="4GiB", help="saved bytes per request")
    p.add_argument("--max-sequence-length", type=int, default=8192, help="tokens per prompt")
    p.add_argument("--max-queue-depth", type=int, default=64, help="requests queued per model")
    p.add_argument("--deadline", type=float, default=600.0, help="default request deadline, seconds")
    p.add_argument(
        "--max-pause",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="longest a run may stay paused at one sync point waiting for its client, whatever the client's "
        "pause_timeout (a paused run holds its model; 0: no cap)",
    )
    p.add_argument(
        "--max-paused-total",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="longest one request may spend paused in all, over all its sync points (0: no cap)",
    )
    p.add_argument("--max-tokenize-bytes", default="4MiB", help="text one Tokenize request may carry")
    p.add_argument(
        "--max-inflight-bytes", default="1GiB", help="Trace/Generate/Session bytes the daemon holds at once, all clients"
    )
    p.add_argument(
        "--helper-memory",
        default="4GiB",
        help="address space the helper process (meta builds, scans, tokenizing, upload checks) may add to what its imports mapped",
    )
    p.add_argument(
        "--helper-cpu-s",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="CPU time one helper call (a Scan, a meta build...) may use before it is stopped (0: unbounded)",
    )
    p.add_argument(
        "--allow-model",
        action="append",
        metavar="NAME",
        help="restrict LoadModel to these repo ids/paths (a trailing * matches a prefix; repeatable)",
    )
    p.add_argument(
        "--model-root",
        action="append",
        metavar="DIR",
        help="read local models only from inside these folders, every file resolved (repeatable; "
        "recommended on a daemon several users share)",
    )
    p.add_argument("--allow-remote-code", action="store_true", help="let clients load models with trust_remote_code")
    p.add_argument(
        "--max-upload-bytes",
        default="20GiB",
        help="largest model a client may upload (nnd.TransformersModel(hf_model), nnd.NNsight(module)); 0: no limit",
    )
    p.add_argument(
        "--no-uploads", action="store_true", help="refuse uploaded models: only repo ids and paths can be loaded"
    )
    p.add_argument("--socket-group", help="group owning the socket (mode 0660, in a 0750 directory), e.g. a lab group")
    p.add_argument(
        "--token-file",
        help="file holding the bearer token clients must send (NND_TOKEN / --token); "
        "required on every listener, the unix socket included, once given",
    )
    p.add_argument("--insecure", action="store_true", help="allow --listen without a token (loopback addresses only)")
    p.add_argument("--tls-cert", help="TLS certificate chain (PEM) for --listen")
    p.add_argument("--tls-key", help="TLS private key (PEM) for --listen")
    p.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mTLS) on --listen")
    p.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds in-flight requests may take to finish before workers are stopped "
        "(a second signal cuts it short)",
    )
    p.add_argument(
        "--watchdog-interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="how often each dispatched worker is pinged (0: no watchdog); a worker that misses "
        "--watchdog-misses pings in a row is killed and its model re-dispatched",
    )
    p.add_argument(
        "--watchdog-timeout", type=float, default=10.0, metavar="SECONDS", help="how long one ping waits for an answer"
    )
    p.add_argument("--watchdog-misses", type=int, default=3, metavar="N", help="unanswered pings that mean hung")
    p.add_argument(
        "--restart-limit",
        type=int,
        default=3,
        metavar="N",
        help="re-dispatch a model whose worker hung at most N times per 10 minutes (0: leave it META "
        "until a request or `nnd dispatch` asks for it)",
    )
    p.add_argument(
        "--batch-window-ms",
        type=float,
        default=2.0,
        metavar="MS",
        help="a worker gathers concurrent compatible traces this long and runs them as one batched "
        "forward; the trace that takes the model after a batched run also waits for that run's clients "
        "to send again, up to this long or half that run, at most ten times this (0: every request "
        "runs alone)",
    )
    p.add_argument(
        "--worker-start",
        choices=("fork", "exec"),
        default="fork",
        help="fork: workers and the helper fork from one process that imported torch and transformers "
        "at start (a dispatch skips seconds of imports); exec: each starts a fresh interpreter",
    )
    p.add_argument(
        "--upload-idle-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="cancel an upload that sends nothing for this long (0: never)",
    )
    p.add_argument(
        "--request-idle-timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="cut off a call that has not sent its request this long after opening (0: never); "
        "the daemon's socket and the workers' route sockets",
    )
    p.add_argument(
        "--max-waiting-calls",
        type=int,
        default=32,
        metavar="N",
        help="calls one user may have open that have not sent their request yet; more are refused (0: no cap)",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    p.add_argument(
        "--worker-log-bytes",
        default="16MiB",
        metavar="SIZE",
        help="a worker log in the state directory is rotated at this size (3 old files kept)",
    )
    _record_given(p)


def _record_given(p: argparse.ArgumentParser) -> None:
    """Make every option note, when it is used, that it was given on the command line: a config file
    fills only the others, and --print-config names each value's source."""
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        base = type(action)

        def call(self, parser, namespace, values, option_string=None, _base=base):  # noqa: ANN001
            getattr(namespace, GIVEN, None) or setattr(namespace, GIVEN, set())
            getattr(namespace, GIVEN).add(self.dest)
            _base.__call__(self, parser, namespace, values, option_string)

        action.__class__ = type(base.__name__, (base,), {"__call__": call})
    p.set_defaults(_serve_parser=p)
