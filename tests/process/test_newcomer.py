"""A newcomer's silent failures (issue #30), against a real daemon: a typo in a placement never takes a
working model down, a placement that leaves weights on meta or disk is refused with the figures,
max_new_tokens=0 is refused as transformers refuses it, and a missing local folder is said to be one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator

import pytest
from daemonproc import Daemon, start_daemon

import nnd


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Daemon]:
    d = start_daemon(tmp_path_factory.mktemp("newcomer"))
    yield d
    d.stop()


def _ps(d: Daemon) -> dict[str, dict]:
    return {m["name"]: m for m in json.loads(d.cli("ps", "--json").stdout)}


@pytest.fixture(scope="module")
def dispatched(served, tiny_models) -> str:
    path = tiny_models["gpt2"]
    served.cli("load", path)
    served.cli("dispatch", path, "--device", "cpu")
    return path


BAD_PLACEMENTS = [
    (("--device", "cdua"), "device", "cdua"),
    (("--dtype", "int4"), "dtype", "int4"),
    (("--device-map", "cdua"), "device_map", "cdua"),
    (("--max-memory", "gpu0=1GiB"), "max_memory", "gpu0"),
    (("--compute-dtype", "int4"), "compute_dtype", "int4"),
]


@pytest.mark.parametrize(("args", "field", "word"), BAD_PLACEMENTS, ids=[a[0][0] for a in BAD_PLACEMENTS])
def test_a_bad_placement_leaves_a_dispatched_model_as_it_was(served, dispatched, args, field, word):
    before = _ps(served)[dispatched]
    res = served.cli("dispatch", dispatched, *args, check=False)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert field in res.stderr and repr(word) in res.stderr, res.stderr
    after = _ps(served)[dispatched]
    assert after["state"] == "DISPATCHED"
    assert after["worker_pids"] == before["worker_pids"]  # the same worker: never released


def test_a_bad_placement_on_a_meta_model_starts_no_worker(served, tiny_models):
    path = tiny_models["llama"]
    served.cli("load", path)
    for args, field, word in BAD_PLACEMENTS:
        res = served.cli("dispatch", path, *args, check=False)
        assert res.returncode == 1 and field in res.stderr and repr(word) in res.stderr, (args, res.stderr)
        model = _ps(served)[path]
        assert model["state"] == "META" and not model.get("worker_pids"), (args, model)
    assert f"dispatch of {path} " not in served.log()  # no dispatch began (that line says a worker failed)


def test_max_memory_too_small_is_refused_with_figures_and_the_dispatch_kept(served, dispatched, tiny_models):
    before = _ps(served)[dispatched]
    res = served.cli("dispatch", dispatched, "--device-map", "auto", "--max-memory", "cpu=1KiB", check=False)
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "cpu=1KiB" in res.stderr and "MiB" in res.stderr and "meta" in res.stderr, res.stderr
    after = _ps(served)[dispatched]
    assert after["state"] == "DISPATCHED" and after["worker_pids"] == before["worker_pids"]
    # on a META model: refused the same way, and it stays META (never DISPATCHED with weights on meta)
    path = tiny_models["bert"]
    served.cli("load", path)
    res = served.cli("dispatch", path, "--device-map", "auto", "--max-memory", "cpu=1KiB", check=False)
    assert res.returncode == 1 and "cpu=1KiB" in res.stderr, res.stderr
    assert _ps(served)[path]["state"] == "META"


def test_the_worker_fails_a_load_that_leaves_weights_on_meta_or_disk(tiny_models):
    # The worker's own check (the daemon's max_memory estimate may pass a placement accelerate
    # still offloads): the same from_pretrained the worker runs, then its check.
    from transformers import AutoModelForCausalLM

    from nnd.v1 import nnd_pb2
    from nnd_daemon import errors
    from nnd_daemon.worker import loader

    placement = nnd_pb2.Placement(device_map="auto", max_memory={"cpu": "1KiB"})
    model = AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"], **loader.from_pretrained_kwargs(placement))
    with pytest.raises(errors.ResourceExhausted) as info:
        loader.check_resident(model, placement)
    text = str(info.value)
    assert "MiB" in text and "disk" in text and "max_memory cpu=1KiB" in text, text
    fits = nnd_pb2.Placement(device="cpu")
    loader.check_resident(AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"], device_map="cpu"), fits)


def test_max_new_tokens_zero_is_refused_as_transformers_refuses_it(served, dispatched):
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(dispatched)
    with pytest.raises(ValueError, match="max_new_tokens") as theirs:
        reference.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=0)
    model = nnd.TransformersModel(dispatched, address=served.address)
    with pytest.raises(ValueError) as ours:
        model.generate("Hello world", max_new_tokens=0)
    assert str(ours.value) == str(theirs.value)
    with pytest.raises(ValueError):
        with model.generate("Hello world", max_new_tokens=0):
            pass
    res = served.cli("generate", dispatched, "Hello world", "--max-new-tokens", "0", check=False)
    assert res.returncode == 2 and "at least 1" in res.stderr, res.stderr
    assert res.stdout == ""  # nothing generated, nothing echoed


@pytest.mark.parametrize("where", ["./no/such/dir", "/data/missing", "../no/such"])
def test_a_missing_local_folder_is_no_such_directory(served, where):
    res = served.cli("load", where, check=False)
    assert res.returncode == 1, res.stderr
    assert "no such directory" in res.stderr and where in res.stderr, res.stderr
    assert "repo id" not in res.stderr.lower().replace("a repo id such as", ""), res.stderr


STREAM = """
import os, signal, sys, threading, time
import nnd
model = nnd.TransformersModel(sys.argv[1], address=sys.argv[2])
worker, main = int(sys.argv[3]), threading.main_thread().ident
# As in a terminal: Ctrl-C raises KeyboardInterrupt. (A process started with SIGINT ignored, as
# pytest-xdist's workers pass it on, would otherwise never see it: Python keeps an inherited SIG_IGN.)
signal.signal(signal.SIGINT, signal.default_int_handler)


def waiting_for_a_token():
    # The main thread is in nnd's stream generator, blocked for the next message (in gRPC's call).
    frame = sys._current_frames()[main]
    if frame.f_code.co_name not in ("_consume_next_event", "wait"):
        return False
    while frame is not None and not (frame.f_code.co_name == "stream" and "nnd" in frame.f_code.co_filename):
        frame = frame.f_back
    return frame is not None


def ctrl_c():
    # Ctrl-C as a terminal sends it, while the loop waits for the next token: with the worker stopped no
    # new token can come, so once the main thread waits for one (twice in a row, the same token last:
    # any already on their way have been read) it stays there until the signal.
    # (On a loaded box the frame test can miss the moment; with the worker stopped, no token for 5 s also
    # means the loop waits for one: well inside the daemon's 30 s before it calls the worker hung.)
    last, since = steps[-1], time.monotonic()
    while True:
        seen = steps[-1]
        if seen != last:
            last, since = seen, time.monotonic()
        if waiting_for_a_token():
            time.sleep(0.02)
            if waiting_for_a_token() and steps[-1] == seen:
                break
        if time.monotonic() - since > 5:
            break
        time.sleep(0.001)
    # Under the parallel suite's load a first interrupt was seen to go unanswered for the 30 s until
    # the daemon killed the stopped worker; a terminal user presses Ctrl-C again, and so does this, but
    # only while the main thread still waits for a token: once it has taken the interrupt it is out of
    # that wait, and a second Ctrl-C during its handling would be a test artefact, however slow the box.
    while True:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(3)
        if not waiting_for_a_token():
            return


steps = [0]
try:
    for token in model.stream("Hello world", max_new_tokens=100, min_new_tokens=100):
        steps.append(token.step)
        if token.step == 1:
            os.kill(worker, signal.SIGSTOP)
            print("streaming", flush=True)
            threading.Thread(target=ctrl_c, daemon=True).start()
finally:
    try:
        os.kill(worker, signal.SIGCONT)
    except ProcessLookupError:
        pass
"""


def test_ctrl_c_during_stream_is_one_line(served, dispatched, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "stream.py"
    script.write_text(STREAM)
    worker = _ps(served)[dispatched]["worker_pids"][0]
    try:
        res = subprocess.run(
            [sys.executable, str(script), dispatched, served.address, str(worker)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)  # whatever became of the script
    assert res.stdout.startswith("streaming"), (res.stdout, res.stderr)
    err = res.stderr
    assert res.returncode != 0 and "KeyboardInterrupt: nnd: interrupted: cancelled after" in err, err
    assert "of 100 steps" in err, err
    assert "grpc" not in err and "threading" not in err and "During handling" not in err, err
    assert len(err.splitlines()) <= 8, err
