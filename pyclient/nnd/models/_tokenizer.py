"""The model's tokenizer on the client."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from nnd.v1 import nnd_pb2

if TYPE_CHECKING:
    from nnd.wire.connection import Connection


def build(conn: Connection, model: str, **kwargs: Any) -> Any:
    """A transformers tokenizer built from the daemon's tokenizer files when
    transformers is installed (`kwargs`: from_pretrained's, as nnsight's
    `tokenizer_kwargs=`), else a `RemoteTokenizer`."""
    if importlib.util.find_spec("transformers") is None:
        return RemoteTokenizer(conn, model)
    files = conn.call("GetTokenizerFiles", nnd_pb2.GetModelRequest(model=model)).files
    folder = tempfile.mkdtemp(prefix="nnd-tokenizer-")
    try:
        for name, content in files.items():
            if os.path.basename(name) != name:
                continue  # a file name is never a path
            with open(os.path.join(folder, name), "wb") as fh:
                fh.write(content)
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        try:
            return AutoTokenizer.from_pretrained(folder, **kwargs)
        except Exception:  # a config naming a class we lack: the fast tokenizer file is enough
            return PreTrainedTokenizerFast.from_pretrained(folder, **kwargs)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# Tasks whose models are encoder-decoders: their batches pad on the right.
_ENCODER_DECODER_TASKS = frozenset({"text2text-generation", "summarization", "translation"})


def for_task(tokenizer: Any, task: str, asked: dict[str, Any] | None = None) -> Any:
    """Set up as nnsight's model.tokenizer is, so that `model.tokenizer(prompts, padding=True)` gives
    the ids nnsight's does: a pad token (the eos token) when the files name none, and padding on the
    left for a model that generates (where nnd's invokes are left-padded too), on the right for an
    encoder-decoder. `asked`: the handle's tokenizer_kwargs; a padding_side named there stays."""
    if not hasattr(tokenizer, "padding_side"):
        return tokenizer  # a RemoteTokenizer: it pads nothing
    if getattr(tokenizer, "pad_token", None) is None and getattr(tokenizer, "eos_token", None) is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if asked and "padding_side" in asked:
        return tokenizer
    if task == "text-generation":
        tokenizer.padding_side = "left"
    elif task in _ENCODER_DECODER_TASKS:
        tokenizer.padding_side = "right"
    return tokenizer


def _rows(ids: Any) -> tuple[list[list[int]], bool]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, int):
        return [[ids]], True
    ids = list(ids)
    if ids and not isinstance(ids[0], (list, tuple)) and not hasattr(ids[0], "tolist"):
        return [[int(i) for i in ids]], True
    return [[int(i) for i in (r.tolist() if hasattr(r, "tolist") else r)] for r in ids], False


class RemoteTokenizer:
    """The daemon's tokenizer through the Tokenize/Decode RPCs (used when
    transformers is not installed)."""

    def __init__(self, conn: Connection, model: str) -> None:
        self._conn = conn
        self._model = model

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one text."""
        return self.batch_encode([text], add_special_tokens=add_special_tokens)[0]

    def batch_encode(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        req = nnd_pb2.TokenizeRequest(model=self._model, texts=texts, no_special_tokens=not add_special_tokens)
        return [list(r.ids) for r in self._conn.call("Tokenize", req).ids]

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, **_: Any) -> dict[str, Any]:
        """`{"input_ids": [...]}` like a transformers tokenizer (no padding)."""
        if isinstance(text, str):
            return {"input_ids": self.encode(text, add_special_tokens)}
        return {"input_ids": self.batch_encode(list(text), add_special_tokens)}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Text of a sequence of ids (an int, a list, or a tensor/array)."""
        rows, _ = _rows(ids)
        return self.batch_decode(rows, skip_special_tokens=skip_special_tokens)[0]

    def batch_decode(self, ids: Any, skip_special_tokens: bool = False) -> list[str]:
        rows, _ = _rows(ids)
        req = nnd_pb2.DecodeRequest(
            model=self._model, ids=[nnd_pb2.TokenIds(ids=r) for r in rows], skip_special_tokens=skip_special_tokens
        )
        return list(self._conn.call("Decode", req).texts)

    def __repr__(self) -> str:
        return f"RemoteTokenizer({self._model!r})"
