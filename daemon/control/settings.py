"""The daemon's settings: where it listens, where it keeps state, its limits."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from nnd.v1 import nnd_pb2


@dataclass
class Limits:
    """Request limits; 0 means unlimited. Defaults protect a shared box."""

    max_request_bytes: int = 256 * 1024 * 1024
    max_constant_bytes: int = 256 * 1024 * 1024
    max_saved_bytes: int = 4 * 1024 * 1024 * 1024
    # Invokes are counted loosely (230 one-line prompts are ordinary research code); the batch's
    # memory is bounded by tokens instead: rows x longest row <= BATCH_TOKENS_PER_LENGTH x
    # max_sequence_length (daemon/engine/inputs.py), what 64 invokes of the longest length held before.
    max_invokes: int = 4096
    max_sequence_length: int = 8192
    max_new_tokens: int = 1024
    default_deadline_s: float = 600.0
    max_queue_depth: int = 64
    max_dispatched_models: int = 8
    # Bytes one Upload may carry (all its files); -1: uploads disabled (--no-uploads).
    max_upload_bytes: int = 20 * 1024 * 1024 * 1024
    # Text one Tokenize may carry (a 128k-token context is well under 1 MiB of text).
    max_tokenize_bytes: int = 4 * 1024 * 1024
    # Request and result bytes of Trace/Generate/Session the daemon holds at once (daemon/inflight.py; workers keep one of their own).
    max_inflight_bytes: int = 1024 * 1024 * 1024
    # The helper process (control/helper_supervisor.py): RLIMIT_AS, and CPU seconds per call.
    helper_memory_bytes: int = 4 * 1024 * 1024 * 1024
    helper_cpu_s: float = 60.0
    # A run paused at a sync point holds its model: seconds per pause, and in all per request (0: no cap).
    max_pause_s: float = 5.0
    max_paused_total_s: float = 30.0

    def to_proto(self) -> nnd_pb2.Limits:
        return nnd_pb2.Limits(**self.__dict__)


@dataclass
class UserLimits:
    """What one user (a uid on the unix socket, a token or host over TCP) may hold; 0: no per-user cap.
    They keep one person from taking a shared box: the daemon-wide caps still apply on top."""

    # Models dispatched by this user at once (a request's automatic dispatch counts for its sender).
    max_models: int = 0
    # Estimated weight bytes of those models, all devices together.
    max_memory_bytes: int = 0
    # Fraction of a model's queue (max_queue_depth) one user's requests may fill.
    max_queue_share: float = 0.0


@dataclass
class Settings:
    address: str
    state_dir: str
    keep_alive: str = "30m"
    limits: Limits = field(default_factory=Limits)

    @property
    def helper_memory_bytes(self) -> int:
        return self.limits.helper_memory_bytes

    @property
    def helper_cpu_s(self) -> float:
        return self.limits.helper_cpu_s
    # Per-device weight budgets in bytes ("cpu", "cuda:0"); missing: what the device has free.
    max_memory: dict[str, int] = field(default_factory=dict)
    allow_remote_code: bool = False
    # Repo ids / path prefixes a LoadModel may name; empty: anything.
    allow_models: list[str] = field(default_factory=list)
    # Folders local models may be read from (--model-root); empty: any folder (daemon/modelfiles.py).
    model_roots: list[str] = field(default_factory=list)
    socket_group: str | None = None
    worker_start_timeout_s: float = 120.0
    # The worker watchdog: every `watchdog_interval_s` the daemon asks each
    # dispatched worker for its Status and waits `watchdog_timeout_s` for the
    # answer; after `watchdog_misses` unanswered pings in a row the worker
    # counts as hung: it is killed, and its model re-dispatched at once.
    # Detection takes about misses * (interval + timeout). 0 interval: off.
    # (A worker that dies is noticed at once, without pings; its model is
    # dispatched again by the next request.)
    watchdog_interval_s: float = 10.0
    watchdog_timeout_s: float = 10.0
    watchdog_misses: int = 3
    # A model whose worker hung is re-dispatched at most `restart_limit` times
    # per `restart_window_s`; after that it stays META with the reason until
    # a request or `nnd dispatch` asks for it. 0: never re-dispatched eagerly.
    restart_limit: int = 3
    restart_window_s: float = 600.0
    # Workers gather concurrent compatible Traces this long (ms) and run them
    # as one batched forward (worker/batching.py). 0: every request alone.
    batch_window_ms: float = 2.0
    # "fork": workers and the helper fork from a process that imported torch and transformers once
    # (control/forking.py); "exec": each starts a fresh interpreter.
    worker_start: str = "fork"
    # Uploads at once, per client (TCP host; the unix socket is one client) and in all;
    # an Upload that sends nothing for `upload_idle_timeout_s` is cancelled (0: never).
    max_uploads_per_client: int = 4
    max_concurrent_uploads: int = 16
    upload_idle_timeout_s: float = 60.0
    # A call must send its request (a stream its first message) this many seconds after it opens, or it
    # is cut off (0: never); until then it costs no thread, and one caller (its verified identity) may
    # have at most `max_waiting_calls` such calls open (daemon/asyncserve.py; workers' route sockets too).
    request_idle_timeout_s: float = 5.0
    max_waiting_calls: int = 32
    # Prometheus metrics and /healthz on this HOST:PORT (control/metrics.py); "": off.
    metrics: str = ""
    # One log line per finished request (model, kind, client, queue wait, run time, status), by the worker.
    log_requests: bool = False
    log_format: str = "text"
    # A worker's log is rotated at this size, 3 old files kept (supervisor.py).
    worker_log_bytes: int = 16 * 1024 * 1024
    users: UserLimits = field(default_factory=lambda: UserLimits())

    @property
    def state_file(self) -> str:
        return os.path.join(self.state_dir, "registry.json")


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str) -> int:
    """'20GiB', '512MB', '1000' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 20GiB, 512MB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_duration(text: str) -> float | None:
    """Keep-alive durations as Ollama spells them: '5m', '1h30m', '90s', '300'
    (seconds), '0' (now), '-1' (forever -> None)."""
    text = text.strip()
    if text in ("-1", "inf", "forever"):
        return None
    if re.fullmatch(r"-?[0-9.]+", text):
        value = float(text)
        if value < 0:
            return None
        return value
    parts = re.findall(r"([0-9.]+)\s*(h|m|s|ms)", text)
    if not parts or "".join(f"{n}{u}" for n, u in parts) != text.replace(" ", ""):
        raise ValueError(f"not a duration: {text!r} (use e.g. 5m, 1h, 30s, 0, -1)")
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * scale[u] for n, u in parts)
