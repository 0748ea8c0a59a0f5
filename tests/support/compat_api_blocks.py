"""The API surface real nnsight 0.8.1 code touches (issue #27), as blocks run
unchanged by nnsight (tests/support/nnsight_blocks_reference.py, in a process of its own)
and by nnd (tests/test_nnsight_api.py) on the same weights: the model handle
as transformers users know it, generate() keywords, module attributes,
torch.nn.functional, range/list indices, einops, cache keys, `tracer.all()`
over a generation that ends early, `.all()` on a submodule.

Each takes a model (nnsight's LanguageModel or nnd's TransformersModel) and
returns plain results to compare."""

from __future__ import annotations

from typing import Any

import einops
import torch
import torch.nn.functional as F

PROMPT = "The Eiffel Tower is in the city of"


def handle_as_transformers_knows_it(model: Any) -> dict[str, Any]:
    config = model.config
    model.eval()
    with model.trace(PROMPT):
        logits = model.lm_head.output.save()
    return {
        "class": type(config).__name__,
        "n_head": config.n_head,
        "heads": config.num_attention_heads,
        "layers": config.num_hidden_layers,
        "vocab": config.to_dict()["vocab_size"],
        "dtype": str(model.dtype),
        "logits": logits,
    }


def calling_the_model_returns_its_output(model: Any) -> dict[str, Any]:
    ids = model.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    out = model(ids)
    direct = model.trace(ids, trace=False)
    with model.trace(PROMPT, remote=False):
        local = model.lm_head.output.save()
    return {"call": out.logits, "trace_false": direct.logits, "remote_false": local}


def generate_keywords_reach_generation(model: Any) -> dict[str, Any]:
    pad = model.tokenizer.eos_token_id
    with model.generate(PROMPT, max_new_tokens=6, repetition_penalty=1.8, no_repeat_ngram_size=2, pad_token_id=pad) as t:
        penalised = t.result.save()
    encoded = model.tokenizer(PROMPT, return_tensors="pt")
    with model.generate(
        input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"], max_new_tokens=4, num_beams=2
    ) as t:
        beams = t.result.save()
    with model.generate(PROMPT, max_new_tokens=4, do_sample=False, top_k=3, eos_token_id=pad) as t:
        greedy = t.result.save()
    return {"penalised": penalised, "beams": beams, "greedy": greedy}


def module_attributes_in_real_code(model: Any) -> dict[str, Any]:
    attn = model.transformer.h[0].attn
    heads, width = attn.num_heads, attn.head_dim
    with model.trace(PROMPT):
        qkv = attn.c_attn.output
        q = qkv[..., : heads * width].reshape(qkv.shape[0], qkv.shape[1], heads, width).transpose(1, 2).save()
    return {
        "heads": heads,
        "width": width,
        "split": attn.split_size,
        "layer": model.transformer.h[1].attn.layer_idx,
        "causal": attn.is_causal,
        "scaling": attn.scaling,
        "config_heads": attn.config.n_head,
        "q": q,
    }


def functional_as_a_whole(model: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with model.trace(PROMPT):
        h0 = model.transformer.h[0].output[0]
        h1 = model.transformer.h[1].output[0]
        logits = model.lm_head.output[0]
        probs = F.softmax(logits, dim=-1)
        out.update({
            "softmax": probs.save(),
            "kl": F.kl_div(F.log_softmax(logits[:-1], dim=-1), probs[1:], reduction="batchmean").save(),
            "ce": F.cross_entropy(logits[:-1], torch.arange(1, logits.shape[0])).save(),
            "cos": F.cosine_similarity(h0, h1, dim=-1).save(),
            "normalize": F.normalize(h1, dim=-1).save(),
            "pad": F.pad(h0, (1, 2)).save(),
            "gelu": F.gelu(h0).save(),
            "mse": F.mse_loss(h0, h1).save(),
            "linear": F.linear(h0, torch.ones(3, h0.shape[-1])).save(),
            "logsigmoid": F.logsigmoid(h1).save(),
        })
    return out


def range_and_list_indices(model: Any) -> dict[str, Any]:
    with model.trace(PROMPT):
        h = model.transformer.h[0].output
        a = h[:, range(3)].save()
        b = h[:, [0, 2, 4]].save()
        c = h[0, range(1, 6, 2), :5].save()
        model.transformer.h[1].output[:, [1, 3]] = 0
        d = model.transformer.h[1].output.save()
    return {"range": a, "list": b, "stepped": c, "written": d}


def einops_on_traced_values(model: Any) -> dict[str, Any]:
    with model.trace(PROMPT):
        h = model.transformer.h[0].output
        split = einops.rearrange(h, "b s (n d) -> b n s d", n=4).save()
        mean = einops.reduce(h, "b s d -> b d", "mean").save()
        scores = einops.einsum(h, h, "b s d, b t d -> b s t").save()
    return {"split": split, "mean": mean, "scores": scores}


def cache_keys_as_nnsight_spells_them(model: Any) -> dict[str, Any]:
    with model.trace(PROMPT) as tracer:
        some = tracer.cache(modules=[model.transformer.h[0], model.transformer.h[1].mlp])
    with model.trace(PROMPT) as tracer:
        every = tracer.cache()
    return {
        "keys": sorted(some.keys()),
        "h0": some["model.transformer.h.0"].output,
        "short": some["transformer.h.1.mlp"].output,
        "root_cached": "model" in every.keys(),
        "root_logits": every["model"].output["logits"],
    }


def all_steps_of_a_generation_that_ends_early(model: Any) -> dict[str, Any]:
    with model.generate(PROMPT, max_new_tokens=4) as tracer:
        free = tracer.result.save()
    stop = int(free[0, -3])  # the second new token ends the next generation
    with model.generate(PROMPT, max_new_tokens=8, eos_token_id=stop, pad_token_id=stop) as tracer:
        norms = list().save()
        with tracer.all():
            norms.append(model.transformer.h[0].output[0, -1].norm())
    return {"norms": norms}


def all_on_a_submodule(model: Any) -> dict[str, Any]:
    with model.generate(PROMPT, max_new_tokens=3, min_new_tokens=3):
        norms = list().save()
        with model.transformer.h[1].all():
            norms.append(model.transformer.h[1].output[0, -1].norm())
    return {"norms": norms}


BLOCKS = {
    f.__name__: f
    for f in (
        handle_as_transformers_knows_it,
        calling_the_model_returns_its_output,
        generate_keywords_reach_generation,
        module_attributes_in_real_code,
        functional_as_a_whole,
        range_and_list_indices,
        einops_on_traced_values,
        cache_keys_as_nnsight_spells_them,
        all_steps_of_a_generation_that_ends_early,
        all_on_a_submodule,
    )
}
