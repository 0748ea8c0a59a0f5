"""The Node.js example client (examples/node) against a real daemon.

Its numbers are checked twice: against the same TraceRequest built here with
the Python stubs and sent over gRPC (the wire encoding agrees), and against a
plain-PyTorch forward with a forward hook that adds the same vector (the
daemon computes the right thing). Its Dispatch progress, Scan shapes and
streamed Generate steps are checked the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import select
import shutil
import signal
import subprocess
import time
from typing import Any

import grpc
import numpy as np
import pytest

from nnd.v1 import graph_pb2, nnd_pb2, nnd_pb2_grpc, values_pb2

NODE_DIR = pathlib.Path(__file__).resolve().parents[1] / "examples" / "node"
SHORT_PROMPT = "The Eiffel Tower is in the city of"
NEW_TOKENS = 3
# 105 tokens with the tiny tokenizer: its logits (105 x 320 float32) exceed the
# 64 KiB inline limit, so they come back chunked.
LONG_PROMPT = (
    "A daemon keeps models loaded so that every notebook shares one copy, and a JavaScript visualiser "
    "asks it what layer five of the model thinks about the Eiffel Tower in the city of"
)

pytestmark = pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None, reason="node and npm are needed"
)


# ---------------------------------------------------------------- the request, built in Python


def steering_vector(width: int, seed: int, scale: float) -> np.ndarray:
    """The Node client's vector: Numerical Recipes' LCG, (2u - 1) * scale, rounded to float32."""
    state = seed & 0xFFFFFFFF
    out = np.empty(width, dtype="<f4")
    for i in range(width):
        state = (1664525 * state + 1013904223) & 0xFFFFFFFF
        out[i] = (state / 4294967296 * 2 - 1) * scale
    return out


def _slice_all() -> graph_pb2.Arg:
    return graph_pb2.Arg(value=values_pb2.Value(slice=values_pb2.Slice()))


def last_position() -> graph_pb2.Arg:
    """The index `[:, -1, :]`."""
    items = [_slice_all(), graph_pb2.Arg(value=values_pb2.Value(int=-1)), _slice_all()]
    return graph_pb2.Arg(tuple=graph_pb2.ArgList(items=items))


def steering_graph(layer_path: str, vector: np.ndarray) -> graph_pb2.Graph:
    """`model.<layer>.output[:, -1, :] += v`; save the edited layer output (node 7) and lm_head's output (node 9)."""

    def ref(i: int) -> graph_pb2.Arg:
        return graph_pb2.Arg(ref=i)

    hook = graph_pb2.ModuleValue(path=layer_path, point=graph_pb2.OUTPUT, invoke=0)
    const = values_pb2.Tensor(dtype=values_pb2.FLOAT32, shape=[vector.size], data=vector.astype("<f4").tobytes())
    g = graph_pb2.Graph()
    g.nodes.add(id=1, module=hook)
    g.nodes.add(id=2, op=graph_pb2.Op(name="getitem", args=[ref(1), last_position()]))
    g.nodes.add(id=3, constant=values_pb2.Value(tensor=const))
    g.nodes.add(id=4, op=graph_pb2.Op(name="iadd", args=[ref(2), ref(3)]))
    g.nodes.add(id=5, op=graph_pb2.Op(name="setitem", args=[ref(1), last_position(), ref(4)]))
    g.nodes.add(id=6, module=hook)
    g.nodes.add(id=7, save=graph_pb2.Save(value=ref(6)))
    g.nodes.add(id=8, module=graph_pb2.ModuleValue(path="lm_head", point=graph_pb2.OUTPUT, invoke=0))
    g.nodes.add(id=9, save=graph_pb2.Save(value=ref(8)))
    return g


_NUMPY = {values_pb2.FLOAT32: "<f4", values_pb2.FLOAT64: "<f8", values_pb2.INT64: "<i8"}


def trace(address: str, request: nnd_pb2.TraceRequest) -> tuple[dict[int, np.ndarray], set[int]]:
    """Send a Trace; saved tensors by node id (chunks joined) and the ids that came chunked."""
    with grpc.insecure_channel(address) as channel:
        responses = list(nnd_pb2_grpc.NndStub(channel).Trace(request, timeout=120))
    assert responses[-1].WhichOneof("kind") == "done"
    saved: dict[int, values_pb2.Tensor] = {}
    blobs: dict[int, bytearray] = {}
    for r in responses:
        kind = r.WhichOneof("kind")
        if kind == "saved":
            saved[r.saved.node] = r.saved.value.tensor
        elif kind == "chunk":
            assert r.chunk.blob in {t.blob for t in saved.values()}, "a chunk came before its Saved"
            blobs.setdefault(r.chunk.blob, bytearray()).extend(r.chunk.data)
    out = {}
    for node, t in saved.items():
        data = bytes(blobs[t.blob]) if t.blob else t.data
        out[node] = np.frombuffer(data, _NUMPY[t.dtype]).reshape(list(t.shape))
    return out, {node for node, t in saved.items() if t.blob}


def torch_reference(model_path: str, prompt: str, layer: int, vector: np.ndarray | None) -> dict[str, Any]:
    """Plain PyTorch: a forward hook on transformer.h[layer] adds `vector` at the last position."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    ids = torch.tensor([tok(prompt)["input_ids"]])
    seen: dict[str, torch.Tensor] = {}

    def hook(module: Any, args: Any, output: Any) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if vector is not None:
            hidden[:, -1, :] += torch.from_numpy(vector.copy())
        seen["layer"] = hidden.detach().clone()

    handle = model.transformer.h[layer].register_forward_hook(hook)
    try:
        with torch.no_grad():
            logits = model(ids).logits
    finally:
        handle.remove()
    return {"layer": seen["layer"].numpy(), "logits": logits.numpy(), "tokenizer": tok}


def generate_steps(address: str, model: str, prompt: str, new_tokens: int) -> list[tuple[int, int, str]]:
    """(step, id, text) of each StepTokens of a greedy Generate, sent with the Python stubs."""
    request = nnd_pb2.TraceRequest(
        model=model,
        invokes=[nnd_pb2.Invoke(text=prompt)],
        generate=nnd_pb2.GenerateOptions(max_new_tokens=new_tokens, stream_text=True),
    )
    with grpc.insecure_channel(address) as channel:
        responses = list(nnd_pb2_grpc.NndStub(channel).Generate(request, timeout=120))
    return [(r.step.step, r.step.ids[0], r.step.text[0]) for r in responses if r.WhichOneof("kind") == "step"]


def greedy(model_path: str, prompt: str, new_tokens: int) -> list[int]:
    """Plain PyTorch greedy decoding: the argmax of the last position, appended, `new_tokens` times."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = torch.tensor([AutoTokenizer.from_pretrained(model_path)(prompt)["input_ids"]])
    model = AutoModelForCausalLM.from_pretrained(model_path).eval()
    out = []
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


# ---------------------------------------------------------------- the Node client


def _lock_is_installed() -> bool:
    """node_modules already holds exactly what package-lock.json pins (npm's hidden lockfile agrees)."""
    hidden = NODE_DIR / "node_modules" / ".package-lock.json"
    if not hidden.exists():
        return False
    want = json.loads((NODE_DIR / "package-lock.json").read_text())["packages"]
    have = json.loads(hidden.read_text())["packages"]
    pinned = {k: v.get("version") for k, v in want.items() if k}
    return pinned == {k: v.get("version") for k, v in have.items() if k}


@pytest.fixture(scope="session")
def node_client() -> pathlib.Path:
    """examples/node with its dependencies installed by `npm ci` (once; kept between runs)."""
    if not _lock_is_installed():
        res = subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True, text=True, timeout=600
        )
        if res.returncode != 0:
            offline = any(s in res.stderr for s in ("ENOTFOUND", "EAI_AGAIN", "ECONNREFUSED", "ETIMEDOUT"))
            if offline:
                pytest.skip(f"npm ci could not reach the registry:\n{res.stderr[-2000:]}")
            raise AssertionError(f"npm ci failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    return NODE_DIR / "client.js"


def run_node(client: pathlib.Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["node", str(client), *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    ("prompt", "layer", "scale", "seed"),
    [(SHORT_PROMPT, 0, 4.0, 0), (LONG_PROMPT, 1, 2.5, 7)],
    ids=["short-inline", "long-chunked"],
)
def test_node_client_matches_python_and_torch(node_client, daemon, tiny_models, prompt, layer, scale, seed):
    model = tiny_models["gpt2"]
    res = run_node(
        node_client,
        *("--address", daemon.address, "--model", model, "--prompt", prompt),
        *("--layer", str(layer), "--scale", str(scale), "--seed", str(seed), "--new-tokens", str(NEW_TOKENS)),
    )
    assert res.returncode == 0, f"node client failed:\n{res.stdout}\n{res.stderr}"
    out = json.loads(res.stdout)

    # The vector: Node's LCG and the Python one agree bit for bit.
    vector = steering_vector(64, seed, scale)
    assert out["steering"]["width"] == 64
    assert out["steering"]["first"] == [float(x) for x in vector[:4]]
    assert out["steering"]["checksum"] == pytest.approx(float(vector.astype(np.float64).sum()), abs=1e-9)

    # It dispatched (progress streamed, ending "ready"), and scanned the graph's shapes first.
    assert out["dispatch"]["stages"][-1] == "ready" and out["dispatch"]["state"] == "DISPATCHED"

    # The same request, built with the Python stubs and sent over gRPC; `layers` is the daemon's
    # standard alias for transformer.h, which the client uses so that it runs on any architecture.
    path = f"layers.{layer}"
    request = nnd_pb2.TraceRequest(
        model=model, invokes=[nnd_pb2.Invoke(text=prompt)], graph=steering_graph(path, vector)
    )
    saved, chunked = trace(daemon.address, request)
    py_layer, py_logits = saved[7], saved[9]
    last = py_logits[0, -1]
    py_top = np.argsort(-last, kind="stable")[:5]

    node_ids = [t["id"] for t in out["top5"]]
    node_logits = np.array([t["logit"] for t in out["top5"]])
    assert node_ids == py_top.tolist()
    np.testing.assert_allclose(node_logits, last[py_top], atol=1e-5, rtol=0)
    assert out["layer"] == path
    assert out["layer_output"]["shape"] == list(py_layer.shape)
    assert out["layer_output"]["dtype"] == "FLOAT32"
    assert out["layer_output"]["checksum"] == pytest.approx(float(py_layer.astype(np.float64).sum()), abs=1e-5)
    assert out["logits"]["shape"] == list(py_logits.shape)
    for name, value in (("layer_output", py_layer), ("logits", py_logits)):
        assert out["scan"][name] == {"shape": list(value.shape), "dtype": "FLOAT32", "meta": True}
    if prompt == LONG_PROMPT:  # the chunk path was exercised, in both clients
        assert 9 in chunked and out["logits"]["chunked"] is True
    else:
        assert not chunked and out["logits"]["chunked"] is False

    # Plain PyTorch: the daemon's numbers are the model's numbers.
    ref = torch_reference(model, prompt, layer, vector)
    np.testing.assert_allclose(py_layer, ref["layer"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(py_logits, ref["logits"], atol=1e-5, rtol=0)
    ref_last = ref["logits"][0, -1]
    assert node_ids == np.argsort(-ref_last, kind="stable")[:5].tolist()
    np.testing.assert_allclose(node_logits, ref_last[node_ids], atol=1e-5, rtol=0)
    assert out["layer_output"]["checksum"] == pytest.approx(float(ref["layer"].astype(np.float64).sum()), abs=1e-4)

    # ... and the edit mattered: without it the last position's logits differ.
    plain = torch_reference(model, prompt, layer, None)["logits"][0, -1]
    assert np.abs(plain - ref_last).max() > 1e-2

    # Decode RPC texts are the tokenizer's.
    tok = ref["tokenizer"]
    assert [t["text"] for t in out["top5"]] == [tok.decode([i]) for i in node_ids]

    # Generate: the steps it printed as they streamed in are greedy decoding's, as the Python stubs get them.
    steps = generate_steps(daemon.address, model, prompt, NEW_TOKENS)
    assert [(s["step"], s["id"], s["text"]) for s in out["generate"]] == steps
    assert [i for _, i, _ in steps] == greedy(model, prompt, NEW_TOKENS)

    # Scan went to the daemon; Trace and Generate to the model's worker by its route.
    assert out["routes"] == {"direct": 2, "daemon": 1, "rerouted": 0, "fallback": 0}


# A driver that keeps one Router (client.js) across commands read from stdin, so the test can
# change the worker between two of its traces: "trace" (the steering graph of the main test at
# layers.0; answers the sha256 of the logits' bytes, the route it used and the Router's counts),
# "stale" (make the cached route's epoch an old one), "forget" (drop cached routes), "quit".
DRIVER = r"""
const crypto = require('crypto');
const readline = require('readline');
const [clientPath, address, model] = process.argv.slice(1);
const { connect, Router, trace, steeringVector, steeringGraph } = require(clientPath);
const daemon = connect(address);
const router = new Router(daemon, true);
const { graph } = steeringGraph('layers.0', steeringVector(64, 7, 2.5));
const request = { model, invokes: [{ text: process.env.PROMPT }], graph };
const lines = readline.createInterface({ input: process.stdin });
const answer = (obj) => process.stdout.write(JSON.stringify(obj) + '\n');
lines.on('line', async (cmd) => {
  try {
    if (cmd === 'trace') {
      const { saved, blobs } = await trace(router, request, 120);
      const t = saved.get(9).tensor;
      const bytes = Number(t.blob) ? blobs.get(t.blob) : t.data;
      const route = router.routes.get(model);
      answer({
        sha: crypto.createHash('sha256').update(bytes).digest('hex'),
        epoch: route ? String(route.epoch) : null,
        counts: router.counts,
      });
    } else if (cmd === 'stale') {
      const route = router.routes.get(model);
      route.epoch = String(BigInt(route.epoch) - 1n);
      answer({ epoch: route.epoch });
    } else if (cmd === 'forget') {
      router.close();
      answer({});
    } else {
      router.close();
      daemon.close();
      lines.close();
    }
  } catch (err) {
    answer({ error: `${err.code} ${err.details || err.message}` });
  }
});
"""


class _Driver:
    def __init__(self, client: pathlib.Path, address: str, model: str) -> None:
        self.proc = subprocess.Popen(
            ["node", "-e", DRIVER, str(client), address, model],
            cwd=NODE_DIR,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PROMPT": SHORT_PROMPT},
        )

    def ask(self, command: str, timeout: float = 180) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"the node driver did not answer {command!r} within {timeout:.0f} s"
        line = self.proc.stdout.readline()
        assert line, f"the node driver exited:\n{self.proc.stderr.read() if self.proc.stderr else ''}"
        out = json.loads(line)
        assert "error" not in out, out["error"]
        return out

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def test_node_client_follows_routes_across_a_worker_restart(node_client, process_daemon, tmp_path, tiny_models):
    """The Node client's traces go to the worker, not through the daemon; a stale epoch and a restarted
    worker are re-routed around; a worker it cannot reach is reached through the daemon."""
    from nnd.wire.connection import Connection

    # A copy of its own on the shared daemon: its worker gets killed here, and the daemon's log
    # lines about forwarding name it.
    model = str(tmp_path / "routed-gpt2")
    shutil.copytree(tiny_models["gpt2"], model)
    d = process_daemon  # its worker a process of its own: killing it leaves the daemon serving
    conn = Connection(d.address)
    driver = _Driver(node_client, d.address, model)

    def info() -> nnd_pb2.ModelInfo:
        return conn.call("GetModel", nnd_pb2.GetModelRequest(model=model), timeout=60)

    try:
        d.cli("load", model)
        d.cli("dispatch", model)
        # The same request from the Python client (which follows routes too): the bytes to expect.
        request = nnd_pb2.TraceRequest(
            model=model,
            invokes=[nnd_pb2.Invoke(text=SHORT_PROMPT)],
            graph=steering_graph("layers.0", steering_vector(64, 7, 2.5)),
        )
        saved = [r.saved.value.tensor for r in conn.stream("Trace", request, timeout=120) if r.HasField("saved")]
        want = hashlib.sha256([t for t in saved if t.shape[-1] == 320][0].data).hexdigest()
        first = info()
        assert first.worker_requests == 1

        out = driver.ask("trace")
        assert out["sha"] == want and out["epoch"] == str(first.route.epoch)
        assert out["counts"] == {"direct": 1, "daemon": 0, "rerouted": 0, "fallback": 0}
        assert info().worker_requests == 2  # the worker ran it ...
        assert f"of {model} for" not in d.log()  # ... and the daemon forwarded none of it

        # A route whose epoch is not the worker's: refused before anything ran, re-fetched, resent once.
        driver.ask("stale")
        out = driver.ask("trace")
        assert out["sha"] == want and out["epoch"] == str(first.route.epoch)
        assert out["counts"] == {"direct": 2, "daemon": 0, "rerouted": 1, "fallback": 0}
        assert info().worker_requests == 3  # the refused call was never counted, let alone run

        # The worker dies and is dispatched again (a new epoch, a new socket): the cached route is dead.
        os.kill(first.worker_pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while info().state != nnd_pb2.META:
            assert time.monotonic() < deadline, "the killed worker's model did not return to META"
            time.sleep(0.1)
        d.cli("dispatch", model)
        second = info()
        assert second.route.epoch != first.route.epoch
        out = driver.ask("trace")
        assert out["sha"] == want and out["epoch"] == str(second.route.epoch)
        assert out["counts"] == {"direct": 3, "daemon": 0, "rerouted": 2, "fallback": 0}
        assert info().worker_requests == 1  # run once, on the new worker
        assert f"of {model} for" not in d.log()

        # A worker socket the client cannot reach (moved out of its sight; the worker still serves it):
        # the fresh route fails too, so the request goes through the daemon, which forwards it.
        driver.ask("forget")  # an open connection would survive the move
        sock = second.route.address[len("unix://") :]
        os.rename(sock, sock + ".away")
        try:
            out = driver.ask("trace")
        finally:
            os.rename(sock + ".away", sock)
        assert out["sha"] == want and out["epoch"] is None
        assert out["counts"] == {"direct": 3, "daemon": 1, "rerouted": 3, "fallback": 1}
        assert f"forwarding Trace of {model} for" in d.log()
        assert info().worker_requests == 2
    finally:
        driver.close()
        conn.close()
        d.cli("unload", model, check=False)


def test_node_client_grpc_error_is_one_line(node_client, daemon, tiny_models):
    res = run_node(
        node_client,
        *("--address", daemon.address, "--model", tiny_models["gpt2"], "--prompt", "hi", "--layer", "99"),
    )
    assert res.returncode == 1
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("nnd-node: NOT_FOUND:") and "'layers.99'" in lines[0]


def test_node_client_unreachable_daemon(node_client, tmp_path):
    res = run_node(
        node_client,
        *("--address", f"unix://{tmp_path}/none.sock", "--model", "m", "--prompt", "hi", "--layer", "0"),
        *("--timeout", "3"),
    )
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("nnd-node: "), res.stderr
    assert "UNAVAILABLE" in lines[0] or "DEADLINE_EXCEEDED" in lines[0]
