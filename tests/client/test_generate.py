"""Generation: loop scopes, per-step saves, streamed tokens, model.stream()."""

from __future__ import annotations

import threading

import pytest
import torch
from fakedaemon import saves

from nnd.v1 import graph_pb2, nnd_pb2, values_pb2


def gen_reply(steps: int = 3):
    def reply(method, request):
        for s in range(steps):
            ids = [10 + s + i for i in range(len(request.invokes))]
            yield nnd_pb2.TraceResponse(step=nnd_pb2.StepTokens(step=s, ids=ids, text=[f"t{i}" for i in ids]))
        scoped = {n.id for n in request.graph.nodes if n.scope}
        for node in saves(request):
            if node in scoped:
                items = [values_pb2.Value(int=s) for s in range(steps)]
                value = values_pb2.Value(list=values_pb2.ValueList(items=items))
            else:
                value = values_pb2.Value(int=-1)
            yield nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=node, value=value))

    return reply


def last_generate(fake) -> nnd_pb2.TraceRequest:
    return [r for m, r in fake[0].requests if m == "Generate"][-1]


def test_iter_runs_the_body_once_per_step_each_pass_in_a_scope_of_its_step(model, fake):
    fake[0].reply = gen_reply()
    with model.generate("hi", max_new_tokens=3, do_sample=True, temperature=0.7, top_k=5, seed=1) as tracer:
        first = model.lm_head.output.argmax(-1).save()
        bodies = [].save()  # made in the block: saved, or its name does not outlive it (as in nnsight)
        per_step = [].save()
        for step in tracer.iter[1:3]:
            bodies.append(step)
            per_step.append(model.lm_head.output.argmax(-1).save())
            model.transformer.h[0].output[:] *= 0.5
        out = tracer.result.save()
    assert bodies == [1, 2]  # nnsight's semantics: the body runs per step, `step` is its number
    req = last_generate(fake)
    opts = req.generate
    assert (opts.max_new_tokens, opts.do_sample, opts.top_k, opts.seed) == (3, True, 5, 1)
    assert abs(opts.temperature - 0.7) < 1e-9
    g = req.graph
    assert [list(sc.steps.steps.steps) for sc in g.scopes] == [[1], [2]]  # one single-step scope per pass
    scopes = [n.scope for n in g.nodes]
    assert scopes[:3] == [0, 0, 0] and set(scopes[3:-3]) == {1, 2} and scopes[-2:] == [0, 0]
    assert all(n.module.call == 0 for n in g.nodes if n.WhichOneof("kind") == "module")
    # A pass's save is that step's value, not a list (the fake answers step lists [0, 1, 2] per scope).
    assert first == -1 and per_step == [0, 0] and out == -1
    assert [t.id for t in tracer.tokens] == [10, 11, 12] and tracer.tokens[0].text == "t10"


def test_step_selectors(model, fake):
    fake[0].reply = gen_reply()
    with model.generate("hi", max_new_tokens=3) as tracer:
        for _ in tracer.iter[:]:
            model.lm_head.output.save()
        for _ in tracer.iter[[0, 2]]:
            model.lm_head.output.save()
        with pytest.warns(FutureWarning, match="deprecated; use `for step in tracer.iter"):
            with tracer.all():  # nnsight's deprecated form: its body too runs once per step
                model.lm_head.output.save()
        for _ in tracer.iter[-1:]:
            model.lm_head.output.save()
    scopes = last_generate(fake).graph.scopes
    picked = [list(s.steps.steps.steps) if s.steps.HasField("steps") else "all" for s in scopes]
    assert picked == [[0], [1], [2], [0], [2], [0], [1], [2], [2]]


def test_with_form_without_source_records_its_body_once(model, fake):
    # Code whose source Python cannot show (built from a string): the body cannot be re-run per step,
    # so it runs once, as Python runs it, recorded into one scope the daemon runs at every step.
    fake[0].reply = gen_reply()
    namespace = {"model": model}
    code = (
        "with model.generate('hi', max_new_tokens=3) as tracer:\n"
        "    with tracer.iter[0:2]:\n"
        "        model.lm_head.output.save()\n"
    )
    with pytest.warns(FutureWarning):
        exec(compile(code, "<no source>", "exec"), namespace)  # noqa: S102 - the test's own literal
    scopes = last_generate(fake).graph.scopes
    assert [s.steps.WhichOneof("kind") for s in scopes] == ["range"]


def test_branching_on_a_step_number_is_plain_python(model, fake):
    fake[0].reply = gen_reply()
    with model.generate("hi", max_new_tokens=3) as tracer:
        for step in tracer.iter[:]:
            if step == 2:
                model.transformer.h[0].output[:] = 0
    g = last_generate(fake).graph
    sets = [n for n in g.nodes if n.WhichOneof("kind") == "op" and n.op.name == "setitem"]
    assert len(sets) == 1 and list(g.scopes[sets[0].scope - 1].steps.steps.steps) == [2]


def test_steps_the_generation_never_reached_warn(model, fake):
    fake[0].reply = gen_reply(steps=2)  # the generation stops after 2 of 4 steps
    with pytest.warns(UserWarning, match=r"step\(s\) \[2, 3\] of a `tracer.iter` loop were never reached"):
        with model.generate("hi", max_new_tokens=4) as tracer:
            for _ in tracer.iter[:]:
                model.lm_head.output.save()


def test_only_a_for_statement_over_the_steps_gets_the_pass_past_the_end(model, fake):
    # The pass past an open loop's end reruns the body of the `for` that asked for one more step; a loop
    # over a copy of the steps (its header consumed them all first) is not that loop, and runs as written.
    fake[0].reply = gen_reply()
    direct, copied = [], []
    with model.generate("hi", max_new_tokens=3) as tracer:
        for step in tracer.iter[:]:
            direct.append(step)
            model.lm_head.output.save()
        for step in list(tracer.iter[:]):
            copied.append(step)
            model.lm_head.output.save()
    assert direct == [0, 1, 2, 3] and copied == [0, 1, 2]


def test_stream_yields_tokens_and_cancels(model, fake):
    started = threading.Event()

    def reply(method, request):
        assert request.generate.stream_text and request.generate.max_new_tokens == 50
        for s in range(50):
            started.set()
            yield nnd_pb2.TraceResponse(step=nnd_pb2.StepTokens(step=s, ids=[s], text=[str(s)]))

    fake[0].reply = reply
    got = []
    it = model.stream("hi", max_new_tokens=50)
    for token in it:
        got.append((token.step, token.id, token.text))
        if len(got) == 2:
            break
    it.close()
    assert got == [(0, 0, "0"), (1, 1, "1")]
    assert fake[0].cancelled.wait(5)


def test_generated_ids_as_tensor(model, fake):
    def reply(method, request):
        for node in saves(request):
            ids = torch.tensor([[1, 2, 3]])
            t = values_pb2.Tensor(dtype=values_pb2.INT64, shape=[1, 3], data=ids.numpy().tobytes())
            yield nnd_pb2.TraceResponse(saved=nnd_pb2.Saved(node=node, value=values_pb2.Value(tensor=t)))

    fake[0].reply = reply
    with pytest.warns(FutureWarning, match=r"model.generator.output is deprecated; use tracer.result"):
        with model.generate("hi", max_new_tokens=3):
            out = model.generator.output.save()
    assert out.tolist() == [[1, 2, 3]]
    node = last_generate(fake).graph.nodes[0]
    assert node.module.point == graph_pb2.RESULT


def _parses(monkeypatch) -> list[str]:
    """Every parse of the caller's source from now on (the caches emptied first)."""
    from nnd.tracing import _blocknames, _pyast, _withbody

    for cache in (_pyast._trees, _withbody._statements, _withbody._codes, _blocknames._cache):
        cache.clear()
    seen: list[str] = []
    real = _pyast.parse

    def counted(source: str):
        seen.append(source)
        return real(source)

    monkeypatch.setattr(_pyast, "parse", counted)
    return seen


def test_a_loop_of_generations_reads_its_source_once(model, fake, monkeypatch):
    # A sweep over prompts opens the same block each time: finding its loop's body (for the pass past
    # the end, and the `with` form's per-step runs) parses the file once, not per block, and every
    # block still runs its body per step.
    fake[0].reply = gen_reply()
    parses = _parses(monkeypatch)
    runs = []
    for _ in range(3):
        direct = []
        with model.generate("hi", max_new_tokens=3) as tracer:
            for step in tracer.iter[:]:
                direct.append(step)
                model.lm_head.output.save()
            with pytest.warns(FutureWarning):
                with tracer.all():
                    model.lm_head.output.save()
        runs.append((direct, len(last_generate(fake).graph.scopes)))
    assert runs == [([0, 1, 2, 3], 6)] * 3  # a scope per step for each loop; the `for` runs once past the end
    assert len(parses) == 1


def test_a_changed_file_is_read_again(model, fake, monkeypatch, tmp_path):
    # The same file, rewritten between two imports of it (a script edited while the notebook runs):
    # each version's code finds its own body, not the first version's.
    import importlib.util
    import linecache

    fake[0].reply = gen_reply()
    parses = _parses(monkeypatch)
    path = tmp_path / "sweep.py"
    body = (
        "def run(model, seen):\n"
        "    with model.generate('hi', max_new_tokens=3) as tracer:\n"
        "        for step in tracer.iter[{steps}]:\n"
        "            seen.append(({tag!r}, step))\n"
    )
    got = []
    for tag, steps in (("first", ":"), ("first", ":"), ("second", "0:2")):
        path.write_text(body.format(tag=tag, steps=steps))
        linecache.checkcache(str(path))
        spec = importlib.util.spec_from_file_location("sweep", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        seen = []
        module.run(model, seen)
        got.append(seen)
    assert got[0] == got[1] == [("first", 0), ("first", 1), ("first", 2), ("first", 3)]
    assert got[2] == [("second", 0), ("second", 1)]
    assert len(parses) == 2  # one per version of the text
