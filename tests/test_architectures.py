"""The architecture matrix: 19 transformers architectures, tiny and random,
through one real daemon, each checked against the same weights in-process.

One load and one dispatch per architecture (a module-scoped fixture,
released after its tests): print, scan, trace, an edit, generate with
per-step saves, and the standard `layers` alias. An encoder-decoder (t5)
gets decoder inputs as a keyword (generation starts its decoder itself), and
its `layers` is the decoder's stack.
Known gaps are strict xfails naming their cause, so the matrix stays green
and the gap visible.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import archmodels
import pytest
import torch

import nnd

PROMPT = "The Eiffel Tower is in the city of"

# (check, arch) -> why it fails today.
KNOWN: dict[tuple[str, str], str] = {}


def cases(check: str, *, only: tuple[str, ...] = ()) -> list[Any]:
    kinds = only or tuple(archmodels.ARCHS)
    return [
        pytest.param(kind, marks=pytest.mark.xfail(strict=True, reason=KNOWN[check, kind]))
        if (check, kind) in KNOWN
        else kind
        for kind in kinds
    ]


CAUSAL = tuple(k for k, a in archmodels.ARCHS.items() if a.task == "causal")


@dataclass
class Pair:
    kind: str
    remote: Any  # nnd.TransformersModel
    ref: torch.nn.Module  # the same weights, in-process
    enc: dict[str, torch.Tensor]  # the prompt, tokenized, as the forward takes it
    layers: str  # the real path of the decoder layer stack
    extra: dict[str, torch.Tensor]  # keyword inputs the remote calls send besides the prompt

    def layer(self, i: int) -> str:
        return f"{self.layers}.{i}"


@pytest.fixture(scope="session")
def arch_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("archs")


@pytest.fixture(scope="module")
def arch(request: pytest.FixtureRequest, daemon: Any, arch_root: pathlib.Path) -> Iterator[Pair]:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, AutoModelForSeq2SeqLM

    kind: str = request.param
    spec = archmodels.ARCHS[kind]
    path = archmodels.build_config(kind, arch_root / kind)
    auto = {"causal": AutoModelForCausalLM, "masked": AutoModelForMaskedLM, "seq2seq": AutoModelForSeq2SeqLM}
    ref = auto[spec.task].from_pretrained(path).eval()
    remote = nnd.TransformersModel(str(path), address=daemon.address, device="cpu")
    enc = dict(remote.tokenizer(PROMPT, return_tensors="pt"))
    extra: dict[str, torch.Tensor] = {}
    if spec.task == "seq2seq":  # the decoder's start token and two more: positions to read and edit
        extra["decoder_input_ids"] = torch.tensor([[ref.config.decoder_start_token_id, 9, 10]])
    try:
        yield Pair(kind, remote, ref, {**enc, **extra}, spec.layers, extra)
    finally:
        remote.release()
        remote.unload() if hasattr(remote, "unload") else None


def _ref_forward(pair: Pair, hooks: dict[str, Any] | None = None) -> tuple[dict[str, Any], torch.Tensor]:
    """The in-process forward: each hooked module's output (first element of a tuple), and the logits."""
    seen: dict[str, Any] = {}
    handles = []
    modules = dict(pair.ref.named_modules())
    for path, edit in (hooks or {}).items():

        def hook(module: Any, args: Any, output: Any, path: str = path, edit: Any = edit) -> Any:
            tensor = output[0] if isinstance(output, tuple) else output
            if edit is not None:
                edit(tensor)
            seen[path] = tensor.detach().clone()
            return output

        handles.append(modules[path].register_forward_hook(hook))
    try:
        with torch.no_grad():
            logits = pair.ref(**pair.enc).logits
    finally:
        for h in handles:
            h.remove()
    return seen, logits


def _is_tuple(pair: Pair, path: str) -> bool:
    found: dict[str, bool] = {}
    module = dict(pair.ref.named_modules())[path]

    def hook(module: Any, args: Any, output: Any) -> None:
        found["t"] = isinstance(output, tuple)

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            pair.ref(**pair.enc)
    finally:
        handle.remove()
    return found["t"]


def _value(envoy: Any, tupled: bool) -> Any:
    return envoy.output[0] if tupled else envoy.output


@pytest.mark.parametrize("arch", cases("print"), indirect=True)
def test_print_shows_the_in_process_tree(arch: Pair) -> None:
    assert [p for p, _ in arch.remote.named_modules()] == [p for p, _ in arch.ref.named_modules()]
    assert repr(arch.remote) == repr(arch.ref)


@pytest.mark.parametrize("arch", cases("scan"), indirect=True)
def test_scan_gives_the_in_process_shapes(arch: Pair) -> None:
    path = arch.layer(0)
    tupled = _is_tuple(arch, path)
    seen, logits = _ref_forward(arch, {path: None})
    with arch.remote.scan(PROMPT, **arch.extra):
        hidden = nnd.save(_value(arch.remote.layers[0], tupled).shape)
        shape = nnd.save(arch.remote.lm_head.output.shape)
    assert tuple(shape) == tuple(logits.shape)
    assert tuple(hidden) == tuple(seen[path].shape)


@pytest.mark.parametrize("arch", cases("alias"), indirect=True)
def test_standard_layers_alias_names_the_layer_stack(arch: Pair) -> None:
    assert arch.remote.layers.path == arch.layers
    assert arch.remote.layers[1].path == arch.layer(1)


@pytest.mark.parametrize("arch", cases("trace"), indirect=True)
def test_trace_reads_what_in_process_hooks_read(arch: Pair) -> None:
    path = arch.layer(0)
    tupled = _is_tuple(arch, path)
    seen, logits = _ref_forward(arch, {path: None})
    with arch.remote.trace(PROMPT, **arch.extra):
        hidden = _value(arch.remote.layers[0], tupled).save()
        out = arch.remote.lm_head.output.save()
    torch.testing.assert_close(hidden, seen[path], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", cases("edit"), indirect=True)
def test_zeroing_the_last_position_equals_the_in_process_hook(arch: Pair) -> None:
    path = arch.layer(0)
    tupled = _is_tuple(arch, path)

    def zero(t: torch.Tensor) -> None:
        t[:, -1, :] = 0

    _, expected = _ref_forward(arch, {path: zero})
    _, plain = _ref_forward(arch)
    with arch.remote.trace(PROMPT, **arch.extra):
        _value(arch.remote.layers[0], tupled)[:, -1, :] = 0
        out = arch.remote.lm_head.output.save()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(out[:, -1], plain[:, -1])  # the edit mattered


@pytest.mark.parametrize("arch", cases("generate", only=(*CAUSAL, "t5")), indirect=True)
def test_greedy_generate_with_per_step_saves_equals_hf(arch: Pair) -> None:
    """An encoder-decoder generates from the decoder's start token: its steps read the decoder's
    layers, one position each, and the result is the decoder's sequence (as transformers gives it)."""
    path = arch.layer(1)
    tupled = _is_tuple(arch, path)
    with arch.remote.generate(PROMPT, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        steps = list().save()
        for _ in tracer.iter[0:3]:  # the body runs once per step (nnsight's idiom)
            steps.append(_value(arch.remote.layers[1], tupled))
        ids = tracer.result.save()
    prompt = {k: v for k, v in arch.enc.items() if k not in arch.extra}  # generation starts the decoder itself
    with torch.no_grad():
        expected = arch.ref.generate(**prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert ids.tolist() == expected.tolist()
    n = 1 if arch.extra else prompt["input_ids"].shape[1]
    assert isinstance(steps, list) and [s.shape[1] for s in steps] == [n, 1, 1]


MOE = ("mixtral", "qwen2_moe", "olmoe")


@pytest.mark.parametrize("arch", cases("moe_scan", only=MOE), indirect=True)
def test_moe_scan_gives_every_expert_module_its_in_process_shape(arch: Pair) -> None:
    """The META model runs its experts with another implementation than the real forward
    (daemon/helper/meta.py): every module of a mixture-of-experts block keeps its shape."""
    block = f"{arch.layer(0)}.mlp"
    paths = [p for p, _ in arch.ref.named_modules() if p == block or p.startswith(block + ".")]
    tupled = {p: _is_tuple(arch, p) for p in paths}
    seen, _ = _ref_forward(arch, dict.fromkeys(paths))
    assert any(".experts" in p for p in seen)  # the experts module ran and is compared
    envoys = dict(arch.remote.named_modules())
    with arch.remote.scan(PROMPT):
        # The dict is made in the block: saved too, or its name does not outlive it (as in nnsight).
        shapes = {p: nnd.save(_value(envoys[p], tupled[p]).shape) for p in seen}.save()
    assert {p: tuple(s) for p, s in shapes.items()} == {p: tuple(t.shape) for p, t in seen.items()}


@pytest.mark.parametrize("arch", cases("seq2seq_alias", only=("t5",)), indirect=True)
def test_encoder_decoder_aliases_name_both_stacks(arch: Pair) -> None:
    """`layers` is the decoder's stack; `encoder_layers`/`decoder_layers` name both, and a block's
    parts are named inside T5's `layer.<i>` wrappers. A trace through the aliases reads what
    in-process hooks on the real paths read."""
    remote = arch.remote
    assert remote.encoder_layers.path == "encoder.block"
    assert remote.decoder_layers[1].path == "decoder.block.1"
    assert remote.layers[0].attention.path == "decoder.block.0.layer.0.SelfAttention"
    assert remote.layers[0].cross_attention.path == "decoder.block.0.layer.1.EncDecAttention"
    assert remote.layers[0].mlp.path == "decoder.block.0.layer.2.DenseReluDense"
    assert remote.encoder_layers[1].mlp.path == "encoder.block.1.layer.1.DenseReluDense"
    assert remote.final_norm.path == "decoder.final_layer_norm"
    reads = {p: _is_tuple(arch, p) for p in ("encoder.block.1", "decoder.block.0.layer.1.EncDecAttention")}
    seen, _ = _ref_forward(arch, dict.fromkeys(reads))
    with remote.trace(PROMPT, **arch.extra):
        encoded = _value(remote.encoder_layers[1], reads["encoder.block.1"]).save()
        cross = _value(remote.layers[0].cross_attention, reads["decoder.block.0.layer.1.EncDecAttention"]).save()
    torch.testing.assert_close(encoded, seen["encoder.block.1"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cross, seen["decoder.block.0.layer.1.EncDecAttention"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", cases("overloaded", only=("bert",)), indirect=True)
def test_a_submodule_named_output_is_reached_as_E_output_as_in_nnsight(arch: Pair) -> None:
    # `.output` is every module's value, so nnsight 0.8 serves BERT's `output` submodules as `.E_output`.
    layer = arch.layer(0)
    seen, _ = _ref_forward(arch, {layer: None, f"{layer}.output": None, f"{layer}.output.dense": None})
    with arch.remote.trace(PROMPT):
        block = arch.remote.layers[0]
        value = block.output[0].save() if _is_tuple(arch, layer) else block.output.save()
        sub = block.E_output.output.save()
        dense = block.E_output.dense.output.save()
    torch.testing.assert_close(value, seen[layer], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sub, seen[f"{layer}.output"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense, seen[f"{layer}.output.dense"], rtol=1e-5, atol=1e-5)

    def half(t: torch.Tensor) -> None:
        t.mul_(0.5)

    _, expected = _ref_forward(arch, {f"{layer}.attention.output.dense": half})
    with arch.remote.trace(PROMPT):
        arch.remote.layers[0].attention.E_output.dense.output *= 0.5
        out = arch.remote.lm_head.output.save()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(AttributeError, match="has no module 'E_intermediate'"):
        arch.remote.layers[0].E_intermediate  # noqa: B018 - only served names move
