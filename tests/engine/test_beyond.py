"""Caches, stored edits, sessions, aliases and server-side reductions, at the engine level."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import wire_results
from graphs import Graph, S, idx
from reference import forward, inputs
from torch.testing import assert_close

from nnd.v1 import nnd_pb2, worker_pb2
from nnd_daemon import aliases, engine, errors

PROMPT = "The Eiffel Tower is in the city of"
OTHER = "Hello world"


# ------------------------------------------------------------------ cache


def _hooked_outputs(m: Any, texts: list[str], paths: list[str], **fns: Any) -> dict[str, list[Any]]:
    seen: dict[str, list[Any]] = {p: [] for p in paths}
    modules = dict(m.model.named_modules())
    handles = [
        modules[p].register_forward_hook(lambda mod, a, o, p=p: seen[p].append(o)) for p in paths
    ]  # registered after the steering hooks below, so they see the steered value
    try:
        forward(m.model, m.tokenizer, texts, **fns)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_cache_every_module_after_interventions(gpt2):
    g = Graph()
    cache = g.cache()
    h0 = g.module("transformer.h.0")
    g.op("setitem", h0, idx(S, -1, S), 0.0, text="h0.output[:, -1] = 0")
    got = gpt2.run(g.request(PROMPT))[cache.id]
    # Every module that ran (a ModuleList is never called, so it has no entry).
    paths = {p for p, _ in gpt2.model.named_modules()}
    assert set(got) <= paths and {"", "transformer.h.0", "transformer.h.1.mlp.c_fc", "lm_head"} <= set(got)

    def zero_last(mod: Any, a: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[:, -1] = 0
        return out

    ref = forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0=zero_last)
    seen = _hooked_outputs(gpt2, [PROMPT], ["transformer.h.1", "transformer.h.0.mlp"], transformer__h__0=zero_last)
    assert len(got["transformer.h.0"]) == 1
    assert torch.all(got["transformer.h.0"][0]["output"][:, -1] == 0)
    assert_close(got["transformer.h.1"][0]["output"], seen["transformer.h.1"][0])
    assert_close(got["transformer.h.0.mlp"][0]["output"], seen["transformer.h.0.mlp"][0])
    assert_close(got[""][0]["output"]["logits"], ref.logits)


def test_cache_selected_modules_inputs_and_dtype(gpt2):
    g = Graph()
    cache = g.cache(["transformer.h.1", "lm_head"], inputs=True, dtype=torch.float16, device="cpu")
    got = gpt2.run(g.request(PROMPT))[cache.id]
    assert set(got) == {"transformer.h.1", "lm_head"}
    seen = _hooked_outputs(gpt2, [PROMPT], ["transformer.h.0"])
    args, kwargs = got["transformer.h.1"][0]["inputs"]
    assert args[0].dtype == torch.float16
    assert_close(args[0], seen["transformer.h.0"][0].half())
    assert got["lm_head"][0]["output"].dtype == torch.float16


def test_cache_one_entry_per_generation_step(gpt2):
    g = Graph()
    cache = g.cache(["transformer.h.0"])
    got = gpt2.run(g.request(PROMPT, generate=nnd_pb2.GenerateOptions(max_new_tokens=3)), mode="generate")[cache.id]
    entries = got["transformer.h.0"]
    n = len(gpt2.tokenizer(PROMPT)["input_ids"])
    assert [e["output"].shape[1] for e in entries] == [n, 1, 1]


# ------------------------------------------------------------------ edits


def _zero_mlp0() -> nnd_pb2.TraceRequest:
    e = Graph()
    e.op("setitem", e.module("transformer.h.0.mlp"), idx(S), 0.0, text="edited.h[0].mlp.output[:] = 0")
    return e.g


def test_edit_runs_before_the_request_and_keeps_its_ids(gpt2):
    g = Graph()
    mlp = g.save(g.module("transformer.h.0.mlp"))
    logits = g.save(g.op("getattr", g.module(""), "logits"))
    request = g.request(PROMPT)
    plain = gpt2.run(request)
    request.edits.append("zero")
    edited = gpt2.run(request, edits={"zero": worker_pb2.EditStack(graphs=[_zero_mlp0()])})
    assert set(edited) == set(plain) == {mlp.id, logits.id}
    assert torch.all(edited[mlp.id] == 0) and not torch.all(plain[mlp.id] == 0)
    ref = forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__0__mlp=lambda m, a, o: torch.zeros_like(o))
    assert_close(edited[logits.id], ref.logits)


def test_unknown_edit_is_not_found(gpt2):
    g = Graph()
    g.save(g.module("transformer.h.0"))
    request = g.request(PROMPT)
    request.edits.append("nope")
    with pytest.raises(errors.NotFound, match="nope"):
        gpt2.run(request, edits={})


def test_edit_that_saves_is_refused(gpt2):
    from nnd_daemon.engine import plan

    e = Graph()
    e.save(e.module("transformer.h.0"))
    with pytest.raises(errors.InvalidArgument, match="cannot save"):
        plan.check_edit(e.g, gpt2.model)
    e = Graph()
    e.op("setitem", e.module("transformer.h.0", invoke=0), idx(S), 0.0)
    with pytest.raises(errors.InvalidArgument, match="invoke"):
        plan.check_edit(e.g, gpt2.model)


# ------------------------------------------------------------------ sessions


def _session(m: Any, *traces: nnd_pb2.TraceRequest, scan: bool = False) -> dict[int, Any]:
    session = nnd_pb2.SessionRequest(model="tiny", scan=scan)
    for t in traces:
        session.traces.add(request=t)
    out: list[nnd_pb2.TraceResponse] = []
    engine.run_session(m.meta if scan else m.model, m.tokenizer, session, emit=out.append)
    assert out[-1].WhichOneof("kind") == "done"
    return wire_results.collect(out)


def test_session_equals_its_traces_and_values_flow(gpt2):
    first = Graph()
    h = first.module("transformer.h.1", invoke=0)  # not saved: it flows into the next trace
    kept = first.save(first.op("getattr", first.module(""), "logits"))
    second = Graph()
    second.next = first.next
    second.op("setitem", second.module("transformer.h.1"), idx(S, -1, S), second.op("getitem", h, idx(S, -1, S)))
    patched = second.save(second.op("getattr", second.module(""), "logits"))
    got = _session(gpt2, first.request(PROMPT), second.request(OTHER))
    assert set(got) == {kept.id, patched.id}

    alone = gpt2.run(first.request(PROMPT))
    assert_close(got[kept.id], alone[kept.id])
    store: dict[str, torch.Tensor] = {}
    forward(gpt2.model, gpt2.tokenizer, [PROMPT], transformer__h__1=lambda m, a, o: store.setdefault("h", o))

    def patch(mod: Any, a: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[:, -1] = store["h"][:, -1]
        return out

    ref = forward(gpt2.model, gpt2.tokenizer, [OTHER], transformer__h__1=patch)
    assert_close(got[patched.id], ref.logits)


def test_session_scan_and_bad_reference(gpt2):
    first = Graph()
    h = first.module("transformer.h.0")
    second = Graph()
    second.next = first.next
    total = second.save(second.op("add", second.module("transformer.h.0"), h))
    got = _session(gpt2, first.request(PROMPT), second.request(PROMPT), scan=True)
    assert got[total.id].device.type == "meta"
    bad = Graph()
    bad.next = 50
    bad.save(bad.op("add", bad.module("transformer.h.0"), h))
    bad.g.nodes[-2].op.args[1].ref = 40  # a node no trace has
    with pytest.raises(errors.InvalidArgument):
        _session(gpt2, first.request(PROMPT), bad.request(PROMPT))


# ------------------------------------------------------------------ aliases

STANDARD = {
    "gpt2": {"layers": "transformer.h", "final_norm": "transformer.ln_f", "embed": "transformer.wte"},
    "llama": {"layers": "model.layers", "final_norm": "model.norm", "embed": "model.embed_tokens"},
    "bert": {"layers": "bert.encoder.layer", "lm_head": "cls", "embed": "bert.embeddings.word_embeddings"},
}


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_one_alias_graph_runs_on_every_architecture(models, kind):
    m = models[kind]
    table = aliases.AliasTable.of(m.model)
    for alias, real in STANDARD[kind].items():
        assert table.resolve(alias) == real
    g = Graph()
    layer = g.save(g.module("layers.0"))
    attn = g.save(g.module("layers.1.attention"))
    mlp = g.save(g.module("layers.1.mlp"))
    head = g.save(g.module("lm_head"))
    request = g.request(PROMPT)
    aliases.rewrite_graph(request.graph, table)
    got = m.run(request)
    real = {"gpt2": "transformer.h", "llama": "model.layers", "bert": "bert.encoder.layer"}[kind]
    modules = dict(m.model.named_modules())
    attn_name = {"gpt2": "attn", "llama": "self_attn", "bert": "attention"}[kind]
    mlp_name = {"gpt2": "mlp", "llama": "mlp", "bert": "intermediate"}[kind]
    seen: dict[str, Any] = {}
    handles = [
        modules[f"{real}.0"].register_forward_hook(lambda mod, a, o: seen.setdefault("layer", o)),
        modules[f"{real}.1.{attn_name}"].register_forward_hook(lambda mod, a, o: seen.setdefault("attn", o)),
        modules[f"{real}.1.{mlp_name}"].register_forward_hook(lambda mod, a, o: seen.setdefault("mlp", o)),
    ]
    try:
        ref = m.model(**inputs(m.tokenizer, [PROMPT])) if kind != "bert" else None
        if kind == "bert":
            with torch.no_grad():
                ref = m.model(**{k: v for k, v in inputs(m.tokenizer, [PROMPT]).items() if k != "position_ids"})
    finally:
        for h in handles:
            h.remove()
    first = lambda v: v[0] if isinstance(v, tuple) else v  # noqa: E731
    assert_close(first(got[layer.id]), first(seen["layer"]))
    assert_close(first(got[attn.id]), first(seen["attn"]))
    assert_close(got[mlp.id], seen["mlp"])
    assert_close(got[head.id], ref.logits)


def test_rename_rules_follow_nnsight():
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=10))
    table = aliases.AliasTable.of(model, standard=False)
    table.add_rules(
        [
            aliases.Rule(("blocks",), path="*.h"),
            aliases.Rule(("self_attn",), path="attn"),
            aliases.Rule(("attn.o_proj",), path="attn.c_proj"),
            aliases.Rule(("ffn",), type="GPT2MLP"),
        ]
    )
    assert table.resolve("blocks.1.self_attn.o_proj") == "transformer.h.1.attn.c_proj"
    assert table.resolve("transformer.h.0.self_attn") == "transformer.h.0.attn"
    assert table.resolve("blocks.0.ffn.c_fc") == "transformer.h.0.mlp.c_fc"
    assert "transformer.h.0.self_attn" in table.aliases_of()["transformer.h.0.attn"]
    with pytest.raises(errors.InvalidArgument, match="would hide"):
        table.add_rule(aliases.Rule(("wte",), path="wpe"))  # on `transformer`, which has a wte
    with pytest.raises(errors.InvalidArgument, match="names 2 modules"):
        table.add_rule(aliases.Rule(("block",), path="transformer.h.*"))
    with pytest.raises(errors.InvalidArgument, match="names 2 modules"):
        table.add_rule(aliases.Rule(("norm",), type="LayerNorm"))  # ln_1 and ln_2 of each block


# ------------------------------------------------------------------ reductions


def test_reductions_on_the_server(gpt2):
    directions = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    g = Graph()
    h = g.module("transformer.h.1")
    logits = g.op("getattr", g.module(""), "logits")
    norms = g.save(g.op("norm", h, dim=-1))
    vnorms = g.save(g.op("linalg_vector_norm", h, ord=2, dim=-1))
    top = g.op("topk", g.op("getitem", logits, idx(S, -1)), 5, dim=-1)
    top_ids = g.save(g.op("getattr", top, "indices"))
    top_vals = g.save(g.op("getattr", top, "values"))
    mean = g.save(g.op("mean", h, dim=0))
    proj = g.save(g.op("matmul", h, g.op("getattr", directions, "T")))
    eins = g.save(g.op("einsum", "bsd,kd->bsk", h, directions))
    got = gpt2.run(g.request(PROMPT, OTHER))

    store: dict[str, Any] = {}
    ref = forward(
        gpt2.model, gpt2.tokenizer, [PROMPT, OTHER], transformer__h__1=lambda m, a, o: store.setdefault("h", o)
    )
    hv = store["h"]
    assert_close(got[norms.id], hv.norm(dim=-1))
    assert_close(got[vnorms.id], torch.linalg.vector_norm(hv, dim=-1))
    want = ref.logits[:, -1].topk(5, dim=-1)
    assert torch.equal(got[top_ids.id], want.indices) and got[top_ids.id].shape == (2, 5)
    assert_close(got[top_vals.id], want.values)
    assert_close(got[mean.id], hv.mean(dim=0))
    assert_close(got[proj.id], hv @ directions.T)
    assert_close(got[eins.id], hv @ directions.T)
