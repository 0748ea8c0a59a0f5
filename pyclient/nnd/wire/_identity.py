"""The client's side of who-is-asking: a ticket from the daemon's `.who` socket, which the daemon
mints for this process's uid (read by the kernel, SO_PEERCRED) and which rides on every call as
`nnd-user`, so `nnd ps`, the logs and `--force` checks name the user. No socket (an older daemon,
TCP): no ticket, and the call goes as before."""

from __future__ import annotations

import socket

from nnd.wire import _address


def fetch_ticket(address: str, timeout: float = 2.0) -> str | None:
    path = _address.unix_path(address)
    if not path:
        return None
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(path + ".who")
            data = b""
            while not data.endswith(b"\n") and len(data) < 512:
                chunk = sock.recv(512)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    text = data.decode("ascii", "replace").strip()
    return text if text.count("|") == 2 else None
