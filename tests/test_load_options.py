"""Loading options as nnsight passes them to from_pretrained (issue #18):
`attn_implementation=` and `config=` reach the daemon's META model (scans) and
the dispatched worker, and give what nnsight 0.8.1 gives for the same code
(tests/nnsight_load_options.py, in a process of its own)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import tinymodels
import torch
import warmfork

import nnd

if importlib.util.find_spec("nnsight") is None:
    pytest.skip("nnsight 0.8.1 is not installed", allow_module_level=True)

PROMPT = "The Eiffel Tower is in"


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A tiny GPT-2 to load with options, and one for loads that are refused: a loaded model
    has one set of options, so these are nobody else's."""
    root = tmp_path_factory.mktemp("loadopts")
    return {name: str(tinymodels.build("gpt2", root / name)) for name in ("options", "other")}


@pytest.fixture(scope="module")
def ref(paths: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("loadopts-ref") / "ref.pt"
    script = os.path.join(os.path.dirname(__file__), "support", "nnsight_load_options.py")
    res = warmfork.run([sys.executable, script, paths["options"], str(out)], text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out)


def _one_layer(path: str) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    config.n_layer = 1
    return config


@pytest.fixture(scope="module")
def model(daemon: Any, paths: dict[str, str]) -> Iterator[Any]:
    """Eager attention and a config of one layer (the checkpoint has two)."""
    path = paths["options"]
    m = nnd.LanguageModel(
        path, address=daemon.address, device="cpu", attn_implementation="eager", config=_one_layer(path)
    )
    yield m
    m.unload()


def test_options_reach_the_meta_model_and_the_worker_as_in_nnsight(model: Any, ref: Any) -> None:
    """config= gives nnsight's module tree; eager attention returns its weights (sdpa, the
    default, returns none) in the scan (the META model) and the trace (the worker), whose values
    equal nnsight's."""
    assert [p for p, _ in model.named_modules()] == ref["modules"]
    assert len(model.transformer.h) == 1
    n = len(model.tokenizer(PROMPT)["input_ids"])
    with model.scan(PROMPT):
        shape = nnd.save(model.transformer.h[0].attn.output[1].shape)
        logits_shape = nnd.save(model.lm_head.output.shape)
    assert tuple(shape) == (1, 4, n, n)
    assert tuple(logits_shape) == tuple(ref["logits"].shape)
    with model.trace(PROMPT):
        weights = model.transformer.h[0].attn.output[1].save()
        logits = model.lm_head.output.save()
    torch.testing.assert_close(weights, ref["weights"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref["logits"], rtol=1e-5, atol=1e-5)


def test_a_loaded_model_keeps_its_options(daemon: Any, paths: dict[str, str], model: Any) -> None:
    path = paths["options"]
    again = nnd.LanguageModel(path, address=daemon.address, attn_implementation="eager", config=_one_layer(path))
    assert again._name == model._name  # the same options share the loaded model
    # Other options are another model: its own entry, never the loaded one's (as nnsight gives each handle its own).
    whole = nnd.LanguageModel(path, address=daemon.address, attn_implementation="eager")  # the checkpoint's config
    assert whole.name != model.name and whole.name.startswith(path + "@")
    assert len(whole.transformer.h) == 2 and len(model.transformer.h) == 1
    whole.unload()


def test_options_no_model_can_take_are_refused(daemon: Any, paths: dict[str, str]) -> None:
    from transformers import LlamaConfig

    with pytest.raises(nnd.errors.InvalidRequest, match="'llama' config"):
        nnd.LanguageModel(paths["other"], address=daemon.address, config=LlamaConfig(vocab_size=320))
    with pytest.raises(nnd.errors.InvalidRequest, match="not_an_attention"):
        nnd.LanguageModel(paths["other"], address=daemon.address, attn_implementation="not_an_attention")
    with pytest.raises(TypeError):
        nnd.LanguageModel(paths["other"], address=daemon.address, config=pathlib.Path(paths["other"]))
    model = nnd.LanguageModel(paths["other"], address=daemon.address)  # nothing of the refused loads stayed
    model.unload()


def test_the_registry_file_keeps_the_options(tmp_path: pathlib.Path) -> None:
    """A restarted daemon loads the model again with its options (older files have none)."""
    import json
    from types import SimpleNamespace

    from nnd.v1 import helper_pb2, nnd_pb2
    from nnd_daemon.control import statefile

    options = nnd_pb2.LoadOptions(attn_implementation="eager", config_json='{"model_type": "gpt2", "n_layer": 1}')
    meta = SimpleNamespace(revision="", task="text-generation", ref=helper_pb2.HelperModel(options=options))
    entry = SimpleNamespace(
        name="/m",
        meta=meta,
        trust_remote_code=False,
        keep_alive="",
        placement=nnd_pb2.Placement(),
        dispatched_placement=None,
        state=nnd_pb2.META,
        upload="",
    )
    path = str(tmp_path / "registry.json")
    statefile.write(path, [entry])
    (record,) = statefile.read(path)
    assert record.load_request().options == options
    data = json.loads(pathlib.Path(path).read_text())
    del data["models"][0]["options"]
    pathlib.Path(path).write_text(json.dumps(data))
    (old,) = statefile.read(path)
    assert not old.load_request().HasField("options")


def test_a_hub_kernel_name_is_refused_before_anything_loads() -> None:
    """transformers would download and load code for attn_implementation="org/repo"."""
    from nnd.v1 import nnd_pb2
    from nnd_daemon import errors, loadoptions

    with pytest.raises(errors.InvalidArgument, match="Hub"):
        loadoptions.check(nnd_pb2.LoadOptions(attn_implementation="kernels-community/flash-attn"))
    loadoptions.check(nnd_pb2.LoadOptions(attn_implementation="eager"))
