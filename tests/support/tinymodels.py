"""Tiny models with random weights and real tokenizer files, built locally.

Nothing is fetched: a byte-level BPE is trained on a few sentences with
`tokenizers`, and GPT-2, Llama and BERT shapes are built from small configs.
"""

from __future__ import annotations

import json
import pathlib

CORPUS = [
    "The Eiffel Tower is in the city of Paris.",
    "The Colosseum is in the city of Rome.",
    "Hello world, this is a tiny model for tests.",
    "Interpretability means looking inside neural networks while they run.",
    "A daemon keeps models loaded so that every notebook shares one copy.",
] * 20

VOCAB = 256 + 64


def _tokenizer(path: pathlib.Path, *, bert: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] if bert else ["<|endoftext|>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="[UNK]" if bert else None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bert:
        cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
        )
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="[UNK]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
        )
    else:
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<pad>"
        )
    fast.save_pretrained(path)
    return fast


def _fix_generation_ids(path: pathlib.Path, ids: dict[str, int]) -> None:
    gen = path / "generation_config.json"
    if gen.exists():
        data = json.loads(gen.read_text())
        data.update(ids)
        gen.write_text(json.dumps(data, indent=2))


def build(kind: str, path: pathlib.Path, *, layers: int = 2, width: int = 64, seed: int = 0) -> pathlib.Path:
    """Write a tiny `kind` ("gpt2", "llama", "bert") model with tokenizer to `path`."""
    import torch
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    path.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(path, bert=(kind == "bert"))
    torch.manual_seed(seed)
    if kind == "gpt2":
        ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=width, n_layer=layers, n_head=4, **ids)
        model = GPT2LMHeadModel(cfg)
    elif kind == "llama":
        ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=width,
            intermediate_size=width * 2,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            tie_word_embeddings=False,
            **ids,
        )
        model = LlamaForCausalLM(cfg)
    elif kind == "bert":
        ids = {"pad_token_id": tok.pad_token_id}
        cfg = BertConfig(
            vocab_size=VOCAB,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=width * 2,
            max_position_embeddings=128,
            **ids,
        )
        model = BertForMaskedLM(cfg)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}")
    model.eval()
    model.save_pretrained(path)
    _fix_generation_ids(path, ids)
    return path


def write_config_only(path: pathlib.Path, config: dict) -> pathlib.Path:
    """A model directory with a config.json and a tokenizer but no weights."""
    path.mkdir(parents=True, exist_ok=True)
    _tokenizer(path)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def private_copy(path: str, dest: pathlib.Path) -> str:
    """A copy of the model at `path` under `dest`: a model (its name is its path) that no other test
    of a shared daemon loads, so a test about one model's state needs no daemon of its own."""
    import shutil

    return str(shutil.copytree(path, dest / pathlib.Path(path).name))
