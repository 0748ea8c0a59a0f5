"""Recycled memory for big results: the pages of the last one dropped, instead of fresh ones.

A copy into fresh pages runs at a fraction of memcpy speed (a page fault per 4 KiB: ~200 ms for 256
MiB here, against ~30 ms into pages already touched); a loop of traces with results of the same size
reuses the pages of the last one it dropped instead. A buffer given back is marked MADV_FREE where the
kernel has it: kept while memory is plentiful, reclaimed (without swapping) when it is not, so the
pool costs the machine nothing it needs.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref

import numpy as np

KEEP = 1  # free buffers kept per pool: enough for `x = trace()` in a loop (the old x dies after the new one is made)
MAX_BYTES = 2**30  # bigger buffers are not kept


class WarmBuffers:
    """Buffers of whole pages, each given back once the last array viewing it is garbage."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a collection may run give_back while take holds it
        self.free: list[mmap.mmap] = []

    def take(self, nbytes: int) -> np.ndarray:
        """`nbytes` of memory (not zeroed: the caller writes every byte before reading any)."""
        size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        mm = None
        with self.lock:
            for i, cand in enumerate(self.free):
                if len(cand) == size:
                    mm = self.free.pop(i)
                    break
        if mm is None:
            mm = mmap.mmap(-1, size)  # anonymous, untouched: no zero-filling pass (bytearray(n) makes one)
        # Every array handed out is a view of `holder` (numpy keeps it as their base): its finalizer runs
        # exactly when the last of them is gone.
        holder = np.frombuffer(mm, dtype=np.uint8)
        weakref.finalize(holder, self.give_back, mm)
        return holder[:nbytes]

    def give_back(self, mm: mmap.mmap) -> None:
        with self.lock:
            if len(self.free) < KEEP and len(mm) <= MAX_BYTES:
                with contextlib.suppress(AttributeError, OSError):  # no MADV_FREE here: kept as it is
                    mm.madvise(mmap.MADV_FREE)
                self.free.append(mm)
