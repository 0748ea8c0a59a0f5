"""The fast route, client side (nnd.proto, Route.fast_address and FastCall).

Where a model's route offers a fast socket, its TraceOnce, Trace, Generate,
Session and Interact calls go there as framed messages instead of gRPC calls: a
frame written and frames read on a connection kept open between calls (one per
concurrent call, a few kept idle). An Interact call's later messages go out
from the reading thread itself, before each read (the block puts them before it
waits for the answer). Failures read as the gRPC call's would
(`FastError` is a `grpc.RpcError` with a code, details and metadata), so the
router treats both alike. A connection the worker refuses, or that cannot be
made, raises `Unreachable` before anything was sent: the call takes the gRPC
route. `NND_FAST=0` turns the fast route off in this process.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from nnd.v1 import nnd_pb2
from nnd.wire._warm import WarmBuffers

_HEAD = struct.Struct("<I")
_BODY = struct.Struct("<Q")
_ADMITTED = b"\x01"
_KEEP_IDLE = 4  # connections kept open between calls, per route
_HEADERS_KEPT = 16  # serialized FastCall headers kept, per route
_CODES = {code.value[0]: code for code in grpc.StatusCode}


def enabled() -> bool:
    return os.environ.get("NND_FAST") != "0"


class Unreachable(Exception):
    """No connection could be made, or the worker refused it: nothing was sent."""


class FastError(grpc.RpcError):
    """A fast-route call that ended with a status other than OK, read as a gRPC call's error."""

    def __init__(
        self,
        code: grpc.StatusCode,
        details: str,
        trailers: Sequence[tuple[str, str]] = (),
        initial: Sequence[tuple[str, str]] = (),
    ) -> None:
        super().__init__(details)
        self._code = code
        self._details = details
        self._trailers = tuple(trailers)
        self._initial = tuple(initial)

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailers

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._initial

    def __str__(self) -> str:
        return f"{self._code}: {self._details}"


def _send_frame(sock: socket.socket, header: bytes, body: bytes) -> None:
    """One frame (nnd.proto, FastCall): the header's length, the header, the body's length, the body."""
    prefix = _HEAD.pack(len(header)) + header + _BODY.pack(len(body))
    if len(body) < 1 << 16:
        sock.sendall(prefix + body)
    else:  # not copied into one buffer first
        sock.sendall(prefix)
        sock.sendall(body)


def _set_timeout(sock: socket.socket, timeout: float | None) -> None:
    # settimeout is a system call (the socket's blocking mode) even when nothing changes.
    if sock.gettimeout() != timeout:
        sock.settimeout(timeout)


def _closed(exc: OSError, initial: tuple[tuple[str, str], ...]) -> FastError:
    return FastError(grpc.StatusCode.UNAVAILABLE, f"the worker's fast route closed the connection ({exc})", (), initial)


_RECYCLED_MIN = 1 << 20  # parts this big are read into recycled memory (`_fresh`)
_READ_AHEAD = 1 << 16  # what one recv may take of a reply's bytes beyond the part being read


_received = WarmBuffers()  # big parts' memory, recycled (a result's chunks are copied out, then it is garbage)


def _fresh(size: int) -> bytearray | np.ndarray:
    """Memory for a part of `size` bytes, about to be written whole. A big one is recycled memory
    (_warm.py): `bytearray(n)` zero-fills every page first, and fresh pages fault one by one (for a
    256 MiB result, ~200 ms of the ~330 ms it took beyond computing it)."""
    return bytearray(size) if size < _RECYCLED_MIN else _received.take(size)


class _Reader:
    """A connection's incoming bytes: one recv takes whatever has arrived (a whole small frame, often
    with the next), so a reply costs one syscall instead of one per part (length, header, length,
    body). A part bigger than the read-ahead goes straight into its own buffer."""

    def __init__(self, sock: socket.socket, deadline: float | None) -> None:
        self._sock = sock
        self._deadline = deadline
        self._buf = bytearray()

    def take(self, size: int) -> bytearray | np.ndarray:
        buf = self._buf
        while len(buf) < size and size - len(buf) <= _READ_AHEAD:
            buf += self._recv(_READ_AHEAD)
        if len(buf) >= size:
            part = buf[:size]
            del buf[:size]  # from the front: CPython moves the start, not the bytes
            return part
        part = _fresh(size)
        got = len(buf)
        view = memoryview(part)
        view[:got] = buf
        buf.clear()
        while got < size:
            self._wait()
            n = self._sock.recv_into(view[got:])
            if not n:
                raise ConnectionResetError("the worker closed the connection")
            got += n
        return part

    def _recv(self, size: int) -> bytes:
        self._wait()
        data = self._sock.recv(size)
        if not data:
            raise ConnectionResetError("the worker closed the connection")
        return data

    def _wait(self) -> None:
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError()
            self._sock.settimeout(left)


class FastCall:
    """One call's replies: iterate for the response bodies; raises FastError for a failed status."""

    def __init__(
        self,
        channel: FastChannel,
        sock: socket.socket,
        deadline: float | None,
        more: Any = None,
    ) -> None:
        self._channel = channel
        self._more = more  # later messages this thread writes before each read (`ready()`)
        self._sock: socket.socket | None = sock
        self._reader = _Reader(sock, deadline)
        self._initial: tuple[tuple[str, str], ...] = ()

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._initial

    def cancel(self) -> None:
        """End the call if it has not ended: the connection closes, and the worker cancels the call."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __iter__(self) -> Iterator[bytearray]:
        try:
            while self._sock is not None:
                if self._more is not None:
                    self._send_ready(self._sock)
                header, body = self._frame(self._sock)
                if header.initial_metadata:
                    self._initial = tuple((m.key, m.value) for m in header.initial_metadata)
                if header.end:
                    # Reused only when the client has said all it will: nothing of this call can follow.
                    if self._more is None or self._more.ended:
                        sock, self._sock = self._sock, None
                        self._channel.give_back(sock)
                    if header.code:
                        trailers = tuple((m.key, m.value) for m in header.trailing_metadata)
                        code = _CODES.get(header.code, grpc.StatusCode.UNKNOWN)
                        raise FastError(code, header.details, trailers, self._initial)
                    return
                if not header.initial_metadata:
                    yield body
        finally:
            self.cancel()  # left before the end (an error, or the caller stopped reading): not reusable

    def _send_ready(self, sock: socket.socket) -> None:
        for message in self._more.ready():
            try:
                _send_frame(sock, b"", message.SerializeToString())  # a later message: an empty header
            except OSError as exc:
                raise _closed(exc, self._initial) from None

    def _frame(self, sock: socket.socket) -> tuple[nnd_pb2.FastReply, bytearray]:
        read = self._reader.take
        try:
            (size,) = _HEAD.unpack(read(_HEAD.size))
            header = nnd_pb2.FastReply.FromString(read(size))
            (size,) = _BODY.unpack(read(_BODY.size))
            body = read(size)
        except TimeoutError:
            raise FastError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", (), self._initial) from None
        except OSError as exc:
            raise _closed(exc, self._initial) from None
        return header, body


class FastChannel:
    """Connections to one worker's fast socket: a call takes one (an idle one, else a new one) and gives
    it back when its reply has ended."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._idle: list[socket.socket] = []
        self._pid = os.getpid()
        self._headers: dict[tuple[str, tuple[tuple[str, str], ...], float], bytes] = {}

    def _connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(10.0)
            sock.connect(self.path)
            if sock.recv(1) != _ADMITTED:
                raise Unreachable(f"the worker's fast route at {self.path} refused the connection")
        except OSError as exc:
            sock.close()
            raise Unreachable(f"cannot connect to {self.path}: {exc}") from None
        except Unreachable:
            sock.close()
            raise
        return sock

    def _take(self) -> tuple[socket.socket, bool]:
        """A connection, and whether it was open before (it may have been closed by the worker since)."""
        with self._lock:
            if self._pid != os.getpid():  # a forked child: its parent's connections are not its own
                self._idle, self._pid = [], os.getpid()
            while self._idle:
                sock = self._idle.pop()
                # An idle connection has nothing to read: readable means the worker closed it.
                if not select.select([sock], [], [], 0)[0]:
                    return sock, True
                sock.close()
        return self._connect(), False

    def give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if self._pid == os.getpid() and len(self._idle) < _KEEP_IDLE:
                _set_timeout(sock, None)
                self._idle.append(sock)
                return
        sock.close()

    def call(
        self,
        method: str,
        request: bytes,
        metadata: Sequence[tuple[str, str]],
        timeout: float | None,
        more: Any = None,
    ) -> FastCall:
        """Send the call; raises Unreachable if it could not be sent whole (then nothing ran). `more`: a
        streaming call's later messages, whose `ready()` gives those put since (and `ended` says whether
        the client has said all): the call writes them before each read (see FastCall)."""
        header = self._header(method, tuple(metadata), timeout or 0.0)
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in range(2):
            sock, reused = self._take()
            try:
                _set_timeout(sock, None if timeout is None else max(timeout, 0.001))
                _send_frame(sock, header, request)
            except OSError as exc:
                sock.close()
                if reused:  # the worker closed it while it sat idle: a fresh one
                    continue
                raise Unreachable(f"cannot send to {self.path}: {exc}") from None
            return FastCall(self, sock, deadline, more=more)
        raise Unreachable(f"cannot send to {self.path}")

    def _header(self, method: str, metadata: tuple[tuple[str, str], ...], timeout_s: float) -> bytes:
        """A call's FastCall, serialized: the same for every call of a block that has no timeout, so
        kept (a few per channel: methods x metadata)."""
        key = (method, metadata, timeout_s)
        header = self._headers.get(key)
        if header is None:
            header = nnd_pb2.FastCall(
                method=method,
                metadata=[nnd_pb2.FastMetadata(key=k, value=v) for k, v in metadata],
                timeout_s=timeout_s,
            ).SerializeToString()
            if timeout_s == 0.0:  # a timeout is a deadline: rarely the same twice
                if len(self._headers) >= _HEADERS_KEPT:
                    self._headers.clear()
                self._headers[key] = header
        return header

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()


def unary(call: FastCall, parse: Callable[[bytearray], Any]) -> Any:
    """The one response of a unary call (TraceOnce)."""
    response = None
    for body in call:
        response = parse(body)
    if response is None:
        raise FastError(grpc.StatusCode.INTERNAL, "the worker ended the call without a response")
    return response
