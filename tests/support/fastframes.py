"""Frames of a worker's fast socket (nnd.proto, FastCall/FastReply) as a test client writes and reads
them by hand: `frame` (a call's header and body), `read_exact`, and `reply` (one reply frame)."""

from __future__ import annotations

import socket
import struct

from nnd.v1 import nnd_pb2


def frame(header: bytes, body: bytes) -> bytes:
    return struct.pack("<I", len(header)) + header + struct.pack("<Q", len(body)) + body


def read_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        got = sock.recv(n - len(out))
        if not got:
            raise ConnectionError("closed")
        out += got
    return out


def reply(sock: socket.socket) -> tuple[nnd_pb2.FastReply, bytes]:
    """One reply frame: its header and its body."""
    (size,) = struct.unpack("<I", read_exact(sock, 4))
    header = nnd_pb2.FastReply.FromString(read_exact(sock, size))
    (size,) = struct.unpack("<Q", read_exact(sock, 8))
    return header, read_exact(sock, size)
