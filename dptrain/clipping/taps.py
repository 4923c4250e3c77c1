"""Tapped parameters: those of a module (no layer rule) whose submodules have parameters of their
own, so that no layer rule sees their uses: a ViT's class token and position table, ConvNeXt's
and CaiT's layer-scale ``gamma``, NFNet's scalar ``skipinit_gain``. The engine gives each use of
such a parameter that meets the examples one row per example, and reads example b's gradient
from row b.

For the module's call the parameter is replaced by a leaf ``P`` of its own shape and values (so
whatever the forward reads of it, its size or a statistic, is the model's), and a
``TorchFunctionMode`` (:class:`OpTaps`) follows the module's torch calls: results computed from
``P``, buffers and constants only are "parameter-made"; results of the module's inputs are
"example-made". At a call that takes both (``x.mul(gamma.reshape(1, -1, 1, 1))``,
``out.mul_(skipinit_gain)``, ``x + pos_embed``), each parameter-made argument ``q`` is aligned to
the dimensions of the example-made ones (leading 1s) and expanded to ``q_B``, with B rows on the
first dimension; a parameter-made result that is already expanded over the examples
(``cls_token.expand(B, -1, -1)``: a first dimension of B with stride 0) becomes ``q_B`` there.
A hook on ``q_B`` takes its gradient (B, ...): example b's cotangent of ``q`` is row b, and
example b's gradient of ``p`` is its vector-Jacobian product through the parameter-made
computation ``P -> q`` (``autograd.grad(..., is_grads_batched=True)``, inside the hook, before
the backward frees that computation; a plain reshape when ``q`` is a reshape of ``P``). A call
that looks a parameter-made tensor up with the examples' values (``vec[ids]``) is refused.

Two checks make this safe whatever the forward does with these tensors:

- **rows reach their own losses** (once, at the first query of two or more examples, or of any
  size on every rank under a process group): the rows of every expanded tensor are equal, so
  the forward's values cannot tell where they go; with weights w_b (1 + b/B, shuffled), the
  gradient of sum_b w_b loss_b must be, row by row, w_b times that of sum_b loss_b
  (``p.expand(B, ...)[0]``, a ``.mean(0)`` over the rows, a (T, B, d) layout are refused);
- **nothing is missing** (every query): ``P`` is a target of the engine's backward too, so
  autograd gives its whole gradient; the per-example gradients must add up to it. A
  parameter-made tensor that reaches the loss some other way (kept and used after the module,
  fed to a layer) would otherwise be missing from the norms; one the module returns is refused
  at once.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dptrain.clipping.contributions import Dense
from dptrain.clipping.errors import ClippingError
from dptrain.clipping.rules import LayerRule


@dataclass
class Tapped:
    """A module's tapped parameters (attribute -> parameter, as registered) and their names
    in the engine (attribute -> name)."""
    name: str
    module: nn.Module
    params: dict[str, nn.Parameter] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)


class TapRule(LayerRule):
    """A tapped parameter's per-example gradient, (B, *shape) (``saved``: the parameter's
    attribute in its module and its shape)."""

    def contributions(self, module, saved, G):
        return {saved["attr"]: Dense(G.reshape(G.shape[0], *saved["shape"]))}


TAP = TapRule()


#: calls that look a parameter-made tensor up with the examples' values (``vec[ids]``): its
#: expansion to B rows would index the rows instead
_LOOKUPS = {"__getitem__", "index_select", "gather", "take", "take_along_dim", "embedding",
            "embedding_bag", "masked_select", "index", "index_put", "index_put_", "index_add",
            "index_copy", "scatter", "scatter_add", "put"}


def tolerance(dtype: torch.dtype, device_type: str) -> float:
    """The checks' relative tolerance: 1e-4 (a float64 model may compute parts in float32,
    transformers' attention softmax), 3e-2 where the forward runs in bf16/fp16."""
    half = dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled(device_type)
    return 3e-2 if half else 1e-4


def same_elements(view: Tensor, base: Tensor) -> bool:
    """Whether ``view`` holds ``base``'s elements in ``base``'s order (``base`` itself, or a
    reshape of it): its gradient is then the parameter's, reshaped."""
    return (view.numel() == base.numel() and view.is_contiguous() and base.is_contiguous()
            and view.data_ptr() == base.data_ptr() and view.dtype == base.dtype)


def _tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors among a torch call's arguments, also inside lists, tuples and dicts (the
    common case, a flat tuple of tensors and scalars, without pytree's cost)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple, dict)):
            out.extend(t for t in pytree.tree_leaves(a) if isinstance(t, Tensor))
    return out


def _weak_set(store: dict, t: Tensor, value) -> None:
    key = id(t)
    store[key] = (weakref.ref(t, lambda _: store.pop(key, None)), value)


class OpTaps(TorchFunctionMode):
    """The taps of one call of a module (see the module docstring). ``params``: attribute ->
    the leaf ``P`` put in its place; ``inputs``: the call's arguments (example-made);
    ``on_meet(attrs, q, q_B)``: called for each expanded argument (``attrs``: the tapped
    parameters it is made from), before the call runs."""

    def __init__(self, params: dict[str, Tensor], inputs, batch_size: int, name: str, on_meet):
        super().__init__()
        self.B = batch_size
        self.name = name
        self.on_meet = on_meet
        self.made: dict[int, tuple] = {}  # id -> (weak ref, attributes): parameter-made
        self.examples: dict[int, tuple] = {}  # id -> (weak ref, None): example-made
        for attr, P in params.items():
            _weak_set(self.made, P, frozenset([attr]))
        for t in pytree.tree_leaves(inputs):
            if isinstance(t, Tensor):
                _weak_set(self.examples, t, None)

    def made_attr(self, t) -> frozenset | None:
        hit = self.made.get(id(t)) if isinstance(t, Tensor) else None
        return hit[1] if hit is not None and hit[0]() is t else None

    def _example(self, t) -> bool:
        hit = self.examples.get(id(t)) if isinstance(t, Tensor) else None
        return hit is not None and hit[0]() is t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = _tensors(args, kwargs)
        made = {}
        examples = []
        for t in leaves:
            attrs = self.made_attr(t)
            if attrs is not None:
                made[id(t)] = attrs
            elif self._example(t):
                examples.append(t)
        if made and examples and torch.is_grad_enabled():
            if getattr(func, "__name__", "") in _LOOKUPS:
                raise ClippingError(self.refusal(next(iter(made.values())), func,
                                                 "looks it up with the examples' values (a table "
                                                 "indexed per example: use an nn.Embedding)"))
            D = max(t.dim() for t in examples)
            swap = {}
            for t in leaves:
                if id(t) in made and id(t) not in swap:
                    swap[id(t)] = self._expand(t, D, made[id(t)], func)
            args, kwargs = pytree.tree_map_only(
                Tensor, lambda t: swap.get(id(t), t), (args, kwargs))
            out = func(*args, **kwargs)
            for o in (out,) if isinstance(out, Tensor) else pytree.tree_leaves(out):
                if isinstance(o, Tensor):
                    if o.dim() == 0 or o.shape[0] != self.B:
                        raise ClippingError(self.refusal(next(iter(made.values())), func,
                                                          f"gave a result of shape "
                                                          f"{tuple(o.shape)}"))
                    _weak_set(self.examples, o, None)
            return out
        out = func(*args, **kwargs)
        if (made and not examples and isinstance(out, Tensor) and torch.is_grad_enabled()
                and out.requires_grad and self.B > 1 and out.dim() and out.shape[0] == self.B
                and out.stride(0) == 0):
            # expanded over the examples (``p.expand(B, ...)``, a ViT's class token): one row
            # per example from here on, the same values and shape as without the engine
            qa = out[:1]
            q_B = qa.expand(out.shape)
            self.on_meet(frozenset().union(*made.values()), qa, q_B)
            _weak_set(self.examples, q_B, None)
            return q_B
        mark = self.examples if examples else (self.made if made else None)
        if mark is not None:
            value = None if examples else frozenset().union(*made.values())
            for o in (out,) if isinstance(out, Tensor) else pytree.tree_leaves(out):
                if isinstance(o, Tensor):
                    _weak_set(mark, o, value)
        return out

    def _expand(self, q: Tensor, D: int, attrs: frozenset, func) -> Tensor:
        """``q`` with the examples' B rows on its first dimension, for a call that broadcasts
        it against tensors of D dimensions (first: the examples)."""
        if q.dim() < D:
            qa = q.reshape((1,) * (D - q.dim()) + tuple(q.shape))
        elif q.dim() == D and q.shape[0] == 1:
            qa = q
        elif q.dim() == D and q.shape[0] == self.B and q.stride(0) == 0:
            qa = q[:1]  # already expanded over the examples (``p.expand(B, ...)``)
        else:
            raise ClippingError(self.refusal(attrs, func, f"takes it with shape {tuple(q.shape)} "
                                                          f"next to the examples' {D}-dimensional "
                                                          f"tensors"))
        q_B = qa.expand(self.B, *qa.shape[1:])
        if q_B.requires_grad:  # (made under no_grad or detached: no gradient to take)
            self.on_meet(attrs, qa, q_B)
        return q_B

    def refusal(self, attrs: frozenset, func, what: str) -> str:
        names = " and ".join(f"{self.name}.{a}" for a in sorted(attrs))
        return (f"dptrain.clipping: {names} is a tapped parameter (its module has "
                f"submodules with parameters of their own) and "
                f"{getattr(func, '__name__', func)} {what}: the engine gives such a parameter one "
                f"row per example where it meets the examples' tensors, which must broadcast it "
                f"over their first dimension. Move it into a module of its own (timm's "
                f"LayerScale), whose rule or torch.func fallback gives its per-example gradient")
