"""Errors about how the client is used (raised at once, before anything is sent)."""

from __future__ import annotations

from nnd.errors import NndError


class OutsideTrace(NndError, RuntimeError):
    """A module value or graph operation was used outside a trace block."""


class ValueNotKnown(NndError, TypeError):
    """Python needed the value of a tensor while the block was still being recorded."""


def value_not_known(what: str, text: str) -> ValueNotKnown:
    where = f" in `{text}`" if text else ""
    return ValueNotKnown(
        f"{what}{where} needs a value that is not known while recording: nnd sends the whole "
        "block to the daemon when the `with` ends, so Python cannot branch on or convert a "
        "tensor's value inside it. Save it (`x = ....save()`) and use the value after the "
        "block, or keep the logic in the graph (e.g. `torch.where(cond, a, b)` instead of `if`)."
    )
