"""A loaded model is keyed by its checkpoint *and* its placement and load
options (issue #27): handles that agree share one worker, a handle that asks
another dtype or attention implementation gets a model of its own, never the
first one's weights with no word. `nnd` commands naming the checkpoint reach
the entry loaded first under that name."""

from __future__ import annotations

import json
from typing import Any

import pytest
import tinymodels
import torch

import nnd
from nnd.v1 import nnd_pb2

PROMPT = "The Eiffel Tower is in"


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tinymodels.build("gpt2", tmp_path_factory.mktemp("keying") / "gpt2"))


def _reference(path: str, **load: Any) -> torch.Tensor:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, **load).eval()
    ids = AutoTokenizer.from_pretrained(path)(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model(ids).logits


def _logits(model: Any) -> torch.Tensor:
    with model.trace(PROMPT):
        logits = model.lm_head.output.save()
    return logits


def test_handles_get_the_model_they_asked_for(daemon: Any, path: str) -> None:
    plain = nnd.TransformersModel(path, address=daemon.address, device="cpu")
    half = nnd.TransformersModel(path, address=daemon.address, device="cpu", torch_dtype=torch.bfloat16)
    same = nnd.TransformersModel(path, address=daemon.address, device="cpu", dtype="bfloat16")
    eager = nnd.TransformersModel(path, address=daemon.address, device="cpu", attn_implementation="eager")
    try:
        assert plain.name == path  # the checkpoint's own name: what `nnd` commands naming it reach
        assert half.name != plain.name and same.name == half.name  # bfloat16 twice: one model
        assert eager.name not in (plain.name, half.name)

        first = _logits(plain)
        assert first.dtype == torch.float32
        torch.testing.assert_close(first, _reference(path), rtol=1e-5, atol=1e-5)
        low = _logits(half)
        assert low.dtype == torch.bfloat16 and half.dtype == torch.bfloat16
        torch.testing.assert_close(low, _reference(path, dtype=torch.bfloat16))
        assert torch.equal(_logits(same), low)
        torch.testing.assert_close(_logits(eager), _reference(path, attn_implementation="eager"), rtol=1e-5, atol=1e-5)
        # The first handle's model is still the float32 one, and still its own worker.
        assert torch.equal(_logits(plain), first)

        listed = json.loads(daemon.cli("ps", "--json").stdout)
        rows = {m["name"]: m for m in listed}
        assert {plain.name, half.name, eager.name} <= set(rows)
        assert rows[half.name]["dtype"] == "bfloat16" and rows[plain.name]["dtype"] == "float32"

        daemon.cli("release", path)  # the checkpoint's name: the first entry, and only it
        assert plain.info.state == nnd_pb2.META
        assert half.dispatched and eager.dispatched
    finally:
        for model in (eager, half, plain):
            model.unload()


def test_a_handle_leaving_a_choice_open_shares_the_loaded_model(daemon: Any, path: str) -> None:
    first = nnd.TransformersModel(path, address=daemon.address, device="cpu", dtype="bfloat16")
    try:
        again = nnd.TransformersModel(path, address=daemon.address)  # no dtype, no device: whatever is loaded
        assert again.name == first.name
        assert _logits(again).dtype == torch.bfloat16
    finally:
        first.unload()


def test_a_restart_loads_an_entry_named_after_its_choices_from_its_checkpoint(tmp_path: Any) -> None:
    from types import SimpleNamespace

    from nnd.v1 import helper_pb2
    from nnd_daemon.control import statefile

    meta = SimpleNamespace(revision="", task="text-generation", ref=helper_pb2.HelperModel(source="/m"))
    entry = SimpleNamespace(
        name="/m@dtype=bfloat16",
        meta=meta,
        trust_remote_code=False,
        keep_alive="",
        placement=nnd_pb2.Placement(dtype="bfloat16"),
        dispatched_placement=None,
        state=nnd_pb2.META,
        upload="",
    )
    path = str(tmp_path / "registry.json")
    statefile.write(path, [entry])
    (record,) = statefile.read(path)
    request = record.load_request()
    assert request.model == "/m" and request.placement.dtype == "bfloat16"  # load() names it again
