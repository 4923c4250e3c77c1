"""The torch.func reference of the clipping tests: per-example gradients by vmap(grad) of the loss
of one example through functional_call."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.func import functional_call, grad, vmap


def reference_grads(model: nn.Module, loss_fn, batch, state: dict | None = None) -> torch.Tensor:
    """(B, P) per-example gradients over the trainable parameters (named_parameters order), by
    vmap(grad) of the loss of ONE example through functional_call; ``state`` overrides values."""
    # a copy: functional_call leaves the passed values in a module the model holds twice
    # (nn.Sequential(a, a)), which would corrupt the model the engine is then run on
    model = copy.deepcopy(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters()}
    if state:
        params.update({n: v.detach() for n, v in state.items()})
    trainable = {n: params[n] for n in names}
    frozen = {n: v for n, v in params.items() if n not in trainable}
    B = batch[0].shape[0]
    if B == 0:
        return torch.zeros(0, sum(v.numel() for v in trainable.values()),
                           dtype=next(iter(trainable.values())).dtype)

    def one(p, *example):
        call = lambda *a, **k: functional_call(model, {**p, **frozen}, a, k)  # noqa: E731
        return loss_fn(call, tuple(e.unsqueeze(0) for e in example))[0]

    g = vmap(grad(one), in_dims=(None,) + (0,) * len(batch))(trainable, *batch)
    return torch.cat([g[n].reshape(B, -1) for n in names], 1)
