"""The protocol as a client in any language sees it: reflection, health,
GetServerInfo, how errors look on the wire, chunked results, and the worked
example graph file (examples/graphs/steer_h0.txtpb) run through `nnd trace`."""

from __future__ import annotations

import json
import pathlib
import time

import grpc
import numpy as np
import pytest
from google.protobuf import text_format

import nnd
from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc, values_pb2

GRAPH_FILE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "graphs" / "steer_h0.txtpb"
BIG = [("grpc.max_receive_message_length", 64 * 2**20)]


def _stub(address: str, options: list | None = None) -> tuple[grpc.Channel, nnd_pb2_grpc.NndStub]:
    channel = grpc.insecure_channel(address, options=options or [])
    return channel, nnd_pb2_grpc.NndStub(channel)


def _collect(responses) -> dict[int, np.ndarray]:
    """Saved tensors (not other values) by node id; a chunked tensor's bytes are its blob's chunks, joined in order."""
    saved: dict[int, values_pb2.Tensor] = {}
    blobs: dict[int, bytearray] = {}
    kinds = []
    for r in responses:
        kind = r.WhichOneof("kind")
        kinds.append(kind)
        if kind == "saved" and r.saved.value.WhichOneof("kind") == "tensor":
            saved[r.saved.node] = r.saved.value.tensor
        elif kind == "chunk":
            blobs.setdefault(r.chunk.blob, bytearray()).extend(r.chunk.data)
    assert kinds[-1] == "done" and kinds.count("done") == 1
    dtypes = {values_pb2.FLOAT32: "<f4", values_pb2.INT64: "<i8"}
    return {
        node: np.frombuffer(bytes(blobs[t.blob]) if t.blob else t.data, dtypes[t.dtype]).reshape(list(t.shape))
        for node, t in saved.items()
    }


def _request(model: str, *nodes: graph_pb2.Node, prompt: str = "hello") -> nnd_pb2.TraceRequest:
    return nnd_pb2.TraceRequest(
        model=model, invokes=[nnd_pb2.Invoke(text=prompt)], graph=graph_pb2.Graph(nodes=list(nodes))
    )


def _error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if not isinstance(result, nnd_pb2.ModelInfo):
            list(result)  # a stream fails when read
    return info.value


@pytest.fixture(scope="module")
def gpt2(daemon, tiny_models) -> str:
    _, stub = _stub(daemon.address)
    return stub.LoadModel(nnd_pb2.LoadModelRequest(model=tiny_models["gpt2"]), timeout=60).name


# ---------------------------------------------------------------- reflection and health


def test_reflection_lists_the_services(daemon):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(daemon.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"nnd.v1.Nnd", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
        # The whole schema comes with it: a client needs no .proto files to build requests.
        nnd_service = DescriptorPool(db).FindServiceByName("nnd.v1.Nnd")
        trace = nnd_service.methods_by_name["Trace"]
        assert trace.input_type.full_name == "nnd.v1.TraceRequest"
        assert trace.output_type.full_name == "nnd.v1.TraceResponse"
        assert trace.server_streaming and not trace.client_streaming
        assert "graph" in trace.input_type.fields_by_name
        assert {m.name for m in nnd_service.methods} >= {"GetServerInfo", "LoadModel", "Dispatch", "Scan", "Decode"}


def _reflect(channel: grpc.Channel, version: str, **request) -> list:
    """ServerReflectionInfo of `grpc.reflection.<version>`, one request (v1 and v1alpha have the same messages)."""
    from grpc_reflection.v1alpha import reflection_pb2 as pb

    info = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=pb.ServerReflectionRequest.SerializeToString,
        response_deserializer=pb.ServerReflectionResponse.FromString,
    )
    return list(info(iter([pb.ServerReflectionRequest(**request)]), timeout=10))


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_is_served_as_v1_and_v1alpha(daemon, version):
    """grpcurl and newer tools ask grpc.reflection.v1 first; older ones v1alpha."""
    from google.protobuf import descriptor_pb2

    with grpc.insecure_channel(daemon.address) as channel:
        (listed,) = _reflect(channel, version, list_services="")
        services = {s.name for s in listed.list_services_response.service}
        assert {
            "nnd.v1.Nnd",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= services
        for symbol, package in (
            ("nnd.v1.Nnd", "nnd.v1"),
            (f"grpc.reflection.{version}.ServerReflection", f"grpc.reflection.{version}"),
        ):
            (found,) = _reflect(channel, version, file_containing_symbol=symbol)
            assert found.WhichOneof("message_response") == "file_descriptor_response", found
            files = [
                descriptor_pb2.FileDescriptorProto.FromString(b)
                for b in found.file_descriptor_response.file_descriptor_proto
            ]
            assert package in {f.package for f in files}


def _health(channel: grpc.Channel, service: str) -> int | None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        return (
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        )
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise


def _wait_health(channel: grpc.Channel, service: str, want: int, timeout: float = 10) -> None:
    """The daemon publishes model states every 0.2 s: poll until `want` shows."""
    deadline = time.monotonic() + timeout
    while (got := _health(channel, service)) != want:
        assert time.monotonic() < deadline, f"health of {service!r} is {got}, not {want} after {timeout} s"
        time.sleep(0.05)


def test_health_overall_is_serving(daemon):
    from grpc_health.v1 import health_pb2

    with grpc.insecure_channel(daemon.address) as channel:
        assert _health(channel, "") == health_pb2.HealthCheckResponse.SERVING
        assert _health(channel, "nnd.v1.Nnd") == health_pb2.HealthCheckResponse.SERVING


def test_health_follows_the_model_state(fresh_daemon, tiny_models):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    channel, stub = _stub(fresh_daemon.address)
    with channel:
        assert _health(channel, tiny_models["gpt2"]) is None  # not loaded yet: NOT_FOUND
        name = stub.LoadModel(nnd_pb2.LoadModelRequest(model=tiny_models["gpt2"]), timeout=60).name
        _wait_health(channel, name, not_serving)
        progress = list(stub.Dispatch(nnd_pb2.DispatchRequest(model=name), timeout=120))
        assert progress[-1].model.state == nnd_pb2.DISPATCHED
        _wait_health(channel, name, serving)
        listed = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=5).statuses
        assert {k: v.status for k, v in listed.items()} == {"": serving, "nnd.v1.Nnd": serving, name: serving}
        assert stub.Release(nnd_pb2.ReleaseRequest(model=name), timeout=60).state == nnd_pb2.META
        _wait_health(channel, name, not_serving)
        assert _health(channel, "") == serving
        stub.Unload(nnd_pb2.UnloadRequest(model=name), timeout=60)
        _wait_health(channel, name, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
        listed = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=5).statuses
        assert set(listed) == {"", "nnd.v1.Nnd"}  # an unloaded model is not listed
        assert _health(channel, "/no/such/model") is None  # never loaded: NOT_FOUND


# ---------------------------------------------------------------- versioning


def test_server_info(daemon):
    channel, stub = _stub(daemon.address)
    with channel:
        info = stub.GetServerInfo(nnd_pb2.GetServerInfoRequest(), timeout=10)
    assert info.version == nnd.__version__
    assert info.protocol == "nnd.v1"
    ops = set(info.ops)
    assert {"add", "getitem", "setitem", "iadd", "softmax", "call_module", "getattr", "randn"} <= ops
    assert {"shape", "logits"} <= set(info.attributes)
    assert "torch" in info.libraries and "cpu" in info.devices


def test_the_protocol_doc_lists_exactly_the_ops_the_daemon_accepts(daemon):
    """docs/protocol.md section 6.7 lists every op name, and section 6 gives their number: both as served."""
    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    section = doc[doc.index("### 6.7 The current list") : doc.index("## 7. Semantics")]
    listed = section.split("```text\n", 1)[1].split("```", 1)[0].split()
    channel, stub = _stub(daemon.address)
    with channel:
        served = list(stub.GetServerInfo(nnd_pb2.GetServerInfoRequest(), timeout=10).ops)
    from nnd_daemon.engine import ops

    # torch.nn.functional is served by rule (section 6.8): its names follow the daemon's torch.
    functional = [n for n in served if n.startswith(ops.FUNCTIONAL_PREFIX)]
    assert sorted(functional) == sorted(ops.FUNCTIONAL_PREFIX + n for n in ops.functional_names())
    named = [n for n in served if not n.startswith(ops.FUNCTIONAL_PREFIX)]
    assert listed == sorted(named)
    assert f"The current daemon accepts {len(named)} names" in " ".join(doc.split())


def test_a_clone_at_a_lower_id_reads_the_value_before_an_in_place_edit(daemon, gpt2):
    """The recipe of docs/protocol.md section 12: the clone (id 2) runs before the edit (ids 10-13) at
    the same hook; a read with a higher id (14) sees the edit."""

    def ref(i: int) -> graph_pb2.Arg:
        return graph_pb2.Arg(ref=i)

    def value(v: values_pb2.Value) -> graph_pb2.Arg:
        return graph_pb2.Arg(value=v)

    hook = graph_pb2.ModuleValue(path="transformer.h.0", point=graph_pb2.OUTPUT, invoke=0)
    all_ = value(values_pb2.Value(slice=values_pb2.Slice()))
    last = graph_pb2.Arg(tuple=graph_pb2.ArgList(items=[all_, value(values_pb2.Value(int=-1)), all_]))
    ones = values_pb2.Tensor(dtype=values_pb2.FLOAT32, shape=[64], data=np.ones(64, "<f4").tobytes())
    read = [graph_pb2.Node(id=1, module=hook), graph_pb2.Node(id=3, save=graph_pb2.Save(value=ref(1)))]
    edit = [
        graph_pb2.Node(id=1, module=hook),
        graph_pb2.Node(id=2, op=graph_pb2.Op(name="clone", args=[ref(1)])),
        graph_pb2.Node(id=3, save=graph_pb2.Save(value=ref(2))),
        graph_pb2.Node(id=10, op=graph_pb2.Op(name="getitem", args=[ref(1), last])),
        graph_pb2.Node(id=11, constant=values_pb2.Value(tensor=ones)),
        graph_pb2.Node(id=12, op=graph_pb2.Op(name="iadd", args=[ref(10), ref(11)])),
        graph_pb2.Node(id=13, op=graph_pb2.Op(name="setitem", args=[ref(1), last, ref(12)])),
        graph_pb2.Node(id=14, module=hook),
        graph_pb2.Node(id=15, save=graph_pb2.Save(value=ref(14))),
    ]
    channel, stub = _stub(daemon.address)
    with channel:
        plain = _collect(stub.Trace(_request(gpt2, *read), timeout=60))[3]
        edited = _collect(stub.Trace(_request(gpt2, *edit), timeout=60))
    np.testing.assert_array_equal(edited[3], plain)  # before the edit
    np.testing.assert_array_equal(edited[15][:, :-1], plain[:, :-1])  # after it: only the last position moved
    np.testing.assert_allclose(edited[15][:, -1], plain[:, -1] + 1, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("rpc", ["Scan", "Trace"])
def test_unknown_op_is_invalid_argument_naming_it(daemon, gpt2, rpc):
    channel, stub = _stub(daemon.address)
    node = graph_pb2.Node(
        id=1, op=graph_pb2.Op(name="os_system", args=[graph_pb2.Arg(value=values_pb2.Value(str="true"))])
    )
    with channel:
        err = _error(lambda: getattr(stub, rpc)(_request(gpt2, node), timeout=120))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "os_system" in err.details()


def test_node_without_kind_is_invalid_argument(daemon, gpt2):
    channel, stub = _stub(daemon.address)
    with channel:
        err = _error(lambda: stub.Scan(_request(gpt2, graph_pb2.Node(id=1)), timeout=60))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no kind" in err.details()


def test_unknown_module_is_not_found(daemon, gpt2):
    channel, stub = _stub(daemon.address)
    node = graph_pb2.Node(id=1, module=graph_pb2.ModuleValue(path="transformer.h.9", point=graph_pb2.OUTPUT))
    with channel:
        err = _error(lambda: stub.Scan(_request(gpt2, node), timeout=60))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert "transformer.h.9" in err.details()


def test_shape_error_names_the_line_and_the_python_exception_type(daemon, gpt2):
    """A torch error in an op: INVALID_ARGUMENT, the client's source line in the
    message, and `nnd-exception-type` in the trailing metadata."""
    channel, stub = _stub(daemon.address)
    three = values_pb2.Tensor(dtype=values_pb2.FLOAT32, shape=[3], data=np.ones(3, "<f4").tobytes())
    loc = graph_pb2.SourceLocation(file="nb.py", line=12, text="model.transformer.h[0].output + w")
    nodes = [
        graph_pb2.Node(id=1, module=graph_pb2.ModuleValue(path="transformer.h.0", point=graph_pb2.OUTPUT)),
        graph_pb2.Node(id=2, constant=values_pb2.Value(tensor=three)),
        graph_pb2.Node(id=3, loc=loc, op=graph_pb2.Op(name="add", args=[graph_pb2.Arg(ref=1), graph_pb2.Arg(ref=2)])),
        graph_pb2.Node(id=4, save=graph_pb2.Save(value=graph_pb2.Arg(ref=3))),
    ]
    with channel:
        err = _error(lambda: stub.Trace(_request(gpt2, *nodes), timeout=120))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert 'File "nb.py", line 12' in err.details() and loc.text in err.details()
    assert dict(err.trailing_metadata() or ()).get("nnd-exception-type") == "RuntimeError"


# ---------------------------------------------------------------- results on the wire


def _randn_request(model: str, n: int, seed: int) -> nnd_pb2.TraceRequest:
    size = graph_pb2.Arg(value=values_pb2.Value(int=n))
    op = graph_pb2.Op(name="randn", args=[size], kwargs={"seed": graph_pb2.Arg(value=values_pb2.Value(int=seed))})
    return _request(
        model, graph_pb2.Node(id=1, op=op), graph_pb2.Node(id=2, save=graph_pb2.Save(value=graph_pb2.Arg(ref=1)))
    )


def test_chunked_result_reassembles_in_order(daemon, gpt2):
    """A 4.8 MB tensor comes as a Saved naming a blob, then that blob's chunks in
    order; seeded randn is torch.randn with a CPU generator seeded so."""
    import torch

    n = 1_200_000
    channel, stub = _stub(daemon.address, BIG)
    with channel:
        responses = list(stub.Trace(_randn_request(gpt2, n, seed=3), timeout=120))
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds[0] == "saved" and kinds[-1] == "done" and kinds.count("chunk") >= 2
    blob = responses[0].saved.value.tensor.blob
    assert blob != 0 and not responses[0].saved.value.tensor.data
    assert all(r.chunk.blob == blob for r in responses if r.WhichOneof("kind") == "chunk")
    got = _collect(responses)[2]
    want = torch.randn(n, generator=torch.Generator().manual_seed(3)).numpy()
    np.testing.assert_array_equal(got, want)


def _results_of(responses) -> list:
    """A one-message response (TraceRequest.one_message) as the stream it stands for."""
    out = []
    for r in responses:
        if r.WhichOneof("kind") != "results":
            out.append(r)
            continue
        out += [nnd_pb2.TraceResponse(saved=s) for s in r.results.saved]
        out += [nnd_pb2.TraceResponse(chunk=c) for c in r.results.chunk]
        if r.results.HasField("paused"):
            out.append(nnd_pb2.TraceResponse(paused=r.results.paused))
        else:
            out.append(nnd_pb2.TraceResponse(done=r.results.done))
    return out


def test_a_trace_asking_for_one_message_gets_its_results_in_one(daemon, gpt2):
    """A small trace with `one_message` answers one TraceResults message (the same values as the
    stream: a seeded randn and a layer's output), through the daemon and on the worker's route."""
    import torch

    def request(one: bool) -> nnd_pb2.TraceRequest:
        req = _randn_request(gpt2, 1000, seed=5)
        req.graph.nodes.add(id=3, module=graph_pb2.ModuleValue(path="transformer.h.0", point=graph_pb2.OUTPUT))
        req.graph.nodes.add(id=4, save=graph_pb2.Save(value=graph_pb2.Arg(ref=3)))
        req.one_message = one
        return req

    channel, stub = _stub(daemon.address)
    route = stub.GetRoute(nnd_pb2.RouteRequest(model=gpt2), timeout=30)
    with channel, grpc.insecure_channel(route.address) as direct:
        on_route = nnd_pb2_grpc.NndStub(direct)
        streamed = list(stub.Trace(request(False), timeout=60))
        whole = list(stub.Trace(request(True), timeout=60))
        routed = list(on_route.Trace(request(True), timeout=60, metadata=[("nnd-epoch", str(route.epoch))]))
    assert [r.WhichOneof("kind") for r in streamed] == ["saved", "saved", "done"]
    for got in (whole, routed):
        assert [r.WhichOneof("kind") for r in got] == ["results"]
        assert len(got[0].results.saved) == 2 and got[0].results.done.compute_s > 0
        values, want = _collect(_results_of(got)), _collect(streamed)
        assert sorted(values) == [2, 4]
        for node in values:
            np.testing.assert_array_equal(values[node], want[node])
    np.testing.assert_array_equal(values[2], torch.randn(1000, generator=torch.Generator().manual_seed(5)).numpy())


@pytest.mark.parametrize("way", ["daemon", "route"])
def test_an_interact_stream_asking_for_one_message_gets_each_pause_in_one(daemon, gpt2, way):
    """With `one_message` in the start's request, a sync point's value comes with its Paused as one
    TraceResults, and the end's saved values with TraceDone: the same values as the two-message form.
    Through the daemon (the worker's private socket: the run on threads of its own) and on the route
    (the run on the stream's handler thread, writing and reading the stream itself)."""
    import queue

    def run(one: bool) -> tuple[list[list[str]], dict[int, np.ndarray]]:
        req = _request(gpt2)
        req.graph.nodes.add(id=1, module=graph_pb2.ModuleValue(path="transformer.h.0", point=graph_pb2.OUTPUT))
        req.graph.nodes.add(id=2, op=graph_pb2.Op(name="sum", args=[graph_pb2.Arg(ref=1)]))
        req.one_message = one
        more = graph_pb2.Graph()
        more.nodes.add(id=3, save=graph_pb2.Save(value=graph_pb2.Arg(ref=1)))
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        outbox.put(nnd_pb2.InteractRequest(start=nnd_pb2.InteractStart(request=req, want=[2])))
        channel, stub = _stub(daemon.address)
        metadata: list[tuple[str, str]] = []
        if way == "route":
            route = stub.GetRoute(nnd_pb2.RouteRequest(model=gpt2), timeout=30)
            channel.close()
            channel = grpc.insecure_channel(route.address)
            stub = nnd_pb2_grpc.NndStub(channel)
            metadata = [("nnd-epoch", str(route.epoch))]
        kinds: list[list[str]] = [[]]
        got: list = []
        with channel:
            for r in stub.Interact(iter(outbox.get, None), timeout=60, metadata=metadata):
                kinds[-1].append(r.WhichOneof("kind"))
                got.append(r)
                if r.WhichOneof("kind") == "paused" or (r.WhichOneof("kind") == "results" and r.results.HasField("paused")):
                    kinds.append([])
                    outbox.put(nnd_pb2.InteractRequest(more=nnd_pb2.InteractContinue(graph=more, finish=True)))
            outbox.put(None)
        values = {}
        for r in _results_of(got):
            if r.WhichOneof("kind") == "saved":
                t = r.saved.value.tensor
                values[r.saved.node] = np.frombuffer(t.data, "<f4").reshape(list(t.shape))
        return kinds, values

    two_kinds, two = run(False)
    one_kinds, one = run(True)
    assert two_kinds == [["saved", "paused"], ["saved", "done"]]
    assert one_kinds == [["results"], ["results"]]
    assert sorted(one) == sorted(two) == [2, 3]
    for node in one:
        np.testing.assert_array_equal(one[node], two[node])


def test_big_results_stream_in_chunks_even_when_one_message_is_asked(daemon, gpt2):
    import torch

    req = _randn_request(gpt2, 1_200_000, seed=4)
    req.one_message = True
    channel, stub = _stub(daemon.address)
    with channel:
        responses = list(stub.Trace(req, timeout=120))
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds[0] == "saved" and kinds[-1] == "done" and kinds.count("chunk") >= 2 and "results" not in kinds
    want = torch.randn(1_200_000, generator=torch.Generator().manual_seed(4)).numpy()
    np.testing.assert_array_equal(_collect(responses)[2], want)


def test_a_client_with_default_limits_receives_big_results(daemon, gpt2):
    channel, stub = _stub(daemon.address)  # gRPC defaults: 4 MiB receive limit
    with channel:
        got = _collect(stub.Trace(_randn_request(gpt2, 1_200_000, seed=0), timeout=120))
    assert got[2].shape == (1_200_000,)


# ---------------------------------------------------------------- the worked example file


def _last_position() -> graph_pb2.Arg:
    whole = graph_pb2.Arg(value=values_pb2.Value(slice=values_pb2.Slice()))
    last = graph_pb2.Arg(value=values_pb2.Value(int=-1))
    return graph_pb2.Arg(tuple=graph_pb2.ArgList(items=[whole, last, whole]))


def worked_example(vector: np.ndarray, path: str = "transformer.h.0") -> graph_pb2.Graph:
    """`model.<path>.output[:, -1, :] += v; model.lm_head.output.save()`, built with the stubs."""
    ref = lambda i: graph_pb2.Arg(ref=i)  # noqa: E731
    tensor = values_pb2.Tensor(dtype=values_pb2.FLOAT32, shape=[vector.size], data=vector.astype("<f4").tobytes())
    g = graph_pb2.Graph()
    g.nodes.add(id=1, module=graph_pb2.ModuleValue(path=path, point=graph_pb2.OUTPUT, invoke=0))
    g.nodes.add(id=2, op=graph_pb2.Op(name="getitem", args=[ref(1), _last_position()]))
    g.nodes.add(id=3, constant=values_pb2.Value(tensor=tensor))
    g.nodes.add(id=4, op=graph_pb2.Op(name="iadd", args=[ref(2), ref(3)]))
    g.nodes.add(id=5, op=graph_pb2.Op(name="setitem", args=[ref(1), _last_position(), ref(4)]))
    g.nodes.add(id=6, module=graph_pb2.ModuleValue(path="lm_head", point=graph_pb2.OUTPUT, invoke=0))
    g.nodes.add(id=7, save=graph_pb2.Save(value=ref(6)))
    return g


def test_worked_example_file_is_the_documented_graph():
    parsed = text_format.Parse(GRAPH_FILE.read_text(), nnd_pb2.TraceRequest())
    assert [i.text for i in parsed.invokes] == ["The Eiffel Tower is in the city of"]
    for node in parsed.graph.nodes:
        node.ClearField("loc")
    vector = ((2 * np.arange(64) - 63) / 64).astype("<f4")
    assert parsed.graph == worked_example(vector)


def test_worked_example_file_runs_through_the_cli(daemon, gpt2):
    model = gpt2  # loaded: `nnd trace` runs on a loaded model
    out = json.loads(daemon.cli("trace", model, "--graph", str(GRAPH_FILE), "--json").stdout)
    assert list(out) == ["7"]
    from_cli = np.array(out["7"], dtype=np.float32)

    vector = ((2 * np.arange(64) - 63) / 64).astype("<f4")
    prompt = "The Eiffel Tower is in the city of"
    request = nnd_pb2.TraceRequest(model=model, invokes=[nnd_pb2.Invoke(text=prompt)], graph=worked_example(vector))
    channel, stub = _stub(daemon.address, BIG)
    with channel:
        from_python = _collect(stub.Trace(request, timeout=120))[7]
        # Without the edit the logits differ: the file's constant did something.
        request.graph.CopyFrom(graph_pb2.Graph(nodes=request.graph.nodes[5:]))
        plain = _collect(stub.Trace(request, timeout=120))[7]
    assert from_cli.shape == from_python.shape == (1, 14, 320)
    np.testing.assert_allclose(from_cli, from_python, atol=1e-5, rtol=0)
    assert np.abs(plain[0, -1] - from_python[0, -1]).max() > 1e-2
    # Without --json: one summary line per saved value (shape, dtype, first values, statistics), not 4,480 numbers.
    (line,) = daemon.cli("trace", model, "--graph", str(GRAPH_FILE)).stdout.splitlines()
    assert line.startswith("node 7: [1, 14, 320] float32  [") and len(line) < 300, line
    assert f"min {from_cli.min():.4g}  max {from_cli.max():.4g}  mean {from_cli.mean():.4g}" in line, line


def test_json_output_keeps_numbers_numbers(daemon, gpt2):
    """`--json` is for programs: 64-bit counts and config values are numbers, not the strings protobuf's
    JSON mapping makes of them."""
    (info,) = [m for m in json.loads(daemon.cli("ps", "--json").stdout) if m["name"] == gpt2]
    assert isinstance(info["num_parameters"], int) and info["num_parameters"] > 0
    assert isinstance(info["config"]["n_layer"], int) and info["config"]["model_type"] == "gpt2"


def test_the_documented_worked_example_is_that_graph_for_gpt2_small():
    """docs/protocol.md's example parses as a TraceRequest and is the same graph for
    transformer.h.5 (width 768), once its abbreviated constant is filled in."""
    import re

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    section = doc[doc.index("## 12. Worked example") :]
    text = section[
        section.index("```textproto") + len("```textproto") : section.index("```\n", section.index("```textproto") + 3)
    ]
    vector = ((2 * np.arange(768) - 767) / 768).astype("<f4")
    escaped = "".join(f"\\x{b:02x}" for b in vector.tobytes())
    text, n = re.subn(r'data: "[^"]*\.\.\."', lambda _: f'data: "{escaped}"', text)
    assert n == 1, "the example's abbreviated constant was not found"
    parsed = text_format.Parse(text, nnd_pb2.TraceRequest())
    assert parsed.model == "openai-community/gpt2"
    assert [i.text for i in parsed.invokes] == ["The Eiffel Tower is in the city of"]
    for node in parsed.graph.nodes:
        node.ClearField("loc")
    assert parsed.graph == worked_example(vector, path="transformer.h.5")


# ---------------------------------------------------------------- sessions, stored edits, aliases (raw stubs)


def _zero_last_position_edit(path: str) -> graph_pb2.Graph:
    """`model.<path>.output[:, -1, :] = 0` for every invoke (an edit names none)."""
    g = graph_pb2.Graph()
    g.nodes.add(id=1, module=graph_pb2.ModuleValue(path=path, point=graph_pb2.OUTPUT))
    g.nodes.add(
        id=2,
        op=graph_pb2.Op(
            name="setitem",
            args=[graph_pb2.Arg(ref=1), _last_position(), graph_pb2.Arg(value=values_pb2.Value(float=0.0))],
        ),
    )
    return g


def _save_outputs(*paths: str, first: int = 1) -> graph_pb2.Graph:
    g = graph_pb2.Graph()
    for i, path in enumerate(paths):
        g.nodes.add(id=first + 2 * i, module=graph_pb2.ModuleValue(path=path, point=graph_pb2.OUTPUT, invoke=0))
        g.nodes.add(id=first + 2 * i + 1, save=graph_pb2.Save(value=graph_pb2.Arg(ref=first + 2 * i)))
    return g


def test_stored_edit_applies_only_to_requests_that_name_it(daemon, gpt2):
    channel, stub = _stub(daemon.address)
    name = "zero-h0-last-protocol-test"
    with channel:
        info = stub.CreateEdit(
            nnd_pb2.CreateEditRequest(model=gpt2, graph=_zero_last_position_edit("transformer.h.0"), name=name),
            timeout=60,
        )
        try:
            assert info.id == name and info.named and info.graphs == 1 and info.nodes == 2
            assert name in {e.id for e in stub.ListEdits(nnd_pb2.ListEditsRequest(model=gpt2), timeout=30).edits}
            err = _error(
                lambda: stub.CreateEdit(
                    nnd_pb2.CreateEditRequest(model=gpt2, graph=_zero_last_position_edit("transformer.h.1"), name=name),
                    timeout=60,
                )
            )
            assert err.code() == grpc.StatusCode.ALREADY_EXISTS

            request = nnd_pb2.TraceRequest(
                model=gpt2,
                invokes=[nnd_pb2.Invoke(text="Hello world")],
                graph=_save_outputs("transformer.h.0", "lm_head"),
            )
            plain = _collect(stub.Trace(request, timeout=120))
            request.edits.append(name)
            edited = _collect(stub.Trace(request, timeout=120))
            # Saved ids are the request's own; the request reads h.0 after the edit's write.
            assert set(edited) == set(plain) == {2, 4}
            assert np.all(edited[2][:, -1] == 0) and np.any(plain[2][:, -1] != 0)
            np.testing.assert_array_equal(edited[2][:, :-1], plain[2][:, :-1])
            assert np.abs(edited[4][0, -1] - plain[4][0, -1]).max() > 1e-3
            # A request that does not name it is unaffected.
            del request.edits[:]
            np.testing.assert_array_equal(_collect(stub.Trace(request, timeout=120))[4], plain[4])
        finally:
            stub.DeleteEdit(nnd_pb2.DeleteEditRequest(model=gpt2, id=name), timeout=30)
        request.edits.append(name)
        err = _error(lambda: stub.Trace(request, timeout=120))
        assert err.code() == grpc.StatusCode.NOT_FOUND and name in err.details()


def test_session_values_flow_between_traces(daemon, gpt2):
    """Trace 0 reads h.1 of one prompt (no save); trace 1 patches it into another
    prompt's last position by referring to trace 0's node id."""
    first = graph_pb2.Graph()
    first.nodes.add(id=1, module=graph_pb2.ModuleValue(path="transformer.h.1", point=graph_pb2.OUTPUT, invoke=0))
    first.nodes.add(id=2, op=graph_pb2.Op(name="getitem", args=[graph_pb2.Arg(ref=1), _last_position()]))
    second = graph_pb2.Graph()
    second.nodes.add(id=10, module=graph_pb2.ModuleValue(path="transformer.h.1", point=graph_pb2.OUTPUT, invoke=0))
    second.nodes.add(
        id=11, op=graph_pb2.Op(name="setitem", args=[graph_pb2.Arg(ref=10), _last_position(), graph_pb2.Arg(ref=2)])
    )
    second.nodes.add(id=12, module=graph_pb2.ModuleValue(path="transformer.h.1", point=graph_pb2.OUTPUT, invoke=0))
    second.nodes.add(id=13, save=graph_pb2.Save(value=graph_pb2.Arg(ref=12)))
    session = nnd_pb2.SessionRequest(model=gpt2)
    session.traces.add(request=nnd_pb2.TraceRequest(invokes=[nnd_pb2.Invoke(text="The Eiffel Tower")], graph=first))
    session.traces.add(request=nnd_pb2.TraceRequest(invokes=[nnd_pb2.Invoke(text="Hello world")], graph=second))
    channel, stub = _stub(daemon.address)
    with channel:
        got = _collect(stub.Session(session, timeout=120))
        alone = _collect(
            stub.Trace(
                nnd_pb2.TraceRequest(
                    model=gpt2,
                    invokes=[nnd_pb2.Invoke(text="The Eiffel Tower")],
                    graph=_save_outputs("transformer.h.1"),
                ),
                timeout=120,
            )
        )
    assert list(got) == [13]
    np.testing.assert_array_equal(got[13][:, -1], alone[2][:, -1])


def test_aliases_are_listed_and_resolve(daemon, gpt2):
    channel, stub = _stub(daemon.address)
    with channel:
        info = stub.GetModel(nnd_pb2.GetModelRequest(model=gpt2), timeout=30)
        aliases = {m.path: set(m.aliases) for m in info.modules}
        assert "layers" in aliases["transformer.h"]
        assert "transformer.h.0.attention" in aliases["transformer.h.0.attn"]
        prompt = [nnd_pb2.Invoke(text="Hello world")]
        by_alias = _collect(
            stub.Trace(
                nnd_pb2.TraceRequest(model=gpt2, invokes=prompt, graph=_save_outputs("layers.0.mlp")), timeout=120
            )
        )
        by_path = _collect(
            stub.Trace(
                nnd_pb2.TraceRequest(model=gpt2, invokes=prompt, graph=_save_outputs("transformer.h.0.mlp")),
                timeout=120,
            )
        )
    np.testing.assert_array_equal(by_alias[2], by_path[2])


def test_cache_result_shape_on_the_wire(daemon, gpt2):
    """A Cache node comes back under its id: map path -> list (one per call) -> map {"output": tensor}."""
    g = graph_pb2.Graph()
    g.nodes.add(id=1, cache=graph_pb2.Cache(modules=["transformer.h.1", "lm_head"], outputs=True))
    g.nodes.add(id=2, module=graph_pb2.ModuleValue(path="lm_head", point=graph_pb2.OUTPUT))
    g.nodes.add(id=3, save=graph_pb2.Save(value=graph_pb2.Arg(ref=2)))
    request = nnd_pb2.TraceRequest(model=gpt2, invokes=[nnd_pb2.Invoke(text="Hello world")], graph=g)
    channel, stub = _stub(daemon.address)
    with channel:
        responses = list(stub.Trace(request, timeout=120))
    cached = next(r.saved.value for r in responses if r.WhichOneof("kind") == "saved" and r.saved.node == 1)
    assert set(cached.map.items) == {"transformer.h.1", "lm_head"}
    calls = cached.map.items["lm_head"].list.items
    assert len(calls) == 1 and set(calls[0].map.items) == {"output"}
    t = calls[0].map.items["output"].tensor
    assert t.dtype == values_pb2.FLOAT32 and list(t.shape)[-1] == 320
    np.testing.assert_array_equal(np.frombuffer(t.data, "<f4").reshape(list(t.shape)), _collect(responses)[3])


def test_gradient_of_a_module_value_matches_torch(daemon, gpt2, tiny_models):
    """Backward from logits[0, -1, 7]; Grad of transformer.h.0's output equals torch autograd's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    g = graph_pb2.Graph()
    g.nodes.add(id=1, module=graph_pb2.ModuleValue(path="transformer.h.0", point=graph_pb2.OUTPUT))
    g.nodes.add(id=2, module=graph_pb2.ModuleValue(path="lm_head", point=graph_pb2.OUTPUT))
    index = graph_pb2.Arg(
        tuple=graph_pb2.ArgList(items=[graph_pb2.Arg(value=values_pb2.Value(int=i)) for i in (0, -1, 7)])
    )
    g.nodes.add(id=3, op=graph_pb2.Op(name="getitem", args=[graph_pb2.Arg(ref=2), index]))
    g.nodes.add(id=4, backward=graph_pb2.Backward(loss=graph_pb2.Arg(ref=3)))
    g.nodes.add(id=5, grad=graph_pb2.Grad(value=1, backward=4))
    g.nodes.add(id=6, save=graph_pb2.Save(value=graph_pb2.Arg(ref=5)))
    prompt = "The Eiffel Tower"
    channel, stub = _stub(daemon.address)
    with channel:
        got = _collect(
            stub.Trace(nnd_pb2.TraceRequest(model=gpt2, invokes=[nnd_pb2.Invoke(text=prompt)], graph=g), timeout=120)
        )[6]

    path = tiny_models["gpt2"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    seen = {}

    def keep(module, args, output):
        output.retain_grad()
        seen["h0"] = output

    handle = model.transformer.h[0].register_forward_hook(keep)
    try:
        model(torch.tensor([tok(prompt)["input_ids"]])).logits[0, -1, 7].backward()
    finally:
        handle.remove()
    want = seen["h0"].grad.numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-5)
    assert np.abs(want).max() > 0


def test_the_daemon_process_never_loads_torch(process_daemon, tiny_models):
    """The control plane stays light: models are built in the helper and run in workers, so after
    GetServerInfo, a scan and a trace forwarded through it, torch's library is not mapped in the
    daemon's process (a daemon that imported torch would carry its ~1 GB of mappings and seconds of start)."""
    daemon = process_daemon  # the session's other daemon serves from threads of its own process, torch and all
    channel, stub = _stub(daemon.address, BIG)
    with channel:
        gpt2 = stub.LoadModel(nnd_pb2.LoadModelRequest(model=tiny_models["gpt2"]), timeout=60).name
        info = stub.GetServerInfo(nnd_pb2.GetServerInfoRequest(), timeout=120)
        assert "add" in info.ops and info.libraries["torch"]
        request = nnd_pb2.TraceRequest(model=gpt2, invokes=[nnd_pb2.Invoke(text="Hello world")])
        node = request.graph.nodes.add(id=1)
        node.module.path, node.module.point = "transformer.h.0", graph_pb2.OUTPUT
        request.graph.nodes.add(id=2).save.value.ref = 1
        for rpc in (stub.Scan, stub.Trace):  # without a route: the daemon forwards the bytes
            assert list(rpc(request, timeout=300))[-1].WhichOneof("kind") == "done"
        worker = int(stub.GetModel(nnd_pb2.GetModelRequest(model=gpt2), timeout=60).worker_pids[0])
    maps = {pid: pathlib.Path(f"/proc/{pid}/maps").read_text() for pid in (daemon.proc.pid, worker)}
    assert "libtorch" not in maps[daemon.proc.pid] and "libtorch" in maps[worker]
