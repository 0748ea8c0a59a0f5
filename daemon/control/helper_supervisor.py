"""The helper process: started and supervised by the daemon, it does every piece
of work whose cost a client shapes (meta builds, scans, tokenizing, edit and
upload checks; helper/service.py), so none of it runs in the daemon's process.

Bounds: the helper runs under RLIMIT_AS (`helper_memory_bytes` beyond what its
imports mapped, so a CUDA build of torch fits as a CPU one does; an allocation
beyond it fails in the helper, which reports RESOURCE_EXHAUSTED) and each call
under a CPU-time bound (`helper_cpu_s`): a watchdog here reads the helper's CPU
time while the call runs and, past the bound, kills the helper; the call gets
RESOURCE_EXHAUSTED naming the limit. Any death ends only the call it was
running; the next call starts a fresh helper, which rebuilds the META models it
needs from the call itself (every call carries its model's HelperModel).

Calls run one at a time in each helper process: the CPU time the watchdog
measures is then the call's own, and a call that kills the helper takes no
other call with it. (Calls wait for the one before; none is lost.) There are
two such processes, two lanes (`Lanes`): cheap calls whose cost is bounded by
a limit of their own (Tokenize, Decode, GetTokenizerFiles) have a process of
their own, so they never wait behind a Scan or a meta build another client
shaped. The heavy lane starts with the daemon, the light one on its first call.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import psutil

from nnd.v1 import contract, helper_pb2, helper_pb2_grpc
from nnd_daemon import errors
from nnd_daemon.control import admission, forking, statedir
from nnd_daemon.control.fairgate import FairGate

log = logging.getLogger("nnd.helper")

# How often the watchdog reads the helper's CPU time during a call.
POLL_S = 0.05


def caller_of(context: Any) -> tuple[str, str] | str:
    """Who a call is for, for taking turns (admission.caller_of: by verified identity, then the
    client's own name); calls the daemon makes for itself are one."""
    if context is None:
        return "daemon"
    try:
        return admission.caller_of(context)
    except Exception:  # noqa: BLE001 - the context of a call that has ended
        return "?"


# After a start that failed on the memory bound, how long calls get that error before a start is tried again.
START_RETRY_S = 60.0


def _size(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


class Helper:
    """The daemon's one helper process, started on first use and after every death."""

    def __init__(
        self,
        run_dir: str,
        log_dir: str,
        *,
        memory_bytes: int,
        cpu_s: float,
        start_timeout_s: float = 120.0,
        call_timeout_s: float = 600.0,
        cache: int = 8,
        name: str = "helper",
        forks: forking.ForkServer | None = None,
    ) -> None:
        self.memory_bytes = memory_bytes
        self.cpu_s = cpu_s
        self.start_timeout_s = start_timeout_s
        # Wall-clock bound of a call that names none (a build waiting on I/O uses no CPU time).
        self.call_timeout_s = call_timeout_s
        self.cache = cache
        self.socket = os.path.join(run_dir, f"{name}.sock")
        self.log_path = os.path.join(log_dir, f"{name}.log")
        # An empty directory the helper may not write to: it starts there (with -I: no cwd on sys.path).
        self.cwd = os.path.join(run_dir, "helper-cwd")
        os.makedirs(self.cwd, mode=0o555, exist_ok=True)
        # One call at a time (see the module docstring), clients taking turns (fairgate.py).
        self._call_lock = FairGate()
        self._proc: subprocess.Popen[bytes] | forking.ForkedProcess | None = None
        self._forks = forks  # the process forks from the daemon's fork server where it can (control/forking.py)
        self._ps: psutil.Process | None = None
        self._channel: grpc.Channel | None = None
        self._stub: helper_pb2_grpc.HelperStub | None = None
        self.restarts = 0
        # Helper processes killed (over helper_cpu_s, half-dead...): nnd_helper_kills_total.
        self.kills = 0
        self._closed = False
        self._capabilities: helper_pb2.HelperCapabilities | None = None
        # A start that failed on the memory bound, and when: it would fail again the same way, so calls
        # meanwhile get its error at once instead of each spawning a helper that aborts after ~10 s.
        self._start_failed: tuple[float, errors.NndError] | None = None

    @property
    def pid(self) -> int:
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else 0

    # -- process ---------------------------------------------------------------
    def start_soon(self) -> None:
        """Start the helper in the background now, so the first LoadModel does not wait for its
        imports, and learn its capabilities (GetServerInfo answers from them)."""

        def start() -> None:
            try:
                self.capabilities()
            except errors.NndError as exc:
                if not self._closed:  # a daemon stopping during the start says nothing about the helper
                    log.warning("the helper did not start (the next call tries again): %s", exc)

        threading.Thread(target=start, name="helper-start", daemon=True).start()

    def _ensure(self) -> helper_pb2_grpc.HelperStub:
        if self._closed:
            raise errors.Unavailable("the daemon is shutting down")
        if self._proc is not None and self._proc.poll() is None and self._stub is not None:
            return self._stub
        failed = self._start_failed
        if failed is not None and time.monotonic() - failed[0] < START_RETRY_S:
            raise failed[1]
        if self._proc is not None:
            self.restarts += 1
            log.warning("starting a new helper process (restart %d)", self.restarts)
        self._discard()
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        cmd = [sys.executable, "-I", "-m", "nnd_daemon.helper", "--socket", self.socket]
        cmd += ["--parent", str(os.getpid()), "--memory-bytes", str(self.memory_bytes), "--cache", str(self.cache)]
        with os.fdopen(statedir.open_log(self.log_path), "ab") as logf:  # never through a link (statedir.py)
            # No preexec_fn (unsafe in a threaded daemon): the helper sets its own rlimit.
            self._proc = forking.spawn(self._forks, cmd, env=None, cwd=self.cwd, logf=logf)
        threading.Thread(target=self._watch, args=(self._proc,), name="helper-watch", daemon=True).start()
        deadline = time.monotonic() + self.start_timeout_s
        while not os.path.exists(self.socket):
            code = self._proc.poll()
            if code is not None:
                exc = self._failed_start(code)
                if isinstance(exc, errors.FailedPrecondition):
                    self._start_failed = (time.monotonic(), exc)
                raise exc
            if time.monotonic() > deadline:
                self._kill()
                raise errors.Unavailable(f"the helper process did not start within {self.start_timeout_s:.0f} s")
            time.sleep(0.02)
        self._channel = grpc.insecure_channel("unix://" + self.socket, options=contract.GRPC_OPTIONS)
        grpc.channel_ready_future(self._channel).result(timeout=max(1.0, deadline - time.monotonic()))
        self._stub = helper_pb2_grpc.HelperStub(self._channel)
        self._start_failed = None
        self._ps = psutil.Process(self._proc.pid)
        return self._stub

    def _watch(self, proc: subprocess.Popen[bytes] | forking.ForkedProcess) -> None:
        """Reap the helper when it ends, and say so (a death is noticed here, not only by the next call)."""
        code = proc.wait()
        if not self._closed:
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            log.warning("the helper process (pid %d) ended: %s; the next call starts a new one", proc.pid, how)

    def _discard(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = self._stub = self._ps = None

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self.kills += 1
            self._proc.kill()
            self._proc.wait()

    def _cpu(self) -> float:
        try:
            t = self._ps.cpu_times() if self._ps is not None else None
        except psutil.Error:
            return 0.0
        return t.user + t.system if t is not None else 0.0

    def _failed_start(self, code: int) -> errors.NndError:
        how = self._describe_exit()
        if self.memory_bytes > 0 and -code in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS):
            # Under a small RLIMIT_AS the helper's threads cannot start (their stacks are address space too).
            return errors.FailedPrecondition(
                f"the helper process exited at start ({how}), most likely at its memory limit: "
                f"helper_memory_bytes={_size(self.memory_bytes)} beyond what its imports mapped leaves no room "
                "for its threads; start nnd serve with a larger --helper-memory (the default is 4 GiB)"
            )
        return errors.Unavailable(f"the helper process exited at start: {how}")

    def _describe_exit(self) -> str:
        code = self._proc.poll() if self._proc is not None else None
        if code is None:
            return "still running"
        return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"

    def close(self) -> None:
        self._closed = True
        self._discard()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(2.0)
            except subprocess.TimeoutExpired:
                self._kill()

    # -- calls -----------------------------------------------------------------
    def call(self, method: str, request: Any, *, what: str, timeout: float | None = None, client: Any = None) -> Any:
        """`method` of the Helper service with `request`, under the CPU watchdog.

        `what` names the work in error messages ("this Scan"); `client` (a
        grpc.ServicerContext) cancels the call when the client goes away."""
        with self._call_lock.held(caller_of(client)):
            stub = self._ensure()
            start = self._cpu()
            future = getattr(stub, method).future(request, timeout=timeout or self.call_timeout_s or None)
            if client is not None and not client.add_callback(future.cancel):
                future.cancel()
            over = ""
            while not future.done():
                try:
                    future.exception(timeout=POLL_S)
                except grpc.FutureTimeoutError:
                    pass
                except grpc.FutureCancelledError:
                    break
                if self.cpu_s > 0 and not future.done() and self._cpu() - start > self.cpu_s:
                    over = f"used more than {self.cpu_s:g} s of CPU time, the limit helper_cpu_s"
                    log.warning("%s %s; killing the helper process", what, over)
                    self._kill()
                    future.cancel()
                    break
                if self._proc is not None and self._proc.poll() is not None:
                    break
            if over:
                self._discard()
                raise errors.ResourceExhausted(
                    f"{what} {over} (nnd serve --helper-cpu-s); it was stopped, and the daemon and every other "
                    "model carry on"
                )
            if future.cancelled() and client is not None and not client.is_active():
                raise errors.Cancelled("the client went away")
            try:
                return future.result(timeout=0 if future.done() else None)
            except grpc.RpcError as err:
                raise self._translate(err, what) from None
            except grpc.FutureCancelledError:
                raise self._lost(what) from None

    def _lost(self, what: str) -> errors.NndError:
        """The helper died during `what`: say why, and that the next call gets a new one."""
        if self._proc is not None:
            try:
                self._proc.wait(2.0)
            except subprocess.TimeoutExpired:
                self._kill()  # a half-dead helper (connection gone) is replaced whole
        code = self._proc.poll() if self._proc is not None else None
        how = self._describe_exit()
        self._discard()
        after = "the daemon and every other model carry on, and the next request starts a new helper"
        if code is not None and -code in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS):
            # What a failed allocation under RLIMIT_AS looks like outside Python (C++ bad_alloc, a NULL malloc).
            return errors.ResourceExhausted(
                f"the helper process died ({how}) during {what}, most likely at its memory limit "
                f"helper_memory_bytes={_size(self.memory_bytes)} (nnd serve --helper-memory); {after}"
            )
        return errors.Unavailable(f"the helper process died ({how}) during {what}; {after} (safe to retry)")

    def _translate(self, err: grpc.RpcError, what: str) -> errors.NndError:
        code = err.code()
        if code == grpc.StatusCode.UNAVAILABLE or (self._proc is not None and self._proc.poll() is not None):
            return self._lost(what)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self._kill()  # its work goes on otherwise, and the next call's CPU time would include it
            self._discard()
            return errors.DeadlineExceeded(f"{what} did not finish before its deadline; it was stopped")
        exc_type = contract.exc_type_of(err)
        if exc_type == "MemoryError":
            return errors.ResourceExhausted(
                f"{what} needs more memory than the helper process may use: helper_memory_bytes="
                f"{_size(self.memory_bytes)} (nnd serve --helper-memory)"
            )
        return errors.from_rpc(err)

    # -- the calls the daemon makes --------------------------------------------
    def describe(self, ref: helper_pb2.HelperModel) -> helper_pb2.MetaDescription:
        return self.call("Describe", ref, what=f"building the META model of {ref.key}")

    def check_upload(self, kind: str, folder: str) -> None:
        self.call("CheckUpload", helper_pb2.HelperUploadRequest(kind=kind, folder=folder), what="the upload's check")

    def capabilities(self) -> helper_pb2.HelperCapabilities:
        """The engine's ops and attributes and the library versions, asked once (they are the
        installed packages': a restarted helper has the same)."""
        caps = self._capabilities
        if caps is None:
            caps = self._capabilities = self.call("Capabilities", helper_pb2.HelperEmpty(), what="a capabilities call")
        return caps

    def status(self) -> helper_pb2.HelperStatus:
        return self.call("Status", helper_pb2.HelperEmpty(), what="a status call", timeout=10.0)


# Helper calls whose cost a limit of their own bounds (max_tokenize_bytes, a token-id check, a
# tokenizer's files): the light lane's. Everything else (Scan, Describe, checks) is the heavy lane's.
LIGHT_METHODS = frozenset({"Tokenize", "Decode", "GetTokenizerFiles"})


class Lanes:
    """The daemon's helper as two processes: a heavy lane (meta builds, Scans, edit and upload checks)
    and a light one (LIGHT_METHODS), so a cheap call never queues behind an expensive one. Anything
    not about calls (the pid, restarts, capabilities) is the heavy lane's."""

    def __init__(self, run_dir: str, log_dir: str, helper_class: type[Helper] | None = None, **options: Any) -> None:
        make = helper_class or Helper  # registry.Processes: the in-process engine for tests passes its own
        self.heavy = make(run_dir, log_dir, **options)
        self.light = make(run_dir, log_dir, name="helper-light", **options)

    def call(self, method: str, request: Any, **kw: Any) -> Any:
        lane = self.light if method in LIGHT_METHODS else self.heavy
        return lane.call(method, request, **kw)

    def start_soon(self) -> None:
        # Only the heavy lane at start (GetServerInfo answers from its capabilities, and every load
        # needs it). The light one starts on its first call: a client reads a model's tokenizer files
        # once (then tokenizes itself), and a daemon whose clients never ask spends no process on it.
        self.heavy.start_soon()

    def close(self) -> None:
        light = threading.Thread(target=self.light.close, name="stop-helper-light")  # both lanes at once
        light.start()
        self.heavy.close()
        light.join()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.heavy, name)
