"""Tab completion of the module tree (nnd.models._completion): which expressions it walks, and that it
walks them only through envoys (tests/test_notebooks.py asks a real kernel)."""

from __future__ import annotations

import pytest
from fakedaemon import gpt2_modules

from nnd.models import _completion, _envoy


@pytest.fixture(scope="module")
def model() -> _envoy.Envoy:
    root = _envoy.Envoy(None, "", "Module")
    modules = gpt2_modules(2)
    for info in modules:  # the daemon's standard aliases, as it sends them
        if info.path == "transformer.h":
            info.aliases.append("layers")
        if info.path.endswith(".attn"):
            info.aliases.append(info.path.replace(".attn", ".attention"))
    _envoy.build_tree(None, modules, root)
    return root


def names(model: _envoy.Envoy, text: str, **namespace: object) -> set[str]:
    prefix, found = _completion.complete(text, [{"model": model, **namespace}])
    return {name for name, _ in found}


def test_after_an_index_the_blocks_modules_and_api(model):
    assert {"attn", "attention", "mlp", "ln_1", "output", "input", "skip"} <= names(model, "model.transformer.h[0].")
    assert names(model, "model.layers[-1].attention.c_") == {"c_attn", "c_proj"}
    assert names(model, "    y = model.transformer['h'][1].ln") == {"ln_1", "ln_2"}
    assert {"output", "input"} <= names(model, 'model.transformer.h[0]["ln_1"].')  # a leaf: no children, falsy
    kinds = dict(_completion.complete("model.transformer.h[0].", [{"model": model}])[1])
    assert (kinds["mlp"], kinds["output"], kinds["skip"]) == ("instance", "property", "function")


def test_only_envoys_are_walked(model):
    class Pretender:  # claims to be an envoy to isinstance(); its code must not run
        __class__ = property(lambda self: _envoy.Envoy)  # type: ignore[assignment]

        def __getattr__(self, name: str) -> object:
            raise AssertionError("the completer ran user code")

    assert isinstance(Pretender(), _envoy.Envoy)
    assert names(model, "other.transformer.", other=Pretender()) == set()
    assert names(model, "model.output.") == set()  # a property is not evaluated (outside a block it raises)
    assert names(model, "model.transformer.h[2].") == set()  # out of range
    assert names(model, "model.transformer.h[0:1].") == set()  # a slice is a list, not an envoy
    assert names(model, "f(x).model.") == set()  # `model` here is an attribute of something else
    assert names(model, "model._") == set()  # private names are left to IPython
    assert names(model, "nothing.") == set()


def test_dir_is_the_public_api_and_the_modules(model):
    block = dir(model.transformer.h[0])
    assert {"attn", "attention", "mlp", "output", "modules"} <= set(block)
    assert not [n for n in block if n.startswith("_")]
    assert "0" not in dir(model.transformer.h) and "layers" in dir(model)
