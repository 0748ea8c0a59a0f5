"""Generation helpers: streaming tokens, and nnsight's `model.generator`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from nnd.tracing import _context, _inputs
from nnd.tracing._proxy import Proxy
from nnd.v1 import graph_pb2, nnd_pb2
from nnd.wire._results import StepToken

if TYPE_CHECKING:
    from nnd.models._model import TransformersModel


GENERATE_OPTIONS = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "stream_text",
        "num_beams",
        "num_return_sequences",
        "generation_config",
    }
)


# Keywords that are always the model's inputs, whatever their value (generate(input_ids=[[...]])).
_INPUT_NAMES = frozenset({"input_ids", "attention_mask", "inputs_embeds", "position_ids", "token_type_ids"})


def is_model_input(name: str, value: Any) -> bool:
    """Whether a keyword of `generate(...)` is a forward input (a tensor or array, or an input name)
    rather than a generation setting: every other keyword is a setting of transformers' generate
    (pad_token_id=, repetition_penalty=...), which the daemon checks against GenerationConfig."""
    return name in _INPUT_NAMES or hasattr(value, "shape") and hasattr(value, "dtype")


def generate_options(**opts: Any) -> nnd_pb2.GenerateOptions:
    """The GenerateOptions of a block's settings: nnd's own fields, and every other keyword
    (transformers' generate() settings) laid over `generation_config=` as its JSON."""
    # On the wire 0 means "not given" (the default length): an explicit 0 or less is refused here, as
    # transformers' generate refuses it, rather than quietly generating the default number of tokens.
    asked = opts.get("max_new_tokens")
    if asked is not None and int(asked) < 1:
        raise ValueError(f"`max_new_tokens` must be greater than 0, but is {asked}.")
    gen = nnd_pb2.GenerateOptions(
        max_new_tokens=int(opts.get("max_new_tokens") or 0),
        min_new_tokens=int(opts.get("min_new_tokens") or 0),
        do_sample=bool(opts.get("do_sample") or False),
        temperature=float(opts.get("temperature") or 0.0),
        top_k=int(opts.get("top_k") or 0),
        top_p=float(opts.get("top_p") or 0.0),
        stream_text=bool(opts.get("stream_text", True)),
    )
    if opts.get("seed") is not None:
        gen.seed = int(opts["seed"])
    gen.num_beams = int(opts.get("num_beams") or 0)
    gen.num_return_sequences = int(opts.get("num_return_sequences") or 0)
    config = opts.get("generation_config")
    fields: dict[str, Any] = {}
    if config is not None:
        # A transformers GenerationConfig (or a dict of its fields), sent as JSON: data, not an object.
        fields.update(config if isinstance(config, dict) else config.to_diff_dict())
    # generate(..., repetition_penalty=1.2, pad_token_id=0): over the config, as transformers lays them.
    fields.update({k: _plain(v) for k, v in opts.items() if k not in GENERATE_OPTIONS})
    if fields:
        import json

        try:
            gen.generation_config_json = json.dumps(fields)
        except TypeError as err:
            raise TypeError(f"generation settings must be plain values (numbers, flags, token id lists): {err}") from None
    return gen


def _plain(value: Any) -> Any:
    """A setting as JSON data: tensors and arrays of token ids as lists, tuples as lists."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def stream(model: TransformersModel, prompt: Any, **opts: Any) -> Iterator[StepToken]:
    """Yield each step's tokens as the daemon produces them. Closing the
    iterator (or leaving the loop early) cancels the generation."""
    timeout = opts.pop("timeout", None)  # the rest are generation settings, checked by the daemon
    request = nnd_pb2.TraceRequest(
        model=model.name, invokes=_inputs.to_invokes(prompt), graph=graph_pb2.Graph(), generate=generate_options(**opts)
    )
    request.edits.extend(model._edits)  # an edited handle streams what its generate blocks generate
    responses = model._conn.stream("Generate", request, timeout=timeout)
    steps = 0
    try:
        for msg in responses:
            if msg.WhichOneof("kind") == "step":
                steps += 1
                yield StepToken(msg.step.step, tuple(msg.step.ids), tuple(msg.step.text))
    except KeyboardInterrupt:
        # Ctrl-C while waiting for the next token: the call is cancelled (finally, below); one line that
        # says how far it got, as a generate block's, instead of gRPC's and threading's frames.
        total = request.generate.max_new_tokens
        raise KeyboardInterrupt(
            f"nnd: interrupted: cancelled after {steps} of {total or 'its'} steps; the daemon stopped the request"
        ) from None
    finally:
        responses.close()  # type: ignore[attr-defined]  # a generator: closing cancels the call


class _Streamer:
    @property
    def output(self) -> Proxy:
        """What transformers hands a streamer, as nnsight gives it: in a pass of a
        `tracer.iter` loop that step's ids (the prompt's at step 0, then the id the
        previous step chose); at the top of the block its first value, the prompt's ids."""
        tracer = _context.current("`model.generator.streamer.output`")
        proxy = Proxy(tracer, None)
        # Where it was read: inside a pass of a `tracer.iter` loop it is that step's tokens.
        tracer._client_scopes[id(proxy)] = (proxy, tracer._builder.scope)
        scope = tracer._builder.scope
        if (scope == 0 or scope in tracer._unrolled) and tracer._streamed_result is None:
            # At step 0 nnsight's streamer holds the prompt's ids: the result's first columns.
            builder = tracer._builder
            builder._scopes.append(0)
            try:
                tracer._streamed_result = tracer.result.save()
            finally:
                builder._scopes.pop()
        return proxy


class Generator:
    """nnsight's `model.generator`: `.output` is the generated ids,
    `.streamer.output` the per-step tokens."""

    streamer = _Streamer()

    @property
    def output(self) -> Proxy:
        """Deprecated (as in nnsight): the generated token ids; read `tracer.result`."""
        import warnings

        warnings.warn(
            "model.generator.output is deprecated; use tracer.result instead "
            "(model.generator.streamer.output still gives per-step tokens).",
            FutureWarning,
            stacklevel=2,
        )
        return _context.current("`model.generator.output`").result
