"""`.save()` on any object: mounted on `object` by a block and, once torch is loaded, left there
(as nnsight's mount stays while nnsight is imported; a remount per block invalidates every class's
method cache, ~1 ms with torch loaded). Outside a block it raises as nnsight's does, or hands the
object to the `save` another library mounted before (nnsight's, when a process uses both).
Without torch loaded, the last block to close takes it off: torch imported later defines `save`s
of its own (tests/client/test_tensor_type.py imports torch after a block)."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from nnd import _objects


@pytest.fixture
def object_save():
    """Leave `object.save` (and nnd's memory of the one before it) as the test found them."""
    namespace = _objects._object_dict()
    before, previous = namespace.get("save"), _objects._previous
    yield namespace
    if before is None:
        namespace.pop("save", None)
    else:
        namespace["save"] = before
    _objects._previous = previous
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(object))


def _install(namespace, fn) -> None:
    namespace["save"] = fn
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(object))


def test_save_stays_mounted_after_a_block_and_raises_outside(model, object_save):
    import torch  # noqa: F401 - loaded, as in a notebook that uses tensors

    object_save.pop("save", None)
    with model.trace("hi"):
        inside = [].save()
        inside.append(model.transformer.h[0].output)
    assert object_save.get("save") is _objects.save_any  # the next block pays no remount
    assert len(inside) == 1 and hasattr(inside[0], "shape")  # delivered as a value
    with pytest.raises(ValueError, match="inside one"):
        [].save()


def test_another_librarys_save_answers_outside_nnds_blocks(object_save):
    seen = []

    def theirs(obj, _=None):  # what nnsight mounts at import
        seen.append(obj)
        return obj

    _install(object_save, theirs)
    _objects.mount()
    _objects.unmount()
    items = [1, 2]
    assert items.save() is items and seen == [items]  # their blocks keep working beside nnd's
    _install(object_save, theirs)  # mounted again after nnd's (nnsight imported later)
    _objects.mount()  # the next nnd block takes `save` back and remembers theirs
    _objects.unmount()
    assert object_save["save"] is _objects.save_any and _objects._previous is theirs
    box = {}
    assert box.save() is box and seen == [items, box]


def test_torch_imported_after_a_block_and_its_compiler_load():
    """The mount leaves nothing in the way of torch (imported after a block) nor of the code
    torch's compiler generates from the methods a class lists (torch.export loads it)."""
    script = (
        "from nnd import _objects\n"
        "_objects.mount(); _objects.unmount()\n"
        "assert not hasattr([], 'save')  # no torch yet: taken off again\n"
        "import torch\n"
        "_objects.mount(); _objects.unmount()\n"
        "assert [].save.__func__ is _objects.save_any  # torch loaded: it stays\n"
        "import torch._inductor.ops_handler\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
