"""nnsight 0.8.1's `.source` on a tiny model, in a process of its own (nnsight patches torch),
for tests/test_source.py to compare with: operation names, printing, and the values of reads
and edits of operations.

Usage: python nnsight_source_reference.py OUT.pt KIND=MODEL_PATH...  (one process for every model:
importing torch and nnsight is most of its cost)
"""

from __future__ import annotations

import sys

import torch

PROMPT = "The Eiffel Tower is in the city of"

# Per kind: (attention path, MLP path, the MLP's activation op, the attention's output projection op).
SITES = {
    "gpt2": ("transformer.h.0.attn", "transformer.h.0.mlp", "self_act_0", "self_c_proj_0"),
    "llama": ("model.layers.0.self_attn", "model.layers.0.mlp", "self_act_fn_0", "self_o_proj_0"),
}


def envoy(model, path: str):
    for part in path.split(".") if path else ():
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def reference(kind: str, path: str) -> dict[str, object]:
    import nnsight
    from transformers import AutoTokenizer

    model = nnsight.LanguageModel(path, tokenizer=AutoTokenizer.from_pretrained(path), device_map="cpu", dispatch=True)
    attn_path, mlp_path, act, proj = SITES[kind]
    attn, mlp = envoy(model, attn_path), envoy(model, mlp_path)
    results: dict[str, object] = {
        "attn_names": list(attn.source.names),
        "mlp_names": list(mlp.source.names),
        "attn_repr": repr(attn.source),
        "op_repr": repr(attn.source.attention_interface_1),
        # Every module's operations (the root, containers and torch.nn leaves included).
        "every": {name: list(envoy(model, name).source.names) for name, _ in model._module.named_modules()},
    }
    with model.trace(PROMPT):
        out_attn = attn.source.attention_interface_1.output[0].save()
        proj_in = attn.source.__getattr__(proj).input.save()
        logits = model.lm_head.output.save()
    results["attention"], results["proj_input"], results["logits"] = out_attn, proj_in, logits

    with model.trace(PROMPT):
        mlp.source.__getattr__(act).output[:] = 0
        zeroed = model.lm_head.output.save()
    results["zeroed"] = zeroed

    with model.trace(PROMPT):
        op = attn.source.__getattr__(proj)
        op.output = op.output * 0.5
        replaced = model.lm_head.output.save()
    results["replaced"] = replaced

    with model.trace(PROMPT):
        op = attn.source.__getattr__(proj)
        op.input = op.input * 2
        reinput = model.lm_head.output.save()
    results["reinput"] = reinput

    # Nested: the attention function's own operations (sdpa here: its kernel call, then the output scaled).
    with model.trace(PROMPT):
        inner = attn.source.attention_interface_1.source
        kernel = inner.torch_nn_functional_scaled_dot_product_attention_0.output.save()
        inner.torch_nn_functional_scaled_dot_product_attention_0.output[:] *= 0.5
        nested = model.lm_head.output.save()
    results["kernel"], results["nested"] = kernel, nested
    return results


if __name__ == "__main__":
    out, *models = sys.argv[1:]
    torch.save({kind: reference(kind, path) for kind, path in (m.split("=", 1) for m in models)}, out)
