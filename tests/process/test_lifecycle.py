"""Model lifecycle end to end through the CLI: load (META), dispatch (a live
worker), release (worker gone), unload, and the errors users hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest
import tinymodels


def _ps(daemon) -> dict[str, dict]:
    return {m["name"]: m for m in json.loads(daemon.cli("ps", "--json").stdout)}


def test_load_is_meta_and_dispatch_release_cycle(process_daemon, tiny_models, tmp_path):
    d = process_daemon  # its worker a process: the test watches its pid; the model is its own
    path = tinymodels.private_copy(tiny_models["gpt2"], tmp_path)
    out = d.cli("load", path).stdout
    assert "META" in out and "GPT2LMHeadModel" in out and "text-generation" in out
    assert _ps(d)[path]["state"] == "META"
    assert "worker_pids" not in _ps(d)[path]

    res = d.cli("dispatch", path)
    assert "DISPATCHED" in res.stdout
    # progress went to stderr: tensor counts up to the total
    assert "tensors" in res.stderr and "ready" in res.stderr
    model = _ps(d)[path]
    assert model["state"] == "DISPATCHED"
    pid = model["worker_pids"][0]
    worker = psutil.Process(pid)
    # Forked from the daemon's fork server (control/forking.py), showing the command line exec would have.
    assert worker.is_running() and worker.parent().ppid() == d.proc.pid
    assert "nnd_daemon.forkserver" in worker.parent().cmdline()
    assert worker.cmdline()[1:4] == ["-I", "-m", "nnd_daemon.worker"]
    assert worker.name() == os.path.basename(sys.executable)[:15]
    assert int(model["worker_rss_bytes"]) > 0
    weights = {w["device"]: int(w["bytes"]) for w in model["weights"]}
    n_params = int(model["num_parameters"])
    assert weights["cpu"] >= n_params * 4  # float32 weights (plus buffers)

    text = d.cli("ps").stdout
    assert "DISPATCHED" in text and str(pid) in text and "float32" in text

    d.cli("release", path)
    assert _ps(d)[path]["state"] == "META"
    psutil.wait_procs([worker], timeout=10)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

    d.cli("unload", path)
    assert path not in _ps(d)


def test_task_inference_and_tree(daemon, tiny_models):
    out = json.loads(daemon.cli("load", tiny_models["bert"], "--json").stdout)
    assert out["task"] == "fill-mask"
    assert out["architecture"] == "BertForMaskedLM"
    tree = daemon.cli("tree", tiny_models["gpt2"], check=False)
    if tree.returncode:  # not loaded yet in this daemon
        daemon.cli("load", tiny_models["gpt2"])
        tree = daemon.cli("tree", tiny_models["gpt2"])
    lines = tree.stdout.splitlines()
    assert lines[0] == "GPT2LMHeadModel("
    assert any("(0-1): 2 x GPT2Block(" in line for line in lines)
    assert any("(lm_head): Linear(in_features=64, out_features=320, bias=False)" in line for line in lines)


def test_unknown_model_is_one_line_error(daemon):
    # `nnd dispatch` loads a model that is not loaded yet (as the Python client does): it says so, then
    # the load's refusal (transformers' own text, which may wrap), and no traceback.
    res = daemon.cli("dispatch", "no/such-model", check=False)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert lines[0] == "nnd: no/such-model is not loaded; loading it", res.stderr
    assert lines[1].startswith("nnd: cannot load model 'no/such-model'"), res.stderr
    assert "Traceback" not in res.stderr and "no config found" in res.stderr, res.stderr


def test_load_of_missing_path_is_not_found(daemon, tmp_path):
    res = daemon.cli("load", str(tmp_path / "nothing-here"), check=False)
    assert res.returncode == 1
    assert "no such directory" in res.stderr and "Traceback" not in res.stderr


def test_stopped_daemon_is_one_line_error(tmp_path):
    env = {**os.environ, "NND_ADDRESS": f"unix://{tmp_path}/none.sock"}
    res = subprocess.run([sys.executable, "-m", "nnd.cli", "ps"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 1
    assert res.stderr.startswith("nnd: cannot reach the nnd daemon at unix://")
    assert len(res.stderr.strip().splitlines()) == 1


def test_meta_load_reads_no_weights(process_daemon, tmp_path):
    daemon = process_daemon  # the helper a process of its own: the daemon's RSS is the control plane's
    """A ~1B-parameter config loads without its weights: the daemon's RSS barely moves."""
    import tinymodels

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
    }
    path = tinymodels.write_config_only(tmp_path / "llama-1b", config)
    proc = psutil.Process(daemon.proc.pid)
    before = proc.memory_info().rss
    info = json.loads(daemon.cli("load", str(path), "--json").stdout)
    grown = proc.memory_info().rss - before
    assert int(info["num_parameters"]) > 1_000_000_000
    assert info["state"] == "META"
    # float32 weights would be > 4 GB; the meta tree costs a few MB.
    assert grown < 150 * 2**20, f"daemon RSS grew by {grown / 2**20:.0f} MiB"
    daemon.cli("unload", str(path))


def test_dispatch_of_missing_weights_fails_cleanly(daemon, tmp_path):
    import tinymodels

    path = tinymodels.write_config_only(
        tmp_path / "noweights",
        {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "n_embd": 32,
            "n_layer": 1,
            "n_head": 2,
            "vocab_size": 320,
        },
    )
    daemon.cli("load", str(path))
    res = daemon.cli("dispatch", str(path), check=False)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr
    model = _ps(daemon)[str(path)]
    assert model["state"] == "META" and model.get("last_error")
    daemon.cli("unload", str(path))


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_dispatch_other_architectures(daemon, tiny_models, kind):
    path = tiny_models[kind]
    daemon.cli("load", path)
    daemon.cli("dispatch", path)
    assert _ps(daemon)[path]["state"] == "DISPATCHED"
    daemon.cli("release", path)


def test_help_keeps_the_quickstart_one_command_a_line():
    """`nnd --help` ends with the quickstart as lines a user can copy, not squashed into one."""
    env = {**os.environ, "COLUMNS": "200"}  # wide: squashing would fit it all on one line
    res = subprocess.run([sys.executable, "-m", "nnd.cli", "--help"], capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = [line.strip() for line in res.stdout.splitlines()]
    start = lines.index("quickstart:")
    assert lines[start + 1 : start + 6] == [
        "nnd serve &",
        "nnd pull openai-community/gpt2",
        "nnd load openai-community/gpt2 --name gpt2",
        "nnd dispatch gpt2 --device cuda",
        "nnd ps",
    ]
