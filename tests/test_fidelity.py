"""nnsight 0.8.1 fidelity (issue #18): the same code under nnsight (in a
subprocess, tests/nnsight_fidelity.py) and under nnd, on the same tiny GPT-2;
values must agree numerically, and where nnsight raises, nnd raises."""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

import pytest
import torch
import warmfork

import nnd

if importlib.util.find_spec("nnsight") is None:
    pytest.skip("nnsight 0.8.1 is not installed", allow_module_level=True)

A = "Hello world"
B = "The Eiffel Tower is in"
ATOL = 1e-5


@pytest.fixture(scope="module")
def ref(tiny_models, tmp_path_factory) -> dict[str, Any]:
    """Every case of nnsight_fidelity.py, run once under nnsight."""
    out = tmp_path_factory.mktemp("fidelity") / "ref.pt"
    script = os.path.join(os.path.dirname(__file__), "support", "nnsight_fidelity.py")
    res = warmfork.run([sys.executable, script, tiny_models["gpt2"], str(out)], text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def model(daemon, tiny_models):
    m = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu", dispatch=True)
    yield m
    m.release()


def _close(a: Any, b: Any) -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-5)


def _expected(ref: dict[str, Any], name: str) -> dict[str, Any]:
    value = ref[name]
    assert "error" not in value, f"nnsight failed {name}: {value}"
    return value


# ------------------------------------------------------------------ bugs


def test_per_invoke_result_and_cache_are_narrowed(model, ref):
    want = _expected(ref, "per_invoke_values")
    with model.trace() as tracer:
        with tracer.invoke(A):
            cache = tracer.cache(modules=[model.transformer.h[0]])
            r1 = tracer.result.logits.save()
        with tracer.invoke(B):
            r2 = tracer.result.logits.save()
    _close(r1, want["r1"])
    _close(r2, want["r2"])
    _close(cache["model.transformer.h.0"].output, want["cache"])


def test_per_invoke_generator_output_is_narrowed(model, ref):
    want = _expected(ref, "per_invoke_generator_output")
    with model.generate(max_new_tokens=3) as tracer:
        with tracer.invoke(A):
            o1 = model.generator.output.save()
        with tracer.invoke(B):
            o2 = model.generator.output.save()
    assert torch.equal(o1, want["o1"])
    assert torch.equal(o2, want["o2"])


def test_skip_in_every_invoke(model, ref):
    want = _expected(ref, "skip_in_invokes")
    with model.trace() as tracer:
        with tracer.invoke(A):
            model.transformer.h[0].skip(model.transformer.h[0].input)
            y1 = model.lm_head.output.save()
        with tracer.invoke(B):
            model.transformer.h[0].skip(model.transformer.h[0].input)
            y2 = model.lm_head.output.save()
    _close(y1, want["y1"])
    _close(y2, want["y2"])


def test_skipped_module_children_do_not_run(model, ref):
    assert "error" in ref["skip_child_read"]  # nnsight raises: the child never runs
    with pytest.raises(nnd.InvalidRequest, match="never ran"):
        with model.trace() as tracer:
            with tracer.invoke(A):
                model.transformer.h[0].skip(model.transformer.h[0].input)
                model.lm_head.output.save()
                model.transformer.h[0].mlp.output.save()


def test_two_backward_passes_in_one_trace(model, ref):
    want = _expected(ref, "two_backwards")
    with model.trace(A):
        h = model.transformer.h[0].output
        out = model.lm_head.output
        with out.sum().backward(retain_graph=True):
            g1 = h.grad.save()
        with (out**2).sum().backward():
            g2 = h.grad.save()
    _close(g1, want["g1"])
    _close(g2, want["g2"])
    assert not torch.allclose(g1, g2)


def test_inputs_written_back_with_none_kwargs(model, ref):
    want = _expected(ref, "inputs_with_none")
    with model.trace(A):
        args, kwargs = model.transformer.h[0].inputs
        model.transformer.h[0].inputs = (args, kwargs)
        y = model.lm_head.output.save()
    _close(y, want["y"])


def test_output_replaced_by_a_smaller_tensor(model, ref):
    want = _expected(ref, "smaller_output")
    with model.trace(A):
        model.transformer.h[0].mlp.output = model.transformer.h[0].mlp.output[:, -1:, :] * 2
        x = model.transformer.h[0].mlp.output.save()
        y = model.lm_head.output.save()
    assert x.shape == want["x"].shape == (1, 1, 64)
    _close(x, want["x"])
    _close(y, want["y"])


def test_rename_alias_belongs_to_its_handle(daemon, tiny_models):
    """nnsight's rename= is per model object: two handles may give one alias to different modules."""
    path = tiny_models["gpt2"]
    a = nnd.TransformersModel(path, address=daemon.address, device="cpu", rename={"transformer.h.0.mlp": "my_mlp"})
    b = nnd.TransformersModel(path, address=daemon.address, device="cpu", rename={"transformer.h.1.mlp": "my_mlp"})
    plain = nnd.TransformersModel(path, address=daemon.address, device="cpu")
    with a.trace(A):
        x, x0 = a.my_mlp.output.save(), a.transformer.h[0].mlp.output.save()
    with b.trace(A):
        y, y1 = b.my_mlp.output.save(), b.transformer.h[1].mlp.output.save()
    assert torch.equal(x, x0) and torch.equal(y, y1) and not torch.equal(x, y)
    assert not hasattr(plain, "my_mlp")


def test_nnsight_wrapper_from_eight_threads(daemon):
    """torch.export runs one at a time in a process; eight threads wrapping at once all succeed."""
    import threading

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    x = torch.rand(2, 5)
    start = threading.Barrier(8)
    results: list[Any] = [None] * 8

    def wrap(i: int) -> None:
        start.wait()
        try:
            wrapped = nnd.NNsight(net, x, address=daemon.address, device="cpu")
            with wrapped.trace(x):
                out = wrapped.output.save()
            results[i] = out
        except Exception as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for got in results:
        assert isinstance(got, torch.Tensor), got
        _close(got, net(x).detach())


# ------------------------------------------------------------------ inputs


def test_keyword_inputs_and_tokenizer_output(model, ref):
    want = _expected(ref, "keyword_inputs")
    enc = model.tokenizer(A, return_tensors="pt")
    with model.trace(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]):
        y1 = model.lm_head.output.save()
    with model.trace(**enc):
        y2 = model.lm_head.output.save()
    _close(y1, want["y1"])
    _close(y2, want["y2"])


def test_invoke_of_several_prompts_is_one_batched_invoke(model, ref):
    want = _expected(ref, "invoke_several_prompts")
    with model.trace() as tracer:
        with tracer.invoke([A, B]):
            y = model.lm_head.output.save()
        with tracer.invoke(B):
            z = model.lm_head.output.save()
    assert y.shape[0] == 2 and z.shape[0] == 1
    _close(y, want["y"])
    _close(z, want["z"])


def test_tokenizer_kwargs(model, ref):
    want = _expected(ref, "tokenizer_kwargs")
    with model.trace(B, tokenizer_kwargs={"add_special_tokens": False}):
        y = model.lm_head.output.save()
    _close(y, want["y"])


def test_keyword_inputs_are_batched_per_invoke(model):
    """A forward keyword other than the ids travels as Invoke.kwargs, row-aligned with the prompts:
    GPT-2's position_ids given explicitly change the logits as they would in-process."""
    ids = model.tokenizer(A, return_tensors="pt")["input_ids"]
    shifted = torch.arange(ids.shape[1]).unsqueeze(0) + 5
    with model.trace(input_ids=ids):
        plain = model.lm_head.output.save()
    with model.trace(input_ids=ids, position_ids=shifted):
        moved = model.lm_head.output.save()
    with model.trace() as tracer:
        with tracer.invoke(input_ids=ids, position_ids=shifted):
            batched = model.lm_head.output.save()
    assert not torch.allclose(plain, moved)
    _close(batched, moved)


# ------------------------------------------------------------------ generation


def test_generate_without_with_returns_the_ids(model, ref):
    want = _expected(ref, "generate_without_with")
    ids = model.generate(A, max_new_tokens=3)
    assert torch.equal(ids, want["ids"])


def test_beams_and_return_sequences_stack_as_nnsight(model, ref):
    want = _expected(ref, "beams_and_return_sequences")
    with model.generate(max_new_tokens=3, num_beams=2, num_return_sequences=2) as tracer:
        with tracer.invoke(A):
            o1 = tracer.result.save()
        with tracer.invoke(B):
            o2 = tracer.result.save()
    assert o1.shape == want["o1"].shape == (4, 14)
    assert torch.equal(o1, want["o1"]) and torch.equal(o2, want["o2"])


def test_generation_config_is_the_callers(model, ref):
    from transformers import GenerationConfig

    want = _expected(ref, "generation_config")
    with model.generate(A, generation_config=GenerationConfig(max_new_tokens=2, do_sample=False)) as tracer:
        ids = tracer.result.save()
    assert torch.equal(ids, want["ids"])


def test_generation_config_fields_are_allow_listed(model):
    with pytest.raises(nnd.InvalidRequest, match="custom_generate"):
        with model.generate(A, generation_config={"max_new_tokens": 2, "custom_generate": "x"}):
            pass


def test_trace_accepts_max_new_tokens(model, ref):
    want = _expected(ref, "trace_with_max_new_tokens")
    with model.trace(A, max_new_tokens=3):
        y = model.lm_head.output.save()
    _close(y, want["y"])


# ------------------------------------------------------------------ small API


def test_barrier_is_accepted(model, ref):
    want = _expected(ref, "barrier_patching")
    with model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(A):
            clean = model.transformer.h[0].output[:, -1, :]
            barrier()
        with tracer.invoke(B):
            barrier()
            model.transformer.h[0].output[:, -1, :] = clean
            y = model.lm_head.output[:, -1, :].save()
    _close(y, want["y"])


def test_cache_non_blocking_and_save(model, ref):
    want = _expected(ref, "cache_options_and_save")
    with model.trace(A) as tracer:
        cache = tracer.cache(modules=[model.transformer.h[1]], non_blocking=True).save()
    _close(cache["model.transformer.h.1"].output, want["h1"])


def test_parameters_and_device(model, ref):
    want = _expected(ref, "parameters_and_device")
    assert str(model.device) == want["device"]
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert named == [tuple(x) for x in want["named"]]
    assert [tuple(p.shape) for p in model.parameters()] == [tuple(x) for x in want["shapes"]]
    assert all(isinstance(p, torch.nn.Parameter) for p in model.parameters())


def test_requires_grad_and_retain_grad_ops(model, ref):
    want = _expected(ref, "requires_grad_and_retain_grad")
    with model.trace(A):
        h = model.transformer.h[0].output
        h.requires_grad_(True)
        h.retain_grad()
        y = model.lm_head.output.save()
    _close(y, want["y"])


def test_distributed_config_spelling(daemon, tiny_models, tmp_path):
    """The reference page's DistributedConfig(tp_size=N) means nnd's tp_size=N (no TypeError)."""
    import tinymodels
    from transformers.distributed import DistributedConfig

    # A model of its own: the first loader's placement is the model's (another test may have loaded it).
    path = tinymodels.private_copy(tiny_models["llama"], tmp_path)
    m = nnd.TransformersModel(
        path, address=daemon.address, device="cpu", distributed_config=DistributedConfig(tp_size=2)
    )
    assert m.info.placement.tp_size == 2
    with pytest.raises(TypeError, match="disagree"):
        nnd.TransformersModel(
            path,
            address=daemon.address,
            tp_size=3,
            distributed_config=DistributedConfig(tp_size=2),
        )


# ------------------------------------------------------------------ loading


def test_nnsight_wrapper_without_example_inputs(daemon, ref):
    """`nnd.NNsight(net)`: exported and sent when the first trace brings inputs."""
    from nnsight_fidelity import seeded_net

    want = _expected(ref, "nnsight_without_example_inputs")
    net, x = seeded_net()
    wrapped = nnd.NNsight(net, address=daemon.address, device="cpu")
    first = wrapped[0]  # navigable before anything is sent
    with wrapped.trace(x):
        hidden = first.output.save()
        out = wrapped.output.save()
    _close(hidden, want["hidden"])
    _close(out, want["out"])


def test_in_memory_transformers_model_is_dispatched(daemon, tiny_models):
    """nnsight reports an in-memory model dispatched (its loading page): nnd dispatches it at once."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]).eval()
    model = nnd.TransformersModel(hf, address=daemon.address, name="fidelity-in-memory")
    try:
        assert model.dispatched and str(model.device) == "cpu"
        ids = torch.tensor([model.tokenizer(A)["input_ids"]])
        with model.trace(ids):
            logits = model.lm_head.output.save()
        with torch.no_grad():
            _close(logits, hf(ids).logits)
    finally:
        model.unload()


def test_scan_values_are_fake_tensors(model, ref):
    from torch._subclasses.fake_tensor import FakeTensor

    want = _expected(ref, "scan_values_are_fake")
    with model.scan(A):
        hs = model.transformer.h[-1].output.save()
    assert want["fake"] and want["sum_fake"]
    assert isinstance(hs, FakeTensor) and isinstance(hs.sum(), FakeTensor)
    assert list(hs.shape) == want["shape"]
    # nnd scans the META model, so its fakes are on "meta" (nnsight's, of a dispatched model, on its device).
    assert hs.device.type == "meta"


def test_t5_trace_with_decoder_input_ids(daemon, tiny_models, tmp_path):
    """A keyword input the ids are not (T5's decoder_input_ids) reaches the forward: the logits
    equal transformers' own for the same inputs."""
    import shutil

    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=320, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0
    )
    hf = T5ForConditionalGeneration(config).eval()
    hf.save_pretrained(tmp_path)
    for f in os.listdir(tiny_models["gpt2"]):
        if "token" in f:
            shutil.copy(os.path.join(tiny_models["gpt2"], f), tmp_path / f)
    model = nnd.TransformersModel(str(tmp_path), address=daemon.address, device="cpu")
    try:
        ids, dec = torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0, 9, 10]])
        with model.trace(input_ids=ids, decoder_input_ids=dec):
            logits = model.lm_head.output.save()
            first = model.decoder.block[0].output[0].save()
        with torch.no_grad():
            want = hf(input_ids=ids, decoder_input_ids=dec).logits
        assert first.shape == (1, 3, 32)
        _close(logits, want)
    finally:
        model.unload()
