"""META models, built in the helper process: config, tokenizer and module tree
on the meta device (no weight byte read), and the description of one that the
daemon keeps instead of the module (control/metamodel.py)."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from nnd.v1 import helper_pb2, nnd_pb2
from nnd_daemon import errors, loadoptions, modelfiles
from nnd_daemon.helper import attributes
from nnd_daemon.modelclass import BYTES_PER_PARAM, QUANTIZED, default_dtype, infer_task, meta_safe_experts, model_class
from nnd_daemon.tpgroup import DIVIDED_FIELDS, MOE_FIELDS

# A config.json is a few KiB (a large label map: a few MiB). Anything bigger is
# refused before it is read: parsing a huge (or sparse) file only costs memory.
MAX_CONFIG_BYTES = 16 * 2**20


@dataclass
class Built:
    """A META model as the helper holds it."""

    ref: helper_pb2.HelperModel
    task: str
    config: Any
    tokenizer: Any
    module: Any  # torch.nn.Module on the meta device
    # Client types/descriptions of an exported program's modules (modules.json).
    types: dict[str, tuple[str, str]] = field(default_factory=dict)
    # Scans attach hooks to the shared module: one at a time.
    lock: threading.Lock = field(default_factory=threading.Lock)


def check_config_file(folder: str) -> None:
    """Refuse a config.json that is not a regular file of sane size, before parsing it."""
    path = os.path.join(folder, "config.json")
    try:
        st = os.stat(path)
    except OSError:
        return  # no config: from_pretrained says so in its own words
    import stat

    if not stat.S_ISREG(st.st_mode):
        raise errors.InvalidArgument(f"{path} is not a regular file")
    if st.st_size > MAX_CONFIG_BYTES:
        raise errors.ResourceExhausted(
            f"config.json is {st.st_size} bytes, over the limit of {MAX_CONFIG_BYTES} bytes a config may have"
        )


def build(ref: helper_pb2.HelperModel) -> Built:
    if ref.exported:
        return _build_exported(ref)
    from transformers import AutoConfig, AutoTokenizer

    source = ref.source
    kwargs: dict[str, Any] = {"trust_remote_code": ref.trust_remote_code}
    if ref.revision:
        kwargs["revision"] = ref.revision
    # Only the folder's vetted files, pinned open while transformers reads them (modelfiles.py).
    with modelfiles.opened(source) as path:
        if os.path.isdir(path):
            check_config_file(path)
        try:
            config = AutoConfig.from_pretrained(path, **kwargs)
        except OSError as exc:
            where = "directory" if os.path.isdir(source) else "repo id or local path"
            raise errors.NotFound(f"cannot load model {source!r}: no config found for this {where} ({exc})") from None
        except ValueError as exc:
            raise errors.InvalidArgument(f"cannot load model {source!r}: {exc}") from None
        config = loadoptions.apply(config, ref.options)
        task = ref.task or infer_task(getattr(config, "architectures", None))
        try:
            tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        except Exception:  # noqa: BLE001 - a model without a tokenizer still traces with token ids
            tokenizer = None
    modelfiles.restore_names(source, config, tokenizer)
    cls = model_class(config, task)
    meta_safe_experts(config)
    module = build_on_meta(cls, config, ref.trust_remote_code)
    module.eval()
    module.requires_grad_(False)
    return Built(ref=ref, task=task, config=config, tokenizer=tokenizer, module=module)


def build_on_meta(cls: Any, config: Any, trust_remote_code: bool) -> Any:
    """`cls` built from `config` on the meta device; a config it cannot be built from
    (an overflowing vocab_size, a negative width) is the client's error, not ours."""
    import torch

    try:
        with torch.device("meta"):
            if hasattr(cls, "_from_config"):
                return cls._from_config(config)
            return cls.from_config(config, trust_remote_code=trust_remote_code)
    except (OverflowError, ValueError, TypeError, RuntimeError, IndexError, ZeroDivisionError) as exc:
        raise errors.InvalidArgument(
            f"cannot build {getattr(cls, '__name__', cls)} from this config: {type(exc).__name__}: {exc}"
        ) from None


def _build_exported(ref: helper_pb2.HelperModel) -> Built:
    from nnd_daemon.export import exported

    module = exported.build(ref.source, on_meta=True)
    module.eval()
    return Built(
        ref=ref, task=ref.task, config=None, tokenizer=None, module=module, types=exported.module_types(ref.source)
    )


def describe(built: Built) -> helper_pb2.MetaDescription:
    module = built.module
    out = helper_pb2.MetaDescription(
        task=built.task,
        num_parameters=sum(p.numel() for p in module.parameters()),
        has_tokenizer=built.tokenizer is not None,
    )
    out.modules.extend(_modules(built))
    if built.ref.exported:
        floats = [str(p.dtype).removeprefix("torch.") for p in module.parameters() if p.is_floating_point()]
        dtype = max(set(floats), key=floats.count) if floats else "float32"
        out.architecture = built.types.get("", ("ExportedProgram", ""))[0]
        out.summary.update({"model_type": "exported", "format": "torch.export", "dtype": dtype})
        out.default_dtype = dtype
        out.tp_config_json = json.dumps({"model_type": "exported"})
        for name in ["", *BYTES_PER_PARAM]:
            out.estimated_bytes[name] = _exported_bytes(module, name)
        return out
    config = built.config
    out.architecture = type(module).__name__
    out.summary.update(_summary(config))
    out.default_dtype = default_dtype(config)
    out.tp_config_json = json.dumps(_tp_config(config))
    out.config_json = attributes.config_json(config)
    for name in ["", *BYTES_PER_PARAM]:
        out.estimated_bytes[name] = _estimate_bytes(module, name or out.default_dtype)
    return out


def _estimate_bytes(module: Any, name: str) -> int:
    per = BYTES_PER_PARAM.get(name, 4.0)
    total = 0
    seen: set[int] = set()  # tied weights count once
    for mod in module.modules():
        for p in mod.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            # Quantization packs Linear weights only; the rest keeps its width.
            quantized = name in QUANTIZED and type(mod).__name__ in ("Linear", "Conv1D") and p.dim() == 2
            total += int(p.numel() * (per if quantized or name not in QUANTIZED else 2.0))
    return total


def _exported_bytes(module: Any, dtype: str) -> int:
    from nnd_daemon.modelclass import torch_dtype

    width = torch_dtype(dtype).itemsize if dtype and dtype not in ("auto", *QUANTIZED) else None
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        size = width if width and t.is_floating_point() else t.element_size()
        total += t.numel() * size
    return total


_SUMMARY_KEYS = (
    "model_type hidden_size num_hidden_layers num_attention_heads num_key_value_heads intermediate_size "
    "vocab_size max_position_embeddings n_embd n_layer n_head dtype"
).split()


def _summary(config: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for key in _SUMMARY_KEYS:
        value = getattr(config, key, None)
        if value is not None:
            out[key] = str(value)
    return out


def _tp_config(config: Any) -> dict[str, Any]:
    """What control/tplaunch.check reads of a config (its text config), as plain data."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out: dict[str, Any] = {"model_type": getattr(text, "model_type", "") or getattr(config, "model_type", "?")}
    for f in (*MOE_FIELDS, *DIVIDED_FIELDS):
        value = getattr(text, f, None)
        if isinstance(value, int):
            out[f] = value
    plan = getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    out["base_model_tp_plan"] = bool(plan)
    return out


def _modules(built: Built) -> list[nnd_pb2.ModuleInfo]:
    out = []
    first: dict[int, str] = {}  # id(tensor) -> its first full name (tied weights are listed once)
    for path, mod in built.module.named_modules():
        params = []
        tensors = [(False, p) for p in mod.named_parameters(recurse=False)]
        tensors += [(True, b) for b in mod.named_buffers(recurse=False)]
        for buffer, (name, t) in tensors:
            full = f"{path}.{name}" if path else name
            owner = first.setdefault(id(t), full)
            params.append(
                nnd_pb2.ParameterInfo(
                    name=name,
                    shape=list(t.shape),
                    dtype=str(t.dtype).removeprefix("torch."),
                    device="meta",
                    buffer=buffer,
                    tied_to=owner if owner != full else "",
                )
            )
        info = nnd_pb2.ModuleInfo(
            path=path,
            type=type(mod).__name__,
            parameters=params,
            extra=_extra(mod),
            attributes_json=attributes.of_module(mod, built.config),
        )
        original = built.types.get(path)
        if original is not None:
            info.type, info.extra = original
        out.append(info)
    return out


def _extra(mod: Any) -> str:
    # Some leaves (transformers' Conv1D) override __repr__ rather than extra_repr.
    name = type(mod).__name__
    if not any(True for _ in mod.children()):
        text = repr(mod)
        if text.startswith(name + "(") and text.endswith(")") and "\n" not in text:
            return text[len(name) + 1 : -1]
    return mod.extra_repr()
