"""Generation through the real daemon: streaming equals the unary result,
cancellation frees the worker, seeds repeat, limits are stated."""

from __future__ import annotations

import threading

import pytest
import torch

import nnd

PROMPT = "Hello world"


@pytest.fixture(scope="module")
def gpt2(daemon, tiny_models):
    model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu", dispatch=True)
    yield model
    model.release()


@pytest.fixture(scope="module")
def reference(tiny_models):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]).eval()


def test_per_step_edit_matches_hf_generate_with_a_hook(gpt2, reference):
    vector = 30 * torch.linspace(-1, 1, 64)
    with gpt2.generate(PROMPT, max_new_tokens=6) as tracer:
        for _ in tracer.iter[1:2]:
            gpt2.transformer.h[0].output[:, -1, :] += vector
        ids = tracer.result.save()

    calls = {"n": 0}

    def hook(module, args, output):
        if calls["n"] == 1:
            output[:, -1, :] += vector
        calls["n"] += 1
        return output

    enc = gpt2.tokenizer(PROMPT, return_tensors="pt")
    handle = reference.transformer.h[0].register_forward_hook(hook)
    try:
        with torch.no_grad():
            expected = reference.generate(**enc, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=1)
    finally:
        handle.remove()
    with gpt2.generate(PROMPT, max_new_tokens=6) as tracer:
        plain = tracer.result.save()
    assert ids.tolist() == expected.tolist()
    assert ids.tolist() != plain.tolist()  # the edit mattered


def test_per_step_saves_count_and_shapes(gpt2):
    with gpt2.generate(PROMPT, max_new_tokens=5) as tracer:
        saved = [].save()  # made in the block: saved, or its name does not outlive it (as in nnsight)
        for _ in tracer.iter[:]:  # the body runs once per step
            saved.append(gpt2.transformer.h[1].output.save())
    assert len(saved) == 5
    n = len(gpt2.tokenizer(PROMPT)["input_ids"])
    assert saved[0].shape == (1, n, 64)  # the prompt pass
    assert all(s.shape == (1, 1, 64) for s in saved[1:])  # one new position per step


def test_stream_equals_unary(gpt2):
    streamed = [t.id for t in gpt2.stream(PROMPT, max_new_tokens=8)]
    with gpt2.generate(PROMPT, max_new_tokens=8) as tracer:
        ids = tracer.result.save()
    n = len(gpt2.tokenizer(PROMPT)["input_ids"])
    assert streamed == ids[0, n:].tolist()


def test_seeded_sampling_repeats(gpt2):
    def sample(seed):
        with gpt2.generate(PROMPT, max_new_tokens=8, do_sample=True, temperature=1.5, seed=seed) as tracer:
            ids = tracer.result.save()
        return ids.tolist()

    assert sample(7) == sample(7)
    assert sample(7) != sample(8) or sample(7) != sample(9)


def test_a_closed_stream_leaves_the_model_serving(gpt2):
    # That the worker stops the generation at the next step is tests/process/test_fast_route.py's
    # (a 1000-step run, the worker's own log); here: the client's close leaves nothing stuck.
    it = gpt2.stream(PROMPT, max_new_tokens=120, min_new_tokens=120)
    next(it)
    it.close()  # cancels the call
    with gpt2.trace(PROMPT):
        out = gpt2.lm_head.output.save()
    assert out.shape[-1] == 320


def test_deadline_is_honoured(daemon, tiny_models):
    # llama: rotary positions, so a long generation is possible at all
    model = nnd.TransformersModel(tiny_models["llama"], address=daemon.address, device="cpu", dispatch=True)
    errors: list[BaseException] = []

    def run():
        try:
            for _ in model.stream(PROMPT, max_new_tokens=1000, min_new_tokens=1000, timeout=0.5):
                pass
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert errors and isinstance(errors[0], nnd.errors.DeadlineExceeded), errors
    with model.trace(PROMPT):  # the worker is free again
        out = model.lm_head.output.save()
    assert out.shape[-1] == 320
    model.release()


def test_max_new_tokens_over_the_cap_is_refused(gpt2):
    with pytest.raises(nnd.errors.LimitExceeded) as info:
        with gpt2.generate(PROMPT, max_new_tokens=100_000):
            pass
    assert "max_new_tokens" in str(info.value) and "1024" in str(info.value)


def test_cli_generate_prints_text(daemon, tiny_models):
    path = tiny_models["gpt2"]
    daemon.cli("load", path)
    out = daemon.cli("generate", path, PROMPT, "--max-new-tokens", "5").stdout
    assert out.startswith(PROMPT) and len(out.strip()) > len(PROMPT)


def test_cli_generate_refused_prints_no_prompt(daemon, tiny_models):
    """A refused generation is one error line, not the prompt echoed as if text were coming."""
    path = tiny_models["gpt2"]
    daemon.cli("load", path)
    res = daemon.cli("generate", path, PROMPT, "--max-new-tokens", "500", check=False)
    assert res.returncode == 1 and res.stdout == "" and "learned positions" in res.stderr, res


def test_min_new_tokens_outlasts_an_early_end_of_sequence(gpt2):
    with gpt2.generate(PROMPT, max_new_tokens=12, min_new_tokens=12) as tracer:
        ids = tracer.result.save()
    n = len(gpt2.tokenizer(PROMPT)["input_ids"])
    assert ids.shape[1] == n + 12


def test_generating_past_learned_positions_is_refused_up_front(gpt2):
    # the tiny GPT-2 has 128 learned positions
    with pytest.raises(nnd.errors.InvalidRequest) as info:
        with gpt2.generate(PROMPT, max_new_tokens=500):
            pass
    text = str(info.value)
    assert "128 learned positions" in text and "at most" in text


def _generation_on_the_wire(gpt2, monkeypatch, prompt, saves, **watch):
    """The message kinds a generation's answer came in, its saves (`saves(step)` per step) and ids."""
    from nnd.wire import _results

    kinds: list[str] = []
    real = _results.collect

    def counting(responses, **kw):
        def passing():
            for msg in responses:
                kinds.append(msg.WhichOneof("kind"))
                yield msg

        return real(passing(), **kw)

    monkeypatch.setattr(_results, "collect", counting)
    with gpt2.generate(prompt, max_new_tokens=6, min_new_tokens=6, **watch) as tracer:
        got = [].save()
        for step in tracer.iter[:]:
            got.append(saves(step))
        ids = tracer.result.save()
    monkeypatch.setattr(_results, "collect", real)
    return kinds, got, ids


def test_a_generation_no_one_watches_comes_as_one_message_with_the_same_numbers(gpt2, monkeypatch):
    def saves(step):
        return gpt2.transformer.h[0].output[:, -1].save()

    joined_kinds, joined, ids = _generation_on_the_wire(gpt2, monkeypatch, PROMPT, saves)
    live: list = []
    kinds, streamed, streamed_ids = _generation_on_the_wire(gpt2, monkeypatch, PROMPT, saves, on_token=live.append)
    assert joined_kinds == ["results"]  # steps, saves and the end: one message
    assert kinds.count("step") == 6 and len(live) == 6  # watched: each step as it comes
    assert ids.tolist() == streamed_ids.tolist() and ids.shape[-1] == len(gpt2.tokenizer(PROMPT)["input_ids"]) + 6
    assert len(joined) == len(streamed) == 6
    for a, b in zip(joined, streamed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_generation_too_big_for_one_message_streams_and_loses_nothing(gpt2, monkeypatch):
    prompt = " ".join(["Hello world"] * 14)  # about 100 tokens: 16 x 100 x 64 floats saved at the prompt's pass

    def saves(step):
        h = gpt2.transformer.h[0].output
        return [(h * k).save() for k in range(1, 17)]

    kinds, got, ids = _generation_on_the_wire(gpt2, monkeypatch, prompt, saves)
    live: list = []
    _, streamed, streamed_ids = _generation_on_the_wire(gpt2, monkeypatch, prompt, saves, on_token=live.append)
    assert "results" not in kinds and kinds.count("step") == 6 and kinds[-1] == "done"
    assert ids.tolist() == streamed_ids.tolist()
    assert got[0][0].shape[1] > 80
    for a, b in zip(got, streamed, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    torch.testing.assert_close(got[0][2], 3 * got[0][0])
    assert sum(x.numel() * 4 for x in got[0]) > 256 * 1024  # more than one message may hold
