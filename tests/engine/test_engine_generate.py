"""Generate: per-step edits and saves, streamed steps, seeded sampling, cancellation."""

from __future__ import annotations

import pytest
import torch
import wire_results
from graphs import Graph, S, idx
from reference import inputs
from torch.testing import assert_close

from nnd.v1 import nnd_pb2
from nnd_daemon import errors

PROMPT = "The Eiffel Tower is"
OTHER = "Hello world, this is a tiny"
N = 4


def _opts(**kw) -> nnd_pb2.GenerateOptions:
    return nnd_pb2.GenerateOptions(max_new_tokens=N, **kw)


def _hf_generate(m, texts, step_edit=None, **kw) -> torch.Tensor:
    """HF generate with a hook that edits transformer.h.0 at one step (counted by forward calls)."""
    calls = {"n": 0}

    def hook(mod, args, out):
        step = calls["n"]
        calls["n"] += 1
        if step_edit is not None and step == step_edit:
            out = out.clone()
            out[:, -1, :] = 0
            return out
        return None

    handle = m.model.transformer.h[0].register_forward_hook(hook)
    try:
        enc = inputs(m.tokenizer, texts)
        enc.pop("position_ids")
        with torch.no_grad():
            return m.model.generate(**enc, max_new_tokens=N, do_sample=False, pad_token_id=m.tokenizer.pad_token_id)
    finally:
        handle.remove()


@pytest.mark.parametrize("style", ["call", "loop"])
def test_edit_at_step_1_matches_hooks(gpt2, style):
    g = Graph()
    if style == "call":  # top-level node at call 1
        h = g.module("transformer.h.0", call=1)
        g.op("setitem", h, idx(S, -1, S), 0.0)
    else:  # loop over steps [1]
        scope = g.loop([1])
        h = g.module("transformer.h.0", scope=scope)
        g.op("setitem", h, idx(S, -1, S), 0.0, scope=scope)
    result = g.save(g.module("", "result"))
    msgs = gpt2.stream(g.request(PROMPT, OTHER, generate=_opts()), mode="generate")

    got = wire_results.collect(msgs)[result.id]
    expected = _hf_generate(gpt2, [PROMPT, OTHER], step_edit=1)
    plain = _hf_generate(gpt2, [PROMPT, OTHER])
    assert torch.equal(got, expected)
    assert not torch.equal(expected, plain)
    steps = [r.step for r in msgs if r.WhichOneof("kind") == "step"]
    assert [s.step for s in steps] == list(range(N))
    width = got.shape[1] - N
    for s in steps:
        assert list(s.ids) == got[:, width + s.step].tolist()


def test_per_step_saves(gpt2):
    g = Graph()
    scope = g.loop()
    logits = g.save(g.op("getattr", g.module("", scope=scope), "logits", scope=scope), scope=scope)
    some = g.loop(slice(1, 3))
    h = g.save(g.module("transformer.h.1", scope=some), scope=some)
    got = gpt2.run(g.request(PROMPT, generate=_opts()), mode="generate")
    assert len(got[logits.id]) == N
    assert all(x.shape == (1, 1, 320) for x in got[logits.id])  # HF keeps only the last position's logits
    assert len(got[h.id]) == 2


def test_scope0_result_is_ids(llama):
    g = Graph()
    first = g.save(g.op("getattr", g.module(""), "logits"))
    result = g.save(g.module("", "result"))
    got = llama.run(g.request(PROMPT, generate=_opts()), mode="generate")
    n = len(llama.tokenizer(PROMPT)["input_ids"])
    assert got[result.id].shape == (1, n + N)
    assert_close(got[result.id][0, n], got[first.id][0, -1].argmax())


def test_seeded_sampling_repeats(gpt2):
    def sample(seed: int) -> torch.Tensor:
        g = Graph()
        result = g.save(g.module("", "result"))
        opts = _opts(do_sample=True, temperature=2.0, top_k=50, seed=seed)
        return gpt2.run(g.request(PROMPT, generate=opts), mode="generate")[result.id]

    assert torch.equal(sample(3), sample(3))
    assert any(not torch.equal(sample(3), sample(s)) for s in (4, 5, 6))


def test_stream_text(gpt2):
    g = Graph()
    msgs = gpt2.stream(g.request(PROMPT, generate=_opts(stream_text=True)), mode="generate")
    steps = [r.step for r in msgs if r.WhichOneof("kind") == "step"]
    assert all(len(s.text) == 1 and s.text[0] == gpt2.tokenizer.decode([s.ids[0]]) for s in steps)


def test_cancel_during_generation(gpt2):
    seen: list[nnd_pb2.TraceResponse] = []
    g = Graph()
    g.save(g.module("", "result"))
    from nnd_daemon import engine

    req = g.request(PROMPT, generate=_opts())
    with pytest.raises(errors.Cancelled):
        engine.run(gpt2.model, gpt2.tokenizer, req, mode="generate", emit=seen.append, cancelled=lambda: len(seen) >= 1)
    assert len(seen) == 1
    for mod in gpt2.model.modules():
        assert not mod._forward_hooks and not mod._forward_pre_hooks


def test_each_step_looks_only_at_frames_with_work_left(gpt2, monkeypatch):
    # A generation makes a frame per step, and the executor looks for nodes to run at every hook. Walking
    # every frame made each step's cost grow with the steps before it (768 steps with one save each:
    # 0.8 ms of engine time a step against 0.2 at 32). Spent frames are now dropped from that walk.
    from nnd_daemon.engine import executor as executor_module

    widest: list[int] = []
    real = executor_module.Executor.run_ready

    def watched(self, frames=None):
        widest.append(len(self._live) if frames is None else len(frames))
        return real(self, frames)

    monkeypatch.setattr(executor_module.Executor, "run_ready", watched)
    steps = 40
    g = Graph()
    scope = g.loop()
    h = g.save(g.op("getitem", g.module("transformer.h.1", scope=scope), idx(S, -1), scope=scope), scope=scope)
    every = g.loop(slice(0, steps, 7))
    w = g.save(g.module("transformer.h.0", scope=every), scope=every)
    got = gpt2.run(g.request(PROMPT, generate=nnd_pb2.GenerateOptions(max_new_tokens=steps)), mode="generate")
    assert len(got[h.id]) == steps and len(got[w.id]) == len(range(0, steps, 7))
    # The same values as HF's own generation, step by step (the last position of block 1's output).
    seen: list[torch.Tensor] = []
    handle = gpt2.model.transformer.h[1].register_forward_hook(lambda _m, _a, out: seen.append(out[:, -1].clone()))
    try:
        enc = inputs(gpt2.tokenizer, [PROMPT])
        enc.pop("position_ids")
        with torch.no_grad():
            gpt2.model.generate(**enc, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=gpt2.tokenizer.pad_token_id)
    finally:
        handle.remove()
    for ours, theirs in zip(got[h.id], seen, strict=True):
        assert_close(ours, theirs)
    assert max(widest) <= 3, widest  # the root and the step's one or two frames, never the spent ones
