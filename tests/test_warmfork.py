"""tests/support/warmfork.py: a reference run or an in-process daemon forked from the warm process
must be what `python SCRIPT ARGS` would have been, or the suite's comparisons would change meaning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import warmfork

PROBE = """
import atexit, json, os, sys, threading, time
import torch
report = {
    "argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "name": __name__,
    "ppid": os.getppid(), "flavour": os.environ.get("FLAVOUR"), "threads": torch.get_num_threads(),
    "stdin": sys.stdin.read(),
}
print(json.dumps(report))
print("to stderr", file=sys.stderr)
out = sys.argv[1]
atexit.register(lambda: open(out, "a").write("atexit\\n"))
def late():
    time.sleep(0.3)
    open(out, "a").write("thread\\n")
threading.Thread(target=late).start()
sys.exit(int(sys.argv[2]))
"""


@pytest.fixture(autouse=True)
def warm():
    state = warmfork._the_warm()
    if isinstance(state, warmfork._Warm) and state.started and state.proc.poll() is not None:
        # It started and has gone since (its reader may not have seen the end yet): every later reference
        # run and in-process daemon of this pytest process execs, the suite slower for it.
        pytest.fail(f"the warm process died (exit status {state.proc.returncode}); its output is in the log above")
    if not state.ready:  # the suite still runs, every subprocess exec'd (and slower)
        pytest.skip(f"no warm process here: {state.why}")
    return state


def _env(warm, **changes: str) -> dict[str, str]:
    """The warm process's own environment with `changes`: what these tests fork does not depend on what
    earlier tests of this pytest process left in os.environ (a child whose environment differs is
    exec'd, by design)."""
    return {**warm.env, **changes}


@pytest.fixture
def probe(tmp_path):
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    return str(script)


def test_a_forked_script_runs_as_python_would_run_it(warm, probe, tmp_path):
    marks = tmp_path / "marks"
    env = _env(warm, OMP_NUM_THREADS="1")
    argv = [sys.executable, probe, str(marks), "3"]
    refused = warm.why_not(argv, env)
    assert not refused, refused
    res = warmfork.run(argv, timeout=60, text=True, env=env, cwd=str(tmp_path))
    report = json.loads(res.stdout)
    assert res.returncode == 3
    assert res.stderr == "to stderr\n"
    assert report["argv"] == [probe, str(marks), "3"]
    assert report["cwd"] == str(tmp_path)
    assert report["path0"] == os.path.dirname(probe)
    assert report["name"] == "__main__"
    assert report["stdin"] == ""
    assert report["threads"] == 1  # OMP_NUM_THREADS applied after the fork
    assert report["ppid"] not in (os.getpid(), 1)  # forked: its parent is the warm process
    # A non-daemon thread finished and atexit ran, in that order, before the exit status was read.
    assert marks.read_text() == "thread\natexit\n"
    with pytest.raises(subprocess.CalledProcessError):
        warmfork.run([sys.executable, probe, str(marks), "4"], timeout=60, check=True, env=env)


def test_an_environment_read_at_import_time_is_not_forked_but_exec(warm, probe, tmp_path):
    env = _env(warm, FLAVOUR="changed")
    res = warmfork.run([sys.executable, probe, str(tmp_path / "m"), "0"], timeout=120, text=True, env=env)
    report = json.loads(res.stdout)
    assert res.returncode == 0
    assert report["flavour"] == "changed"
    assert report["ppid"] == os.getpid()  # exec'd by this process, as subprocess.run would


def test_a_signalled_child_reads_as_popen_reads_it(warm, tmp_path):
    script = tmp_path / "sleep.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    log = tmp_path / "log"
    argv, env = [sys.executable, str(script)], _env(warm)
    proc = warmfork.popen(argv, stdout=str(log), env=env)
    assert isinstance(proc, warmfork.Forked), warm.why_not(argv, env)
    deadline = time.monotonic() + 30
    while "up" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == -signal.SIGTERM
    assert proc.poll() == -signal.SIGTERM


def test_a_run_past_its_timeout_is_killed(warm, tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(600)\n")
    pidfile = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        warmfork.run([sys.executable, str(script), str(pidfile)], timeout=3, env=_env(warm))
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped by the warm process once killed
