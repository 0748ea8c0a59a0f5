"""A poor man's py-spy for the daemon and its workers (bench/profile_nnd.py puts this
folder on PYTHONPATH). When $NND_BENCH_SAMPLE_DIR is set, every Python process
started with it samples all its threads' stacks every ~1 ms and keeps writing
collapsed stacks ("file:line func;... count") to $NND_BENCH_SAMPLE_DIR/<pid>.txt,
after a first line "# ticks T seconds S" (the real sampling period is S/T).
Writing a new value into $NND_BENCH_SAMPLE_DIR/epoch starts the counts afresh.
Stacks whose innermost frame waits (threading, queue, selectors) are idle and not kept.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time

_DIR = os.environ.get("NND_BENCH_SAMPLE_DIR")
_IDLE = ("threading.py", "queue.py", "selectors.py", "concurrent/futures/thread.py")


def _frame_key(frame) -> str:  # noqa: ANN001
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} {code.co_name}"


def _epoch(folder: str) -> str:
    try:
        with open(os.path.join(folder, "epoch")) as f:
            return f.read()
    except OSError:
        return ""


def _run(out: str, interval: float) -> None:
    me = threading.get_ident()
    stacks: collections.Counter[str] = collections.Counter()
    epoch = _epoch(os.path.dirname(out))
    last_dump = started = time.monotonic()
    ticks = 0
    while True:
        time.sleep(interval)
        ticks += 1
        for ident, frame in sys._current_frames().items():
            if ident == me or frame is None:
                continue
            if frame.f_code.co_filename.endswith(_IDLE):
                continue
            names = []
            while frame is not None:
                names.append(_frame_key(frame))
                frame = frame.f_back
            stacks[";".join(reversed(names))] += 1
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
