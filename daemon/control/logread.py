"""ReadLogs: a bounded piece of one log file in the state directory (`nnd logs`)."""

from __future__ import annotations

import os

from nnd.v1 import nnd_pb2
from nnd_daemon import errors

# The most one ReadLogs answers with: `nnd logs -f` asks again for the rest.
MAX_BYTES = 1024 * 1024
DEFAULT_BYTES = 64 * 1024


def read(path: str, offset: int, max_bytes: int) -> nnd_pb2.ReadLogsResponse:
    limit = min(max_bytes or DEFAULT_BYTES, MAX_BYTES)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise errors.NotFound(f"no log at {path} yet: its worker has not started since the logs were cleared") from None
    except OSError as exc:
        raise errors.FailedPrecondition(f"cannot read {path}: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        start = max(0, size + offset) if offset < 0 else offset
        if start > size:  # rotated since the last read: the new file from its start
            start = 0
        os.lseek(fd, start, os.SEEK_SET)
        data = os.read(fd, limit)
    finally:
        os.close(fd)
    return nnd_pb2.ReadLogsResponse(data=data, next_offset=start + len(data), size=size, path=path)
