"""Who sent a request, as the daemon can vouch for it.

gRPC in Python does not expose a unix socket's peer credentials, so the daemon
serves a second socket beside its own (`<socket>.who`): a client connects, the
daemon reads the peer's uid with SO_PEERCRED (the kernel's word, not the
client's) and answers with a ticket, `user|expiry|mac`, an HMAC under a key
only the daemon and its workers hold. The client sends the ticket as `nnd-user`
metadata; the daemon and workers verify it. A forged or stale ticket counts as
no ticket. Over TCP the user is the token (`token@HOST`) or the host.

The control plane and the workers both use this module; neither imports the other.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import pwd
import socket
import stat
import struct
import threading
import time
from typing import Any

# CLIENT_KEY: the client's own name for itself (user@host:pid from the Python client), unverified.
from nnd.v1.contract import CLIENT_KEY, USER_KEY

log = logging.getLogger("nnd.identity")

# The workers' copy of the key (never on a command line, which other users can read).
KEY_ENV = "NND_WORKER_IDENTITY_KEY"
TICKET_TTL_S = 7 * 24 * 3600
_VERIFIED_MAX = 4096  # verified tickets kept (Tickets.verify); only valid ones, so one per user and week
SUFFIX = ".who"


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


class Tickets:
    """Mints and checks tickets under one key."""

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key or os.urandom(32)
        # Tickets already verified, with their user and expiry: a client sends the same ticket with every
        # call, and each call is checked twice (who it is from as it opens, whose it is as it runs).
        self._verified: dict[str, tuple[str, float]] = {}

    @classmethod
    def from_env(cls) -> Tickets | None:
        return cls.of_hex(os.environ.pop(KEY_ENV, ""))

    @classmethod
    def of_hex(cls, text: str) -> Tickets | None:
        return cls(bytes.fromhex(text)) if text else None

    def _mac(self, body: str) -> str:
        return hmac.new(self.key, body.encode(), hashlib.sha256).hexdigest()[:32]

    def mint(self, user: str, ttl_s: float = TICKET_TTL_S) -> str:
        body = f"{user.replace('|', '_')[:64]}|{int(time.time() + ttl_s)}"
        return f"{body}|{self._mac(body)}"

    def verify(self, ticket: str | None) -> str | None:
        if not ticket:
            return None
        known = self._verified.get(ticket)
        if known is not None:
            return known[0] if known[1] >= time.time() else None
        if ticket.count("|") != 2:
            return None
        user, expiry, mac = ticket.split("|")
        if not hmac.compare_digest(mac, self._mac(f"{user}|{expiry}")):
            return None  # a forged ticket is never kept: callers cannot fill the memo with junk
        try:
            until = float(expiry)
        except ValueError:
            return None
        if until < time.time():
            return None
        if len(self._verified) >= _VERIFIED_MAX:
            self._verified.clear()
        self._verified[ticket] = (user, until)
        return user


def who(context: Any, tickets: Tickets | None, *, token: bool = False) -> str:
    """The user behind a call: a verified ticket's, else what the transport says."""
    return who_of(context.invocation_metadata() or (), context.peer() or "", tickets, token=token)


def who_of(metadata: Any, peer: str, tickets: Tickets | None, *, token: bool = False) -> str:
    """`who`, from a call's metadata and peer (before any handler runs)."""
    user = tickets.verify(dict(metadata).get(USER_KEY)) if tickets is not None else None
    if user:
        return user
    if peer.startswith("unix"):
        return ""  # an old client, or one that could not reach the .who socket: not known
    host = peer.split(":", 1)[-1].rsplit(":", 1)[0]
    return f"token@{host}" if token else host


# The one identity of every local caller without a valid ticket (raw gRPC, other languages, old
# clients): they share one set of bounds, so skipping the ticket gains nothing.
UNVERIFIED = "unverified local user"


def caller_of(metadata: Any, peer: str, tickets: Tickets | None, *, token: bool = False) -> tuple[str, str]:
    """Who a call is from, for fairness: (the verified identity, the client's own name within it).
    Shares and turns go by the identity; the `nnd-client` name the client chose (its process,
    user@host:pid) only tells its own calls apart, so sending many names buys no more shares."""
    identity = who_of(metadata, peer, tickets, token=token) or UNVERIFIED
    named = ""
    for key, value in metadata or ():
        if key == CLIENT_KEY and isinstance(value, str):
            named = value[:80]
    return identity, named


class WhoServer:
    """The `.who` socket: one connection, one ticket for the connecting uid."""

    def __init__(self, path: str, tickets: Tickets) -> None:
        self.path = path
        self.tickets = tickets
        self._sock: socket.socket | None = None

    def start(self, mode: int = 0o660, gid: int = -1) -> None:
        if os.path.lexists(self.path):
            if not stat.S_ISSOCK(os.lstat(self.path).st_mode):
                raise OSError(f"{self.path} exists and is not a socket")
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, mode)  # the same users as the daemon's socket
        if gid != -1:
            os.chown(self.path, -1, gid)
        sock.listen(64)
        self._sock = sock
        threading.Thread(target=self._serve, name="who", daemon=True).start()

    def _serve(self) -> None:
        sock = self._sock
        while sock is not None:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed
            try:
                conn.settimeout(1.0)
                creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                _pid, uid, _gid = struct.unpack("3i", creds)
                conn.sendall((self.tickets.mint(user_name(uid)) + "\n").encode())
            except OSError as exc:  # a client that went away: its loss
                log.debug("who: %s", exc)
            finally:
                conn.close()

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
