"""`nnd serve`'s options; defined on the client side so `nnd serve --help`
works where only the client is installed."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--max-invokes", type=int, default=64, help="invokes (prompts) per request")
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
        help="address-space limit of the helper process (meta builds, scans, tokenizing, upload checks)",
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
        "forward (0: every request runs alone)",
    )
    p.add_argument(
        "--upload-idle-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="cancel an upload that sends nothing for this long (0: never)",
    )
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
