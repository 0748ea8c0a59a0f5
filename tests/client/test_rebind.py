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
    # As in nnsight, a name bound without .save() does not outlive the block (tests/test_unsaved_names.py).
    with pytest.raises(NameError):
        unsaved  # noqa: B018


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


BIG = 50_000  # under the walk's old cap of 100,000 items: the old client walked all of them


def test_block_looks_only_at_what_its_body_binds_and_fills(model, tmp_path):
    """A notebook cell holding big data: after the block the client rebinds `out`, fills the new item of
    `hs` (a list that existed before the block), and walks nothing else the cell's globals hold."""
    from nnd.tracing import _rebind

    code = (
        "big = [0.5] * BIG\n"
        "table = {i: float(i) for i in range(BIG)}\n"
        "hs = [None] * BIG\n"
        "out_dict = {}\n"
        "before = walked[0]\n"
        "with model.trace('hi'):\n"
        "    out = model.lm_head.output.save()\n"
        "    hs.append(model.transformer.h[0].output)\n"
        "    out_dict['h'] = model.transformer.h[1].output\n"
        "looked_at = walked[0] - before\n"
    )
    cell = tmp_path / "cell.py"
    cell.write_text(code)  # a real file: linecache reads the block's source, as IPython's cells have it
    namespace = {"model": model, "BIG": BIG, "walked": _rebind.walked}
    exec(compile(code, str(cell), "exec"), namespace)
    assert type(namespace["out"]) is torch.Tensor
    assert type(namespace["hs"][-1]) is torch.Tensor and namespace["hs"][0] is None
    assert type(namespace["out_dict"]["h"]) is torch.Tensor
    assert namespace["looked_at"] < 100, namespace["looked_at"]


def test_function_block_does_not_walk_its_frames_data(model):
    from nnd.tracing import _rebind

    big = [0.5] * BIG
    table = {i: float(i) for i in range(BIG)}
    hs = list(range(BIG))
    before = _rebind.walked[0]
    with model.trace("hi"):
        hidden = model.transformer.h[0].output.save()
        hs.append(model.lm_head.output)
        pairs = (model.transformer.h[1].output.save(), 1).save()
    looked_at = _rebind.walked[0] - before
    assert type(hidden) is torch.Tensor and type(hs[-1]) is torch.Tensor and hs[0] == 0
    assert type(pairs[0]) is torch.Tensor
    assert looked_at < 100, looked_at
    assert len(big) == len(table) == BIG


def test_unreadable_source_still_rebinds_everything(model, tmp_path):
    """Code without a source file (exec of a string): every name and container is looked at, as before."""
    code = "hs = []\nwith model.trace('hi'):\n    hs.append(model.lm_head.output)\n    out = model.lm_head.output.save()\n"
    namespace = {"model": model}
    exec(compile(code, "<no file>", "exec"), namespace)
    assert type(namespace["out"]) is torch.Tensor and type(namespace["hs"][0]) is torch.Tensor
