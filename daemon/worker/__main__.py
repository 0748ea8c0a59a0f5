"""Worker process entry: `python -m nnd_daemon.worker --socket PATH --public PATH`.

Started by the daemon (never by hand); serves the Worker service on a private
unix socket and the model's data path on a public one (listen.py) until the
daemon ends it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from typing import Any

import grpc

from nnd.v1 import worker_pb2_grpc
from nnd_daemon import shared
from nnd_daemon.worker import listen
from nnd_daemon.worker.service import WorkerService


def parser() -> argparse.ArgumentParser:
    """The worker's command line (the daemon's supervisor writes it)."""
    parser = argparse.ArgumentParser(prog="nnd-worker", description=__doc__)
    parser.add_argument("--socket", required=True, help="unix socket to serve on")
    parser.add_argument("--name", default="", help="model name, for logs and ps")
    parser.add_argument("--parent", type=int, default=0, help="daemon pid; the worker dies with it")
    parser.add_argument("--limits", default="", help="engine limits as JSON (from the daemon's settings)")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    parser.add_argument(
        "--batch-window-ms",
        type=float,
        default=0.0,
        help="gather compatible Traces this long into one forward (0: off)",
    )
    listen.add_arguments(parser)
    return parser


def main() -> None:
    ns = parser().parse_args()
    # Under torchrun (tensor parallel) this process is one rank of a group; tp.py runs it.
    rank = os.environ.get("RANK", "") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    if not rank:
        shared.die_with_parent(ns.parent)
    who = f"{ns.name} rank {rank}" if rank else ns.name
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s worker[{who}] %(levelname)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    if rank:
        from nnd_daemon.worker import tp

        tp.main(ns, shared.GRPC_OPTIONS, _limits(ns))
        return
    servers = serve(ns)
    signal.signal(signal.SIGTERM, lambda *_: listen.stop(servers, 2))
    servers[-1].wait_for_termination()


def _limits(ns: argparse.Namespace) -> Any:
    if not ns.limits:
        return None
    from nnd_daemon.engine import EngineLimits

    return EngineLimits(**json.loads(ns.limits))


def serve(ns: argparse.Namespace, token: str | None = None) -> list[grpc.Server]:
    """Start one worker's servers in this process (its arguments as parsed by `parser()`) and
    return them, private socket last; `token`: as listen.start. Besides main, only the
    in-process engine for tests (nnd_daemon/inprocess.py) calls this."""
    service = WorkerService()
    service.limits = _limits(ns)
    if ns.batch_window_ms > 0:
        from nnd_daemon.worker import batching

        max_invokes = int(json.loads(ns.request_limits or "{}").get("max_invokes", 0))
        service.batcher = batching.for_service(service, ns.batch_window_ms, max_invokes)
    return listen.start(service, ns, worker_pb2_grpc.add_WorkerServicer_to_server, token=token)


if __name__ == "__main__":
    main()
