"""gpu: the lab box's figures, on a CUDA GPU (one row saying "no GPU" elsewhere).

- trace overhead over the plain forward, nnd vs nnsight 0.8.1 in-process, on the
  GPT-2-small shape and on a ~1B-parameter Llama shape (bfloat16), all on the GPU;
- generate 32 tokens with one `.save()` per step vs HF generate on the GPU;
- a 256 MiB result made in GPU memory, streamed and through shared memory.

Random weights (tests/support/tinymodels.py's tokenizer), built on the GPU into the run's
temp folder. Times are medians of interleaved repeats after a warm-up, with
`torch.cuda.synchronize()` inside every timed call, so they include the kernels.
Run by `scripts/gpu-check` and `python bench/run.py --only gpu`.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import harness
from harness import PROMPT, Row, ms

NAME = "gpu"
NEW = 32
# NND_GPU_CHECK_DEVICE=cpu runs these rows on the CPU with --quick shapes, to debug the benchmark itself.
DEVICE = os.environ.get("NND_GPU_CHECK_DEVICE", "cuda")


def _sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _llama_1b(folder: pathlib.Path) -> str:
    """A TinyLlama-shaped model (22 layers, 2048 wide, ~1B parameters) in bfloat16, random weights."""
    import tinymodels
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (folder / "config.json").exists():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with harness.quiet():
        tok = tinymodels._tokenizer(folder)
    cfg = LlamaConfig(
        vocab_size=tinymodels.VOCAB,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=512,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()
    return str(folder)


def _trace_rows(d: Any, path: str, label: str, layer: Any, dtype: str, repeats: int) -> list[Row]:
    import nnsight
    import torch

    import nnd

    torch_dtype = getattr(torch, dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, device_map=DEVICE).eval()
    lm = nnsight.LanguageModel(path, tokenizer=tok, device_map=DEVICE, dtype=torch_dtype, dispatch=True)
    ours = nnd.TransformersModel(path, address=d.address, device=DEVICE, dtype=dtype, dispatch=True)
    enc = {k: v.to(DEVICE) for k, v in tok(PROMPT, return_tensors="pt").items()}

    def plain() -> Any:
        with torch.no_grad():
            out = hf(**enc).logits
        _sync()
        return out

    def with_nnsight() -> Any:
        with lm.trace(PROMPT):
            h = layer(lm).output.save()
        _sync()
        return h

    def with_nnd() -> Any:
        with ours.trace(PROMPT):
            h = layer(ours).output.save()
        return h

    t = harness.interleaved({"plain": plain, "nnsight": with_nnsight, "nnd": with_nnd}, warmup=3, repeats=repeats)
    ours.release()
    over_ns, over_nnd = t["nnsight"] - t["plain"], t["nnd"] - t["plain"]
    ratio = over_nnd / over_ns if over_ns > 0 else None
    return [
        Row(f"GPU trace ({label}), vs plain forward", "HF forward in-process", ms(t["plain"]), ms(t["nnd"]),
            t["nnd"] / t["plain"], raw={k + "_s": v for k, v in t.items()}),
        Row(f"GPU trace overhead ({label})", "nnsight overhead", harness.plus_ms(over_ns),
            harness.plus_ms(over_nnd), ratio),
    ]


def _generate_row(d: Any, path: str, label: str) -> Row:
    import torch

    import nnd

    tok, hf = harness.hf_model(path)
    hf = hf.to(DEVICE)
    ours = nnd.TransformersModel(path, address=d.address, device=DEVICE, dispatch=True)
    enc = {k: v.to(DEVICE) for k, v in tok(PROMPT, return_tensors="pt").items()}

    def plain() -> Any:
        with torch.no_grad():
            out = hf.generate(**enc, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        _sync()
        return out

    def with_nnd() -> Any:
        with ours.generate(PROMPT, max_new_tokens=NEW, min_new_tokens=NEW) as tracer:
            for _ in tracer.iter[:]:
                h = ours.transformer.h[0].output.save()
        return h

    t = harness.interleaved({"plain": plain, "nnd": with_nnd}, warmup=1, repeats=7)
    ours.release()
    return Row(f"GPU generate {NEW} tokens, a save per step ({label})", "HF generate in-process",
               ms(t["plain"]), ms(t["nnd"]), t["nnd"] / t["plain"])


def _transfer_rows(d: Any, path: str) -> list[Row]:
    import torch

    import nnd

    n = 64 * 2**20  # float32: 256 MiB
    model = nnd.TransformersModel(path, address=d.address, device=DEVICE, dispatch=True)

    def big(shm: bool) -> Any:
        with model.trace(PROMPT, shm=shm):
            out = model.transformer.h[0].output[0, 0, 0].expand(n).save()
        return out

    def baseline() -> Any:
        with model.trace(PROMPT):
            out = model.transformer.h[0].output[0, 0, 0].expand(n)[:1].save()
        return out

    streamed = big(False)
    for _ in range(3):  # warms the client's region pool
        if not torch.equal(torch.as_tensor(big(True)), torch.as_tensor(streamed)):
            raise RuntimeError("the shared-memory result differs from the streamed one")
    del streamed
    t = harness.interleaved(
        {"base": baseline, "stream": lambda: big(False), "shm": lambda: big(True)}, warmup=1, repeats=7
    )
    model.release()
    nbytes = n * 4

    def rate(seconds: float) -> str:
        return f"{nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s"

    return [
        Row("GPU result of 256 MiB, streamed", "the same trace saving one element", ms(t["base"]),
            f"{ms(t['stream'])} ({rate(t['stream'] - t['base'])} beyond the baseline)", t["stream"] / t["base"]),
        Row("GPU result of 256 MiB, shm=True", "the same trace saving one element", ms(t["base"]),
            f"{ms(t['shm'])} ({rate(t['shm'] - t['base'])} beyond the baseline)", t["shm"] / t["base"]),
    ]


def run(quick: bool) -> list[Row]:
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        return [Row("GPU rows", "-", "-", "no GPU on this machine (run scripts/gpu-check on one)")]
    gpt2 = harness.model("gpt2", layers=4 if quick else 12, width=256 if quick else 768)
    rows: list[Row] = []
    with harness.daemon(NAME) as d:
        small, mid = ("GPT-2 4×256", 2) if quick else ("GPT-2 12×768", 6)
        rows += _trace_rows(d, gpt2, small, lambda m: m.transformer.h[mid], "float32", 30)
        if not quick and DEVICE == "cuda":
            big = _llama_1b(harness.workdir() / "models" / "llama-1b")
            rows += _trace_rows(d, big, "Llama 22×2048, ~1B, bf16", lambda m: m.model.layers[11], "bfloat16", 20)
        rows.append(_generate_row(d, gpt2, small))
        rows += _transfer_rows(d, gpt2)
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "none (dry run on the CPU)"
    for r in rows:
        r.raw["gpu"] = name
    return rows
