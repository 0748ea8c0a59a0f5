"""The op whitelist: the one table of everything a graph may call.

Each entry says how to run the op and two facts the graph checks need:
whether it writes into args[0] (`mutates`) and whether its result may share
memory with args[0] (`aliases`, so an in-place write through it reaches the
module value it came from). Nothing outside this table runs.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from .. import errors


class OpContext(Protocol):
    """What context ops need from the executor."""

    def call_module(self, path: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class OpSpec:
    fn: Callable[..., Any]
    mutates: bool = False
    aliases: bool = False
    # fn takes the OpContext as its first argument.
    context: bool = False


# Attributes "getattr" may read: tensor facts and model-output fields, never parameters or methods.
TENSOR_ATTRIBUTES = ("shape", "dtype", "T", "mT", "ndim", "device", "requires_grad", "is_floating_point", "data")
OUTPUT_ATTRIBUTES = (
    "logits",
    "loss",
    "hidden_states",
    "attentions",
    "past_key_values",
    "last_hidden_state",
    "pooler_output",
    "cross_attentions",
    "sequences",
    "scores",
)
# Fields of the named tuples reductions return (topk, max/min with dim, sort, kthvalue, median...).
RESULT_ATTRIBUTES = ("values", "indices")
ATTRIBUTES: tuple[str, ...] = TENSOR_ATTRIBUTES + OUTPUT_ATTRIBUTES + RESULT_ATTRIBUTES


def _getattr(x: Any, name: Any) -> Any:
    if not isinstance(name, str) or name not in ATTRIBUTES:
        raise errors.InvalidArgument(f"attribute {name!r} is not allowed; allowed: {', '.join(ATTRIBUTES)}")
    if name in OUTPUT_ATTRIBUTES and isinstance(x, dict):
        if name not in x:
            raise errors.InvalidArgument(f"the value has no field {name!r}; it has: {', '.join(map(str, x))}")
        return x[name]
    if name in RESULT_ATTRIBUTES and not (isinstance(x, tuple) and hasattr(type(x), "n_fields")):
        raise errors.InvalidArgument(
            f"{name!r} is a field of what topk/sort/max(dim=...) return, not of a {type(x).__name__}"
        )
    if not hasattr(x, name):
        raise errors.InvalidArgument(f"a value of type {type(x).__name__} has no attribute {name!r}")
    value = getattr(x, name)
    return value() if name == "is_floating_point" else value


def _requires_grad_(x: Any, requires_grad: Any = True) -> Any:
    """`x.requires_grad_(flag)` on a value of the request (never a weight: those never get gradients)."""
    if not isinstance(x, torch.Tensor) or isinstance(x, torch.nn.Parameter):
        raise errors.InvalidArgument(f"requires_grad_ applies to a tensor the model computed, not a {type(x).__name__}")
    return x.requires_grad_(bool(requires_grad))


def _retain_grad(x: Any) -> None:
    """`x.retain_grad()`: nnd serves gradients through `.grad` in a backward block, so this
    only checks, as torch does, that the value can have one."""
    if not isinstance(x, torch.Tensor):
        raise errors.InvalidArgument(f"retain_grad applies to a tensor, not a {type(x).__name__}")
    if torch.is_grad_enabled() and x.requires_grad:
        x.retain_grad()


def _to_tuple(x: Any) -> tuple[Any, ...]:
    """`output.to_tuple()` on a model output: its fields that are set, in order (the engine may hold an
    invoke's share of one as a dict of those fields)."""
    if isinstance(x, dict):  # a transformers ModelOutput is an OrderedDict of its set fields
        return tuple(x.values())
    raise AttributeError(f"to_tuple applies to a model output (logits, hidden states...), not a {type(x).__name__}")


def _slice(start: Any = None, stop: Any = None, step: Any = None) -> slice:
    """`x[:, : h.size(1) - 1]`: a slice whose bounds the graph computes (the client sends this op only when a
    bound is a traced value). Each bound must be an integer, as Python's own indexing asks."""
    try:
        return slice(*(None if b is None else operator.index(b) for b in (start, stop, step)))
    except TypeError as e:
        raise errors.InvalidArgument(f"a slice bound must be an integer: {e}") from None


def _setitem(target: Any, index: Any, value: Any) -> None:
    target[index] = value


def _method_or_function(name: str, *, functional: bool = False) -> Callable[..., Any]:
    """`x.name(*rest)` when args[0] is a tensor with that method, else torch(.nn.functional).name(*args)."""
    function = getattr(F, name, None) if functional else None
    if function is None:
        function = getattr(torch, name, None)
    has_method = hasattr(torch.Tensor, name)

    def run(*args: Any, **kwargs: Any) -> Any:
        if has_method and args and isinstance(args[0], torch.Tensor):
            return getattr(args[0], name)(*args[1:], **kwargs)
        if function is None:
            raise TypeError(f"{name}() needs a tensor as its first argument")
        return function(*args, **kwargs)

    return run


def _function(function: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *args, **kwargs: function(*args, **kwargs)


# `torch.nn.functional` by rule, not by list: a public name of the module whose
# function torch itself declares a tensor function (torch.overrides: it dispatches
# on tensor arguments, which is how a client's proxies record it), minus the
# in-place variants ("relu_"). The table is built here, once: a request names an
# entry of it ("nn.functional.kl_div") and nothing is looked up by a client's name.
FUNCTIONAL_PREFIX = "nn.functional."
# torch's own plumbing keyword (where a warning points), meaningless in a graph.
_PLUMBING_KWARGS = frozenset({"_stacklevel"})


def functional_names() -> dict[str, Callable[..., Any]]:
    from torch.overrides import get_overridable_functions

    tensor_functions = {id(f) for fs in get_overridable_functions().values() for f in fs}
    out = {}
    for name in dir(F):
        fn = getattr(F, name)
        if name.startswith("_") or name.endswith("_") or not callable(fn) or id(fn) not in tensor_functions:
            continue
        out[name] = fn
    return out


def _functional(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("inplace"):
            raise errors.InvalidArgument(
                f"torch.nn.functional.{name}(..., inplace=True) would write into its input; "
                "use the out-of-place form and assign the result (`h[:] = F.{name}(h)`)"
            )
        for key in _PLUMBING_KWARGS & kwargs.keys():
            del kwargs[key]
        return function(*args, **kwargs)

    return run


def _generator(seed: Any) -> torch.Generator | None:
    if seed is None:
        return None
    return torch.Generator().manual_seed(int(seed))


def _random(function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torch.randn/rand with an optional `seed` kwarg: the same seed gives the same numbers."""

    def run(*size: Any, seed: Any = None, device: Any = None, **kwargs: Any) -> torch.Tensor:
        out = function(*size, generator=_generator(seed), **kwargs)
        return out if device is None else out.to(device)

    return run


def _random_like(function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    # Drawn on the CPU with a CPU generator, then moved: the same seed gives the same numbers anywhere.
    def run(x: torch.Tensor, *, seed: Any = None, dtype: torch.dtype | None = None, **kwargs: Any) -> torch.Tensor:
        if kwargs:
            raise TypeError(f"unexpected keyword arguments {sorted(kwargs)}")
        out = function(tuple(x.shape), generator=_generator(seed), dtype=dtype or x.dtype)
        return out.to(x.device)

    return run


# Plain Python values (not tensors) stay small: an op on ints, strings or lists
# runs for real (fake tensors cover tensors only), so `2 ** 10**9`, `1 << 2**40`
# or `"x" * 2**33` would freeze or exhaust whatever process runs the graph.
MAX_INT_BITS = 128  # int64/uint64 and their products fit
MAX_LENGTH = 2**22  # items of a str, bytes, list or tuple an op may build
_SEQUENCES = (str, bytes, bytearray, list, tuple)


def _is_int(x: Any) -> bool:
    return isinstance(x, int)  # bools too


def _length(x: Any) -> int:
    return len(x) if isinstance(x, _SEQUENCES) else 0


def _too_big(name: str, what: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(
        f"{name}: the result would be {what}; ops on plain numbers and sequences are bounded "
        f"(integers to {MAX_INT_BITS} bits, strings and lists to {MAX_LENGTH} items)"
    )


def _check_operands(name: str, a: Any, b: Any) -> None:
    """Refuse, before computing it, a plain-value result past the bounds."""
    base = name.removeprefix("i") if name in _INPLACE else name
    if base == "pow" and _is_int(a) and _is_int(b) and b > 0 and abs(a) > 1:
        if (abs(a).bit_length() - 1) * b >= MAX_INT_BITS:
            raise _too_big(name, f"an integer of about {(abs(a).bit_length() - 1) * b} bits")
    elif base == "lshift" and _is_int(a) and _is_int(b) and a and b > 0:
        if a.bit_length() + b > MAX_INT_BITS:
            raise _too_big(name, f"an integer of {a.bit_length() + b} bits")
    elif base == "mul":
        if _is_int(a) and _is_int(b):
            if a.bit_length() + b.bit_length() > MAX_INT_BITS + 1:
                raise _too_big(name, f"an integer of about {a.bit_length() + b.bit_length()} bits")
        elif _is_int(a) or _is_int(b):
            n, seq = (a, b) if _is_int(a) else (b, a)
            if _length(seq) * max(n, 0) > MAX_LENGTH:
                raise _too_big(name, f"a sequence of {_length(seq) * n} items")
    elif base == "add" and _length(a) + _length(b) > MAX_LENGTH:
        raise _too_big(name, f"a sequence of {_length(a) + _length(b)} items")
    elif base == "mod" and isinstance(a, (str, bytes, bytearray)):
        # printf-style formatting can pad to any width ("%*d"): not an op a graph needs.
        raise errors.InvalidArgument(f"{name}: string formatting is not allowed; format the value on the client")


def _check_result(name: str, out: Any) -> Any:
    if _is_int(out) and out.bit_length() > MAX_INT_BITS:
        raise _too_big(name, f"an integer of {out.bit_length()} bits")
    return out


def _bounded(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (an operator on two values), refusing plain-value results past the bounds."""

    def run(a: Any, b: Any) -> Any:
        if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
            _check_operands(name, a, b)
            return _check_result(name, fn(a, b))
        return fn(a, b)

    return run


def _call_module(ctx: OpContext, path: Any, *args: Any, **kwargs: Any) -> Any:
    if not isinstance(path, str):
        raise errors.InvalidArgument("call_module needs a module path string as its first argument")
    return ctx.call_module(path, args, kwargs)


_OPERATORS = (
    "add sub mul truediv floordiv mod pow matmul neg pos abs invert and_ or_ xor lshift rshift "
    "lt le eq ne gt ge getitem contains"
).split()
_INPLACE = "iadd isub imul itruediv ifloordiv imod ipow imatmul iand ior ixor".split()
_UNARY = {"neg", "pos", "abs", "invert"}
_BINARY = set(_OPERATORS) - _UNARY
# Result shares memory with args[0] (so later in-place writes reach it).
_ALIASING = (
    "getitem view reshape transpose permute squeeze unsqueeze flatten expand contiguous detach to float half "
    "bfloat16 double long int bool cpu view_as expand_as narrow select unflatten movedim swapaxes chunk split"
).split()
_METHODS = (
    "softmax log_softmax argmax argmin topk max min mean sum prod norm einsum clone detach to float half bfloat16 "
    "double long int bool reshape view view_as transpose permute squeeze unsqueeze flatten unflatten expand "
    "expand_as repeat contiguous cpu zeros_like ones_like full_like abs exp log sqrt tanh sigmoid relu gather "
    "index_select sort argsort size item tolist dot outer cumsum var std clamp nonzero narrow select movedim "
    "swapaxes numel dim sign round floor ceil log2 log10 square rsqrt pow isnan isinf all any logsumexp "
    "masked_fill diff tril triu chunk split flip roll any new_zeros new_ones new_full type_as "
    # reductions and projections that bring back only what a client needs
    "amax amin median nanmean count_nonzero kthvalue mm bmm inner tensordot"
).split()
# `linear`: a client module (a probe, a rotation, an SAE) applied to a traced value records F.linear.
_FUNCTIONAL = "softmax log_softmax gelu relu silu cosine_similarity layer_norm normalize linear".split()
_TORCH_ONLY = {
    "cat": torch.cat,
    "stack": torch.stack,
    "where": torch.where,
    "einsum": torch.einsum,
    "zeros": torch.zeros,
    "ones": torch.ones,
    "full": torch.full,
    "arange": torch.arange,
    "tensor": torch.tensor,
    "eye": torch.eye,
    "linspace": torch.linspace,
    # torch.linalg.* arrive under the names their __name__ gives ("linalg_vector_norm").
    "linalg_vector_norm": torch.linalg.vector_norm,
    "linalg_norm": torch.linalg.norm,
    "linalg_matrix_norm": torch.linalg.matrix_norm,
    "vector_norm": torch.linalg.vector_norm,
}


def _table() -> dict[str, OpSpec]:
    table: dict[str, OpSpec] = {}
    for name in _METHODS:
        table[name] = OpSpec(_method_or_function(name), aliases=name in _ALIASING)
    for name in _FUNCTIONAL:  # the plain names older clients send
        table[name] = OpSpec(_functional(name, _method_or_function(name, functional=True)))
    for name, function in functional_names().items():
        table[FUNCTIONAL_PREFIX + name] = OpSpec(_functional(name, function))
    for name, function in _TORCH_ONLY.items():
        table[name] = OpSpec(_function(function))
    for name in _OPERATORS:  # operator names win over same-named methods ("abs", "matmul" agree anyway)
        fn = getattr(operator, name)
        table[name] = OpSpec(_bounded(name, fn) if name in _BINARY else fn, aliases=name in _ALIASING)
    for name in _INPLACE:
        table[name] = OpSpec(_bounded(name, getattr(operator, name)), mutates=True, aliases=True)
    table["setitem"] = OpSpec(_setitem, mutates=True)
    table["getattr"] = OpSpec(_getattr, aliases=True)
    table["slice"] = OpSpec(_slice)
    table["to_tuple"] = OpSpec(_to_tuple, aliases=True)
    table["requires_grad_"] = OpSpec(_requires_grad_, aliases=True)
    table["retain_grad"] = OpSpec(_retain_grad)
    table["randn"] = OpSpec(_random(torch.randn))
    table["rand"] = OpSpec(_random(torch.rand))
    table["randn_like"] = OpSpec(_random_like(torch.randn))
    table["rand_like"] = OpSpec(_random_like(torch.rand))
    table["call_module"] = OpSpec(_call_module, context=True)
    return table


TABLE: dict[str, OpSpec] = _table()
OPS: tuple[str, ...] = tuple(sorted(TABLE))


def lookup(name: str) -> OpSpec:
    try:
        return TABLE[name]
    except KeyError:
        raise errors.InvalidArgument(f"unknown op {name!r}; GetServerInfo lists the ops this daemon runs") from None
