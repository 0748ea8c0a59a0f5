"""The fast route: a worker's data methods as framed messages on a unix socket (nnd.proto, FastCall).

A gRPC call here costs about a millisecond of HTTP/2 framing, grpc.aio's poller thread and loop, and
thread hand-offs on both sides: a fifth of GPT-2 4x64's forward, and more than nnsight's whole
in-process overhead. On this socket a call is a frame written and a frame read each way.

It serves the same handlers behind the same interceptors as the gRPC route (token check, error
mapping), looked up per call as `asyncserve.Server` does, and keeps its bounds: one loop thread reads
every connection, so a connection that sends nothing holds no thread; a frame that starts must arrive
whole within `idle_s`; connections are bounded per uid (the kernel's SO_PEERCRED) and in all, and one
refused gets a 0 byte before anything runs, so the client takes the gRPC route instead. A complete
call runs on a pool thread, which writes its own replies and serves the connection's next calls too,
whether it reads them itself (`_linger`) or the loop read them first (`_hand_over`). A connection that
closes mid-call cancels the call (its context's callbacks run: the request's Stop), as a cancelled gRPC
call does.

Interact, whose client sends more after its first message, reads its later frames from the same
connection as they come (at most INBOX frames ahead of the run, which a lock-step client never
nears); its handler writes and reads them itself (`Context.post`, `exchange`), as on asyncserve.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import select
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from nnd.v1 import contract, nnd_pb2
from nnd_daemon import asyncserve
from nnd_daemon.worker import onemessage

log = logging.getLogger("nnd.worker.fastroute")

_SERVICE = "/nnd.v1.Nnd/"
METHODS = frozenset({contract.TRACE_ONCE, *contract.DATA_METHODS, "Interact"})
# Later frames of a streaming call read ahead of its handler; a client that sends more is not lock-step.
INBOX = 4
MAX_HEADER = 1 << 20  # a FastCall: metadata and a method name
_HEAD = struct.Struct("<I")
_BODY = struct.Struct("<Q")
_ADMITTED, _REFUSED = b"\x01", b"\x00"
# How long a reply may wait for the client to read it; then the call ends (cancelled), as a
# connection that stopped reading must not hold a handler thread and the model's turn for ever.
WRITE_TIMEOUT_S = 60.0
# How long a pool thread that served a call waits on its connection for the client's next (`_linger`).
LINGER_S = 0.05
# How long a call the loop read waits for the pool thread still serving its connection (`_hand_over`)
# before another pool thread takes it.
HAND_OVER_S = 0.02


class _Ended(Exception):
    """The connection closed (the client went away, or the worker is stopping)."""


class _CallEnded(grpc.RpcError):
    """Raised to a handler writing or reading a call that has ended (its client went away)."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "the call ended"


_GONE = object()  # what a streaming call's inbox holds once its connection closed


class _Details(grpc.HandlerCallDetails):
    def __init__(self, method: str, metadata: tuple[tuple[str, str], ...]) -> None:
        self.method = method
        self.invocation_metadata = metadata


class _Conn:
    """One client connection: the frame being read, and the call it runs (one at a time)."""

    def __init__(self, sock: socket.socket, uid: int) -> None:
        self.sock = sock
        self.uid = uid
        self.head = bytearray()
        self.header_len = -1
        self.body: bytearray | None = None
        self.got = 0
        self.since: float | None = None  # when the frame being read began
        # Bytes of a refused request's body still to come, read and dropped: the client sends its frame
        # whole, and those bytes are not the start of its next call.
        self.skip = 0
        self.call: Context | None = None
        self.closed = False
        self.write_lock = threading.Lock()
        # Whoever reads the connection holds this: the loop, or the pool thread that served its last call
        # and waits on it for the next (FastRoute._linger).
        self.read_lock = threading.Lock()
        # The run of `FastRoute._serve` serving the connection's calls (a token), if any; a call the loop
        # reads meanwhile waits for it in `next` until `next_due` (`FastRoute._hand_over`).
        self.server: object | None = None
        self.next: _Started | None = None
        self.next_due = 0.0

    def reset(self) -> None:
        self.head = bytearray()
        self.header_len = -1
        self.body = None
        self.got = 0
        self.since = None


class Context(asyncserve.CallState):
    """The servicer context the handlers see (the part of grpc.ServicerContext nnd uses)."""

    def __init__(
        self, conn: _Conn, metadata: tuple[tuple[str, str], ...], timeout_s: float, streaming: bool = False
    ) -> None:
        super().__init__(time.monotonic() + timeout_s if timeout_s > 0 else None)
        self._conn = conn
        # A streaming call's later frames (bodies), grpc.aio.EOF once the client said it sends no more.
        self.inbox: queue.SimpleQueue[Any] | None = queue.SimpleQueue() if streaming else None
        self._metadata = metadata
        self._trailers: tuple[Any, ...] = ()
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._initial: tuple[Any, ...] | None = None
        self.answered = False  # the call's last response and OK went out before its handler returned

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return f"unix:fast-route uid {self._conn.uid}"

    def finish(self) -> None:
        """The call is over (ended, or its client went away): run the callbacks once."""
        with self._lock:
            if self._done:
                return
            self._done = True
            callbacks, self._callbacks = self._callbacks, []
        if self.inbox is not None:
            self.inbox.put(_GONE)  # wakes a handler waiting for the client's next message
        self.run_callbacks(callbacks)

    def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise asyncserve.Aborted(code, details)

    def set_trailing_metadata(self, metadata: Any) -> None:
        self._trailers = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def send_initial_metadata(self, metadata: Any) -> None:
        self._initial = tuple(metadata)
        self._send(_reply(nnd_pb2.FastReply(initial_metadata=_pairs(self._initial))), b"")

    def answer(self, response: Any) -> None:
        """A call's last response and its OK status, written now (one write): the handler has its answer
        and what it still does (unwinding, bookkeeping) is off the client's wait. Nothing it does later
        reaches the client; the connection takes the client's next call at once."""
        if self.answered:
            raise RuntimeError("a call is answered once")
        if self._done:  # its client went away: nobody to answer
            return
        self.answered = True
        self._conn.call = None  # before the bytes go out: the client may send its next call as soon as it reads them
        try:
            _write_frames(self._conn, [(_EMPTY, _serialized(response)), (_OK_END, b"")])
        except _Ended:  # the client went away: the run is over anyway, and nothing is owed to anyone
            pass

    # -- a stream its handler drives (Interact: the run writes and reads its own stream) ----------
    def _send(self, header: bytes, body: Any) -> None:
        if self.answered:
            raise RuntimeError("a message after the call's answer")
        try:
            _write(self._conn, header, body)
        except _Ended:
            raise _CallEnded() from None

    def post(self, message: Any = None, *, initial_metadata: Any = None) -> None:
        """Write `message` (or send `initial_metadata`)."""
        if self._done:
            raise _CallEnded()
        if initial_metadata is not None:
            self.send_initial_metadata(initial_metadata)
        else:
            self._send(_EMPTY, _serialized(message))

    def flush(self) -> None:
        """Everything posted is written already."""

    def exchange(self, timeout: float, message: Any = None) -> Any:
        """Write `message` (if given), then the stream's next request: its bytes, grpc.aio.EOF once the
        client sends no more, None when none came within `timeout` seconds. Raises grpc.RpcError
        (CANCELLED) when the call has ended."""
        if message is not None:
            self.post(message)
        return self._next(timeout)

    def _next(self, timeout: float | None) -> Any:
        assert self.inbox is not None
        if self._done:
            raise _CallEnded()
        try:
            item = self.inbox.get(timeout=None if timeout is None else max(0.0, timeout))
        except queue.Empty:
            return None
        if item is _GONE:
            raise _CallEnded()
        return item

    def requests(self, first: bytes) -> Iterator[Any]:
        """A stream's requests: `first`, then the later frames as they come."""
        yield first
        while True:
            item = self._next(None)
            if item is grpc.aio.EOF:
                return
            yield item


def _pairs(metadata: Any) -> list[nnd_pb2.FastMetadata]:
    return [nnd_pb2.FastMetadata(key=str(k), value=v if isinstance(v, str) else v.decode("latin-1")) for k, v in metadata]


def _reply(header: nnd_pb2.FastReply) -> bytes:
    return header.SerializeToString()


def _serialized(message: Any) -> Any:
    if isinstance(message, (bytes, bytearray, memoryview, onemessage.Gathered)):
        return message
    return message.SerializeToString()


def _write(conn: _Conn, header: bytes, body: Any) -> None:
    """One frame, whole, on the connection (a pool thread; the loop only reads)."""
    _write_frames(conn, [(header, body)])


def _write_frames(conn: _Conn, frames: list[tuple[bytes, Any]]) -> None:
    """Frames, whole and in order, in as few writes as the socket takes (a response and its end in one
    `sendmsg`: one wake-up of the client, not two)."""
    parts: list[memoryview] = []
    for header, body in frames:
        size = len(body)  # bytes: a Gathered's are its parts' (written as they are, not joined)
        parts.append(memoryview(_HEAD.pack(len(header)) + header + _BODY.pack(size)))
        if isinstance(body, onemessage.Gathered):
            parts.extend(memoryview(p).cast("B") for p in body.parts if len(p))
        elif size:
            parts.append(memoryview(body).cast("B"))
    deadline = time.monotonic() + WRITE_TIMEOUT_S
    with conn.write_lock:
        while parts:
            if conn.closed:
                raise _Ended()
            try:
                sent = conn.sock.sendmsg(parts)
            except (BlockingIOError, InterruptedError):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _Ended() from None
                select.select([], [conn.sock], [], min(left, 1.0))
                continue
            except OSError:
                raise _Ended() from None
            while sent:
                if sent >= len(parts[0]):
                    sent -= len(parts[0])
                    parts.pop(0)
                else:
                    parts[0] = parts[0][sent:]
                    sent = 0


def _peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return int(struct.unpack("3i", creds)[1])


class FastRoute:
    """Serves METHODS of `add_generic_rpc_handlers`' handlers on a unix socket at `path`.
    `per_uid`, `total`: connections open at once (0: unbounded); `idle_s`: how long a frame may take to
    arrive whole (0: for ever), as asyncserve.Server's bounds on calls waiting for their request."""

    def __init__(
        self,
        path: str,
        *,
        threads: int,
        interceptors: Sequence[grpc.ServerInterceptor] = (),
        idle_s: float = 5.0,
        per_uid: int = 32,
        total: int = 256,
        max_body: int = contract.MAX_MESSAGE,
        max_reading: int = 0,
        name: str = "fast",
    ) -> None:
        self.path = path
        # Bytes of request bodies being read at once, all connections (0: no bound): the worker's
        # max_inflight_bytes, so many connections announcing big requests cannot grow it past that.
        self.max_reading = max_reading
        self._reading = 0
        self._reading_lock = threading.Lock()  # the loop and lingering pool threads both count here
        self.idle_s = idle_s
        self.per_uid = per_uid
        self.total = total
        self.max_body = max_body
        self._lookup = asyncserve.Lookup(interceptors)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._selector = selectors.DefaultSelector()
        self._conns: set[_Conn] = set()
        self._per_uid: dict[int, int] = {}
        self._listener: socket.socket | None = None
        self._stopping = False
        self._name = name
        self._thread: threading.Thread | None = None
        self.refused = 0  # connections turned away at a bound
        self.lingered = 0  # calls a pool thread took from the connection itself (`_linger`)
        self.waiting = 0  # pool threads waiting on a connection now (`_linger`)
        self.handed = 0  # calls the loop read that the thread serving their connection took (`_hand_over`)
        # Wakes the loop to look again (a connection handed back with part of a frame read: its idle bound).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def parked(self) -> int:
        """Calls read by the loop that wait for the thread serving their connection (`_hand_over`)."""
        return sum(1 for c in list(self._conns) if c.next is not None)

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._lookup.generic.extend(handlers)

    def start(self, mode: int = 0o660) -> None:
        if os.path.lexists(self.path):
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise OSError(f"{self.path} exists and is not a socket")
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o777 & ~mode)
        try:
            listener.bind(self.path)
        finally:
            os.umask(old)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._thread = threading.Thread(target=self._loop, name=self._name + "-loop", daemon=True)
        self._thread.start()

    def stop(self, grace: float | None = None) -> threading.Event:
        """Take no more connections and close the open ones (their calls are cancelled)."""
        self._stopping = True
        done = threading.Event()
        listener = self._listener
        if listener is not None:
            try:
                self._selector.unregister(listener)
            except (KeyError, ValueError, OSError):
                pass
            listener.close()
            try:
                os.unlink(self.path)
            except OSError:
                pass
        for conn in list(self._conns):
            self._close(conn)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._wake()
        done.set()
        return done

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full (the loop has a wake-up pending already) or closed
            pass

    # -- the loop thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stopping:
            try:
                events = self._selector.select(self._sweep_after())
            except (OSError, ValueError):
                if self._stopping:
                    return
                raise
            for key, _ in events:
                try:
                    if key.data is None:
                        self._accept()
                    elif key.data is _WAKE:
                        os.read(self._wake_r, 4096)
                    else:
                        self._readable(key.data)
                except Exception:  # noqa: BLE001 - one connection's trouble must not end the socket's loop
                    log.exception("fast route: a connection failed; closed")
                    if key.data is not None:
                        self._close(key.data)
            self._sweep()
            self._unpark()

    def _sweep_after(self) -> float | None:
        now = time.monotonic()
        parked = min((c.next_due for c in self._conns if c.next is not None), default=None)
        after = None if parked is None else max(0.0, parked - now)
        started = [c.since for c in self._conns if c.since is not None] if self.idle_s > 0 else []
        if started:  # (idle_s 0: no cut-off, as asyncserve's --request-idle-timeout 0)
            cut = max(0.0, min(started) + self.idle_s - now)
            after = cut if after is None else min(after, cut)
        if after is None and self._stopping:
            return 1.0
        return after

    def _sweep(self) -> None:
        """End connections whose frame began more than `idle_s` ago and is still not whole."""
        if self.idle_s <= 0:
            return
        now = time.monotonic()
        for conn in [c for c in self._conns if c.since is not None and now - c.since > self.idle_s]:
            log.info("a fast-route connection (uid %d) sent part of a frame and no more within %g s; closed", conn.uid, self.idle_s)
            self._close(conn)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        try:
            uid = _peer_uid(sock)
        except OSError:
            sock.close()
            return
        mine = self._per_uid.get(uid, 0)
        if (self.total and len(self._conns) >= self.total) or (self.per_uid and mine >= self.per_uid):
            self.refused += 1
            log.info(
                "fast route: refused a connection of uid %d (%d of its own open, %d in all; bounds %d and %d): "
                "its calls take the gRPC route",
                uid, mine, len(self._conns), self.per_uid, self.total,
            )
            try:
                sock.send(_REFUSED)
            except OSError:
                pass
            sock.close()
            return
        try:
            sock.send(_ADMITTED)
        except OSError:
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, uid)
        self._conns.add(conn)
        self._per_uid[uid] = mine + 1
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.body is not None:  # a body it was sending: no longer being read
            with self._reading_lock:
                self._reading -= len(conn.body)
            conn.body = None
        if conn in self._conns:
            self._conns.discard(conn)
            left = self._per_uid.get(conn.uid, 1) - 1
            if left:
                self._per_uid[conn.uid] = left
            else:
                self._per_uid.pop(conn.uid, None)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass
        with self._reading_lock:
            conn.next = None  # a call waiting for its connection's thread: its client is gone
        call = conn.call
        if call is not None:
            call.finish()  # the request's Stop: it ends at its next check
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.sock.close()

    def _readable(self, conn: _Conn) -> None:
        if not conn.read_lock.acquire(blocking=False):
            return  # a pool thread reads it now (`_linger`): this event came before it took it out of the selector
        try:
            started = self._readable_locked(conn)
        finally:
            conn.read_lock.release()
        if started is not None:
            self._hand_over(conn, started)

    def _hand_over(self, conn: _Conn, started: _Started) -> None:
        """A call the loop read goes to the pool thread still serving its connection, if one is, else to
        a new one. A call answered early (Context.answer: a batched run's members) lets its client send
        the next before the thread that served it has unwound; waking another pool thread for it cost
        a hand-off a trace (eight clients: a third of all calls). The thread takes it on its way out
        (`_handed`); one that has not within HAND_OVER_S (its handler runs on after its answer) leaves
        it to another (`_unpark`)."""
        with self._reading_lock:
            if conn.server is not None:
                conn.next, conn.next_due = started, time.monotonic() + HAND_OVER_S
                return
            conn.server = server = object()
        self._submit(conn, server, started)

    def _submit(self, conn: _Conn, server: object, started: _Started) -> None:
        try:
            self._pool.submit(self._serve, server, *started)
        except RuntimeError:  # shutting down
            self._close(conn)

    def _handed(self, conn: _Conn, server: object) -> _Started | None:
        """The call the loop left for this run of `_serve`, if any; else the run ends (None)."""
        with self._reading_lock:
            if conn.server is not server:  # another run serves the connection now
                return None
            started, conn.next = conn.next, None
            if started is None:
                conn.server = None
            return started

    def _unpark(self) -> None:
        """Calls that waited HAND_OVER_S for the thread serving their connection go to new pool threads."""
        now = time.monotonic()
        due: list[tuple[_Conn, object, _Started]] = []
        with self._reading_lock:
            for conn in self._conns:  # (the loop's own set: this runs on the loop)
                if conn.next is not None and conn.next_due <= now:
                    conn.server = server = object()
                    due.append((conn, server, conn.next))
                    conn.next = None
        for conn, server, started in due:
            self._submit(conn, server, started)

    def _readable_locked(self, conn: _Conn) -> _Started | None:
        if conn.call is not None and conn.call.inbox is None and not conn.skip:
            # Mid-call a client sends nothing: this is its end (EOF) or a second call before the first
            # ended. Either way the call is cancelled and the connection closed.
            try:
                data = conn.sock.recv(1)
            except (BlockingIOError, InterruptedError):
                return None
            except OSError:
                data = b""
            if data:
                log.info("a fast-route client (uid %d) sent a second call before its first ended; closed", conn.uid)
            self._close(conn)
            return None
        try:
            return self._read(conn)
        except (BlockingIOError, InterruptedError):
            return None
        except (OSError, _Ended):
            self._close(conn)
            return None

    def _read(self, conn: _Conn) -> _Started | None:
        """Read what has arrived of the connection's frame. Each part (length, header, body) whose bytes
        are all there leads straight to the next: a small frame is read in one wake-up of the loop, not
        one per part (a recv that finds nothing raises BlockingIOError, which `_readable` takes). Returns
        the call a whole frame starts (for a pool thread to serve), if any."""
        if conn.since is None:
            conn.since = time.monotonic()
        if conn.skip:
            while conn.skip:  # a refused body: dropped as it comes (a recv that finds nothing raises)
                data = conn.sock.recv(min(conn.skip, 1 << 16))
                if not data:
                    raise _Ended()
                conn.skip -= len(data)
            conn.since = None  # the frame is over: what comes next is the next call's
            return None
        while conn.body is None:
            need = _HEAD.size if conn.header_len < 0 else _HEAD.size + conn.header_len + _BODY.size
            data = conn.sock.recv(need - len(conn.head))
            if not data:
                raise _Ended()
            conn.head += data
            if len(conn.head) < need:
                return None
            if conn.header_len < 0:
                (conn.header_len,) = _HEAD.unpack_from(conn.head)
                if conn.header_len > MAX_HEADER:
                    log.info("a fast-route frame's header of %d bytes is over %d; closed", conn.header_len, MAX_HEADER)
                    raise _Ended()
                continue
            (size,) = _BODY.unpack_from(conn.head, _HEAD.size + conn.header_len)
            refusal = ""
            if size > self.max_body:
                refusal = f"the request is {size} bytes, over this socket's {self.max_body}; nothing ran"
            elif self.max_reading and self._reading + size > self.max_reading:  # (read without the lock: a bound)
                refusal = (
                    f"the worker is reading {self._reading} bytes of other requests; with this one's {size} that is "
                    f"over its limit max_inflight_bytes={self.max_reading}; nothing ran, retry shortly"
                )
            if refusal:
                header = bytes(conn.head[_HEAD.size : _HEAD.size + conn.header_len])
                started = self._start(conn, header, None, size, refusal)
                conn.skip = size  # its body follows, unread: dropped, so the stream stays framed
                if size:
                    conn.since = time.monotonic()  # (its bytes must keep coming: the idle bound applies)
                return started
            try:  # untouched pages cost nothing: memory grows as the body arrives, as gRPC's buffers do
                conn.body = bytearray(size)
            except MemoryError:
                log.info("fast route: no memory for a %d-byte request; its connection closed", size)
                raise _Ended() from None
            with self._reading_lock:
                self._reading += size
            conn.got = 0
        if conn.got < len(conn.body):
            n = conn.sock.recv_into(memoryview(conn.body)[conn.got :])
            if not n:
                raise _Ended()
            conn.got += n
        if conn.got < len(conn.body):
            return None
        header = bytes(conn.head[_HEAD.size : _HEAD.size + conn.header_len])
        with self._reading_lock:
            self._reading -= len(conn.body)
        return self._start(conn, header, conn.body, len(conn.body))

    def _start(self, conn: _Conn, header: bytes, body: bytearray | None, size: int, refusal: str = "") -> _Started | None:
        """A whole frame came: the call it starts, for a pool thread (a streaming call's later frame goes
        to its call instead)."""
        conn.reset()
        try:
            call = nnd_pb2.FastCall.FromString(header)
        except Exception:  # noqa: BLE001 - not a FastCall: the client speaks something else
            log.info("a fast-route frame's header is not a FastCall; closed")
            raise _Ended() from None
        running = conn.call
        if running is not None:  # a later frame of a streaming call (its header empty, or half_close)
            if body is None or call.method or running.inbox.qsize() >= INBOX:  # type: ignore[union-attr]
                log.info("a fast-route client (uid %d) sent a frame its call does not take; closed", conn.uid)
                raise _Ended()
            running.inbox.put(grpc.aio.EOF if call.half_close else bytes(body))  # type: ignore[union-attr]
            return None
        if call.half_close and not call.method:  # a streaming call's last word, after its end: nothing to do
            return None
        metadata = tuple((m.key, m.value) for m in call.metadata)
        context = Context(conn, metadata, call.timeout_s, streaming=call.method == "Interact")
        conn.call = context
        return conn, context, call.method, body, refusal

    # -- a pool thread --------------------------------------------------------------------------
    def _serve(
        self, server: object, conn: _Conn, context: Context, method: str, body: bytearray | None, refusal: str
    ) -> None:
        """Serve a call, then the calls its client sends next on the connection while this thread waits
        for them (`_linger`) or the loop reads them (`_hand_over`). `server`: this run's token."""
        started: _Started | None = (conn, context, method, body, refusal)
        try:
            while started is not None:
                self._serve_call(*started)
                started = self._linger(conn)
                if started is None:
                    started = self._handed(conn, server)
                    if started is not None:
                        self.handed += 1
        except BaseException:
            # Nothing else serves the connection now: a call left for this run must not wait for ever.
            log.exception("fast route: the thread serving a connection failed; closed")
            _shut(conn)
            raise

    def _linger(self, conn: _Conn) -> _Started | None:
        """After a call: wait up to LINGER_S on its connection for the client's next call, read here. A
        client calling in a loop (a sweep over prompts) then wakes this thread directly, instead of the
        loop that wakes a pool thread: on a 2-core VM each wake-up costs its waker ~50 us of CPU, and the
        hand-off as much again in latency. The thread only waits (in poll), and there are more threads
        than connections (listen.py), so no call waits for one. Returns the call that came, if any."""
        if self._stopping or conn.closed or LINGER_S <= 0 or not conn.read_lock.acquire(blocking=False):
            return None
        try:
            if conn.call is not None or conn.closed:  # the loop read the next call first
                return None
            try:
                self._selector.unregister(conn.sock)
            except (KeyError, ValueError, OSError):  # closed meanwhile
                return None
            try:
                started = self._next_call(conn)
            finally:
                self._hand_back(conn)
        finally:
            conn.read_lock.release()
        if started is not None:
            self.lingered += 1
        return started

    def _next_call(self, conn: _Conn) -> _Started | None:
        deadline = time.monotonic() + LINGER_S
        poller = select.poll()
        poller.register(conn.sock, select.POLLIN)
        with self._reading_lock:
            self.waiting += 1
        try:
            return self._poll_call(conn, poller, deadline)
        finally:
            with self._reading_lock:
                self.waiting -= 1

    def _poll_call(self, conn: _Conn, poller: select.poll, deadline: float) -> _Started | None:
        while not (conn.closed or self._stopping):
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1e3):
                return None
            try:
                started = self._read(conn)
            except (BlockingIOError, InterruptedError):
                continue
            except (OSError, _Ended):
                _shut(conn)  # what it read is gone
                return None
            if started is not None or conn.call is not None:
                return started
        return None

    def _hand_back(self, conn: _Conn) -> None:
        """The loop watches the connection again (during a call too: its end cancels the call)."""
        if conn.closed:
            return
        try:
            self._selector.register(conn.sock, selectors.EVENT_READ, conn)
        except (KeyError, ValueError, OSError):
            return
        if conn.since is not None:  # part of a frame read here: the loop's idle bound must count it from now
            self._wake()

    def _serve_call(self, conn: _Conn, context: Context, method: str, body: bytearray | None, refusal: str) -> None:
        code, details = grpc.StatusCode.OK, ""
        try:
            if body is None:
                raise asyncserve.Aborted(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            handler = self._lookup(_Details(_SERVICE + method, context.invocation_metadata()))
            streaming = context.inbox is not None
            if method not in METHODS or handler is None or handler.request_streaming != streaming:
                raise asyncserve.Aborted(grpc.StatusCode.UNIMPLEMENTED, f"the fast route does not serve {method!r}")
            deserialize = handler.request_deserializer or bytes
            request: Any = deserialize(bytes(body))
            serialize = handler.response_serializer or (lambda m: m)
            if streaming:
                requests = (r if i == 0 else deserialize(r) for i, r in enumerate(context.requests(request)))
                request = requests
            if handler.response_streaming:
                behavior = handler.stream_stream if streaming else handler.unary_stream
                responses: Iterator[Any] = behavior(request, context)
                try:
                    for response in responses:
                        if context.answered:
                            raise RuntimeError("a response after the call's answer")
                        _write(conn, _EMPTY, serialize(response))
                finally:
                    close = getattr(responses, "close", None)
                    if close is not None:
                        close()  # a generator stopped early (the client went away) runs its cleanup now
            else:
                response = handler.unary_unary(request, context)
                if context.answered:  # its answer went out already (Context.answer)
                    context.finish()
                    return
                if context._code is None:
                    context.finish()
                    conn.call = None  # before the bytes go out: the client may send its next call at once
                    _write_frames(conn, [(_EMPTY, serialize(response)), (_end(context, grpc.StatusCode.OK, ""), b"")])
                    return
                _write(conn, _EMPTY, serialize(response))
            if context._code is not None:
                code, details = context._code, context._details
        except asyncserve.Aborted as aborted:
            code, details = aborted.code, aborted.details
        except (_Ended, _CallEnded):
            context.finish()
            return
        except Exception:  # noqa: BLE001 - what no interceptor mapped: a status, never a dead connection
            log.exception("fast route: %s failed", method)
            code, details = grpc.StatusCode.UNKNOWN, "internal error in worker"
        if context.answered:  # the client has its answer and OK: what failed after is the worker's to log
            if code != grpc.StatusCode.OK:
                log.warning("fast route: %s failed after its answer went out: %s %s", method, code.name, details)
            context.finish()
            return
        end = _end(context, code, details)
        context.finish()
        conn.call = None  # before the end goes out: the client may send its next call as soon as it reads it
        try:
            _write(conn, end, b"")
        except _Ended:
            pass


def _shut(conn: _Conn) -> None:
    """From a pool thread: end the connection through the loop, which sees its end and closes it (the
    loop alone closes connections: it owns the selector and the set of them)."""
    try:
        conn.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _end(context: Context, code: grpc.StatusCode, details: str) -> bytes:
    return _reply(
        nnd_pb2.FastReply(end=True, code=code.value[0], details=details, trailing_metadata=_pairs(context._trailers))
    )


_EMPTY = b""
_WAKE = object()  # the selector's key data of the loop's wake-up pipe
_Started = tuple[_Conn, Context, str, "bytearray | None", str]  # a call a whole frame starts, for `_serve`
_OK_END = _reply(nnd_pb2.FastReply(end=True, code=grpc.StatusCode.OK.value[0]))
