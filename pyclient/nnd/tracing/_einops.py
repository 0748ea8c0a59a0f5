"""einops on traced values: `einops.rearrange(h, "b s (n d) -> b s n d", n=4)`
inside a block records the same torch ops einops runs on a tensor.

einops picks a backend by asking each `AbstractBackend` subclass whether a
value is its type; this one answers for nnd's proxies and runs torch's
backend's ops on them (reshape, permute, sum, stack...), each recorded.
It is defined when a block opens in a process that has imported einops and
torch, never importing either itself."""

from __future__ import annotations

import sys

_registered: type | None = None  # the backend class, held: einops finds backends through weak subclass links


def register() -> None:
    """Make einops accept proxies (once; only if einops and torch are already imported)."""
    global _registered
    if _registered or "einops" not in sys.modules or "torch" not in sys.modules:
        return
    try:
        from einops._backends import TorchBackend
    except ImportError:  # an einops without the torch backend: nothing to lean on
        return
    from nnd.tracing._proxy import Proxy

    class NndBackend(TorchBackend):  # einops finds it among TorchBackend's subclasses
        framework_name = "nnd"  # in sys.modules: einops instantiates backends of imported packages only

        def is_appropriate_type(self, tensor: object) -> bool:
            return isinstance(tensor, Proxy)

        def shape(self, x: Proxy) -> tuple[int, ...]:
            return tuple(x.shape)

    _registered = NndBackend
