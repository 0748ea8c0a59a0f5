"""`with loss.backward():` — the block in which `.grad` reads and writes gradients."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nnd._tracer import Tracer


class BackwardBlock:
    """A backward pass recorded in the graph (returned by `proxy.backward()`).

    The pass itself is recorded when `backward()` is called; entering the
    block makes `x.grad` (read or assigned) refer to this pass's gradients:

        with model.trace(prompt):
            h = model.transformer.h[0].output
            loss = model.lm_head.output[0, -1, token]
            with loss.backward():
                attribution = (h * h.grad).sum(-1).save()
    """

    def __init__(self, tracer: Tracer, node: int) -> None:
        self._tracer = tracer
        self.node = node
        """The id of the Backward node in the graph."""

    def __enter__(self) -> BackwardBlock:
        self._tracer._backwards.append(self.node)
        return self

    def __exit__(self, *exc: object) -> None:
        stack = self._tracer._backwards
        if stack and stack[-1] == self.node:
            stack.pop()

    def __repr__(self) -> str:
        return f"<nnd backward pass %{self.node}>"
