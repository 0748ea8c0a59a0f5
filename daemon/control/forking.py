"""Workers and helpers forked from one process that has imported torch and transformers once.

Every worker and helper process used to import torch and transformers itself:
6-7 s of CPU on a 2-core box (2.9 s on a faster one), paid again on every
dispatch, restart and helper start. `ForkServer` starts the fork server
(nnd_daemon/forkserver) as the daemon starts, so the import overlaps with the
daemon's own start; a later start forks from its imported state in a few
milliseconds. The child runs the same module with the same command line,
environment and working directory a `subprocess.Popen` would have given it,
under the same `python -I`; its process (`ForkedProcess`) answers the part
of Popen the supervisors use.

Where the fork server cannot serve (it failed to start, its state is not safe
to fork, it died), `spawn` returns None and the caller execs as before, so a
start never fails because of it. `nnd serve --worker-start exec` turns it off.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import Any

from nnd_daemon.control import statedir

log = logging.getLogger("nnd.forking")

# Imported in the fork server before its first fork: what every worker and helper imports anyway.
PRELOAD = (
    "torch",
    "transformers",
    "transformers.modeling_utils",
    "transformers.generation.utils",
    "nnd_daemon.worker.__main__",
    "nnd_daemon.helper.__main__",
    "nnd_daemon.helper.service",
)
MAX_MESSAGE = 1 << 20
# A fork takes milliseconds; a fork server that has not answered in this long is stopped or stuck.
REPLY_TIMEOUT_S = 30.0


class ForkedProcess:
    """A child of the fork server, as much of subprocess.Popen as the supervisors use. Signals go by
    pidfd, so one can never reach another process that later took the same pid; where pidfds are
    refused (an old kernel, a seccomp filter), by pid until its exit is reported."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()
        self._lock = threading.Lock()
        self._pidfd: int | None = None
        self._by_pid = False  # no pidfds here: signal by pid (the fork server's child, unreaped until it ends)
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone: its exit report follows
            pass
        except (OSError, AttributeError):  # refused, or a platform without pidfds
            self._by_pid = True

    def _exited(self, code: int) -> None:
        with self._lock:
            if self.returncode is None:
                self.returncode = code
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            try:
                if self._pidfd is not None:
                    try:
                        signal.pidfd_send_signal(self._pidfd, sig)
                        return
                    except PermissionError:  # a seccomp filter that allows pidfd_open but not this
                        self._by_pid = True
                if self._by_pid:
                    os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The daemon's fork server: started by `start`, asked by `spawn`, ended by `close`."""

    def __init__(
        self, run_dir: str, log_dir: str, *, start_timeout_s: float = 120.0, preload: tuple[str, ...] = PRELOAD
    ) -> None:
        self.preload = preload
        self.cwd = os.path.join(run_dir, "forkserver-cwd")
        self.log_path = os.path.join(log_dir, "forkserver.log")
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()  # one request and its reply at a time
        self._state = threading.Condition()
        self._ready: bool | None = None  # None: not answered yet
        self.why = ""  # why it does not serve, once it says so (or died)
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._replies: list[dict[str, Any]] = []
        self._children: dict[int, ForkedProcess] = {}
        self._early: dict[int, int] = {}  # exits reported before their spawn's reply was read
        self.forked = 0
        self._closing = False

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else 0

    @property
    def serving(self) -> bool:
        """Whether starts fork from it now (False while it imports, and for good once it cannot)."""
        return bool(self._ready)

    def start(self) -> None:
        """Start the fork server; it imports in the background while the daemon goes on."""
        try:
            os.makedirs(self.cwd, mode=0o555, exist_ok=True)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except (OSError, AttributeError) as exc:  # no SOCK_SEQPACKET here: every start execs
            self._give_up(f"could not start ({exc})")
            return
        cmd = [sys.executable, "-I", "-m", "nnd_daemon.forkserver", "--control", str(theirs.fileno())]
        try:
            with os.fdopen(statedir.open_log(self.log_path), "ab") as logf:
                self._proc = subprocess.Popen(
                    cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    pass_fds=(theirs.fileno(),), cwd=self.cwd,
                )
        except OSError as exc:
            self._give_up(f"could not start ({exc})")
            ours.close()
            return
        finally:
            theirs.close()
        self._sock = ours
        try:
            ours.send(json.dumps({"preload": list(self.preload)}).encode())
        except OSError as exc:
            self._give_up(f"could not be asked ({exc})")
            return
        threading.Thread(target=self._read, name="forkserver-read", daemon=True).start()

    def _read(self) -> None:
        """Replies to the waiting `spawn`, children's exits to their ForkedProcess."""
        assert self._sock is not None
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                break
            try:
                message = json.loads(data)
            except ValueError:
                log.error("the fork server sent %r, not JSON; it is stopped", data[:80])
                break
            if "exit" in message:
                with self._state:
                    child = self._children.pop(message["exit"], None)
                    if child is None:
                        self._early[message["exit"]] = message["code"]
                if child is not None:
                    child._exited(message["code"])
                continue
            with self._state:
                if "ready" in message:
                    self._ready = bool(message["ready"])
                    self.why = message.get("why", "")
                    if not self._ready:
                        log.warning("forking workers from a preloaded process is off: %s", self.why)
                else:
                    self._replies.append(message)
                self._state.notify_all()
        self._give_up("ended")
        if self._proc is not None:
            self._proc.kill()  # stopped here for a bad message; long gone otherwise
            self._proc.wait()
        # Its children end with it (parentwatch.py); say so to whoever waits on them.
        with self._state:
            orphans, self._children = list(self._children.values()), {}
        for child in orphans:
            child.kill()
            child._exited(-signal.SIGKILL)

    def _give_up(self, why: str) -> None:
        with self._state:
            if self._ready is not False:
                if self._ready and not self._closing:
                    log.warning("the fork server %s; workers start by exec from now on", why)
                self.why = self.why or why
            self._ready = False
            self._state.notify_all()

    def spawn(
        self, module: str, args: list[str], *, env: dict[str, str], cwd: str, log_fd: int
    ) -> ForkedProcess | None:
        """`python -I -m module args` as a child of the fork server (None: it cannot; exec instead).
        Waits for the fork server's imports if they are still going on."""
        with self._state:
            if not self._state.wait_for(lambda: self._ready is not None, self.start_timeout_s):
                return None
            if not self._ready or self._sock is None:
                return None
        request = json.dumps({"module": module, "args": args, "env": env, "cwd": cwd}).encode()
        with self._lock:
            try:
                socket.send_fds(self._sock, [request], [log_fd])
            except OSError as exc:
                self._give_up(f"could not be asked ({exc})")
                return None
            with self._state:
                if not self._state.wait_for(lambda: self._replies or self._ready is False, REPLY_TIMEOUT_S):
                    # A late reply would start a worker nobody tracks: end it (and what it forked) now.
                    self._give_up(f"did not answer a spawn request within {REPLY_TIMEOUT_S:g} s")
                    if self._proc is not None:
                        self._proc.kill()
                    return None
                if not self._replies:
                    return None
                reply = self._replies.pop(0)
                if "pid" not in reply:
                    log.warning("the fork server could not start %s: %s", module, reply.get("error"))
                    return None
                child = ForkedProcess(reply["pid"])
                early = self._early.pop(child.pid, None)
                if early is None:
                    self._children[child.pid] = child
                self.forked += 1
        if early is not None:
            child._exited(early)
        return child

    def close(self) -> None:
        """End the fork server (its children end with it)."""
        self._closing = True
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._proc is not None:
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def spawn(
    forks: ForkServer | None, cmd: list[str], *, env: dict[str, str] | None, cwd: str, logf: Any
) -> subprocess.Popen[bytes] | ForkedProcess:
    """Start `cmd` (`python -I -m module args...`) by the fork server where it can, else by exec,
    with stdout and stderr on `logf` and stdin empty, in `cwd`, with `env` (None: this process's)."""
    if forks is not None and cmd[1:3] == ["-I", "-m"]:
        child = forks.spawn(cmd[3], cmd[4:], env=dict(os.environ if env is None else env), cwd=cwd,
                            log_fd=logf.fileno())
        if child is not None:
            return child
    return subprocess.Popen(
        cmd, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, close_fds=True, env=env, cwd=cwd
    )
