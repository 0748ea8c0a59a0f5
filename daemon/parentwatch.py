"""How a child process of the daemon (a worker, the helper) dies with it."""

from __future__ import annotations

import os
import threading
import time


def parent_of(pid: int) -> int:
    """`pid`'s parent (0 if it is gone), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0
    return int(stat.rpartition(")")[2].split()[1])


def die_with_parent(parent: int) -> None:
    """End this process (a worker, the helper) once `parent`, the daemon, has gone: neither may
    outlive the daemon that supervises it. Polling rather than PR_SET_PDEATHSIG: that signal
    fires when the *thread* that started us ends, and the daemon starts them from short-lived threads.
    A process the daemon's fork server forked (control/forking.py) watches the fork server, which
    ends with the daemon."""
    if not parent:
        return
    watched = parent
    ours = os.getppid()
    if ours != parent and parent_of(ours) == parent:
        watched = ours

    def watch() -> None:
        while os.getppid() == watched:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
