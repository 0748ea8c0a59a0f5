"""Which class a checkpoint builds and in which dtype, agreed on by the daemon's budgets, the
helper's meta builds and a worker's loading: the pipeline task inferred offline from the config's
architectures, the transformers class, bytes per parameter for each dispatch dtype, and the
experts implementation META models run with. No torch or transformers at import: the control plane
imports it."""

from __future__ import annotations

from typing import Any

from nnd_daemon import errors

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
# The unquantized dtypes a placement may name.
TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64")


def torch_dtype(name: str) -> Any:
    """The torch dtype a placement names ("float16", "torch.float16"); INVALID_ARGUMENT for another."""
    import torch

    key = name.removeprefix("torch.")
    if key not in TORCH_DTYPES:
        raise errors.InvalidArgument(f"unknown dtype {name!r}; use one of {', '.join([*TORCH_DTYPES, *QUANTIZED, 'auto'])}")
    return getattr(torch, key)


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


def default_dtype(config: Any) -> str:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    return name if name in BYTES_PER_PARAM else "float32"


# The experts implementation every META model runs its mixture-of-experts layers with. The META
# model only computes shapes, and of transformers' implementations only batched_mm has shape-only
# kernels for all its ops: grouped_mm's meta kernel accepts only bf16 ("Expected inputs of BF16
# type"), eager loops over `nonzero()` of the routing mask (data-dependent, refused by fake
# tensors), deepgemm/sonicmoe need their GPU kernels. Outputs of every module keep their shapes,
# as tests/test_architectures.py checks against the real forward.
META_EXPERTS = "batched_mm"


def meta_safe_experts(config: Any) -> None:
    """Make `config` (and its sub-configs) build experts that run on the meta device."""
    if hasattr(type(config), "_experts_implementation"):  # transformers >= 5's experts interface
        config._experts_implementation = META_EXPERTS
