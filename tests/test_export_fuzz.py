"""A fuzzer of uploaded torch.export programs: mutations of real archives' JSON
(operator names swapped into every position an operator can appear, fields
added and removed, values retyped, shape expressions grown) go through the
checker the daemon uses and, where it accepts them, through torch's loader and
a forward pass, in process; a handful also go through a real daemon. No
mutation may run code (a canary file stays uncreated), a mutation naming a
file, storage or Python operator must be refused, and only INVALID_ARGUMENT may
come back. NND_FUZZ_EXPORT=500 runs 500 mutations (50 by default)."""

from __future__ import annotations

import copy
import os
import random
from collections import Counter
from typing import Any

import grpc
import pytest
import torch
from daemonproc import start_daemon
from exportcraft import file_call, read_program, with_program

import nnd
from nnd.models import _nnsight, _upload
from nnd.v1 import nnd_pb2, nnd_pb2_grpc
from nnd_daemon import errors
from nnd_daemon.export import exported

COUNT = int(os.environ.get("NND_FUZZ_EXPORT", "50"))
THROUGH_DAEMON = 6

# Operators that must never get through, wherever they are put ({canary} is the file they would create).
HOSTILE = [
    "torch.os.system",
    "torch.ops.aten.from_file.default",
    "torch.ops.aten.set_.source_Storage",
    "torch.ops.aten.set_.source_Storage_storage_offset",
    "torch.ops.aten.add.str",
    "torch.ops.aten.__class__.__init__",
    "torch.ops.aten._unsafe_index.Tensor",
    "torch.ops.aten.sparse_coo_tensor.indices",
    "torch.ops.aten._nested_view_from_buffer.default",
    "torch.load",
    "torch.save",
    "torch.serialization.os.system",
    "torch._C._jit_set_profiling_executor",
    "builtins.eval",
    "_operator.attrgetter",
    "math.os.system",
    "#custom:op",
]
HARMLESS = ["torch.ops.aten.relu.default", "torch.ops.aten.mul.Tensor", "_operator.add", "torch.ops.higher_order.cond"]
EXPRESSIONS = [
    "Pow({e}, Pow(Integer(10), Integer(8)))",
    "Pow({e}, Integer(2))",
    "Pow({e}, Integer(65))",
    "Mul({e}, Integer(" + "7" * 400 + "))",
    "{e}**{e}",
    "({e})**64**64",
    "Add({e}, Symbol('s0').__class__)",
    "__import__('os').system('touch {canary}')",
    "Symbol('s0', precision=10**9)",
    "lambda: {e}",
    "FloorDiv({e}, Integer(2))",
    "Max(Integer(1), {e})",
]
FIELDS = ["code", "guards_code", "as_operator", "target", "__class__", "source_fn_stack", "extra"]


class _Module(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 4)
        self.b = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # a wrap_with_set_grad_enabled subgraph
            y = self.a(x)
        return self.b(y.relu()).reshape(-1)  # a size expression (3 * batch)


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    canary = str(tmp_path_factory.getbasetemp() / "canary")
    hop = _nnsight.export(_Module(), torch.rand(1, 3))
    seq_archive = _nnsight.export(seq, torch.rand(1, 3))
    # The attack as a base too: swaps move its operator into and out of the operand position.
    attack = with_program(seq_archive, file_call(read_program(seq_archive), canary, shared=True, size=8))
    return [hop, seq_archive, attack]


def _spots(tree: Any) -> tuple[list[dict], list[dict], list[tuple[Any, Any]], list[dict]]:
    """Nodes, Argument-like objects, every (container, key) of the tree, and shape expressions."""
    nodes: list[dict] = []
    args: list[dict] = []
    slots: list[tuple[Any, Any]] = []
    exprs: list[dict] = []
    stack = [tree]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "target" in item and "inputs" in item:
                nodes.append(item)
            if len(item) == 1 and next(iter(item)).startswith("as_"):
                args.append(item)
            if "expr_str" in item:
                exprs.append(item)
            for k, v in item.items():
                slots.append((item, k))
                stack.append(v)
        elif isinstance(item, list):
            for i, v in enumerate(item):
                slots.append((item, i))
                stack.append(v)
    return nodes, args, slots, exprs


def mutate(program: dict, rng: random.Random, canary: str) -> tuple[str, dict]:
    """(kind, a mutated copy of `program`)."""
    out = copy.deepcopy(program)
    nodes, args, slots, exprs = _spots(out)
    op = rng.choice(HOSTILE + HARMLESS)
    kind = rng.choice(["target", "argument", "operand", "metadata", "field", "drop", "retype", "expression"])
    if kind == "target":
        rng.choice(nodes)["target"] = op
    elif kind == "argument":
        arg = rng.choice(args)
        arg.clear()
        arg["as_operator"] = op
    elif kind == "operand":  # a control-flow operand (a subgraph or the attack's operator) swapped
        hops = [n for n in nodes if n["target"].startswith("torch.ops.higher_order.")] or nodes
        node = rng.choice(hops)
        if node["inputs"]:
            slot = rng.choice(node["inputs"])
            slot["arg"] = rng.choice([{"as_operator": op}, {"as_string": canary}, {"as_tensor": {"name": "x"}}])
    elif kind == "metadata":
        rng.choice(nodes)["metadata"][rng.choice(["source_fn_stack", "torch_fn", "custom"])] = f"x,{op}"
    elif kind == "field":
        objects = [c for c, _ in slots if isinstance(c, dict)]
        rng.choice(objects)[rng.choice(FIELDS)] = rng.choice([op, 1, [], {"as_operator": op}])
    elif kind == "drop":
        container, key = rng.choice([(c, k) for c, k in slots if isinstance(c, dict)])
        del container[key]
    elif kind == "retype":
        container, key = rng.choice(slots)
        container[key] = rng.choice([op, 2**80, -1, 1.5, None, True, [], {}, [op], {"as_operator": op}])
    else:
        if not exprs:  # give a size an expression to grow
            tensor = next(iter(out["graph_module"]["graph"]["tensor_values"].values()))
            tensor["sizes"][0] = {"as_expr": {"expr_str": "Symbol('s0', positive=True, integer=True)"}}
            exprs = [tensor["sizes"][0]["as_expr"]]
        target = rng.choice(exprs)
        for _ in range(rng.randint(1, 3)):
            target["expr_str"] = rng.choice(EXPRESSIONS).format(e=target["expr_str"], canary=canary)
    return kind, out


def _hostile(program: dict) -> bool:
    """Whether the program names an operator where torch would resolve it: a node target from
    HOSTILE, any operator passed as a value, or the metadata torch resolves operators from."""
    nodes, _, slots, _ = _spots(program)
    return any(n["target"] in HOSTILE for n in nodes) or any(
        k in ("as_operator", "source_fn_stack") for c, k in slots if isinstance(c, dict)
    )


def _run_in_process(tmp: Any, archive: bytes) -> str:
    """'refused' or 'ran'; anything but INVALID_ARGUMENT from the daemon's loader fails the test."""
    path = tmp / "program.pt2"
    path.write_bytes(archive)
    try:
        module = exported._unflatten(exported.load_program(str(path)))
    except errors.InvalidArgument:
        return "refused"
    # The context restores grad mode: a forward that fails inside an unflattened no_grad region
    # leaves it off (the daemon's engine wraps every request in such a context too).
    with torch.enable_grad():
        try:
            module(torch.rand(2, 3))
        except Exception:  # noqa: BLE001 - an accepted but inconsistent program may fail as torch pleases
            pass
    return "ran"


def test_mutated_programs_never_run_code(tmp_path, tmp_path_factory, bases):
    canary = tmp_path_factory.getbasetemp() / "canary"
    rng = random.Random(22)
    outcomes: Counter[tuple[str, str]] = Counter()
    for i in range(COUNT):
        base = bases[i % len(bases)]
        kind, program = mutate(read_program(base), rng, str(canary))
        outcome = _run_in_process(tmp_path, with_program(base, program))
        outcomes[kind, outcome] += 1
        if _hostile(program):
            assert outcome == "refused", f"mutation {i} ({kind}) names a hostile operator and was accepted"
        assert not canary.exists(), f"mutation {i} ({kind}) ran code"
    print(sorted(outcomes.items()))
    kinds = {k for k, _ in outcomes}
    assert sum(n for (_, o), n in outcomes.items() if o == "refused") > COUNT // 3, outcomes
    assert len(kinds) >= 6, outcomes  # the mutations reached most positions


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    d = start_daemon(tmp_path_factory.mktemp("fuzz"))
    yield d
    d.stop()


def test_a_daemon_survives_mutated_uploads(tmp_path_factory, daemon, bases):
    canary = tmp_path_factory.getbasetemp() / "canary"
    rng = random.Random(2222)
    with grpc.insecure_channel(daemon.address) as channel:
        stub = nnd_pb2_grpc.NndStub(channel)
        for i in range(THROUGH_DAEMON):
            base = bases[i % len(bases)]
            kind, program = mutate(read_program(base), rng, str(canary))
            payload = _upload.Payload("exported", [("program.pt2", with_program(base, program))])
            try:
                stub.Upload(payload.messages([0]), timeout=120)
                stub.LoadModel(nnd_pb2.LoadModelRequest(model=f"m{i}", upload=payload.sha256), timeout=120)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (i, kind, err.details())
            else:
                assert not _hostile(program), (i, kind)
            assert daemon.proc.poll() is None
        stub.GetServerInfo(nnd_pb2.GetServerInfoRequest(), timeout=30)
    assert not canary.exists()
    # The daemon still loads and runs a valid upload.
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 2))
    wrapped = nnd.NNsight(net, torch.rand(1, 3), address=daemon.address, name="after", device="cpu")
    x = torch.rand(2, 3)
    with wrapped.trace(x):
        out = wrapped[0].output.save()
    assert torch.allclose(out, net(x), atol=1e-6)
