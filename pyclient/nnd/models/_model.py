"""`TransformersModel`: a handle on a model the daemon holds."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from nnd.models import _envoy, _placement, _tokenizer
from nnd.tracing import _concrete, _context, _generation, _tracer
from nnd.tracing._proxy import Proxy
from nnd.v1 import nnd_pb2
from nnd.wire._results import StepToken
from nnd.wire.connection import Connection, connect

if TYPE_CHECKING:
    from nnd.models._edit import EditTracer
    from nnd.tracing._session import Session

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

    A transformers model object instead of a name (`TransformersModel(hf_model,
    name=..., tokenizer=...)`) is sent to the daemon as data (config,
    safetensors, tokenizer files) and loaded from there like any model; see
    `nnd.models._upload.UploadedModel`. For any other torch module: `nnd.NNsight`.

    `address`/`token` choose the daemon (default: `$NND_ADDRESS`, else the
    user or system socket; `$NND_TOKEN`). `keep_alive` sets how long the
    dispatched model stays loaded while idle ("5m", seconds, -1 forever).

    `rename` gives modules extra names, as nnsight's `rename=`: keys are
    dotted paths matched from every module (`"transformer.h"`, `"attn"`,
    `"*.h"`) or module classes, values an alias or a list of them
    (`{"transformer.h": "layers"}` makes `model.layers[0]` work). They
    belong to this handle, as in nnsight: another handle of the same model
    may give the same alias to another module. GPT-2, Llama and BERT-like
    models also get a standard set (layers, attention, mlp, final_norm,
    lm_head, embed) that every client and language shares. `edits` opens a named edited
    variant that some client stored with `model.edit(name=...)`.

    Loading the weights (`dispatch()`, `dispatch=True`, or the first trace
    of a model not dispatched yet) shows their progress as `nnd dispatch`
    does: a tqdm bar in a notebook, lines on stderr in a script.
    `progress=False` keeps this handle quiet; `nnd.set_progress(False)` (or
    NND_PROGRESS=0) the whole process.

    `attn_implementation` ("eager", "sdpa", ...) and `config` (a transformers
    config, or its `to_dict()`, used instead of the checkpoint's) reach the
    daemon's META model and every dispatch, as nnsight passes them to
    `from_pretrained`. A handle gets the model it asks for: handles of one
    checkpoint whose options and placement (dtype, device...) agree share one
    loaded model and worker; one that asks otherwise (`dtype="bfloat16"`,
    `attn_implementation="eager"`) gets its own, named `<checkpoint>@<choices>`
    (`model.name`; see docs/protocol.md).
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
        rename: Mapping[Any, str | list[str] | tuple[str, ...]] | None = None,
        edits: str | list[str] | None = None,
        attn_implementation: str | None = None,
        config: Any = None,
        progress: bool | None = None,
        **kwargs: Any,
    ) -> None:
        if "torch_dtype" in kwargs:  # transformers' older spelling
            dtype = kwargs.pop("torch_dtype") if dtype is None else dtype
        distributed = kwargs.pop("distributed_config", None)
        if distributed is not None:  # transformers' DistributedConfig(tp_size=N), as nnsight's page spells it
            size = (
                distributed.get("tp_size")
                if isinstance(distributed, Mapping)
                else getattr(distributed, "tp_size", None)
            )
            if not isinstance(size, int) or size < 1:
                raise TypeError("distributed_config needs a tp_size (transformers' DistributedConfig(tp_size=N))")
            if tp_size is not None and tp_size != size:
                raise TypeError(f"tp_size={tp_size} and distributed_config's tp_size={size} disagree")
            tp_size = size
        # nnsight's tokenizer_kwargs=: how the client's tokenizer is loaded (padding_side=...).
        tokenizer_kwargs = dict(kwargs.pop("tokenizer_kwargs", None) or {})
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
        self._tokenizer_kwargs = tokenizer_kwargs
        # Handles of one loaded model (edited copies too) share this, and may use each other's envoys.
        self._family = object()
        self._edits: list[str] = [edits] if isinstance(edits, str) else list(edits or [])
        self._owned_edits: list[str] = []  # anonymous edits this handle created (clear_edits deletes them)
        request = nnd_pb2.LoadModelRequest(
            model=name_or_path,
            revision=revision or "",
            task=task or "",
            trust_remote_code=trust_remote_code,
            placement=_placement.placement(device=device, device_map=device_map, dtype=dtype, tp_size=tp_size, **extra),
        )
        # The placement this handle asked for: the daemon keeps the first loader's, so dispatch() says it again.
        self._placement = request.placement if request.placement.ListFields() else None
        if keep_alive is not None:
            request.keep_alive = _placement.keep_alive_string(keep_alive)
        request.rename.extend(_renames(rename))
        options = _load_options(attn_implementation, config)
        if options.ListFields():  # a plain load sends what it always sent
            request.options.CopyFrom(options)
        self._info: nnd_pb2.ModelInfo = self._load(request)
        self._name = self._info.name or name_or_path
        self._progress = progress
        if progress is not None:  # the first trace's dispatch (Connection.ensure_dispatched) honours it too
            self._conn.progress[self._name] = progress
        _envoy.build_tree(self, self._info.modules, self)
        if self._edits:
            known = {e.id for e in self.list_edits()}
            missing = [e for e in self._edits if e not in known]
            if missing:
                from nnd.errors import ModelNotFound

                raise ModelNotFound(
                    f"{self._name} has no stored edit {', '.join(map(repr, missing))}; "
                    f"stored: {', '.join(sorted(known)) or 'none'}"
                )
        if dispatch:
            self.dispatch()

    def __new__(cls, name_or_path: Any = None, *args: Any, **kwargs: Any) -> TransformersModel:
        if cls is TransformersModel and name_or_path is not None and not isinstance(name_or_path, (str, os.PathLike)):
            from nnd.models._upload import (
                UploadedModel,  # an in-memory transformers model: sent to the daemon (_upload.py)
            )

            cls = UploadedModel
        return super().__new__(cls)

    def _load(self, request: nnd_pb2.LoadModelRequest) -> nnd_pb2.ModelInfo:
        """LoadModel; handles of models sent from this process upload them first (_upload.py)."""
        return self._conn.call("LoadModel", request)

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
    def device(self) -> Any:
        """Where the weights are, as nnsight's `model.device`: the first
        parameter's device ("meta" until dispatched), asked of the daemon; a
        torch.device when torch is in use, else the name."""
        from nnd.wire import _torchmod

        name = "meta"
        for module in self.info.modules:
            if module.parameters:
                name = module.parameters[0].device or "meta"
                break
        torch = _torchmod.available()
        return torch.device(name) if torch is not None else name

    @property
    def config(self) -> Any:
        """The model's config, as transformers' `model.config`: its config class
        (`model.config.n_head`, `.num_hidden_layers`, `.to_dict()`) when
        transformers is importable, else an `nnd.models._config.Config` with the same
        typed values. Built once per handle from the daemon's description."""
        config = self.__dict__.get("_config")
        if config is None:
            from nnd.models import _config

            # A dispatch's progress replaces _info without the description: GetModel has it.
            info = self._info if self._info.config_json else self.info
            config = _config.build(info.config_json, dict(info.config))
            object.__setattr__(self, "_config", config)
        return config

    @property
    def dtype(self) -> Any:
        """The weights' dtype, as transformers' `model.dtype` (a torch.dtype when torch is in use):
        the dispatched worker's, else the one this handle asked for, else the checkpoint's."""
        from nnd.wire import _dtypes, _torchmod

        name = self._info.dtype
        if not name:
            info = self.info
            asked = self._placement.dtype if self._placement is not None else ""
            name = info.dtype or (asked if asked and asked != "auto" else "") or info.config.get("dtype", "")
            name = name or next((p.dtype for m in info.modules for p in m.parameters if not p.buffer), "float32")
        name = name.removeprefix("torch.")
        torch = _torchmod.available()
        found = getattr(torch, _dtypes.canonical(name), None) if torch is not None else None
        # A quantized weight format ("nf4") has no torch dtype: named as the daemon names it.
        return found if torch is not None and isinstance(found, torch.dtype) else name

    def eval(self) -> TransformersModel:
        """As torch's `model.eval()`: the daemon's model is always in eval mode, so this returns the model."""
        return self

    def train(self, mode: bool = True) -> TransformersModel:
        """As torch's `model.train()`: the daemon keeps its model in eval mode (dropout off) for every
        client, so this returns the model, changing nothing."""
        return self

    @property
    def task(self) -> str:
        return self._info.task

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer: a transformers tokenizer built from the
        daemon's files when transformers is installed, else a small
        `RemoteTokenizer` with encode/decode."""
        if self._tokenizer is None:
            asked = self.__dict__.get("_tokenizer_kwargs", {})
            self._tokenizer = _tokenizer.for_task(_tokenizer.build(self._conn, self._name, **asked), self._info.task, asked)
        return self._tokenizer

    @property
    def generator(self) -> _generation.Generator:
        """Inside `model.generate(...)`: `.output` (generated ids) and
        `.streamer.output` (per-step tokens)."""
        return _generation.Generator()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Inside a block: the model called on traced values (recorded). Outside one, as
        nnsight's `model(**inputs)`: one forward pass on the daemon, returning its output."""
        if _context.current_or_none() is not None:
            return super().__call__(*args, **kwargs)
        with self.trace(*args, **kwargs):
            output = self.output.save()
        return output.value if isinstance(output, Proxy) else output

    def to(self, *args: Any, **kwargs: Any) -> TransformersModel:
        """nnsight's `model.to(device)` (`NNsight(net).to("cuda")`): the device the
        daemon dispatches the weights to, and this handle. A dtype argument is left
        to `dtype=` at load; a model dispatched elsewhere must be released first."""
        device = kwargs.get("device", args[0] if args else None)
        if device is None or not isinstance(device, str) and type(device).__name__ != "device":
            return self  # `.to(dtype)` / `.to(tensor)`: the daemon's placement decides
        wanted = str(device)
        placement = nnd_pb2.Placement()
        if self._placement is not None:
            placement.CopyFrom(self._placement)
        if placement.device == wanted:
            return self
        if not self.__dict__.get("_deferred") and self.dispatched:
            current = str(self.device)
            if current == wanted or current.split(":")[0] == wanted:
                return self
            raise RuntimeError(
                f"{self._name} is dispatched on {current}; release() it before moving it to {wanted} "
                "(the daemon holds one copy of the weights for every client)"
            )
        placement.device = wanted
        placement.ClearField("device_map")
        self._placement = placement
        pending = self.__dict__.get("_deferred_request")
        if pending is not None:  # an NNsight module not yet sent: it loads with this placement
            pending.placement.CopyFrom(placement)
        return self

    # -- lifecycle
    def dispatch(self, progress: bool | Callable[[nnd_pb2.DispatchProgress], None] | None = None) -> TransformersModel:
        """Load the weights now, showing their progress (a tqdm bar in a notebook, lines on stderr
        otherwise). `progress=False` is quiet, a callable is given each progress message instead;
        None: the handle's `progress=`, else the process's setting (`nnd.set_progress`)."""
        from nnd.wire import _progress

        request = nnd_pb2.DispatchRequest(model=self._name)
        if self._placement is not None:
            request.placement.CopyFrom(self._placement)
        chosen = self.__dict__.get("_progress") if progress is None else progress

        def final(info: nnd_pb2.ModelInfo) -> None:
            self._info = info

        _progress.show(self._conn.stream("Dispatch", request), self._name, chosen, on_final=final)
        self._conn._dispatched.add(self._name)  # the next trace needs no check of its own
        return self

    def release(self) -> TransformersModel:
        """End the model's worker so its memory returns; the model stays loaded (META)."""
        self._info = self._conn.call("Release", nnd_pb2.ReleaseRequest(model=self._name))
        self._conn.forget_dispatched(self._name)
        return self

    def unload(self) -> None:
        """Release and forget the model on the daemon."""
        self._conn.call("Unload", nnd_pb2.UnloadRequest(model=self._name))
        self._conn.forget_dispatched(self._name)

    # -- blocks
    def trace(self, *inputs: Any, **options: Any) -> Any:
        """`with model.trace(input):` one forward pass on real weights
        (dispatching first if needed). Without an input, add prompts with
        `tracer.invoke(input)`. `model.trace(input, trace=False)` runs the
        forward at once and returns the model's output, as `model(input)`."""
        if options.pop("trace", True) is False:
            return self(*inputs, **options)
        return _tracer.Tracer(self, *_one(inputs), **options)

    def scan(self, *inputs: Any, **options: Any) -> _tracer.ScanTracer:
        """`with model.scan(input):` run the block with fake tensors on the
        META model: shapes and dtypes, no weights, never dispatches."""
        return _tracer.ScanTracer(self, *_one(inputs), **options)

    def generate(self, *inputs: Any, **options: Any) -> Any:
        """`with model.generate(input, max_new_tokens=N, ...) as tracer:` run
        the block during generation. Options: every keyword transformers'
        generate() takes as a setting (max_new_tokens, do_sample, temperature,
        top_k, num_beams, repetition_penalty, no_repeat_ngram_size,
        pad_token_id, eos_token_id, generation_config=...; the daemon checks
        each against GenerationConfig and refuses an unknown one by name),
        `seed`, and tensors as the forward's inputs (input_ids=, attention_mask=).
        `tracer.result` is the generated ids; loop over steps with
        `tracer.iter[...]` / `tracer.all()`. Called without `with`
        (`ids = model.generate(prompt, max_new_tokens=3)`), it generates at
        once and returns the ids, as nnsight does. `on_token=callback` is
        called with each step's tokens (`.id`, `.text`) as they are generated,
        while the block's interventions apply:
        `on_token=lambda t: print(t.text, end="")` watches a steered generation live."""
        from nnd.tracing import _source

        tracer = _tracer.GenerateTracer(self, *_one(inputs), **options)
        frame = _source.user_frame()
        if frame is None or _source.called_in_with(frame):
            return tracer
        with tracer:
            ids = tracer.result.save()
        return ids._value

    def session(self, **options: Any) -> Session:
        """`with model.session():` — the trace/generate blocks inside run
        together, in order, in one request when the session ends. A value of
        one block can be used in a later one without `.save()`; only saved
        values come back (after the session)."""
        from nnd.tracing._session import Session

        return Session(self, **options)

    # -- persistent edits
    def edit(self, *, inplace: bool = False, name: str | None = None, replace: bool = False) -> EditTracer:
        """Record interventions that the daemon applies before every later
        trace of the edited handle (nnsight's `model.edit()`):

            with model.edit() as (tracer, edited):
                edited.transformer.h[0].mlp.output[:] = 0
            with edited.trace(prompt): ...   # mlp 0 zeroed
            with model.trace(prompt): ...    # unchanged

        `inplace=True` edits this handle (`with model.edit(inplace=True) as
        tracer:`). Edits stack. Other handles and other clients of the same
        model are never affected, unless they open the edit by `name`
        (`TransformersModel(path, edits=name)`); `replace` overwrites a
        stored edit of that name."""
        from nnd.models._edit import EditTracer

        return EditTracer(self, inplace=inplace, name=name, replace=replace)

    def clear_edits(self) -> None:
        """Stop applying this handle's edits (the daemon forgets the unnamed
        ones it created for this handle; named ones stay for other clients)."""
        from nnd.errors import NndError

        for edit_id in self._owned_edits:
            try:
                self._conn.call("DeleteEdit", nnd_pb2.DeleteEditRequest(model=self._name, id=edit_id))
            except NndError:
                pass  # already gone
        self._owned_edits.clear()
        self._edits.clear()

    def list_edits(self) -> list[nnd_pb2.EditInfo]:
        """Every edit the daemon stores for this model (any client's)."""
        response = self._conn.call("ListEdits", nnd_pb2.ListEditsRequest(model=self._name))
        return list(response.edits)

    def delete_edit(self, edit_id: str) -> None:
        """Forget a stored edit (e.g. a named variant) for every client."""
        self._conn.call("DeleteEdit", nnd_pb2.DeleteEditRequest(model=self._name, id=edit_id))
        for ids in (self._edits, self._owned_edits):
            if edit_id in ids:
                ids.remove(edit_id)

    @property
    def edits(self) -> list[str]:
        """The ids of the edits applied to this handle's traces, in order."""
        return list(self._edits)

    def _shallow_copy(self) -> TransformersModel:
        copy = object.__new__(type(self))
        copy.__dict__.update(self.__dict__)
        object.__setattr__(copy, "_edits", list(self._edits))
        object.__setattr__(copy, "_owned_edits", [])
        object.__setattr__(copy, "_shape_cache", _concrete.ShapeCache())
        return copy

    def stream(self, prompt: Any, **options: Any) -> Iterator[StepToken]:
        """Generate without a graph, yielding each step's tokens (`.id`,
        `.text`) as they are produced; breaking out cancels the generation."""
        return _generation.stream(self, prompt, **options)

    def __repr__(self) -> str:
        return super().__repr__()


def _renames(rename: Mapping[Any, Any] | None) -> list[nnd_pb2.Rename]:
    """`rename=` as Rename messages: str keys are paths, class keys match by class name."""
    out = []
    for key, aliases in (rename or {}).items():
        names = [aliases] if isinstance(aliases, str) else list(aliases)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise TypeError(f"rename[{key!r}] must be an alias or a list of aliases (strings)")
        if isinstance(key, type):
            out.append(nnd_pb2.Rename(type=key.__name__, aliases=names))
        elif isinstance(key, str) and key:
            out.append(nnd_pb2.Rename(path=key, aliases=names))
        else:
            raise TypeError(f"rename keys are module paths or classes, not {key!r}")
    return out


def _load_options(attn_implementation: str | None, config: Any) -> nnd_pb2.LoadOptions:
    """`attn_implementation=`/`config=` as data: a config travels as its JSON (to_dict()), never pickled."""
    import json

    out = nnd_pb2.LoadOptions()
    if attn_implementation is not None:
        if not isinstance(attn_implementation, str):
            raise TypeError("attn_implementation must be a name such as 'eager' or 'sdpa'")
        out.attn_implementation = attn_implementation
    if config is not None:
        if hasattr(config, "to_json_string"):  # a transformers PretrainedConfig
            out.config_json = config.to_json_string(use_diff=False)
        elif isinstance(config, Mapping):
            out.config_json = json.dumps(dict(config), sort_keys=True)
        else:
            raise TypeError("config must be a transformers config or a dict of one (its to_dict())")
    return out


def _one(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    if len(inputs) > 1:
        raise TypeError("pass one input (a text, a list of texts or ids); for several prompts use tracer.invoke")
    return inputs


LanguageModel = TransformersModel
