"""Shared-memory segments older workers left behind, removed by the daemon (at its start, and
when a worker is gone); with the dead clients' regions (nnd/v1/shm.py)."""

from __future__ import annotations

import contextlib
import glob
import os
import re

from nnd.v1.shm import SHM_DIR, alive, reap_dead

_OLD_SEGMENT = re.compile(r"nnd-([0-9]{1,10})-[0-9]{1,12}-[0-9a-f]{8}")  # what workers created before


def remove_segments(pid: int = 0) -> int:
    """Unlink the segments older workers of this user created: worker `pid`'s (called when it is
    gone), or (pid 0, at the daemon's start) those of every worker that is gone; and dead clients' regions."""
    n = 0
    uid = os.geteuid()
    for path in glob.glob(os.path.join(SHM_DIR, "nnd-[0-9]*")):
        m = _OLD_SEGMENT.fullmatch(os.path.basename(path))
        if m is None or (pid and int(m.group(1)) != pid) or (not pid and alive(int(m.group(1)), 0)):
            continue
        with contextlib.suppress(OSError):
            if os.lstat(path).st_uid == uid:
                os.unlink(path)
                n += 1
    return n + reap_dead()
