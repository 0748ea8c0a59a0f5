"""Taking results from shared memory (`TraceRequest.shm`; see daemon/worker/shm.py).

The worker writes each big saved tensor into a segment of its own in
/dev/shm and sends its name. Here the segment is mapped (the tensor is a
zero-copy view of the mapping) and unlinked at once: the unlink tells the
worker the result was taken, and the mapping outlives it. A client that
never gets here (killed) leaves the unlinking to the worker's grace timer.
"""

from __future__ import annotations

import mmap
import os
import re
import sys
from typing import Any

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"nnd-\d+-\d+-[0-9a-f]+")


def available(address: str) -> bool:
    """Whether results can come through shared memory: Linux, /dev/shm, and a daemon on this host's unix socket."""
    return sys.platform.startswith("linux") and os.path.isdir(SHM_DIR) and address.startswith("unix:")


def take(name: str, nbytes: int) -> Any:
    """A writable mapping of segment `name`'s first `nbytes` bytes; the segment is unlinked."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"the daemon sent an invalid shared-memory segment name {name!r}")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise OSError(
            f"cannot open the shared-memory result {path}: {exc.strerror}. The daemon's worker creates it for "
            "its own user; run the client as that user, or trace without shm=True"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ValueError(f"shared-memory result {name} holds {size} bytes, {nbytes} expected")
        # MAP_PRIVATE: a copy-on-write view, so writing into the tensor never touches the segment.
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_PRIVATE) if nbytes else bytearray()
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass  # another user's segment in a sticky /dev/shm: the worker's timer unlinks it
