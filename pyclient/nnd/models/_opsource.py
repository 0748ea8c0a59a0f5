"""`envoy.source`: the operations inside a module's forward, as nnsight 0.8 names and prints them.

The names and the forward's text come from the daemon (GetSource, answered on
the META model), fetched the first time a module's `.source` is used and kept
per model handle. Inside a block, `source.<op>.output` / `.input` / `.inputs`
read and write that operation's values: graph nodes whose ModuleValue carries
the module path and the operation name.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from nnd.v1 import graph_pb2, nnd_pb2

if TYPE_CHECKING:
    from nnd.models._envoy import Envoy
    from nnd.tracing._proxy import Proxy
    from nnd.tracing._tracer import Tracer


def _address(envoy: Envoy) -> str:
    """The module as nnsight prints it: "model.transformer.h.0.attn"."""
    return f"model.{envoy._path}" if envoy._path else "model"


def fetch(envoy: Envoy) -> Source:
    model = envoy._model
    if model is None:
        raise AttributeError("`.source` needs a model handle")
    cache: dict[str, nnd_pb2.SourceInfo] = model.__dict__.setdefault("_sources", {})
    info = cache.get(envoy._path)
    if info is None:
        request = nnd_pb2.GetSourceRequest(model=model._name, path=envoy._path)
        info = cache[envoy._path] = model._conn.call("GetSource", request)
    return Source(envoy, info)


class Source:
    """A module's forward as operations: `source.<name>` is one (`attention_interface_1`,
    `self_c_attn_0`); `print(source)` shows the forward with every name at its line."""

    def __init__(self, envoy: Envoy, info: nnd_pb2.SourceInfo) -> None:
        self._envoy = envoy
        self._info = info
        self._lines = {op.name: op.line for op in info.ops}

    @property
    def names(self) -> tuple[str, ...]:
        """Every operation, in evaluation order."""
        return tuple(op.name for op in self._info.ops)

    @property
    def _prefix(self) -> str:
        return _address(self._envoy) + ".source"

    def __getattr__(self, name: str) -> SourceOp:
        if name.startswith("__") or name in ("_envoy", "_info", "_lines"):  # a private op (`_foo_0`) is a name
            raise AttributeError(name)
        if name not in self._lines:
            close = difflib.get_close_matches(name, self.names, n=5, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise AttributeError(
                f"{self._prefix!r} has no operation {name!r}{hint} (print `{self._prefix}` for every name)"
            )
        return SourceOp(self._envoy, name, self._info.source, self._lines[name])

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(self.names))

    def __iter__(self) -> Iterator[SourceOp]:
        for name in self.names:
            yield getattr(self, name)

    def __len__(self) -> int:
        return len(self._info.ops)

    def __repr__(self) -> str:
        # nnsight 0.8.1's layout: the first source line marked "*", then every line numbered
        # from 0 with the operations on it in a left gutter ("+" for a line's further ones).
        names = self.names
        width = max((len(n) for n in names), default=0)
        lines = self._info.source.split("\n")
        by_line: dict[int, list[str]] = {}
        for name in names:
            by_line.setdefault(self._lines[name] - 2, []).append(name)
        out = [" " * (width + 6) + "* " + lines[0]]
        for i, line in enumerate(lines[1:]):
            ops = by_line.get(i)
            if not ops:
                out.append(" " * (width + 4) + f"{i:3d} {line}")
                continue
            out.append(f" {ops[0]:{width}} ->{i:3d} {line}")
            indent = " " * (len(line) - len(line.lstrip()))
            out.extend(f" {op:{width}} ->  + {indent}..." for op in ops[1:])
        return "\n".join(out)


class SourceOp:
    """One operation of a forward: `.output` (what the call returned, or the assigned value),
    `.input` (its first argument), `.inputs` ((args, kwargs)), each readable and assignable inside
    a block, and `.skip(value)` (do not make the call)."""

    def __init__(self, envoy: Envoy, op: str, text: str, line: int) -> None:
        self._envoy = envoy
        self._op = op  # "a", or "a.b" for operation b inside the function operation a calls
        self.name = op.rpartition(".")[2]
        self._text = text
        self._line = line

    @property
    def path(self) -> str:
        return f"{_address(self._envoy)}.source." + ".source.".join(self._op.split("."))

    def _tracer(self, what: str) -> Tracer:
        return self._envoy._tracer(f"{self.path}.{what}")

    @property
    def output(self) -> Proxy:
        return self._tracer("output")._module(self._envoy._path, graph_pb2.OUTPUT, op=self._op)

    @output.setter
    def output(self, value: Any) -> None:
        self._tracer("output")._set(self._envoy._path, graph_pb2.OUTPUT, value, op=self._op)

    @property
    def input(self) -> Proxy:
        return self._tracer("input")._module(self._envoy._path, graph_pb2.INPUT, op=self._op)

    @input.setter
    def input(self, value: Any) -> None:
        self._tracer("input")._set(self._envoy._path, graph_pb2.INPUT, value, op=self._op)

    @property
    def inputs(self) -> Proxy:
        return self._tracer("inputs")._module(self._envoy._path, graph_pb2.INPUTS, op=self._op)

    @inputs.setter
    def inputs(self, value: Any) -> None:
        self._tracer("inputs")._set(self._envoy._path, graph_pb2.INPUTS, value, op=self._op)

    def skip(self, value: Any) -> None:
        """Do not make this call; use `value` as its output."""
        self._tracer("skip()")._skip(self._envoy._path, value, op=self._op)

    @property
    def source(self) -> CalledSource:
        """The operations inside the function this operation calls (nnsight's nested `.source`):
        `attn.source.attention_interface_1.source.nn_functional_softmax_0.output`."""
        return CalledSource(self)

    def __repr__(self) -> str:
        if not self._text:  # inside a called function: its text is known only when it runs
            return self.path
        # nnsight 0.8.1's window: a few lines around the operation, marked --> <--.
        lines = self._text.split("\n")
        at = self._line - 2
        start, end = max(0, at - 5), min(len(lines) - 1, at + 8)
        out = [self.path + ":\n"]
        if start != 0:
            out.append("    ....")
        for i in range(start, end):
            out.append(f"    --> {lines[i][4:]} <--" if i == at + 1 else "    " + lines[i])
        if end != len(lines) - 1:
            out.append("    ....")
        return "\n".join(out)


class CalledSource:
    """The operations of the function an operation calls. The callee is a value of the running
    forward (an attention implementation chosen by the config, say), so the daemon learns it only
    when the call runs: names are checked then (NOT_FOUND naming the close ones), and there is
    nothing to print beforehand."""

    def __init__(self, op: SourceOp) -> None:
        self._of = op

    def __getattr__(self, name: str) -> SourceOp:
        if name.startswith("__") or name == "_of":
            raise AttributeError(name)
        return SourceOp(self._of._envoy, f"{self._of._op}.{name}", "", 0)

    def __repr__(self) -> str:
        return (
            f"{self._of.path}.source: the operations of the function this operation calls, known when it runs; "
            "name one (`.source.<name>.output`) inside a trace"
        )
