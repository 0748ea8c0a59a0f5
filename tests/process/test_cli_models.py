"""The CLI's model commands (issue #30), the real `nnd` command against a real daemon: `--name`
(a short name usable everywhere, kept across restarts), dispatch/generate/scan loading a model not
loaded yet, and a placement that fails only with what another handle chose saying so."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import pytest
import torch
import transformers
from daemonproc import Daemon, start_daemon

import nnd


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Daemon]:
    # Workers and the helper as threads of the daemon: what is tested is the CLI, and a dispatch then
    # starts no process.
    d = start_daemon(tmp_path_factory.mktemp("cli-models"), in_process=True)
    yield d
    d.stop()


def _ps(d: Daemon) -> dict[str, dict]:
    return {m["name"]: m for m in json.loads(d.cli("ps", "--json").stdout)}


def test_a_short_name_is_usable_everywhere_and_survives_a_restart(tmp_path, tiny_models):
    d = start_daemon(tmp_path / "first", in_process=True)  # the CLI and the registry are tested, not processes
    try:
        out = d.cli("load", tiny_models["gpt2"], "--name", "tiny")
        assert out.stdout.startswith("tiny: META"), out.stdout
        assert _ps(d)["tiny"]["state"] == "META"
        assert "(transformer): GPT2Model" in d.cli("tree", "tiny").stdout
        # the Python client names it so too, and gets the same model
        model = nnd.LanguageModel("tiny", address=d.address)
        assert model.name == "tiny" and model.config.n_layer == 2
        with model.scan("The Eiffel Tower"):
            shape = model.transformer.h[0].output.shape.save()
        assert tuple(shape)[-1] == model.config.n_embd
        # a handle naming it with another placement is told what the name holds, not given another model
        with pytest.raises(nnd.NndError, match="tiny is .*gpt2 loaded with .*asks for dtype=bfloat16"):
            nnd.LanguageModel("tiny", address=d.address, dtype="bfloat16")
        # loading it under its name again is the same model; the name cannot be taken by another one
        assert d.cli("load", tiny_models["gpt2"], "--name", "tiny").stdout.startswith("tiny: META")
        taken = d.cli("load", tiny_models["llama"], "--name", "tiny", check=False)
        assert taken.returncode == 1 and "'tiny' is taken by" in taken.stderr, taken.stderr
        bad = d.cli("load", tiny_models["llama"], "--name", "org/llama", check=False)
        assert bad.returncode == 1 and "no '/'" in bad.stderr, bad.stderr
    finally:
        d.stop()
    again = start_daemon(tmp_path / "second", state_dir=d.state_dir, in_process=True)
    try:
        assert "tiny" in _ps(again)
        assert "(transformer): GPT2Model" in again.cli("tree", "tiny").stdout
    finally:
        again.stop()


def test_scan_generate_and_dispatch_load_a_model_that_is_not_loaded(served, tiny_models):
    scanned = served.cli("scan", tiny_models["llama"], "The Eiffel Tower")
    assert "modules ran for this input" in scanned.stdout and "is not loaded; loading it" in scanned.stderr
    assert _ps(served)[tiny_models["llama"]]["state"] == "META"

    prompt = "The Eiffel Tower is in"
    generated = served.cli("generate", tiny_models["gpt2"], prompt, "--max-new-tokens", "3")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_models["gpt2"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]).eval()
    ids = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(**ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, ids["input_ids"].shape[1] :]
    assert generated.stdout == prompt + "".join(tok.decode([t]) for t in new) + "\n", generated.stdout
    assert "weights loaded in" in generated.stderr  # its automatic dispatch shows progress too

    dispatched = served.cli("dispatch", tiny_models["bert"], "--device", "cpu")
    assert "DISPATCHED" in dispatched.stdout and "is not loaded; loading it" in dispatched.stderr
    assert _ps(served)[tiny_models["bert"]]["placement"]["device"] == "cpu"


def test_a_placement_that_fails_only_with_another_handles_choice_says_what_is_there(served, tiny_models, tmp_path):
    # A copy of the tiny Llama (a checkpoint of its own here): one handle loads it as nf4.
    path = str(tmp_path / "llama-copy")
    shutil.copytree(tiny_models["llama"], path)
    served.cli("load", path, "--dtype", "nf4")
    asked = served.cli("dispatch", path, "--tp", "2", check=False)
    assert asked.returncode == 1, (asked.stdout, asked.stderr)
    msg = asked.stderr
    assert "was loaded with dtype=nf4" in msg and "asks for tp_size=2" in msg, msg
    assert "use it as it is" in msg and f"nnd release {path}" in msg and "--name" in msg, msg
    model = _ps(served)[path]
    assert model["state"] == "META" and not model.get("worker_pids")
    # Once that handle has dispatched it as nf4 (bitsandbytes runs on CPU), the refusal says so and
    # the worker keeps running.
    nf4 = nnd.LanguageModel(path, address=served.address, dtype="nf4", device="cpu", progress=False)
    assert nf4.name == path
    nf4.dispatch()
    before = _ps(served)[path]
    asked = served.cli("dispatch", path, "--tp", "2", check=False)
    assert asked.returncode == 1, (asked.stdout, asked.stderr)
    assert f"{path} is dispatched with" in asked.stderr and "dtype=nf4" in asked.stderr, asked.stderr
    assert "asks for tp_size=2" in asked.stderr and "use it as it is" in asked.stderr, asked.stderr
    after = _ps(served)[path]
    # The same worker (its route's epoch: these workers are threads of the daemon, the pid is its own).
    assert after["state"] == "DISPATCHED" and after["route"]["epoch"] == before["route"]["epoch"]
    # A Python handle asking for tp_size=2 gets a model of its own; the nf4 one is left as it was.
    tp = nnd.LanguageModel(path, address=served.address, tp_size=2)
    assert tp.name != path
    models = _ps(served)
    assert "tp_size" not in models[path]["placement"] and models[tp.name]["placement"]["tp_size"] == 2, models
