"""The intervention engine: one executor for Scan (fake tensors on the meta model), Trace and Generate.

`run` validates the graph before anything runs, installs hooks for the one
request, runs one batched forward (or `generate`), and emits Saved/Chunk/Step
messages and one Done. Every failure is an `nnd_daemon.errors` exception, and
the model is left exactly as it was.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from nnd.v1 import nnd_pb2

from .. import errors
from . import batch as batching
from . import generation, plan, scan, wire
from .executor import Executor, StopForward
from .failures import where, wrap
from .limits import EngineLimits
from .ops import ATTRIBUTES, OPS

__all__ = ["ATTRIBUTES", "MODES", "OPS", "EngineLimits", "run"]

MODES = ("trace", "scan", "generate")


def run(
    model: torch.nn.Module,
    tokenizer: Any,
    request: nnd_pb2.TraceRequest,
    *,
    mode: str,
    emit: Callable[[nnd_pb2.TraceResponse], None],
    cancelled: Callable[[], bool] = lambda: False,
    limits: EngineLimits | None = None,
) -> None:
    """Run `request.graph` on `model` and stream its results through `emit`.

    Raises only `nnd_daemon.errors` exceptions.
    """
    try:
        _run(model, tokenizer, request, mode=mode, emit=emit, cancelled=cancelled, limits=limits)
    except errors.NndError:
        raise
    except Exception as e:  # anything unforeseen still reaches the client as a status, not a traceback
        raise wrap(e, None, scan=mode == "scan") from e


def _run(
    model: torch.nn.Module,
    tokenizer: Any,
    request: nnd_pb2.TraceRequest,
    *,
    mode: str,
    emit: Callable[[nnd_pb2.TraceResponse], None],
    cancelled: Callable[[], bool],
    limits: EngineLimits | None,
) -> None:
    if mode not in MODES:
        raise errors.InvalidArgument(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    limits = limits or EngineLimits()
    inputs = batching.build(
        model,
        tokenizer,
        request.invokes,
        max_invokes=limits.max_invokes,
        max_sequence_length=limits.max_sequence_length,
    )
    the_plan = plan.build(request.graph, model, len(request.invokes), limits.max_constant_bytes)
    opts = generation.options(request.generate, limits) if mode == "generate" else None
    total_steps = opts.max_new_tokens if opts else 1

    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        constant: Callable[[Any], Any] = lambda v: v  # noqa: E731
        if mode == "scan":
            constant = scan.faker(stack.enter_context(scan.fake_mode()))
        executor = Executor(
            the_plan,
            model,
            inputs.rows,
            inputs.size,
            total_steps=total_steps,
            cancelled=cancelled,
            scan=mode == "scan",
            constant=constant,
        )
        stack.enter_context(torch.no_grad())
        stack.enter_context(executor.hooks.installed())
        try:
            executor.poll()
            executor.run_ready()  # nodes that need only constants
            placed = inputs.to(batching.input_device(model))
            if opts is not None:
                result = generation.generate(model, tokenizer, placed, opts, emit, cancelled)
            else:
                result = model(*placed.args, **placed.kwargs)
            executor.at_result(result)
        except StopForward:
            pass
        except errors.NndError:
            raise
        except Exception as e:
            last = executor.writes[-1].proto if executor.writes else None
            raise wrap(e, last, scan=mode == "scan") from None
        executor.check_complete()
        saved = executor.saved()
    compute_s = time.perf_counter() - started
    _emit_saved(the_plan, saved, emit, limits.max_saved_bytes)
    emit(nnd_pb2.TraceResponse(done=nnd_pb2.TraceDone(compute_s=compute_s)))


def _emit_saved(
    the_plan: plan.Plan, saved: dict[int, Any], emit: Callable[[nnd_pb2.TraceResponse], None], max_bytes: int
) -> None:
    # Encode everything first, so a limit violation emits nothing half-way.
    encoder = wire.Encoder()
    encoded: list[tuple[int, Any, list[tuple[int, bytes]]]] = []
    for node_id, value in saved.items():
        first_blob = len(encoder.blobs)
        try:
            msg = encoder.value(value)
        except errors.NndError as e:
            raise wrap(e, the_plan.nodes[node_id].proto) from None
        if max_bytes and encoder.total_bytes > max_bytes:
            raise errors.ResourceExhausted(
                f"{where(the_plan.nodes[node_id].proto)}\nsaved values exceed the limit "
                f"max_saved_bytes={max_bytes} ({encoder.total_bytes} bytes so far); save less or slice first"
            )
        encoded.append((node_id, msg, encoder.blobs[first_blob:]))
    for node_id, msg, blobs in encoded:
        for response in wire.saved_messages(node_id, msg, blobs):
            emit(response)
