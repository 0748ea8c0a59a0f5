"""The envoy tree: navigation, printing, load options."""

from __future__ import annotations

import json

import pytest
import torch
from fakedaemon import FakeNnd, module_infos

import nnd
from nnd.models import _envoy, _placement
from nnd.v1 import nnd_pb2


def test_navigation(model):
    h = model.transformer.h
    assert len(h) == 3 and h[-1].path == "transformer.h.2" and h[0].mlp.path == "transformer.h.0.mlp"
    assert [m.path for m in h[1:]] == ["transformer.h.1", "transformer.h.2"]
    assert [layer.path for layer in h] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    with pytest.raises(AttributeError, match="children are: wte, wpe, drop, h, ln_f"):
        model.transformer.layers  # noqa: B018
    with pytest.raises(IndexError, match="3 modules"):
        h[3]


def test_language_model_alias():
    assert nnd.LanguageModel is nnd.TransformersModel


def _root(torch_model):
    root = _envoy.Envoy(None, "", "Module")
    _envoy.build_tree(None, module_infos(torch_model), root)
    return root


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_printing_matches_torch(kind):
    import transformers as tf

    configs = {
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=4, n_embd=16, n_head=2, vocab_size=64)),
        "llama": lambda: tf.LlamaForCausalLM(
            tf.LlamaConfig(
                num_hidden_layers=3, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=64
            )
        ),
        "bert": lambda: tf.BertForMaskedLM(
            tf.BertConfig(
                num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=64
            )
        ),
    }
    with torch.device("meta"):
        torch_model = configs[kind]()
    assert repr(_root(torch_model)) == repr(torch_model)


def test_printing_collapses_runs_only():
    net = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 2)])
    text = repr(_root(net))
    assert text == repr(net) and "(0-1): 2 x Linear" in text


def test_placement_and_load_request(fake):
    service, address = fake
    nnd.TransformersModel(
        "tiny", address=address, device_map="auto", dtype=torch.bfloat16, tp_size=2, keep_alive=300,
        max_memory={0: "20GiB"}, task="text-generation",
    )  # fmt: skip
    req = service.loads[-1]
    assert req.placement == nnd_pb2.Placement(device_map="auto", dtype="bfloat16", tp_size=2, max_memory={"0": "20GiB"})
    assert req.keep_alive == "300s" and req.task == "text-generation"
    assert _placement.placement(device=0).device == "0"
    assert _placement.keep_alive_string(-1) == "-1"
    assert not req.HasField("options")  # a plain load sends no load options
    # nnsight's load options travel as data: a config as its JSON, never pickled.
    from transformers import GPT2Config

    nnd.TransformersModel("tiny", address=address, attn_implementation="eager", config=GPT2Config(n_layer=1))
    options = service.loads[-1].options
    assert options.attn_implementation == "eager" and json.loads(options.config_json)["n_layer"] == 1
    with pytest.raises(TypeError, match="low_cpu_mem_usage"):
        nnd.TransformersModel("tiny", address=address, low_cpu_mem_usage=True)


def test_dispatch_release_dispatched(model, fake):
    assert not model.dispatched
    seen = []
    model.dispatch(progress=seen.append)
    assert [p.stage for p in seen] == ["loading", "ready"] and model.dispatched
    model.release()
    assert not model.dispatched


def test_remote_tokenizer(fake):
    from nnd.models._tokenizer import RemoteTokenizer
    from nnd.wire.connection import connect

    tok = RemoteTokenizer(connect(fake[1]), "tiny")
    assert tok.encode("AB") == [ord("A") % 64, ord("B") % 64]
    assert tok.decode([0, 1]) == "AB" and tok.decode(torch.tensor([2])) == "C"
    assert tok(["A", "B"])["input_ids"] == [[1], [2]]


def test_fake_service_is_a_servicer():
    assert issubclass(FakeNnd, nnd.v1.nnd_pb2_grpc.NndServicer)
