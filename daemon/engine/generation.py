"""Generate mode: HF `generate` with per-step token streaming and cancellation."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from nnd.v1 import contract, nnd_pb2

from .. import errors
from .inputs import Batch, pad_id
from .limits import EngineLimits


@dataclass
class Options:
    max_new_tokens: int
    kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    stream_text: bool = False


# What a client's generation settings may be: a field transformers' GenerationConfig
# itself declares, set to plain data (a flag, a number, None, or a short list of
# token ids / numbers). Strings and objects never pass: they name code, files,
# models or registries (custom_generate, cache_implementation, watermarking_config,
# compile_config...), and no value of the request is ever evaluated.
_CONFIG_IGNORED = frozenset({"transformers_version", "_from_model_config"})
MAX_CONFIG_ITEMS = 4096  # numbers in one field's (nested) lists: bad_words_ids, suppress_tokens...


def config_fields() -> frozenset[str]:
    """The public fields of transformers' GenerationConfig, read off a fresh one (no hand list)."""
    from transformers import GenerationConfig

    return frozenset(k for k in vars(GenerationConfig()) if not k.startswith("_") and k not in _CONFIG_IGNORED)


def _plain(value: Any, depth: int = 0) -> int:
    """How many numbers `value` holds, if it is plain data; else -1."""
    if value is None or isinstance(value, (bool, int, float)):
        return 1
    if isinstance(value, list) and depth < 2:
        counts = [_plain(v, depth + 1) for v in value]
        return -1 if any(c < 0 for c in counts) else sum(counts)
    return -1


def _config(text: str) -> dict[str, Any]:
    """A client's generation settings (GenerationConfig JSON and generate() keywords), checked
    against GenerationConfig's own fields, each plain data."""
    import json

    try:
        data = json.loads(text)
    except ValueError as e:
        raise errors.InvalidArgument(f"generate.generation_config_json is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise errors.InvalidArgument("generate.generation_config_json must be a JSON object")
    data = {k: v for k, v in data.items() if k not in _CONFIG_IGNORED}
    fields = config_fields()
    unknown = sorted(set(data) - fields)
    if unknown:
        raise errors.InvalidArgument(
            f"generate() got unknown generation option(s) {', '.join(map(repr, unknown))}: not a field of "
            "transformers' GenerationConfig (model inputs are tensors, e.g. input_ids=, attention_mask=)"
        )
    for key, value in data.items():
        count = _plain(value)
        if count < 0:
            raise errors.InvalidArgument(
                f"generation option {key!r} is a {type(value).__name__}; the daemon takes flags, numbers "
                "and lists of token ids as generation settings, nothing that names code, files or objects"
            )
        if count > MAX_CONFIG_ITEMS:
            raise errors.InvalidArgument(f"generation option {key!r} holds {count} numbers, over {MAX_CONFIG_ITEMS}")
    return data


def options(msg: nnd_pb2.GenerateOptions, limits: EngineLimits) -> Options:
    config = _config(msg.generation_config_json) if msg.generation_config_json else {}
    n = msg.max_new_tokens or int(config.get("max_new_tokens") or 0) or contract.DEFAULT_MAX_NEW_TOKENS
    if n < 0:
        raise errors.InvalidArgument(f"generate.max_new_tokens must be positive, got {n}")
    if limits.max_new_tokens and n > limits.max_new_tokens:
        raise errors.ResourceExhausted(
            f"generate.max_new_tokens={n} is over the limit max_new_tokens={limits.max_new_tokens}"
        )
    if msg.temperature < 0:
        raise errors.InvalidArgument(f"generate.temperature must not be negative, got {msg.temperature}")
    if msg.top_k < 0:
        raise errors.InvalidArgument(f"generate.top_k must not be negative, got {msg.top_k}")
    if not 0 <= msg.top_p <= 1:
        raise errors.InvalidArgument(f"generate.top_p must be in (0, 1], got {msg.top_p}")
    if msg.num_beams < 0 or msg.num_return_sequences < 0:
        raise errors.InvalidArgument("generate.num_beams and num_return_sequences must not be negative")
    kwargs: dict[str, Any] = {}
    if config:  # the caller's config over the model's (generate()); the explicit options below over both
        kwargs["generation_config"] = config
    kwargs["max_new_tokens"] = n
    if msg.do_sample or "do_sample" not in config:
        kwargs["do_sample"] = msg.do_sample
    if msg.num_beams:
        kwargs["num_beams"] = msg.num_beams
    if msg.num_return_sequences:
        kwargs["num_return_sequences"] = msg.num_return_sequences
    if msg.min_new_tokens:
        if not 0 < msg.min_new_tokens <= n:
            raise errors.InvalidArgument(
                f"generate.min_new_tokens must be between 1 and max_new_tokens={n}, got {msg.min_new_tokens}"
            )
        kwargs["min_new_tokens"] = msg.min_new_tokens
    if msg.do_sample:  # sampling settings only mean something when sampling (HF warns otherwise)
        if msg.temperature:
            kwargs["temperature"] = msg.temperature
        if msg.top_k:
            kwargs["top_k"] = msg.top_k
        if msg.top_p:
            kwargs["top_p"] = msg.top_p
    seed = msg.seed if msg.HasField("seed") else None
    return Options(n, kwargs, seed, msg.stream_text)


_TOKEN_TEXTS = 1 << 16  # per tokenizer: about a vocabulary
_token_texts: weakref.WeakKeyDictionary[Any, dict[int, str]] = weakref.WeakKeyDictionary()


def token_text(tokenizer: Any, token: int) -> str:
    """`tokenizer.decode([token])`, remembered: every step of every generation decodes its new tokens,
    and one decode costs as much as a small model's hook."""
    try:
        texts = _token_texts.setdefault(tokenizer, {})
    except TypeError:  # not weakly referenceable: no memo
        return str(tokenizer.decode([token]))
    text = texts.get(token)
    if text is None:
        text = str(tokenizer.decode([token]))
        if len(texts) < _TOKEN_TEXTS:
            texts[token] = text
    return text


class StepStreamer(BaseStreamer):
    """Emits one StepTokens per generation step (HF first `put`s the prompt, which is skipped)."""

    def __init__(
        self,
        emit: Callable[[nnd_pb2.TraceResponse], None],
        rows: list[tuple[int, int]],
        tokenizer: Any,
        stream_text: bool,
        cancelled: Callable[[], bool],
        between: Callable[[], None] | None = None,
    ) -> None:
        self.between = between
        self.emit = emit
        self.rows = rows
        self.tokenizer = tokenizer
        self.stream_text = stream_text
        self.cancelled = cancelled
        self.step = -1

    def put(self, value: torch.Tensor) -> None:
        if self.step < 0:
            self.step = 0
            return
        # A step's new tokens, one per row (transformers puts them as a 1-d tensor; a 2-d one: the last column).
        flat = value.tolist() if value.dim() == 1 else value.reshape(value.shape[0], -1)[:, -1].tolist()
        ids = [int(flat[start]) for start, _ in self.rows]
        # Filled in place: building it from keyword arguments cost twice as much (~30 against ~19 µs a
        # step between two forwards, where little of it is in the caches).
        response = nnd_pb2.TraceResponse()
        tokens = response.step
        tokens.SetInParent()  # step 0 with no rows is still a step
        tokens.step = self.step
        tokens.ids.extend(ids)
        if self.stream_text and self.tokenizer is not None:
            tokens.text.extend(token_text(self.tokenizer, i) for i in ids)
        self.emit(response)
        self.step += 1
        if self.cancelled():
            raise errors.Cancelled("the request was cancelled")
        if self.between is not None:  # between two forwards: other requests may take a turn
            self.between()
            if self.cancelled():
                raise errors.Cancelled("the request was cancelled")

    def end(self) -> None:
        pass


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Put torch's random state back as it was: sampling continues as if nothing ran meanwhile."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _position_table_size(model: torch.nn.Module) -> int:
    """Rows of the model's learned position-embedding table (GPT-2's wpe,
    BERT's position_embeddings), or 0 when positions are not learned."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if not isinstance(limit, int):
        return 0
    for name, module in model.named_modules():
        last = name.rpartition(".")[2]
        learned = isinstance(module, torch.nn.Embedding) and module.num_embeddings == limit
        if learned and ("pos" in last or last == "wpe"):
            return limit
    return 0


def generate(
    model: torch.nn.Module,
    tokenizer: Any,
    batch: Batch,
    opts: Options,
    emit: Callable[[nnd_pb2.TraceResponse], None],
    cancelled: Callable[[], bool],
    between: Callable[[], None] | None = None,
) -> torch.Tensor:
    """The generated ids (batch, prompt + new tokens); `between` is called after each step."""
    if "input_ids" not in batch.kwargs:
        raise errors.InvalidArgument("generate needs text or token invokes")
    if not callable(getattr(model, "generate", None)):
        raise errors.InvalidArgument(f"{type(model).__name__} cannot generate")
    inputs = {k: v for k, v in batch.kwargs.items() if k != "position_ids"}  # HF derives them from the mask
    # A learned position table ends somewhere (rotary positions do not): say so
    # before the forward fails with an opaque index error past the end.
    limit = _position_table_size(model)
    prompt = int(inputs["input_ids"].shape[1])
    if limit and prompt + opts.max_new_tokens > limit:
        raise errors.InvalidArgument(
            f"the prompt ({prompt} tokens) plus max_new_tokens={opts.max_new_tokens} exceeds the "
            f"model's {limit} learned positions; ask for at most {max(0, limit - prompt)} new tokens"
        )
    kwargs = dict(opts.kwargs)
    config = kwargs.pop("generation_config", None)
    if config is not None:
        # transformers lays the caller's config over the model's, as it does in-process (nnsight).
        from transformers import GenerationConfig

        kwargs["generation_config"] = GenerationConfig(**config)
    beams = int(kwargs.get("num_beams") or (config or {}).get("num_beams") or 1)
    # transformers streams greedy and sampled decoding only; beam search returns at the end.
    streamer = StepStreamer(emit, batch.rows, tokenizer, opts.stream_text, cancelled, between) if beams == 1 else None
    if opts.seed is not None:
        torch.manual_seed(opts.seed)
    if "pad_token_id" not in kwargs and "pad_token_id" not in (config or {}):
        kwargs["pad_token_id"] = pad_id(tokenizer)  # the client's own pad_token_id= wins
    out = model.generate(**inputs, **kwargs, streamer=streamer)
    # return_dict_in_generate=True: the ids are the output's `sequences` (what the result carries).
    return out.sequences if hasattr(out, "sequences") else out
