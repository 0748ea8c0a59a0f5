"""The `nnd` command: run the daemon and drive it (docker/ollama manners).

Every command but `serve` talks to a running daemon at --address (default:
$NND_ADDRESS, else $XDG_RUNTIME_DIR/nnd/nnd.sock, else /run/nnd/nnd.sock).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from nnd.errors import NndError
from nnd.wire import _address

STATES = {0: "?", 1: "META", 2: "DISPATCHING", 3: "DISPATCHED"}
QUICKSTART = """\
quickstart:
  nnd serve &
  nnd pull openai-community/gpt2
  nnd load openai-community/gpt2 --name gpt2
  nnd dispatch gpt2 --device cuda
  nnd ps"""


# ---------------------------------------------------------------- helpers


def _conn(ns: argparse.Namespace) -> Any:
    from nnd.wire.connection import Connection

    return Connection(ns.address, token=ns.token)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _human_duration(s: float) -> str:
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]]
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    # 0 would reach the daemon as "not given" and generate its default length instead.
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value} (as transformers' generate requires)")
    return value


def _placement(ns: argparse.Namespace) -> Any:
    from nnd.v1 import nnd_pb2

    p = nnd_pb2.Placement()
    if getattr(ns, "device", None):
        p.device = str(ns.device)
    if getattr(ns, "device_map", None):
        p.device_map = ns.device_map
    if getattr(ns, "dtype", None):
        p.dtype = ns.dtype
    if getattr(ns, "compute_dtype", None):
        p.compute_dtype = ns.compute_dtype
    for item in getattr(ns, "max_memory", None) or []:
        dev, _, size = item.partition("=")
        if not size:
            raise SystemExit(f"nnd: --max-memory wants DEVICE=SIZE (e.g. 0=20GiB, cpu=64GiB), not {item!r}")
        p.max_memory[dev] = size
    if getattr(ns, "tp", None):
        p.tp_size = ns.tp
    return p


def _model_dict(m: Any) -> dict[str, Any]:
    from nnd.cli import tools as clitools

    return clitools.plain_message(m)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False))


# ---------------------------------------------------------------- commands


def cmd_serve(ns: argparse.Namespace) -> int:
    try:
        from nnd_daemon.control import cli_serve
    except ImportError as exc:
        print(f"nnd: the daemon needs the server extra: pip install 'nnd-daemon[daemon]' ({exc})", file=sys.stderr)
        return 1
    return cli_serve.run(ns)


def cmd_load(ns: argparse.Namespace) -> int:
    from nnd.v1 import nnd_pb2

    req = nnd_pb2.LoadModelRequest(
        model=_local(ns.model),
        revision=ns.revision or "",
        task=ns.task or "",
        placement=_placement(ns),
        keep_alive=ns.keep_alive or "",
        trust_remote_code=ns.trust_remote_code,
        name=ns.name or "",
    )
    t0 = time.perf_counter()
    info = _conn(ns).call("LoadModel", req)
    if ns.json:
        _print_json(_model_dict(info))
    else:
        print(
            f"{info.name}: {STATES[info.state]} {info.architecture} ({info.num_parameters:,} parameters, "
            f"task {info.task}) in {time.perf_counter() - t0:.2f} s"
        )
    if ns.dispatch:
        return _dispatch(ns, info.name)
    return 0


def _local(model: str) -> str:
    # A local directory is named by its absolute path, so it is the same model from any cwd.
    return os.path.abspath(model) if os.path.isdir(model) else model


def cmd_dispatch(ns: argparse.Namespace) -> int:
    return _dispatch(ns, _loaded(ns, ns.model, _placement(ns)))


def _loaded(ns: argparse.Namespace, model: str, placement: Any = None) -> str:
    """The daemon's name of `model`, loading it first (META, as `nnd load` does) when it is not
    loaded yet, as the Python client does: dispatch, generate and scan need no `nnd load` before."""
    from nnd.errors import ModelNotFound
    from nnd.v1 import nnd_pb2

    model = _local(model)
    conn = _conn(ns)
    try:
        return conn.call("GetModel", nnd_pb2.GetModelRequest(model=model)).name or model
    except ModelNotFound:
        pass
    req = nnd_pb2.LoadModelRequest(model=model, keep_alive=getattr(ns, "keep_alive", None) or "")
    if placement is not None:
        req.placement.CopyFrom(placement)
    print(f"nnd: {model} is not loaded; loading it", file=sys.stderr)
    return conn.call("LoadModel", req).name or model


def _dispatch(ns: argparse.Namespace, model: str) -> int:
    from nnd.v1 import nnd_pb2

    req = nnd_pb2.DispatchRequest(model=model, placement=_placement(ns), keep_alive=ns.keep_alive or "")
    from nnd.wire import _progress

    bar = _progress.Lines()  # the same renderer as model.dispatch() and a first trace (_progress.py)
    final = None
    try:
        for msg in _conn(ns).stream("Dispatch", req):
            bar.update(msg.stage, msg.done, msg.total, msg.unit, msg.message)
            if msg.HasField("model"):
                final = msg.model
    except KeyboardInterrupt:
        bar.close()
        # Cancelling the stream makes the daemon stop the half-started worker (registry.dispatch).
        print(f"nnd: dispatch of {model} interrupted; the daemon stopped loading it (it stays META)", file=sys.stderr)
        return 130
    finally:
        bar.close()
    if final is not None:
        weights = ", ".join(f"{w.device} {_human_bytes(w.bytes)}" for w in final.weights) or "-"
        pids = ",".join(map(str, final.worker_pids))
        print(f"{final.name}: {STATES[final.state]} (worker pid {pids}; dtype {final.dtype}; weights {weights})")
    return 0


def cmd_release(ns: argparse.Namespace) -> int:
    from nnd.v1 import nnd_pb2

    info = _conn(ns).call("Release", nnd_pb2.ReleaseRequest(model=_local(ns.model), force=ns.force))
    print(f"{info.name}: {STATES[info.state]}")
    return 0


def cmd_unload(ns: argparse.Namespace) -> int:
    from nnd.v1 import nnd_pb2

    _conn(ns).call("Unload", nnd_pb2.UnloadRequest(model=_local(ns.model), force=ns.force))
    print(f"{_local(ns.model)}: unloaded")
    return 0


def cmd_ps(ns: argparse.Namespace) -> int:
    from nnd.v1 import nnd_pb2

    resp = _conn(ns).call("ListModels", nnd_pb2.ListModelsRequest())
    if ns.json:
        _print_json([_model_dict(m) for m in resp.models])
        return 0
    now = time.time()
    rows = []
    for m in resp.models:
        # A tensor-parallel group: its ranks' devices, the agent's pid here, and a line per rank below.
        ranked = {r.pid for r in m.ranks}
        devices = ",".join(dict.fromkeys(r.device for r in m.ranks)) or ",".join(w.device for w in m.weights) or "-"
        weights = _human_bytes(sum(w.bytes for w in m.weights)) if m.weights else "-"
        rows.append(
            [
                m.name,
                STATES[m.state],
                str(m.tp_size) if m.tp_size else "-",
                devices,
                m.dtype or m.placement.dtype or "-",
                weights,
                _human_bytes(m.worker_rss_bytes) if m.worker_rss_bytes else "-",
                ",".join(str(p) for p in m.worker_pids if p not in ranked) or "-",
                m.dispatched_by or m.loaded_by or "-",
                _human_duration(m.idle_s) if m.idle_s else "-",
                ("in " + _human_duration(max(0.0, m.expires_at - now))) if m.expires_at else "-",
                m.last_error[:60] if m.last_error else "",
            ]
        )
        for r in m.ranks:
            rss = _human_bytes(r.rss_bytes) if r.rss_bytes else "-"
            rows.append([f"  rank {r.rank}", "", "", r.device, "", "", rss, str(r.pid), "", "", "", ""])
    # USER: who dispatched the running worker (else who loaded the model).
    header = ["NAME", "STATE", "TP", "DEVICES", "DTYPE", "WEIGHTS", "RSS", "PID", "USER", "IDLE", "RELEASE", "NOTE"]
    print(_table(rows, header) if rows else "no models loaded")
    inflight = [
        [m.name, r.state, r.kind, _progress(r), _human_duration(max(0.0, now - r.since)), r.user or "-", r.client]
        for m in resp.models
        for r in m.requests
    ]
    if inflight:
        print()
        print(_table(inflight, ["MODEL", "REQUEST", "KIND", "PROGRESS", "FOR", "USER", "CLIENT"]))
    return 0


def cmd_logs(ns: argparse.Namespace) -> int:
    """A model's worker log (or the helper's), read through the daemon; -f keeps following it."""
    from nnd.v1 import nnd_pb2

    conn = _conn(ns)
    model = _local(ns.model) if ns.model else ""
    offset = -abs(ns.bytes)
    out = sys.stdout.buffer
    while True:
        resp = conn.call("ReadLogs", nnd_pb2.ReadLogsRequest(model=model, offset=offset, max_bytes=1 << 20))
        out.write(resp.data)
        out.flush()
        offset = resp.next_offset  # (after a rotation the daemon starts the new file from its beginning)
        if resp.next_offset < resp.size:
            continue  # more than one answer's worth
        if not ns.follow:
            return 0
        time.sleep(0.5)


def _progress(r: object) -> str:
    """'step 12/600' for a generation, 'next in line' / 'after 2' for a queued request, 'at a sync point for
    3s' for a paused one, '-' otherwise."""
    if getattr(r, "state", "") == "queued":
        ahead = getattr(r, "position", 0)
        return "next in line" if ahead <= 1 else f"after {ahead}"
    if getattr(r, "state", "") == "paused":  # holds the model while its client computes the next step
        since = getattr(r, "paused_since", 0.0)
        return f"at a sync point for {_human_duration(max(0.0, time.time() - since))}" if since else "at a sync point"
    steps = getattr(r, "steps", 0)
    return f"step {getattr(r, 'step', 0)}/{steps}" if steps else "-"


def cmd_tree(ns: argparse.Namespace) -> int:
    from nnd.cli import tree
    from nnd.v1 import nnd_pb2

    info = _conn(ns).call("GetModel", nnd_pb2.GetModelRequest(model=_local(ns.model)))
    if ns.json:
        _print_json([_model_dict(m) for m in info.modules])
    else:
        print(tree.render(info.modules))
    return 0


def cmd_info(ns: argparse.Namespace) -> int:
    from nnd.v1 import nnd_pb2

    info = _conn(ns).call("GetServerInfo", nnd_pb2.GetServerInfoRequest())
    if ns.json:
        _print_json(_model_dict(info))
        return 0
    print(f"nnd {info.version} ({info.protocol}) at {_conn(ns).address}")
    print("libraries: " + ", ".join(f"{k} {v}" for k, v in sorted(info.libraries.items())))
    print("devices:   " + ", ".join(info.devices))
    print(f"ops:       {len(info.ops)} ({', '.join(info.ops[:12])}, ...)")
    return 0


def cmd_scan(ns: argparse.Namespace) -> int:
    from nnd.cli import tools as clitools

    return clitools.scan_table(_conn(ns), _loaded(ns, ns.model), ns.prompt, as_json=ns.json)


def cmd_generate(ns: argparse.Namespace) -> int:
    from nnd.cli import tools as clitools

    return clitools.generate_text(_conn(ns), _loaded(ns, ns.model), ns.prompt, ns)


def cmd_trace(ns: argparse.Namespace) -> int:
    from nnd.cli import tools as clitools

    return clitools.trace_graph_file(_conn(ns), _local(ns.model), ns)


# ---------------------------------------------------------------- parser


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions keep their line breaks; every option with a real default says it in --help."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = not (default is None or default is False or default is argparse.SUPPRESS or isinstance(default, list))
        if shown and "%(default)" not in text and (action.option_strings or action.nargs in ("?", "*")):
            text += " (default: %(default)s)"
        return text


def _placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", help='where the weights go: "cpu", "cuda", "cuda:1" or a GPU index')
    p.add_argument("--device-map", help='"auto", "balanced", "cuda", or a JSON object {module: device}')
    p.add_argument("--dtype", help="float32, float16, bfloat16, auto, or a quantization: nf4, fp4, int8")
    p.add_argument(
        "--compute-dtype", help="compute dtype of quantized layers (default float32 on CPU, bfloat16 on GPU)"
    )
    p.add_argument(
        "--max-memory", action="append", metavar="DEVICE=SIZE", help="per-device cap, e.g. 0=20GiB (repeatable)"
    )
    p.add_argument("--tp", type=int, help="tensor-parallel degree (a torchrun worker group of N ranks)")
    p.add_argument("--keep-alive", help="release after this much idle time: 5m, 1h, 0 (after each request), -1 (never)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nnd",
        description="nnd: a daemon that keeps models loaded and lets any client look inside them.",
        epilog=QUICKSTART,
        formatter_class=_HelpFormatter,
    )
    from nnd import __version__

    parser.add_argument("--version", action="version", version=f"nnd {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default=None, help="daemon address: unix:///path, a socket path, or host:port")
    common.add_argument("--token", default=None, help="bearer token for a TCP daemon (default: $NND_TOKEN)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, parents=[common], help=help_, description=help_, formatter_class=_HelpFormatter)
        p.set_defaults(fn=fn)
        return p

    from nnd.cli import serve_args as cli_serve_args

    cli_serve_args.add_arguments(add("serve", cmd_serve, "run the daemon in the foreground"))

    p = add("load", cmd_load, "load a model's config, tokenizer and module tree (META; no weights read)")
    p.add_argument("model", help="a HuggingFace repo id or a local model directory")
    p.add_argument("--revision")
    p.add_argument("--task", help="pipeline task (inferred from config.architectures when omitted)")
    p.add_argument(
        "--trust-remote-code", action="store_true", help="run the repo's model code (the daemon must allow it)"
    )
    p.add_argument(
        "--name", help="a short name to use for it everywhere a model is named (kept across daemon restarts)"
    )
    p.add_argument("--dispatch", action="store_true", help="dispatch right away")
    p.add_argument("--json", action="store_true", help="print the model as JSON")
    _placement_args(p)

    p = add("dispatch", cmd_dispatch, "load a model's weights in a worker process (shows progress; loads it first if needed)")
    p.add_argument("model")
    _placement_args(p)

    p = add("release", cmd_release, "end a model's worker and free its memory; the model stays loaded (META)")
    p.add_argument("model")
    p.add_argument(
        "--force", action="store_true", help="also when another user dispatched it or requests run on it (they fail)"
    )
    p = add("unload", cmd_unload, "release a model and forget it")
    p.add_argument("model")
    p.add_argument("--force", action="store_true", help="as for release")

    p = add("logs", cmd_logs, "show a model's worker log (no MODEL: the helper's), read through the daemon")
    p.add_argument("model", nargs="?", help="a loaded (or once loaded) model; omit for the helper process's log")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing what is added (Ctrl-C ends)")
    p.add_argument("--bytes", type=int, default=16384, metavar="N", help="start this many bytes before the end")

    p = add("ps", cmd_ps, "list loaded models: state, TP degree, devices, dtype, memory, worker pids (each rank's), idle time")
    p.add_argument("--json", action="store_true")

    p = add("tree", cmd_tree, "print a model's module tree")
    p.add_argument("model")
    p.add_argument("--json", action="store_true")

    p = add("info", cmd_info, "the daemon's version, libraries, devices and ops")
    p.add_argument("--json", action="store_true")

    p = add("scan", cmd_scan, "every module's output shape and dtype for a prompt, without weights (loads it if needed)")
    p.add_argument("model")
    p.add_argument("prompt")
    p.add_argument("--json", action="store_true")

    p = add("generate", cmd_generate, "generate text, printed as it comes (loads and dispatches it if needed)")
    p.add_argument("model")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=_positive_int, default=32, help="tokens to generate (at least 1)")
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: the model's default)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling threshold (0: off)")
    p.add_argument("--seed", type=int, help="seed for sampling, for reproducible text")

    from nnd.cli import hub as cli_hub

    cli_hub.add_commands(add)

    p = add("completion", cmd_completion, "print the shell completion script: eval \"$(nnd completion bash)\"")
    p.add_argument("shell", choices=["bash", "zsh", "fish"], help="the shell to complete in")

    p = add("trace", cmd_trace, "run a graph from a file (protobuf text format or JSON) and print what it saved")
    p.add_argument("model")
    p.add_argument("--graph", required=True, help="a TraceRequest or Graph in text format (.txtpb/.textproto) or JSON")
    p.add_argument("--prompt", action="append", help="input text (repeat for several invokes); overrides the file's")
    p.add_argument("--json", action="store_true", help="print saved values as JSON")
    return parser


def cmd_completion(ns: argparse.Namespace) -> int:
    import argcomplete

    print(argcomplete.shellcode(["nnd"], shell=ns.shell))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # a shell asking for completions (nnd completion SHELL installed the hook)
        import argcomplete

        argcomplete.autocomplete(parser)
    ns = parser.parse_args(argv)
    if ns.address is not None:
        ns.address = _address.normalize(ns.address)
    try:
        return int(ns.fn(ns) or 0)
    except NndError as exc:
        print(f"nnd: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nnd: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
