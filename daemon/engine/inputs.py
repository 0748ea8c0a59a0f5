"""Invokes -> one batch: left-padded token ids, attention mask, position ids, or stacked tensors.

Each invoke owns a range of batch rows; module values with `invoke` set are
views of those rows.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from nnd.v1 import nnd_pb2

from .. import errors
from . import modules, wire


@dataclass
class Batch:
    size: int
    rows: list[tuple[int, int]]  # per invoke: [start, stop)
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)  # unpadded token counts (text/token invokes)
    positions: list[list[int]] = field(default_factory=list)  # per row, what position_ids would be (text/tokens)

    def to(self, device: torch.device | str) -> Batch:
        def move(x: Any) -> Any:
            return x.to(device) if isinstance(x, torch.Tensor) else x

        return Batch(
            self.size,
            self.rows,
            tuple(move(a) for a in self.args),
            {k: move(v) for k, v in self.kwargs.items()},
            self.lengths,
            self.positions,
        )


def input_device(model: torch.nn.Module) -> torch.device:
    """Where the model wants its inputs: its input embeddings, else its first parameter (worked out once
    per model: its placement is fixed for its life, a dispatch loads a new one)."""
    try:
        return _input_devices[model]
    except (KeyError, TypeError):
        pass
    device = _input_device(model)
    try:
        _input_devices[model] = device
    except TypeError:  # not weakly referenceable
        pass
    return device


_input_devices: weakref.WeakKeyDictionary[torch.nn.Module, torch.device] = weakref.WeakKeyDictionary()


def _input_device(model: torch.nn.Module) -> torch.device:
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
        except (NotImplementedError, AttributeError):
            emb = None
        weight = getattr(emb, "weight", None)
        if isinstance(weight, torch.Tensor):
            return weight.device
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


def accepts(model: torch.nn.Module, name: str) -> bool:
    return modules.accepts(model, name)


_TEXT_CACHE_SIZE = 1024
_text_cache: weakref.WeakKeyDictionary[Any, collections.OrderedDict[str, tuple[int, ...]]] = weakref.WeakKeyDictionary()
_text_lock = threading.Lock()


def text_ids(tokenizer: Any, text: str) -> tuple[int, ...]:
    """`tokenizer(text)`'s input ids, remembered for the last prompts of each tokenizer.

    Notebooks and benchmarks send the same prompts again and again, and the
    tokenizer's Python wrapper costs about a fifth of a small model's forward."""
    with _text_lock:
        try:
            cache = _text_cache.setdefault(tokenizer, collections.OrderedDict())
        except TypeError:  # not weakly referenceable: no cache
            cache = None
        if cache is not None and text in cache:
            cache.move_to_end(text)
            return cache[text]
    ids = tuple(int(i) for i in tokenizer(text)["input_ids"])
    if cache is not None:
        with _text_lock:
            cache[text] = ids
            while len(cache) > _TEXT_CACHE_SIZE:
                cache.popitem(last=False)
    return ids


def _token_ids(invoke: nnd_pb2.Invoke, tokenizer: Any, index: int) -> list[int]:
    if invoke.HasField("tokens"):
        ids = [int(i) for i in invoke.tokens.ids]
    else:
        if tokenizer is None:
            raise errors.InvalidArgument(f"invoke {index} has text but the model has no tokenizer")
        ids = list(text_ids(tokenizer, invoke.text))
    if not ids:
        raise errors.InvalidArgument(f"invoke {index} has no tokens")
    return ids


def pad_id(tokenizer: Any) -> int:
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if isinstance(value, int):
            return value
        if isinstance(value, list) and value:
            return int(value[0])
    return 0


def _rows_of(invoke: nnd_pb2.Invoke, tokenizer: Any, index: int) -> list[list[int]]:
    """The token ids of each batch row an invoke owns (several for `Prompts`)."""
    if invoke.WhichOneof("input") != "prompts":
        return [_token_ids(invoke, tokenizer, index)]
    rows = [nnd_pb2.Invoke(text=t) for t in invoke.prompts.text]
    rows += [nnd_pb2.Invoke(tokens=t) for t in invoke.prompts.tokens]
    if not rows:
        raise errors.InvalidArgument(f"invoke {index} has an empty list of prompts")
    return [_token_ids(row, tokenizer, index) for row in rows]


def _kwargs(invokes: Sequence[nnd_pb2.Invoke], rows: list[tuple[int, int]]) -> dict[str, Any]:
    """Invoke.kwargs joined into the batch: tensors with one row per batch row concatenated."""
    names = set(invokes[0].kwargs)
    if any(set(inv.kwargs) != names for inv in invokes):
        raise errors.InvalidArgument("every invoke must give the same keyword inputs (Invoke.kwargs)")
    out: dict[str, Any] = {}
    for name in sorted(names):
        column = [wire.decode_value(inv.kwargs[name]) for inv in invokes]
        batched = [
            isinstance(c, torch.Tensor) and c.dim() > 0 and c.shape[0] == stop - start
            for c, (start, stop) in zip(column, rows, strict=True)
        ]
        if all(batched):
            try:
                out[name] = torch.cat(column, dim=0)
            except RuntimeError as e:
                raise errors.InvalidArgument(f"keyword input {name!r} of the invokes cannot be batched: {e}") from e
        elif not any(isinstance(c, torch.Tensor) for c in column) and all(c == column[0] for c in column):
            out[name] = column[0]
        else:
            raise errors.InvalidArgument(
                f"keyword input {name!r}: give each invoke a tensor with one row per prompt, or one equal plain value"
            )
    return out


# A batch's padded tokens (rows x longest row) are bounded by this many full-length rows: many short
# invokes pass, as many long ones as the activations of 64 longest rows allow.
BATCH_TOKENS_PER_LENGTH = 64


def _tokens(invokes: Sequence[nnd_pb2.Invoke], tokenizer: Any, max_len: int) -> Batch:
    per_invoke = [_rows_of(inv, tokenizer, i) for i, inv in enumerate(invokes)]
    seqs = [seq for rows in per_invoke for seq in rows]
    longest = max(len(s) for s in seqs)
    if max_len and longest > max_len:
        raise errors.ResourceExhausted(f"an invoke has {longest} tokens, over the limit max_sequence_length={max_len}")
    if max_len and len(seqs) * longest > BATCH_TOKENS_PER_LENGTH * max_len:
        raise errors.ResourceExhausted(
            f"the padded batch holds {len(seqs)} rows x {longest} tokens, over the limit of "
            f"{BATCH_TOKENS_PER_LENGTH} x max_sequence_length={max_len} tokens; split the prompts into several traces"
        )
    pad = pad_id(tokenizer)
    # Left padding (the last token of every row is at -1), built as Python lists: two tensors in all,
    # not four small tensor writes per row on every request.
    ids = torch.tensor([[pad] * (longest - len(seq)) + list(seq) for seq in seqs], dtype=torch.long)
    mask = torch.tensor([[0] * (longest - len(seq)) + [1] * len(seq) for seq in seqs], dtype=torch.long)
    # What the mask's running count minus one gives, clamped at 0 (pads at 0, each row's tokens from 0),
    # as a list: one tensor, not three small ops on the mask. Used when the model takes positions (build).
    positions = [[0] * (longest - len(seq)) + list(range(len(seq))) for seq in seqs]
    kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    spans: list[tuple[int, int]] = []
    for rows in per_invoke:
        start = spans[-1][1] if spans else 0
        spans.append((start, start + len(rows)))
    extra = _kwargs(invokes, spans)
    clash = set(extra) & set(kwargs)
    if clash:
        raise errors.InvalidArgument(f"{', '.join(sorted(clash))} come from the invokes' tokens, not Invoke.kwargs")
    kwargs.update(extra)
    return Batch(len(seqs), spans, (), kwargs, [len(s) for s in seqs], positions)


def _tensors(invokes: Sequence[nnd_pb2.Invoke]) -> Batch:
    per_invoke = [[wire.decode_value(v) for v in inv.args] for inv in invokes]
    width = len(per_invoke[0])
    if any(len(a) != width for a in per_invoke):
        raise errors.InvalidArgument("every invoke must pass the same number of positional args")
    rows: list[tuple[int, int]] = []
    start = 0
    for i, args in enumerate(per_invoke):
        first = args[0]
        if not isinstance(first, torch.Tensor) or first.dim() == 0:
            raise errors.InvalidArgument(f"invoke {i}: the first arg must be a tensor with a batch dimension")
        rows.append((start, start + first.shape[0]))
        start += first.shape[0]
    args: list[Any] = []
    for pos in range(width):
        column = [a[pos] for a in per_invoke]
        if all(isinstance(c, torch.Tensor) and c.dim() > 0 for c in column):
            try:
                args.append(torch.cat(column, dim=0))
            except RuntimeError as e:
                raise errors.InvalidArgument(f"positional arg {pos} of the invokes cannot be batched: {e}") from e
        elif all(c == column[0] for c in column):
            args.append(column[0])
        else:
            raise errors.InvalidArgument(f"positional arg {pos} differs between invokes and is not a tensor")
    return Batch(start, rows, tuple(args))


def build(
    model: torch.nn.Module,
    tokenizer: Any,
    invokes: Sequence[nnd_pb2.Invoke],
    *,
    max_sequence_length: int = 0,
) -> Batch:
    """The model's inputs for these invokes (on the CPU; the caller moves them)."""
    if not invokes:
        raise errors.InvalidArgument("the request has no invoke: give at least one input")
    kinds = {inv.WhichOneof("input") or ("args" if inv.args else None) for inv in invokes}
    if None in kinds:
        raise errors.InvalidArgument("an invoke has no input: give text, token ids or args")
    if "args" in kinds:
        if len(kinds) > 1:
            raise errors.InvalidArgument("invokes with tensor args cannot be mixed with text or token invokes")
        return _tensors(invokes)
    batch = _tokens(invokes, tokenizer, max_sequence_length)
    if accepts(model, "position_ids") and "position_ids" not in batch.kwargs:  # the caller's own win
        # Left padding shifts every row; without explicit positions GPT-2 would number the pads.
        batch.kwargs["position_ids"] = torch.tensor(batch.positions, dtype=torch.long)
    return batch
