"""Run the interventions of test_vs_nnsight.py with nnsight 0.8.1 in a process
of its own and save the results: importing nnsight patches torch in ways that
would leak into the other tests of the session.

Usage: python nnsight_reference.py KIND MODEL_PATH OUT.pt
"""

from __future__ import annotations

import sys

import torch

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "Hello world, this is"


def main(kind: str, path: str, out: str) -> None:
    import nnsight
    from transformers import AutoTokenizer

    model = nnsight.LanguageModel(path, tokenizer=AutoTokenizer.from_pretrained(path), device_map="cpu", dispatch=True)
    layers = (lambda: model.transformer.h) if kind == "gpt2" else (lambda: model.model.layers)
    norm = (lambda: model.transformer.ln_f) if kind == "gpt2" else (lambda: model.model.norm)
    width = model.config.hidden_size
    torch.manual_seed(0)
    v = torch.randn(int(width))
    results: dict[str, torch.Tensor] = {}

    with model.trace(PROMPT):
        read_layer = layers()[1].output.save()
        read_logits = model.lm_head.output.save()
    results["read_layer"], results["read_logits"] = read_layer, read_logits

    with model.trace(PROMPT):
        layers()[0].output[:] = 0
        ablated = model.lm_head.output.save()
    results["ablation"] = ablated

    with model.trace(PROMPT):
        layers()[1].output[:, -1, :] += 4 * v
        steered = model.lm_head.output.save()
    results["steering"] = steered

    with model.trace() as tracer:
        barrier = tracer.barrier(2)
        with tracer.invoke(PROMPT):
            clean = layers()[0].output[:, -1, :]
            barrier()
        with tracer.invoke(OTHER):
            barrier()
            layers()[0].output[:, -1, :] = clean
            patched = model.lm_head.output[:, -1, :].save()
    results["patching"] = patched

    with model.trace(PROMPT):
        lens = torch.softmax(model.lm_head(norm()(layers()[0].output)), dim=-1).save()
    results["logit_lens"] = lens

    with model.trace(PROMPT):
        layer = layers()[1]
        layer.skip(layer.input)
        skipped = model.lm_head.output.save()
    results["skip"] = skipped

    with model.trace(PROMPT):
        layers()[0].output[:, -1, :] *= 2
        early = layers()[0].output.save()
        late = model.lm_head.output.save()
    results["reverse_early"], results["reverse_late"] = early, late

    with model.trace(PROMPT) as tracer:
        stopped = layers()[0].output.save()
        tracer.stop()
    results["stop"] = stopped

    with model.trace(PROMPT):
        norm_seen = layers()[0].mlp.output.norm().save()
        if layers()[0].mlp.output.norm().item() > 0:  # a sync point inside layer 0
            layers()[0].output[:] = layers()[0].output * 0.5
        halved = layers()[1].output.save()
    results["inner_sync_norm"], results["inner_sync_halved"] = norm_seen, halved

    results["steering_vector"] = v
    torch.save({k: t.detach().clone() for k, t in results.items()}, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
