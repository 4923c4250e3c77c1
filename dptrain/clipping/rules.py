"""Per-layer rules: how a layer's captured input and output gradient give the per-example
gradient contributions of its own (direct) parameters.

Rules are registered by decorator and looked up along ``type(module).__mro__``, so subclasses
and wrapper classes (FSDP2's ``FSDPLinear`` etc.) resolve to their base's rule.

A rule has two halves:

``capture(module, args, output) -> dict``
    called in the forward hook; stores what the backward half will need (detached). Anything
    that depends on the parameters' *values* (e.g. the standardised weight) must be captured
    here, because the engine may evaluate the same layer at several model states.
``contributions(module, saved, grad_output) -> {param_attr: Contribution}``
    called after the backward, with ``grad_output`` the gradient of the summed per-example
    losses w.r.t. the layer's output (so row b is example b's own output gradient).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn

from dptrain.clipping.contributions import Contribution, Dense, OneHot, Outer

_RULES: dict[type, "LayerRule"] = {}


class LayerRule:
    #: True when the layer's first argument is an integer tensor (its output becomes a
    #: gradient target of the engine's backward, see engine.py).
    integer_input = False
    #: forward functions the rule understands, when it checks them itself (the convolution
    #: rules, at capture); empty: :func:`find_rule` accepts only the registered class's own
    #: ``forward``, so a subclass that overrides it goes to the torch.func fallback
    forwards: tuple = ()
    #: True: ``capture`` also takes the call's keyword arguments (``capture(..., kwargs)``)
    wants_kwargs = False

    def capture(self, module: nn.Module, args: tuple, output: Tensor) -> dict:
        return {"x": args[0].detach()}

    def contributions(self, module: nn.Module, saved: dict,
                      grad_output: Tensor) -> dict[str, Contribution]:
        raise NotImplementedError


def register_rule(*module_types: type) -> Callable[[type], type]:
    """Class decorator: ``@register_rule(nn.Linear) class LinearRule(LayerRule): ...``."""

    def deco(cls: type) -> type:
        for t in module_types:
            _RULES[t] = cls()
        return cls

    return deco


def find_rule(module: nn.Module) -> LayerRule | None:
    """The rule registered for the nearest class of ``module``'s MRO; None (the torch.func
    fallback) when the module's class overrides that class's ``forward`` (a subclass that
    scales its output, adds a parameter, ...), unless the rule checks forwards itself."""
    for klass in type(module).__mro__:
        rule = _RULES.get(klass)
        if rule is not None:
            if rule.forwards or type(module).forward is klass.forward:
                return rule
            return None
    return None


def overridden_base(module: nn.Module) -> type | None:
    """The class with a rule whose ``forward`` ``module``'s class overrides (for messages)."""
    for klass in type(module).__mro__:
        if klass in _RULES:
            return None if find_rule(module) is not None else klass
    return None


def _flat_bt(x: Tensor) -> Tensor:
    """(B, ..., d) -> (B, T, d) with T the product of the middle dimensions."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


@register_rule(nn.Linear)
class LinearRule(LayerRule):
    """y = x W^T + b; W is (out, in): per-example grad sum_t G_t ⊗ x_t."""

    def contributions(self, module, saved, G):
        x = _flat_bt(saved["x"])
        G = _flat_bt(G)
        out = {"weight": Outer(G, x)}
        if module.bias is not None:
            out["bias"] = Dense(G.sum(1))
        return out


def _transformers_conv1d():
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # pragma: no cover - transformers is a dependency
        return None
    return Conv1D


_Conv1D = _transformers_conv1d()


if _Conv1D is not None:

    @register_rule(_Conv1D)
    class Conv1DRule(LayerRule):
        """transformers' GPT-2 Conv1D: y = x W + b with W stored (in, out): grad sum_t x_t ⊗ G_t."""

        def contributions(self, module, saved, G):
            x = _flat_bt(saved["x"])
            G = _flat_bt(G)
            out = {"weight": Outer(x, G)}
            if module.bias is not None:
                out["bias"] = Dense(G.sum(1))
            return out


@register_rule(nn.Embedding)
class EmbeddingRule(LayerRule):
    """Row ids[b,t] of W receives G[b,t]: per-example grad sum_t onehot(id_t) ⊗ G_t."""

    integer_input = True

    def capture(self, module, args, output):
        # a copy (B x T integers): the ids may be changed in place after the forward (labels
        # that alias them, masked inside loss_fn), and the layer's own backward, whose version
        # check would refuse that, never runs here
        return {"ids": args[0].detach().clone()}

    def contributions(self, module, saved, G):
        ids = saved["ids"].reshape(saved["ids"].shape[0], -1)
        G = _flat_bt(G)
        if module.padding_idx is not None:
            G = G * (ids != module.padding_idx).unsqueeze(-1).to(G.dtype)
        if module.max_norm is not None:
            raise ValueError(f"dptrain.clipping: nn.Embedding with max_norm is not supported (it "
                             f"renormalises weights in the forward): {module}")
        if module.scale_grad_by_freq:
            raise ValueError(f"dptrain.clipping: nn.Embedding with scale_grad_by_freq is not "
                             f"supported (it divides each row's gradient by its count in the "
                             f"whole batch, so one example's gradient depends on the others): "
                             f"{module}")
        return {"weight": Outer(OneHot(ids, module.num_embeddings), G)}


@register_rule(nn.LayerNorm)
class LayerNormRule(LayerRule):
    """y = xhat * gamma + beta over the trailing normalized_shape: per-example grads
    sum_t G_t * xhat_t and sum_t G_t (xhat recomputed from the captured input by one fused
    ``layer_norm`` without affine parameters: a third of the time of mean, var and rsqrt)."""

    def contributions(self, module, saved, G):
        x = saved["x"]
        xhat = F.layer_norm(x.to(G.dtype), module.normalized_shape, eps=module.eps)
        B = x.shape[0]
        n = 1
        for d in module.normalized_shape:
            n *= d
        out = {}
        if module.weight is not None:
            out["weight"] = Dense((G * xhat).reshape(B, -1, n).sum(1).reshape(B, *module.normalized_shape))
        if module.bias is not None:
            out["bias"] = Dense(G.reshape(B, -1, n).sum(1).reshape(B, *module.normalized_shape))
        return out


class LayerNorm2dRule(LayerRule):
    """timm's LayerNorm2d: nn.LayerNorm over the channels of an NCHW input (ConvNeXt), each
    position a token: the LayerNorm rule on the input and output gradient moved to NHWC."""

    def contributions(self, module, saved, G):
        return LayerNormRule().contributions(module, {"x": saved["x"].movedim(1, -1)},
                                             G.movedim(1, -1))


def _register_timm_layernorm() -> None:
    """timm's LayerNorm overrides the forward (a fast-norm switch) but computes nn.LayerNorm's
    function; its LayerNorm2d computes it over the channels of NCHW (until 2026-12-02 it took
    the torch.func fallback, a third of a ConvNeXt's private step)."""
    try:
        from timm.layers.norm import LayerNorm as TimmLayerNorm
        from timm.layers.norm import LayerNorm2d as TimmLayerNorm2d
    except Exception:  # pragma: no cover - timm is a dependency
        return
    register_rule(TimmLayerNorm)(LayerNormRule)
    register_rule(TimmLayerNorm2d)(LayerNorm2dRule)


_register_timm_layernorm()


# ---------------------------------------------------------------------------------------------
# torch.func fallback for any other layer with direct parameters


class FuncFallbackRule(LayerRule):
    """Per-example gradients of an unsupported layer's own parameters with torch.func: one
    vmapped VJP of the layer's forward per example, from the captured input and output grad.
    Instantiates that layer's per-example gradients only (never the whole model's).

    The first positional argument is per-example (row b is example b's: the engine checks
    it). Another positional tensor whose leading size is not the microbatch's is shared and
    passed whole. Keyword arguments are captured too (the engine hooks such layers with
    ``with_kwargs``). A keyword tensor, a positional tensor after the first whose leading size
    is the microbatch's, or tensors inside a list, tuple or dict argument may be per-example
    or shared (a (T, T) mask with T = B); then the rule makes no guess: it takes example b's
    gradient as the VJP of the whole microbatch's forward with every output row but b's
    cotangent zeroed (B VJPs of the microbatch, vmapped: exact whatever the arguments are,
    and B times the work). (Until 2026-12-02 every positional tensor was split per example: a
    shared (T, d) scale at T = B gave each example a row of it, and wrong norms.)"""

    wants_kwargs = True

    def capture(self, module, args, output, kwargs=None):
        # cloned: the engine may copy other model states into the parameters afterwards
        params = {n: p.detach().clone() for n, p in module.named_parameters(recurse=False)}
        return {"args": pytree.tree_map_only(Tensor, Tensor.detach, tuple(args)),
                "kwargs": pytree.tree_map_only(Tensor, Tensor.detach, dict(kwargs or {})),
                "params": params}

    def contributions(self, module, saved, G):
        try:
            return self._contributions(module, saved, G)
        except RuntimeError as e:
            if "vmap" not in str(e):
                raise
            raise ValueError(
                f"dptrain.clipping: the torch.func fallback for {type(module).__name__} "
                f"(no layer rule) computes its per-example gradients under vmap, which could "
                f"not run its forward: {str(e).splitlines()[0]} Write that forward with ops vmap "
                f"supports (torch.where, not Python branches on values or boolean-mask "
                f"indexing), or register a layer rule (dptrain.clipping.rules.register_rule)"
            ) from e

    def _contributions(self, module, saved, G):
        from torch.func import functional_call, vjp, vmap

        params = saved["params"]
        args = saved["args"]  # half captures arrive as float32 (the engine's _to_float)
        kwargs = saved.get("kwargs") or {}
        B = G.shape[0]
        batched = [isinstance(a, Tensor) and (i == 0 or (a.dim() > 0 and a.shape[0] == B))
                   for i, a in enumerate(args)]
        nested = any(not isinstance(a, Tensor) and any(
            isinstance(t, Tensor) for t in pytree.tree_leaves(a)) for a in args)
        if (any(isinstance(t, Tensor) for t in pytree.tree_leaves(kwargs)) or any(batched[1:])
                or nested):
            _, pull = vjp(lambda p: functional_call(module, p, args, kwargs), params)
            rows = torch.eye(B, dtype=G.dtype, device=G.device).view(B, B, *[1] * (G.dim() - 1))
            grads = vmap(lambda row: pull(G * row)[0])(rows)
            return {n: Dense(g) for n, g in grads.items()}

        def one(g, *example_args):
            full = []
            it = iter(example_args)
            for a, is_b in zip(args, batched):
                full.append(next(it).unsqueeze(0) if is_b else a)

            def f(p):
                return functional_call(module, p, tuple(full), kwargs)

            _, pull = vjp(f, params)
            (grads,) = pull(g.unsqueeze(0))
            return grads

        grads = vmap(one)(G, *[a for a, is_b in zip(args, batched) if is_b])
        return {n: Dense(g) for n, g in grads.items()}


FALLBACK = FuncFallbackRule()


def _no_rule(module: nn.Module) -> str:
    base = overridden_base(module)
    if base is not None:
        return f"{type(module).__name__} overrides the forward of {base.__name__}"
    return f"no ghost rule for {type(module).__name__}"
