"""The client's name for the address rules, which live in the contract (nnd/v1/address.py)."""

from __future__ import annotations

from nnd.v1.address import SERVICE_SOCKET, default_address, is_loopback, normalize, unix_path, user_socket

__all__ = ["SERVICE_SOCKET", "default_address", "is_loopback", "normalize", "unix_path", "user_socket"]
