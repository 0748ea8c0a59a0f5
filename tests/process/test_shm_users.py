"""Shared memory on a lab box: the daemon (and so its worker) runs as one user, the client as
another in the socket's group, as with the systemd unit. Needs root, to run processes as other uids.

`shm=True` results equal the streamed ones and come through the client's region;
nobody else can read that region: not a user outside the group (who cannot
even reach it), not a user in the group (who cannot list the directory, so
cannot find it, nor read it), not the daemon's user (who writes results
without being able to read them).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator

import pytest
from daemonproc import Daemon, start_daemon

LAB = 4100  # the daemon's group, which owns the socket
DAEMON, CLIENT, OUTSIDER, PEER = 4101, 4102, 4103, 4104  # PEER: another user in the group


def _as(uid: int, *groups: int, python: bool = False) -> tuple[str, ...]:
    """Run as `uid` (primary group: the first of `groups`). `python`: keep CAP_DAC_READ_SEARCH, which
    reads (never writes) any file: only so that the other uid can read the Python installation, which on
    a test machine may sit in root's home. Write access, the socket included, is the uid's own."""
    gid = groups[0] if groups else uid
    extra = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
    caps = ("--inh-caps=-all,+dac_read_search", "--ambient-caps=+dac_read_search") if python else ("--inh-caps=-all",)
    return ("setpriv", f"--reuid={uid}", f"--regid={gid}", extra, *caps)


def _setuid_works() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run processes as other uids"
    if shutil.which("setpriv") is None:
        return "needs setpriv (util-linux)"
    try:
        probe = [*_as(OUTSIDER, python=True), sys.executable, "-c", "import grpc, torch"]
        ok = subprocess.run(probe, capture_output=True, timeout=120).returncode == 0
    except OSError:
        ok = False
    return None if ok else "this machine forbids running Python as another uid (setpriv failed)"


pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs Linux /dev/shm")


@pytest.fixture(scope="module")
def lab(tiny_models: dict[str, str]) -> Iterator[tuple[Daemon, str, pathlib.Path]]:
    """A daemon running as DAEMON:LAB, a copy of the tiny gpt2 every user can read, and homes."""
    why = _setuid_works()
    if why:
        pytest.skip(why)
    base = pathlib.Path(tempfile.mkdtemp(prefix="nnd-users-"))
    try:
        base.chmod(0o755)
        model = str(shutil.copytree(tiny_models["gpt2"], base / "gpt2"))
        for uid in (DAEMON, CLIENT, OUTSIDER, PEER):
            home = base / f"home{uid}"
            home.mkdir()
            os.chown(home, uid, LAB if uid == DAEMON else uid)
        served = base / f"home{DAEMON}"
        served.chmod(0o750)  # the socket's directory is reached through it by LAB only
        env = {"HOME": str(served), "HF_HOME": str(served / "hf"), "XDG_CACHE_HOME": str(served / "cache")}
        d = start_daemon(served, prefix=_as(DAEMON, LAB, python=True), env=env, state_dir=str(served / "state"))
        yield d, model, base
        d.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


CLIENT_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import nnd
    from nnd.wire import _shm
    address, path = sys.argv[1:3]
    model = nnd.TransformersModel(path, address=address, device="cpu", dispatch=True)

    def run(shm):
        with model.trace("hello world", shm=shm):
            h = model.transformer.h[0].output
            big = h.expand(600, -1, -1).contiguous().save()
            half = h.to(torch.bfloat16).expand(600, -1, -1).contiguous().save()
        return big, half

    want = run(False)
    run(True)  # learns the size: streamed
    got = run(True)  # into a region
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(want, got)), "shm results differ"
    pool = _shm.pool()
    leased = [r for r in pool.regions.values() if r not in pool.free]
    assert len(leased) == 1, pool.regions  # `got` lives in it
    region = leased[0]
    print(region.path, flush=True)
    sys.stdin.read()  # results kept alive until the test closes stdin
    assert torch.equal(got[0], want[0])  # nobody wrote into it meanwhile
    print("ok", flush=True)
    """
)

# What a user can do to a region at `$1`: list its directory, read it, open it for writing (appending nothing).
PROBES = {
    "list": 'ls "$(dirname "$1")"',
    "read": 'head -c1 "$1"',
    "write": 'exec 3>>"$1"',
}


def _probe(uid: int, path: str, *groups: int) -> dict[str, str]:
    """Plain shell tools, without any capability: what this uid itself may do."""
    out = {}
    for what, script in PROBES.items():
        res = subprocess.run(
            [*_as(uid, *groups), "sh", "-c", script, "sh", path], capture_output=True, text=True, timeout=60
        )
        assert res.returncode == 0 or "Permission denied" in res.stderr, res.stderr
        out[what] = "allowed" if res.returncode == 0 else "denied"
    return out


def test_results_reach_a_client_of_another_user_and_no_one_else(lab: tuple[Daemon, str, pathlib.Path]) -> None:
    d, model, base = lab
    home = base / f"home{CLIENT}"
    client = subprocess.Popen(
        [*_as(CLIENT, CLIENT, LAB, python=True), sys.executable, "-c", CLIENT_SCRIPT, d.address, model],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HOME": str(home), "HF_HOME": str(home / "hf")},
    )
    try:
        assert client.stdout is not None
        path = client.stdout.readline().strip()
        assert path.startswith("/dev/shm/nnd-c"), client.stderr.read() if client.stderr else ""
        st, dst = os.stat(path), os.stat(os.path.dirname(path))
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (CLIENT, LAB, 0o620)
        assert (dst.st_uid, dst.st_gid, dst.st_mode & 0o777) == (CLIENT, LAB, 0o710)
        # Outside the group: cannot even reach it.
        assert _probe(OUTSIDER, path) == {"list": "denied", "read": "denied", "write": "denied"}
        # In the group: cannot find it (no listing), nor read it.
        peer = _probe(PEER, path, PEER, LAB)
        assert peer["list"] == "denied" and peer["read"] == "denied"
        # The daemon's user writes results, and cannot read them.
        assert _probe(DAEMON, path, LAB) == {"list": "denied", "read": "denied", "write": "allowed"}
        out, err = client.communicate("", timeout=120)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert client.returncode == 0 and out.strip() == "ok", err
    assert not os.path.exists(os.path.dirname(path))  # removed at the client's exit
