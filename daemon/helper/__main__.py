"""Helper process entry: `python -I -m nnd_daemon.helper --socket PATH`.

Started and supervised by the daemon (control/helper_supervisor.py), never by hand. It
does the work whose cost a client shapes, under an address-space limit
(RLIMIT_AS, set here) and a per-call CPU-time bound (the daemon's watchdog), so
that work can fail, or kill this process, but never the daemon.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import signal
from concurrent import futures

import grpc

from nnd.v1 import contract
from nnd_daemon import errors, parentwatch


def main() -> None:
    parser = argparse.ArgumentParser(prog="nnd-helper", description=__doc__)
    parser.add_argument("--socket", required=True, help="unix socket to serve on")
    parser.add_argument("--parent", type=int, default=0, help="daemon pid; the helper dies with it")
    parser.add_argument("--memory-bytes", type=int, default=0, help="RLIMIT_AS in bytes (0: none)")
    parser.add_argument("--cache", type=int, default=8, help="META models kept (least recently used go first)")
    ns = parser.parse_args()
    parentwatch.die_with_parent(ns.parent)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s helper %(levelname)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Imported before the limit goes up and before serving: no call pays for it, and it cannot fail on it.
    import torch
    import transformers  # noqa: F401

    torch.set_num_threads(1)  # fake tensors compute nothing; one thread keeps the CPU bound per call honest
    if ns.memory_bytes > 0:
        # The bound is on what calls may add. What the imports mapped is not theirs, and it varies by
        # build: a CUDA build of torch maps gigabytes of library images, so an absolute limit that a
        # CPU build fits under stopped the helper at its start (SIGABRT) with a CUDA one.
        few_arenas()
        mapped = mapped_bytes()
        limit = mapped + ns.memory_bytes
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        logging.getLogger("nnd.helper").info(
            "address space bounded at %d MiB (%d MiB mapped at start + %d MiB for calls)",
            limit >> 20,
            mapped >> 20,
            ns.memory_bytes >> 20,
        )
    server = serve(ns.socket, ns.cache)
    signal.signal(signal.SIGTERM, lambda *_: server.stop(grace=1))
    server.wait_for_termination()
    # Calls are drained and nothing here is kept: skip interpreter teardown, which with torch and
    # transformers imported takes a second or more that the daemon's stop would wait for.
    logging.shutdown()
    os._exit(0)


def few_arenas() -> None:
    """At most two malloc arenas. glibc gives each new thread an arena of its own, reserving 64 MiB of
    address space apiece (up to 8 per core): under RLIMIT_AS those reservations, not what calls
    allocate, used up a small bound, and a serving thread could not start (the helper then answered
    nothing). glibc only; elsewhere a no-op."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if not name:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt(-8, 2)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def mapped_bytes() -> int:
    """This process's address space now (VmSize), or 0 where /proc does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def serve(socket: str, cache: int) -> grpc.Server:
    """Start the Helper service on the unix socket `socket` in this process and return its server.
    Besides main, only the in-process engine for tests (nnd_daemon/inprocess.py) calls this."""
    from nnd.v1 import helper_pb2_grpc
    from nnd_daemon.helper.service import HelperService, memory_error

    mapped = errors.ErrorInterceptor(logging.getLogger("nnd.helper"), translate=memory_error)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), options=contract.GRPC_OPTIONS, interceptors=[mapped]
    )
    helper_pb2_grpc.add_HelperServicer_to_server(HelperService(cache), server)
    server.add_insecure_port("unix://" + socket)
    server.start()
    return server


if __name__ == "__main__":
    main()
