"""Placement and memory lifecycle: quantized dispatch, budgets, keep-alive,
and a registry that survives restarts. (The LRU cap's choice of victim is bookkeeping,
tested without processes in tests/control/test_registry_lifecycle.py.)"""

from __future__ import annotations

import json
import time

import psutil
import pytest
import tinymodels
from daemonproc import start_daemon


def _ps(daemon) -> dict[str, dict]:
    return {m["name"]: m for m in json.loads(daemon.cli("ps", "--json").stdout)}


def _wait_state(daemon, name: str, state: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        model = _ps(daemon).get(name, {})
        if model.get("state") == state:
            return model
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} is {model.get('state')}, not {state}, after {timeout} s")
        time.sleep(0.2)


@pytest.mark.parametrize("dtype", ["nf4", "int8"])
def test_quantized_dispatch_keeps_module_tree(daemon, tiny_models, dtype):
    path = tiny_models["llama"]
    daemon.cli("load", path)
    before = daemon.cli("tree", path, "--json").stdout
    paths_before = [m.get("path", "") for m in json.loads(before)]
    daemon.cli("dispatch", path, "--dtype", dtype)
    model = _ps(daemon)[path]
    assert model["state"] == "DISPATCHED" and model["dtype"] == dtype
    tree = json.loads(daemon.cli("tree", path, "--json").stdout)
    assert [m.get("path", "") for m in tree] == paths_before
    types = {m.get("path", ""): m["type"] for m in tree}
    # the tree comes from the meta model: paths and class names never change with quantization
    assert types["model.layers.0.mlp.gate_proj"] == "Linear"
    daemon.cli("release", path)


def test_dispatch_over_budget_is_refused_with_figures(tmp_path, tiny_models):
    d = start_daemon(tmp_path, "--max-memory", "cpu=100KiB")
    try:
        path = tiny_models["gpt2"]
        d.cli("load", path)
        res = d.cli("dispatch", path, check=False)
        assert res.returncode == 1
        msg = res.stderr
        assert "needs about" in msg and "budget" in msg and "--max-memory cpu" in msg and "KiB" not in msg.split("needs about")[0]
        assert "0.1 MiB" in msg  # the budget, stated
        assert _ps(d)[path]["state"] == "META"
        # the daemon is healthy afterwards, and nf4 (smaller) is judged on its own estimate
        assert d.proc.poll() is None
        assert "META" in d.cli("ps").stdout
    finally:
        d.stop()


def test_keep_alive_expiry_releases(process_daemon, tiny_models):
    daemon = process_daemon  # its worker a process: the test watches it end
    path = tiny_models["gpt2"]
    daemon.cli("load", path)
    daemon.cli("dispatch", path)
    pid = _ps(daemon)[path]["worker_pids"][0]
    # A dispatched model takes a new keep-alive. (Not asserted DISPATCHED after this call: on a
    # busy box one second may pass before `nnd ps` answers.)
    daemon.cli("dispatch", path, "--keep-alive", "1s")
    _wait_state(daemon, path, "META", timeout=60)
    psutil.wait_procs([psutil.Process(pid)] if psutil.pid_exists(pid) else [], timeout=10)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    daemon.cli("dispatch", path, "--keep-alive", "-1")  # back to forever for later tests
    assert float(_ps(daemon)[path].get("expires_at", 0)) == 0
    daemon.cli("release", path)


def test_registry_survives_restart(tmp_path, tiny_models):
    state = str(tmp_path / "state")
    # The registry file is what survives: workers as threads of the daemon (a dispatch starts no process).
    d = start_daemon(tmp_path / "one", state_dir=state, in_process=True)
    gpt2, llama = tiny_models["gpt2"], tiny_models["llama"]
    try:
        d.cli("load", gpt2)
        d.cli("load", llama)
        d.cli("dispatch", llama, "--dtype", "bfloat16")
    finally:
        assert d.stop() == 0
    d2 = start_daemon(tmp_path / "two", state_dir=state, in_process=True)
    try:
        assert _ps(d2)[gpt2]["state"] == "META"
        model = _wait_state(d2, llama, "DISPATCHED")
        assert model["dtype"] == "bfloat16"
        assert model["dispatched_placement"]["dtype"] == "bfloat16"
    finally:
        d2.stop()


def test_several_models_each_in_own_worker(process_daemon, tiny_models):
    daemon = process_daemon  # workers as processes: their pids are what differs
    pids = set()
    for kind in ("gpt2", "bert"):
        daemon.cli("load", tiny_models[kind])
        daemon.cli("dispatch", tiny_models[kind])
        pids.add(_ps(daemon)[tiny_models[kind]]["worker_pids"][0])
    assert len(pids) == 2
    for kind in ("gpt2", "bert"):
        daemon.cli("release", tiny_models[kind])


def test_quantized_traces_stay_close_to_full_precision(daemon, tiny_models):
    """nf4, fp4 and int8 dispatches run the same graph (paths never change) and
    give logits close to the float32 model's."""
    import torch

    import nnd

    path = tiny_models["llama"]
    model = nnd.TransformersModel(path, address=daemon.address, device="cpu")

    def trace() -> tuple[torch.Tensor, torch.Tensor]:
        with model.trace("The Eiffel Tower is in the city of"):
            gate = model.model.layers[0].mlp.gate_proj.output.save()
            logits = model.lm_head.output.save()
        return gate, logits

    model.dispatch()
    gate32, logits32 = trace()
    scale = logits32.abs().max()
    for dtype, tolerance in (("nf4", 0.3), ("fp4", 0.3), ("int8", 0.05)):
        daemon.cli("dispatch", path, "--dtype", dtype)
        assert _ps(daemon)[path]["dtype"] == dtype
        gate, logits = trace()
        assert gate.shape == gate32.shape and logits.shape == logits32.shape
        err = (logits - logits32).abs().max() / scale
        print(f"{dtype}: max relative logit error {err:.4f}")
        assert 0 < err < tolerance, f"{dtype}: relative error {err:.3f}"
        # the prediction mostly survives quantization
        agree = (logits.argmax(-1) == logits32.argmax(-1)).float().mean()
        assert agree >= 0.5, f"{dtype}: argmax agreement {agree:.2f}"
    model.release()


def test_a_handle_dispatches_with_the_placement_it_asked_for(daemon, tiny_models, tmp_path):
    """A second handle asking for another dtype gets that dtype (a model of its own, named after it), not the
    first handle's silently; the first keeps its own."""
    import nnd

    path = tinymodels.private_copy(tiny_models["gpt2"], tmp_path)  # no other test's handle has loaded it
    first = nnd.TransformersModel(path, address=daemon.address, device="cpu", dispatch=True)
    assert _ps(daemon)[path]["dtype"] == "float32"
    second = nnd.TransformersModel(path, address=daemon.address, device="cpu", dtype="bfloat16", dispatch=True)
    assert second.name != path and _ps(daemon)[second.name]["dtype"] == "bfloat16"
    assert _ps(daemon)[path]["dtype"] == "float32"
    with second.trace("Hello"):
        h = second.transformer.h[0].output.save()
    assert str(h.dtype).endswith("bfloat16")
    first.release()
    second.release()
