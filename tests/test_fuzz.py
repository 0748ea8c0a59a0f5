"""Random and malformed requests against a real daemon (Hypothesis).

Graphs with wrong dtypes, byte lengths that do not match shapes, dangling and
forward references, duplicate ids, huge shapes, bad module paths, bad slices,
unknown ops, wrong arguments, unset oneofs, deep nesting, giant strings,
invokes and scopes out of range; and raw bytes that are not a request at all.
Every request must get a proper status (never INTERNAL or UNKNOWN, never a
dead worker, never a hang), the daemon and the worker must stay up, and the
model's logits for a fixed prompt must be bit-identical afterwards.

Size: NND_FUZZ_EXAMPLES (default 150, about a minute; nightly: 1000). The
examples are derandomized, so CI sees the same ones every run; set
NND_FUZZ_SEED to explore others.
"""

from __future__ import annotations

import collections
import math
import os
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from daemonproc import Daemon, start_daemon
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc, values_pb2

EXAMPLES = int(os.environ.get("NND_FUZZ_EXAMPLES", "150"))
SEED = os.environ.get("NND_FUZZ_SEED", "")
CALL_TIMEOUT_S = 60.0
# A proper answer to a bad request; INTERNAL, UNKNOWN, UNAVAILABLE (the worker
# died) and DEADLINE_EXCEEDED (a hang) are bugs.
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.PERMISSION_DENIED,
}
STATS: collections.Counter[str] = collections.Counter()
TIMES: list[float] = []


def _fuzz_settings(examples: int) -> Any:
    def apply(fn: Any) -> Any:
        fn = settings(
            max_examples=examples,
            deadline=None,
            derandomize=not SEED,
            database=None,
            print_blob=True,
            suppress_health_check=list(HealthCheck),
        )(fn)
        return seed(int(SEED))(fn) if SEED else fn

    return apply


# ---------------------------------------------------------------- the daemon


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, str]) -> Iterator[dict[str, Any]]:
    d = start_daemon(tmp_path_factory.mktemp("fuzz"))
    model = MODEL["path"] = tiny_models["gpt2"]
    d.cli("load", model)
    d.cli("dispatch", model)
    channel = grpc.insecure_channel(d.address, options=[("grpc.max_receive_message_length", -1)])
    stub = nnd_pb2_grpc.NndStub(channel)
    pid = _worker(stub, model)
    yield {"daemon": d, "model": model, "stub": stub, "channel": channel, "pid": pid, "before": _logits(stub, model)}
    channel.close()
    assert d.stop() == 0


def _worker(stub: nnd_pb2_grpc.NndStub, model: str) -> int:
    (info,) = [m for m in stub.ListModels(nnd_pb2.ListModelsRequest(), timeout=30).models if m.name == model]
    assert info.state == nnd_pb2.DISPATCHED
    return info.worker_pids[0]


def _logits(stub: nnd_pb2_grpc.NndStub, model: str) -> bytes:
    graph = graph_pb2.Graph()
    graph.nodes.add(id=1, module=graph_pb2.ModuleValue(path="lm_head", point=graph_pb2.OUTPUT))
    graph.nodes.add(id=2, save=graph_pb2.Save(value=graph_pb2.Arg(ref=1)))
    request = nnd_pb2.TraceRequest(model=model, invokes=[nnd_pb2.Invoke(text="The Eiffel Tower is in")], graph=graph)
    (saved,) = [r.saved.value.tensor for r in stub.Trace(request, timeout=60) if r.HasField("saved")]
    return saved.data


def _check_alive(target: dict[str, Any]) -> None:
    d: Daemon = target["daemon"]
    assert d.proc.poll() is None, f"the daemon died:\n{d.log()[-3000:]}"
    assert _worker(target["stub"], target["model"]) == target["pid"], "the worker was replaced"


def _call(target: dict[str, Any], method: str, payload: bytes) -> tuple[grpc.StatusCode, str, list[bytes]]:
    streaming = method in ("Trace", "Scan", "Generate")
    make = target["channel"].unary_stream if streaming else target["channel"].unary_unary
    fn = make(f"/nnd.v1.Nnd/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    started = time.monotonic()
    try:
        out = list(fn(payload, timeout=CALL_TIMEOUT_S)) if streaming else [fn(payload, timeout=CALL_TIMEOUT_S)]
    except grpc.RpcError as err:
        return err.code(), err.details() or "", []
    finally:
        TIMES.append(time.monotonic() - started)
    return grpc.StatusCode.OK, "", out


def _verdict(target: dict[str, Any], method: str, payload: bytes, shown: str) -> None:
    code, details, out = _call(target, method, payload)
    STATS[f"{method} {code.name}"] += 1
    assert code in ALLOWED, f"{method} answered {code.name}: {details[:2000]}\nrequest: {shown[:3000]}"
    if code != grpc.StatusCode.OK:
        assert details.strip(), f"{method} answered {code.name} without saying why\nrequest: {shown[:3000]}"
    elif method in ("Trace", "Scan", "Generate"):
        last = nnd_pb2.TraceResponse.FromString(out[-1])
        assert last.HasField("done"), f"{method} ended without Done\nrequest: {shown[:3000]}"


# ---------------------------------------------------------------- strategies

# The tiny model's path, set by the `target` fixture before any example is drawn.
MODEL: dict[str, str] = {"path": ""}
SMALL = [0, 1, 2, 3, -1, -2, 8]
# Big enough that any allocation fails at once; never sizes that would
# succeed and take gigabytes of a shared machine.
HUGE = [2**40, 2**62, 2**63 - 1, -(2**63), 2**31]
PATHS = [
    "",
    "transformer",
    "transformer.wte",
    "transformer.h.0",
    "transformer.h.1",
    "transformer.h.0.attn",
    "transformer.h.1.mlp",
    "transformer.h.0.attn.c_attn",
    "transformer.ln_f",
    "lm_head",
]
BAD_PATHS = ["nope", "transformer.h.2", "transformer.h.-1", "transformer..h", "lm_head.weight", " ", "\x00", "é"]
ATTRS = ["shape", "dtype", "T", "logits", "weight", "__class__", "__dict__", "forward", "state_dict", "_parameters"]
KWARGS = ["dim", "keepdim", "dtype", "seed", "device", "k", "size", "out", "generator", "memory_format", "x"]
ITEMSIZE = {1: 4, 2: 2, 3: 2, 4: 8, 5: 8, 6: 4, 7: 2, 8: 1, 9: 1, 10: 1}


def _op_names() -> list[str]:
    from nnd_daemon.engine import ops

    return list(ops.OPS)


def _giant(n: int) -> str:
    return ("é" if n % 2 else "x") * n


ints = st.one_of(st.sampled_from(SMALL), st.sampled_from(SMALL), st.sampled_from(HUGE), st.just(64))
small_ints = st.sampled_from(SMALL + [64])
giants = st.sampled_from([5_000, 100_000, 1_000_001]).map(_giant)
texts = st.one_of(
    st.text(max_size=12),
    st.sampled_from(PATHS + BAD_PATHS + ATTRS + ["cpu", "cuda", "meta", "cuda:99", "float32"]),
    giants,
)


@st.composite
def tensors(draw: Any) -> values_pb2.Tensor:
    dtype = draw(st.sampled_from([*range(11), 11, 99]))
    dims = st.one_of(st.sampled_from([0, 1, 2, 3, 4]), st.sampled_from([-1, 2**40, 2**62, 2**63 - 1]))
    shape = draw(st.lists(dims, max_size=4))
    numel = math.prod(shape) if all(d >= 0 for d in shape) else -1
    size = numel * ITEMSIZE.get(dtype, 4)
    mode = draw(st.sampled_from(["exact", "exact", "exact", "other"]))
    if mode == "exact" and 0 <= size <= 4096:
        data = draw(st.binary(min_size=size, max_size=size))
    else:
        data = draw(st.binary(max_size=64))
    meta = draw(st.sampled_from([False] * 9 + [True]))
    blob = draw(st.sampled_from([0] * 9 + [3]))
    return values_pb2.Tensor(dtype=dtype, shape=shape, data=data, meta=meta, blob=blob)


@st.composite
def slices(draw: Any) -> values_pb2.Slice:
    s = values_pb2.Slice()
    for name in ("start", "stop", "step"):
        value = draw(st.one_of(st.none(), ints))
        if value is not None:
            setattr(s, name, value)
    return s


leaf_values = st.one_of(
    tensors().map(lambda t: values_pb2.Value(tensor=t)),
    ints.map(lambda i: values_pb2.Value(int=i)),
    st.floats().map(lambda f: values_pb2.Value(float=f)),
    st.booleans().map(lambda b: values_pb2.Value(bool=b)),
    texts.map(lambda s: values_pb2.Value(str=s)),
    slices().map(lambda s: values_pb2.Value(slice=s)),
    st.just(values_pb2.Value(ellipsis=values_pb2.Empty())),
    st.just(values_pb2.Value(none=values_pb2.Empty())),
    st.lists(ints, max_size=4).map(lambda d: values_pb2.Value(size=values_pb2.Shape(dims=d))),
    st.sampled_from([*range(12), 99]).map(lambda d: values_pb2.Value(dtype=d)),
    st.just(values_pb2.Value()),  # no kind set
)
values = st.recursive(
    leaf_values,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda xs: values_pb2.Value(list=values_pb2.ValueList(items=xs))),
        st.lists(inner, max_size=4).map(lambda xs: values_pb2.Value(tuple=values_pb2.ValueList(items=xs))),
        st.dictionaries(st.text(max_size=6), inner, max_size=3).map(
            lambda m: values_pb2.Value(map=values_pb2.ValueMap(items=m))
        ),
    ),
    max_leaves=8,
)


def _nested(depth: int) -> values_pb2.Value:
    v = values_pb2.Value(int=1)
    for _ in range(depth):
        v = values_pb2.Value(list=values_pb2.ValueList(items=[v]))
    return v


def args_from(refs: st.SearchStrategy[int]) -> st.SearchStrategy[graph_pb2.Arg]:
    leaf = st.one_of(
        refs.map(lambda r: graph_pb2.Arg(ref=r)),
        refs.map(lambda r: graph_pb2.Arg(ref=r)),
        values.map(lambda v: graph_pb2.Arg(value=v)),
        st.just(graph_pb2.Arg()),
        st.sampled_from([20, 44]).map(lambda n: graph_pb2.Arg(value=_nested(n))),  # ~100 levels deep with the request
    )
    return st.recursive(
        leaf,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3).map(lambda xs: graph_pb2.Arg(tuple=graph_pb2.ArgList(items=xs))),
            st.lists(inner, max_size=3).map(lambda xs: graph_pb2.Arg(list=graph_pb2.ArgList(items=xs))),
        ),
        max_leaves=5,
    )


@st.composite
def module_values(draw: Any) -> graph_pb2.ModuleValue:
    mv = graph_pb2.ModuleValue(
        path=draw(st.one_of(st.sampled_from(PATHS), st.sampled_from(PATHS), st.sampled_from(BAD_PATHS), giants)),
        point=draw(st.sampled_from([1, 1, 1, 2, 3, 4, 0, 7])),
        call=draw(st.sampled_from([0, 0, 0, 1, 2, -1, 2**31 - 1])),
    )
    invoke = draw(st.sampled_from([None, None, None, 0, 1, -1, 5, 2**31 - 1]))
    if invoke is not None:
        mv.invoke = invoke
    return mv


@st.composite
def op_calls(draw: Any, refs: st.SearchStrategy[int]) -> graph_pb2.Op:
    name = draw(st.one_of(st.sampled_from(_op_names()), st.sampled_from(["", "eval", "__import__", "exec", "system"])))
    arg = args_from(refs)
    if name == "expand":  # a huge expand is a view whose reductions run for hours: not a request-validation case
        arg = st.one_of(refs.map(lambda r: graph_pb2.Arg(ref=r)), small_ints.map(_int_arg))
    op = graph_pb2.Op(name=name, args=draw(st.lists(arg, max_size=4)))
    if name == "call_module":
        op.args.insert(0, graph_pb2.Arg(value=values_pb2.Value(str=draw(st.sampled_from(PATHS + BAD_PATHS)))))
    if name == "getattr":
        op.args.append(graph_pb2.Arg(value=values_pb2.Value(str=draw(st.sampled_from(ATTRS)))))
    for key, value in draw(st.dictionaries(st.sampled_from(KWARGS), arg, max_size=2)).items():
        op.kwargs[key].CopyFrom(value)
    return op


def _int_arg(i: int) -> graph_pb2.Arg:
    return graph_pb2.Arg(value=values_pb2.Value(int=i))


@st.composite
def step_selectors(draw: Any) -> graph_pb2.StepSelector:
    kind = draw(st.sampled_from(["all", "range", "steps", "unset"]))
    if kind == "all":
        return graph_pb2.StepSelector(all=values_pb2.Empty())
    if kind == "range":
        return graph_pb2.StepSelector(range=draw(slices()))
    if kind == "steps":
        return graph_pb2.StepSelector(steps=graph_pb2.StepList(steps=draw(st.lists(ints, max_size=3))))
    return graph_pb2.StepSelector()


KINDS = ["module"] * 3 + ["op"] * 5 + ["constant", "save", "save", "set", "skip", "stop"]
KINDS += ["backward", "grad", "set_grad", "cache", "unset"]


@st.composite
def nodes(draw: Any, node_id: int, refs: st.SearchStrategy[int]) -> graph_pb2.Node:
    node = graph_pb2.Node(id=node_id, scope=draw(st.sampled_from([0] * 8 + [1, 2, 9, 2**32 - 1])))
    if draw(st.integers(0, 9)) == 0:
        node.loc.CopyFrom(
            graph_pb2.SourceLocation(file=draw(texts), line=draw(st.integers(-(2**31), 2**31 - 1)), text=draw(texts))
        )
    kind = draw(st.sampled_from(KINDS))
    arg = args_from(refs)
    if kind == "module":
        node.module.CopyFrom(draw(module_values()))
    elif kind == "constant":
        node.constant.CopyFrom(draw(values))
    elif kind == "op":
        node.op.CopyFrom(draw(op_calls(refs)))
    elif kind == "save":
        node.save.SetInParent()
        if draw(st.integers(0, 9)):
            node.save.value.CopyFrom(draw(arg))
    elif kind in ("set", "skip"):
        effect = getattr(node, kind)
        effect.SetInParent()
        if draw(st.integers(0, 9)):
            effect.target.CopyFrom(draw(module_values()))
        if draw(st.integers(0, 9)):
            effect.value.CopyFrom(draw(arg))
    elif kind == "stop":
        node.stop.SetInParent()
    elif kind == "backward":
        node.backward.loss.CopyFrom(draw(arg))
        if draw(st.booleans()):
            node.backward.gradient.CopyFrom(draw(arg))
    elif kind in ("grad", "set_grad"):
        msg = getattr(node, kind)
        msg.value, msg.backward = draw(refs), draw(refs)
        if kind == "set_grad":
            msg.grad.CopyFrom(draw(arg))
    elif kind == "cache":
        node.cache.modules.extend(draw(st.lists(st.sampled_from(PATHS + BAD_PATHS), max_size=3)))
        node.cache.outputs, node.cache.inputs = draw(st.booleans()), draw(st.booleans())
        node.cache.dtype = draw(st.sampled_from([0, 0, 1, 3, 99]))
        node.cache.device = draw(st.sampled_from(["", "", "cpu", "meta", "cuda", "cuda:99", "nope"]))
    return node


@st.composite
def graphs(draw: Any) -> graph_pb2.Graph:
    n = draw(st.integers(0, 8))
    ids = list(range(1, n + 1))
    shuffle = draw(st.sampled_from(["none"] * 7 + ["duplicate", "reverse", "zero", "huge"]))
    if n and shuffle == "duplicate":
        ids[-1] = ids[0]
    elif shuffle == "reverse":
        ids.reverse()
    elif n and shuffle == "zero":
        ids[0] = 0
    elif n and shuffle == "huge":
        ids[-1] = 2**32 - 1
    graph = graph_pb2.Graph()
    for _ in range(draw(st.integers(0, 2))):
        graph.scopes.add(steps=draw(step_selectors()))
    for i, node_id in enumerate(ids):
        earlier = ids[:i]
        wild = st.sampled_from([0, node_id, min(node_id + 1, 2**32 - 1), 999, 2**32 - 1])
        refs = st.one_of(st.sampled_from(earlier), st.sampled_from(earlier), wild) if earlier else wild
        graph.nodes.append(draw(nodes(node_id, refs)))
    return graph


COMMON_OPS = (
    "add sub mul truediv iadd isub imul getitem setitem sum mean softmax log_softmax argmax topk reshape view "
    "transpose permute unsqueeze squeeze flatten cat stack norm abs exp clone detach to float getattr call_module "
    "zeros_like ones_like matmul einsum where clamp gather index_select tolist item size numel narrow chunk split "
    "randn_like cumsum sort max min relu gelu layer_norm cosine_similarity repeat masked_fill"
).split()
HIDDEN = 64  # the tiny gpt2's width


@st.composite
def vectors(draw: Any) -> values_pb2.Value:
    """A float32 constant shaped like what it will meet: [64], [1], [] or [1, 1, 64]."""
    import struct

    shape = draw(st.sampled_from([[HIDDEN], [1], [], [1, 1, HIDDEN], [2, HIDDEN]]))
    n = math.prod(shape)
    numbers = draw(st.lists(st.floats(-4, 4, width=32), min_size=n, max_size=n))
    data = struct.pack(f"<{n}f", *numbers)
    return values_pb2.Value(tensor=values_pb2.Tensor(dtype=values_pb2.FLOAT32, shape=shape, data=data))


@st.composite
def plausible_graphs(draw: Any) -> graph_pb2.Graph:
    """Graphs that mostly pass validation, so the executor runs them: module
    values, common ops on them with small ints, slices and fitting vectors,
    saves and writes."""
    graph = graph_pb2.Graph()
    last = 0
    for node_id in range(1, draw(st.integers(2, 9)) + 1):
        earlier = list(range(1, node_id))
        refs = st.sampled_from(earlier) if earlier else st.just(0)
        kind = draw(st.sampled_from(["module"] * 3 + ["op"] * 6 + ["save", "set"] if earlier else ["module"]))
        node = graph.nodes.add(id=node_id)
        if kind == "module":
            node.module.path = draw(st.sampled_from(PATHS[1:]))
            node.module.point = draw(st.sampled_from([graph_pb2.OUTPUT] * 3 + [graph_pb2.INPUT]))
            if draw(st.integers(0, 4)) == 0:
                node.module.invoke = 0
            continue
        arg = st.one_of(
            refs.map(lambda r: graph_pb2.Arg(ref=r)),
            refs.map(lambda r: graph_pb2.Arg(ref=r)),
            st.sampled_from([-1, 0, 1, 2]).map(_int_arg),
            vectors().map(lambda v: graph_pb2.Arg(value=v)),
            slices().map(lambda v: graph_pb2.Arg(value=values_pb2.Value(slice=v))),
            st.lists(
                st.sampled_from(
                    [
                        graph_pb2.Arg(value=values_pb2.Value(slice=values_pb2.Slice())),
                        _int_arg(-1),
                        _int_arg(0),
                        graph_pb2.Arg(value=values_pb2.Value(ellipsis=values_pb2.Empty())),
                    ]
                ),
                min_size=1,
                max_size=3,
            ).map(lambda xs: graph_pb2.Arg(tuple=graph_pb2.ArgList(items=xs))),
        )
        if kind == "save":
            node.save.value.CopyFrom(graph_pb2.Arg(ref=draw(refs)))
        elif kind == "set":
            node.set.target.path = draw(st.sampled_from(PATHS[1:]))
            node.set.target.point = graph_pb2.OUTPUT
            node.set.value.CopyFrom(draw(arg))
        else:
            name = draw(st.sampled_from(COMMON_OPS))
            first = [graph_pb2.Arg(ref=draw(refs))]
            if name == "call_module":
                first = [graph_pb2.Arg(value=values_pb2.Value(str=draw(st.sampled_from(PATHS[1:]))))] + first
            if name == "getattr":
                first.append(graph_pb2.Arg(value=values_pb2.Value(str=draw(st.sampled_from(ATTRS)))))
            node.op.name = name
            node.op.args.extend(first + draw(st.lists(arg, max_size=2)))
            if draw(st.integers(0, 3)) == 0:
                node.op.kwargs["dim"].CopyFrom(_int_arg(draw(st.sampled_from([-1, 0, 1]))))
        last = node_id
    if last:
        graph.nodes.add(id=len(graph.nodes) + 1, save=graph_pb2.Save(value=graph_pb2.Arg(ref=last)))
    return graph


@st.composite
def invokes(draw: Any) -> nnd_pb2.Invoke:
    kind = draw(st.sampled_from(["text", "text", "tokens", "tokens", "unset"]))
    invoke = nnd_pb2.Invoke()
    if kind == "text":
        invoke.text = draw(st.one_of(st.sampled_from(["Hello world", "The Eiffel Tower is in", ""]), texts))
    elif kind == "tokens":
        ids = st.one_of(st.integers(0, 319), st.sampled_from([-1, 320, 2**40, -(2**63)]))
        invoke.tokens.ids.extend(draw(st.lists(ids, max_size=10)))
    if draw(st.integers(0, 9)) == 0:
        invoke.args.extend(draw(st.lists(values, max_size=2)))
    return invoke


@st.composite
def requests(draw: Any) -> tuple[str, nnd_pb2.TraceRequest]:
    method = draw(st.sampled_from(["Trace"] * 5 + ["Scan"] * 2 + ["Generate"] * 2))
    if draw(st.booleans()):  # plausible: a real model, real prompts, a graph that mostly validates
        texts_ = st.sampled_from(["Hello world", "The Eiffel Tower is in", "a", "Interpretability means"])
        request = nnd_pb2.TraceRequest(
            model=MODEL["path"],
            invokes=[nnd_pb2.Invoke(text=t) for t in draw(st.lists(texts_, min_size=1, max_size=2))],
            graph=draw(plausible_graphs()),
        )
        if method == "Generate":
            request.generate.max_new_tokens = draw(st.integers(1, 3))
        return method, request
    request = nnd_pb2.TraceRequest(
        model=draw(st.sampled_from([MODEL["path"]] * 20 + ["", "nope", _giant(100_000)])),
        invokes=draw(st.lists(invokes(), min_size=draw(st.sampled_from([1] * 9 + [0])), max_size=3)),
        graph=draw(graphs()),
    )
    if method == "Generate" or draw(st.integers(0, 9)) == 0:
        options = request.generate
        options.max_new_tokens = draw(st.sampled_from([0, 1, 2, 3, -1, 2000, 2**31 - 1]))
        options.do_sample = draw(st.booleans())
        options.temperature = draw(st.sampled_from([0.0, 0.7, -1.0, math.nan, math.inf]))
        options.top_k = draw(st.sampled_from([0, 5, -3]))
        options.top_p = draw(st.sampled_from([0.0, 0.9, 1.5, -0.5, math.nan]))
        if draw(st.booleans()):
            options.seed = draw(ints)
    if draw(st.integers(0, 19)) == 0:
        request.edits.append(draw(texts))
    if draw(st.integers(0, 19)) == 0:
        request.keep_alive = draw(st.sampled_from(["5m", "-1", "bogus", "1e400s"]))
    return method, request


def _raw_value(depth: int) -> bytes:
    """Value bytes nested deeper than protobuf parsers allow (built by hand: the
    Python library refuses to make them)."""

    def field(number: int, payload: bytes) -> bytes:
        return _varint(number << 3 | 2) + _varint(len(payload)) + payload

    v = b"\x10\x01"  # Value.int = 1
    for _ in range(depth):
        v = field(9, field(1, v))  # Value.list -> ValueList.items
    return v


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# ---------------------------------------------------------------- the tests


@pytest.mark.timeout(max(300, int(EXAMPLES * 1.5)))
@_fuzz_settings(EXAMPLES)
@given(case=requests())
def test_random_graphs_get_a_proper_status(target, case):
    method, request = case
    _verdict(target, method, request.SerializeToString(), str(request))


@st.composite
def raw_payloads(draw: Any) -> tuple[str, bytes]:
    method = draw(st.sampled_from(["Trace", "Scan", "Generate", "GetModel", "Tokenize", "Decode"]))
    kind = draw(st.sampled_from(["random", "mutated", "mutated", "deep"]))
    if kind == "random":
        return method, draw(st.binary(max_size=256))
    if kind == "deep":
        depth = draw(st.sampled_from([99, 101, 200, 5000]))
        value = _raw_value(depth)
        node = b"\x08\x01" + _varint(11 << 3 | 2) + _varint(len(value)) + value  # Node.id = 1, .constant
        graph = _varint(1 << 3 | 2) + _varint(len(node)) + node  # Graph.nodes
        request = nnd_pb2.TraceRequest(model=MODEL["path"], invokes=[nnd_pb2.Invoke(text="Hello")])
        request = request.SerializeToString()
        return method, request + _varint(3 << 3 | 2) + _varint(len(graph)) + graph
    method, request = draw(requests())
    data = bytearray(request.SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        what = draw(st.sampled_from(["flip", "cut", "insert"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if what == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif what == "cut":
            del data[at : at + draw(st.integers(1, 8))]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return method, bytes(data)


@pytest.mark.timeout(max(300, int(EXAMPLES * 1.5)))
@_fuzz_settings(max(50, EXAMPLES // 3))
@given(case=raw_payloads())
def test_malformed_bytes_get_a_proper_status(target, case):
    method, payload = case
    _verdict(target, method, payload, repr(payload[:500]))


def _deep_trace(model: str, wraps: int, where: str) -> bytes:
    """A Trace with a list nested `wraps` deep as a graph constant, an op
    argument or an invoke's argument, as bytes (the Python library refuses to
    build messages this deep)."""

    def field(number: int, payload: bytes) -> bytes:
        return _varint(number << 3 | 2) + _varint(len(payload)) + payload

    value = b"\x10\x01"  # Value.int = 1
    for _ in range(wraps):
        value = field(9, field(1, value))  # Value.list -> ValueList.items -> Value
    invoke = field(1, b"Hello")  # Invoke.text
    if where == "invoke":
        first = b"\x08\x01" + field(11, b"\x10\x01")
        invoke += field(3, value)  # Invoke.args
    elif where == "op":  # Node.op = Op(name="add", args=[Arg(value=...), Arg(value=...)])
        arg = field(2, value)
        first = b"\x08\x01" + field(12, field(1, b"add") + field(2, arg) + field(2, arg))
    else:  # Node.constant
        first = b"\x08\x01" + field(11, value)
    save = b"\x08\x02" + field(13, field(1, b"\x08\x01"))  # Node 2: save(ref 1)
    graph = field(1, first) + field(1, save)
    return field(1, model.encode()) + field(2, invoke) + field(3, graph)


@pytest.mark.parametrize("where", ["constant", "op", "invoke"])
def test_nesting_at_the_parsers_limit_gets_a_proper_status(target, where):
    """Found by the nightly run: a request the daemon could parse but its worker,
    one wrapper deeper, could not, was INTERNAL ("Exception deserializing")."""
    for wraps in range(40, 52):
        payload = _deep_trace(target["model"], wraps, where)
        for method in ("Trace", "Scan"):
            _verdict(target, method, payload, f"{method} of a value nested {wraps} deep in {where}")
    _check_alive(target)


def test_after_fuzzing_the_model_computes_exactly_what_it_did(target):
    _check_alive(target)
    assert _logits(target["stub"], target["model"]) == target["before"]
    total = sum(STATS.values())
    print(f"\n{total} fuzzed requests, {sum(TIMES):.1f} s in calls, slowest {max(TIMES, default=0):.2f} s")
    for key, count in sorted(STATS.items()):
        print(f"  {key:<32} {count}")


@pytest.mark.parametrize("method", ["Trace", "Generate", "Scan"])
def test_a_model_name_with_a_nul_is_invalid_not_internal(target: dict[str, Any], method: str):
    # Found by the fuzzer: os.path raised ValueError on the name and the daemon answered INTERNAL.
    name = "/\x00" + target["model"][1:]
    request = nnd_pb2.TraceRequest(model=name, invokes=[nnd_pb2.Invoke(text="Hello")])
    code, details, _ = _call(target, method, request.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "NUL" in details
    _check_alive(target)
