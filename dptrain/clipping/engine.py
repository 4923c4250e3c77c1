"""The per-example clipping engine: norms of each example's complete query, clip factors, and
the clipped sum, without materialising the whole model's per-example gradient.

One microbatch, one query plan ``[(a_0, state_0), (a_1, state_1), ...]`` (``state=None`` is the
current parameters; DiSK and inner momentum evaluate at several states):

1. for each state: swap the state's parameter values in, run the forward with hooks that capture
   each layer's input (forward hook) and output gradient (tensor hook), then ONE backward
   ``autograd.grad(sum_b loss_b, targets)`` whose targets are activations (and the per-example
   leaves of tapped parameters, below) — autograd then skips every weight-gradient product,
   which book-keeping recomputes with the clip factors (the checks, and two_pass, add
   backwards of their own);
2. every parameter's per-example gradient of the query u_b = sum_j a_j grad l(theta_j; x_b) is a
   list of contributions (contributions.py); the squared norm of the complete query is the sum
   over parameters of their ghost (or instantiated) squared norms, cross terms included;
3. lam_b = min(1, C / ||u_b||) — one factor per example from all trainable coordinates;
4. the clipped sum sum_b lam_b u_b: by book-keeping (one weighted product per layer from the
   captured tensors) or by a second backward of sum_b lam_b a_j loss_b per state.

What a model must satisfy for this to bound each example's influence is checked, not assumed:
its structure over the first forward (``_FirstForwardCheck``), and that no example's data
reaches another example's rows, by perturbation after the first query (rows.py).

Parameters that no layer rule sees (owned by a module whose submodules have parameters of their
own: a ViT's class token, ConvNeXt's layer scale) are tapped: each use that meets the examples
gets one row per example (taps.py), and row b's gradient is example b's, checked, not assumed.

Targets of the backward: float inputs that do not require grad, and a caller's own leaves that
do, are replaced in a pre-hook by leaves of the engine's (cheap: the first layer's input
gradient), and layers with integer inputs
(embeddings) make their output a target. Every trainable tensor then lies on a path from the
loss to a target, so every hooked layer's output gradient is computed, and nothing else extra.
Tensor hooks registered before an in-place op (timm's in-place activations) receive the gradient
w.r.t. the pre-in-place value, which is what the layer rules need.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal

import torch
import torch.utils._pytree
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from dptrain.clipping.contributions import (
    Contribution,
    Dense,
    Kernels,
    OneHot,
    Outer,
    add_instantiated,
    cancelled,
    choose_form_states,
    clipped_sum,
    drop_examples,
    first_write_order,
    refine_cancelled,
    sq_rows,
    squared_norms_scaled,
    state_bytes,
    tokens,
)
from dptrain.clipping.errors import ClippingError
from dptrain.clipping.precision import ieee_float32
from dptrain.config import FLOAT32_TINY
from dptrain.messages import brief
from dptrain.clipping.rows import (COMPARED, MAX_ATTEMPTS, UNCHECKABLE, cannot_check,
                                   check_example_rows, check_stored_across)
from dptrain.clipping.rules import FALLBACK, LayerRule, _no_rule, find_rule
from dptrain.clipping.taps import TAP as _TAP
from dptrain.clipping.taps import OpTaps, Tapped, same_elements, tolerance
from dptrain.models.dropout import set_stream as set_dropout_stream
from dptrain.parallel.fsdp import all_reduce_scalars
from dptrain.tree import map_tensors

LossFn = Callable[[nn.Module, Any], Tensor]
#: [(coefficient, state), ...]: example b's query is u_b = sum_j a_j * grad l(state_j; x_b).
#: ``state`` maps parameter names to the values to evaluate at (None: the current values); the
#: coefficient is a float, or a dict name -> float for per-parameter coefficients (inner
#: momentum's separate Muon/AdamW histories; a missing name means 0). An optional third element
#: seeds torch's global RNG for that evaluation's forward (inside ``fork_rng``, so the current
#: state's forward consumes the global RNG exactly as without the plan); dptrain's dropout masks
#: follow the entry's index instead (``dptrain.models.dropout``). An
#: optional fourth element is a view, ``view(batch) -> batch`` (same examples, same order): the
#: entry is evaluated on the views (augmentation multiplicity, ``dptrain.data.augment``).
QueryPlan = list[tuple]


_HALF = (torch.float16, torch.bfloat16)


def _to_float(v: Any) -> Any:
    """Half tensors (autocast's captures) as float32, inside containers too (the torch.func
    fallback keeps its layer's inputs, lists among them, as a tuple; the conv rules nest the
    fallback's dict): the engine's arithmetic runs at float32 whatever the forward's
    precision."""
    return map_tensors(lambda t: t.float() if t.dtype in _HALF else t, v)


def _shapes(batch: Any) -> tuple:
    """The shapes of the batch's tensors, in order (for text: the padded length)."""
    return tuple(tuple(t.shape) for t in torch.utils._pytree.tree_leaves(batch)
                 if isinstance(t, Tensor))


def batch_size_of(batch: Any) -> int:
    """The number of examples: the leading dimension of the batch's first tensor (a tensor,
    or the first value of a dict, list or tuple, recursively)."""
    if isinstance(batch, Tensor):
        if batch.dim() == 0:
            raise ClippingError("dptrain.clipping: the batch's first tensor is a scalar; it must "
                                "have the examples along its first dimension")
        return batch.shape[0]
    if isinstance(batch, (dict, list, tuple)) and len(batch) == 0:
        raise ClippingError(f"dptrain.clipping: the batch is an empty {type(batch).__name__}; "
                            f"it must hold a tensor with the examples along its first dimension")
    if isinstance(batch, dict):
        return batch_size_of(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return batch_size_of(batch[0])
    raise TypeError(f"dptrain.clipping: cannot tell the batch size of a "
                    f"{type(batch).__name__}: the batch must be a tensor, or a dict, list or "
                    f"tuple whose first value is one, with the examples along its first "
                    f"dimension")


@dataclass
class _Record:
    module: nn.Module
    rule: LayerRule
    saved: dict
    coef: float | dict[str, float]  # the state's coefficient (per parameter: a dict)
    G: Tensor | None = None
    is_target: bool = False  # its output is a target of the backward
    output: Tensor | None = None
    version: int = 0
    node: Any = None  # the output's autograd node (tensor-hook captures)
    Gq: Tensor | None = None  # a tap's gradient rows (taps.py), for the rows check
    name: str = ""  # the layer's name in the model (for messages)


@dataclass
class StepStats:
    """Aggregates of one microbatch. ``loss_sum`` is computed from private data without noise:
    it is for progress display only and not covered by the privacy guarantee. The query's sizes
    are for the memory report (byte counts from shapes; the microbatch's size and padded length
    come from the sample, so they too are outside the guarantee): ``states`` evaluated,
    ``query_bytes`` held until the clip factors were known by the chosen norm forms
    (per-example buffers and captured layer factors; activations and the history not counted),
    and ``least_query_bytes``, the same with every parameter in its smaller form
    (``performance.ghost=memory``)."""

    num_examples: int = 0
    loss_sum: float = 0.0
    states: int = 1
    query_bytes: int = 0
    least_query_bytes: int = 0


@dataclass
class _Hooked:
    name: str
    module: nn.Module
    rule: LayerRule
    params: dict[str, nn.Parameter] = field(default_factory=dict)


def _swappable(p: Tensor, v: Tensor) -> bool:
    """Whether ``p.data`` may be pointed at ``v`` for a while: plain tensors of the same shape,
    dtype, device and strides (sharded FSDP2 parameters are copied into instead)."""
    return (type(p) is nn.Parameter and type(v) is Tensor and v.shape == p.shape
            and v.dtype == p.dtype and v.device == p.device and v.stride() == p.stride())


class _FirstForwardCheck(TorchFunctionMode):
    """Two things about a model that its classes do not tell, checked over the engine's first
    forward (the model's structure; later forwards run without this mode).

    The engine sees a parameter's uses through the hooks of the modules that own it: a use
    elsewhere (``F.linear(h, self.emb.weight)`` in a parent's forward) would be missing from
    the norms and the clipped sum. This mode refuses any torch call that takes a trainable
    parameter and gives a result autograd tracks, outside the forward of every hooked module
    owning it. Attribute reads and queries (``.dtype``, ``.data``, ``is_floating_point()``),
    ``detach()`` and calls under ``no_grad`` are not uses.
    Sharded (FSDP2) runs register gathered parameters, other tensors, in the modules during
    the forward: a trainable parameter not known by its identity is looked up in the modules'
    slots at its use.

    It also refuses a hooked layer's output (or a same-shaped result of it) that an op
    broadcasts against a tensor of more dimensions made from the batch (a weight is not one):
    its rows are then not the microbatch's
    examples, although its leading size may equal the microbatch's (nanoGPT's
    ``wpe(torch.arange(T))`` added to (B, T, d) token embeddings when T happens to equal B),
    and each example would be credited with the whole microbatch's gradient of one row.

    And it refuses a hooked layer whose input has the microbatch's leading size and rows that
    differ, but does not come from the batch (no torch op links it to the batch's tensors):
    ``wpe(torch.arange(T))`` at T = B again, which reshaped before the broadcast
    (``.unsqueeze(0)``) the check above does not see. Inputs made from one row for all
    (``arange(K).expand(B, K)``: learned queries) are the same for every example, and fine."""

    def __init__(self, engine: "ClippingEngine", batch: Any, batch_size: int):
        super().__init__()
        #: id -> weak reference: the batch's tensors and every result of a torch call on one
        self.derived: dict[int, weakref.ref] = {}
        for t in torch.utils._pytree.tree_leaves(batch):
            if isinstance(t, Tensor):
                self._derive(t)
        self.batch_size = batch_size
        self.owners: dict[int, tuple[list[int], str]] = {}
        for h in engine.hooked:
            for p in h.params.values():
                ids, name = self.owners.get(id(p), ([], engine.names[id(p)]))
                self.owners[id(p)] = (ids + [id(h.module)], name)
        self.active: dict[int, int] = {}
        self.hooked = [(h.module, h.name) for h in engine.hooked]
        self.engine = engine
        for t in engine.taps:  # used only through the engine's leaves: any use is elsewhere
            for p in t.params.values():
                self.owners.setdefault(id(p), ([], engine.names[id(p)]))
        #: (module, attribute, name): where each hooked parameter is registered, to find the
        #: tensors FSDP2 registers there during the forward (its gathered parameters, other
        #: objects than the sharded ones above; a tapped one's gathered copy is the one the
        #: taps see meet the examples, and is not looked up)
        self.slots = [(h.module, a, engine.names[id(p)])
                      for h in engine.hooked for a, p in h.params.items()]
        self.strangers: set[int] = set()  # parameters found in no slot (frozen, or foreign)
        self.handles: list = []
        #: id -> (weak reference, shape, layer name): hooked outputs and same-shaped results of
        #: them. Weak: keeping them would hold memory the forward frees; an entry leaves when its
        #: tensor dies, before its id can be reused.
        self.rows: dict[int, tuple[weakref.ref, torch.Size, str]] = {}

    def _derive(self, t: Tensor) -> None:
        derived, key = self.derived, id(t)
        derived[key] = weakref.ref(t, lambda _: derived.pop(key, None))

    def __enter__(self):
        def enter(module, args):
            self.active[id(module)] = self.active.get(id(module), 0) + 1
            x = args[0] if args else None
            B = self.batch_size
            if (isinstance(x, Tensor) and B > 1 and x.dim() and x.shape[0] == B
                    and id(x) not in self.derived and bool((x != x[:1]).any())):
                name = next(n for m, n in self.hooked if m is module)
                raise ClippingError(
                    f"dptrain.clipping: the input of {name} ({type(module).__name__}, shape "
                    f"{tuple(x.shape)}) does not come from the batch, and its {B} rows differ: "
                    f"they are not the microbatch's examples, although there are as many (a "
                    f"shared input, such as positions from torch.arange(T) with T = {B}). Give "
                    f"the layer one row per example, made from the batch by torch ops (a "
                    f"tensor built through numpy or Python lists looks shared too)")

        def forward_done(module, args, output):
            if self.active.get(id(module)):  # (not when a pre-hook before ``enter`` raised)
                self.active[id(module)] -= 1

        def leave(module, args, output, name):
            if not isinstance(output, Tensor):
                return
            B = self.batch_size
            if (B > 1 and output.dim() and output.shape[0] == B and id(output) not in self.derived
                    and bool((output.detach() != output.detach()[:1]).any())):
                raise ClippingError(
                    f"dptrain.clipping: the output of {name} ({type(module).__name__}, shape "
                    f"{tuple(output.shape)}) does not come from the batch's values, and its {B} "
                    f"rows differ: they are not the microbatch's examples, although there are "
                    f"as many (a table of positions sliced to the sequence length T = {B}, "
                    f"such as table[:x.shape[1]]), and each example would be credited with one "
                    f"row's gradient. Give the layer one row per example (expand its output to "
                    f"the microbatch inside it), or look positions up with an nn.Embedding on "
                    f"ids expanded to (B, T)")
            self._mark(output, name)

        for m, name in self.hooked:
            # A use of a parameter is its module's from the last forward pre-hook to the first
            # forward hook: the module's own forward. A user's hook on the module runs outside,
            # as the engine's capture hooks do: a use there (a forward hook adding the layer's
            # own bias again) is not in what the layer's rule computes (its output and input),
            # and is refused as any other use elsewhere (it went unseen: 7.9% off the norms)
            self.handles.append(m.register_forward_pre_hook(enter))
            self.handles.append(m.register_forward_hook(forward_done, prepend=True,
                                                        always_call=True))
            # the output after every hook: the tensor the rest of the forward computes from
            self.handles.append(m.register_forward_hook(
                lambda mod, a, o, name=name: leave(mod, a, o, name), always_call=True))
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.rows.clear()
        self.derived.clear()
        if exc[0] is None:  # a forward that raised (this check's refusal too) checked nothing
            self.engine._uses_checked = True
        return super().__exit__(*exc)

    def _mark(self, t: Tensor, name: str) -> None:
        rows, key = self.rows, id(t)
        rows[key] = (weakref.ref(t, lambda _: rows.pop(key, None)), t.shape, name)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._check_rows(func, args, kwargs, out)
        if any(isinstance(a, Tensor) and id(a) in self.derived
               for a in torch.utils._pytree.tree_leaves(_value_operands(func, args, kwargs))):
            for o in torch.utils._pytree.tree_leaves(out):
                if isinstance(o, Tensor):
                    self._derive(o)
        if torch.is_grad_enabled() and any(
                isinstance(o, Tensor) and o.requires_grad
                for o in torch.utils._pytree.tree_leaves(out)):
            for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                owner = self._owner(a) if isinstance(a, Tensor) else None
                if owner is not None and not any(self.active.get(m) for m in owner[0]):
                    raise ClippingError(
                        f"dptrain.clipping: the trainable parameter {owner[1]} is used outside "
                        f"the forward of the module that owns it (by "
                        f"{getattr(func, '__name__', func)}; a forward hook or pre-hook on the "
                        f"module is outside too): the hooks would not see that use, "
                        f"and its gradient would be missing from the per-example norms. Use it "
                        f"through a module (a tied head: an nn.Linear whose weight is the "
                        f"embedding's)")
        return out

    def _owner(self, a: Tensor) -> tuple[list[int], str] | None:
        """(the ids of the modules owning ``a``, its name) if ``a`` is a trainable parameter
        (a tapped one: by identity only), or one registered now in a hooked module's slot of
        one; else None."""
        owner = self.owners.get(id(a))
        if (owner is None and isinstance(a, nn.Parameter) and a.requires_grad
                and id(a) not in self.strangers):
            # FSDP2 registers gathered copies in the modules for the forward: look them up
            found: dict[int, tuple[list[int], str]] = {}
            for module, attr, name in self.slots:
                now = module._parameters.get(attr)
                if now is not None and id(now) not in self.owners:
                    ids, _ = found.get(id(now), ([], name))
                    found[id(now)] = (ids + [id(module)], name)
            self.owners.update(found)
            owner = self.owners.get(id(a))
            if owner is None:
                self.strangers.add(id(a))
        return owner

    def _check_rows(self, func, args, kwargs, out) -> None:
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                   if isinstance(a, Tensor)]
        marked = [self.rows[id(a)][1:] for a in tensors if id(a) in self.rows]
        if not marked or getattr(func, "__name__", "") == "__get__":
            return
        # against tensors made from the batch only: a weight of more dimensions (nn.Bilinear's,
        # a buffer in tensordot) has no examples to broadcast over
        top = max(t.dim() for t in tensors if id(t) in self.rows or id(t) in self.derived)
        kept = _einsum_rows_kept(func, args, kwargs, self.rows, self.derived)
        for shape, name in marked:
            if 0 < len(shape) < top and not kept:
                raise ClippingError(
                    f"dptrain.clipping: the output of {name} (shape {tuple(shape)}) is "
                    f"broadcast against a tensor of {top} dimensions (by "
                    f"{getattr(func, '__name__', func)}): its rows are not the microbatch's "
                    f"examples (a shared input, such as positions from torch.arange(T)). Give "
                    f"the layer one row per example: expand its input to the microbatch")
        if isinstance(out, Tensor) and any(out.shape == shape for shape, _ in marked):
            self._mark(out, marked[0][1])


#: torch calls that read only the dtype, device or shape of some tensor arguments: of
#: ``x.type_as(ids)`` (``to``, ``expand_as``, ...) only ``x``'s values, of ``ids.new_ones(T)`` and
#: ``torch.zeros_like(ids)`` none of ``ids``'s
_METADATA_OF_OTHERS = {"type_as", "to", "expand_as", "view_as", "reshape_as"}
_METADATA_OF_FIRST = {"new_ones", "new_zeros", "new_empty", "new_full", "new_tensor",
                      "new_empty_strided", "zeros_like", "ones_like", "empty_like", "full_like",
                      "rand_like", "randn_like", "randint_like"}


def _value_operands(func, args, kwargs) -> tuple:
    """The arguments whose values a torch call's result depends on: a result counts as derived
    from the batch only through those (``torch.arange(T).type_as(ids)`` is shared positions,
    not the batch's rows)."""
    name = getattr(func, "__name__", "")
    if name in _METADATA_OF_OTHERS:
        return args[:1]
    if name in _METADATA_OF_FIRST:
        return args[1:], {k: v for k, v in kwargs.items() if k != "input"}
    return args, kwargs


def _einsum_rows_kept(func, args, kwargs, rows: dict, derived: dict) -> bool:
    """Whether an einsum aligns the examples by label: every operand that is a hooked output or
    made from the batch has the same first subscript (``"bd,btd->bt"``, or ``"->tb"``: example
    b with example b), so operands of fewer dimensions are not broadcast over the examples
    (``"td,btd->bt"`` is). False for anything else (another function, ``...``, the sublist
    form): the dimension rule applies."""
    if func is not torch.einsum:
        return False
    equation = args[0] if args else kwargs.get("equation")
    operands = list(args[1:])
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = list(operands[0])
    if not isinstance(equation, str) or "." in equation:
        return False
    specs = equation.replace(" ", "").partition("->")[0].split(",")
    if len(specs) != len(operands):
        return False
    firsts = {spec[:1] for spec, op in zip(specs, operands)
              if isinstance(op, Tensor) and (id(op) in rows or id(op) in derived)}
    return len(firsts) == 1 and "" not in firsts


def _take_gradients(records: list[_Record], index: dict[int, Tensor | None]) -> None:
    """Give each record of a layer output its gradient from ``index`` (the backward's, by the
    output's ``id``: the record keeps the output alive until then) and drop the output."""
    for rec in records:
        if rec.is_target:
            if rec.output._version != rec.version:
                raise ClippingError(
                    f"dptrain.clipping: the output of {type(rec.module).__name__} was "
                    f"modified in place; its gradient cannot be captured")
            rec.G = index.get(id(rec.output))
            rec.output = None


def _check_reached(records: list[_Record], losses: Tensor) -> None:
    """A layer whose output gradient did not arrive must be one the loss does not use (its
    per-example gradient is then 0). If the loss does use it, no backward target lay below it
    (its input depends on parameters only, e.g. learned query tokens made from a parameter by a
    layer without inputs): its gradient would be missing from the norms, so refuse."""
    missing = [rec for rec in records if rec.G is None and rec.node is not None]
    if not missing:
        for rec in records:
            rec.node = None
        return
    seen, todo = set(), [losses.grad_fn]
    while todo:  # every node the loss reaches
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo.extend(nxt for nxt, _ in node.next_functions)
    for rec in records:
        if rec.G is None and rec.node is not None and rec.node in seen:
            raise ClippingError(
                f"dptrain.clipping: the output gradient of {rec.name} "
                f"({type(rec.module).__name__}) was not computed: its output reaches the loss, "
                f"but none of the inputs it depends on comes from the batch (it is computed "
                f"from parameters only). Make the layer's input depend on the batch, or fold "
                f"that computation into a layer that takes the batch as input")
        rec.node = None


def _refuse_unsupported(name: str, m: nn.Module) -> None:
    """Modules with trainable parameters (their own or their submodules') that no rule, tap or
    fallback handles, and embeddings whose forward writes their weight (``max_norm``); refused
    by name at construction (they failed in the first forward, with torch's own error, or were
    refused by a check that named something else, after the forward had written)."""
    from torch.nn.utils import parametrize

    if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
        # trainable or frozen: its forward writes the rows the private batch looks up
        raise ClippingError(
            f"dptrain.clipping: {name or type(m).__name__} ({type(m).__name__}) has max_norm "
            f"{m.max_norm}: its forward renormalises, in place, the weight rows the batch looks "
            f"up, so the model would hold what the private batch selected outside the clipped, "
            f"noised release (frozen too). Set max_norm=None")
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    for hook in m._forward_pre_hooks.values():
        if not isinstance(hook, (WeightNorm, SpectralNorm)):
            continue
        kind, made_from = (("weight_norm", (f"{hook.name}_g", f"{hook.name}_v"))
                           if isinstance(hook, WeightNorm) else
                           ("spectral_norm", (f"{hook.name}_orig",)))
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            where = f"{name} ({type(m).__name__})" if name else type(m).__name__
            raise ClippingError(
                f"dptrain.clipping: {where} has a torch.nn.utils.{kind} hook, which computes "
                f"its {hook.name} from {list(made_from)} in a forward pre-hook, outside the "
                f"layer's forward; the layer's rule takes {hook.name} for a parameter of its "
                f"own. Remove it (torch.nn.utils.remove_{kind}) or train without it")
    if not isinstance(m, (nn.MultiheadAttention, parametrize.ParametrizationList, nn.RNNBase,
                          nn.LSTMCell)):
        return
    trainable = sorted(k for k, p in m.named_parameters() if p.requires_grad)
    if not trainable:
        return
    where = f"{name} ({type(m).__name__})" if name else type(m).__name__
    if isinstance(m, (nn.RNNBase, nn.LSTMCell)):
        raise ClippingError(
            f"dptrain.clipping: {where} has the trainable parameters {trainable}: torch.nn's "
            f"recurrent layers (RNN, LSTM, GRU: every step in one fused kernel; LSTMCell: a "
            f"tuple (h, c) out) have no per-example rule. Loop over an nn.RNNCell or "
            f"nn.GRUCell, passing the initial state explicitly (hx=torch.zeros(B, H)), or "
            f"build the gates from nn.Linear layers")
    if isinstance(m, nn.MultiheadAttention):
        raise ClippingError(
            f"dptrain.clipping: {where} has the trainable parameters {trainable}: "
            f"torch.nn.MultiheadAttention computes its projections from its parameters inside "
            f"F.multi_head_attention_forward (out_proj's weight too), which has no per-example "
            f"rule. Build the attention from nn.Linear layers (as transformers' and timm's "
            f"models do; Opacus's DPMultiheadAttention is such a module) and the engine clips "
            f"it exactly")
    raise ClippingError(
        f"dptrain.clipping: {where} has the trainable parameters {trainable}: "
        f"parametrizations (torch.nn.utils.parametrize: parametrizations.weight_norm, "
        f"orthogonal, spectral_norm, ...) are not supported: the layer's weight is computed from "
        f"them, and the layer's rule gives the gradient of the weight only. Remove the "
        f"parametrization (parametrize.remove_parametrizations) or train without it")


#: torch's global forward hooks (``register_module_forward_hook``), a dict it mutates in place
_GLOBAL_FORWARD_HOOKS = torch.nn.modules.module._global_forward_hooks


def _global_hook_too_late(h: "_Hooked", module: nn.Module) -> ClippingError:
    return ClippingError(
        f"dptrain.clipping: a global forward hook (register_module_forward_hook) was "
        f"registered during the query, and runs on {h.name} ({type(module).__name__}) before "
        f"the engine could see the layer's own output. Register it before the query, or on the "
        f"modules themselves")


def _record_raw_outputs(cap: "_Capture", layers: set[int]):
    """A global forward hook, moved before the others, that records each hooked layer's own
    output and its version in ``cap.raw``, for the layer's hook to tell whether another global
    hook changed it (in place too); its handle."""

    def record(module, args, output):
        if id(module) in layers and isinstance(output, Tensor):
            cap.raw[id(module)] = (output, output._version)

    handle = torch.nn.modules.module.register_module_forward_hook(record)
    _GLOBAL_FORWARD_HOOKS.move_to_end(handle.id, last=False)
    return handle


@dataclass
class _Capture:
    """What one forward's hooks share: the microbatch's size, the state's coefficient, and the
    lists they fill (records, the backward's targets, the taps' uses)."""

    batch_size: int
    coef: float | dict[str, float]
    records: list[_Record]
    targets: list[Tensor]
    op_taps: list
    two_pass: bool
    tap_leaves: set[int] = field(default_factory=set)  # the tapped parameters' leaves
    #: the id of the engine's own global forward hook, first of them, registered when the query
    #: began with global hooks (None: there were none)
    recorder: int | None = None
    #: id(layer) -> (its forward's own output, its version): recorded by the engine's global
    #: hook, run before any other while there are others, and compared by the layer's hook
    raw: dict[int, tuple[Tensor, int]] = field(default_factory=dict)


def _tap_hooks(cap: _Capture, t: Tapped):
    """A tapped module's (pre, post) forward hooks: each call's parameters are swapped for
    leaves of the engine's, and each use of them that meets the examples gets a row per
    example (taps.py) whose gradient rows become records."""
    batch_size, records, targets, op_taps = cap.batch_size, cap.records, cap.targets, cap.op_taps
    tap_leaves = cap.tap_leaves
    # per call of the module: the values put back, and the OpTaps mode entered (or None)
    stack: list[tuple[dict[str, Tensor], OpTaps | None]] = []

    def record(module, attr: str, shape) -> _Record:
        rec = _Record(module, _TAP, {"attr": attr, "shape": tuple(shape)}, cap.coef,
                      name=f"{t.name}.{attr}" if t.name else attr)
        records.append(rec)
        return rec

    def pre(module, args, kwargs):
        swapped: dict[str, Tensor] = {}
        if not torch.is_grad_enabled():
            stack.append((swapped, None))
            return
        leaves, meetings = {}, {}
        for attr in t.params:
            cur = module._parameters[attr]  # (FSDP2: gathered by its pre-hook)
            leaf = cur.detach().requires_grad_(True)
            swapped[attr] = cur
            module._parameters[attr] = leaf  # type: ignore[assignment]
            tap_leaves.add(id(leaf))
            leaves[attr] = leaf
            targets.append(leaf)  # its whole gradient: "nothing is missing"
            meetings[attr] = []
            op_taps.append((t.names[attr], leaf, meetings[attr]))

        def on_meet(attrs, qa, q_B, module=module, leaves=leaves, meetings=meetings):
            attrs = sorted(attrs)
            mine = []
            for attr in attrs:
                rec = record(module, attr, leaves[attr].shape)
                meetings[attr].append(rec)
                mine.append(rec)
            mine[0].output = q_B  # (for the rows check: its rows' gradient, Gq)

            def hook(g, mine=mine, qa=qa, P=[leaves[a] for a in attrs]):
                mine[0].Gq = g
                # example b's gradient of each parameter: the VJP of row b through the
                # parameter-made computation P -> qa, which the backward frees after
                # this hook; a reshape of the parameter itself (ConvNeXt's
                # gamma.reshape(1, -1, 1, 1), a gain): the rows, reshaped
                if len(P) == 1 and same_elements(qa, P[0]):
                    per = (g.reshape(g.shape[0], *P[0].shape),)
                else:
                    per = torch.autograd.grad(qa, P, g.unsqueeze(1), retain_graph=True,
                                              is_grads_batched=True, allow_unused=True)
                for rec, grad in zip(mine, per):
                    rec.G = grad

            q_B.register_hook(hook)

        mode = OpTaps(leaves, (args, kwargs), batch_size, t.name or "<root>", on_meet)
        mode.__enter__()
        stack.append((swapped, mode))

    def post(module, args, kwargs, output):
        swapped, mode = stack.pop()
        for attr, cur in swapped.items():
            module._parameters[attr] = cur  # type: ignore[assignment]
        if mode is not None:
            mode.__exit__(None, None, None)
            made = [o for o in torch.utils._pytree.tree_leaves(output)
                    if mode.made_attr(o) is not None]
            if made and torch.is_grad_enabled():
                raise ClippingError(mode.refusal(
                    mode.made_attr(made[0]), "the module's forward",
                    "returns a tensor computed from it and not from the examples"))

    return pre, post


def _layer_hooks(cap: _Capture, h: _Hooked):
    """A hooked layer's (pre, post) forward hooks: the pre-hook makes the backward's targets
    (the examples' float inputs become leaves of the engine's, broadcast ids one row per
    example), the post-hook captures what the layer's rule needs and the output's gradient."""
    batch_size, targets, tap_leaves = cap.batch_size, cap.targets, cap.tap_leaves

    def pre(module, args):
        if _GLOBAL_FORWARD_HOOKS and torch.is_grad_enabled() and cap.recorder is None:
            raise _global_hook_too_late(h, module)
        if (cap.two_pass and torch.is_grad_enabled()
                and torch._C._autograd._top_saved_tensors_default_hooks(False)
                is not None):
            raise ClippingError(
                f"dptrain.clipping: mode='two_pass' with saved-tensor hooks active at "
                f"{h.name} (torch.autograd.graph.saved_tensors_hooks: activation "
                f"checkpointing, offloading or compression): its second backward "
                f"computes the weights' gradients from what the hooks give back, the "
                f"norms from the layer's real input (one example added 9.95 C, a red "
                f"team); use mode='bookkeeping'")
        if not torch.is_grad_enabled() or not args or not isinstance(args[0], Tensor):
            return None
        x = args[0]
        if h.rule.integer_input:
            if x.shape[0] == 1 and batch_size != 1:
                # broadcast ids (GPT-2's position_ids): one row per example, so each
                # example's gradient is separable; same forward values.
                return (x.expand(batch_size, *x.shape[1:]),) + tuple(args[1:])
            return None
        new = list(args)
        changed = False
        for i, a in enumerate(args):
            # a float input that needs no grad, or a caller's own leaf that does (not
            # a parameter): a leaf of the engine's, so a backward target lies below
            if isinstance(a, Tensor) and a.is_floating_point() and (
                    not a.requires_grad or (a.grad_fn is None
                                            and not isinstance(a, nn.Parameter)
                                            and id(a) not in tap_leaves)):
                leaf = a.detach().requires_grad_(True)
                targets.append(leaf)
                new[i] = leaf
                changed = True
        return tuple(new) if changed else None

    def post(module, args, output, kwargs=None):
        if not torch.is_grad_enabled():
            return None
        if _GLOBAL_FORWARD_HOOKS:
            # global hooks run before a module's own, this one included: it must see the
            # forward's own output, which the engine's global hook recorded before them (one
            # there is when the query began with global hooks)
            if cap.recorder is None:
                raise _global_hook_too_late(h, module)
            if next(iter(_GLOBAL_FORWARD_HOOKS)) != cap.recorder:
                raise ClippingError(
                    f"dptrain.clipping: a global forward hook (register_module_forward_hook) "
                    f"was moved before the engine's during the query, and ran on {h.name} "
                    f"({type(module).__name__}) before the engine could see the layer's own "
                    f"output. Leave torch's order of global hooks as it is")
            raw, version = cap.raw.pop(id(module), (output, None))
            if raw is not output or (version is not None and output._version != version):
                raise ClippingError(
                    f"dptrain.clipping: a global forward hook (register_module_forward_hook) "
                    f"changed the output of {h.name} ({type(module).__name__})"
                    f"{'' if raw is output else ' (returned another tensor)'}: "
                    f"it runs before the layer's own hooks, the engine's included, which would "
                    f"take the changed output for the layer's (norms 6-33% off, red teams). "
                    f"Register the hook on the module itself (it then runs after the "
                    f"engine's), or remove it for the query")
        if not isinstance(output, Tensor):
            raise ClippingError(f"dptrain.clipping: {h.name} ({type(module).__name__}) "
                                f"returned {type(output).__name__}, expected a Tensor")
        if output.shape[0] != batch_size:
            raise ClippingError(
                f"dptrain.clipping: {h.name} ({type(module).__name__}) produced a "
                f"leading dimension {output.shape[0]} for a microbatch of {batch_size} "
                f"examples (the leading dimension of the batch's first tensor): its "
                f"per-example gradients cannot be separated. Every layer's input and output "
                f"must hold the examples along their first dimension: a layer called on a "
                f"tensor shared by all examples (a position embedding of torch.arange(T)) "
                f"needs one row per example, made from the batch (torch.arange(T).expand(B, "
                f"T)); a sequence layer, batch_first=True")
        if not h.rule.wants_kwargs and not (args and isinstance(args[0], Tensor)):
            raise ClippingError(
                f"dptrain.clipping: {h.name} ({type(module).__name__}) was called without a "
                f"tensor as its first positional argument (a keyword input=...?): its rule "
                f"reads the layer's input from there; call it as layer(x)")
        saved = (h.rule.capture(module, args, output, kwargs) if h.rule.wants_kwargs
                 else h.rule.capture(module, args, output))
        rec = _Record(module, h.rule, saved, cap.coef, name=h.name)
        cap.records.append(rec)
        if not output.requires_grad:
            return None
        if not any(isinstance(a, Tensor) and a.requires_grad for a in args):
            rec.is_target = True
            rec.output = output
            rec.version = output._version
            targets.append(output)
            # the module returns a non-view alias of the target's storage, with a
            # version counter of its own: an in-place op after the layer (an
            # Embedding followed by ReLU(inplace=True)) then leaves the target as
            # the backward's input, whose gradient is w.r.t. the value before it
            return torch.ops.aten._unsafe_view(output, output.shape)
        else:
            def grab(g, rec=rec):
                rec.G = g

            replaced = None
            if output._is_view():
                # (a Linear on a (B, T, d) input returns a view) an in-place op on a
                # view rebases its history and the hooks registered on it never fire:
                # the layer would look unused and drop out of the norm. The module
                # returns a non-view alias of the same storage instead, whose hooks
                # see the gradient w.r.t. the value before any in-place op.
                output = replaced = torch.ops.aten._unsafe_view(output, output.shape)
            output.register_hook(grab)
            rec.node = output.grad_fn  # to tell "unused" from "not reached" later
            return replaced
        return None

    return pre, post


class ClippingEngine:
    """Per-example norms and clipped sums for ``model``'s trainable parameters.

    Args:
        model: any module whose trainable parameters all belong to layers with a rule, to
            parameter-owning leaf modules (the torch.func fallback), or to modules whose
            submodules have parameters of their own (tapped: taps.py).
        clip_norm: C; ``None`` only for computing norms.
        ghost: per-layer norm form, a performance setting (same result either way): by
            estimated time ("auto"), by bytes held ("memory"), or one form for every layer.
        mode: "bookkeeping" (one backward) or "two_pass" (second backward with weights).
        kernels: "torch", or "triton" for the fused ghost-product kernel
            (dptrain/kernels/ghost.py; CUDA, or CPU under TRITON_INTERPRET=1), a performance
            setting.
    """

    def __init__(self, model: nn.Module, *, clip_norm: float | None = None,
                 ghost: Literal["auto", "ghost", "instantiate", "memory"] = "auto",
                 mode: Literal["bookkeeping", "two_pass"] = "bookkeeping",
                 kernels: Kernels = "torch"):
        if clip_norm is not None:
            # NaN or inf made every clip factor 1 (no clipping at all), a negative C flipped
            # the sum's sign, 0 released noise only
            if isinstance(clip_norm, bool) or not isinstance(clip_norm, (int, float)):
                raise TypeError(f"dptrain.clipping: clip_norm must be a number or None, got "
                                f"{type(clip_norm).__name__}")
            if not (math.isfinite(clip_norm) and clip_norm >= FLOAT32_TINY):
                raise ClippingError(f"dptrain.clipping: clip_norm must be finite and at least "
                                    f"float32's smallest normal ({FLOAT32_TINY:.3g}), got "
                                    f"{clip_norm}")
        for name, value, allowed in (("ghost", ghost, ("auto", "ghost", "instantiate", "memory")),
                                     ("mode", mode, ("bookkeeping", "two_pass")),
                                     ("kernels", kernels, ("torch", "triton"))):
            if value not in allowed:  # (an unknown string was read as the default)
                raise ClippingError(f"dptrain.clipping: {name} must be one of {allowed}, got "
                                    f"{value!r}")
        self.model = model
        self.clip_norm = float(clip_norm) if clip_norm is not None else None
        self.ghost = ghost
        self.mode = mode
        self.kernels = kernels
        self.names: dict[int, str] = {}
        self.params: dict[str, nn.Parameter] = {}
        for n, p in model.named_parameters():
            if p.requires_grad:
                self.names[id(p)] = n
                self.params[n] = p
        if mode == "two_pass" and any(p.dtype not in (torch.float32, torch.float64)
                                      for p in self.params.values()):
            # (autocast is refused at the query for the same reason)
            raise ClippingError("dptrain.clipping: mode='two_pass' with parameters in "
                                f"{sorted({str(p.dtype) for p in self.params.values()})}: its "
                                "second backward's low-precision gradients would be added to "
                                "float32 norms (removing one bf16 example moved the release by "
                                "1.009 C, a red team); use mode='bookkeeping', or float32 "
                                "parameters")
        if mode == "two_pass" and any(hasattr(p, "to_local") for p in self.params.values()):
            # (its second backward reaches FSDP2's gathered copies, not these: the trainer
            # refuses performance.clipping=two_pass with sharding for the same reason)
            raise ClippingError("dptrain.clipping: mode='two_pass' with FSDP2-sharded "
                                "parameters: its second backward gives the gathered copies' "
                                "gradients, not the sharded parameters'; use "
                                "mode='bookkeeping' with sharding")
        hooked_grads = sorted(n for n, p in self.params.items()
                              if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks",
                                                              None))
        if hooked_grads:
            import warnings

            warnings.warn(f"dptrain.clipping: the parameters {hooked_grads} have gradient "
                          f"hooks (Tensor.register_hook, register_post_accumulate_grad_hook): "
                          f"the engine computes each example's gradient itself, and they run "
                          f"on none of them, nor on the clipped sum (a mask on an embedding's "
                          f"rows does not freeze them). Change the model instead (detach the "
                          f"rows, or freeze the parameter)", stacklevel=2)
        if not self.params:  # (a StopIteration at the first query before)
            raise ClippingError(f"dptrain.clipping: {type(model).__name__} has no trainable "
                                f"parameters (requires_grad=True): there is nothing to clip")
        self.hooked: list[_Hooked] = []
        #: parameters of modules with parameterised submodules, given one row per example
        self.taps: list[Tapped] = []
        owned: set[int] = set()
        for mname, m in model.named_modules():
            _refuse_unsupported(mname, m)
            direct = {k: p for k, p in m._parameters.items() if p is not None and p.requires_grad}
            if not direct:
                continue
            rule = find_rule(m)
            if rule is None and any(p.requires_grad for c in m.children()
                                    for p in c.parameters()):
                # a submodule has trainable parameters of its own (hooked separately): this
                # module's parameters are tapped, given one row per example (taps.py)
                self.taps.append(Tapped(mname, m, direct,
                                        {k: self.names[id(p)] for k, p in direct.items()}))
                owned.update(id(p) for p in direct.values())
                continue
            if rule is None or rule is FALLBACK:
                # (submodules without trainable parameters, timm's GroupNormAct's activation,
                # run inside the fallback's vmapped forward)
                import warnings

                warnings.warn(f"dptrain.clipping: {_no_rule(m)} ({mname}); using the "
                              f"torch.func fallback", stacklevel=2)
                rule = FALLBACK
            self.hooked.append(_Hooked(mname, m, rule, direct))
            owned.update(id(p) for p in direct.values())
        missing = [n for i, n in self.names.items() if i not in owned]
        assert not missing, f"trainable parameters not owned by any module: {missing}"
        #: (two_pass) the parameters of the last query whose second-backward sum the probe
        #: refused (:meth:`_probe_agrees`), summed by book-keeping instead
        self.summed_by_query: set[str] = set()
        self.summed_by_query_ever: set[str] = set()  # (each warned of once)
        #: warn of what happened at a query (two_pass's fallbacks, a rows check that could
        #: not be made): when, and whether, can depend on the examples; secure mode turns it
        #: off (the trainer), as its other notes
        self.warn_at_queries = True
        #: batch norms, refused when they use batch statistics (checked at every query:
        #: train()/eval() can change between calls)
        self._batchnorms = [(n, m) for n, m in model.named_modules()
                            if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        # Sensitive: per-example gradients of the last multi-state query stay here until
        # overwritten by the next one (or release_workspace()).
        self._workspace: dict[str, Tensor] = {}
        #: the first forward runs under _FirstForwardCheck (the model's structure, checked once)
        self._uses_checked = False
        #: examples kept to their own rows (rows.py), checked at the first query that can
        self._rows_checked = False
        self._pending_rows: tuple | None = None  # that check, due at the end of this query
        self._rows_attempts = 0  # first queries it found nothing in
        # Sensitive: a microbatch of one example, kept for the check of a later one until it
        # is done (or release_workspace())
        self._rows_other: Any = None
        self._rows_compared = False  # two one-example microbatches compared, of one shape
        #: tapped rows kept to their examples (``_check_tap_rows``), checked once
        self._taps_checked = not self.taps

    # -----------------------------------------------------------------------------------------
    # capture

    @contextlib.contextmanager
    def _capture(self, batch_size: int, coef: float | dict[str, float],
                 records: list[_Record], targets: list[Tensor],
                 op_taps: list) -> Iterator[None]:
        """One forward's hooks on every hooked layer and tapped module; they append to
        ``records``, ``targets`` and ``op_taps``, and are removed on leaving."""
        cap = _Capture(batch_size, coef, records, targets, op_taps, self.mode == "two_pass")
        handles = []
        if _GLOBAL_FORWARD_HOOKS:  # (none: torch's fast path for modules without hooks)
            handles.append(_record_raw_outputs(cap, {id(h.module) for h in self.hooked}))
            cap.recorder = handles[-1].id
        try:
            for h in self.hooked:
                pre, post = _layer_hooks(cap, h)
                if h.rule.wants_kwargs:  # the torch.func fallback re-runs the call: all of it
                    def pre_kw(module, args, kwargs, pre=pre):
                        new = pre(module, args)
                        return None if new is None else (new, kwargs)

                    def post_kw(module, args, kwargs, output, post=post):
                        return post(module, args, output, kwargs)

                    handles.append(h.module.register_forward_pre_hook(pre_kw, with_kwargs=True))
                    handles.append(h.module.register_forward_hook(post_kw, with_kwargs=True,
                                                                  prepend=True))
                    continue
                # prepend: the layer's own output, before a user's forward hook changes it (the
                # rule's gradient is w.r.t. what the layer computed)
                handles.append(h.module.register_forward_pre_hook(pre))
                handles.append(h.module.register_forward_hook(post, prepend=True))
            for t in self.taps:
                pre, post = _tap_hooks(cap, t)
                # after FSDP2's pre-hook gathers the parameters, put back before its post-hook
                # reshards them (prepend), and also when the forward raises (always_call)
                handles.append(t.module.register_forward_pre_hook(pre, with_kwargs=True))
                handles.append(t.module.register_forward_hook(
                    post, prepend=True, always_call=True, with_kwargs=True))
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextlib.contextmanager
    def _state(self, state: dict[str, Tensor] | None, seed: int | None = None) -> Iterator[None]:
        """Evaluate at ``state`` (name -> values), through ``.data`` (autograd's version
        counters are untouched): a parameter is pointed at the state's tensor and back
        afterwards (no copy); one whose storage must stay its own (FSDP2 gathers from it) has
        the values copied in and its own copied back. Under sharding the values are each
        rank's local shards. With ``seed``, the forward randomness
        comes from a forked RNG stream seeded with it. The state's names and shapes were checked
        with its plan (``_check_plan``)."""
        rng = contextlib.nullcontext()
        if seed is not None:
            devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
            rng = torch.random.fork_rng(devices=devices)
        with rng:
            if seed is not None:
                torch.manual_seed(seed)
            if not state:
                yield
                return
            saved, swapped = {}, {}
            try:
                with torch.no_grad():
                    for n, v in state.items():
                        p = self.params[n]
                        if _swappable(p, v):
                            # point the parameter at the state's tensor (no copy of the
                            # current values): the state is only read while it is in place
                            swapped[n] = p.data
                            p.data = v
                        else:  # FSDP2 gathers from the parameter's own storage: copy into it
                            saved[n] = p.data.clone()
                            p.data.copy_(v)
                # autocast keeps its low-precision copies of the weights, keyed by the
                # parameter, until its outermost region ends: neither a swap nor a copy shows
                # in them, so without this the state's forward would use the current weights
                torch.clear_autocast_cache()
                yield
            finally:
                with torch.no_grad():
                    for n, v in swapped.items():
                        self.params[n].data = v
                    for n, v in saved.items():
                        self.params[n].data.copy_(v)
                torch.clear_autocast_cache()  # (and the state's copies must not outlive it)

    # -----------------------------------------------------------------------------------------
    # the private query of one microbatch

    def _check_plan(self, plan: QueryPlan) -> None:
        """Before any forward: every name in a coefficient dict or a state is a trainable
        parameter's, under the name the engine gives it (a name it does not know would get
        coefficient 0, or no value), and every state value has its parameter's shape (global,
        or the local shard's when sharded; a value is never broadcast)."""
        for entry in plan:
            if not isinstance(entry, (tuple, list)) or len(entry) < 2:
                raise ClippingError(f"dptrain.clipping: a plan entry must be (coefficient, state "
                                    f"or None[, seed[, view]]), got {entry!r}")
            coef, state = entry[0], entry[1]
            values = coef.values() if isinstance(coef, dict) else [coef]
            if not all(isinstance(a, (int, float)) and not isinstance(a, bool)
                       and math.isfinite(a) for a in values):
                # a NaN coefficient made the clipped sum NaN
                raise ClippingError(f"dptrain.clipping: a plan's coefficients must be finite "
                                    f"numbers, got {coef!r}")
            unknown = sorted(set(coef) - self.params.keys()) if isinstance(coef, dict) else []
            if unknown:
                raise ClippingError(f"dptrain.clipping: a plan's coefficients name {unknown}, "
                                    f"which are not trainable parameters of the model under "
                                    f"the names the engine gives them (a parameter tied to "
                                    f"another goes by the first name named_parameters() gives "
                                    f"it)")
            unknown = sorted(set(state or {}) - self.params.keys())
            if unknown:
                raise ClippingError(f"dptrain.clipping: a plan's state gives {unknown}, which are "
                                    f"not trainable parameters of the model (a state holds values "
                                    f"of trainable parameters only)")
            for n, v in (state or {}).items():
                p = self.params[n]
                shapes = {tuple(p.shape)}
                if hasattr(p, "to_local"):  # a sharded parameter: its local shard too
                    shapes.add(tuple(p.to_local().shape))
                if tuple(v.shape) not in shapes:
                    raise ClippingError(f"dptrain.clipping: a plan's state gives {n} the shape "
                                        f"{tuple(v.shape)}, but the parameter's is "
                                        f"{tuple(p.shape)} (a value is never broadcast)")

    def _check_params(self) -> None:
        """The model's trainable parameters and hooked layers must be those the engine was
        built for (every query; a walk over the modules): a layer frozen since would be
        released as noise alone, and moved by the optimizer; one added, unfrozen, or put in
        place of a hooked one (even holding the same parameters: the hooks are on the old
        one) would be left out of the norms and the release, or fail deep in the query."""
        if self._same_params_and_layers():
            return
        if any(hasattr(p, "to_local") for p in self.params.values()):
            # FSDP2 leaves the root's parameters unsharded after a forward without gradients
            # (an evaluation): sharded again, they are the engine's
            from dptrain.parallel.fsdp import reshard

            reshard(self.model)
            if self._same_params_and_layers():
                return
        now = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        frozen = sorted(set(self.params) - set(now))
        new = sorted(set(now) - set(self.params))
        swapped = sorted(n for n in set(now) & set(self.params) if now[n] is not self.params[n])
        modules = dict(self.model.named_modules())
        layers = sorted(h.name for h in self.hooked if modules.get(h.name) is not h.module)
        said = "; ".join(f"{what}: {names[:4]}{' ...' if len(names) > 4 else ''}"
                         for what, names in (("frozen or removed", frozen),
                                             ("trainable and new to it", new),
                                             ("replaced by another tensor", swapped),
                                             ("layers replaced or removed", layers)) if names)
        raise ClippingError(f"dptrain.clipping: the model's trainable parameters or layers "
                            f"changed since the engine was built ({said}): build a new "
                            f"ClippingEngine (and optimizer) for the model as it is now, or set "
                            f"requires_grad and load weights in place (load_state_dict without "
                            f"assign=True) before building it")

    def _same_params_and_layers(self) -> bool:
        params = self.params
        count = 0
        for n, p in self.model.named_parameters():
            if p.requires_grad:
                if params.get(n) is not p:
                    return False
                count += 1
        if count != len(params):
            return False
        modules = dict(self.model.named_modules())
        return all(modules.get(h.name) is h.module for h in self.hooked)

    def _forward_backward(self, loss_fn: LossFn, batch: Any, plan: QueryPlan, retain: bool,
                          query: "_Query"):
        """Evaluate every state of the plan; each state's captured tensors are turned into
        contributions and handed to ``query`` as soon as that state's backward is done (so a
        parameter whose contributions are instantiated keeps one per-example buffer, not every
        state's activations). ``retain`` (two_pass): each state's graph is kept, and returned
        as (coefficient, state, per-example losses) for the second backward."""
        self._check_params()
        for name, m in self._batchnorms:
            # (torch's own test: without running statistics it normalises by the batch's in
            # eval mode too)
            if m.training or (m.running_mean is None and m.running_var is None):
                state = ("is in training mode" if m.training else
                         "keeps no running statistics (track_running_stats=False), so it uses "
                         "the batch's in eval mode too")
                raise ClippingError(
                    f"dptrain.clipping: {name} ({type(m).__name__}) {state}: its "
                    f"batch statistics couple the examples of a microbatch, so an example's "
                    f"gradient depends on the others and no clip bounds its influence. Use "
                    f"GroupNorm or LayerNorm, or keep it in eval mode (running statistics)")
        self._check_plan(plan)
        if not torch.is_grad_enabled():
            raise RuntimeError(
                "dptrain.clipping: called with autograd disabled (torch.no_grad() or "
                "torch.inference_mode()): the per-example gradients need the backward; call it "
                "outside those contexts")
        # the whole query in IEEE float32 products (precision.py): TF32 or bf16 products
        # would round the norms and the clipped sums apart, and two_pass's second backward,
        # like the engine's checks, must see the same output gradients as the first
        with ieee_float32():
            return self._evaluate_states(loss_fn, batch, plan, retain, query)

    def _evaluate_states(self, loss_fn: LossFn, batch: Any, plan: QueryPlan, retain: bool,
                         query: "_Query"):
        B = batch_size_of(batch)
        self._pending_rows = None
        graphs = []
        loss_total = None  # per-example losses at the current state (display only)
        current = 0  # entries at the current state (several views: their losses are averaged)
        for j, entry in enumerate(plan):
            coef, state = entry[0], entry[1]
            seed = entry[2] if len(entry) > 2 else None
            view = entry[3] if len(entry) > 3 else None
            inputs = view(batch) if view is not None else batch
            set_dropout_stream(j)  # per-example dropout masks: entry j's own stream
            targets: list[Tensor] = []
            records: list[_Record] = []
            op_taps: list[tuple[str, Tensor, list[_Record]]] = []  # (name, leaf, its meetings)
            if j == 0 and not self._rows_checked:  # at the end of the query (_finish_rows_check)
                self._pending_rows = (loss_fn, batch, view, B, state)
            with self._state(state, seed), self._capture(B, coef, records, targets,
                                                                     op_taps):
                losses = self._losses(loss_fn, inputs, B, retain)
                if not state:  # the current parameters (as in _state)
                    d = losses.detach()
                    loss_total = d if loss_total is None else loss_total + d
                    current += 1
                index = self._backward(losses, targets, records, B, retain)
            del targets  # (the outputs live on in their records until their gradient is taken)
            self._check_op_taps(op_taps, index)
            del op_taps
            _take_gradients(records, index)
            del index
            _check_reached(records, losses)
            with self._exact():
                query.add(self._contributions(records))
            del records
            if retain:
                graphs.append((coef, state, losses))
        if current > 1:
            loss_total = loss_total / current
        return graphs, loss_total

    def _losses(self, loss_fn: LossFn, inputs: Any, B: int, retain: bool) -> Tensor:
        """One state's forward: ``loss_fn``'s per-example losses, checked (a tensor of shape
        (B,) that depends on the trainable parameters; float32 or float64 for two_pass), with
        the forward's failures that the engine's taps can cause said as such."""
        check = contextlib.nullcontext()
        if not self._uses_checked:  # (sets _uses_checked once a forward passed)
            check = _FirstForwardCheck(self, inputs, B)
        with check:  # the forward only: it keeps references to outputs while open
            try:
                losses = loss_fn(self.model, inputs)
            # (torch's own shape checks raise ValueError or AssertionError too)
            except (RuntimeError, IndexError, ValueError, AssertionError) as e:
                if "appears to not have been used in the graph" in str(e):
                    raise ClippingError(
                        f"dptrain.clipping: loss_fn differentiates with respect to a "
                        f"tensor of the batch (torch.autograd.grad inside it: a "
                        f"gradient penalty, an input-gradient loss), which is not "
                        f"supported: the engine gives each layer a leaf of its own as "
                        f"input, and its per-example rules are for losses of the "
                        f"layers' outputs, not of their gradients ({brief(e)})"
                    ) from e
                # (the engine's own refusals, raised from its hooks, are ClippingErrors)
                if self._taps_checked or isinstance(e, ClippingError):
                    raise
                raise ClippingError(
                    f"dptrain.clipping: the forward failed with the tapped parameters "
                    f"{self._tap_names()} given one row per example (clipping/taps.py):"
                    f" {brief(e)}. If that is a "
                    f"shape error, the forward uses such a parameter in a way that does "
                    f"not broadcast it over the examples (p.view(-1), or after a reshape "
                    f"of the examples' tensors): move it into a module of its own (timm's "
                    f"LayerScale), whose rule or torch.func fallback gives its "
                    f"per-example gradient") from e
        if not isinstance(losses, Tensor):
            raise TypeError(f"loss_fn must return a tensor of per-example losses of "
                            f"shape ({B},), got {type(losses).__name__}")
        if retain and losses.dtype not in (torch.float32, torch.float64):  # two_pass
            # (its second backward weights them by the clip factors rounded to theirs)
            raise ClippingError(
                f"dptrain.clipping: mode='two_pass' with losses in {losses.dtype}: the "
                f"second backward's weights, the clip factors, would be rounded to it "
                f"(up to 2^-8 more: 1.003 C from one example, a red team); return "
                f"float32 losses, or use mode='bookkeeping'")
        if losses.shape != (B,):
            raise ValueError(f"loss_fn must return per-example losses of shape ({B},), "
                             f"got {tuple(losses.shape)}")
        if not losses.requires_grad:
            # (an empty sum, silently: the release would be noise only)
            raise ClippingError("dptrain.clipping: loss_fn's losses do not depend on the "
                                "trainable parameters (detached, or computed without "
                                "autograd): there is no gradient to clip")
        return losses

    def _backward(self, losses: Tensor, targets: list[Tensor], records: list[_Record], B: int,
                  retain: bool) -> dict[int, Tensor | None]:
        """One state's backward, of the summed ``losses`` to the captured layer outputs
        ``targets`` (the graph kept when ``retain``); their gradients by ``id``. The first
        query with tapped parameters also checks the taps' rows here (``_check_tap_rows``)."""
        loss = losses.sum()
        live = [t for t in targets if t.requires_grad]
        taps = [rec for rec in records if rec.rule is _TAP]
        # (under a process group on every rank at once: FSDP2 gathers in the backward)
        collective = (torch.distributed.is_available()
                      and torch.distributed.is_initialized())
        check_taps = not self._taps_checked and (B > 1 or collective) and bool(taps)
        try:
            grads = (torch.autograd.grad(loss, live, allow_unused=True,
                                         retain_graph=retain or check_taps)
                     if loss.requires_grad and live else [None] * len(live))
        except RuntimeError as e:
            if "use_reentrant" not in str(e):
                raise
            raise ClippingError(
                "dptrain.clipping: the model uses torch.utils.checkpoint with "
                "use_reentrant=True, whose forward runs without autograd (the engine's "
                "hooks see no layer in it) and whose backward autograd.grad cannot "
                "run: pass use_reentrant=False (transformers: "
                "gradient_checkpointing_enable(gradient_checkpointing_kwargs="
                "{'use_reentrant': False}))") from e
        if check_taps:
            # at the state still in place: the retained graph reads the parameters'
            # values when its backward runs (a plan led by another state than the
            # current one, DiSK's, was refused when the check ran after it: a fuzz);
            # the check's backward fires the hooks too: what they grab is put back
            grabbed = [rec.G for rec in records]
            self._check_tap_rows(losses, [
                (rec.name, rec.output, rec.Gq) for rec in taps], retain, collective)
            for rec, G in zip(records, grabbed):
                rec.G = G
            del grabbed
        for rec in taps:  # (their rows were for the check only)
            rec.output = rec.Gq = None
        return {id(t): g for t, g in zip(live, grads)}

    #: the probe's tolerance: 2^-13 of sum_b |lam_b| sum_t |L_bt| |R_bt| (a bound on either
    #: sum's float32 rounding, which stays far below it), and at most 1e-4 C over the square
    #: root of the number of parameters probed: the bound grows with the microbatch's tokens
    #: (a difference under it from one example went out: 1.5 C at B = 256, T = 1024, a red
    #: team), and differences spread over many parameters add up (1e-3 C over 1,024, another);
    #: float32 differences were at most 2.8e-6 C
    PROBE_TOLERANCE = 2.0 ** -13
    PROBE_TOLERANCE_C = 1e-4
    #: random projections per parameter: a difference E of many directions escapes all of them
    #: with probability ~ (tolerance / |E|)^k (u^T E v is about |E|_F N(0, 1)); one of rank
    #: 1 (a token's) more often (u^T E v a product of two normals: 2.3e-3 at 10x the tolerance)
    PROBES = 4

    def _probe(self, contribs: list, lam: Tensor, rng: torch.Generator | None,
               directions: tuple[Tensor, Tensor] | None = None) -> dict | None:
        """Random projections of the book-keeping sum of a parameter's ``contribs`` (all plain
        :class:`Outer`: sum_b lam_b coef sum_t L_bt (x) R_bt, the parameter viewed as (L's
        width, R's width)): ``want`` = u^T S v for ``PROBES`` Gaussian pairs (u, v), each
        O(B T (out + in)), the sum never formed, with ``scale`` = sum_b |lam_b coef| sum_t
        |L_bt| |R_bt|, a bound on the sum's rounding. ``directions``: (U, V) again, for
        :meth:`_probe_repeats`. None without contributions."""
        if not contribs:
            return None
        c0 = contribs[0]
        width_l = c0.L.num if isinstance(c0.L, OneHot) else c0.L.shape[-1]
        width_r = c0.R.shape[-1]
        device = c0.R.device
        k = self.PROBES
        if directions is None:
            U = torch.randn(width_l, k, generator=rng, dtype=torch.float64).to(device)
            V = torch.randn(width_r, k, generator=rng, dtype=torch.float64).to(device)
        else:
            U, V = directions
        # on the device, no sync: the caller reads every parameter's verdict at once
        want = torch.zeros(k, dtype=torch.float64, device=device)
        scale = torch.zeros((), dtype=torch.float64, device=device)
        for c in contribs:
            w = (lam.double() * c.coef).to(device)
            R = c.R
            rv = (R @ V.to(R.dtype)).double()  # (B, T, k)
            if isinstance(c.L, OneHot):
                lu = U[c.L.ids]
                l_norm = torch.ones(c.L.ids.shape, dtype=torch.float64, device=device)
            else:
                lu = (c.L @ U.to(c.L.dtype)).double()
                l_norm = c.L.norm(dim=-1).double()  # (the scale needs no more precision)
            want += torch.einsum("b,btk,btk->k", w, lu, rv)
            r_norm = R.norm(dim=-1).double()
            scale += torch.einsum("b,bt,bt->", w.abs(), l_norm, r_norm)
        return {"U": U, "V": V, "want": want, "scale": scale, "widths": (width_l, width_r)}

    def _probe_agrees(self, probe: dict | None, g: Tensor | None, cap: float,
                      device: torch.device) -> Tensor:
        """Whether the second backward's sum ``g`` (None: none reached the parameter) has the
        projections of :meth:`_probe`, to min(2^-13 ``scale``, ``cap``): a bool tensor on
        ``device``, not read here (one sync for all parameters)."""
        if probe is None:  # no contributions: nothing may arrive
            return (torch.ones((), dtype=torch.bool, device=device) if g is None
                    else ~g.any().to(device))
        U, V, (width_l, width_r) = probe["U"], probe["V"], probe["widths"]
        if g is not None and g.numel() != width_l * width_r:
            return torch.zeros((), dtype=torch.bool, device=device)
        if g is None:
            got = torch.zeros(U.shape[1], dtype=torch.float64, device=U.device)
        else:
            G = g.reshape(width_l, width_r).double()
            got = ((U.to(G.device).T @ G) * V.to(G.device).T).sum(-1)
        tolerance = torch.clamp(self.PROBE_TOLERANCE * probe["scale"], max=cap)
        return ((got.to(U.device) - probe["want"]).abs() <= tolerance).all().to(device)

    def _probe_repeats(self, probe: dict, contribs: list, lam: Tensor, cap: float) -> bool:
        """Whether ``contribs`` still have ``probe``'s projections (a parameter about to take
        the book-keeping sum: its factors are unchanged since the probe, which catches writes
        through ``.data`` as well). The same ops on the same tensors: equal but for a
        nondeterministic kernel's rounding, to 2^-20 of the scale and 1% of the probe's
        ``cap`` (2^-20 of the scale alone let a write of 0.2% into one example's input out
        at B = 256, T = 1024, a red team)."""
        again = self._probe(contribs, lam, None, (probe["U"], probe["V"]))
        tolerance = min(2.0 ** -20 * float(torch.maximum(probe["scale"], again["scale"])),
                        0.01 * cap)
        return bool(((again["want"] - probe["want"]).abs() <= tolerance).all())

    def _check_op_taps(self, op_taps: list, index: dict) -> None:
        """A tapped parameter's per-example gradients must add up to its whole gradient
        (its leaf is a target of the backward): a tensor computed from it that reached the loss
        without meeting the examples' tensors inside its module would be missing from the
        norms (taps.py). Every query; a sum over the examples, and a norm."""
        device_type = next(iter(self.params.values())).device.type
        for name, leaf, recs in op_taps:
            total = index.get(id(leaf))
            pers = [rec.G for rec in recs if rec.G is not None]
            if total is None and not pers:
                continue
            want = (torch.zeros_like(leaf, dtype=torch.float64) if total is None
                    else total.detach().double())
            got = torch.zeros_like(want)
            scale = float(want.norm())
            for per in pers:
                got += per.detach().double().sum(0)
                scale += float(per.detach().double().reshape(per.shape[0], -1).norm(dim=1).sum())
            if float((got - want).norm()) > tolerance(leaf.dtype, device_type) * scale:
                raise ClippingError(
                    f"dptrain.clipping: the parameter {name} (tapped: its module has submodules "
                    f"with parameters of their own) reaches the loss other than where the "
                    f"forward of its module combines it with the examples' tensors (a tensor "
                    f"made from it alone is fed to a layer, or kept and used elsewhere): part of "
                    f"its gradient would be missing from the per-example norms. Move it into a "
                    f"module of its own (timm's LayerScale), whose rule or torch.func fallback "
                    f"gives its per-example gradient")

    def _tap_names(self) -> list[str]:
        return [name for t in self.taps for name in t.names.values()]

    def _check_tap_rows(self, losses: Tensor, taps: list[tuple[str, Tensor, Tensor | None]],
                        retain: bool, collective: bool) -> None:
        """Row b of a tapped parameter's B rows (where it met the examples) must reach loss b
        alone, or its gradient is not example b's (the forward indexed or reduced the expanded
        rows, ``p.expand(B, ...)[0]``, or broadcast them against another dimension than the
        examples'). The rows are equal, so the forward's values cannot tell; the gradients can:
        with weights w_b, the gradient of sum_b w_b loss_b must be row by row w_b times that of
        sum_b loss_b. One more backward over the retained graph, with a generator of its own
        (the run's random streams are untouched), until a query of two or more examples has
        been checked. ``collective``: every rank runs it at each query until then (one example:
        nothing to compare, but the backward's gathers must pair up); it is done on every rank
        once any rank compared, and every rank refuses if any found mixed rows."""
        live = [(name, leaf, g) for name, leaf, g in taps if g is not None]
        if not live:
            return
        B = losses.shape[0]
        # weights 1, 1 + 1/B, ..., 2 - 1/B in a random order: any two differ by 1/B or more
        # (random draws could nearly coincide, and mixing between those two examples would go
        # unseen: w = 0.8199 and 0.8211 at B = 2 let a (B, C) row broadcast over positions T = B
        # through, found by a fuzz)
        gen = torch.Generator().manual_seed(0x7A95)
        w = 1.0 + torch.randperm(B, generator=gen).to(torch.float64) / B
        weighted = (losses * w.to(losses.device, losses.dtype)).sum()
        again = torch.autograd.grad(weighted, [leaf for _, leaf, _ in live], allow_unused=True,
                                    retain_graph=retain)
        # to 1e-3 of the row (float32 rounding of the two backwards reached 1.1e-4 of a ViT's
        # class-token row 100x smaller than the largest: a fuzz); rows below 1e-2 of the
        # largest are measured against that (rounding, not mixing). Mixing rows (p[0],
        # .mean(0), a (T, B, d) layout) moves every row by a fraction of order 1/B.
        tol = max(tolerance(losses.dtype, losses.device.type), 1e-3)
        found = None
        for (name, leaf, g), h in zip(live, again):
            want = (w.to(g.device)[:, None] * g.detach().double().reshape(B, -1))
            got = (torch.zeros_like(want) if h is None else h.double().reshape(B, -1))
            err = (got - want).norm(dim=1)
            rows = torch.maximum(want.norm(dim=1), got.norm(dim=1))
            scale = torch.clamp(rows, min=1e-2 * float(rows.max()))
            bad = ((err > tol * scale) & (rows.max() > 0)).nonzero().flatten().tolist()
            if bad and found is None:
                found = (f"rows {bad[:8]} of the microbatch", name)
        compared = B > 1  # one example (a phantom, or a rank's share of one) compares nothing
        if collective:  # every rank refuses together (or one would wait for the others)
            anywhere, compared_anywhere = all_reduce_scalars(
                float(found is not None), float(compared), device=losses.device, op="max")
            if anywhere > 0 and found is None:
                found = ("on another rank", " or ".join(name for name, _, _ in live))
            # done once some rank compared rows: then every rank is (the same flag everywhere,
            # so that the ranks' next checks, if any, pair up)
            compared = compared_anywhere > 0
        if found is not None:
            where, name = found
            raise ClippingError(
                f"dptrain.clipping: the parameter {name}, given one row per example where it "
                f"meets the examples (tapped: its module has submodules with parameters of "
                f"their own), has rows that reach other examples' losses ({where}): the "
                f"forward indexes or reduces those rows (p.expand(B, ...)[0], .mean(0)), or "
                f"broadcasts them against another dimension than the examples' (a (T, B, d) "
                f"layout), so row b's gradient is not example b's. Broadcast the parameter "
                f"against the examples' (B, ...) tensors, or move it into a module of its own")
        self._taps_checked = compared

    def _finish_rows_check(self) -> None:
        """Row b of every hooked input and loss b depend on example b alone (rows.py): checked
        by perturbation once the first query whose forward passed the structural checks is
        done (its captures, per-example buffers and graphs released by then, so the check's
        forwards do not raise the step's peak), before its clipped sum reaches the caller. In
        one process, a microbatch where no replaced example reached a layer (all alike, only
        labels differing) leaves it for the next, up to MAX_ATTEMPTS; a microbatch of one
        example is compared with an earlier one's (``check_stored_across``: the buffers). With a
        process group every rank checks at each query until some rank's check was done
        (ranks whose share is one example compare nothing), so that all ranks run the check's
        forwards together (FSDP gathers in each); the ranks must run as many queries (the
        trainer's phantom microbatches). A refusal leaves it due."""
        pending, self._pending_rows = self._pending_rows, None
        if pending is None:
            return
        loss_fn, batch, view, B, state = pending
        collective = torch.distributed.is_available() and torch.distributed.is_initialized()
        hooked = [(h.name, h.module) for h in self.hooked]
        # (its forwards round as the query's did: IEEE products, see _forward_backward)
        with self._state(state), ieee_float32():  # the plan's first entry: dropout stream 0
            if B == 1 and not collective:
                # nothing to replace in one example: a buffer written from the data is seen
                # by comparing its forward with an earlier one-example microbatch's (whose
                # length, for text, is that example's own: rows.py)
                # Done once two of different shapes were compared (text: two lengths, so
                # that a buffer of the length is seen too), or, after MAX_ATTEMPTS, two of one
                other = self._rows_other
                done = False
                if other is not None:
                    other_shapes = _shapes(batch) != _shapes(other)
                    found = check_stored_across(self.model, hooked, loss_fn, batch, other, 0,
                                                view=view, other_shapes=other_shapes,
                                                warn=self.warn_at_queries)
                    self._rows_compared |= found == COMPARED
                    done = found == UNCHECKABLE or (found == COMPARED and other_shapes)
                if not done:
                    self._rows_other = torch.utils._pytree.tree_map(
                        lambda t: t.detach().clone() if isinstance(t, Tensor) else t, batch)
            else:
                done = check_example_rows(self.model, hooked, loss_fn, batch, B, 0, view=view,
                                          collective=collective, warn=self.warn_at_queries)
        # (under a process group every check is a round of forwards on every rank, and the
        # ranks must count alike: their microbatch sizes differ)
        self._rows_attempts += 1
        if (not done and self._rows_attempts >= MAX_ATTEMPTS and self._rows_compared
                and B == 1 and not collective):
            done = True  # one-example microbatches, all of one shape: compared, not for length
        elif not done and self._rows_attempts >= MAX_ATTEMPTS:
            cannot_check(f"in {self._rows_attempts} microbatches no example that differs from "
                         f"another reached a layer's input (inputs alike, only labels differ, "
                         f"or one example per rank?)", warn=self.warn_at_queries)
            done = True
        self._rows_checked = done
        if done:
            self._rows_other = None

    def _contributions(self, records: list[_Record]) -> dict[str, list[Contribution]]:
        per_param: dict[str, list[Contribution]] = {}
        for rec in records:
            if rec.G is None:  # the layer's output did not reach the loss
                continue
            G = _to_float(rec.G)
            rec.saved = _to_float(rec.saved)
            contributions = rec.rule.contributions(rec.module, rec.saved, G)
            # one parameter may be registered under several names (``self.w2 = self.w1``):
            # the rule computes it under one of them
            aliases: dict[int, set[str]] = {}
            for k, p in rec.module._parameters.items():
                if p is not None and p.requires_grad and (rec.rule is not _TAP
                                                          or k == rec.saved["attr"]):
                    aliases.setdefault(id(p), set()).add(k)
            own = set().union(*aliases.values())
            if (any(len(names & contributions.keys()) != 1 for names in aliases.values())
                    or contributions.keys() - rec.module._parameters.keys()):
                # e.g. torch.nn.utils.weight_norm: weight_g and weight_v next to a computed
                # weight, which the Linear rule would credit to a parameter that is not there
                raise ClippingError(
                    f"dptrain.clipping: {rec.name} ({type(rec.module).__name__}) has the "
                    f"trainable parameters {sorted(own)}, and its rule "
                    f"({type(rec.rule).__name__}) computes {sorted(contributions)}: a "
                    f"gradient would be missing from the norms. Parametrizations (weight_norm, "
                    f"spectral_norm) are not supported")
            for attr, c in contributions.items():
                p = rec.module._parameters[attr]
                if p is None or not p.requires_grad:
                    continue
                name = self.names[id(p)]
                a = rec.coef.get(name, 0.0) if isinstance(rec.coef, dict) else rec.coef
                if a == 0.0:
                    continue
                c.coef = c.coef * a
                per_param.setdefault(name, []).append(c)
            rec.saved = {}
            rec.G = None
        return per_param

    def _norms(self, query: "_Query", B: int, device, dtype):
        """Per-example norms of the query; returns (norms, forms kept for the clipped sum,
        whether some examples' ghost sums were within rounding of 0 and had their rows
        instantiated). The query's entries are released as they are consumed. The parameters'
        squared norms are added in float64 (hundreds of terms)."""
        sq = torch.zeros(B, device=device, dtype=torch.float64)
        used = {}
        ghost = []  # (name, squared norms, examples whose ghost sum is within rounding of 0)
        for name in list(query.forms):
            total = query.dense.pop(name, None)
            if total is not None:  # instantiated, states already summed
                s = sq_rows(total)
                used[name] = [Dense(total, 1.0)]
            else:
                s, scale, used[name] = squared_norms_scaled(query.lists.pop(name), self.kernels)
                doubt = cancelled(s, scale, tokens(used[name]))
                if doubt is not None:
                    ghost.append((name, s, doubt))
                    continue
            sq = sq + s.to(sq.dtype)
        # one device sync for all parameters; the recomputation itself is rare
        refined = bool(ghost) and bool(torch.stack([d for _, _, d in ghost]).any())
        for name, s, doubt in ghost:
            if refined and bool(doubt.any()):
                s, used[name] = refine_cancelled(used[name], s, doubt)
            sq = sq + s.to(sq.dtype)
        return sq.clamp_min(0).sqrt().to(dtype), used, refined

    def _exact(self):
        """The engine's own arithmetic (contributions, norms, clipped sums) in float32 or float64
        even inside a caller's autocast (``performance.dtype=bfloat16``): a norm whose Gram
        products autocast rounded to bf16 can be ~0.4% short of the norm of what the clipped
        sum adds, and then a clipped example would add more than C. For the same reason its
        float32 products are IEEE, whatever TF32 or bf16 setting the process chose
        (``precision.py``; the forwards and backwards too, see ``_forward_backward``)."""
        device = next(iter(self.params.values())).device
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device.type, enabled=False))
        stack.enter_context(ieee_float32())
        return stack

    def _query(self, plan: QueryPlan) -> "_Query":
        """A query with reusable instantiated buffers when the plan has several states: their
        size (B x the parameter's) is the same at every step, and a fresh allocation of that
        size costs page faults (CPU) or allocator churn every step. One state: no reuse (the
        buffers would otherwise stay allocated during the next forward, raising the peak)."""
        return _Query(plan, self.ghost, self._workspace_view if len(plan) > 1 else None)

    def _workspace_view(self, name: str, c: Contribution) -> Tensor | None:
        """(B, numel) storage for parameter ``name``'s instantiated query, reused across calls
        (grown when B grows); None for a Factored contribution (it allocates its own)."""
        if isinstance(c, Outer):
            ref = c.L if isinstance(c.L, Tensor) else c.R
        elif isinstance(c, Dense):
            ref = c.g
        else:
            return None
        B, need = ref.shape[0], ref.shape[0] * self.params[name].numel()
        buf = self._workspace.get(name)
        if buf is None or buf.numel() < need or buf.dtype != ref.dtype or buf.device != ref.device:
            self._workspace.pop(name, None)  # free the old one first
            buf = torch.empty(need, dtype=ref.dtype, device=ref.device)
            self._workspace[name] = buf
        return buf[:need].view(B, -1)

    def release_workspace(self) -> None:
        """Free the reusable per-example buffers of multi-state queries, and the one-example
        microbatches a pending row check keeps (both private data)."""
        self._workspace.clear()
        self._rows_other = None

    def acc_dtype(self) -> torch.dtype:
        """The dtype clipped sums accumulate in: float64 for a float64 model, else float32."""
        p = next(iter(self.params.values()))
        return torch.float64 if p.dtype == torch.float64 else torch.float32

    def per_example_norms(self, loss_fn: LossFn, batch: Any,
                          plan: QueryPlan | None = None) -> Tensor:
        """||u_b|| for each example of ``batch`` (no clipping, no accumulation)."""
        B = batch_size_of(batch)
        dtype = self.acc_dtype()
        device = next(iter(self.params.values())).device
        if B == 0:
            return torch.zeros(0, device=device, dtype=dtype)
        plan = plan or [(1.0, None)]
        query = self._query(plan)
        self._forward_backward(loss_fn, batch, plan, False, query)
        with self._exact():
            norms, _, _ = self._norms(query, B, device, dtype)
        del query
        self._finish_rows_check()
        return norms

    def _require_clip_norm(self) -> None:
        if self.clip_norm is None:
            raise ClippingError("dptrain.clipping: this engine was built with clip_norm=None, for "
                                "norms only; clipping needs ClippingEngine(model, clip_norm=C)")

    def clip_factors(self, norms: Tensor) -> Tensor:
        """lam_b = min(1, C / ||u_b||) (1 for a zero gradient, 0 for a non-finite norm: a NaN
        norm must never leave an example unclipped)."""
        self._require_clip_norm()
        C = torch.as_tensor(self.clip_norm, dtype=norms.dtype, device=norms.device)
        lam = torch.where(norms > C, C / norms.clamp_min(torch.finfo(norms.dtype).tiny), 1.0)
        return torch.where(torch.isfinite(norms), lam, 0.0)

    def accumulate(self, loss_fn: LossFn, batch: Any, acc: dict[str, Tensor],
                   plan: QueryPlan | None = None, active: Tensor | None = None) -> StepStats:
        """Add sum_b lam_b u_b of this microbatch into ``acc`` (name -> tensor shaped like the
        parameter, created on first use). Sensitive: ``acc`` holds an unnoised sum.

        ``active`` (bool, [B]): False marks a phantom example — run so that a rank with fewer
        sampled examples still takes part in FSDP's collectives — whose clip factor is 0, so
        it adds exactly nothing to the sum."""
        plan = plan or [(1.0, None)]
        self._require_clip_norm()  # (before any forward)
        B = batch_size_of(batch)
        if active is not None and not (isinstance(active, Tensor) and active.dtype == torch.bool
                                       and tuple(active.shape) == (B,)):
            raise ClippingError(f"dptrain.clipping: active must be a bool tensor of shape ({B},), "
                                f"got {type(active).__name__} "
                                f"{getattr(active, 'dtype', '')} "
                                f"{tuple(getattr(active, 'shape', ()))}")
        if not isinstance(acc, dict):
            raise TypeError(f"acc must be a dict (parameter name -> clipped sum; an empty {{}} "
                            f"to start), got {type(acc).__name__}")
        bits = torch.finfo(self.acc_dtype()).bits
        for name, have in acc.items():  # (before any work: acc is left as it was)
            p = self.params.get(name)
            if p is not None and not (
                    isinstance(have, Tensor) and have.is_floating_point()
                    and have.shape == p.shape and torch.finfo(have.dtype).bits >= bits
                    and not have.requires_grad  # (add_ into a leaf that does: refused by torch)
                    and not any(st == 0 and n > 1 for st, n in zip(have.stride(), have.shape))):
                what = (f"{have.dtype} {tuple(have.shape)}"
                        f"{', requires grad' if have.requires_grad else ''}"
                        f"{', expanded' if 0 in have.stride() else ''}"
                        if isinstance(have, Tensor) else type(have).__name__)
                raise ClippingError(
                    f"dptrain.clipping: acc[{name!r}] is {what}, the clipped sum of {name} "
                    f"{self.acc_dtype()} {tuple(p.shape)} (a tensor of its own): pass an empty "
                    f"dict (the engine creates each entry) or one the engine filled")
        if B == 0:
            return StepStats()
        dtype = self.acc_dtype()
        device = next(iter(self.params.values())).device
        two_pass = self.mode == "two_pass"
        if two_pass and torch.is_autocast_enabled(device.type):
            # (the trainer refuses performance.dtype=bfloat16 with two_pass for this reason)
            raise ClippingError("dptrain.clipping: mode='two_pass' under autocast: the second "
                                "backward's gradients are low precision while the norms are "
                                "float32, so a clipped example could add more than C (1.0019 C "
                                "measured); use mode='bookkeeping' under autocast")
        query = self._query(plan)
        graphs, loss_total = self._forward_backward(loss_fn, batch, plan, two_pass, query)
        num_examples = int(active.sum()) if active is not None else B
        # the displayed loss: at the current parameters (NaN if no plan entry evaluates them)
        if loss_total is None:
            loss_sum = float("nan")
        elif active is not None:
            loss_sum = float(loss_total[active.to(loss_total.device)].sum())
        else:
            loss_sum = float(loss_total.sum())
        sizes = query.held_bytes(B, {n: p.numel() for n, p in self.params.items()})
        # the first query's clipped sum reaches acc only after the rows check passed
        out = {} if self._pending_rows is not None else acc
        # the engine's own arithmetic in float32/64, whatever the caller's autocast
        with self._exact():
            norms, used, refined = self._norms(query, B, device, dtype)
            del query  # memory: only the forms used by the clipped sum are kept
            if refined:
                # some examples' rows were instantiated (cancelling terms): the second backward
                # would add their float32 residue instead (mode is a performance setting)
                two_pass = False
                graphs = None
            # Sensitive: per-example norms and clip factors; discard after use.
            lam = self.clip_factors(norms)
            if active is not None:
                lam = torch.where(active.to(lam.device), lam, torch.zeros_like(lam))
            finite = torch.isfinite(norms)
            del norms
            if not bool(finite.all()):
                # An example with a non-finite loss or gradient (lam = 0): its captured tensors may
                # hold inf/NaN, and 0 * inf = NaN would poison the whole sum. Its rows are selected
                # away; the second backward of two_pass would mix them in again, so this microbatch
                # takes the book-keeping sum (the same values: mode is a performance setting).
                used = {n: [drop_examples(c, finite) for c in cs] for n, cs in used.items()}
                two_pass = False
                graphs = None
            if two_pass:
                self._two_pass_sum(used, lam, graphs, out, dtype, device)
            else:
                for name in list(used):
                    contribs = used.pop(name)  # released as soon as it is summed
                    p = self.params[name]
                    self._add(out, name, clipped_sum(contribs, lam, p.shape, dtype))
            graphs = used = None
        if out is not acc:  # (under the caller's autocast, as the query's forwards)
            self._finish_rows_check()
            for name, value in out.items():
                self._add(acc, name, value)
        held, least = sizes
        return StepStats(num_examples=num_examples, loss_sum=loss_sum, states=len(plan),
                         query_bytes=held, least_query_bytes=least)

    def _two_pass_sum(self, used: dict[str, list[Contribution]], lam: Tensor, graphs: list,
                      out: dict[str, Tensor], dtype: torch.dtype, device) -> None:
        """two_pass's clipped sum into ``out``: a second backward of sum_b lam_b a_j loss_b per
        state for the parameters whose sums it can give, each checked against the book-keeping
        sum by random projections (the rest, and any that disagree, from ``used``, which this
        empties)."""
        # tapped parameters are detached from the graph (the engine's leaves stand in
        # for them): their clipped sums come from the query, as book-keeping's. So do
        # those held as per-example gradients (instantiated, biases, norms), and those
        # with rows instantiated for cancellation: the norm was taken of those very rows,
        # where the second backward would round its own way (under cancelling terms, a
        # few % of C apart); and those of layers with contributions of their own forms
        # (convolutions), which the probe below does not read
        tapped = set(self._tap_names())
        from_query = {n for n, cs in used.items()
                      if n in tapped or not all(type(c) is Outer for c in cs)}
        for name in from_query:
            p = self.params[name]
            self._add(out, name, clipped_sum(used.pop(name), lam, p.shape, dtype))
        names = [n for n in self.params if n not in tapped and n not in from_query]
        # The second backward adds every use of a parameter in the graph; the norms,
        # what the layers' hooks saw. Anything the hooks missed (a use outside the
        # layer's call, a custom autograd.Function, a view made before the query, a
        # user's hook, saved tensors given back changed: 1.4-7290 C from one example,
        # an audit and three red teams) shows as a difference from the book-keeping
        # sum, which random projections find: taken here, before any code of the
        # model's runs again (the backward's hooks could change the factors in place),
        # from a generator seeded from the OS now and held by this frame only
        rng = torch.Generator().manual_seed(secrets.randbits(63))
        probes = {n: self._probe(used.get(n, []), lam, rng) for n in names}
        second: dict[str, Tensor] = {}
        for coef, state, losses in graphs if names else ():
            with self._state(state):
                weighted = (losses * lam.to(losses.dtype)).sum()
                grads = torch.autograd.grad(weighted, [self.params[n] for n in names],
                                            allow_unused=True)
            for n, g in zip(names, grads):
                a = coef.get(n, 0.0) if isinstance(coef, dict) else coef
                if g is not None and a != 0.0:
                    g = g.to(dtype) * a
                    second[n] = second[n] + g if n in second else g
            del grads
        # each parameter within 1e-4 C / sqrt(number probed): the differences of all
        # of them together within 1e-4 C (a red team spread 1e-3 C over 1,024)
        cap = self.PROBE_TOLERANCE_C * self.clip_norm / math.sqrt(max(1, len(names)))
        self.summed_by_query = set()
        verdicts = (torch.stack([self._probe_agrees(probes[n], second.get(n), cap,
                                                    device) for n in names]).tolist()
                    if names else [])  # (one device sync for all parameters)
        for n, agrees in zip(names, verdicts):
            contribs, g = used.pop(n, []), second.pop(n, None)
            if agrees:
                if g is not None:
                    self._add(out, n, g)
                continue
            if self.warn_at_queries and n not in self.summed_by_query_ever:
                self.summed_by_query_ever.add(n)
                import warnings

                warnings.warn(
                    f"dptrain.clipping: mode='two_pass': the second backward's sum of {n} is "
                    f"not the clipped sum of what the layers' hooks saw (a use of it they miss: "
                    f"a hook or autograd.Function added after the first query?); it takes the "
                    f"book-keeping sum, which each example's norm bounds, but that norm may "
                    f"miss the use too (said once per parameter)", stacklevel=3)
            self.summed_by_query.add(n)
            if not contribs:
                continue
            if not self._probe_repeats(probes[n], contribs, lam, cap):
                raise ClippingError(
                    f"dptrain.clipping: mode='two_pass': the captured factors of {n} "
                    f"changed during the second backward (a hook or autograd.Function "
                    f"of the model's writing into a layer's input or output gradient "
                    f"in place: 7-8 C from one example, a red team); neither sum can "
                    f"be trusted; use mode='bookkeeping'")
            p = self.params[n]
            self._add(out, n, clipped_sum(contribs, lam, p.shape, dtype))
        del second, probes

    @staticmethod
    def _add(acc: dict[str, Tensor], name: str, value: Tensor) -> None:
        if name in acc:
            acc[name].add_(value)
        else:
            acc[name] = value.clone() if value.requires_grad else value


class _Query:
    """The per-example query u_b = sum_j a_j grad l(theta_j; x_b), parameter by parameter, as
    the plan's states are evaluated one after the other.

    A parameter's norm form is chosen when its first contributions arrive, from that state's
    contributions and the number of states of the plan whose coefficient for the parameter is
    non-zero (``choose_form_states``; one state: the single-state ``choose_form``). Then

    - "instantiate": each state's contributions are added, with their coefficients, into ONE
      per-example buffer (B, numel) right away (``add_instantiated``) and the state's captured
      input and output gradient are released: memory B x the parameter's size whatever the
      number of states, and no separate pass to sum the states' gradients;
    - "ghost": the contributions are kept (the cross terms between states need every state's
      factors) and paired up by ``squared_norms_scaled`` once all states are in.

    The result is the same as collecting every contribution first (only the summation order of
    the instantiated gradient differs).
    """

    def __init__(self, plan: QueryPlan, policy: str, buffer=None):
        self.plan = plan
        self.policy = policy
        self.buffer = buffer  # (name, first contribution) -> reusable (B, numel) storage
        self.forms: dict[str, str] = {}
        self.lists: dict[str, list[Contribution]] = {}
        self.dense: dict[str, Tensor] = {}
        # name -> (states using it, ghost-form bytes of one state or None, element size)
        self.sizes: dict[str, tuple[int, int | None, int]] = {}

    def _states_using(self, name: str) -> int:
        n = 0
        for entry in self.plan:
            a = entry[0].get(name, 0.0) if isinstance(entry[0], dict) else entry[0]
            n += a != 0.0
        return max(n, 1)

    def add(self, per_param: dict[str, list[Contribution]]) -> None:
        for name, contribs in per_param.items():
            form = self.forms.get(name)
            if form is None:
                n = self._states_using(name)
                form = choose_form_states(contribs, n, self.policy)
                self.forms[name] = form
                self.sizes[name] = (n, *state_bytes(contribs))
                if form == "instantiate":
                    self.dense[name] = None  # type: ignore[assignment]
                else:
                    self.lists[name] = []
            if name in self.dense:
                total = self.dense[name]
                out = None
                if total is None:
                    contribs = first_write_order(contribs)
                    if self.buffer is not None:
                        out = self.buffer(name, contribs[0])
                for c in contribs:
                    total = add_instantiated(total, c, c.coef, out)
                self.dense[name] = total
            else:
                self.lists[name].extend(contribs)
        per_param.clear()

    def held_bytes(self, B: int, numel: dict[str, int]) -> tuple[int, int]:
        """(bytes the chosen forms hold until the clip factors are known, the same with every
        parameter in its smaller form): a parameter's instantiated buffer is B x its size; in
        ghost form it keeps every state's factors. From shapes only, no values."""
        held = least = 0
        for name, form in self.forms.items():
            n, ghost_one, size = self.sizes[name]
            inst = B * numel[name] * size
            ghost = None if ghost_one is None else n * ghost_one
            held += inst if form == "instantiate" or ghost is None else ghost
            least += inst if ghost is None else min(inst, ghost)
        return held, least


def per_example_grad_norms(model: nn.Module, loss_fn: LossFn, batch: Any) -> Tensor:
    """L2 norm of each example's complete gradient over all trainable parameters.

    ``loss_fn(model, batch)`` returns per-example losses of shape [B]. Equals the norm of
    torch.func per-example gradients, computed without materialising them (ghost norms).
    """
    return ClippingEngine(model).per_example_norms(loss_fn, batch)
