"""Tiny builds of many transformers architectures, for the architecture matrix.

Each entry is a model type and the config keys that make it tiny (2 layers,
hidden 32-64, the 320-token vocabulary of tinymodels' tokenizer); `build`
writes weights, tokenizer and generation ids the way tinymodels.build does.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from typing import Any

import tinymodels

W = 64
_DECODER: dict[str, Any] = {
    "hidden_size": W,
    "intermediate_size": 2 * W,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
_MOE: dict[str, Any] = {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}


@dataclass(frozen=True)
class Arch:
    """A model type, the auto class that builds it, and the keys that make it tiny."""

    model_type: str
    layers: str  # the real path of the layer stack the standard `layers` alias names
    task: str = "causal"  # "causal", "masked" or "seq2seq"
    config: dict[str, Any] = field(default_factory=dict)


ARCHS: dict[str, Arch] = {
    "gpt2": Arch("gpt2", "transformer.h", config={"n_embd": W, "n_layer": 2, "n_head": 4, "n_positions": 128}),
    "gpt_neox": Arch(
        "gpt_neox",
        "gpt_neox.layers",
        config={**_DECODER, "num_key_value_heads": 4, "rotary_pct": 0.5, "use_parallel_residual": True},
    ),
    "llama": Arch("llama", "model.layers", config=_DECODER),
    "mistral": Arch("mistral", "model.layers", config={**_DECODER, "head_dim": 16, "sliding_window": 64}),
    "qwen2": Arch("qwen2", "model.layers", config=_DECODER),
    "qwen3": Arch("qwen3", "model.layers", config={**_DECODER, "head_dim": 16}),
    "gemma": Arch("gemma", "model.layers", config={**_DECODER, "head_dim": 16}),
    "gemma2": Arch("gemma2", "model.layers", config={**_DECODER, "head_dim": 16, "sliding_window": 64}),
    "gemma3": Arch("gemma3_text", "model.layers", config={**_DECODER, "head_dim": 16, "sliding_window": 64}),
    "phi3": Arch("phi3", "model.layers", config=_DECODER),
    "opt": Arch(
        "opt",
        "model.decoder.layers",
        config={
            "hidden_size": W,
            "ffn_dim": 2 * W,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 128,
            "word_embed_proj_dim": W,
        },
    ),
    "gptj": Arch(
        "gptj", "transformer.h", config={"n_embd": W, "n_layer": 2, "n_head": 4, "n_positions": 128, "rotary_dim": 8}
    ),
    "falcon": Arch(
        "falcon",
        "transformer.h",
        config={
            "hidden_size": W,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "new_decoder_architecture": False,
            "multi_query": True,
            "alibi": False,
            "max_position_embeddings": 128,
        },
    ),
    "mamba": Arch(
        "mamba",
        "backbone.layers",
        config={"hidden_size": W, "num_hidden_layers": 2, "state_size": 8, "expand": 2, "conv_kernel": 4},
    ),
    "mixtral": Arch("mixtral", "model.layers", config={**_MOE, "head_dim": 16}),
    "qwen2_moe": Arch(
        "qwen2_moe",
        "model.layers",
        config={
            **_DECODER,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": W,
            "shared_expert_intermediate_size": W,
        },
    ),
    "olmoe": Arch("olmoe", "model.layers", config={**_DECODER, "num_experts": 4, "num_experts_per_tok": 2}),
    "bert": Arch(
        "bert",
        "bert.encoder.layer",
        task="masked",
        config={
            "hidden_size": W,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "intermediate_size": 2 * W,
            "max_position_embeddings": 128,
        },
    ),
    "t5": Arch(
        "t5",
        "decoder.block",
        task="seq2seq",
        config={"d_model": W, "d_ff": 2 * W, "d_kv": 16, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4},
    ),
}


def build_config(kind: str, path: pathlib.Path, *, seed: int = 0) -> pathlib.Path:
    """Write the tiny `kind` (a key of ARCHS) with random weights and a tokenizer to `path`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    arch = ARCHS[kind]
    path.mkdir(parents=True, exist_ok=True)
    tok = tinymodels._tokenizer(path, bert=arch.task == "masked")
    if arch.task == "masked":
        ids = {"pad_token_id": tok.pad_token_id}
    else:
        ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    if arch.task == "seq2seq":
        ids["decoder_start_token_id"] = tok.pad_token_id
    config = AutoConfig.for_model(arch.model_type, vocab_size=tinymodels.VOCAB, **arch.config, **ids)
    auto = {"causal": AutoModelForCausalLM, "masked": AutoModelForMaskedLM, "seq2seq": AutoModelForSeq2SeqLM}
    torch.manual_seed(seed)
    model = auto[arch.task].from_config(config)
    model.eval()
    model.save_pretrained(path)
    tinymodels._fix_generation_ids(path, ids)
    return path
