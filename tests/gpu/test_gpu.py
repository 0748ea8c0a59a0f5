"""The lab box's path on a real GPU: placement, constants meeting GPU activations,
bitsandbytes' CUDA kernels, generation, gradients, patching, scan, results from GPU
memory, memory returned on release and on worker death, tensor-parallel refusals.

Every number is compared with the same weights run in this process on the same
device (plain transformers, with hooks where nnd intervenes).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import pytest
import torch
from daemonproc import start_daemon
from torch.testing import assert_close

import nnd

pytestmark = pytest.mark.cuda

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "The Colosseum is in the city of"


def _ps(d: Any) -> dict[str, dict]:
    return {m["name"]: m for m in json.loads(d.cli("ps", "--json").stdout)}


def _wait(predicate: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _reference(path: str, device: str, **kwargs: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, device_map=device, **kwargs).eval()


def _inputs(model: Any, device: str, text: str = PROMPT) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in model.tokenizer(text, return_tensors="pt").items()}


@pytest.fixture(scope="module")
def gpt2(daemon, tiny_models, device):
    model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device=device, dispatch=True)
    yield model
    model.release()


@pytest.fixture(scope="module")
def reference(tiny_models, device):
    return _reference(tiny_models["gpt2"], device)


# ------------------------------------------------------------------ placement


def test_dispatch_puts_the_weights_on_the_device(daemon, gpt2, reference, device):
    model = _ps(daemon)[gpt2.name]
    assert model["state"] == "DISPATCHED"
    on = {w["device"] for w in model.get("weights", [])}
    assert on and all(d.startswith(device) for d in on), on  # `nnd ps` shows the GPU's share
    with gpt2.trace(PROMPT):
        logits = gpt2.lm_head.output.save()
    with torch.no_grad():
        expected = reference(**_inputs(gpt2, device)).logits
    assert_close(torch.as_tensor(logits).to(device), expected, atol=1e-4, rtol=1e-4)


def test_a_gpu_worker_forks_from_the_fork_server(daemon, gpt2):
    """The fork server imports torch without loading the CUDA driver (it asks NVML), so a CUDA worker
    forks from it and skips the imports; were the driver loaded there, it would say so and exec."""
    import psutil

    (pid,) = _ps(daemon)[gpt2.name]["worker_pids"]
    parent = psutil.Process(pid).parent()
    assert parent is not None and "nnd_daemon.forkserver" in " ".join(parent.cmdline()), daemon.log()[-2000:]


def test_a_cpu_constant_meets_a_gpu_activation(gpt2, reference, device):
    """The reference page's device-mismatch case: a vector made on the CPU, added to a GPU activation."""
    steer = torch.randn(64, generator=torch.Generator().manual_seed(1))  # on the CPU, as a notebook makes it
    with gpt2.trace(PROMPT):
        gpt2.transformer.h[0].output[:, -1, :] += steer
        logits = gpt2.lm_head.output.save()

    def hook(mod: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        out[:, -1, :] += steer.to(out.device)
        return out

    handle = reference.transformer.h[0].register_forward_hook(hook)
    try:
        with torch.no_grad():
            expected = reference(**_inputs(gpt2, device)).logits
    finally:
        handle.remove()
    assert_close(torch.as_tensor(logits).to(device), expected, atol=1e-4, rtol=1e-4)


def test_device_map_auto_splits_by_max_memory(daemon, tiny_models, device, on_gpu):
    path = tiny_models["llama"]
    model = nnd.TransformersModel(
        path, address=daemon.address, device_map="auto", max_memory={0: "300KiB", "cpu": "2GiB"}, dispatch=True
    )
    try:
        devices = {w["device"] for w in _ps(daemon)[model.name]["weights"]}
        assert any(d.startswith("cuda") for d in devices) and "cpu" in devices, devices
        with model.trace(PROMPT):
            logits = model.lm_head.output.save()
        ref = _reference(path, "cpu")
        with torch.no_grad():
            expected = ref(**_inputs(model, "cpu")).logits
        assert_close(torch.as_tensor(logits).cpu(), expected, atol=1e-4, rtol=1e-4)
    finally:
        model.release()


def test_a_dispatch_over_the_gpu_budget_is_refused_with_both_figures(tmp_path, tiny_models, on_gpu):
    d = start_daemon(tmp_path, "--max-memory", "0=100KiB")
    try:
        d.cli("load", tiny_models["gpt2"])
        res = d.cli("dispatch", tiny_models["gpt2"], "--device", "cuda", check=False)
        assert res.returncode == 1
        assert "needs about" in res.stderr and "budget" in res.stderr and "cuda:0" in res.stderr, res.stderr
        assert _ps(d)[tiny_models["gpt2"]]["state"] == "META"
    finally:
        d.stop()


@pytest.mark.parametrize("dtype", ["nf4", "fp4", "int8"])
def test_bitsandbytes_kernels_match_in_process(daemon, tiny_models, device, dtype):
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    path = tiny_models["llama"]
    compute = torch.bfloat16 if device == "cuda" else torch.float32  # what the worker picks (worker/loader.py)
    if dtype == "int8":
        config = BitsAndBytesConfig(load_in_8bit=True)
    else:
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=dtype, bnb_4bit_compute_dtype=compute)
    model = nnd.TransformersModel(path, address=daemon.address, device=device, dtype=dtype, dispatch=True)
    try:
        with model.trace(PROMPT):
            hidden = model.model.layers[0].output.save()
            logits = model.lm_head.output.save()
        ref = _reference(path, device, quantization_config=config, dtype=compute)
        seen: list[torch.Tensor] = []
        handle = ref.model.layers[0].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
        try:
            with torch.no_grad():
                expected = ref(**_inputs(model, device)).logits
        finally:
            handle.remove()
        assert_close(torch.as_tensor(hidden).to(device), seen[0], atol=1e-3, rtol=1e-3)
        assert_close(torch.as_tensor(logits).to(device), expected, atol=1e-3, rtol=1e-3)
    finally:
        model.release()


# ------------------------------------------------------------------ beyond one forward


def test_generate_with_a_per_step_edit(gpt2, reference, device):
    vector = 30 * torch.linspace(-1, 1, 64)
    with gpt2.generate(PROMPT, max_new_tokens=6) as tracer:
        for _ in tracer.iter[1:2]:
            gpt2.transformer.h[0].output[:, -1, :] += vector
        ids = tracer.result.save()
    calls = {"n": 0}

    def hook(mod: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        if calls["n"] == 1:
            out[:, -1, :] += vector.to(out.device)
        calls["n"] += 1
        return out

    handle = reference.transformer.h[0].register_forward_hook(hook)
    try:
        enc = _inputs(gpt2, device)
        expected = reference.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=gpt2.tokenizer.pad_token_id)
    finally:
        handle.remove()
    assert torch.as_tensor(ids).cpu().tolist() == expected.cpu().tolist()


def test_gradients_of_a_gpu_activation(gpt2, reference, device):
    with gpt2.trace(PROMPT):
        h = gpt2.transformer.h[0].output
        logits = gpt2.lm_head.output
        metric = logits[0, -1, 5] - logits[0, -1, 7]
        with metric.backward():
            grad = h.grad.save()
    kept: list[torch.Tensor] = []

    def keep(mod: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        out.retain_grad()
        kept.append(out)
        return out

    handle = reference.transformer.h[0].register_forward_hook(keep)
    try:
        out = reference(**_inputs(gpt2, device)).logits
        (out[0, -1, 5] - out[0, -1, 7]).backward()
    finally:
        handle.remove()
        reference.zero_grad(set_to_none=True)
    assert_close(torch.as_tensor(grad).to(device), kept[0].grad, atol=1e-4, rtol=1e-4)


def test_activation_patching_across_invokes(gpt2, reference, device):
    with gpt2.trace() as tracer:
        with tracer.invoke(PROMPT):
            clean = gpt2.transformer.h[1].output[:, -1, :]
        with tracer.invoke(OTHER):
            gpt2.transformer.h[1].output[:, -1, :] = clean
            patched = gpt2.lm_head.output[:, -1, :].save()
    store: dict[str, torch.Tensor] = {}

    def read(mod: Any, args: Any, out: torch.Tensor) -> None:
        store["clean"] = out[:, -1, :].detach().clone()

    def write(mod: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        out[:, -1, :] = store["clean"]
        return out

    with torch.no_grad():
        handle = reference.transformer.h[1].register_forward_hook(read)
        reference(**_inputs(gpt2, device, PROMPT))
        handle.remove()
        handle = reference.transformer.h[1].register_forward_hook(write)
        try:
            expected = reference(**_inputs(gpt2, device, OTHER)).logits[:, -1, :]
        finally:
            handle.remove()
    assert_close(torch.as_tensor(patched).to(device), expected, atol=1e-4, rtol=1e-4)


def test_scan_of_a_model_that_lives_on_the_gpu(gpt2):
    with gpt2.scan(PROMPT):
        shape = nnd.save(gpt2.transformer.h[0].output.shape)
    n = len(gpt2.tokenizer(PROMPT)["input_ids"])
    assert tuple(shape) == (1, n, 64)


@pytest.mark.parametrize("shm", [False, True])
def test_results_from_gpu_memory(gpt2, reference, device, shm):
    with gpt2.trace(PROMPT, shm=shm):
        hidden = gpt2.transformer.h[1].output.save()
    seen: list[torch.Tensor] = []
    handle = reference.transformer.h[1].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    try:
        with torch.no_grad():
            reference(**_inputs(gpt2, device))
    finally:
        handle.remove()
    assert_close(torch.as_tensor(hidden).to(device), seen[0], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ memory comes back


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("how", ["release", "kill"])
def test_every_byte_of_gpu_memory_comes_back(daemon, tiny_models, on_gpu, how):
    from nnd_daemon.control import gpus

    path = tiny_models["llama"]
    torch.cuda.init()
    before = _free()
    model = nnd.TransformersModel(path, address=daemon.address, device="cuda", dispatch=True)
    with model.trace(PROMPT):
        model.lm_head.output.save()
    pids = _ps(daemon)[model.name]["worker_pids"]
    held = {pid: gpus.process_memory().get(pid, 0) for pid in pids}
    assert any(held.values()), f"the worker holds no GPU memory per nvidia-smi: {held}"
    if how == "release":
        model.release()
    else:
        os.kill(pids[0], signal.SIGKILL)
        _wait(lambda: _ps(daemon)[model.name]["state"] == "META", "the model back to META")
    _wait(lambda: not any(pid in gpus.process_memory() for pid in pids), "the worker's GPU memory to go")
    _wait(lambda: _free() >= before - 16 * 2**20, f"free GPU memory back to {before} (now {_free()})")


# ------------------------------------------------------------------ tensor parallel and visibility


def test_tensor_parallel_beyond_the_gpus_is_refused(daemon, tiny_models, on_gpu):
    n = torch.cuda.device_count() + 1
    daemon.cli("load", tiny_models["llama"])
    res = daemon.cli("dispatch", tiny_models["llama"], "--tp", str(n), "--device", "cuda", check=False)
    assert res.returncode == 1 and f"needs {n} GPUs" in res.stderr, res.stderr
