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
from dptrain.clipping.errors import ClippingError
from dptrain.messages import brief

_RULES: dict[type, "LayerRule"] = {}


class LayerRule:
    #: True when the layer's first argument is an integer tensor (its output becomes a
    #: gradient target of the engine's backward, see engine.py).
    integer_input = False
    #: forward functions the rule understands, when it checks them itself (the convolution
    #: rules: ``known(module)``); empty: :func:`find_rule` accepts only the registered class's
    #: own ``forward``, so a subclass that overrides it goes to the torch.func fallback
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
    scales its output, adds a parameter, ...), or FALLBACK itself where the rule checks
    forwards and does not know this one (a conv subclass), and when
    the instance has a ``forward`` of its own (``layer.forward = ...``: the rule's gradient is
    that of its class's forward; in two_pass, 1.6 C from one example, a red team)."""
    if "forward" in vars(module):
        return None
    for klass in type(module).__mro__:
        rule = _RULES.get(klass)
        if rule is not None:
            if rule.forwards:
                # (decided here, not at capture: the fallback takes the call's keyword
                # arguments, which a conv rule's capture does not; a subclass forward called
                # with them got norms 5x too small)
                # (FALLBACK, not None: a layer with trainable children of its own stays a
                # fallback layer, not a tapped module)
                return rule if rule.known(module) else FALLBACK
            if type(module).forward is klass.forward:
                return rule
            return _copied_form_rule(module)
    return _copied_form_rule(module)


def _copied_form_rule(module: nn.Module) -> LayerRule | None:
    """The rule of a layer whose class is one of the forms transformers copies from model to
    model (RMSNorms, scaled word embeddings), recognised by its code; None otherwise."""
    if _transformers_rmsnorm_form(module) is not None:
        return _RULES[nn.RMSNorm]
    if _scaled_embedding_scale(module) is not None:
        return SCALED_EMBEDDING
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
        if module.scale_grad_by_freq:
            raise ClippingError(f"dptrain.clipping: nn.Embedding with scale_grad_by_freq is not "
                                f"supported (it divides each row's gradient by its count in the "
                                f"whole batch, so one example's gradient depends on the others): "
                                f"{module}")
        return {"weight": Outer(OneHot(ids, module.num_embeddings), G)}


class _GemmaScaledEmbeddingForm(nn.Embedding):
    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


class _BartScaledEmbeddingForm(nn.Embedding):
    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale


def _scaled_embedding_scale(module: nn.Module) -> Tensor | float | None:
    """transformers' scaled word embeddings (Gemma's ``*TextScaledWordEmbedding``, a buffer;
    BART's, BioGPT's, M2M100's ``*ScaledWordEmbedding``, a number): ``nn.Embedding``'s output
    times a scalar, recognised by the code of the forward (written out above, as
    ``_RMS_FORMS`` below), defined on a direct subclass of ``nn.Embedding``. Returns the scale
    as the forward applies it, or None."""
    klass = type(module)
    if "ScaledWordEmbedding" not in klass.__name__ or not isinstance(module, nn.Embedding):
        return None
    owner = next((k for k in klass.__mro__ if "forward" in vars(k)), None)
    if owner is None or owner.__bases__ != (nn.Embedding,):
        return None  # super() in the forward would not be nn.Embedding's
    scale = getattr(module, "embed_scale", None)
    if _same_code(klass.forward, _GemmaScaledEmbeddingForm.forward):
        if isinstance(scale, Tensor) and scale.numel() == 1:
            return scale.to(module.weight.dtype)
    elif _same_code(klass.forward, _BartScaledEmbeddingForm.forward):
        if isinstance(scale, (int, float)) and not isinstance(scale, bool):
            return scale
    return None


class ScaledEmbeddingRule(EmbeddingRule):
    """``nn.Embedding`` times a scalar s: row ids[b,t] of W receives s * G[b,t]."""

    def contributions(self, module, saved, G):
        scale = _scaled_embedding_scale(module)
        if isinstance(scale, Tensor):
            scale = scale.to(G.dtype)
        return super().contributions(module, saved, G * scale)


SCALED_EMBEDDING = ScaledEmbeddingRule()


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


class _Watched:
    """A captured tensor and its version counter at capture time, held in an object the engine
    leaves as it is. The engine replaces each half-precision TENSOR of the saved dict by a
    float32 copy (bf16 autocast), and a copy has a fresh counter: it would flag an in-place
    modification made before the capture (timm's in-place ReLU producing a conv's input) and
    hide one made after it (an in-place activation on a conv's output)."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: Tensor):
        self.tensor = t.detach()
        self.version = t._version

    @property
    def modified(self) -> bool:
        return self.tensor._version != self.version


def _check_unmodified(module: nn.Module, saved: dict) -> None:
    if saved["x"].modified:
        raise ClippingError(f"dptrain.clipping: the input of {type(module).__name__} was modified "
                            f"in place after the forward; its per-example gradients cannot be "
                            f"computed (use an out-of-place operation there)")


# ---------------------------------------------------------------------------------------------
# RMSNorm: torch's, and the forms transformers' decoder LMs copy from one model to the next


def _transformers_rms_hat(x: Tensor, eps: float, form: str) -> Tensor:
    """xhat of a transformers RMSNorm form, with its operations in its dtypes: every form
    normalises in float32 (whatever the input's dtype), Gemma 3n with ``pow(-0.5)`` instead
    of ``rsqrt``; Llama's casts xhat back to the input's dtype before the weight."""
    h = x.to(torch.float32)
    mean_sq = h.pow(2).mean(-1, keepdim=True) + eps
    xhat = h * (torch.pow(mean_sq, -0.5) if form == "gemma3n" else torch.rsqrt(mean_sq))
    return xhat.to(x.dtype) if form == "llama" else xhat


class RMSNormRule(LayerRule):
    """y = xhat * w, xhat = x / sqrt(mean(x^2) + eps) over the trailing normalized_shape: the
    weight's per-example gradient is sum_t G_t * xhat_t, xhat recomputed from the captured
    input (torch's nn.RMSNorm: one fused ``rms_norm`` without a weight, as the LayerNorm rule
    does). Also the forms of transformers' RMSNorm classes that :func:`_transformers_rmsnorm_form`
    recognises: Gemma's ``(1 + w)`` has the same gradient, and the forms differ only in the
    dtypes xhat is computed and meets the weight in, which the rule follows."""

    def capture(self, module, args, output):
        x = args[0]
        # nn.RMSNorm's eps=None is the machine epsilon of the input's dtype, which a half input
        # no longer shows once the engine has cast the capture to float32
        eps = getattr(module, "eps", None)
        if isinstance(module, nn.RMSNorm) and eps is None:
            eps = torch.finfo(x.dtype).eps
        # (watched: autograd saves the form's float32 copy of a half input, so an in-place
        # change of the input after the forward would go unseen)
        return {"x": _Watched(x), "eps": eps}

    def contributions(self, module, saved, G):
        _check_unmodified(module, saved)
        x = saved["x"].tensor
        match = None if isinstance(module, nn.RMSNorm) else _transformers_rmsnorm_match(module)
        if match is None:  # torch's nn.RMSNorm: F.rms_norm in the input's dtype
            shape = tuple(module.normalized_shape)
            xhat = F.rms_norm(x.to(G.dtype), shape, eps=saved["eps"])
        else:
            form, eps = match
            shape = tuple(module.weight.shape)
            xhat = _transformers_rms_hat(x, eps, form).to(G.dtype)
        B, n = x.shape[0], module.weight.numel()
        g = (G * xhat).reshape(B, -1, n).sum(1).reshape(B, *shape)
        return {"weight": Dense(g)}


register_rule(nn.RMSNorm)(RMSNormRule)


# The forward of each form of transformers' RMSNorm, written out: a class is recognised when its
# ``forward`` (and the ``_norm`` it calls) compiles to the same code as one of these (the same
# operations on the same attribute names), so a form transformers changes, or a class that
# swaps in a hub kernel, no longer matches and takes the torch.func fallback. The forms cover
# 179 of transformers 5.24's 213 RMSNorm classes and 181 of 5.25's 218 (Llama's alone 142 and
# 144: Mistral, Qwen2, Qwen3, Phi-3, OLMo, SmolLM3, ...; 5.25 renamed Gemma 3n's eps, hence its
# second variant); gated ones, which take a second input, take the fallback.
# (Comments and names of locals aside, these must stay token for token transformers' code.)


class _LlamaForm(nn.Module):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class _GptOssForm(nn.Module):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight * hidden_states).to(input_dtype)


class _HeliumForm(nn.Module):
    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)


class _GemmaForm(nn.Module):
    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


class _Gemma3nForm(nn.Module):
    def _norm(self, hidden_states):
        mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.eps
        return hidden_states * torch.pow(mean_squared, -0.5)

    def forward(self, hidden_states):
        normed_output = self._norm(hidden_states.float())
        if self.with_scale:
            normed_output = normed_output * self.weight.float()
        return normed_output.type_as(hidden_states)


class _Gemma3nVarianceEpsilonForm(_Gemma3nForm):
    """transformers 5.25 renamed Gemma 3n's ``eps`` to ``variance_epsilon``."""

    def _norm(self, hidden_states):
        mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.variance_epsilon
        return hidden_states * torch.pow(mean_squared, -0.5)


#: form name -> (class whose methods a recognised class's must compile to, the attribute its
#: epsilon is read from), one per way transformers has written the form
_RMS_FORMS = {"llama": [(_LlamaForm, "variance_epsilon")],
              "gptoss": [(_GptOssForm, "variance_epsilon")],
              "helium": [(_HeliumForm, "variance_epsilon")],
              "gemma": [(_GemmaForm, "eps")],
              "gemma3n": [(_Gemma3nForm, "eps"),
                          (_Gemma3nVarianceEpsilonForm, "variance_epsilon")]}


def _same_code(f, g) -> bool:
    a, b = getattr(f, "__code__", None), getattr(g, "__code__", None)
    return (a is not None and b is not None and a.co_code == b.co_code
            and a.co_consts == b.co_consts and a.co_names == b.co_names
            and a.co_argcount == b.co_argcount and a.co_nlocals == b.co_nlocals)


def _transformers_rmsnorm_match(module: nn.Module) -> tuple[str, float] | None:
    """(form, epsilon) of ``module`` (see ``_RMS_FORMS``) when its class computes one of them
    with a 1-D ``weight`` as its only trainable parameter and a float epsilon; None otherwise."""
    klass = type(module)
    if "RMSNorm" not in klass.__name__:
        return None
    weight = module._parameters.get("weight")
    if weight is None or weight.ndim != 1 or len(module._parameters) != 1:
        return None
    for form, variants in _RMS_FORMS.items():
        for ref, eps_name in variants:
            if not _same_code(klass.forward, ref.forward):
                continue
            norm = getattr(ref, "_norm", None)
            if norm is not None and not _same_code(getattr(klass, "_norm", None), norm):
                continue
            eps = getattr(module, eps_name, None)
            if isinstance(eps, (int, float)) and not isinstance(eps, bool):
                return form, float(eps)
    return None


def _transformers_rmsnorm_form(module: nn.Module) -> str | None:
    """The form of ``module`` (see :func:`_transformers_rmsnorm_match`), or None."""
    match = _transformers_rmsnorm_match(module)
    return None if match is None else match[0]


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
            if isinstance(e, torch.OutOfMemoryError):
                raise
            # (everything here runs under vmap: torch's message may not say so, e.g. an
            # nn.GRUCell given hx=None writes into a zero state it made, one example wide)
            raise ClippingError(
                f"dptrain.clipping: the torch.func fallback for {type(module).__name__} "
                f"(no layer rule) computes its per-example gradients under vmap, which could "
                f"not run its forward: {brief(e)}. Write that forward with ops vmap "
                f"supports (torch.where, not Python branches on values or boolean-mask "
                f"indexing; no in-place write into a tensor the forward makes: pass such a "
                f"state as an input), or register a layer rule "
                f"(dptrain.clipping.rules.register_rule)"
            ) from e

    def _contributions(self, module, saved, G):
        from torch.func import vjp, vmap

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
            _, pull = vjp(lambda p: _forward_at(module, p, args, kwargs), params)
            rows = torch.eye(B, dtype=G.dtype, device=G.device).view(B, B, *[1] * (G.dim() - 1))
            grads = vmap(lambda row: pull(G * row)[0])(rows)
            return {n: Dense(g) for n, g in grads.items()}

        def one(g, *example_args):
            full = []
            it = iter(example_args)
            for a, is_b in zip(args, batched):
                full.append(next(it).unsqueeze(0) if is_b else a)

            def f(p):
                return _forward_at(module, p, tuple(full), kwargs)

            _, pull = vjp(f, params)
            (grads,) = pull(g.unsqueeze(0))
            return grads

        grads = vmap(one)(G, *[a for a, is_b in zip(args, batched) if is_b])
        return {n: Dense(g) for n, g in grads.items()}


FALLBACK = FuncFallbackRule()


def _forward_at(module: nn.Module, params: dict[str, Tensor], args: tuple, kwargs: dict):
    """``module.forward(*args, **kwargs)`` with ``params`` in place of its parameters (as
    ``torch.func.functional_call``, but not through ``module(...)``): the module's hooks, and
    global ones, do not run again. The captured input already has the pre-hooks' changes and
    the output gradient is the forward's own output's; a hook that scaled either counted
    twice (norms 6-23% off, a red team), and a hook calling .item() failed under vmap."""
    from torch.nn.utils.stateless import _reparametrize_module

    # (tie_weights: a parameter registered under two names is replaced under both, as
    # functional_call does)
    with _reparametrize_module(module, params, tie_weights=True):
        return module.forward(*args, **kwargs)


def _no_rule(module: nn.Module) -> str:
    if "forward" in vars(module):
        return f"this {type(module).__name__} has a forward of its own (set on the instance)"
    base = overridden_base(module)
    if base is not None:
        return f"{type(module).__name__} overrides the forward of {base.__name__}"
    return f"no ghost rule for {type(module).__name__}"
