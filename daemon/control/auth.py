"""Who may talk to the daemon.

Two parts: `Access`, the listening policy, checked before anything binds
(TCP needs a token, mTLS, or an explicit `--insecure` on loopback), and
`TokenInterceptor` (bearer_tokens.py), the one place a bearer token is checked on every call.
The unix socket is guarded by its file mode; with a token configured it needs
the token too, so one rule covers both listeners.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass

import grpc

from nnd.v1 import address as _address
from nnd_daemon.bearer_tokens import TokenInterceptor, bearer

log = logging.getLogger("nnd.auth")


class AccessError(ValueError):
    """A listening setup that `nnd serve` refuses to start with."""


@dataclass(frozen=True)
class Tls:
    cert: bytes
    key: bytes
    client_ca: bytes | None = None  # set: clients must present a certificate it signed


@dataclass(frozen=True)
class Access:
    """How the daemon may be reached besides its unix socket."""

    listen: str | None = None  # TCP host:port
    token: str | None = None
    insecure: bool = False
    tls: Tls | None = None

    @classmethod
    def build(
        cls,
        *,
        listen: str | None = None,
        token_file: str | None = None,
        insecure: bool = False,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        tls_client_ca: str | None = None,
    ) -> Access:
        """Read the files and check the combination; raises AccessError with a
        one-line reason."""
        if listen and _address.unix_path(_address.normalize(listen)):
            raise AccessError(f"--listen takes HOST:PORT, not a socket path ({listen}); use --address for the socket")
        if (tls_cert or tls_key or tls_client_ca) and not listen:
            raise AccessError("--tls-cert/--tls-key/--tls-client-ca apply to --listen HOST:PORT; add --listen")
        if bool(tls_cert) != bool(tls_key):
            raise AccessError("TLS needs both --tls-cert and --tls-key")
        if tls_client_ca and not tls_cert:
            raise AccessError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
        token = load_token(token_file) if token_file else None
        tls = None
        if tls_cert and tls_key:
            tls = Tls(_read(tls_cert, "--tls-cert"), _read(tls_key, "--tls-key"))
            if tls_client_ca:
                tls = Tls(tls.cert, tls.key, _read(tls_client_ca, "--tls-client-ca"))
        if listen:
            loopback = _address.is_loopback(listen)
            if insecure and not loopback:
                raise AccessError(
                    f"--insecure is only allowed on a loopback address (127.0.0.1, ::1, localhost), not {listen}"
                )
            # mTLS authenticates every connection by certificate, so it stands in for a token.
            authenticated = token is not None or (tls is not None and tls.client_ca is not None)
            if not authenticated and not insecure:
                hint = " (or --insecure, on loopback only)" if loopback else ""
                raise AccessError(f"refusing to listen on {listen} without authentication: give --token-file{hint}")
            if token is not None and tls is None and not loopback:
                log.warning(
                    "listening on %s in plaintext: the token and every request can be read on the network; "
                    "add --tls-cert/--tls-key",
                    listen,
                )
        return cls(listen=listen, token=token, insecure=insecure, tls=tls)

    def credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for the TCP port; None means plaintext."""
        if self.tls is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls.key, self.tls.cert)],
            root_certificates=self.tls.client_ca,
            require_client_auth=self.tls.client_ca is not None,
        )

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        return [TokenInterceptor(self.token)] if self.token else []


def _read(path: str, option: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise AccessError(f"cannot read {option} {path}: {exc.strerror}") from None


def load_token(path: str) -> str:
    """The token in `path`, surrounding whitespace removed."""
    token = _read(path, "--token-file").decode("utf-8", "replace").strip()
    if not token:
        raise AccessError(f"--token-file {path} is empty")
    if any(c.isspace() for c in token):
        raise AccessError(f"--token-file {path} must hold one token without spaces")
    if os.stat(path).st_mode & stat.S_IROTH:
        log.warning("token file %s is readable by every user; chmod 0640 or 0600 it", path)
    return token


__all__ = ["Access", "AccessError", "TokenInterceptor", "Tls", "bearer", "load_token"]
