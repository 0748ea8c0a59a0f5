"""Helper fairness (issue #26): a cheap helper call (Tokenize, Decode) never queues behind an
expensive one (a Scan, a meta build) another client shaped, against a real daemon.

The expensive call is made to last as long as the test needs by stopping the heavy helper process
(SIGSTOP) while it runs: the interleaving is forced, not timed."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import threading

import grpc
import psutil
import pytest
from daemonproc import start_daemon

import nnd
from nnd.v1 import nnd_pb2, nnd_pb2_grpc

PROMPT = "Hello world"


def _helpers(daemon) -> dict[str, psutil.Process]:
    out = {}
    for p in psutil.Process(daemon.proc.pid).children(recursive=True):  # forked: the fork server's children
        cmd = p.cmdline()
        if "nnd_daemon.helper" in cmd:
            sock = cmd[cmd.index("--socket") + 1]
            out[os.path.basename(sock)] = p
    return out


def test_tokenize_and_decode_answer_while_a_scan_holds_the_heavy_helper(fresh_daemon, tiny_models):
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(tiny_models["gpt2"])(PROMPT)["input_ids"]
    model = nnd.TransformersModel(tiny_models["gpt2"], address=fresh_daemon.address, device="cpu")
    stub = nnd_pb2_grpc.NndStub(grpc.insecure_channel(fresh_daemon.address))
    stub.Tokenize(nnd_pb2.TokenizeRequest(model=model.name, texts=[PROMPT]), timeout=120)  # both lanes up
    helpers = _helpers(fresh_daemon)
    assert set(helpers) == {"helper.sock", "helper-light.sock"}
    heavy = helpers["helper.sock"]
    scanned = []

    def scan():
        with model.scan(PROMPT):
            shape = nnd.save(model.transformer.h[0].output.shape)
        scanned.append(tuple(shape))

    heavy.send_signal(signal.SIGSTOP)
    try:
        scanner = threading.Thread(target=scan, daemon=True)
        scanner.start()
        while heavy.status() != psutil.STATUS_STOPPED:
            threading.Event().wait(0.01)
        # The Scan is on its way to (or waiting in) the stopped heavy helper; the bystander's cheap calls are not.
        threading.Event().wait(0.5)
        got = stub.Tokenize(nnd_pb2.TokenizeRequest(model=model.name, texts=[PROMPT]), timeout=30)
        assert list(got.ids[0].ids) == want
        text = stub.Decode(nnd_pb2.DecodeRequest(model=model.name, ids=[nnd_pb2.TokenIds(ids=want)]), timeout=30)
        assert text.texts == [PROMPT]
        assert scanner.is_alive()  # the Scan really was held meanwhile
    finally:
        heavy.send_signal(signal.SIGCONT)
    scanner.join(120)
    assert scanned and scanned[0][-1] == 64


def test_the_helpers_memory_bound_is_what_calls_add_to_what_its_imports_mapped(tmp_path, tiny_models):
    """`--helper-memory` below the address space torch's import maps by itself (a CUDA build maps several
    GB, this CPU build ~0.9-1.1 GB): the helper still starts and builds models, bounded at what it mapped at
    start plus the bound. As an absolute RLIMIT_AS it killed the helper at its start (SIGABRT, or no
    thread could start), so no model could load. 512 MiB: with glibc's default of an arena per thread
    (64 MiB of address space each) a serving thread could not start under it and the helper answered nothing."""
    d = start_daemon(tmp_path, "--helper-memory", "512MiB")
    try:
        model = nnd.TransformersModel(tiny_models["gpt2"], address=d.address, device="cpu")  # a meta build
        assert "GPT2MLP" in repr(model.transformer.h[0])
        log = (pathlib.Path(d.state_dir) / "logs" / "helper.log").read_text()
        found = re.search(r"address space bounded at (\d+) MiB \((\d+) MiB mapped at start \+ (\d+) MiB", log)
        assert found, log
        bound, mapped, calls = map(int, found.groups())
        assert calls == 512 and bound == mapped + calls, found.group(0)
        # What the helper maps now, serving, is more than the bound alone: as an absolute RLIMIT_AS the bound
        # could not have held it (torch's import alone maps ~0.9-1.1 GB of a CPU build, threads and arenas more).
        status = pathlib.Path(f"/proc/{_helpers(d)['helper.sock'].pid}/status").read_text()
        (vm,) = [int(line.split()[1]) << 10 for line in status.splitlines() if line.startswith("VmSize:")]
        assert vm > calls << 20, f"the helper maps {vm >> 20} MiB, less than the bound: this no longer shows the fix"
        (limits,) = [
            line for line in pathlib.Path(f"/proc/{_helpers(d)['helper.sock'].pid}/limits").read_text().splitlines()
            if line.startswith("Max address space")
        ]
        assert int(limits.split()[3]) >> 20 == bound, limits
    finally:
        d.stop()


def test_a_helper_bound_too_small_to_start_says_so(tmp_path, tiny_models):
    """A `--helper-memory` that leaves the helper no room for its threads: it aborts at its start, and the
    request that needed it fails saying which setting to raise (before: "exited at start: killed by
    SIGABRT", nothing about why)."""
    d = start_daemon(tmp_path, "--helper-memory", "16MiB", ready="health")  # GetServerInfo needs the helper
    try:
        with pytest.raises(nnd.NndError) as caught:
            nnd.TransformersModel(tiny_models["gpt2"], address=d.address, device="cpu")  # a meta build: the helper's
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION, caught.value
        assert "--helper-memory" in str(caught.value) and "16 MiB" in str(caught.value), caught.value
        # Later calls get the same answer at once: no helper is started again for each (each aborted after ~10 s).
        stub = nnd_pb2_grpc.NndStub(grpc.insecure_channel(d.address))
        with pytest.raises(grpc.RpcError) as again:
            stub.GetServerInfo(nnd_pb2.GetServerInfoRequest(), timeout=5)
        assert again.value.code() == grpc.StatusCode.FAILED_PRECONDITION, again.value
        log = pathlib.Path(d.log_path).read_text()
        assert log.count("starting a new helper process") <= 1, log
    finally:
        d.stop()
