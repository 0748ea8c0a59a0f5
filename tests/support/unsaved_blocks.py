"""Blocks that bind names without `.save()`, as nnsight 0.8.1 users meet them:
after the outermost block only the names bound to a saved value hold what the
body gave them; any other name the body bound is unbound (NameError) if it did
not exist before, or has its value from before the block. Run unchanged by
nnsight (tests/support/nnsight_blocks_reference.py, in a process of its own)
and by nnd (tests/client/test_unsaved_names.py); each returns, per name, what
the name holds after the block: "NameError", a type's name, or a plain value.
"""

from __future__ import annotations

import linecache
from typing import Any

PROMPT = "The Eiffel Tower is in the city of"
# Every value bound below is an object of its own: nnsight keeps a name whose object was saved under
# any name (`a = h.output` and `b = h.output.save()` are one tensor), so no two names share one here.


def _what(scope: dict[str, Any], names: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names.split():
        if name not in scope:
            out[name] = "NameError"
            continue
        value = scope[name]
        out[name] = value if isinstance(value, (int, float, str)) else type(value).__name__
    return out


def new_names_unsaved(model: Any) -> dict[str, Any]:
    with model.trace(PROMPT):
        hidden = model.transformer.h[0].output
        kept = model.transformer.h[1].output.save()
        number = 3
        text = "s"
    return _what(locals(), "hidden kept number text")


def names_from_before_keep_their_value(model: Any) -> dict[str, Any]:
    hidden = 7
    number = 1
    kept = 2
    with model.trace(PROMPT):
        hidden = model.transformer.h[0].output
        number = 2
        kept = model.transformer.h[1].output.save()
    return _what(locals(), "hidden number kept")


def loops_tuples_and_real_values(model: Any) -> dict[str, Any]:
    with model.trace(PROMPT):
        for layer in range(2):
            looped = model.transformer.h[layer].output[0]
        first, second = model.transformer.h[1].output * 2, (model.transformer.h[1].output * 3).save()
        shape = model.transformer.h[1].output.shape
        item = model.lm_head.output[0, -1, 0].item()
        saved_item = model.lm_head.output[0, -1, 1].item().save()
        both = [model.lm_head.output[0, -1]].save()
    found = _what(locals(), "layer looped first second shape item saved_item both")
    found["saved_item_type"] = type(saved_item).__name__
    return found


def attribute_and_item_targets(model: Any) -> dict[str, Any]:
    class Holder:
        pass

    holder = Holder()
    holder.old = 1
    table: dict[str, Any] = {}
    with model.trace(PROMPT):
        holder.old = model.transformer.h[0].output
        table["h"] = model.transformer.h[1].output
    return {"old": type(holder.old).__name__, "table": type(table["h"]).__name__}


def invoke_targets_and_deletes(model: Any) -> dict[str, Any]:
    gone = 1
    with model.trace() as tracer:
        with tracer.invoke(PROMPT) as invoker:  # noqa: F841 - what it holds after the block is the point
            inside = model.transformer.h[0].output
            out = model.transformer.h[1].output.save()
        del gone
    return _what(locals(), "tracer invoker inside out gone") | {"tracer": "kept" if "tracer" in locals() else "gone"}


def a_cache_needs_no_save(model: Any) -> dict[str, Any]:
    with model.trace() as tracer:  # noqa: F841
        with tracer.invoke(PROMPT):
            cache = tracer.cache()
    return {"cache": "kept" if "cache" in locals() else "NameError"}


def a_failed_block_binds_nothing(model: Any) -> dict[str, Any]:
    # (A saved name after a failed block: nnsight's is unbound; nnd's says the block did not complete.)
    old = 5
    try:
        with model.trace(PROMPT):
            old = model.transformer.h[0].output
            new = model.transformer.h[1].output
            raise KeyError("inside the block")
    except KeyError:
        pass
    return _what(locals(), "old new")


def a_session(model: Any) -> dict[str, Any]:
    with model.session():
        with model.trace(PROMPT):
            first = model.transformer.h[0].output
            total = model.transformer.h[0].output.sum().save()
        with model.trace(PROMPT):
            uses_first = (model.transformer.h[1].output + first).save()
            second = model.transformer.h[1].output * 2
        plain = 5
        listed = [1].save()
    return _what(locals(), "first total uses_first second plain listed")


def generate_steps(model: Any) -> dict[str, Any]:
    with model.generate(PROMPT, max_new_tokens=2, min_new_tokens=2) as tracer:
        early = model.transformer.h[0].output
        values = list().save()
        for step in tracer.iter[0:2]:  # noqa: B007 - what `step` holds after the block is the point
            values.append(model.transformer.h[0].output[0, -1, 0].item())
            inner = 1
    return _what(locals(), "early values step inner") | {"count": len(values)}


def a_module_set_through_a_loop_variable(model: Any) -> dict[str, Any]:
    # `layer.output = ...` sets a module value, not an attribute to deliver: after the session nothing
    # reads the envoy's `.output` (the LLM-depth tutorial's loop, `layer` bound when the block opens).
    layer = model.transformer.h[-1]
    with model.session():
        with model.trace(PROMPT):
            for i, layer in enumerate(model.transformer.h):
                if i == 1:
                    layer.output = layer.output * 2
            out = model.lm_head.output.save()
    return {"out": type(out).__name__, "layer": type(layer).__name__}


_CELL = """
with model.trace(PROMPT):
    cell_new = model.transformer.h[0].output
    cell_old = model.transformer.h[0].output + 1
    cell_saved = model.transformer.h[1].output.save()
    cell_number = 4
"""


def module_level_cell(model: Any) -> dict[str, Any]:
    # A notebook cell: module-level code run in a globals dict, its source in linecache as IPython puts it.
    name = "<unsaved-cell-1>"
    linecache.cache[name] = (len(_CELL), None, _CELL.splitlines(keepends=True), name)
    scope: dict[str, Any] = {"model": model, "PROMPT": PROMPT, "cell_old": "before", "__name__": "__main__"}
    exec(compile(_CELL, name, "exec"), scope)  # noqa: S102 - the test's own cell
    return _what(scope, "cell_new cell_old cell_saved cell_number")


BLOCKS = {
    name: fn
    for name, fn in list(globals().items())
    if callable(fn) and not name.startswith("_") and getattr(fn, "__module__", None) == __name__
}
