"""Bring your own model, against a real daemon: an edited in-memory transformers
model, torch modules exported with torch.export (a Sequential and a module with
nested children), the client-side refusal of a module torch cannot export,
deduplicated uploads, the size limit, and a restart with uploads disabled that
still restores what was uploaded."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch
from daemonproc import Daemon, start_daemon

import nnd

PROMPT = "The Eiffel Tower is in the city of"


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """What the tests leave for the restart test at the end (its daemon, names, expected values)."""
    return {"root": tmp_path_factory.mktemp("upload")}


@pytest.fixture(scope="module")
def daemon(state: dict) -> Daemon:
    d = start_daemon(state["root"] / "first", "--max-upload-bytes", "2MiB", in_process=True)
    state["daemon"] = d
    yield d
    d.stop()


def _uploads(d: Daemon) -> list[str]:
    folder = pathlib.Path(d.state_dir) / "uploads"
    return sorted(os.listdir(folder)) if folder.exists() else []


def _ps(d: Daemon) -> dict[str, dict]:
    return {m["name"]: m for m in json.loads(d.cli("ps", "--json").stdout)}


# ---------------------------------------------------------------- torch modules


def test_seed_sequential_trace_scan_and_edits(daemon, state):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.Linear(10, 2))
    wrapped = nnd.NNsight(net, torch.rand(1, 5), address=daemon.address, name="seq", device="cpu")
    assert wrapped.name == "seq" and wrapped.upload_info.sent_bytes == wrapped.upload_info.total_bytes > 0
    assert "Linear(in_features=5, out_features=10, bias=True)" in repr(wrapped)

    x = torch.rand(1, 5)
    with wrapped.trace(x):
        out = wrapped[0].output.save()
    assert out.shape == (1, 10) and torch.allclose(out, net[0](x), atol=1e-6)

    with wrapped.scan(torch.rand(3, 5)):
        shape = wrapped[1].output.shape.save()
    assert tuple(shape) == (3, 2)

    # Two invokes are rows of one batch; an edit of one leaves the other alone.
    a, b = torch.rand(2, 5), torch.rand(3, 5)
    with wrapped.trace() as tracer:
        with tracer.invoke(a):
            clean = wrapped.output.save()
        with tracer.invoke(b):
            wrapped[0].output[:] = 0
            zeroed = wrapped.output.save()
    assert torch.allclose(clean, net(a), atol=1e-6)
    assert torch.allclose(zeroed, net[1](torch.zeros(3, 10)), atol=1e-6)
    assert _ps(daemon)["seq"]["state"] == "DISPATCHED"
    assert "seq" in daemon.cli("ps").stdout
    wrapped.release()
    state["seq"] = (net, x, wrapped.upload_info.sha256)


class MLP(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(width, 2 * width)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList([Block(8), Block(8)])
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _local(net: Net, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The reads and edits of the trace below, done with forward hooks on the local module."""
    got: dict[str, torch.Tensor] = {}

    def zero(module, args, output):
        return torch.zeros_like(output)

    def plus_one(module, args, output):
        got["fc2_in"] = args[0].clone()
        return output + 1

    def keep(module, args, output):
        got["block1"] = output.clone()

    def skip(module, args, output):
        return args[0]

    handles = [
        net.blocks[0].mlp.register_forward_hook(zero),
        net.blocks[0].norm.register_forward_hook(skip),
        net.blocks[1].mlp.fc2.register_forward_hook(plus_one),
        net.blocks[1].register_forward_hook(keep),
    ]
    try:
        with torch.no_grad():
            got["out"] = net(x)
            got["lens"] = net.head(got["block1"])
    finally:
        for h in handles:
            h.remove()
    return got


def test_nested_module_reads_edits_gradients_and_scan(daemon):
    torch.manual_seed(1)
    net = Net().eval()
    wrapped = nnd.NNsight(net, torch.rand(1, 6, 4), address=daemon.address, name="net", device="cpu")
    assert [p for p, _ in wrapped.named_modules()] == [p for p, _ in net.named_modules()]
    assert wrapped.blocks[0].mlp._type == "MLP" and "in_features=8" in wrapped.blocks[1].mlp.fc1._extra

    x = torch.rand(2, 7, 4)  # another batch and sequence length than the example
    with wrapped.trace(x):
        wrapped.blocks[0].mlp.output[:] = 0
        wrapped.blocks[0].norm.skip(wrapped.blocks[0].norm.input)  # not run: its input goes on
        wrapped.blocks[1].mlp.fc2.output += 1
        fc2_in = wrapped.blocks[1].mlp.fc2.input.save()
        block1 = wrapped.blocks[1].output.save()
        lens = wrapped.head(block1).save()  # a module called out of place
        out = wrapped.output.save()
    local = _local(net, x)
    assert torch.allclose(out, local["out"], atol=1e-5)
    assert torch.allclose(fc2_in, local["fc2_in"], atol=1e-5)
    assert torch.allclose(lens, local["lens"], atol=1e-5) and torch.allclose(lens, out, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(out, net(x), atol=1e-3)  # the edits did something

    # Gradients flow through the exported graph as through the module.
    with wrapped.trace(x):
        h0 = wrapped.blocks[0].output
        with wrapped.output.sum().backward():
            grad = h0.grad.save()
    kept: dict[str, torch.Tensor] = {}

    def retain(module, args, output):
        output.retain_grad()
        kept["h0"] = output

    handle = net.blocks[0].register_forward_hook(retain)
    try:
        net(x.clone().requires_grad_(True)).sum().backward()
    finally:
        handle.remove()
        net.zero_grad(set_to_none=True)
    assert torch.allclose(grad, kept["h0"].grad, atol=1e-5)

    with wrapped.scan(torch.rand(5, 3, 4)):
        hidden = wrapped.blocks[1].mlp.fc1.output.save()
        result = wrapped.output.save()
    assert hidden.shape == (5, 3, 16) and hidden.device.type == "meta" and result.shape == (5, 3, 3)
    wrapped.release()


class DataDependent(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # Python control flow on a value: torch.export cannot capture it
            return x * 2
        return x - 1


def test_unexportable_module_is_refused_in_the_client(daemon):
    before_models, before_files = set(_ps(daemon)), _uploads(daemon)
    with pytest.raises(nnd.ExportError) as info:
        nnd.NNsight(DataDependent(), torch.rand(2, 3), address=daemon.address, name="bad")
    assert isinstance(info.value, RuntimeError) and "data-dependent" in str(info.value)
    assert "nothing was sent" in str(info.value)
    assert set(_ps(daemon)) == before_models and _uploads(daemon) == before_files


def test_upload_over_the_limit_is_refused_before_sending(daemon):
    big = torch.nn.Linear(1024, 1024)  # 4 MiB of weights, over the daemon's 2 MiB
    with pytest.raises(nnd.LimitExceeded, match="--max-upload-bytes"):
        nnd.NNsight(big, torch.rand(2, 1024), address=daemon.address, name="big")
    assert not any(name.startswith(".partial") for name in _uploads(daemon))


# ---------------------------------------------------------------- transformers models


def test_edited_transformers_model_gives_the_edited_logits(daemon, tiny_models, state):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_models["gpt2"]
    original = AutoModelForCausalLM.from_pretrained(path).eval()
    edited = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        edited.transformer.h[0].mlp.c_proj.bias += 0.5
        edited.lm_head.weight[7] = 1.0  # tied: the embedding row changes with it
    ids = torch.tensor([AutoTokenizer.from_pretrained(path)(PROMPT)["input_ids"]])
    with torch.no_grad():
        want, before = edited(ids).logits, original(ids).logits
    assert not torch.allclose(want, before, atol=1e-3)

    model = nnd.TransformersModel(edited, address=daemon.address, name="gpt2-edited", device="cpu")
    assert model.task == "text-generation" and model.info.architecture == "GPT2LMHeadModel"
    assert model.dispatched  # an in-memory model is dispatched at construction, as nnsight reports it
    with model.trace(PROMPT):  # text: the tokenizer beside the checkpoint went with it
        logits = model.lm_head.output.save()
    assert torch.allclose(logits, want, atol=1e-4)
    assert not torch.allclose(logits, before, atol=1e-3)
    stored = pathlib.Path(daemon.state_dir) / "uploads" / model.upload_info.sha256
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(stored))
    model.release()
    state["gpt2"] = (model.upload_info.sha256, want)

    # The same weights again, under another name: nothing is sent, nothing stored twice.
    files = _uploads(daemon)
    again = nnd.TransformersModel(edited, address=daemon.address, name="gpt2-edited-again", dispatch=False)
    assert again.upload_info.existed and again.upload_info.sent_bytes == 0
    assert again.upload_info.sha256 == model.upload_info.sha256
    assert _uploads(daemon) == files and files.count(model.upload_info.sha256) == 1
    # Unloading one name keeps the files the other still uses.
    again.unload()
    assert model.upload_info.sha256 in _uploads(daemon)


# ---------------------------------------------------------------- restart


def test_restart_restores_uploads_and_no_uploads_refuses_new_ones(daemon, state):
    assert {"seq", "net", "gpt2-edited"} <= set(_ps(daemon))
    daemon.stop()
    d = start_daemon(state["root"] / "second", "--no-uploads", state_dir=daemon.state_dir, in_process=True)
    try:
        models = _ps(d)
        assert {"seq", "net", "gpt2-edited"} <= set(models) and models["gpt2-edited"]["state"] == "META"

        sha, want = state["gpt2"]
        restored = nnd.TransformersModel("gpt2-edited", address=d.address)
        with restored.trace(PROMPT):  # the worker loads the weights from the state directory
            logits = restored.lm_head.output.save()
        assert torch.allclose(logits, want, atol=1e-4)

        net, x, seq_sha = state["seq"]
        seq = nnd.NNsight("seq", address=d.address)  # an uploaded module, opened by name
        with seq.scan(x):
            shape = seq[0].output.shape.save()
        assert tuple(shape) == (1, 10)
        seq.unload()  # its last user: the files go
        assert seq_sha not in _uploads(d) and sha in _uploads(d)
        with pytest.raises(nnd.Unauthenticated, match="--no-uploads"):
            nnd.NNsight(torch.nn.Linear(3, 3), torch.rand(2, 3), address=d.address)
    finally:
        d.stop()
