"""LoadModelRequest.options (nnsight's `attn_implementation=` and `config=`): checked in the
daemon, applied to the checkpoint's config where a model is built (the helper's META model, the
worker's weights), so scans and traces see the same module tree."""

from __future__ import annotations

import importlib.util
import json
import re
from typing import Any

from nnd.v1 import nnd_pb2
from nnd_daemon import errors
from nnd_daemon.modelclass import QUANTIZED

# A config is a few KiB (a large label map: a few MiB), as config.json files are.
MAX_CONFIG_JSON_BYTES = 16 * 2**20


# Deeper than any config (a vision config in a composite one: 3 or 4 levels). JSON nested
# 100,000 deep stops json's parser at Python's recursion limit (it guards itself); what parses is
# then measured without recursion, so nothing after (transformers' from_dict copies configs
# recursively) meets a config deeper than this.
MAX_CONFIG_DEPTH = 64

# The attention implementations transformers ships in its own tree, each with the package it needs.
# Anything else ("org/repo" above all) is a Hub kernel: code downloaded and run. An allow-list.
IN_TREE_ATTENTION = {
    "eager": None,
    "sdpa": None,
    "flash_attention_2": "flash_attn",
    "flash_attention_3": "flash_attn_interface",
}


def check(options: nnd_pb2.LoadOptions) -> None:
    """Refuse options no config could be built from, before the helper sees them."""
    if len(options.config_json) > MAX_CONFIG_JSON_BYTES:
        raise errors.ResourceExhausted(
            f"options.config_json is {len(options.config_json)} bytes, over the limit of "
            f"{MAX_CONFIG_JSON_BYTES} bytes a config may have"
        )
    if options.attn_implementation:
        check_attention(options.attn_implementation, "options.attn_implementation")
    if options.config_json:
        _check_config_values(_config_dict(options.config_json))


def check_attention(value: object, where: str) -> None:
    """`value` names an in-tree attention implementation whose package is installed (or is a
    per-sub-config dict of them, as transformers also accepts)."""
    if value is None:
        return
    if isinstance(value, dict):
        for key, sub in value.items():
            check_attention(sub, f"{where}[{str(key)[:40]!r}]")
        return
    if not isinstance(value, str) or value not in IN_TREE_ATTENTION:
        raise errors.InvalidArgument(
            f"{where} is {str(value)[:80]!r}: use one of {', '.join(IN_TREE_ATTENTION)} (the implementations "
            "transformers ships; kernels from the Hub, 'org/repo', are never loaded)"
        )
    package = IN_TREE_ATTENTION[value]
    if package and importlib.util.find_spec(package) is None:
        raise errors.InvalidArgument(
            f"{where} is {value!r}, which needs the {package} package; it is not installed where this daemon runs "
            "(use 'sdpa' or 'eager')"
        )


def _check_config_values(data: dict[str, Any]) -> None:
    # Every spelling transformers reads (attn_implementation, _attn_implementation,
    # _attn_implementation_internal), at any level: text_config, vision_config, ...; and the
    # dtypes transformers turns into torch attributes (getattr(torch, name)).
    stack: list[tuple[str, Any]] = [("config_json", data)]
    while stack:
        where, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for key, value in items:
            here = f"{where}.{key}" if isinstance(node, dict) else f"{where}[{key}]"
            name = str(key).lstrip("_")
            if isinstance(node, dict) and name.startswith("attn_implementation"):
                if name.endswith("_autoset") and isinstance(value, bool):
                    continue
                check_attention(value, f"options.{here}")
            elif isinstance(node, dict) and name in ("dtype", "torch_dtype"):
                _check_config_dtype(value, f"options.{here}")
            elif isinstance(value, (dict, list)):
                stack.append((here, value))


def _check_config_dtype(value: object, where: str) -> None:
    if value is None or (isinstance(value, str) and value.removeprefix("torch.") in (*FLOAT_DTYPES, "auto")):
        return
    raise errors.InvalidArgument(f"{where} is {str(value)[:80]!r}: use one of {', '.join(FLOAT_DTYPES)} or 'auto'")


def _too_deep(data: Any) -> bool:
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_CONFIG_DEPTH:
            return True
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _config_dict(text: str) -> dict[str, Any]:
    deep = errors.InvalidArgument(f"options.config_json nests deeper than {MAX_CONFIG_DEPTH} levels; no config does")
    try:
        data = json.loads(text)
    except RecursionError:
        raise deep from None
    except ValueError as exc:
        raise errors.InvalidArgument(f"options.config_json is not JSON: {exc}") from None
    if _too_deep(data):
        raise deep
    if not isinstance(data, dict):
        raise errors.InvalidArgument("options.config_json must be a JSON object (a config's to_dict())")
    return data


def apply(config: Any, options: nnd_pb2.LoadOptions) -> Any:
    """The config a model is built from: the caller's config (`config_json`) if any, else the
    checkpoint's, with the caller's attention implementation."""
    if options.config_json:
        data = _config_dict(options.config_json)
        kind = data.get("model_type", "")
        if kind != getattr(config, "model_type", ""):
            raise errors.InvalidArgument(
                f"config= is a {kind or 'config without model_type'!r} config; the checkpoint's is "
                f"{config.model_type!r}: its weights would not fit"
            )
        try:
            config = type(config).from_dict(data)
        except (TypeError, ValueError) as exc:
            raise errors.InvalidArgument(f"config= cannot be built: {type(exc).__name__}: {exc}") from None
    if options.attn_implementation:
        config._attn_implementation = options.attn_implementation
    return config


def describe(options: nnd_pb2.LoadOptions) -> str:
    """The options as an error message names them."""
    parts = []
    if options.attn_implementation:
        parts.append(f"attn_implementation={options.attn_implementation!r}")
    if options.config_json:
        parts.append("a config= of its own")
    return ", ".join(parts) or "no load options"


# What a Placement may say (transformers' device_map/dtype vocabulary); anything else is the
# client's mistake, refused before a worker starts rather than failing inside torch.
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
_DEVICE = re.compile(r"cpu|mps|cuda|cuda:\d{1,4}|xpu|xpu:\d{1,4}|\d{1,4}")
_DEVICE_MAP_WORDS = ("auto", "balanced", "balanced_low_0", "sequential")
_SIZE = re.compile(r"\d{1,20}(\.\d{1,6})?\s*([KMGT]i?B|B)?", re.IGNORECASE)
MAX_DEVICE_MAP_BYTES = 2**20


def check_placement(placement: nnd_pb2.Placement) -> None:
    """Refuse a placement transformers could not load with, naming the field."""
    dtype = placement.dtype.removeprefix("torch.")
    if dtype and dtype not in (*FLOAT_DTYPES, "auto", *QUANTIZED):
        raise errors.InvalidArgument(
            f"placement dtype {placement.dtype[:80]!r} is not one of {', '.join([*FLOAT_DTYPES, *QUANTIZED, 'auto'])}"
        )
    compute = placement.compute_dtype.removeprefix("torch.")
    if compute and compute not in FLOAT_DTYPES:
        raise errors.InvalidArgument(
            f"placement compute_dtype {placement.compute_dtype[:80]!r} is not one of {', '.join(FLOAT_DTYPES)}"
        )
    if placement.device and not _DEVICE.fullmatch(placement.device):
        raise errors.InvalidArgument(
            f"placement device {placement.device[:80]!r} is not a device (cpu, cuda, cuda:N, N, mps)"
        )
    _check_device_map(placement.device_map.strip())
    for key, value in placement.max_memory.items():
        if not _DEVICE.fullmatch(key):
            raise errors.InvalidArgument(f"max_memory names {key[:80]!r}, which is not a device (cpu, N, cuda:N)")
        if not _SIZE.fullmatch(value.strip()):
            raise errors.InvalidArgument(f"max_memory[{key!r}] is {value[:80]!r}: give a size such as 20GiB")


def _check_device_map(text: str) -> None:
    if not text:
        return
    if not text.startswith("{"):
        if not (_DEVICE.fullmatch(text) or text in _DEVICE_MAP_WORDS):
            raise errors.InvalidArgument(
                f"device_map {text[:80]!r} is neither a device (cpu, cuda:N, N) nor one of "
                f"{', '.join(_DEVICE_MAP_WORDS)} nor a JSON object of module -> device"
            )
        return
    if len(text) > MAX_DEVICE_MAP_BYTES:
        raise errors.InvalidArgument(f"device_map is {len(text)} bytes; at most {MAX_DEVICE_MAP_BYTES}")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise errors.InvalidArgument("device_map is not a JSON object of module -> device") from None
    if not isinstance(data, dict):
        raise errors.InvalidArgument("device_map is not a JSON object of module -> device")
    for module, device in data.items():
        ok = (isinstance(device, int) and not isinstance(device, bool) and 0 <= device < 10_000) or (
            isinstance(device, str) and _DEVICE.fullmatch(device) is not None
        )
        if not ok:
            raise errors.InvalidArgument(
                f"device_map[{module[:80]!r}] is {str(device)[:80]!r}, which is not a device (cpu, cuda:N, N)"
            )
