"""A poor man's py-spy for the daemon and its workers (bench/profile_nnd.py puts this
folder on PYTHONPATH). When $NND_BENCH_SAMPLE_DIR is set, every Python process
started with it samples all its threads' stacks every ~1 ms and keeps writing
collapsed stacks ("file:line func;... count") to $NND_BENCH_SAMPLE_DIR/<pid>.txt,
after a first line "# ticks T seconds S" (the real sampling period is S/T).
Writing a new value into $NND_BENCH_SAMPLE_DIR/epoch starts the counts afresh.
Stacks whose innermost frame waits (threading, queue, selectors) are idle and not kept.
A sample is taken when the sampler gets the GIL, so samples gather where threads let it go (a
torch op that releases it, a wait): read shares between nnd's own lines with that in mind, and use
py-spy (which reads stacks without the GIL) for an unbiased profile.
"""

from __future__ import annotations

import collections
import faulthandler
import os
import threading
import time

_DIR = os.environ.get("NND_BENCH_SAMPLE_DIR")
_IDLE = ("threading.py", "queue.py", "selectors.py", "concurrent/futures/thread.py")


def _stacks(fd: int) -> list[list[str]]:
    """Every other thread's stack, outermost frame first, as "file:line function" strings.

    Read with faulthandler's C dump of all threads rather than by walking `f_back` from
    sys._current_frames(): that walk crashed the worker it sampled (SIGSEGV, after "'tuple' object has
    no attribute 'f_code'", CPython 3.11.7), materialising frame objects of threads that run on."""
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    faulthandler.dump_traceback(fd, all_threads=True)
    size = os.lseek(fd, 0, os.SEEK_CUR)
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, size).decode("utf-8", "replace")
    stacks: list[list[str]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("Current thread "):  # this sampler
            current = None
        elif line.startswith("Thread "):
            current = []
            stacks.append(current)
        elif current is not None and line.startswith('  File "'):
            path, _, rest = line[len('  File "') :].partition('", line ')
            lineno, _, function = rest.partition(" in ")
            current.append(f"{path}:{lineno} {function}")
    return [list(reversed(frames)) for frames in stacks if frames]


def _epoch(folder: str) -> str:
    try:
        with open(os.path.join(folder, "epoch")) as f:
            return f.read()
    except OSError:
        return ""


def _run(out: str, interval: float) -> None:
    fd = os.open(out + ".dump", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    os.unlink(out + ".dump")
    stacks: collections.Counter[str] = collections.Counter()
    epoch = _epoch(os.path.dirname(out))
    last_dump = started = time.monotonic()
    ticks = 0
    while True:
        time.sleep(interval)
        ticks += 1
        for frames in _stacks(fd):
            if frames[-1].partition(":")[0].endswith(_IDLE):
                continue
            stacks[";".join(frames)] += 1
        now = time.monotonic()
        if now - last_dump > 0.5:
            last_dump = now
            current = _epoch(os.path.dirname(out))
            if current != epoch:
                epoch, ticks, started = current, 0, now
                stacks.clear()
                continue
            tmp = out + ".tmp"
            with open(tmp, "w") as f:
                f.write(f"# ticks {ticks} seconds {now - started:.3f}\n")
                for stack, n in stacks.items():
                    f.write(f"{stack} {n}\n")
            os.replace(tmp, out)


if _DIR:
    threading.Thread(
        target=_run, args=(os.path.join(_DIR, f"{os.getpid()}.txt"), 0.001), name="nnd-bench-sampler", daemon=True
    ).start()
