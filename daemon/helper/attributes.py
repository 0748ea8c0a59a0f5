"""What a META model says of itself beyond its tree: the config as data, and
each module's plain attributes (`self_attn.head_dim`, `num_key_value_groups`),
so client code that reads them runs as it does on the module itself.

Only plain values travel, bounded: numbers, flags, short strings, small lists
of those. Tensors, modules, callables and objects never do (nothing here is
evaluated by the client either: it is JSON)."""

from __future__ import annotations

import json
import math
from typing import Any

MAX_KEYS = 64  # attributes per module (a transformers module has about ten)
MAX_STRING = 256  # characters of one string attribute
MAX_ITEMS = 16  # items of one tuple/list attribute
CONFIG_MARK = {"$config": True}  # "this attribute is the model's config" (the client has it whole)


def _plain(value: Any, nested: bool = False) -> tuple[bool, Any]:
    """(fits, the value as JSON data)."""
    if value is None or isinstance(value, bool):
        return True, value
    if isinstance(value, int):
        return abs(value) < 2**63, value
    if isinstance(value, float):
        return math.isfinite(value), value
    if isinstance(value, str):
        return len(value) <= MAX_STRING, value
    if isinstance(value, (tuple, list)) and not nested and len(value) <= MAX_ITEMS:
        items = [_plain(v, nested=True) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    return False, None


def of_module(module: Any, config: Any) -> str:
    """The module's own plain attributes as a JSON object ("" when it has none)."""
    out: dict[str, Any] = {}
    for name, value in vars(module).items():
        if name.startswith("_") or name == "training" or len(out) >= MAX_KEYS:
            continue
        if config is not None and value is config:
            out[name] = CONFIG_MARK
            continue
        ok, plain = _plain(value)
        if ok:
            out[name] = plain
    # A parameter or buffer registered as None (a Linear built with bias=False has `bias = None`)
    # reads as None on the module: real code tests `if proj.bias is not None`.
    for table in (getattr(module, "_parameters", {}), getattr(module, "_buffers", {})):
        for name, value in table.items():
            if value is None and len(out) < MAX_KEYS:
                out.setdefault(name, None)
    return json.dumps(out, allow_nan=False) if out else ""


def config_json(config: Any) -> str:
    """The whole config and its class's attribute aliases (n_head for num_attention_heads), as JSON."""
    if config is None or not hasattr(config, "to_dict"):
        return ""
    aliases = getattr(type(config), "attribute_map", None) or {}
    data = {"config": config.to_dict(), "aliases": {str(k): str(v) for k, v in aliases.items()}}
    return json.dumps(data, default=str)
