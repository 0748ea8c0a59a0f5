"""Sync points against a real daemon: real values inside a block (Nnd.Interact).

Each test checks numbers against the same model run in-process with plain
torch hooks, so a value that came from the wrong place, or an edit that did
not apply after a sync, fails.
"""

from __future__ import annotations

import time

import numpy as np
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


def _outputs(reference, prompt, zero_layer=None):
    """Block outputs and logits of the in-process model; optionally zero one block's output."""
    got = {}
    handles = []
    for i, block in enumerate(reference.transformer.h):

        def hook(module, args, output, i=i):
            out = output[0] if isinstance(output, tuple) else output
            if i == zero_layer:
                out[:] = 0
            got[i] = out.clone()

        handles.append(block.register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = reference(**reference_tokens(reference, prompt)).logits
    finally:
        for h in handles:
            h.remove()
    return got, logits


def reference_tokens(reference, prompt):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reference.name_or_path)
    return tok(prompt, return_tensors="pt")


def test_item_tolist_and_numpy_are_real_values(gpt2, reference):
    expected, _ = _outputs(reference, PROMPT)
    with gpt2.trace(PROMPT) as tracer:
        h = gpt2.transformer.h[0].output
        # Real values made in the block outlive it saved, as in nnsight (nnsight.save / nnd.save).
        total = nnd.save(h.sum().item())
        first = nnd.save(h[0, 0, :3].tolist())
        arr = nnd.save(np.asarray(h[0, -1]))
    assert total == pytest.approx(expected[0].sum().item(), rel=1e-5)
    assert first == pytest.approx(expected[0][0, 0, :3].tolist(), rel=1e-5)
    assert isinstance(arr, np.ndarray) and np.allclose(arr, expected[0][0, -1].numpy(), atol=1e-6)
    assert tracer.backend.interaction is not None and tracer.backend.interaction.syncs == 3


def test_numbers_read_mid_block_are_torchs_own_in_value_and_type(gpt2, reference):
    # `.item()`, float(), int() and bool() of one-element values come over as numbers; each must be what
    # torch gives for the same tensor in-process, of the same Python type. More than one element fails
    # as torch fails, and the run goes on after Python caught it.
    expected, _ = _outputs(reference, PROMPT)
    h0 = expected[0]
    with gpt2.trace(PROMPT):
        h = gpt2.transformer.h[0].output
        got = nnd.save([
            h.sum().item(), h[0, -1].argmax().item(), (h.norm() > 0).item(), float(h.max()), int(h[0].argmin()),
            bool(h.mean() < 0), h.to(torch.bfloat16).sum().item(), h[0, 0, 0].double().item(),
        ])
        try:
            h[0, 0].item()
        except RuntimeError as exc:
            error = nnd.save(str(exc))
        after = gpt2.transformer.h[1].output.save()
    want = [
        h0.sum().item(), h0[0, -1].argmax().item(), (h0.norm() > 0).item(), float(h0.max()), int(h0[0].argmin()),
        bool(h0.mean() < 0), h0.to(torch.bfloat16).sum().item(), h0[0, 0, 0].double().item(),
    ]
    assert [type(v) for v in got] == [type(v) for v in want]
    assert [got[i] for i in (1, 2, 4, 5)] == [want[i] for i in (1, 2, 4, 5)]
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    assert got[3] == pytest.approx(want[3], rel=1e-5) and got[7] == pytest.approx(want[7], rel=1e-5)
    assert got[6] == pytest.approx(want[6], rel=1e-2)  # bf16: its own rounding of a float32 sum
    with pytest.raises(RuntimeError) as torchs:
        h0[0, 0].item()
    assert error == str(torchs.value)
    torch.testing.assert_close(after, expected[1], atol=1e-5, rtol=0)


def test_branch_on_a_value_then_edit_a_later_module(gpt2, reference):
    # The branch is taken (the norm is positive): the later block's output is zeroed, in the same forward.
    with gpt2.trace(PROMPT):
        if gpt2.transformer.h[0].output.norm() > 0:
            gpt2.transformer.h[1].output[:] = 0
        logits = gpt2.lm_head.output.save()
    _, want = _outputs(reference, PROMPT, zero_layer=1)
    _, plain = _outputs(reference, PROMPT)
    assert torch.allclose(logits, want, atol=1e-5)
    assert not torch.allclose(logits, plain, atol=1e-3)


def test_branch_not_taken_leaves_the_model_alone(gpt2, reference):
    with gpt2.trace(PROMPT):
        if gpt2.transformer.h[0].output.norm() < 0:
            gpt2.transformer.h[1].output[:] = 0
        logits = gpt2.lm_head.output.save()
    _, plain = _outputs(reference, PROMPT)
    assert torch.allclose(logits, plain, atol=1e-5)


def test_print_and_format_show_values(gpt2, reference, capsys):
    expected, _ = _outputs(reference, PROMPT)
    with gpt2.trace(PROMPT):
        s = gpt2.transformer.h[0].output.sum()
        print(s)
        text = nnd.save(f"{gpt2.transformer.h[0].output.sum():.3f}")
    assert text == f"{expected[0].sum().item():.3f}"
    assert capsys.readouterr().out.strip() == str(expected[0].sum())


def test_index_from_a_value(gpt2, reference):
    _, logits = _outputs(reference, PROMPT)
    top = int(logits[0, -1].argmax())
    with gpt2.trace(PROMPT):
        best = gpt2.lm_head.output[0, -1].argmax()
        row = nnd.save([0.0] * 100)
        row[best] = 1.0  # __index__
        picked = gpt2.lm_head.output[0, -1, best].save()
    assert row.index(1.0) == top
    assert float(picked) == pytest.approx(float(logits[0, -1, top]), rel=1e-5)


def test_out_of_order_after_a_sync_names_both_lines(gpt2):
    with pytest.raises(nnd.OutOfOrderError) as info:
        with gpt2.trace(PROMPT):
            late = gpt2.transformer.h[1].output.sum().item()  # the sync: paused after block 1
            gpt2.transformer.h[0].output[:] = late  # block 0 already ran
    text = str(info.value)
    assert "gpt2.transformer.h[0].output[:] = late" in text
    assert "gpt2.transformer.h[1].output.sum().item()" in text or "late = " in text


def test_model_is_free_after_a_failed_sync(gpt2, reference):
    with pytest.raises(nnd.OutOfOrderError):
        with gpt2.trace(PROMPT):
            gpt2.transformer.h[1].output.sum().item()
            gpt2.transformer.h[0].output.sum().item()
    with gpt2.trace(PROMPT):
        logits = gpt2.lm_head.output.save()
    _, plain = _outputs(reference, PROMPT)
    assert torch.allclose(logits, plain, atol=1e-5)


def test_an_exception_in_the_block_frees_the_paused_model(gpt2, reference):
    with pytest.raises(ZeroDivisionError):
        with gpt2.trace(PROMPT):
            gpt2.transformer.h[0].output.sum().item()
            raise ZeroDivisionError("the user's code failed while the run was paused")
    with gpt2.trace(PROMPT):  # would wait on the model lock if the paused run still held it
        logits = gpt2.lm_head.output.save()
    _, plain = _outputs(reference, PROMPT)
    assert torch.allclose(logits, plain, atol=1e-5)


def _hf_generate_layer0(reference, prompt, steps, edit=None):
    """Block 0's output at every generation step of the in-process model (greedy), with an optional per-step edit."""
    seen = []

    def hook(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        if edit is not None:
            edit(len(seen), out)
        seen.append(out.clone())

    handle = reference.transformer.h[0].register_forward_hook(hook)
    try:
        with torch.no_grad():
            ids = reference.generate(
                **reference_tokens(reference, prompt),
                max_new_tokens=steps,
                min_new_tokens=steps,
                do_sample=False,
                pad_token_id=1,
            )
    finally:
        handle.remove()
    return seen, ids


def test_loop_body_runs_per_step_and_appends_one_value_each(gpt2, reference):
    seen, ids = _hf_generate_layer0(reference, PROMPT, 3)
    hs = []
    bodies = []
    with gpt2.generate(PROMPT, max_new_tokens=3, min_new_tokens=3) as tracer:
        for step in tracer.iter[:]:
            bodies.append(step)
            hs.append(gpt2.transformer.h[0].output.save())
        out = tracer.result.save()
    # As nnsight 0.8.1: an open loop runs one more pass, cut at its first module access (so it appends
    # the step number but no value).
    assert bodies == [0, 1, 2, 3]
    assert len(hs) == 3
    for got, want in zip(hs, seen, strict=True):
        assert torch.allclose(got, want, atol=1e-5)
    assert out.tolist() == ids.tolist()


def test_a_generation_that_stops_early_leaves_only_its_steps_in_the_users_lists(gpt2):
    # nnsight runs the loop's Python for the steps made, plus one pass cut at its first module access
    # (whose streamer read holds the last token): nothing of the steps never made reaches the lists.
    with gpt2.generate(PROMPT, max_new_tokens=6, min_new_tokens=6, do_sample=False) as tracer:
        ids = tracer.result.save()
    prompt = ids.shape[1] - 6
    hs, streamed = [], []
    with pytest.warns(UserWarning, match="never reached"):
        with gpt2.generate(PROMPT, max_new_tokens=6, do_sample=False, eos_token_id=int(ids[0, prompt + 1])) as tracer:
            for _ in tracer.iter[:]:
                streamed.append(gpt2.generator.streamer.output)
                hs.append(gpt2.transformer.h[0].output[:, -1])
            out = tracer.result.save()
    made = out.shape[1] - prompt
    assert 1 <= made < 6
    assert len(hs) == made and all(isinstance(h, torch.Tensor) for h in hs)
    assert len(streamed) == made + 1 and streamed[0].shape == (1, prompt)
    assert [int(s) for s in streamed[1:]] == out[0, prompt:].tolist()


def test_per_step_condition_on_the_step_number(gpt2, reference):
    vector = 30 * torch.linspace(-1, 1, 64)

    def edit(step, out):
        if step == 1:
            out[:, -1, :] += vector

    _, want = _hf_generate_layer0(reference, PROMPT, 4, edit)
    with gpt2.generate(PROMPT, max_new_tokens=4, min_new_tokens=4) as tracer:
        for step in tracer.iter[:]:
            if step == 1:
                gpt2.transformer.h[0].output[:, -1, :] += vector
        ids = tracer.result.save()
    assert ids.tolist() == want.tolist()


def test_a_module_first_named_after_a_pause_binds_the_call_running_now(gpt2, reference):
    # Block 1 is named only at step 2, after that step's pause: its calls at steps 0 and 1 ran while
    # the graph did not name it, so only the worker's count of every module's calls says which call
    # is step 2's. The value must be step 2's output, not the first call's.
    with gpt2.generate(PROMPT, max_new_tokens=3, min_new_tokens=3) as tracer:
        for step in tracer.iter[:]:
            gpt2.transformer.h[0].output[:, -1].norm().item()
            if step == 2:
                late = gpt2.transformer.h[1].output.save()

    outs: list[torch.Tensor] = []

    def hook(module, args, output):
        outs.append((output[0] if isinstance(output, tuple) else output).clone())

    handle = reference.transformer.h[1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            reference.generate(
                **reference_tokens(reference, PROMPT),
                max_new_tokens=3,
                min_new_tokens=3,
                do_sample=False,
                pad_token_id=1,
            )
    finally:
        handle.remove()
    assert len(outs) == 3
    assert torch.allclose(late, outs[2], atol=1e-5)


def test_after_the_last_pause_a_module_whose_call_is_running_still_gives_its_output(gpt2, reference):
    # The pause is inside block 0, so the call of `transformer` (and of the model) began before the
    # block named them: their outputs come when those calls end, after the client's last message.
    with gpt2.trace(PROMPT):
        norm = nnd.save(gpt2.transformer.h[0].output.norm().item())
        hidden = gpt2.transformer.output[0].save()
        logits = gpt2.output.logits.save()
    with torch.no_grad():
        want = reference(**reference_tokens(reference, PROMPT), output_hidden_states=True)
    got, _ = _outputs(reference, PROMPT)
    assert norm == pytest.approx(got[0].norm().item(), rel=1e-5)
    torch.testing.assert_close(hidden, want.hidden_states[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, want.logits, atol=1e-5, rtol=0)


def test_sync_inside_a_generation_step_edits_that_step(gpt2, reference):
    # Per step: read block 0's norm (a sync, paused inside that step), zero block 1's output when it is
    # above the prompt step's norm. The decision is Python's, on real values, at every step.
    norms = []
    with gpt2.generate(PROMPT, max_new_tokens=3, min_new_tokens=3) as tracer:
        for step in tracer.iter[:]:
            norm = gpt2.transformer.h[0].output[:, -1].norm().item()
            norms.append(norm)
            if step > 0 and norm > norms[0]:
                gpt2.transformer.h[1].output[:] = 0
        ids = tracer.result.save()
    assert len(norms) == 3

    # The same decisions in-process, with hooks: the norms and the generated ids must match.
    ref_norms: list[float] = []

    def read(module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        ref_norms.append(out[:, -1].norm().item())

    def zero(module, args, output):
        step = len(ref_norms) - 1
        if step > 0 and ref_norms[step] > ref_norms[0]:
            out = output[0] if isinstance(output, tuple) else output
            out[:] = 0

    handles = [
        reference.transformer.h[0].register_forward_hook(read),
        reference.transformer.h[1].register_forward_hook(zero),
    ]
    try:
        with torch.no_grad():
            want = reference.generate(
                **reference_tokens(reference, PROMPT),
                max_new_tokens=3,
                min_new_tokens=3,
                do_sample=False,
                pad_token_id=1,
            )
    finally:
        for h in handles:
            h.remove()
    assert norms == pytest.approx(ref_norms, rel=1e-5)
    assert ids.tolist() == want.tolist()


def _until_no_requests(daemon, model, timeout: float = 120) -> None:
    """Until `nnd ps` shows no request running on `model` (its worker let go of the last one)."""
    import json

    deadline = time.monotonic() + timeout
    while True:
        entry = {m["name"]: m for m in json.loads(daemon.cli("ps", "--json").stdout)}[model.name]
        if not entry.get("requests"):
            return
        assert time.monotonic() < deadline, entry["requests"]
        time.sleep(0.1)


def test_a_pause_past_its_timeout_cancels_the_run_and_frees_the_model(gpt2, daemon, reference):
    with pytest.raises(nnd.DeadlineExceeded, match="paused at a sync point for more than 0.5 s"):
        with gpt2.trace(PROMPT, pause_timeout=0.5):
            gpt2.transformer.h[0].output.sum().item()  # the worker starts waiting for the next message here
            # The run is paused, so `nnd ps` lists it until the pause timeout ends it: the next
            # message is sent after that, however long the timeout took to fire on this box.
            _until_no_requests(daemon, gpt2)
            gpt2.transformer.h[1].output.sum().item()
    with gpt2.trace(PROMPT):
        logits = gpt2.lm_head.output.save()
    _, plain = _outputs(reference, PROMPT)
    assert torch.allclose(logits, plain, atol=1e-5)


def test_a_client_that_goes_away_while_paused_frees_the_model(gpt2, daemon, tiny_models, reference):
    # Another process pauses a run and is killed while paused; the model must serve the next request.
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        f"""
        import os, sys, nnd
        model = nnd.TransformersModel({tiny_models["gpt2"]!r}, address={daemon.address!r}, device="cpu")
        with model.trace({PROMPT!r}, pause_timeout=600):
            model.transformer.h[0].output.sum().item()
            print("paused", flush=True)
            sys.stdin.readline()  # held here until killed
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "paused"
    finally:
        proc.kill()
        proc.wait()
    with gpt2.trace(PROMPT, timeout=120):  # with the 600 s pause still holding the model, this would time out
        logits = gpt2.lm_head.output.save()
    _, plain = _outputs(reference, PROMPT)
    assert torch.allclose(logits, plain, atol=1e-5)


def test_syncs_go_to_the_worker_by_route_and_through_the_daemon_alike(gpt2, reference, monkeypatch):
    expected, _ = _outputs(reference, PROMPT)
    router = gpt2._conn.router
    before = router.direct_calls
    with gpt2.trace(PROMPT):
        direct = nnd.save(gpt2.transformer.h[0].output.sum().item())
    assert router.direct_calls == before + 1  # the Interact stream followed the route
    # A client that does not follow routes: the daemon passes the stream's bytes to the worker.
    monkeypatch.setattr(gpt2._conn, "direct", False)
    with gpt2.trace(PROMPT):
        relayed = nnd.save(gpt2.transformer.h[0].output.sum().item())
        if relayed > -1e9:
            gpt2.transformer.h[1].output[:] = 0
        logits = gpt2.lm_head.output.save()
    assert router.direct_calls == before + 1
    assert direct == pytest.approx(expected[0].sum().item(), rel=1e-5)
    assert relayed == pytest.approx(direct, rel=1e-6)
    _, want = _outputs(reference, PROMPT, zero_layer=1)
    assert torch.allclose(logits, want, atol=1e-5)


def test_a_paused_run_shows_in_ps_as_a_paused_trace(gpt2):
    from nnd.v1 import nnd_pb2

    def info():
        return gpt2._conn.call("GetModel", nnd_pb2.GetModelRequest(model=gpt2.name), timeout=60)

    with gpt2.trace(PROMPT):
        gpt2.transformer.h[0].output.sum().item()
        paused = nnd.save(info())  # asked while the run is paused here
    after = info()
    # Paused at a sync point (it holds the model while its client computes), with since when.
    assert [(r.kind, r.state) for r in paused.requests] == [("trace", "paused")]
    assert paused.requests[0].paused_since > 0
    assert paused.idle_s == 0  # busy: keep-alive counts a paused run as activity
    assert not after.requests


def test_syncs_inside_a_session(gpt2, reference):
    expected, plain = _outputs(reference, PROMPT)
    # Block 1 runs first when block 2 asks for a value; block 2 then sets block 1's output at the hook it is
    # paused at; block 3 goes with block 4's sync; block 5 with the session's end.
    with gpt2.session():
        with gpt2.trace(PROMPT):
            h0 = gpt2.transformer.h[0].output  # no save: a later block uses it
        with gpt2.trace(PROMPT):
            b = nnd.save(gpt2.transformer.h[1].output.sum().item())
            if b != 0:
                gpt2.transformer.h[1].output[:] = h0
            swapped = gpt2.lm_head.output.save()
        with gpt2.trace(PROMPT):
            c = gpt2.transformer.h[0].output.sum().save()
        with gpt2.trace(PROMPT):
            d = nnd.save(gpt2.transformer.h[1].output.norm().item())
        with gpt2.trace(PROMPT):
            e = gpt2.lm_head.output.save()
    assert b == pytest.approx(expected[1].sum().item(), rel=1e-5)
    assert float(c) == pytest.approx(expected[0].sum().item(), rel=1e-5)
    assert d == pytest.approx(expected[1].norm().item(), rel=1e-5)
    assert torch.allclose(e, plain, atol=1e-5)

    def swap(module, args, output):
        return (expected[0].clone(), *output[1:]) if isinstance(output, tuple) else expected[0].clone()

    handle = reference.transformer.h[1].register_forward_hook(swap)
    try:
        with torch.no_grad():
            want = reference(**reference_tokens(reference, PROMPT)).logits
    finally:
        handle.remove()
    assert torch.allclose(swapped, want, atol=1e-5)
    assert not torch.allclose(swapped, plain, atol=1e-3)


def test_a_failed_block_in_a_session_frees_the_paused_model(gpt2, reference):
    with pytest.raises(ZeroDivisionError):
        with gpt2.session():
            with gpt2.trace(PROMPT):
                gpt2.transformer.h[0].output.sum().item()
                raise ZeroDivisionError("the user's code failed while the session's run was paused")
    with gpt2.trace(PROMPT, timeout=120):
        logits = gpt2.lm_head.output.save()
    _, plain = _outputs(reference, PROMPT)
    assert torch.allclose(logits, plain, atol=1e-5)


def test_a_later_session_block_may_name_a_stored_edit_the_first_did_not(gpt2, reference):
    # The session's run starts at block 1's sync, before block 2 (on an edited handle) is recorded: the
    # edit block 2 names reaches the worker with block 2, not with the start of the stream.
    with gpt2.edit() as (_, edited):
        edited.transformer.h[1].output[:] = 0
    try:
        with gpt2.session():
            with gpt2.trace(PROMPT):
                a = nnd.save(gpt2.transformer.h[0].output.sum().item())
            with edited.trace(PROMPT):
                b = nnd.save(edited.transformer.h[1].output.sum().item())
                zeroed = edited.lm_head.output.save()
            with gpt2.trace(PROMPT):
                plain = gpt2.lm_head.output.save()
    finally:
        edited.clear_edits()
    expected, want_plain = _outputs(reference, PROMPT)
    _, want_zeroed = _outputs(reference, PROMPT, zero_layer=1)
    assert a == pytest.approx(expected[0].sum().item(), rel=1e-5)
    assert b == 0.0  # read after the edit ran at that hook
    assert torch.allclose(zeroed, want_zeroed, atol=1e-5)
    assert torch.allclose(plain, want_plain, atol=1e-5)
    assert not torch.allclose(zeroed, plain, atol=1e-3)
