"""User inputs (text, token ids, tensors, tokenizer output) -> Invoke messages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nnd.v1 import nnd_pb2


def to_invokes(data: Any) -> list[nnd_pb2.Invoke]:
    """One Invoke per prompt: a str, a list of str, a list of ids, a list of
    id lists, a 1-D/2-D tensor or array of ids, or a tokenizer's output
    (`input_ids` with an optional `attention_mask`, whose padding is dropped
    since the daemon pads the batch itself)."""
    if isinstance(data, nnd_pb2.Invoke):  # built by the caller (nnd.NNsight's tensor inputs)
        return [data]
    if isinstance(data, str):
        return [nnd_pb2.Invoke(text=data)]
    if isinstance(data, Mapping) or hasattr(data, "keys") and "input_ids" in data:
        return _from_encoding(data)
    rows = _as_rows(data)
    if rows is None:
        raise TypeError(
            f"cannot use a {type(data).__name__} as model input; pass text, a list of token ids, "
            "a tensor of ids, or a tokenizer's output"
        )
    return rows


def _ids(seq: Any) -> list[int]:
    return [int(i) for i in seq]


def _as_rows(data: Any) -> list[nnd_pb2.Invoke] | None:
    if hasattr(data, "tolist") and hasattr(data, "shape"):  # torch tensor / numpy array
        data = data.tolist()
        if isinstance(data, int):
            data = [data]
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        if not data:
            raise ValueError("empty model input")
        if all(isinstance(x, str) for x in data):
            return [nnd_pb2.Invoke(text=x) for x in data]
        if all(_is_int(x) for x in data):
            return [nnd_pb2.Invoke(tokens=nnd_pb2.TokenIds(ids=_ids(data)))]
        if all(isinstance(x, Sequence) or hasattr(x, "tolist") for x in data):
            rows = [_as_rows(x) for x in data]
            if any(r is None or len(r) != 1 for r in rows):
                return None
            return [r[0] for r in rows if r]
    return None


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) or type(x).__name__.startswith(("int", "uint"))


def _from_encoding(enc: Any) -> list[nnd_pb2.Invoke]:
    ids = enc["input_ids"]
    ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
    if ids and _is_int(ids[0]):
        ids = [ids]
    mask = enc.get("attention_mask") if hasattr(enc, "get") else None
    if mask is not None:
        mask = mask.tolist() if hasattr(mask, "tolist") else list(mask)
        if mask and _is_int(mask[0]):
            mask = [mask]
        ids = [[t for t, m in zip(row, mrow, strict=True) if m] for row, mrow in zip(ids, mask, strict=True)]
    return [nnd_pb2.Invoke(tokens=nnd_pb2.TokenIds(ids=_ids(row))) for row in ids]


def merge(invokes: list[nnd_pb2.Invoke]) -> nnd_pb2.Invoke:
    """Several prompts as one invoke (`tracer.invoke([a, b])`): one batch row each."""
    if len(invokes) == 1:
        return invokes[0]
    prompts = nnd_pb2.Prompts()
    kinds = {inv.WhichOneof("input") for inv in invokes}
    if kinds == {"text"}:
        prompts.text.extend(inv.text for inv in invokes)
    elif kinds == {"tokens"}:
        prompts.tokens.extend(inv.tokens for inv in invokes)
    else:
        raise TypeError("the prompts of one invoke must all be texts or all be token ids")
    return nnd_pb2.Invoke(prompts=prompts)


def keyword_invokes(data: Any, kwargs: dict[str, Any], tokenize: Any = None) -> list[nnd_pb2.Invoke]:
    """Invokes from an input and the forward's keyword inputs (nnsight's `trace(input_ids=...,
    attention_mask=..., decoder_input_ids=...)` or `trace(**tokenizer_output)`).

    `input_ids`/`attention_mask` become token rows; every other keyword travels
    as `Invoke.kwargs` (tensors row-aligned with the prompts). With several
    prompts and keyword inputs, the prompts form one invoke. `tokenize(text)`
    (for `tokenizer_kwargs=`) tokenizes text here instead of in the daemon."""
    from nnd.wire import _codec

    kwargs = dict(kwargs)
    if "input_ids" in kwargs:
        if data is not None:
            raise TypeError("pass the input positionally or as input_ids=, not both")
        data = {"input_ids": kwargs.pop("input_ids")}
        if kwargs.get("attention_mask") is not None:
            data["attention_mask"] = kwargs.pop("attention_mask")
    kwargs.pop("attention_mask", None)  # the daemon builds the mask of the padded batch
    if data is None:
        raise TypeError("no input: pass a prompt, token ids or input_ids=")
    if tokenize is not None and (isinstance(data, str) or _all_str(data)):
        texts = [data] if isinstance(data, str) else list(data)
        data = [list(tokenize(t)) for t in texts]
    invokes = to_invokes(data)
    if not kwargs:
        return invokes
    invoke = merge(invokes)
    for name, value in kwargs.items():
        invoke.kwargs[name].CopyFrom(_codec.encode(value))
    return [invoke]


def _all_str(data: Any) -> bool:
    return isinstance(data, (list, tuple)) and bool(data) and all(isinstance(x, str) for x in data)
