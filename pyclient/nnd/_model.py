"""`TransformersModel`: a handle on a model the daemon holds."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from nnd import _concrete, _envoy, _generation, _placement, _tokenizer, _tracer
from nnd._results import StepToken
from nnd.connection import Connection, connect
from nnd.v1 import nnd_pb2

_PLACEMENT_KWARGS = ("compute_dtype", "max_memory")


class TransformersModel(_envoy.Envoy):
    """A HuggingFace transformers model held by the nnd daemon.

    Loading reads only the config and tokenizer (the daemon builds the module
    tree on the meta device); the weights load on the first trace, on
    `dispatch()`, or at once with `dispatch=True`. Every option is that of
    transformers' `from_pretrained` (dtype also takes "nf4"/"fp4"/"int8").

        model = nnd.TransformersModel("openai-community/gpt2", device_map="auto")
        with model.trace("The Eiffel Tower is in the city of"):
            logits = model.lm_head.output.save()

    `address`/`token` choose the daemon (default: `$NND_ADDRESS`, else the
    user or system socket; `$NND_TOKEN`). `keep_alive` sets how long the
    dispatched model stays loaded while idle ("5m", seconds, -1 forever).
    """

    def __init__(
        self,
        name_or_path: str,
        *,
        address: str | None = None,
        token: str | None = None,
        device: Any = None,
        device_map: Any = None,
        dtype: Any = None,
        dispatch: bool = False,
        task: str | None = None,
        revision: str | None = None,
        trust_remote_code: bool = False,
        keep_alive: Any = None,
        tp_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if "torch_dtype" in kwargs:  # transformers' older spelling
            dtype = kwargs.pop("torch_dtype") if dtype is None else dtype
        extra = {k: kwargs.pop(k) for k in _PLACEMENT_KWARGS if k in kwargs}
        if kwargs:
            raise TypeError(f"nnd cannot pass these options to the daemon: {', '.join(sorted(kwargs))}")
        if not isinstance(name_or_path, str):
            raise TypeError("nnd loads models by repo id or path; an in-memory model cannot be sent to the daemon")
        if os.path.isdir(name_or_path):  # the daemon may run in another directory
            name_or_path = os.path.abspath(name_or_path)
        super().__init__(self, "", "Module")
        self._conn: Connection = connect(address, token=token)
        self._shape_cache = _concrete.ShapeCache()
        self._tokenizer: Any = None
        request = nnd_pb2.LoadModelRequest(
            model=name_or_path,
            revision=revision or "",
            task=task or "",
            trust_remote_code=trust_remote_code,
            placement=_placement.placement(device=device, device_map=device_map, dtype=dtype, tp_size=tp_size, **extra),
        )
        if keep_alive is not None:
            request.keep_alive = _placement.keep_alive_string(keep_alive)
        self._info: nnd_pb2.ModelInfo = self._conn.call("LoadModel", request)
        self._name = self._info.name or name_or_path
        _envoy.build_tree(self, self._info.modules, self)
        if dispatch:
            self.dispatch()

    # -- about the model
    @property
    def name(self) -> str:
        """The name the daemon knows this model by."""
        return self._name

    @property
    def info(self) -> nnd_pb2.ModelInfo:
        """The daemon's current description of the model (state, memory, placement)."""
        self._info = self._conn.call("GetModel", nnd_pb2.GetModelRequest(model=self._name))
        return self._info

    @property
    def dispatched(self) -> bool:
        """Whether the weights are loaded in a worker (asks the daemon)."""
        return self.info.state == nnd_pb2.DISPATCHED

    @property
    def config(self) -> dict[str, str]:
        """A summary of the model's config (model_type, sizes...) as strings."""
        return dict(self._info.config)

    @property
    def task(self) -> str:
        return self._info.task

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer: a transformers tokenizer built from the
        daemon's files when transformers is installed, else a small
        `RemoteTokenizer` with encode/decode."""
        if self._tokenizer is None:
            self._tokenizer = _tokenizer.build(self._conn, self._name)
        return self._tokenizer

    @property
    def generator(self) -> _generation.Generator:
        """Inside `model.generate(...)`: `.output` (generated ids) and
        `.streamer.output` (per-step tokens)."""
        return _generation.Generator()

    # -- lifecycle
    def dispatch(self, progress: Callable[[nnd_pb2.DispatchProgress], None] | None = None) -> TransformersModel:
        """Load the weights now, calling `progress` with each progress message."""
        for msg in self._conn.stream("Dispatch", nnd_pb2.DispatchRequest(model=self._name)):
            if progress is not None:
                progress(msg)
            if msg.HasField("model"):
                self._info = msg.model
        return self

    def release(self) -> TransformersModel:
        """End the model's worker so its memory returns; the model stays loaded (META)."""
        self._info = self._conn.call("Release", nnd_pb2.ReleaseRequest(model=self._name))
        return self

    def unload(self) -> None:
        """Release and forget the model on the daemon."""
        self._conn.call("Unload", nnd_pb2.UnloadRequest(model=self._name))

    # -- blocks
    def trace(self, *inputs: Any, **options: Any) -> _tracer.Tracer:
        """`with model.trace(input):` one forward pass on real weights
        (dispatching first if needed). Without an input, add prompts with
        `tracer.invoke(input)`."""
        return _tracer.Tracer(self, *_one(inputs), **options)

    def scan(self, *inputs: Any, **options: Any) -> _tracer.ScanTracer:
        """`with model.scan(input):` run the block with fake tensors on the
        META model: shapes and dtypes, no weights, never dispatches."""
        return _tracer.ScanTracer(self, *_one(inputs), **options)

    def generate(self, *inputs: Any, **options: Any) -> _tracer.GenerateTracer:
        """`with model.generate(input, max_new_tokens=N, ...) as tracer:` run
        the block during generation (options: do_sample, temperature, top_k,
        top_p, seed). `tracer.result` is the generated ids; loop over steps
        with `tracer.iter[...]` / `tracer.all()`."""
        return _tracer.GenerateTracer(self, *_one(inputs), **options)

    def stream(self, prompt: Any, **options: Any) -> Iterator[StepToken]:
        """Generate without a graph, yielding each step's tokens (`.id`,
        `.text`) as they are produced; breaking out cancels the generation."""
        return _generation.stream(self, prompt, **options)

    def __repr__(self) -> str:
        return super().__repr__()


def _one(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    if len(inputs) > 1:
        raise TypeError("pass one input (a text, a list of texts or ids); for several prompts use tracer.invoke")
    return inputs


LanguageModel = TransformersModel
