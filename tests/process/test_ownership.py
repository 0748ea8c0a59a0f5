"""Ownership on a shared box: the daemon runs as one user, two lab users share it (issue #29,
and issue #26's release-under-a-running-request finding). Needs root, to run processes as
other uids (as tests/test_shm_users.py).

A second user cannot release the first user's busy model without `--force`; with it, the
first user's running generation ends with an error naming who released the model and when,
the daemon logs both users, and `nnd ps` names the user who dispatched it. Users are those the
kernel reports for the socket's peer (SO_PEERCRED), not names a client claims.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator

import pytest
from daemonproc import Daemon, start_daemon
from test_shm_users import _as, _setuid_works

LAB = 4100
DAEMON, ALICE, BOB = 4201, 4202, 4203  # no passwd entries: the daemon names them "uid N"


@pytest.fixture(scope="module")
def shared_box() -> Iterator[tuple[Daemon, str, pathlib.Path]]:
    why = _setuid_works()
    if why:
        pytest.skip(why)
    import tinymodels
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    base = pathlib.Path(tempfile.mkdtemp(prefix="nnd-owners-"))
    try:
        base.chmod(0o755)
        # Long enough generations (1024 positions) to act while one runs.
        model = tinymodels.build("gpt2", base / "gpt2")
        cfg = GPT2Config.from_pretrained(model)
        cfg.n_positions, cfg.n_layer = 1024, 4
        torch.manual_seed(0)
        GPT2LMHeadModel(cfg).eval().save_pretrained(model)
        for uid in (DAEMON, ALICE, BOB):
            home = base / f"home{uid}"
            home.mkdir()
            os.chown(home, uid, LAB if uid == DAEMON else uid)
        served = base / f"home{DAEMON}"
        served.chmod(0o750)
        env = {"HOME": str(served), "HF_HOME": str(served / "hf"), "XDG_CACHE_HOME": str(served / "cache")}
        d = start_daemon(served, "--watchdog-interval", "0", prefix=_as(DAEMON, LAB, python=True), env=env,
                         state_dir=str(served / "state"))
        yield d, str(model), base
        d.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


GENERATE = textwrap.dedent(
    """
    import sys
    from nnd.wire.connection import Connection
    from nnd.v1 import nnd_pb2
    address, path = sys.argv[1:3]
    conn = Connection(address)
    conn.call("LoadModel", nnd_pb2.LoadModelRequest(model=path))
    for _ in conn.stream("Dispatch", nnd_pb2.DispatchRequest(model=path)):
        pass
    ids = [nnd_pb2.Invoke(tokens=nnd_pb2.TokenIds(ids=[(7 * j + 13 * k) % 300 + 5 for j in range(8)])) for k in range(16)]
    options = nnd_pb2.GenerateOptions(max_new_tokens=1000, do_sample=True, seed=1)
    steps = conn.stream("Generate", nnd_pb2.TraceRequest(model=path, invokes=ids, generate=options), timeout=300)
    next(steps)
    print("running", flush=True)
    try:
        for _ in steps:
            pass
        print("finished", flush=True)
    except Exception as exc:
        print("ERROR", type(exc).__name__, exc, flush=True)
    """
)


def _cli(d: Daemon, uid: int, base: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    home = base / f"home{uid}"
    cmd = [*_as(uid, uid, LAB, python=True), sys.executable, "-m", "nnd.cli", *args, "--address", d.address]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": str(home)})


def _wait_log(d: Daemon, text: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while text not in d.log():
        if time.monotonic() > deadline:
            raise AssertionError(f"no log line with {text!r}:\n{d.log()[-3000:]}")
        time.sleep(0.1)


def test_another_user_cannot_release_a_busy_model_without_force_and_the_owner_learns_who(shared_box):
    d, model, base = shared_box
    alice = subprocess.Popen(
        [*_as(ALICE, ALICE, LAB, python=True), sys.executable, "-c", GENERATE, d.address, model],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HOME": str(base / f"home{ALICE}")},
    )
    try:
        assert alice.stdout is not None
        line = alice.stdout.readline().strip()
        assert line == "running", (line, alice.stderr.read() if alice.stderr else "")
        _wait_log(d, f"dispatched {model} on")
        assert f"for uid {ALICE} in" in d.log()

        ps = _cli(d, BOB, base, "ps")
        assert ps.returncode == 0, ps.stderr
        row = next(r for r in ps.stdout.splitlines() if r.startswith(model))
        assert f"uid {ALICE}" in row  # USER: who dispatched it
        assert any(f"uid {ALICE}" in r and "generate" in r for r in ps.stdout.splitlines()[1:])  # the request's user

        refused = _cli(d, BOB, base, "release", model)
        assert refused.returncode == 1
        assert f"dispatched by uid {ALICE}" in refused.stderr and "request(s) run or wait" in refused.stderr
        assert "--force" in refused.stderr
        assert _cli(d, BOB, base, "unload", model).returncode == 1  # the same rule for unload
        assert alice.poll() is None  # nothing happened to alice's generation

        forced = _cli(d, BOB, base, "release", "--force", model)
        assert forced.returncode == 0, forced.stderr
        out, err = alice.communicate(timeout=60)
        assert out.startswith("ERROR DaemonUnavailable"), (out, err)
        assert f"was released by uid {BOB} at" in out and "while running this request" in out
        assert "Cancelling all calls" not in out
        _wait_log(d, f"release of {model} forced by uid {BOB}: it was dispatched by uid {ALICE}")
        _wait_log(d, f"released {model} for uid {BOB} (dispatched by uid {ALICE})")
    finally:
        if alice.poll() is None:
            alice.kill()
            alice.wait()


def test_an_idle_model_is_released_by_its_own_user_but_not_by_another(shared_box):
    d, model, base = shared_box
    res = _cli(d, ALICE, base, "load", model, "--dispatch")
    assert res.returncode == 0, res.stderr
    other = _cli(d, BOB, base, "release", model)
    assert other.returncode == 1 and f"dispatched by uid {ALICE}" in other.stderr
    assert "request(s) run" not in other.stderr  # idle: only ownership stands in the way
    own = _cli(d, ALICE, base, "release", model)
    assert own.returncode == 0, own.stderr
    _wait_log(d, f"released {model} for uid {ALICE} (dispatched by uid {ALICE})")


def test_another_placement_for_a_model_another_user_dispatched_says_what_is_dispatched(shared_box):
    # Issue #30: bob asking for float16 re-dispatched alice's model under her (or, for tp_size=2 on a
    # model dispatched as nf4, blamed a dtype bob never asked for); now he is told what is dispatched,
    # by whom, and his choices, and her worker keeps running.
    import json

    d, model, base = shared_box
    res = _cli(d, ALICE, base, "load", model, "--dispatch", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    before = {m["name"]: m for m in json.loads(_cli(d, ALICE, base, "ps", "--json").stdout)}[model]
    asked = _cli(d, BOB, base, "dispatch", model, "--dtype", "float16")
    assert asked.returncode == 1, (asked.stdout, asked.stderr)
    msg = asked.stderr
    assert "already dispatched with device=cpu" in msg and f"by uid {ALICE}" in msg, msg
    assert "asks for dtype=float16" in msg, msg
    assert "use it as it is" in msg and f"nnd release {model}" in msg and "--force" in msg, msg
    assert "another folder" in msg, msg
    after = {m["name"]: m for m in json.loads(_cli(d, ALICE, base, "ps", "--json").stdout)}[model]
    assert after["state"] == "DISPATCHED" and after["worker_pids"] == before["worker_pids"]
    # the same placement (or none) is simply the model as it is
    assert _cli(d, BOB, base, "dispatch", model, "--device", "cpu").returncode == 0
    assert _cli(d, ALICE, base, "release", model).returncode == 0
