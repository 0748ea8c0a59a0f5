"""No request freezes or kills the daemon (issue #22, S2).

Work whose cost a client shapes (meta builds, scans, tokenizing, edit checks)
runs in the daemon's helper process, under an address-space limit and a
per-call CPU-time bound (control/helper_supervisor.py). Each attempt below, which once
froze the daemon or had it OOM-killed with every worker, ends in a clear
status while the daemon's health check keeps answering within 1 s and another
model's logits stay bit-identical.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import psutil
import pytest
import torch
from daemonproc import Daemon, start_daemon

import nnd
from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc, values_pb2

PROMPT = "The Eiffel Tower is in the city of"
CPU_S = 10  # the helper's per-call CPU bound here; every attack needs far more
RSS: dict[str, int] = {}  # the daemon's resident memory before the attacks


@pytest.fixture(scope="module")
def bounded(tmp_path_factory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("bounded"), "--helper-cpu-s", str(CPU_S), "--helper-memory", "2GiB")
    yield d
    d.stop()


@pytest.fixture(scope="module")
def stub(bounded) -> Iterator[nnd_pb2_grpc.NndStub]:
    with grpc.insecure_channel(bounded.address) as channel:
        yield nnd_pb2_grpc.NndStub(channel)


@pytest.fixture(scope="module")
def gpt2(bounded, tiny_models) -> str:
    nnd.TransformersModel(tiny_models["gpt2"], address=bounded.address, device="cpu")
    return tiny_models["gpt2"]


@pytest.fixture(scope="module")
def bystander(bounded, tiny_models) -> Callable[[], torch.Tensor]:
    """A dispatched model other than the attacked one: its logits, on demand."""
    llama = nnd.TransformersModel(tiny_models["llama"], address=bounded.address, device="cpu", dispatch=True)
    RSS["before"] = psutil.Process(bounded.proc.pid).memory_info().rss

    def logits() -> torch.Tensor:
        with llama.trace(PROMPT):
            out = llama.lm_head.output.save()
        return out

    return logits


class Health:
    """Calls grpc.health.v1 Check on the daemon until stopped, each with a 5 s deadline:
    a frozen daemon never answers, while a busy 2-core box may take a second."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.answers = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._answered = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5.0)
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                    self.answers += 1
                except (grpc.RpcError, AssertionError) as exc:
                    self.failures.append(repr(exc))
                self._answered.set()
                if self._stop.wait(0.1):
                    return

    def __enter__(self) -> Health:
        self._thread.start()
        self._answered.wait(30)  # checking before the attack starts
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def contained(bounded, bystander) -> Iterator[None]:
    """Around one attack: health answers throughout, the other model's logits do not change."""
    before = bystander()
    with Health(bounded.address) as health:
        yield
    assert health.answers > 0 and not health.failures, health.failures[:3]
    assert bounded.proc.poll() is None
    assert torch.equal(bystander(), before)


def _status(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _value(v: object) -> values_pb2.Value:
    return values_pb2.Value(int=v) if isinstance(v, int) else values_pb2.Value(str=v)


def _scan(model: str, *nodes: graph_pb2.Node) -> nnd_pb2.TraceRequest:
    return nnd_pb2.TraceRequest(
        model=model,
        invokes=[nnd_pb2.Invoke(tokens=nnd_pb2.TokenIds(ids=[1, 2, 3]))],
        graph=graph_pb2.Graph(nodes=list(nodes)),
    )


def _op(node_id: int, name: str, *args: object) -> graph_pb2.Node:
    return graph_pb2.Node(id=node_id, op=graph_pb2.Op(name=name, args=[graph_pb2.Arg(value=_value(a)) for a in args]))


def _save(node_id: int, ref: int) -> graph_pb2.Node:
    return graph_pb2.Node(id=node_id, save=graph_pb2.Save(value=graph_pb2.Arg(ref=ref)))


@pytest.mark.parametrize(("a", "op", "b"), [(2, "pow", 10**9), ("x", "mul", 2**33), (1, "lshift", 2**40)])
def test_plain_value_ops_are_refused_not_run(stub, gpt2, contained, a, op, b):
    err = _status(lambda: list(stub.Scan(_scan(gpt2, _op(1, op, a, b), _save(2, 1)), timeout=120)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "bounded" in err.details(), err.details()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _constants_scan(model: str, n: int) -> bytes:
    """A Scan of `n` constant nodes, encoded directly (building n messages takes the test minutes)."""
    nodes = []
    for i in range(n):
        node = b"\x08" + _varint(i + 1) + _field(11, b"\x10" + _varint(i))  # Node(id=i+1, constant=Value(int=i))
        nodes.append(_field(1, node))
    head = _scan(model).SerializeToString()  # model and input; its graph is empty
    return head + _field(3, b"".join(nodes))


@pytest.fixture(scope="module")
def two_million(gpt2) -> bytes:
    """Built before the health checks start: building it holds this process's GIL for seconds."""
    request = _constants_scan(gpt2, 2_000_000)
    assert len(nnd_pb2.TraceRequest.FromString(request).graph.nodes) == 2_000_000
    return request


@pytest.mark.timeout(900)
def test_a_scan_of_two_million_constants_is_refused(bounded, two_million, contained):
    request = two_million
    with grpc.insecure_channel(bounded.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        scan = channel.unary_stream("/nnd.v1.Nnd/Scan", request_serializer=None, response_deserializer=None)
        err = _status(lambda: list(scan(request, timeout=600)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_graph_nodes" in err.details(), err.details()


def _gpt2_config(src: str, dst: str, **changes: object) -> str:
    os.makedirs(dst)
    for name in os.listdir(src):
        if name.endswith(".json") and name != "config.json":
            shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.update(changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_a_config_with_twenty_thousand_layers_is_stopped(stub, gpt2, tmp_path, contained):
    path = _gpt2_config(gpt2, str(tmp_path / "deep"), n_layer=20000)
    err = _status(lambda: stub.LoadModel(nnd_pb2.LoadModelRequest(model=path), timeout=300))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "helper_" in err.details(), err.details()
    # The helper was stopped and replaced: the next call works.
    ids = stub.Tokenize(nnd_pb2.TokenizeRequest(model=gpt2, texts=["Hello world"]), timeout=120).ids[0].ids
    assert list(ids)


def test_a_huge_sparse_config_is_refused_before_it_is_read(stub, gpt2, tmp_path, contained):
    path = _gpt2_config(gpt2, str(tmp_path / "sparse"))
    with open(os.path.join(path, "config.json"), "r+b") as f:
        f.truncate(3 * 2**30)  # 3 GiB, almost none of it on disk
    err = _status(lambda: stub.LoadModel(nnd_pb2.LoadModelRequest(model=path), timeout=120))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "config.json" in err.details(), err.details()


def test_a_twenty_megabyte_tokenize_is_refused(stub, gpt2, contained):
    request = nnd_pb2.TokenizeRequest(model=gpt2, texts=["Hello world " * (20 * 2**20 // 12)])
    err = _status(lambda: stub.Tokenize(request, timeout=120))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_tokenize_bytes" in err.details()


def test_stacked_edits_are_bounded(stub, gpt2, contained):
    first = stub.CreateEdit(nnd_pb2.CreateEditRequest(model=gpt2, graph=graph_pb2.Graph()), timeout=120)
    err = _status(lambda: stub.CreateEdit(nnd_pb2.CreateEditRequest(model=gpt2, base=[first.id] * 4), timeout=60))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "once" in err.details()
    top = first
    with pytest.raises(grpc.RpcError) as info:
        for _ in range(100):
            top = stub.CreateEdit(nnd_pb2.CreateEditRequest(model=gpt2, base=[top.id]), timeout=60)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "64" in info.value.details()
    assert top.graphs == 64


def _helper(daemon: Daemon) -> psutil.Process:
    # The heavy lane (Scans, meta builds); the light one (Tokenize, Decode) is helper-light.sock.
    (helper,) = [
        p for p in psutil.Process(daemon.proc.pid).children(recursive=True)  # forked: the fork server's children
        if "nnd_daemon.helper" in p.cmdline() and any(a.endswith("/helper.sock") for a in p.cmdline())
    ]
    return helper


def test_a_killed_helper_is_replaced_and_the_next_scan_works(bounded, stub, gpt2, contained):
    model = nnd.TransformersModel(gpt2, address=bounded.address, device="cpu")
    with model.scan(PROMPT):
        before = nnd.save(model.transformer.h[0].output.shape)
    helper = _helper(bounded)
    os.kill(helper.pid, signal.SIGKILL)
    ended = f"the helper process (pid {helper.pid}) ended: killed by SIGKILL"
    while ended not in bounded.log():  # the daemon noticed (it then starts a new one for the next call)
        time.sleep(0.05)
    with model.scan(PROMPT):
        after = nnd.save(model.transformer.h[0].output.shape)
    assert after == before and _helper(bounded).pid != helper.pid


def test_the_daemons_memory_stays_bounded(bounded, stub, gpt2, bystander):
    """Runs last: the attacks above did not grow the daemon by what they asked for (GiBs)."""
    rss = psutil.Process(bounded.proc.pid).memory_info().rss
    print(f"daemon RSS: {RSS['before'] / 2**20:.0f} MiB before the attacks, {rss / 2**20:.0f} MiB after")
    assert rss - RSS["before"] < 2**30
