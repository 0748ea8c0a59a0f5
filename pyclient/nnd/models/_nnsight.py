"""`nnd.NNsight(module, example_inputs)`: any torch module, held by the daemon without shipping code.

The client exports the module with `torch.export.export` (every dimension of
the example tensors `Dim.AUTO`: dynamic where the module allows it; a batch
dimension of 1 is exported from a batch of 2, since torch fixes a dimension
whose example size is 1), writes the program with `torch.export.save`, and
uploads it with the original module types (modules.json). The daemon reads the
program without running any of its Python (see the daemon's
export/exported.py) and rebuilds the module tree with `torch.export.unflatten`:
the same module paths, so `wrapped[0].output`, `.input`, edits, skips and
`wrapped.layer(x)` calls work as on a transformers model, in `trace` and in
`scan` (which runs the META program, weights on the meta device, under fake
tensors). Inputs are tensors: the positional arguments of `trace(...)` or
`tracer.invoke(...)`, concatenated along dimension 0 when there are several
invokes.

What export changes: the graph is the module's computation for the example's
structure (train/eval mode, Python branches on shapes and flags are fixed at
export); a module that runs only some children leaves the others out of the
tree; a module called twice appears once per call (torch names the second
`<path>@1`... see torch.export.unflatten).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Mapping
from typing import Any

from nnd.errors import ExportError
from nnd.models._upload import Payload, _Uploaded, modules_json
from nnd.tracing import _tracer
from nnd.v1 import nnd_pb2
from nnd.wire import _codec

from ._model import TransformersModel

# torch.export traces under process-wide dispatch modes (one ProxyTorchDispatchMode slot):
# two exports at once in one process fail, so threads take turns.
_EXPORT_LOCK = threading.Lock()


def _as_args(example_inputs: Any) -> tuple[Any, ...]:
    return tuple(example_inputs) if isinstance(example_inputs, tuple) else (example_inputs,)


def export(module: Any, example_inputs: Any, *, dynamic: bool = True) -> bytes:
    """The module as a `torch.export.save` archive; raises ExportError with torch's reason."""
    import torch
    from torch.export import Dim

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"NNsight wraps a torch.nn.Module, not a {type(module).__name__}")
    args = _as_args(example_inputs)
    # Under the lock: another thread's export of the same module swaps its parameters while it traces.
    with _EXPORT_LOCK:
        placed = {t.device.type for t in [*module.parameters(), *module.buffers()]}
    placed |= {a.device.type for a in args if isinstance(a, torch.Tensor)}
    if placed - {"cpu"}:
        raise ExportError(
            f"the module and its example inputs must be on the CPU to be exported (found {', '.join(sorted(placed))}); "
            "choose where the daemon runs it with device=..."
        )

    def shapes(values: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(
            {d: Dim.AUTO for d in range(v.dim())} if isinstance(v, torch.Tensor) and v.dim() else None for v in values
        )

    # (label, example, dynamic shapes), tried in order until one exports.
    attempts: list[tuple[str, tuple[Any, ...], Any]] = []
    if dynamic:
        # torch fixes a dimension whose example size is 1: export the batch from two rows.
        doubled = tuple(
            torch.cat([a, a]) if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == 1 else a for a in args
        )
        if any(d is not a for d, a in zip(doubled, args, strict=True)):
            attempts.append(("batch of two", doubled, shapes(doubled)))
        attempts.append(("dynamic", args, shapes(args)))
    attempts.append(("static", args, None))
    failures: dict[str, BaseException] = {}
    program = None
    for label, values, dynamic_shapes in attempts:
        try:
            with _EXPORT_LOCK:
                program = torch.export.export(module, values, dynamic_shapes=dynamic_shapes)
            break
        except Exception as exc:  # noqa: BLE001 - torch raises many kinds; its reason is what the user needs
            failures[label] = exc
            if _hopeless(exc):
                break
    if program is None:
        # The reason for the user's own example (with dynamic shapes) says most.
        reason = failures.get("dynamic") or next(iter(failures.values()))
        raise ExportError(
            f"torch.export cannot export this {type(module).__name__}, so it cannot be sent to the daemon "
            f"(nothing was sent): {type(reason).__name__}: {reason}"
        ) from reason
    for gm in program.graph_module.modules():  # the client's file paths stay here; equal modules hash equal
        graph = getattr(gm, "graph", None)
        for node in graph.nodes if graph is not None else ():
            node.meta.pop("stack_trace", None)
    program._example_inputs = None  # the daemon never reads them; they may be private data
    # Guards are Python source torch compiles when it rebuilds the module; the daemon refuses them
    # (export/export_schema.py) and checks inputs against the graph's shapes itself.
    program._guards_code = []
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def _payload(module: Any, program: bytes) -> Payload:
    return Payload("exported", [("modules.json", modules_json(module)), ("program.pt2", program)])


def _hopeless(exc: BaseException) -> bool:
    """Failures no other example shape can fix (data-dependent Python control flow)."""
    return type(exc).__name__ in ("GuardOnDataDependentSymNode", "DataDependentOutputException")


def _invoke(args: tuple[Any, ...]) -> nnd_pb2.Invoke:
    if not args:
        raise TypeError("pass the module's inputs: wrapped.trace(x) or tracer.invoke(x)")
    try:
        return nnd_pb2.Invoke(args=[_codec.encode(a) for a in args])
    except TypeError as exc:
        raise TypeError(f"a module input must be a tensor, number, string or a list of them: {exc}") from None


class _ArgsTracer(_tracer.Tracer):
    """A trace whose invokes are tensors (positional arguments), not text."""

    def invoke(self, *args: Any) -> _tracer.Invoker:
        """Add one input (the module's positional arguments) as its own batch rows."""
        self.model._bring(args)  # type: ignore[attr-defined]
        return _tracer.Invoker(self, _invoke(args))


class _ArgsScanTracer(_tracer.ScanTracer):
    """A scan whose invokes are tensors (positional arguments), not text."""

    def invoke(self, *args: Any) -> _tracer.Invoker:
        """Add one input (the module's positional arguments) as its own batch rows."""
        self.model._bring(args)  # type: ignore[attr-defined]
        return _tracer.Invoker(self, _invoke(args))


def _local_modules(module: Any) -> list[nnd_pb2.ModuleInfo]:
    """The module tree as this process sees it, until the daemon describes the exported one."""
    return [nnd_pb2.ModuleInfo(path=path, type=type(m).__name__) for path, m in module.named_modules()]


class NNsight(_Uploaded, TransformersModel):
    """Any torch module, held and run by the nnd daemon (nnsight's `NNsight`).

        net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.Linear(10, 2))
        wrapped = nnd.NNsight(net, torch.rand(1, 5))
        with wrapped.trace(torch.rand(1, 5)):
            hidden = wrapped[0].output.save()

    `example_inputs` is one input tensor or a tuple of the positional
    arguments; without them (`NNsight(net)`, as in nnsight) the module is
    exported and sent when the first trace or scan brings its inputs (until
    then the tree is this process's own, and nothing is on the daemon). `NNsight(name)` opens a module uploaded earlier (by any
    client, or before the daemon restarted) by its name. The module is exported here with `torch.export` (a module that
    cannot be exported raises `nnd.ExportError` with torch's reason, and
    nothing is sent) and uploaded as data: a graph of ATen operators and the
    weights, never pickled code. The daemon stores it under `name` (default:
    derived from the content hash); sending an identical module again sends
    nothing. Set `dynamic=False` to export with the example's exact shapes.

    `device`/`dtype` choose where the daemon runs it ("cpu", "cuda:0";
    "float16"...), `keep_alive`, `dispatch`, `rename` and `edits` are as for
    `TransformersModel`. Traces take tensors: `wrapped.trace(x)` or, for
    several inputs batched along dimension 0, `tracer.invoke(x)` per input.
    """

    def __init__(
        self,
        module: Any,
        example_inputs: Any = None,
        *,
        name: str | None = None,
        dynamic: bool = True,
        address: str | None = None,
        token: str | None = None,
        device: Any = None,
        dtype: Any = None,
        dispatch: bool = False,
        keep_alive: Any = None,
        rename: Mapping[Any, str | list[str] | tuple[str, ...]] | None = None,
        edits: str | list[str] | None = None,
    ) -> None:
        deferred = None
        if isinstance(module, str):  # a module uploaded before (by any client): open it by name
            payload, name = None, module
        elif example_inputs is None:
            # nnsight's `NNsight(net)`: torch.export needs inputs, so the first trace or scan brings them.
            if not hasattr(module, "named_modules"):
                raise TypeError(f"NNsight wraps a torch.nn.Module, not a {type(module).__name__}")
            payload, deferred = None, module
        else:
            program = export(module, example_inputs, dynamic=dynamic)  # before connecting: nothing sent on failure
            payload = _payload(module, program)
        object.__setattr__(self, "_payload", payload)
        object.__setattr__(self, "_upload_name", name or "")
        object.__setattr__(self, "_upload_info", None)
        object.__setattr__(self, "_deferred", deferred)
        object.__setattr__(self, "_deferred_request", None)
        object.__setattr__(self, "_dynamic", dynamic)
        object.__setattr__(self, "_dispatch_on_load", dispatch and deferred is not None)
        super().__init__(
            "",
            address=address,
            token=token,
            device=device,
            dtype=dtype,
            dispatch=dispatch and deferred is None,
            keep_alive=keep_alive,
            rename=rename,
            edits=edits,
        )

    def _load(self, request: nnd_pb2.LoadModelRequest) -> nnd_pb2.ModelInfo:
        if self._deferred is None:
            return super()._load(request)
        object.__setattr__(self, "_deferred_request", request)  # sent when inputs arrive (_bring)
        return nnd_pb2.ModelInfo(modules=_local_modules(self._deferred))

    def _bring(self, args: tuple[Any, ...]) -> None:
        """A block's first inputs: export the module with them as the example, upload and load it."""
        module = self._deferred
        if module is None or not args:
            return
        program = export(module, tuple(args), dynamic=self._dynamic)
        object.__setattr__(self, "_payload", _payload(module, program))
        object.__setattr__(self, "_deferred", None)
        info = self._load(self._deferred_request)  # type: ignore[arg-type]
        object.__setattr__(self, "_info", info)
        object.__setattr__(self, "_name", info.name)
        from nnd.models import _envoy

        _envoy.build_tree(self, info.modules, self)  # the exported tree (see the module docstring)
        if self._dispatch_on_load:
            self.dispatch()

    def trace(self, *inputs: Any, **options: Any) -> _tracer.Tracer:
        """`with wrapped.trace(x):` one forward pass on the daemon with the
        module's positional arguments `inputs`; without inputs, add them with
        `tracer.invoke(x)`."""
        self._bring(inputs)
        return _ArgsTracer(self, *((_invoke(inputs),) if inputs else ()), **options)

    def scan(self, *inputs: Any, **options: Any) -> _tracer.ScanTracer:
        """`with wrapped.scan(x):` shapes and dtypes only, on the META module
        (fake tensors; no weights, never dispatches)."""
        self._bring(inputs)
        return _ArgsScanTracer(self, *((_invoke(inputs),) if inputs else ()), **options)

    def generate(self, *inputs: Any, **options: Any) -> Any:
        raise NotImplementedError("generate needs a transformers model; an NNsight module has trace and scan")

    def stream(self, prompt: Any, **options: Any) -> Any:
        raise NotImplementedError("stream needs a transformers model; an NNsight module has trace and scan")
