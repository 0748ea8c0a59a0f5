"""Saved names are rebound to real values after the block, wherever the block is."""

from __future__ import annotations

import pytest
import torch
from fakedaemon import Abort

import nnd

MODULE_LEVEL = None


def test_function_locals_are_rebound(model):
    with model.trace("hi"):
        hidden = model.transformer.h[0].output.save()
        logits = model.lm_head.output.save()
        unsaved = model.lm_head.output
    assert type(hidden) is torch.Tensor and type(logits) is torch.Tensor
    assert isinstance(unsaved, nnd.Proxy)
    with pytest.raises(nnd.ValueNotKnown, match="not saved"):
        unsaved.value  # noqa: B018


def test_closure_cells_are_rebound(model):
    with model.trace("hi"):
        hidden = model.transformer.h[0].output.save()

    def reader():
        return hidden

    assert type(reader()) is torch.Tensor


def test_module_globals_are_rebound(model):
    global MODULE_LEVEL
    with model.trace("hi"):
        MODULE_LEVEL = model.lm_head.output.save()
    assert type(MODULE_LEVEL) is torch.Tensor


def test_module_level_block(model, tmp_path):
    code = "with model.trace('hi'):\n    out = model.lm_head.output.save()\nkind = type(out).__name__\n"
    namespace = {"model": model}
    exec(compile(code, str(tmp_path / "notebook_cell.py"), "exec"), namespace)
    assert namespace["kind"] == "Tensor"


def test_daemon_errors_keep_builtin_type_and_point_at_with(model, fake):
    def reply(method, request):
        raise Abort(
            __import__("grpc").StatusCode.INVALID_ARGUMENT, "test.py:3: `x += v`: size mismatch", "RuntimeError"
        )
        yield

    fake[0].reply = reply
    with pytest.raises(RuntimeError, match="size mismatch") as info:
        with model.trace("hi"):
            model.lm_head.output.save()
    err = info.value
    assert isinstance(err, nnd.InvalidRequest) and isinstance(err, nnd.NndError)
    frames = [f for f in info.traceback if "nnd" + "/" not in str(f.path)]
    assert frames[-1].path == __import__("pathlib").Path(__file__)
