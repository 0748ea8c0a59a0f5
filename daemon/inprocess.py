"""The in-process engine, for tests only: a daemon whose workers and helper serve their usual
gRPC services from threads of the daemon's own process instead of processes of their own (as
vLLM's in-process engine client keeps the engine beside its caller).

Why: a test suite that starts a worker process per dispatch and a helper per daemon pays an
interpreter start and a torch + transformers import each time, and that is most of its time.
Clients still go through everything that matters for semantics: the client's recording, gRPC
over unix sockets (the worker's public route and the daemon's forwarding), the worker's gateway,
turns, batching, and the engine on real weights. What it cannot show is anything about processes
(a worker's death, the helper's memory and CPU bounds, RSS coming back, tensor parallel, uids):
tests of those run against a daemon with real processes.

`PROCESSES` is what `nnd_daemon.control.server.serve(..., processes=...)` takes. Production never
imports this module: `nnd serve` always starts processes. This module is the one place that
composes the control plane with the worker's and the helper's servers, so control/ and worker/
still never import each other.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from typing import Any

import grpc

from nnd.v1 import contract, helper_pb2_grpc
from nnd_daemon import errors
from nnd_daemon.control.helper_supervisor import Helper
from nnd_daemon.control.registry import Processes
from nnd_daemon.control.supervisor import TOKEN_ENV, Launcher, Worker

log = logging.getLogger("nnd.inprocess")
_KILLED = -9  # what a killed process's returncode reads as


class ServedHere:
    """Stands in for a worker's or the helper's `subprocess.Popen`: its servers run in this
    process, and ending it stops them (`terminate`: with the grace the real process's SIGTERM
    handler gives, exit code 0; `kill`: at once, as SIGKILL)."""

    def __init__(self, servers: list[grpc.Server], grace: float) -> None:
        self.pid = os.getpid()
        self.returncode: int | None = None
        self._servers = servers
        self._grace = grace
        self._lock = threading.Lock()
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired("in-process server", timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def terminate(self) -> None:
        threading.Thread(target=self._end, args=(self._grace, 0), name="inprocess-stop", daemon=True).start()

    def kill(self) -> None:
        self._end(None, _KILLED)

    def _end(self, grace: float | None, code: int) -> None:
        with self._lock:
            if self._ended.is_set():
                return
            servers, self._servers = self._servers, []  # the servicers (and a worker's model) go with them
            for stopped in [server.stop(grace) for server in servers]:
                stopped.wait()
            self.returncode = code
            self._ended.set()


class InProcessWorker(Worker):
    """A `Worker` whose command line is served by `worker.__main__.serve` in this process."""

    def _spawn(self, cmd: list[str], env: dict[str, str], logf: Any) -> Any:
        if self.tp_size > 1:
            raise errors.FailedPrecondition("the in-process engine has no tensor parallel: test it with processes")
        from nnd_daemon.worker import __main__ as worker_main

        # cmd: python -I -m nnd_daemon.worker ARGS (supervisor.Worker.start), parsed as the worker would.
        ns = worker_main.parser().parse_args(cmd[cmd.index("nnd_daemon.worker") + 1 :])
        from nnd_daemon import identity

        served = worker_main.serve(ns, token=env.get(TOKEN_ENV, ""), identity_key=env.get(identity.KEY_ENV, ""))
        return ServedHere(served, grace=2.0)


class InProcessLauncher(Launcher):
    def worker_class(self) -> type[Worker]:
        return InProcessWorker


class InProcessHelper(Helper):
    """The helper's service on its usual socket, served from this process. No CPU watchdog and no
    memory limit: those bound a process (tests of them start a daemon with processes)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cpu_s = 0.0

    def _ensure(self) -> Any:
        if self._closed:
            raise errors.Unavailable("the daemon is shutting down")
        if self._proc is not None and self._proc.poll() is None and self._stub is not None:
            return self._stub
        if self._proc is not None:
            self.restarts += 1
        self._discard()
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        from nnd_daemon.helper import __main__ as helper_main

        self._proc = ServedHere([helper_main.serve(self.socket, self.cache)], grace=1.0)  # type: ignore[assignment]
        self._channel = grpc.insecure_channel("unix://" + self.socket, options=contract.GRPC_OPTIONS)
        grpc.channel_ready_future(self._channel).result(timeout=self.start_timeout_s)
        self._stub = helper_pb2_grpc.HelperStub(self._channel)
        return self._stub

    def _cpu(self) -> float:
        return 0.0


PROCESSES = Processes(launcher=InProcessLauncher, helper=InProcessHelper, forks=False)
