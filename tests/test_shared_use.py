"""Notebooks sharing a daemon: streaming a steered generation, a steered handle's stream, what
`nnd ps` shows, and what the daemon's log says about requests that end early."""

from __future__ import annotations

import json

import pytest
import torch

import nnd

PROMPT = "The Eiffel Tower is in the city of"
N = 8


@pytest.fixture(scope="module")
def gpt2(daemon, tiny_models):
    model = nnd.TransformersModel(tiny_models["gpt2"], address=daemon.address, device="cpu", dispatch=True)
    yield model
    model.clear_edits()


def _steered(gpt2):
    vector = 40 * torch.linspace(-1, 1, 64)
    with gpt2.edit() as (_, edited):
        edited.transformer.h[0].output[:, -1, :] += vector
    return edited


def _new_ids(gpt2, tracer_result) -> list[int]:
    n = len(gpt2.tokenizer(PROMPT)["input_ids"])
    return torch.as_tensor(tracer_result)[0, n:].tolist()


def test_an_edited_handle_streams_what_it_generates(gpt2):
    edited = _steered(gpt2)
    with edited.generate(PROMPT, max_new_tokens=N) as tracer:
        steered = tracer.result.save()
    with gpt2.generate(PROMPT, max_new_tokens=N) as tracer:
        plain = tracer.result.save()
    assert _new_ids(gpt2, steered) != _new_ids(gpt2, plain)  # the steering changes the text
    assert [t.id for t in edited.stream(PROMPT, max_new_tokens=N)] == _new_ids(gpt2, steered)
    assert [t.id for t in gpt2.stream(PROMPT, max_new_tokens=N)] == _new_ids(gpt2, plain)


def test_a_generate_block_streams_its_tokens_live_with_its_interventions(gpt2):
    vector = 40 * torch.linspace(-1, 1, 64)
    seen: list[nnd.StepToken] = []
    with gpt2.generate(PROMPT, max_new_tokens=N, on_token=seen.append) as tracer:
        for _ in tracer.all():
            gpt2.transformer.h[0].output[:, -1, :] += vector
        ids = tracer.result.save()
        assert seen == []  # nothing runs while the block records
    assert [t.step for t in seen] == list(range(N))
    assert [t.id for t in seen] == _new_ids(gpt2, ids)
    assert all(isinstance(t.text, str) for t in seen)


def test_ps_shows_no_requests_and_a_true_idle_time_between_requests(daemon, gpt2):
    with gpt2.generate(PROMPT, max_new_tokens=N):
        pass
    model = {m["name"]: m for m in json.loads(daemon.cli("ps", "--json").stdout)}[gpt2.name]
    assert not model.get("requests")
    assert 0 < model["idle_s"] < 60


def test_a_failed_shape_query_does_not_spoil_its_block(gpt2):
    n = len(gpt2.tokenizer(PROMPT)["input_ids"])
    with gpt2.trace(PROMPT):
        with pytest.raises(Exception, match="never"):
            gpt2.transformer.h.output.shape  # a ModuleList never runs: no such value  # noqa: B018
        shape = nnd.save(gpt2.transformer.h[0].output.shape)  # later queries work
        logits = gpt2.lm_head.output.save()  # and so does the block
    assert tuple(shape) == (1, n, 64)
    assert tuple(logits.shape) == (1, n, 320)


def test_an_interrupt_reads_as_one_line_and_the_blocks_values_say_it_did_not_complete(daemon, gpt2):
    import _thread
    import signal
    import threading
    import time

    from nnd import ValueNotKnown

    reached: list[bool] = []

    def interrupt(token: nnd.StepToken) -> None:
        # The client calls this from its loop over the stream, in the main thread: the interrupt lands
        # there, while the client reads the run's answers, whatever the box's speed.
        if token.step == 1:
            reached.append(threading.current_thread() is threading.main_thread())
            _thread.interrupt_main()  # what Ctrl-C in a notebook does

    # Ctrl-C raises KeyboardInterrupt, as in a notebook's kernel. (An event loop an earlier test ran in
    # this process may have left a handler of its own, under which interrupt_main does nothing.)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt, match=r"cancelled after \d+ of 100 steps") as info:
            with gpt2.generate(PROMPT, max_new_tokens=100, min_new_tokens=100, on_token=interrupt) as tracer:
                ids = tracer.result.save()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert reached == [True]
    assert info.value.__suppress_context__  # no chained gRPC traceback under it
    with pytest.raises(ValueNotKnown, match="did not complete"):
        ids.value  # noqa: B018
    # The worker lets go of the model: nothing is left running for it.
    deadline = time.monotonic() + 30
    while True:
        model = {m["name"]: m for m in json.loads(daemon.cli("ps", "--json").stdout)}[gpt2.name]
        if not model.get("requests"):
            break
        assert time.monotonic() < deadline, model["requests"]
        time.sleep(0.1)
    with gpt2.trace(PROMPT):  # and the handle works as before
        out = gpt2.lm_head.output.save()
    assert out.shape[0] == 1
