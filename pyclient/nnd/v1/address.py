"""Where the daemon listens: one rule shared by `nnd serve` and every client.

Part of the contract (beside the generated stubs), so the daemon imports no
private module of the client."""

from __future__ import annotations

import ipaddress
import os

SERVICE_SOCKET = "/run/nnd/nnd.sock"


def user_socket() -> str | None:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "nnd", "nnd.sock") if runtime else None


def default_address(*, serving: bool = False) -> str:
    """`$NND_ADDRESS`, else `$XDG_RUNTIME_DIR/nnd/nnd.sock`, else /run/nnd/nnd.sock.

    A client whose user socket does not exist falls back to the service's
    socket, so notebooks on a box running the systemd unit need no setting.
    """
    env = os.environ.get("NND_ADDRESS")
    if env:
        return normalize(env)
    mine = user_socket()
    if mine and (serving or os.path.exists(mine)):
        return "unix://" + mine
    return "unix://" + SERVICE_SOCKET


def normalize(address: str) -> str:
    """Accept "unix:///p", "unix:/p", a bare path, or "host:port"."""
    if address.startswith("unix:"):
        return _unix(address)
    if address.startswith(("/", "./", "../", "~")):
        return "unix://" + os.path.abspath(os.path.expanduser(address))
    return address


def _unix(address: str) -> str:
    path = address[len("unix:") :]
    if path.startswith("//"):
        path = path[2:]
    return "unix://" + os.path.abspath(path)


def unix_path(address: str) -> str | None:
    """The socket path of a unix address, else None."""
    return address[len("unix://") :] if address.startswith("unix://") else None


def is_loopback(address: str) -> bool:
    """Whether HOST:PORT names a loopback address: an IP in 127.0.0.0/8 or ::1, or
    `localhost`. A host name that merely starts with "127." (127.0.0.1.example.com)
    is not one."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
