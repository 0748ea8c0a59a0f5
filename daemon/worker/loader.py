"""Loading a model's weights in the worker, with the placement it was asked for."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nnd.v1 import nnd_pb2, worker_pb2
from nnd_daemon import errors, loadoptions, modelfiles
from nnd_daemon.modelclass import QUANTIZED, infer_task, model_class, torch_dtype

Report = Callable[[int, int, str], None]


def _device(text: str) -> Any:
    return int(text) if text.isdigit() else text


def from_pretrained_kwargs(placement: nnd_pb2.Placement) -> dict[str, Any]:
    """transformers' loading keywords for a Placement."""
    if placement.tp_size > 1:
        # Tensor parallel (a torchrun rank): transformers places the shards, one rank per device.
        from transformers.distributed import DistributedConfig

        tp: dict[str, Any] = {"distributed_config": DistributedConfig(tp_size=placement.tp_size)}
        if placement.dtype:
            tp["dtype"] = "auto" if placement.dtype == "auto" else torch_dtype(placement.dtype)
        return tp
    kwargs: dict[str, Any] = {}
    if placement.device_map:
        dm = placement.device_map.strip()
        kwargs["device_map"] = json.loads(dm) if dm.startswith("{") else _device(dm)
    elif placement.device:
        kwargs["device_map"] = _device(placement.device)
    else:
        kwargs["device_map"] = "cuda" if torch.cuda.is_available() else "cpu"
    if placement.max_memory:
        kwargs["max_memory"] = {(int(k) if k.isdigit() else k): v for k, v in placement.max_memory.items()}
    dtype = placement.dtype or ""
    on_gpu = torch.cuda.is_available() and "cpu" not in str(kwargs["device_map"])
    if dtype in QUANTIZED:
        from transformers import BitsAndBytesConfig

        compute = (
            torch_dtype(placement.compute_dtype)
            if placement.compute_dtype
            else (torch.bfloat16 if on_gpu else torch.float32)
        )
        if dtype == "int8":
            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
            kwargs["dtype"] = compute
        else:
            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type=dtype, bnb_4bit_compute_dtype=compute
            )
            kwargs["dtype"] = compute
    elif dtype and dtype != "auto":
        kwargs["dtype"] = torch_dtype(dtype)
    elif dtype == "auto":
        kwargs["dtype"] = "auto"
    return kwargs


class _ReportingBar:
    """Wraps transformers' weight-loading progress bar to report each step."""

    def __init__(self, bar: Any, report: Report) -> None:
        self._bar = bar
        self._report = report

    def __iter__(self) -> Iterator[Any]:
        total = int(getattr(self._bar, "total", 0) or 0)
        for done, item in enumerate(self._bar, 1):
            yield item
            self._report(done, total, "tensors")

    def __enter__(self) -> _ReportingBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bar, name)


def load(req: worker_pb2.WorkerLoadRequest, report: Report) -> tuple[torch.nn.Module, Any, str]:
    """Load weights; returns (model, tokenizer, dtype name)."""
    from nnd_daemon.export import exported

    if exported.is_program_dir(req.model):  # an uploaded torch.export program (control/uploads.py)
        return exported.load(req, report)
    common: dict[str, Any] = {"trust_remote_code": req.trust_remote_code}
    if req.revision:
        common["revision"] = req.revision
    # Only the folder's vetted files, pinned open while transformers reads them (modelfiles.py).
    with modelfiles.opened(req.model) as path:
        model, tokenizer = _load(req, path, common, report)
    check_resident(model, req.placement)
    modelfiles.restore_names(req.model, model, tokenizer)
    dtype = req.placement.dtype if req.placement.dtype in QUANTIZED else str(model.dtype).removeprefix("torch.")
    return model, tokenizer, dtype


def _load(req: worker_pb2.WorkerLoadRequest, path: str, common: dict[str, Any], report: Report) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    config = loadoptions.apply(AutoConfig.from_pretrained(path, **common), req.options)
    cls = model_class(config, req.task or infer_task(getattr(config, "architectures", None)))
    kwargs = from_pretrained_kwargs(req.placement)
    if req.options.attn_implementation:  # the config carries it too; from_pretrained checks it here
        kwargs["attn_implementation"] = req.options.attn_implementation

    def hook(factory: Callable[..., Any], args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        kw = {**kw, "disable": True}
        return _ReportingBar(factory(*args, **kw), report)

    previous = hf_logging.set_tqdm_hook(hook) if hasattr(hf_logging, "set_tqdm_hook") else None
    try:
        model = cls.from_pretrained(path, config=config, **common, **kwargs)
    finally:
        if hasattr(hf_logging, "set_tqdm_hook"):
            hf_logging.set_tqdm_hook(previous)
    model.eval()
    model.requires_grad_(False)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **common)
    except Exception:  # noqa: BLE001 - token ids still work without one
        tokenizer = None
    return model, tokenizer


# Where accelerate leaves weights it could not place within max_memory: every request would then fail
# with "Cannot copy out of meta tensor" (or read them back from disk on each forward), so the load fails.
_NOT_RESIDENT = ("meta", "disk")


def check_resident(model: torch.nn.Module, placement: nnd_pb2.Placement) -> None:
    """Fail the load when any weight was left on meta or offloaded to disk, with the figures."""
    placed = weight_bytes(model)
    offloaded = sorted(
        name or "(the whole model)"
        for name, device in (getattr(model, "hf_device_map", None) or {}).items()
        if str(device) in _NOT_RESIDENT
    )
    left = placed.get("meta", 0)
    if not left and not offloaded:
        return
    resident = ", ".join(f"{_mib(n)} on {d}" for d, n in sorted(placed.items()) if d not in _NOT_RESIDENT)
    limits = ", ".join(f"{k}={v}" for k, v in sorted(placement.max_memory.items()))
    if offloaded:
        shown = ", ".join(offloaded[:5]) + (", ..." if len(offloaded) > 5 else "")
        where = f"{len(offloaded)} module(s) offloaded to disk or meta: {shown}"
    else:
        where = "parameters on meta"
    raise errors.ResourceExhausted(
        f"the placement leaves {_mib(left)} of weights off any device ({where}); "
        f"{resident or 'nothing'} is resident"
        + (f", with max_memory {limits}" if limits else "")
        + "; raise max_memory (or --max-memory) or pick a smaller dtype, so that every weight fits on a device"
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of parameters and buffers per device."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        key = str(t.device)
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out


def devices(model: torch.nn.Module) -> dict[str, str]:
    """Parameter/buffer name -> device."""
    named = list(model.named_parameters()) + list(model.named_buffers())
    return {name: str(t.device) for name, t in named}
