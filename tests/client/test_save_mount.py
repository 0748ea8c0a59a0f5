"""`.save()` on any object: mounted on `object` while a block is open, and taken off when the last
open one closes, so that outside a block `dir(object)` is what it was before `import nnd` (a library
imported after a block that walks its classes' attributes, as anyio's `TypedAttributeSet` does,
finds nothing foreign). Mounting does not invalidate every class's method cache (_objects._forget),
so it stays cheap. Outside a block the `save` another library mounted before (nnsight's) answers."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from nnd.tracing import _objects


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


def test_save_is_mounted_only_while_a_block_is_open(model, object_save):
    import torch  # noqa: F401 - loaded, as in a notebook that uses tensors

    object_save.pop("save", None)
    before = dir(object)
    with model.trace("hi"):
        inside = [].save()
        inside.append(model.transformer.h[0].output)
        assert "save" in dir(object)
    assert dir(object) == before
    assert len(inside) == 1 and hasattr(inside[0], "shape")  # delivered as a value
    with pytest.raises(AttributeError):
        [].save()


def _call_save(obj):
    return obj.save()  # one call site, specialised by the interpreter on the types it sees


def test_no_class_remembers_save_after_the_block(model, object_save):
    """A call site the interpreter specialised inside blocks, and the global method cache, both
    forget `save` once the block closes; a block after that finds it again."""

    class Plain:
        pass

    class Slotted:
        __slots__ = ()

    object_save.pop("save", None)
    values = [[], (1,), {}, Plain(), Slotted(), 5, "s", 2.5]
    for _ in range(30):
        with model.trace("hi"):
            for _ in range(20):
                for value in values:
                    assert _call_save(value) is value
                    assert hasattr(value, "save")
            model.transformer.h[0].output.save()
        for value in values:
            assert not hasattr(value, "save"), type(value)
            with pytest.raises(AttributeError):
                _call_save(value)
    assert "save" not in dir(object)


def test_a_lookup_cached_inside_a_block_finds_no_save_after_it(object_save):
    """Unmounting invalidates nothing: a class whose `save` the interpreter's method cache still
    maps to nnd's finds no attribute after the block, by every way of looking (hasattr, getattr
    with a default, the class itself, a class's `__getattr__`); an instance's own `save` wins."""
    import inspect

    class Plain:
        pass

    class Fallback:
        def __getattr__(self, name):
            return ("fallback", name)

    own = Plain()
    own.save = "mine"
    values = [[], {}, Plain(), Fallback(), 5, "s"]
    object_save.pop("save", None)
    for _ in range(30):
        _objects.mount()
        for value in values:
            assert value.save.__self__ is value and hasattr(type(value), "save")
        assert own.save == "mine"
        assert list(inspect.signature(Plain.save).parameters) == ["self", "_"]
        _objects.unmount()
        for value in values:
            if isinstance(value, Fallback):
                assert value.save == ("fallback", "save")
                continue
            assert not hasattr(value, "save") and getattr(value, "save", 7) == 7, type(value)
            assert not hasattr(type(value), "save")
        assert own.save == "mine"
    assert "save" not in dir(object)


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
    _objects.mount()  # the next nnd block takes `save` over and remembers theirs
    assert object_save["save"] is _objects.save_any and _objects._previous is theirs
    _objects.unmount()
    assert object_save["save"] is theirs  # given back
    box = {}
    assert box.save() is box and seen == [items, box]


def test_torch_imported_after_a_block_and_its_compiler_load():
    """The mount leaves nothing in the way of torch (imported after a block) nor of the code
    torch's compiler generates from the methods a class lists (torch.export loads it)."""
    script = (
        "from nnd.tracing import _objects\n"
        "_objects.mount(); _objects.unmount()\n"
        "assert not hasattr([], 'save')  # taken off again\n"
        "import torch\n"
        "_objects.mount(); _objects.unmount()\n"
        "assert not hasattr([], 'save')\n"
        "import torch._inductor.ops_handler\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


_AFTER_A_BLOCK = """
import sys
before = dir(object)
import torch  # noqa: F401 - loaded, as in a notebook that uses tensors
import nnd
model = nnd.TransformersModel("tiny-gpt2", address=sys.argv[1])
with model.trace("hi"):
    kept = [].save()
    kept.append(model.transformer.h[0].output)
assert hasattr(kept[0], "shape"), kept
assert dir(object) == before, sorted(set(dir(object)) - set(before))
import dataclasses, enum
import anyio.streams.tls, attrs, httpx, huggingface_hub, pydantic, transformers
from anyio import TypedAttributeSet, typed_attribute

class Attributes(TypedAttributeSet):
    port: int = typed_attribute()

@dataclasses.dataclass
class Point:
    x: int = 0

class Colour(enum.Enum):
    RED = 1

@attrs.define
class Pair:
    a: int = 0

class Record(pydantic.BaseModel):
    n: int = 0

assert Point().x == 0 and Colour.RED.value == 1 and Pair().a == 0 and Record().n == 0
assert dir(object) == before
print("ok")
"""


def test_libraries_imported_after_a_block_see_object_as_it_was(fake):
    """The first import of anyio (httpx, huggingface_hub, hence transformers), pydantic, attrs,
    and class definitions using dataclasses and enum, in a fresh process after a block."""
    _, address = fake
    out = subprocess.run(
        [sys.executable, "-c", _AFTER_A_BLOCK, address], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_nnd_save_outside_a_block_raises_as_nnsights():
    import nnd

    with pytest.raises(ValueError, match="outside a block"):
        nnd.save(5)
