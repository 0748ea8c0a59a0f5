"""Blocks that read a module's parameters and buffers, written as nnsight 0.8.1 users write
them, run unchanged by nnsight (nnsight_weights_reference.py, in a process of its own) and by
nnd (tests/test_weights_vs_nnsight.py) on the same weights. Each takes a model (nnsight's
LanguageModel or nnd's TransformersModel) and returns plain results to compare; a block that
raises returns the error's class name."""

from __future__ import annotations

from typing import Any

import torch

PROMPT = "The Eiffel Tower is in the city of"


def gpt2_logit_lens_lm_head_weight(model: Any) -> dict[str, Any]:
    lens = []  # outside the block: nnsight keeps only saved names and outer containers
    with model.trace(PROMPT):
        for layer in model.transformer.h:
            lens.append((model.transformer.ln_f(layer.output) @ model.lm_head.weight.T).save())
        logits = model.lm_head.output.save()
    return {"lens": lens, "logits": logits}


def gpt2_embedding_lookup_wte_weight(model: Any) -> dict[str, Any]:
    tokens = torch.tensor(model.tokenizer(PROMPT)["input_ids"])
    with model.trace(PROMPT):
        looked_up = model.transformer.wte.weight[tokens].save()
        embedded = model.transformer.wte.output.save()
    return {"looked_up": looked_up, "embedded": embedded}


def gpt2_shapes_and_dtype(model: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"outside": tuple(model.transformer.wte.weight.shape)}
    with model.trace(PROMPT):
        vocab = model.transformer.wte.weight.shape[0]
        out["vocab"] = vocab
        out["width"] = model.lm_head.weight.shape[-1]
        out["dtype"] = str(model.lm_head.weight.dtype)
        out["ndim"] = model.transformer.h[0].attn.c_attn.weight.ndim
        out["one_hot"] = torch.nn.functional.one_hot(model.lm_head.output[0].argmax(-1), vocab)
    return out


def gpt2_ops_on_parameters(model: Any) -> dict[str, Any]:
    with model.trace(PROMPT):
        scaled = (model.transformer.ln_f.weight * model.transformer.h[-1].output).save()
        bias = model.transformer.h[0].attn.c_attn.bias.save()
        norms = model.lm_head.weight.norm(dim=-1).save()
        position = model.transformer.wpe.weight[:3].sum().save()
    return {"scaled": scaled, "bias": bias, "norms": norms, "position": position}


def gpt2_in_place_write_raises(model: Any) -> dict[str, Any]:
    # nnsight: torch refuses the in-place write into a leaf that requires grad; nnd refuses it too
    # (the daemon's weights are shared). Both with RuntimeError.
    try:
        with model.trace(PROMPT):
            model.transformer.ln_f.weight[:] = 0
            logits = model.lm_head.output.save()
    except RuntimeError:
        return {"error": "RuntimeError"}
    return {"logits": logits}


def gpt2_after_the_write_the_model_is_unchanged(model: Any) -> dict[str, Any]:
    with model.trace(PROMPT):
        logits = model.lm_head.output.save()
    return {"logits": logits}


def gpt2_scan_weight_shapes(model: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with model.scan(PROMPT):
        lens = model.transformer.h[0].output @ model.lm_head.weight.T
        out["shape"] = tuple(lens.shape)
        out["vocab"] = model.transformer.wte.weight.shape[0]
    return out


GPT2 = {
    "gpt2_logit_lens_lm_head_weight": gpt2_logit_lens_lm_head_weight,
    "gpt2_embedding_lookup_wte_weight": gpt2_embedding_lookup_wte_weight,
    "gpt2_shapes_and_dtype": gpt2_shapes_and_dtype,
    "gpt2_ops_on_parameters": gpt2_ops_on_parameters,
    "gpt2_in_place_write_raises": gpt2_in_place_write_raises,
    "gpt2_after_the_write_the_model_is_unchanged": gpt2_after_the_write_the_model_is_unchanged,
    "gpt2_scan_weight_shapes": gpt2_scan_weight_shapes,
}


def llama_logit_lens_and_vocab_in_a_session(model: Any) -> dict[str, Any]:
    # The LLM-depth tutorial's shape: a vocabulary size read between a session's traces.
    out: dict[str, Any] = {}
    with model.session():
        with model.trace(PROMPT):
            h = model.model.layers[0].output
            lens = (model.model.norm(h) @ model.lm_head.weight.T).save()
            called = model.lm_head(model.model.norm(h)).save()
            logits = model.output.logits.save()
        out["vocab"] = model.model.embed_tokens.weight.shape[0]
    out.update(lens=lens, called=called, logits=logits)
    return out


def llama_projection_weights(model: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    attn = model.model.layers[0].self_attn
    with model.trace(PROMPT):
        out["bias_is_none"] = attn.q_proj.bias is None
        out["q"] = model.model.layers[0].input_layernorm.output @ attn.q_proj.weight.T
        out["q_shape"] = tuple(attn.q_proj.weight.shape)
        out["gate"] = model.model.layers[1].mlp.gate_proj.weight
    return out


LLAMA = {
    "llama_logit_lens_and_vocab_in_a_session": llama_logit_lens_and_vocab_in_a_session,
    "llama_projection_weights": llama_projection_weights,
}


def run(blocks: dict[str, Any], model: Any) -> dict[str, Any]:
    out = {}
    for name, block in blocks.items():
        try:
            out[name] = block(model)
        except Exception as exc:  # noqa: BLE001 - the test compares what each side raised
            out[name] = {"raised": f"{type(exc).__name__}: {exc}"}
    return out
