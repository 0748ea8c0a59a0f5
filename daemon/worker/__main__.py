"""Worker process entry: `python -m nnd_daemon.worker --socket PATH --public PATH`.

Started by the daemon (never by hand); serves the Worker service on a private
unix socket and the model's data path on a public one (listen.py) until the
daemon ends it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import grpc

from nnd.v1 import contract, worker_pb2_grpc
from nnd_daemon import intake, logfmt, parentwatch
from nnd_daemon.worker import listen
from nnd_daemon.worker.service import WorkerService

SAMPLER_ENV = "NND_WORKER_SAMPLER"


def _allow_sampler() -> None:
    """Workers start under `python -I`, which ignores PYTHONPATH and so any profiler put there
    (bench/profile_nnd.py's sampler). Whoever starts the daemon may opt in with
    $NND_WORKER_SAMPLER=DIR: the worker runs DIR's sitecustomize.py as Python would have. It is the
    environment of the daemon's own user, never anything a client sends."""
    folder = os.environ.get(SAMPLER_ENV)
    if not folder:
        return
    import importlib.util
    import sys

    path = os.path.join(folder, "sitecustomize.py")
    spec = importlib.util.spec_from_file_location("sitecustomize", path)
    if spec is None or spec.loader is None or not os.path.isfile(path):
        logging.getLogger("nnd.worker").warning("%s=%s: no sitecustomize.py there; not sampled", SAMPLER_ENV, folder)
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


def parser() -> argparse.ArgumentParser:
    """The worker's command line (the daemon's supervisor writes it)."""
    parser = argparse.ArgumentParser(prog="nnd-worker", description=__doc__)
    parser.add_argument("--socket", required=True, help="unix socket to serve on")
    parser.add_argument("--name", default="", help="model name, for logs and ps")
    parser.add_argument("--parent", type=int, default=0, help="daemon pid; the worker dies with it")
    parser.add_argument("--limits", default="", help="the daemon's limits: nnd.v1.Limits as JSON (intake.limits_arg)")
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
    _allow_sampler()
    ns = parser().parse_args()
    # Under torchrun (tensor parallel) this process is one rank of a group; tp.py runs it.
    rank = os.environ.get("RANK", "") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    if not rank:
        parentwatch.die_with_parent(ns.parent)
    who = f"{ns.name} rank {rank}" if rank else ns.name
    text = f"%(asctime)s worker[{who}] %(levelname)s %(message)s"
    logfmt.setup("INFO", ns.log_format, text, model=ns.name, **({"rank": rank} if rank else {}))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if ns.threads:
        import torch

        torch.set_num_threads(ns.threads)
    if rank:
        from nnd_daemon.worker import tp

        tp.main(ns, contract.GRPC_OPTIONS, _limits(ns))
        return
    listen.serve_until_terminated(serve(ns), grace=2)
    # Calls are drained and the worker keeps no state (it creates no shared memory: shm.py): skip the
    # interpreter's teardown, seconds with torch and a model loaded, that a daemon's stop waits for.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _limits(ns: argparse.Namespace) -> Any:
    """The limits the engine enforces while a request runs (the gateway checks the rest: listen.py)."""
    return intake.engine_limits(intake.limits_of_arg(ns.limits))


def serve(ns: argparse.Namespace, token: str | None = None, identity_key: str | None = None) -> list[grpc.Server]:
    """Start one worker's servers in this process (its arguments as parsed by `parser()`) and
    return them, private socket last; `token`, `identity_key`: as listen.start. Besides main, only the
    in-process engine for tests (nnd_daemon/inprocess.py) calls this."""
    service = WorkerService()
    service.limits = _limits(ns)
    if ns.batch_window_ms > 0:
        from nnd_daemon.worker import batching

        max_invokes = int(intake.limits_of_arg(ns.limits).max_invokes)
        service.batcher = batching.for_service(service, ns.batch_window_ms, max_invokes)
    return listen.start(service, ns, worker_pb2_grpc.add_WorkerServicer_to_server, token=token, identity_key=identity_key)


if __name__ == "__main__":
    main()
