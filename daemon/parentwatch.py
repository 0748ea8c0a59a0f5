"""How a child process of the daemon (a worker, the helper) dies with it."""

from __future__ import annotations

import os
import threading
import time


def die_with_parent(parent: int) -> None:
    """End this process (a worker, the helper) once `parent`, the daemon, has gone: neither may
    outlive the daemon that supervises it. Polling rather than PR_SET_PDEATHSIG: that signal
    fires when the *thread* that started us ends, and the daemon starts them from short-lived threads.
    A process the daemon's fork server forked (control/forking.py) watches the fork server, which
    ends with the daemon."""
    if not parent:
        return
    import psutil  # the worker and the helper import it anyway

    watched = parent
    ours = os.getppid()
    try:
        if ours != parent and psutil.Process(ours).ppid() == parent:
            watched = ours
    except psutil.Error:  # our parent is gone already: the loop below ends us
        pass

    def watch() -> None:
        while os.getppid() == watched:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
