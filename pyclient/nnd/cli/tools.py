"""The CLI commands that build requests: scan tables, streamed generation,
graphs from files. Kept apart from cli.py's argument handling."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from nnd.v1 import graph_pb2, nnd_pb2, values_pb2

_DTYPE_NAMES = {v: k.lower() for k, v in values_pb2.DType.items()}


def describe(value: values_pb2.Value) -> str:
    """A short text for a saved value: tensors as shape and dtype."""
    kind = value.WhichOneof("kind")
    if kind == "tensor":
        t = value.tensor
        return f"[{', '.join(map(str, t.shape))}] {_DTYPE_NAMES.get(t.dtype, '?')}"
    if kind in ("list", "tuple"):
        inner = ", ".join(describe(v) for v in getattr(value, kind).items)
        return f"({inner})" if kind == "tuple" else f"[{inner}]"
    if kind == "map":
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.map.items.items()) + "}"
    if kind == "size":
        return f"Size({list(value.size.dims)})"
    if kind in ("none", "ellipsis"):
        return kind
    if kind == "dtype":
        return _DTYPE_NAMES.get(value.dtype, "?")
    return repr(getattr(value, kind)) if kind else "?"


def _number(text: str) -> Any:
    """A config summary value ("768", "1e-05", "True") as the number or bool it spells; other text as is."""
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def plain_message(msg: Any) -> dict[str, Any]:
    """A protobuf message as JSON-able Python for `--json`: like protobuf's JSON mapping (set fields only,
    enum names, field names as in the .proto), except that 64-bit integers stay numbers (the mapping makes
    them strings) and the config summary's values are numbers where they spell one."""
    import base64

    from google.protobuf.descriptor import FieldDescriptor as F

    def one(field: Any, value: Any) -> Any:
        if field.type == F.TYPE_MESSAGE:
            return plain_message(value)
        if field.type == F.TYPE_ENUM:
            return field.enum_type.values_by_number[value].name if value in field.enum_type.values_by_number else value
        if field.type == F.TYPE_BYTES:
            return base64.b64encode(value).decode()
        return value

    out: dict[str, Any] = {}
    for field, value in msg.ListFields():
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            vfield = field.message_type.fields_by_name["value"]
            items = {str(k): one(vfield, v) for k, v in value.items()}
            if field.name == "config" and vfield.type == F.TYPE_STRING:
                items = {k: _number(v) for k, v in items.items()}
            out[field.name] = items
        elif field.is_repeated:
            out[field.name] = [one(field, v) for v in value]
        else:
            out[field.name] = one(field, value)
    return out


def collect(stream: Any) -> tuple[dict[int, values_pb2.Value], dict[int, bytearray], list[nnd_pb2.StepTokens]]:
    """Saved values by node id, chunk bytes by blob id, streamed steps."""
    saved: dict[int, values_pb2.Value] = {}
    blobs: dict[int, bytearray] = {}
    steps: list[nnd_pb2.StepTokens] = []
    serialized: dict[int, int] = {}  # node -> the blob holding its serialized value (Saved.value_blob)
    for msg in stream:
        kind = msg.WhichOneof("kind")
        if kind == "saved":
            if msg.saved.value_blob:
                serialized[msg.saved.node] = msg.saved.value_blob
            else:
                saved[msg.saved.node] = msg.saved.value
        elif kind == "chunk":
            blobs.setdefault(msg.chunk.blob, bytearray()).extend(msg.chunk.data)
        elif kind == "step":
            steps.append(msg.step)
    for node, blob in serialized.items():
        saved[node] = values_pb2.Value.FromString(bytes(blobs.pop(blob, b"")))
    return saved, blobs, steps


_NUMPY = {
    values_pb2.FLOAT32: "<f4",
    values_pb2.FLOAT16: "<f2",
    values_pb2.FLOAT64: "<f8",
    values_pb2.INT64: "<i8",
    values_pb2.INT32: "<i4",
    values_pb2.INT16: "<i2",
    values_pb2.INT8: "i1",
    values_pb2.UINT8: "u1",
    values_pb2.BOOL: "?",
}


def _array(t: values_pb2.Tensor, blobs: dict[int, bytearray]) -> Any:
    import numpy as np

    data = bytes(blobs.get(t.blob, b"")) if t.blob else t.data
    if t.dtype == values_pb2.BFLOAT16:  # widen to float32: the upper half of its bits
        arr = (np.frombuffer(data, "<u2").astype("<u4") << 16).view("<f4")
    elif t.dtype in _NUMPY:
        arr = np.frombuffer(data, _NUMPY[t.dtype])
    else:
        raise SystemExit(f"nnd: cannot show a {_DTYPE_NAMES.get(t.dtype, '?')} tensor here; use the Python client")
    return arr.reshape(list(t.shape))


def to_plain(value: values_pb2.Value, blobs: dict[int, bytearray]) -> Any:
    """A saved value as JSON-able Python: tensors become nested lists."""
    kind = value.WhichOneof("kind")
    if kind == "tensor":
        t = value.tensor
        if t.meta:
            return {"shape": list(t.shape), "dtype": _DTYPE_NAMES.get(t.dtype, "?")}
        return _array(t, blobs).tolist()
    if kind in ("list", "tuple"):
        return [to_plain(v, blobs) for v in getattr(value, kind).items]
    if kind == "map":
        return {k: to_plain(v, blobs) for k, v in value.map.items.items()}
    if kind == "size":
        return list(value.size.dims)
    if kind in ("none", "ellipsis"):
        return None
    if kind == "dtype":
        return _DTYPE_NAMES.get(value.dtype, "?")
    return getattr(value, kind) if kind else None


def scan_table(conn: Any, model: str, prompt: str, *, as_json: bool) -> int:
    """Every module's output shape and dtype for `prompt`, from one Scan with a
    Cache node: modules the input never reaches are listed as not called."""
    info = conn.call("GetModel", nnd_pb2.GetModelRequest(model=model))
    graph = graph_pb2.Graph()
    graph.nodes.add(id=1, cache=graph_pb2.Cache(outputs=True))  # a cache node returns itself
    req = nnd_pb2.TraceRequest(model=model, invokes=[nnd_pb2.Invoke(text=prompt)], graph=graph)
    saved, _, _ = collect(conn.stream("Scan", req))
    calls = saved[1].map.items if 1 in saved else {}
    rows = []
    for m in info.modules:
        entries = calls[m.path].list.items if m.path in calls else []
        outputs = [e.map.items["output"] for e in entries if "output" in e.map.items]
        shown = ", ".join(describe(o) for o in outputs) if outputs else "(not called)"
        rows.append((m.path or "(model)", m.type, shown))
    if as_json:
        print(json.dumps([{"module": p, "type": t, "output": d} for p, t, d in rows], indent=2))
        return 0
    width = max(len(r[0]) for r in rows)
    twidth = max(len(r[1]) for r in rows)
    print(f"{'MODULE'.ljust(width)}  {'TYPE'.ljust(twidth)}  OUTPUT")
    for path, typ, desc in rows:
        print(f"{path.ljust(width)}  {typ.ljust(twidth)}  {desc}")
    called = sum(1 for r in rows if r[2] != "(not called)")
    print(f"\n{called} of {len(rows)} modules ran for this input (no weights were read)")
    return 0


def generate_text(conn: Any, model: str, prompt: str, ns: argparse.Namespace) -> int:
    opts = nnd_pb2.GenerateOptions(
        max_new_tokens=ns.max_new_tokens,
        do_sample=ns.do_sample,
        temperature=ns.temperature,
        top_k=ns.top_k,
        top_p=ns.top_p,
        stream_text=True,
    )
    if ns.seed is not None:
        opts.seed = ns.seed
    req = nnd_pb2.TraceRequest(model=model, invokes=[nnd_pb2.Invoke(text=prompt)], generate=opts)
    echoed = False  # the prompt is echoed once the daemon has accepted the request, never before a refusal
    for msg in conn.stream("Generate", req):
        if not echoed:
            sys.stdout.write(prompt)
            echoed = True
        if msg.WhichOneof("kind") == "step" and msg.step.text:
            sys.stdout.write(msg.step.text[0])
        sys.stdout.flush()
    sys.stdout.write("\n" if echoed else "")
    return 0


def trace_graph_file(conn: Any, model: str, ns: argparse.Namespace) -> int:
    from google.protobuf import json_format, text_format

    text = open(ns.graph).read()
    req = nnd_pb2.TraceRequest()
    is_json = text.lstrip().startswith("{")
    for cls in (nnd_pb2.TraceRequest, graph_pb2.Graph):
        msg = cls()
        try:
            if is_json:
                json_format.Parse(text, msg)
            else:
                text_format.Parse(text, msg)
        except (text_format.ParseError, json_format.ParseError) as exc:
            last = exc
            continue
        if isinstance(msg, graph_pb2.Graph):
            req.graph.CopyFrom(msg)
        else:
            req = msg
        break
    else:
        raise SystemExit(f"nnd: {ns.graph} is neither a TraceRequest nor a Graph: {last}")
    req.model = model
    if ns.prompt:
        del req.invokes[:]
        req.invokes.extend(nnd_pb2.Invoke(text=p) for p in ns.prompt)
    generate = req.HasField("generate") and req.generate.max_new_tokens > 0
    saved, blobs, _ = collect(conn.stream("Generate" if generate else "Trace", req))
    if ns.json:
        print(json.dumps({str(node): to_plain(value, blobs) for node, value in sorted(saved.items())}, indent=2))
    else:
        for node, value in sorted(saved.items()):
            print(f"node {node}: {summarize(value, blobs)}")
    return 0


def summarize(value: values_pb2.Value, blobs: dict[int, bytearray], *, head: int = 6) -> str:
    """One line for a saved value: a tensor's shape, dtype, first values and statistics (the whole tensor
    is what `--json` prints); anything else as its short description or value."""
    import numpy as np

    kind = value.WhichOneof("kind")
    if kind != "tensor" or value.tensor.meta:
        return json.dumps(to_plain(value, blobs)) if kind not in ("list", "tuple", "map") else describe(value)
    t = value.tensor
    arr = _array(t, blobs)
    flat = arr.reshape(-1)
    first = ", ".join(f"{v:.4g}" if flat.dtype.kind == "f" else str(v) for v in flat[:head].tolist())
    more = ", ..." if flat.size > head else ""
    text = f"{describe(value)}  [{first}{more}]"
    if flat.size and flat.dtype.kind in "fiub":
        x = flat.astype(np.float64)
        text += f"  min {x.min():.4g}  max {x.max():.4g}  mean {x.mean():.4g}  std {x.std():.4g}"
    return text
