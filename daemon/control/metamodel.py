"""The META state of a model: config, tokenizer and module tree on the meta
device. Building it reads no weight byte."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from nnd.v1 import nnd_pb2
from nnd_daemon import errors
from nnd_daemon.control.edits import EditStore

# Architecture-name suffix -> pipeline task, checked in order (longest first
# where one suffix contains another). Inferred offline: nnsight asks the Hub.
_TASK_BY_SUFFIX = [
    ("ForCausalLM", "text-generation"),
    ("LMHeadModel", "text-generation"),
    ("ForMaskedLM", "fill-mask"),
    ("ForSequenceClassification", "text-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForConditionalGeneration", "text2text-generation"),
    ("ForPreTraining", "pretraining"),
]

_AUTO_BY_TASK = {
    "text-generation": "AutoModelForCausalLM",
    "fill-mask": "AutoModelForMaskedLM",
    "text-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "text2text-generation": "AutoModelForSeq2SeqLM",
}

# Bytes per parameter for each dispatch dtype; 4-bit formats carry one
# scale per 64-element block besides the packed nibbles.
BYTES_PER_PARAM = {
    "float32": 4.0,
    "float64": 8.0,
    "float16": 2.0,
    "bfloat16": 2.0,
    "int8": 1.0 + 4.0 / 64,
    "nf4": 0.5 + 4.0 / 64,
    "fp4": 0.5 + 4.0 / 64,
}

QUANTIZED = ("nf4", "fp4", "int8")


def infer_task(architectures: list[str] | None) -> str:
    for arch in architectures or []:
        for suffix, task in _TASK_BY_SUFFIX:
            if arch.endswith(suffix):
                return task
    return "feature-extraction"


def model_class(config: Any, task: str) -> Any:
    """The class to build: the checkpoint's own architecture when transformers
    knows it (so module paths match the weights), else the task's Auto class."""
    import transformers

    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, str(arch), None)
        if cls is not None:
            check_model_class(str(arch), cls)
            return cls
    auto = getattr(transformers, _AUTO_BY_TASK.get(task, "AutoModel"))
    return auto


def check_model_class(arch: str, cls: Any) -> None:
    """Refuse a config whose `architectures` names something in transformers that is
    not a model class (`pipeline`, a tokenizer, a function): nothing else may be built."""
    from transformers import PreTrainedModel

    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise errors.InvalidArgument(
            f"the config's architectures names {arch!r}, which is not a transformers model class"
        )


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


@dataclass
class MetaModel:
    """Everything the daemon keeps for a model that costs (almost) no memory."""

    source: str
    revision: str
    task: str
    config: Any
    tokenizer: Any
    module: Any  # torch.nn.Module on the meta device
    # Scans attach hooks to the shared meta module: one at a time.
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Module aliases (the standard set, then `rename=` entries): an engine.aliases.AliasTable.
    aliases: Any = None
    # Graphs stored by CreateEdit, applied to the requests that name them.
    edits: EditStore = field(default_factory=EditStore)

    def renamed(self, renames: Any) -> Any:
        """The model's aliases plus `LoadModelRequest.rename` entries (all or none), for the one
        handle that asked: the model's own table is left as it was, so handles never collide."""
        import copy

        from nnd_daemon.engine import aliases

        rules = aliases.rules(renames)
        with self.lock:
            table = copy.deepcopy(self.aliases) if self.aliases is not None else aliases.AliasTable.of(self.module)
        table.add_rules(rules)
        return table

    @property
    def architecture(self) -> str:
        return type(self.module).__name__

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def estimate_bytes(self, dtype: str) -> int:
        """Weight bytes needed for `dtype` (the config's dtype when empty/auto)."""
        name = dtype if dtype and dtype != "auto" else default_dtype(self.config)
        per = BYTES_PER_PARAM.get(name, 4.0)
        total = 0
        seen: set[int] = set()  # tied weights count once
        for mod in self.module.modules():
            for p in mod.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                # Quantization packs Linear weights only; the rest keeps its width.
                quantized = name in QUANTIZED and type(mod).__name__ in ("Linear", "Conv1D") and p.dim() == 2
                total += int(p.numel() * (per if quantized or name not in QUANTIZED else 2.0))
        return total

    def summary(self) -> dict[str, str]:
        keys = [
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "n_embd",
            "n_layer",
            "n_head",
            "dtype",
        ]
        out: dict[str, str] = {}
        for key in keys:
            value = getattr(self.config, key, None)
            if value is not None:
                out[key] = str(value)
        return out

    def modules(self, devices: dict[str, str] | None = None) -> list[nnd_pb2.ModuleInfo]:
        devices = devices or {}
        names = self.aliases.aliases_of() if self.aliases is not None else {}
        out = []
        first: dict[int, str] = {}  # id(tensor) -> its first full name (tied weights)
        for path, mod in self.module.named_modules():
            params = []
            for buffer, (name, t) in [(False, p) for p in mod.named_parameters(recurse=False)] + [
                (True, b) for b in mod.named_buffers(recurse=False)
            ]:
                full = f"{path}.{name}" if path else name
                owner = first.setdefault(id(t), full)
                params.append(
                    nnd_pb2.ParameterInfo(
                        name=name,
                        shape=list(t.shape),
                        dtype=str(t.dtype).removeprefix("torch."),
                        device=devices.get(full, "meta"),
                        buffer=buffer,
                        tied_to=owner if owner != full else "",
                    )
                )
            out.append(
                nnd_pb2.ModuleInfo(
                    path=path,
                    type=type(mod).__name__,
                    parameters=params,
                    extra=_extra(mod),
                    aliases=sorted(names.get(path, ())),
                )
            )
        return out


def _extra(mod: Any) -> str:
    # Some leaves (transformers' Conv1D) override __repr__ rather than extra_repr.
    name = type(mod).__name__
    if not any(True for _ in mod.children()):
        text = repr(mod)
        if text.startswith(name + "(") and text.endswith(")") and "\n" not in text:
            return text[len(name) + 1 : -1]
    return mod.extra_repr()


def default_dtype(config: Any) -> str:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    return name if name in BYTES_PER_PARAM else "float32"


def build(source: str, *, revision: str = "", task: str = "", trust_remote_code: bool = False) -> MetaModel:
    """Read config and tokenizer of `source` (repo id or directory) and build the
    module tree on the meta device."""
    from transformers import AutoConfig, AutoTokenizer

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if revision:
        kwargs["revision"] = revision
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
    except OSError as exc:
        where = "directory" if os.path.isdir(source) else "repo id or local path"
        raise errors.NotFound(f"cannot load model {source!r}: no config found for this {where} ({exc})") from None
    except ValueError as exc:
        raise errors.InvalidArgument(f"cannot load model {source!r}: {exc}") from None
    task = task or infer_task(getattr(config, "architectures", None))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except Exception:  # noqa: BLE001 - a model without a tokenizer still traces with token ids
        tokenizer = None
    cls = model_class(config, task)
    module = build_on_meta(cls, config, trust_remote_code)
    module.eval()
    module.requires_grad_(False)
    from nnd_daemon.engine.aliases import AliasTable

    return MetaModel(
        source=source,
        revision=revision,
        task=task,
        config=config,
        tokenizer=tokenizer,
        module=module,
        aliases=AliasTable.of(module),
    )
