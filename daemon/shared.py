"""Definitions the control plane, the helper and the workers share (the wire contract's keys and
options are nnd/v1/contract.py's): the files a tensor-parallel group
leaves beside its socket, and how a child process dies with the daemon."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import threading
import time
from typing import Any

from nnd.v1.shm import SHM_DIR, alive, reap_dead
from nnd_daemon import errors


def die_with_parent(parent: int) -> None:
    """End this process (a worker, the helper) once `parent`, the daemon, has gone: neither may
    outlive the daemon that supervises it. Polling rather than PR_SET_PDEATHSIG: that signal
    fires when the *thread* that started us ends, and the daemon starts them from short-lived threads."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    if parent:
        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# Tensor-parallel groups (control/tplaunch.py starts them, worker/tp.py runs them).
# Seconds a rank may wait in one collective, or for the other ranks at the end of a request,
# before the group counts as hung and is stopped (env NND_TP_TIMEOUT_S).
DEFAULT_TP_TIMEOUT_S = 300.0


def timeout_s() -> float:
    try:
        return float(os.environ.get("NND_TP_TIMEOUT_S", "") or DEFAULT_TP_TIMEOUT_S)
    except ValueError:
        return DEFAULT_TP_TIMEOUT_S


def pids_path(sock: str) -> str:
    """Rank pids, in rank order, written by rank 0 before it serves."""
    return sock + ".pids"


def reason_path(sock: str) -> str:
    """Why a group stopped itself, written by the rank that stopped it."""
    return sock + ".reason"


# ---------------------------------------------------------------- tensor parallel: config fields
# Config fields that mean "mixture of experts" when positive.
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
# Config fields a TP degree must divide (the column-parallel projections split along them).
DIVIDED_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


# ---------------------------------------------------------------- model classes and dtypes
# (the daemon's budgets, the helper's meta builds and a worker's loading agree on these)

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


def default_dtype(config: Any) -> str:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    return name if name in BYTES_PER_PARAM else "float32"


# ---------------------------------------------------------------- shared memory left behind

_OLD_SEGMENT = re.compile(r"nnd-([0-9]{1,10})-[0-9]{1,12}-[0-9a-f]{8}")  # what workers created before


def remove_segments(pid: int = 0) -> int:
    """Unlink the segments older workers of this user created: worker `pid`'s (called when it is
    gone), or (pid 0, at the daemon's start) those of every worker that is gone; and dead clients' regions."""
    n = 0
    uid = os.geteuid()
    for path in glob.glob(os.path.join(SHM_DIR, "nnd-[0-9]*")):
        m = _OLD_SEGMENT.fullmatch(os.path.basename(path))
        if m is None or (pid and int(m.group(1)) != pid) or (not pid and alive(int(m.group(1)), 0)):
            continue
        with contextlib.suppress(OSError):
            if os.lstat(path).st_uid == uid:
                os.unlink(path)
                n += 1
    return n + reap_dead()


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
