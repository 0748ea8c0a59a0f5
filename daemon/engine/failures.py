"""Error messages that point at the client's own line."""

from __future__ import annotations

from nnd.v1 import graph_pb2

from .. import errors


def where(node: graph_pb2.Node) -> str:
    """'File "nb.py", line 12, in: <text>' for a node, or its id when the client sent no location."""
    loc = node.loc
    if not loc.file and not loc.line and not loc.text:
        return f"node {node.id}"
    text = f": {loc.text}" if loc.text else ""
    return f'File "{loc.file or "<unknown>"}", line {loc.line}, in{text}'


def scan_unsupported(exc: BaseException) -> str | None:
    """A message when `exc` says an op has no fake/meta implementation (a Scan cannot run it)."""
    from torch._subclasses import fake_tensor

    kinds = (
        fake_tensor.UnsupportedOperatorException,
        fake_tensor.DynamicOutputShapeException,
        fake_tensor.DataDependentOutputException,
    )
    if isinstance(exc, kinds):
        func = getattr(exc, "func", None)
        return f"{func or type(exc).__name__} has no fake/meta implementation (its result depends on data)"
    text = str(exc)
    if isinstance(exc, NotImplementedError) or "meta tensor" in text or "data-dependent" in text:
        return text
    return None


def wrap(exc: BaseException, node: graph_pb2.Node | None, op: str = "", *, scan: bool = False) -> errors.NndError:
    """An NndError for an exception raised while running `node` (or the forward, when node is None)."""
    head = where(node) if node is not None else "in the model's forward"
    if isinstance(exc, errors.NndError):
        if head in exc.message:
            return exc
        return type(exc)(f"{head}\n{exc.message}", exc_type=exc.exc_type)
    if scan:
        unsupported = scan_unsupported(exc)
        if unsupported is not None:
            name = f"op '{op}'" if op else "the model's forward"
            return errors.InvalidArgument(
                f"{head}\n{name} cannot run in a Scan: {unsupported}", exc_type="NotImplementedError"
            )
    return errors.InvalidArgument(f"{head}\n{type(exc).__name__}: {exc}", exc_type=type(exc).__name__)
