"""nnsight 0.8.1's side of tests/test_fidelity.py: run each case on the tiny
GPT-2 in a process of its own (importing nnsight patches torch) and save what
it gave: a tensor, a structure of tensors, or {"error": exception type name}.

Usage: python nnsight_fidelity.py MODEL_PATH OUT.pt
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

A = "Hello world"
B = "The Eiffel Tower is in"

CASES: dict[str, Callable[[Any], Any]] = {}


def case(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    CASES[fn.__name__] = fn
    return fn


# ------------------------------------------------------------------ bugs


@case
def per_invoke_values(model: Any) -> Any:
    with model.trace() as tracer:
        with tracer.invoke(A):
            cache = tracer.cache(modules=[model.transformer.h[0]])
            r1 = tracer.result.logits.save()
        with tracer.invoke(B):
            r2 = tracer.result.logits.save()
    return {"r1": r1, "r2": r2, "cache": cache["model.transformer.h.0"].output}


@case
def per_invoke_generator_output(model: Any) -> Any:
    with model.generate(max_new_tokens=3) as tracer:
        with tracer.invoke(A):
            o1 = model.generator.output.save()
        with tracer.invoke(B):
            o2 = model.generator.output.save()
    return {"o1": o1, "o2": o2}


@case
def skip_in_invokes(model: Any) -> Any:
    with model.trace() as tracer:
        with tracer.invoke(A):
            model.transformer.h[0].skip(model.transformer.h[0].input)
            y1 = model.lm_head.output.save()
        with tracer.invoke(B):
            model.transformer.h[0].skip(model.transformer.h[0].input)
            y2 = model.lm_head.output.save()
    return {"y1": y1, "y2": y2}


@case
def skip_child_read(model: Any) -> Any:
    with model.trace() as tracer:
        with tracer.invoke(A):
            model.transformer.h[0].skip(model.transformer.h[0].input)
            y = model.lm_head.output.save()
            x = model.transformer.h[0].mlp.output.save()
    return {"y": y, "x": x}


@case
def two_backwards(model: Any) -> Any:
    with model.trace(A):
        h = model.transformer.h[0].output
        out = model.lm_head.output
        with out.sum().backward(retain_graph=True):
            g1 = h.grad.save()
        with (out**2).sum().backward():
            g2 = h.grad.save()
    return {"g1": g1, "g2": g2}


@case
def inputs_with_none(model: Any) -> Any:
    with model.trace(A):
        args, kwargs = model.transformer.h[0].inputs
        model.transformer.h[0].inputs = (args, kwargs)
        y = model.lm_head.output.save()
    return {"y": y}


@case
def smaller_output(model: Any) -> Any:
    with model.trace(A):
        model.transformer.h[0].mlp.output = model.transformer.h[0].mlp.output[:, -1:, :] * 2
        x = model.transformer.h[0].mlp.output.save()
        y = model.lm_head.output.save()
    return {"x": x, "y": y}


# ------------------------------------------------------------------ inputs


@case
def keyword_inputs(model: Any) -> Any:
    enc = model.tokenizer(A, return_tensors="pt")
    with model.trace(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]):
        y1 = model.lm_head.output.save()
    with model.trace(**enc):
        y2 = model.lm_head.output.save()
    return {"y1": y1, "y2": y2}


@case
def invoke_several_prompts(model: Any) -> Any:
    with model.trace() as tracer:
        with tracer.invoke([A, B]):
            y = model.lm_head.output.save()
        with tracer.invoke(B):
            z = model.lm_head.output.save()
    return {"y": y, "z": z}


@case
def tokenizer_kwargs(model: Any) -> Any:
    with model.trace(B, tokenizer_kwargs={"add_special_tokens": False}):
        y = model.lm_head.output.save()
    return {"y": y}


# ------------------------------------------------------------------ generation


@case
def generate_without_with(model: Any) -> Any:
    return {"ids": model.generate(A, max_new_tokens=3)}


@case
def beams_and_return_sequences(model: Any) -> Any:
    with model.generate(max_new_tokens=3, num_beams=2, num_return_sequences=2) as tracer:
        with tracer.invoke(A):
            o1 = tracer.result.save()
        with tracer.invoke(B):
            o2 = tracer.result.save()
    return {"o1": o1, "o2": o2}


@case
def generation_config(model: Any) -> Any:
    from transformers import GenerationConfig

    with model.generate(A, generation_config=GenerationConfig(max_new_tokens=2, do_sample=False)) as tracer:
        ids = tracer.result.save()
    return {"ids": ids}


@case
def trace_with_max_new_tokens(model: Any) -> Any:
    with model.trace(A, max_new_tokens=3):
        y = model.lm_head.output.save()
    return {"y": y}


# ------------------------------------------------------------------ small API


@case
def barrier_patching(model: Any) -> Any:
    with model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(A):
            clean = model.transformer.h[0].output[:, -1, :]
            barrier()
        with tracer.invoke(B):
            barrier()
            model.transformer.h[0].output[:, -1, :] = clean
            y = model.lm_head.output[:, -1, :].save()
    return {"y": y}


@case
def cache_options_and_save(model: Any) -> Any:
    with model.trace(A) as tracer:
        cache = tracer.cache(modules=[model.transformer.h[1]], non_blocking=True).save()
    return {"h1": cache["model.transformer.h.1"].output}


@case
def parameters_and_device(model: Any) -> Any:
    return {
        "device": str(model.device),
        "named": [(n, tuple(p.shape)) for n, p in model.named_parameters()],
        "shapes": [tuple(p.shape) for p in model.parameters()],
    }


@case
def requires_grad_and_retain_grad(model: Any) -> Any:
    with model.trace(A):
        h = model.transformer.h[0].output
        h.requires_grad_(True)
        h.retain_grad()
        y = model.lm_head.output.save()
    return {"y": y}


@case
def scan_values_are_fake(model: Any) -> Any:
    from torch._subclasses.fake_tensor import FakeTensor

    with model.scan(A):
        hs = model.transformer.h[-1].output.save()
    return {"fake": isinstance(hs, FakeTensor), "shape": list(hs.shape), "sum_fake": isinstance(hs.sum(), FakeTensor)}


def seeded_net() -> tuple[torch.nn.Module, torch.Tensor]:
    """The same small net and input in both processes."""
    gen = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 2))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return net, torch.randn(3, 5, generator=gen)


@case
def nnsight_without_example_inputs(model: Any) -> Any:
    from nnsight import NNsight

    net, x = seeded_net()
    wrapped = NNsight(net)
    with wrapped.trace(x):
        hidden = wrapped[0].output.save()
        out = wrapped.output.save()
    return {"hidden": hidden, "out": out}


def main(path: str, out: str, names: list[str]) -> None:
    import nnsight
    from transformers import AutoTokenizer

    model = nnsight.LanguageModel(path, tokenizer=AutoTokenizer.from_pretrained(path), device_map="cpu", dispatch=True)
    results: dict[str, Any] = {}
    for name, fn in CASES.items():
        if names and name not in names:
            continue
        try:
            results[name] = _plain(fn(model))
        except Exception as exc:  # noqa: BLE001 - the exception type is the result
            results[name] = {"error": type(exc).__name__, "message": str(exc)[:500]}
    torch.save(results, out)


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
