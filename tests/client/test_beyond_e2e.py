"""Beyond one forward, end to end against a real daemon: gradients, caches, edits, sessions,
aliases and server-side reductions, each checked against plain PyTorch on the same weights."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.testing import assert_close

import nnd

PROMPT = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"
LAYERS = 2


@pytest.fixture(scope="module")
def gpt2(daemon, tiny_models):
    model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu")
    yield model
    model.clear_edits()
    model.release()


@pytest.fixture(scope="module")
def reference(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]).eval()


def _ids(model: Any, *texts: str) -> dict[str, torch.Tensor]:
    """Left-padded ids, mask and positions, as the daemon batches invokes."""
    seqs = [model.tokenizer(t)["input_ids"] for t in texts]
    width = max(len(s) for s in seqs)
    pad = model.tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def _block_outputs(reference: Any, inputs: dict[str, torch.Tensor], **hooks: Any) -> tuple[Any, list[torch.Tensor]]:
    """A forward with every block's output kept (retain_grad), and optional hooks by block index."""
    outs: list[torch.Tensor] = []

    def keep(i: int) -> Any:
        def hook(mod: Any, args: Any, out: torch.Tensor) -> Any:
            if f"h{i}" in hooks:
                out = hooks[f"h{i}"](out)
            out.retain_grad()
            outs.append(out)
            return out

        return hook

    handles = [reference.transformer.h[i].register_forward_hook(keep(i)) for i in range(LAYERS)]
    try:
        result = reference(**inputs)
    finally:
        for h in handles:
            h.remove()
    return result, outs


# ------------------------------------------------------------------ gradients


def test_attribution_patching_end_to_end(gpt2, reference):
    """(clean - corrupt) x grad at every layer, in one request, against plain autograd."""
    with gpt2.trace() as tracer:
        with tracer.invoke(PROMPT):
            clean = [gpt2.transformer.h[i].output for i in range(LAYERS)]
        with tracer.invoke(CORRUPT):
            corrupt = [gpt2.transformer.h[i].output for i in range(LAYERS)]
            logits = gpt2.lm_head.output
            metric = logits[0, -1, 5] - logits[0, -1, 7]
        with metric.backward():
            attributions = [((c - k) * k.grad).sum(-1).save() for c, k in zip(clean, corrupt, strict=True)]
            attributions = attributions.save()  # the list too, or its name does not outlive the block
            grads = [k.grad.save() for k in corrupt].save()

    result, outs = _block_outputs(reference, _ids(gpt2, PROMPT, CORRUPT))
    (result.logits[1, -1, 5] - result.logits[1, -1, 7]).backward()
    reference.zero_grad(set_to_none=True)
    for i in range(LAYERS):
        assert_close(grads[i], outs[i].grad[1:2])
        want = ((outs[i][0:1] - outs[i][1:2]) * outs[i].grad[1:2]).sum(-1).detach()
        assert_close(attributions[i], want)


def test_editing_a_gradient_changes_what_flows_upstream(gpt2, reference):
    with gpt2.trace(PROMPT):
        h0, h1 = gpt2.transformer.h[0].output, gpt2.transformer.h[1].output
        loss = gpt2.lm_head.output[0, -1].sum()
        with loss.backward():
            h1.grad = h1.grad * 0.5
            g0 = h0.grad.save()

    outs: list[torch.Tensor] = []
    result, outs = _block_outputs(reference, _ids(gpt2, PROMPT))
    outs[1].register_hook(lambda g: g * 0.5)
    result.logits[0, -1].sum().backward()
    reference.zero_grad(set_to_none=True)
    assert_close(g0, outs[0].grad)


def test_impossible_gradient_is_refused_before_running(gpt2):
    with pytest.raises(ValueError, match="cannot depend on it") as info:
        with gpt2.trace(PROMPT):
            h0, h1 = gpt2.transformer.h[0].output, gpt2.transformer.h[1].output
            loss = h0.sum()
            with loss.backward():
                h1.grad.save()  # h1 runs after the loss is computed
    assert isinstance(info.value, nnd.InvalidRequest) and "h1.grad.save()" in str(info.value)


# ------------------------------------------------------------------ cache


def test_cache_matches_forward_hooks(gpt2, reference):
    with gpt2.trace(PROMPT) as tracer:
        cache = tracer.cache()
        gpt2.transformer.h[0].output[:, -1] = 0  # the cache sees values after interventions

    seen: dict[str, Any] = {}
    modules = dict(reference.named_modules())

    def zero(mod: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[:, -1] = 0
        return out

    handles = [modules["transformer.h.0"].register_forward_hook(zero)]
    for path in ("transformer.h.0", "transformer.h.1", "transformer.h.1.attn", "lm_head"):
        handles.append(modules[path].register_forward_hook(lambda m, a, o, p=path: seen.setdefault(p, o)))
    try:
        with torch.no_grad():
            reference(**_ids(gpt2, PROMPT))
    finally:
        for h in handles:
            h.remove()
    assert_close(cache["model.transformer.h.0"].output, seen["transformer.h.0"])
    assert_close(cache.transformer.h[1].output, seen["transformer.h.1"])
    assert_close(cache.model.layers[1].attention.output[0], seen["transformer.h.1.attn"][0])  # aliases
    assert_close(cache["model.layers.1"].output, seen["transformer.h.1"])
    assert_close(cache["lm_head"].output, seen["lm_head"])
    assert "transformer.h.0.mlp" in cache and len(cache["transformer.h.0"]) == 1


@pytest.mark.parametrize("dispatched", [False, True])
def test_cache_keys_list_the_layers_in_the_order_they_ran(gpt2, reference, daemon, tiny_models, dispatched):
    """nnsight's cache lists modules as their outputs came in the forward, so `list(cache.keys())[i]` is
    the i-th layer; the wire's map has no order of its own. (nnd orders by the module tree, children
    before parents, which is the forward's order for the layers and the blocks; inside a block a module
    defined out of call order, GPT-2's `mlp.act` after `mlp.c_proj`, is listed in definition order.)"""
    if dispatched:  # a handle made with dispatch=True holds the Dispatch's answer, which lists no modules
        gpt2 = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu", dispatch=True)
    with gpt2.trace(PROMPT) as tracer:
        cache = tracer.cache()
    ran: list[str] = []
    handles = [m.register_forward_hook(lambda mod, a, o, n=n: ran.append(n)) for n, m in reference.named_modules()]
    try:
        with torch.no_grad():
            reference(**_ids(gpt2, PROMPT))
    finally:
        for h in handles:
            h.remove()
    layers = [f"model.{n}" if n else "model" for n in dict.fromkeys(ran) if n.count(".") <= 2]  # blocks, layers, root
    assert [k for k in cache.keys() if k.count(".") <= 3] == layers


def test_cache_inputs_and_one_entry_per_step(gpt2):
    with gpt2.generate(PROMPT, max_new_tokens=3) as tracer:
        cache = tracer.cache(modules=[gpt2.transformer.h[0], "model.layers.1"], include_inputs=True)
    outputs = cache.transformer.h[0].output
    assert isinstance(outputs, list) and len(outputs) == 3
    n = len(gpt2.tokenizer(PROMPT)["input_ids"])
    assert [o.shape[1] for o in outputs] == [n, 1, 1]
    assert_close(cache.transformer.h[1].input[0], outputs[0])  # h1's input is h0's output
    assert set(cache.keys()) == {"model.transformer.h.0", "model.transformer.h.1"}  # nnsight 0.8's spelling


# ------------------------------------------------------------------ edits


def test_edit_visible_to_its_owner_only(daemon, tiny_models, gpt2):
    other = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu")
    with gpt2.trace(PROMPT):
        base = gpt2.lm_head.output.save()

    with gpt2.edit() as (tracer, edited):
        edited.transformer.h[0].mlp.output[:] = 0
    with edited.trace(PROMPT):
        mlp = edited.transformer.h[0].mlp.output.save()
        edited_logits = edited.lm_head.output.save()
    with gpt2.trace(PROMPT):
        plain = gpt2.lm_head.output.save()
    with other.trace(PROMPT):
        theirs = other.lm_head.output.save()
    assert torch.all(mlp == 0) and not torch.allclose(edited_logits, base)
    assert torch.equal(plain, base) and torch.equal(theirs, base)

    with gpt2.edit(inplace=True):
        gpt2.transformer.h[1].output[:, -1] += 1.0
    with gpt2.trace(PROMPT):
        mine = gpt2.lm_head.output.save()
    with other.trace(PROMPT):
        theirs = other.lm_head.output.save()
    assert not torch.allclose(mine, base) and torch.equal(theirs, base)
    gpt2.clear_edits()
    with gpt2.trace(PROMPT):
        cleared = gpt2.lm_head.output.save()
    assert torch.equal(cleared, base)
    edited.clear_edits()


def test_named_variant_opened_by_another_client(daemon, tiny_models, gpt2):
    with gpt2.edit(name="no-mlp0", replace=True) as (tracer, edited):
        edited.transformer.h[0].mlp.output[:] = 0
    variant = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu", edits="no-mlp0")
    with variant.trace(PROMPT):
        mlp = variant.transformer.h[0].mlp.output.save()
    assert torch.all(mlp == 0)
    assert "no-mlp0" in {e.id for e in gpt2.list_edits()}
    gpt2.delete_edit("no-mlp0")
    with pytest.raises(nnd.ModelNotFound):
        nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, edits="no-mlp0")


# ------------------------------------------------------------------ sessions


def test_session_equals_the_traces_it_contains(gpt2):
    with gpt2.session() as session:
        with gpt2.trace(PROMPT):
            clean = gpt2.transformer.h[1].output  # no .save(): it flows into the next trace
            clean_logits = gpt2.lm_head.output.save()
        with gpt2.trace(CORRUPT):
            gpt2.transformer.h[1].output[:, -1] = clean[:, -1]
            patched = gpt2.lm_head.output.save()
    assert session.compute_s > 0

    with gpt2.trace(PROMPT):
        h = gpt2.transformer.h[1].output.save()
        alone = gpt2.lm_head.output.save()
    with gpt2.trace(CORRUPT):
        gpt2.transformer.h[1].output[:, -1] = h[:, -1]
        patched_alone = gpt2.lm_head.output.save()
    assert_close(clean_logits, alone)
    assert_close(patched, patched_alone)
    assert "clean" not in locals()  # never saved: gone after the session, as in nnsight


def test_session_shapes_and_generate(gpt2):
    with gpt2.session():
        with gpt2.trace(PROMPT):
            h = gpt2.transformer.h[0].output
        with gpt2.generate(CORRUPT, max_new_tokens=2) as gen:
            assert h.shape[-1] == 64  # a shape query scans the session so far
            gpt2.transformer.h[0].output[:, -1] = h[:, -1]
            ids = gen.result.save()
        gen = nnd.save(gen)  # an inner block's `as` name outlives the session only saved
    assert ids.shape[1] == len(gpt2.tokenizer(CORRUPT)["input_ids"]) + 2
    assert [t.trace for t in gen.tokens] == [1, 1]


# ------------------------------------------------------------------ aliases


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_one_alias_graph_on_every_architecture(daemon, tiny_models, kind):
    model = nnd.TransformersModel(tiny_models[kind], address=daemon.address, device="cpu")
    try:
        with model.trace(PROMPT):
            layer = model.layers[0].output.save()
            attn = model.layers[1].attention.output.save()
            head = model.lm_head.output.save()
            logits = model.output.logits.save()
        real = {"gpt2": "transformer.h", "llama": "model.layers", "bert": "bert.encoder.layer"}[kind]
        assert model.layers.path == real and model.layers[1].attention.path.startswith(real + ".1.")
        first = layer[0] if isinstance(layer, tuple) else layer
        assert first.shape[-1] == 64 and attn is not None
        assert_close(head, logits)
        # The aliases are in the tree every client gets, so other languages can use them too.
        info = {m.path: list(m.aliases) for m in model.info.modules}
        assert "layers" in info[real]
    finally:
        model.release()


def test_rename_at_load(daemon, tiny_models):
    model = nnd.TransformersModel(
        tiny_models["gpt2"], address=daemon.address, device="cpu", rename={"transformer.h": "blocks", "attn": "sa"}
    )
    with model.trace(PROMPT):
        a = model.blocks[0].sa.output[0].save()
        b = model.transformer.h[0].attn.output[0].save()
    assert torch.equal(a, b)
    with pytest.raises(nnd.InvalidRequest, match="would hide"):
        nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, rename={"wpe": "wte"})


# ------------------------------------------------------------------ reductions


def test_reductions_bring_back_only_what_is_needed(gpt2, reference):
    directions = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    with gpt2.trace() as tracer:
        with tracer.invoke(PROMPT):
            pass
        with tracer.invoke(CORRUPT):
            pass
        h = gpt2.transformer.h[1].output
        norms = torch.linalg.vector_norm(h, dim=-1).save()
        norms2 = h.norm(dim=-1).save()
        top = gpt2.lm_head.output[:, -1].topk(5, dim=-1)
        top_ids = top.indices.save()
        top_values = top.values.save()
        batch_mean = h.mean(dim=0).save()
        projection = (h @ directions.T).save()
        projection2 = torch.einsum("bsd,kd->bsk", h, directions).save()

    seen: dict[str, torch.Tensor] = {}
    handle = reference.transformer.h[1].register_forward_hook(lambda m, a, o: seen.setdefault("h", o))
    try:
        with torch.no_grad():
            out = reference(**_ids(gpt2, PROMPT, CORRUPT))
    finally:
        handle.remove()
    hv = seen["h"]
    assert_close(norms, torch.linalg.vector_norm(hv, dim=-1))
    assert_close(norms2, hv.norm(dim=-1))
    want = out.logits[:, -1].topk(5, dim=-1)
    assert torch.equal(top_ids, want.indices) and top_ids.dtype == torch.int64
    assert_close(top_values, want.values)
    assert_close(batch_mean, hv.mean(dim=0))
    assert_close(projection, hv @ directions.T)
    assert_close(projection2, hv @ directions.T)
