"""Reassembling a Trace/Scan/Generate response stream into saved values."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from nnd import _codec
from nnd.v1 import nnd_pb2, values_pb2


@dataclass(frozen=True)
class StepToken:
    """The tokens one generation step produced: one id (and text) per invoke."""

    step: int
    ids: tuple[int, ...]
    texts: tuple[str, ...] = ()
    trace: int = 0
    """In a session: which of its blocks produced these tokens (0 otherwise)."""

    @property
    def id(self) -> int:
        """The id of the first (usually only) invoke."""
        return self.ids[0]

    @property
    def text(self) -> str:
        """The text of the first invoke's token ("" unless text was streamed)."""
        return self.texts[0] if self.texts else ""


@dataclass
class Results:
    """Everything a response stream carried, decoded."""

    saved: dict[int, Any] = field(default_factory=dict)
    steps: list[StepToken] = field(default_factory=list)
    compute_s: float = 0.0


def collect(
    responses: Iterable[nnd_pb2.TraceResponse],
    *,
    use_torch: bool | None = None,
    on_step: Callable[[StepToken], None] | None = None,
) -> Results:
    """Read a whole response stream. Chunks of a blob are concatenated in
    arrival order; values are decoded once every chunk is in."""
    raw: dict[int, values_pb2.Value] = {}
    chunks: dict[int, list[bytes]] = {}
    out = Results()
    for msg in responses:
        kind = msg.WhichOneof("kind")
        if kind == "saved":
            raw[msg.saved.node] = msg.saved.value
        elif kind == "chunk":
            chunks.setdefault(msg.chunk.blob, []).append(msg.chunk.data)
        elif kind == "step":
            step = StepToken(msg.step.step, tuple(msg.step.ids), tuple(msg.step.text), msg.step.trace)
            out.steps.append(step)
            if on_step is not None:
                on_step(step)
        elif kind == "done":
            out.compute_s = msg.done.compute_s
    decoder = _codec.Decoder({blob: b"".join(parts) for blob, parts in chunks.items()}, use_torch=use_torch)
    out.saved = {node: decoder.value(value) for node, value in raw.items()}
    return out
