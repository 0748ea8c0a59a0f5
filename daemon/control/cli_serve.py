"""Turn `nnd serve`'s options into Settings and run the daemon."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from nnd.v1 import address as _address
from nnd_daemon import logfmt, shmreap
from nnd_daemon.control import config
from nnd_daemon.control.auth import Access, AccessError
from nnd_daemon.control.registry import Processes
from nnd_daemon.control.settings import Limits, Settings, UserLimits, parse_bytes


def default_state_dir() -> str:
    if os.environ.get("STATE_DIRECTORY"):  # systemd's StateDirectory=
        return os.environ["STATE_DIRECTORY"].split(":")[0]
    base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return os.path.join(base, "nnd")


# The limits' defaults are written once, here (settings.Limits); `nnd serve`'s flags show the same
# values (tests/test_contract.py checks that they agree), and a namespace without a flag gets these.
DEFAULTS = Limits()


def _bytes(ns: argparse.Namespace, name: str, default: int) -> int:
    value = getattr(ns, name, None)
    return default if value is None else parse_bytes(value)


def settings_from_args(ns: argparse.Namespace) -> Settings:
    # The unix socket is always there (local tools, the systemd unit's clients);
    # --listen adds a TCP port beside it (see access_from_args).
    address = ns.address or _address.default_address(serving=True)
    max_memory = {}
    for item in ns.max_memory or []:
        dev, _, size = item.partition("=")
        dev = f"cuda:{dev}" if dev.isdigit() else ("cuda:0" if dev == "cuda" else dev)
        max_memory[dev] = parse_bytes(size)
    limits = Limits(
        max_request_bytes=parse_bytes(ns.max_request_bytes),
        max_saved_bytes=parse_bytes(ns.max_saved_bytes),
        max_invokes=ns.max_invokes,
        max_sequence_length=ns.max_sequence_length,
        max_new_tokens=ns.max_new_tokens,
        default_deadline_s=ns.deadline,
        max_pause_s=max(0.0, getattr(ns, "max_pause", DEFAULTS.max_pause_s)),
        max_paused_total_s=max(0.0, getattr(ns, "max_paused_total", DEFAULTS.max_paused_total_s)),
        max_queue_depth=ns.max_queue_depth,
        max_dispatched_models=ns.max_dispatched,
        max_upload_bytes=-1 if ns.no_uploads else parse_bytes(ns.max_upload_bytes),
        max_tokenize_bytes=_bytes(ns, "max_tokenize_bytes", DEFAULTS.max_tokenize_bytes),
        max_inflight_bytes=_bytes(ns, "max_inflight_bytes", DEFAULTS.max_inflight_bytes),
        helper_memory_bytes=_bytes(ns, "helper_memory", DEFAULTS.helper_memory_bytes),
        helper_cpu_s=max(0.0, getattr(ns, "helper_cpu_s", DEFAULTS.helper_cpu_s)),
    )
    return Settings(
        address=address,
        state_dir=ns.state_dir or default_state_dir(),
        keep_alive=ns.keep_alive,
        limits=limits,
        max_memory=max_memory,
        allow_remote_code=ns.allow_remote_code,
        allow_models=ns.allow_model or [],
        model_roots=getattr(ns, "model_root", None) or [],
        socket_group=ns.socket_group,
        watchdog_interval_s=ns.watchdog_interval,
        watchdog_timeout_s=ns.watchdog_timeout,
        watchdog_misses=max(1, ns.watchdog_misses),
        restart_limit=max(0, ns.restart_limit),
        batch_window_ms=max(0.0, getattr(ns, "batch_window_ms", 2.0)),
        worker_start=getattr(ns, "worker_start", "fork"),
        upload_idle_timeout_s=max(0.0, getattr(ns, "upload_idle_timeout", 60.0)),
        request_idle_timeout_s=max(0.0, getattr(ns, "request_idle_timeout", 5.0)),
        max_waiting_calls=max(0, getattr(ns, "max_waiting_calls", 32)),
        metrics=metrics_address(getattr(ns, "metrics", None) or ""),
        log_requests=bool(getattr(ns, "log_requests", False)),
        log_format=getattr(ns, "log_format", "text"),
        worker_log_bytes=parse_bytes(getattr(ns, "worker_log_bytes", "16MiB")),
        users=UserLimits(
            max_models=max(0, getattr(ns, "max_models_per_user", 0)),
            max_memory_bytes=parse_bytes(getattr(ns, "max_memory_per_user", "0")),
            max_queue_share=min(1.0, max(0.0, getattr(ns, "max_queue_share", 0.0))),
        ),
    )


def metrics_address(text: str) -> str:
    """HOST:PORT for the metrics listener; a bare port (or ':PORT') binds loopback only."""
    text = text.strip()
    if not text:
        return ""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--metrics takes HOST:PORT or PORT, not {text!r}")
    return f"{host.strip('[]') or '127.0.0.1'}:{port}"


def access_from_args(ns: argparse.Namespace) -> Access:
    return Access.build(
        listen=ns.listen,
        token_file=ns.token_file,
        insecure=ns.insecure,
        tls_cert=ns.tls_cert,
        tls_key=ns.tls_key,
        tls_client_ca=ns.tls_client_ca,
    )


def run(ns: argparse.Namespace, processes: Processes | None = None) -> int:
    """`nnd serve` with the parsed options `ns`; `processes`: see registry.Processes (tests only)."""
    try:
        sources = config.resolve(ns)
        if ns.address is not None:
            ns.address = _address.normalize(ns.address)
        settings_from_args(ns)  # every value checked before anything starts (or is printed)
    except (config.ConfigError, ValueError) as exc:
        print(f"nnd: {exc}", file=sys.stderr)
        return 1
    if ns.print_config:
        # What the daemon would use where nothing was set, so the output is the whole configuration.
        ns.address = ns.address or _address.default_address(serving=True)
        ns.state_dir = ns.state_dir or default_state_dir()
        print(config.render(ns, sources))
        return 0
    logfmt.setup(ns.log_level, ns.log_format)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Whatever the caller's umask: nothing the daemon or its workers create is writable by others.
    os.umask(0o077)
    if getattr(ns, "token", None):  # the clients' option: silently serving without a token would be worse
        print("nnd: serve takes the token from a file: --token-file PATH (--token is for clients)", file=sys.stderr)
        return 1
    try:
        access = access_from_args(ns)
    except AccessError as exc:
        print(f"nnd: {exc}", file=sys.stderr)
        return 1
    settings = settings_from_args(ns)
    shmreap.remove_segments()  # shared memory of workers gone with an earlier daemon (SIGKILL, older versions)
    from nnd_daemon.control.server import serve

    serve(settings, access, grace=ns.grace, processes=processes)
    # Calls are drained, workers ended, state saved. Skip interpreter teardown:
    # with torch and transformers imported its garbage collection alone takes
    # seconds, which every `systemctl stop`/restart would wait for.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
