"""Blocks that train or differentiate client tensors through a traced model, written as nnsight
0.8.1 users write them, run unchanged by nnsight (tests/grad_reference.py, in a process of its own)
and by nnd (tests/test_client_grads.py). Each builds its client tensors from a fixed seed and
returns plain results (parameters after a few optimizer steps, gradients, losses) to compare.

`BLOCKS` take a language model (GPT-2 shape, width 64); `NET_BLOCKS` take `wrap(net, example)`,
which wraps a torch module (nnsight.NNsight / nnd.NNsight).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

PROMPT = "The Eiffel Tower is in the city of"
WIDTH = 64


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def probe_trained_inside_the_block(model: Any) -> dict[str, Any]:
    """A linear probe on a layer's output; the backward pass runs inside the block, the optimizer after it."""
    torch.manual_seed(0)
    probe = torch.nn.Linear(WIDTH, 4)
    target = torch.randn(4)
    optimizer = torch.optim.SGD(probe.parameters(), lr=0.1)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        with model.trace(PROMPT):
            out = probe(model.transformer.h[1].output[0, -1])
            loss = ((out - target) ** 2).mean()
            loss.backward()
            loss = loss.save()
        optimizer.step()
        losses.append(loss.item())
    return {"weight": _plain(probe.weight), "bias": _plain(probe.bias), "losses": losses}


def rotation_trained_after_the_block(model: Any) -> dict[str, Any]:
    """DAS: an orthogonal rotation (a parametrized client module) patches a subspace; the loss and
    its backward pass run on the saved logits after the block."""
    torch.manual_seed(0)
    rotator = torch.nn.utils.parametrizations.orthogonal(torch.nn.Linear(WIDTH, WIDTH, bias=False))
    optimizer = torch.optim.Adam(rotator.parameters(), lr=0.01)
    losses = []
    for _ in range(3):
        optimizer.zero_grad()
        with model.trace(PROMPT):
            base = model.transformer.h[0].output[:, 1, :].clone()
            rotated = rotator(base)
            patch = torch.cat([rotated[:, :2] * 0.5, rotated[:, 2:]], dim=1)
            model.transformer.h[0].output[:, 1, :] = torch.matmul(patch, rotator.weight.T)
            logits = model.lm_head.output[:, -1, :].save()
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor([5]))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"weight": _plain(rotator.weight), "losses": losses}


def functional_linear_on_a_traced_value(model: Any) -> dict[str, Any]:
    """torch.nn.functional.linear(h, W) with a client W that requires grad; W.grad after the block."""
    torch.manual_seed(0)
    weight = torch.randn(4, WIDTH, requires_grad=True)
    with model.trace(PROMPT):
        y = torch.nn.functional.linear(model.transformer.h[1].output[:, -1], weight).save()
    (y**2).sum().backward()
    return {"y": _plain(y), "grad": _plain(weight.grad)}


class _SAE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.decoder = torch.nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: Any) -> Any:
        return self.decoder(torch.relu(self.encoder(x)))


def sae_fine_tuned_on_a_layer(model: Any) -> dict[str, Any]:
    """A sparse autoencoder's reconstruction loss plus an L1 term, two Adam steps, backward inside."""
    torch.manual_seed(0)
    sae = _SAE()
    optimizer = torch.optim.Adam(sae.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        optimizer.zero_grad()
        with model.trace(PROMPT):
            h = model.transformer.h[0].output
            loss = ((sae(h) - h) ** 2).mean() + 1e-3 * torch.relu(sae.encoder(h)).abs().mean()
            loss.backward()
            loss = loss.save()
        optimizer.step()
        losses.append(loss.item())
    return {name: _plain(p) for name, p in sae.named_parameters()} | {"losses": losses}


def retain_grad_on_a_saved_value(model: Any) -> dict[str, Any]:
    """nnsight's test_retain_grad: after the block the saved value carries its gradient."""
    with model.trace() as tracer:
        with tracer.invoke("Hello World"):
            hidden_states = model.transformer.h[-1].output.save()
            hidden_states.retain_grad()
            logits = model.lm_head.output
            logits.sum().backward()
    return {"grad": _plain(hidden_states.grad)}


def external_module_and_tensor(model: Any) -> dict[str, Any]:
    """nnsight's test_external_tensors: a client Linear and a client bias applied to a traced value."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(WIDTH, WIDTH)
    bias = torch.randn(WIDTH)
    with model.trace("fish"):
        x = model.transformer.h[0].mlp.output
        z = torch.relu(lin(x) - bias).save()
    return {"z": _plain(z)}


BLOCKS = {
    f.__name__: f
    for f in (
        probe_trained_inside_the_block,
        rotation_trained_after_the_block,
        functional_linear_on_a_traced_value,
        sae_fine_tuned_on_a_layer,
        retain_grad_on_a_saved_value,
        external_module_and_tensor,
    )
}


def requires_grad_on_a_traced_value(wrap: Any) -> dict[str, Any]:
    """nnsight's walkthrough: a frozen net, `l1_output.requires_grad = True`, gradients read and scaled
    in reverse order inside `with out.sum().backward():`."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        OrderedDict([("layer1", torch.nn.Linear(5, 10)), ("layer2", torch.nn.Linear(10, 2))])
    ).requires_grad_(False)
    x = torch.rand((1, 5))
    model = wrap(net, x)
    with model.trace(x):
        l1_output = model.layer1.output
        l1_output.requires_grad = True
        l2_output = model.layer2.output
        with model.output.sum().backward():
            l2_output.grad = l2_output.grad * 2
            layer2_output_grad = l2_output.grad.save()
            layer1_output_grad = l1_output.grad.save()
    return {"l1": _plain(layer1_output_grad), "l2": _plain(layer2_output_grad)}


NET_BLOCKS = {f.__name__: f for f in (requires_grad_on_a_traced_value,)}
