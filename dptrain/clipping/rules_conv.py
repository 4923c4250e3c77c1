"""Rules for convolutions, GroupNorm and timm's weight-standardised convolutions.

Convolution (``nn.Conv1d/2d/3d``, timm's ``Conv2dSame``)
    per-example weight gradient ``sum_t G[b, :, t] ⊗ U[b, :, t]`` with U the unfolded (padded)
    input. With ``groups == 1`` a :class:`ConvOuter`: an ``Outer`` (so the engine chooses ghost
    or instantiation by cost) whose R is unfolded (one strided copy) only when needed, whose
    instantiation is one batched product with it, and whose clipped sum is ONE
    ``aten.convolution_backward`` with the clip factors folded into G (what the non-private
    backward computes; no unfolding). With ``groups > 1`` a :class:`ConvDense`: instantiated
    per example and per group in ONE grouped ``convolution_backward`` (batch folded into the
    groups). Bias: ``Dense(sum_t G)``.
``nn.GroupNorm``
    ``Dense`` per-example gradients of weight/bias from the recomputed normalised input.
timm ``StdConv2d``, ``StdConv2dSame``, ``ScaledStdConv2d``, ``ScaledStdConv2dSame``
    effective weight ``W_eff = f(W, gain)`` (per-filter standardisation times ``gain * scale``);
    the per-example gradient w.r.t. W_eff is a convolution's, and the per-example gradients of
    (W, gain) are its image under the VJP of f at the VALUES of the forward (its statistics are
    captured in the forward hook: the engine may evaluate several model states). Instantiated
    form: the VJP (the standardisation's own backward kernel) vmapped over the examples'
    cotangents (the map is linear). Ghost form (``groups == 1``): the squared norm of
    ``J_W^T g_b`` in closed form from row-wise ghost quantities (see :class:`StdConvWeight`),
    the gain's from the forward's own output; clipped sum = the VJP of ONE weighted
    ``convolution_backward``. The engine chooses per layer by cost (:data:`_MEM_WEIGHT`).

The inputs saved in the forward are checked for later in-place modification (the values the
rules see must be those the layer used).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dptrain.clipping.contributions import (CANCELLATION_TOKENS, CANCELLATION_ULPS,
                                           MAX_INSTANTIATE_NUMEL, Dense, Factored, Outer,
                                           sq_rows)
from dptrain.clipping.rules import LayerRule, _check_unmodified, _Watched, register_rule

_conv_backward = torch.ops.aten.convolution_backward

# Relative cost of one element written/read by the memory-bound passes of a form (unfolding
# and centring the input for the ghost form; for instantiation the per-example gradient, its
# vmapped VJP, norm and weighted sum) against one multiply-add of a compute-bound product.
# Calibrated on CPU (one thread) on NF-ResNet-50 at 64 px, B = 16, per layer: with it the
# choice matches the measured faster form on 50 of its 54 layers (the other four: ties within
# 2.5 ms): the stem and stages.0 instantiated, stages.1 mixed, stages.2-3 ghost.
_MEM_WEIGHT = 100.0


# ---------------------------------------------------------------------------------------------
# geometry


class _Geom:
    """Stride/padding/dilation/groups of one convolution call on an already padded input."""

    __slots__ = ("nd", "kernel", "stride", "padding", "dilation", "groups")

    def __init__(self, kernel, stride, padding, dilation, groups):
        self.nd = len(kernel)
        self.kernel = tuple(int(k) for k in kernel)
        self.stride = tuple(int(s) for s in stride)
        self.padding = tuple(int(p) for p in padding)
        self.dilation = tuple(int(d) for d in dilation)
        self.groups = int(groups)

    @property
    def pointwise(self) -> bool:
        return all(k == 1 for k in self.kernel) and not any(self.padding)


def _ntuple(v, nd: int) -> tuple:
    return tuple(v) if isinstance(v, (tuple, list)) else (v,) * nd


def _torch_conv_input(module: nn.Module, x: Tensor) -> tuple[Tensor, tuple]:
    """The input and padding that ``nn.ConvNd.forward`` passes to the convolution."""
    nd = module.weight.dim() - 2
    if module.padding_mode != "zeros":
        return (F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode),
                (0,) * nd)
    pad = module.padding
    if isinstance(pad, str):
        rev = list(module._reversed_padding_repeated_twice)  # (left_last, right_last, ...)
        left, right = rev[0::2][::-1], rev[1::2][::-1]
        if left == right:
            return x, tuple(left)
        return F.pad(x, rev), (0,) * nd
    return x, _ntuple(pad, nd)


def _timm_same_input(module: nn.Module, x: Tensor,
                     force_zero_padding: bool) -> tuple[Tensor, tuple]:
    from timm.layers.padding import pad_same

    nd = module.weight.dim() - 2
    x = pad_same(x, module.kernel_size, module.stride, module.dilation)
    return x, ((0,) * nd if force_zero_padding else _ntuple(module.padding, nd))


def _geom(module: nn.Module, padding: tuple) -> _Geom:
    w = module.weight
    nd = w.dim() - 2
    return _Geom(w.shape[2:], _ntuple(module.stride, nd), padding,
                 _ntuple(module.dilation, nd), module.groups)


# ---------------------------------------------------------------------------------------------
# the three convolution kernels everything is built from


def conv_weight_grad(G: Tensor, x: Tensor, weight_shape, geom: _Geom) -> Tensor:
    """sum over the batch of the weight gradient (what the non-private backward computes)."""
    dummy = G.new_empty(1).expand(tuple(weight_shape))
    return _conv_backward(G, x, dummy, None, geom.stride, geom.padding, geom.dilation, False,
                          [0] * geom.nd, geom.groups, (False, True, False))[1]


def per_example_conv_weight_grad(G: Tensor, x: Tensor, weight_shape, geom: _Geom,
                                 R: Tensor | None = None) -> Tensor:
    """(B, *weight_shape) per-example weight gradients, without a Python loop: with one group,
    a batched product with the unfolded input ``R`` (B, T, n) (a view for 1x1 convolutions);
    with several, the batch folded into the groups of ONE grouped ``convolution_backward``
    (measured on CPU: the product wins for one group, most clearly at small T)."""
    B = G.shape[0]
    O = weight_shape[0]
    if B == 0:
        return G.new_zeros(0, *weight_shape)
    if geom.groups == 1:
        if R is None:
            R = unfold_input(x, geom)
        return torch.bmm(G.reshape(B, O, -1), R).view(B, *weight_shape)
    Gf = G.reshape(1, B * O, *G.shape[2:])
    xf = x.reshape(1, B * x.shape[1], *x.shape[2:])
    folded = _Geom(geom.kernel, geom.stride, geom.padding, geom.dilation, geom.groups * B)
    g = conv_weight_grad(Gf, xf, (B * O, *weight_shape[1:]), folded)
    return g.view(B, *weight_shape)


def unfold_input(x: Tensor, geom: _Geom) -> Tensor:
    """(B, T, Cin*prod(kernel)) patches, in the weight's (Cin, *kernel) order: one strided copy
    into a (B, n, T) buffer, returned transposed (much faster than ``F.unfold`` on CPU, and any
    number of spatial dimensions)."""
    B, C = x.shape[:2]
    if any(geom.padding):
        x = F.pad(x, [p for p in reversed(geom.padding) for _ in (0, 1)])
    if geom.pointwise and all(s == 1 for s in geom.stride):
        return x.reshape(B, C, -1).transpose(1, 2)
    sp, st = x.shape[2:], x.stride()
    out = [(sp[i] - geom.dilation[i] * (geom.kernel[i] - 1) - 1) // geom.stride[i] + 1
           for i in range(geom.nd)]
    size = (B, C, *geom.kernel, *out)
    strides = (st[0], st[1], *[st[2 + i] * geom.dilation[i] for i in range(geom.nd)],
               *[st[2 + i] * geom.stride[i] for i in range(geom.nd)])
    v = x.as_strided(size, strides, x.storage_offset())
    return v.reshape(B, C * math.prod(geom.kernel), math.prod(out)).transpose(1, 2)


def _scale_batch(G: Tensor, w: Tensor) -> Tensor:
    return G * w.to(G.dtype).view(-1, *([1] * (G.dim() - 1)))


# ---------------------------------------------------------------------------------------------
# contributions


class ConvOuter(Outer):
    """Outer(L = G as (B, T, out), R = unfolded input as (B, T, in)); R built on first use."""

    def __init__(self, G: Tensor, x: Tensor, weight_shape, geom: _Geom, coef: float = 1.0):
        self.G, self.x, self.geom, self.coef = G, x, geom, coef
        self.weight_shape = tuple(weight_shape)
        self._R = None
        self.L = G.reshape(G.shape[0], G.shape[1], -1).transpose(1, 2)

    @property
    def R(self) -> Tensor:  # type: ignore[override]
        if self._R is None:
            self._R = unfold_input(self.x, self.geom)
        return self._R

    def dims(self):
        B, T, O = self.L.shape
        return B, T, O, math.prod(self.weight_shape[1:])

    def ghost_bytes(self):
        # the output gradient and input, and the unfolded input: built for the ghost products
        # and kept until the clipped sum (fast_weighted_sum releases it)
        B, T, _, n = self.dims()
        return (self.G.numel() * self.G.element_size() + self.x.numel() * self.x.element_size()
                + B * T * n * self.x.element_size())

    def fast_instantiate(self):
        # the unfolded input is not kept (only the instantiated gradient is needed afterwards)
        R = self._R if self._R is not None else unfold_input(self.x, self.geom)
        B, O = self.G.shape[:2]
        return torch.bmm(self.G.reshape(B, O, -1), R)

    def fast_weighted_sum(self, w, dtype):
        self._R = None  # norms are done: release the unfolded input
        return conv_weight_grad(_scale_batch(self.G, w).to(dtype), self.x.to(dtype),
                                self.weight_shape, self.geom)

    def __repr__(self) -> str:
        return f"ConvOuter(dims={self.dims()}, coef={self.coef})"


class ConvDense(Factored):
    """Grouped (or 3-D) convolution: instantiated per example and group in one call."""

    def __init__(self, G: Tensor, x: Tensor, weight_shape, geom: _Geom):
        self.G, self.x, self.weight_shape, self.geom = G, x, tuple(weight_shape), geom
        self.coef = 1.0

    def instantiate(self):
        return per_example_conv_weight_grad(self.G, self.x, self.weight_shape, self.geom)


def standardisation_stats(module: nn.Module) -> dict:
    """timm's weight standardisation at the module's CURRENT values (called in the forward hook:
    the engine may copy other model states into the parameters before the backward half runs).

    ``W_eff[o] = a_o * what_o`` with ``what_o = (W_o - mean_o) * invstd_o`` computed by the same
    kernel as timm's forward (``F.batch_norm`` over each filter), ``a = gain * scale`` (timm's
    ScaledStdConv2d) or 1 (StdConv2d). Kept: what (O, n), invstd (O,), a (O,) or None — the
    same memory as a copy of the weight, and no second standardisation later.
    """
    with torch.no_grad():
        W = module.weight.detach()
        if W.dtype in (torch.float16, torch.bfloat16):
            W = W.float()
        O = W.shape[0]
        what, _, invstd = torch.native_batch_norm(W.reshape(1, O, -1), None, None, None, None,
                                                  True, 0.0, float(module.eps))
        gain = getattr(module, "gain", None)
        a = None if gain is None else (gain.detach().to(W.dtype) * float(module.scale)).reshape(O)
    return {"what": what.view(O, -1), "invstd": invstd, "a": a}


class _StdConvState:
    """What a weight-standardised conv's contributions share: the captured (padded) input, the
    output gradient, and the standardisation's statistics at forward time."""

    def __init__(self, module: nn.Module, x: Tensor, G: Tensor, geom: _Geom, stats: dict):
        self.x, self.G, self.geom = x, G, geom
        self.what = stats["what"].to(G.dtype)
        self.invstd = stats["invstd"].to(G.dtype)
        self.a = None if stats["a"] is None else stats["a"].to(G.dtype)
        self.weight_shape = tuple(module.weight.shape)
        self.gain_shape = None if self.a is None else tuple(module.gain.shape)
        self.scale = float(getattr(module, "scale", 1.0))
        self.eps = float(module.eps)
        self.O = self.weight_shape[0]
        self.n = self.what.shape[1]
        self._pulled = None
        self._P = None
        self._R = None
        self.y = None  # the forward's output, when unmodified
        self.bias = None

    def pull_one(self, eff: Tensor) -> tuple[Tensor, Tensor | None]:
        """VJP of the standardisation (W, gain) -> W_eff for ONE cotangent ``eff`` of W_eff, at
        the forward-time values: the standardisation's own backward kernel (what autograd and
        ``torch.func.vjp`` run for timm's forward), given the normalised filters ``what`` as the
        input with mean 0 and invstd 1 and the per-filter factor ``a * invstd`` as the affine
        weight: ``dW_o = a_o invstd_o (e_o - mean(e_o) - what_o mean(e_o what_o))`` and
        ``dgain_o = scale * sum(e_o what_o)``. Linear in ``eff``."""
        O = self.O
        w = self.invstd if self.a is None else self.a * self.invstd
        zero = torch.zeros_like(self.invstd)
        gi, gw, _ = torch.ops.aten.native_batch_norm_backward(
            eff.reshape(1, O, -1), self.what.unsqueeze(0), w, None, None, zero, zero + 1.0,
            True, self.eps, [True, self.a is not None, False])
        dgain = None if self.a is None else (gw * self.scale).view(self.gain_shape)
        return gi.view(self.weight_shape), dgain

    def pulled(self) -> tuple[Tensor, Tensor | None]:
        """Per-example (dW, dgain): the per-example gradients of W_eff (one batched product or
        grouped convolution_backward) mapped through the standardisation's VJP, vmapped over
        the examples (torch.func.vmap; no Python loop)."""
        if self._pulled is None:
            from torch.func import vmap

            eff = per_example_conv_weight_grad(self.G, self.x, self.weight_shape, self.geom)
            if self.a is None:
                out = (vmap(lambda e: self.pull_one(e)[0])(eff), None)
            else:
                out = vmap(self.pull_one)(eff)
            del eff
            self._pulled = out
        return self._pulled

    def stats(self):
        """what (O, n), a/s (O,), r = var/(var+eps) = 1 - eps/s^2, with 1/s = invstd."""
        a_over_s = self.invstd if self.a is None else self.a * self.invstd
        return self.what, a_over_s, 1.0 - self.eps * self.invstd * self.invstd

    def R(self) -> Tensor:
        """(B, n, T) unfolded input, centred per patch (groups == 1 only). Centring removes the
        mean direction exactly (no cancellation in ||g - mean(g)||^2) and leaves <R_t, what_o>
        unchanged (what_o has zero mean)."""
        if self._R is None:
            R = unfold_input(self.x, self.geom).transpose(1, 2)
            self._R = R - R.mean(1, keepdim=True)
        return self._R

    def P(self) -> Tensor:
        """(B, O, T): <patch_t, what_o>, i.e. the convolution of the input with the standardised
        (unscaled) weight: one product with the unfolded input when it exists, else a conv."""
        if self._P is None and self.y is not None:
            self._P = self._P_from_output()
        if self._P is None:
            what = self.what
            if self._R is not None:
                # ONE (O, n) x (n, B*T) product: a broadcast matmul would expand ``what`` to
                # (B, O, n) (B copies of the weight)
                B, n, T = self._R.shape
                RT = self._R.permute(1, 0, 2).reshape(n, B * T)
                self._P = torch.mm(what, RT).view(self.O, B, T).transpose(0, 1)
            else:
                y = torch.convolution(self.x, what.view(self.weight_shape), None, self.geom.stride,
                                      self.geom.padding, self.geom.dilation, False,
                                      [0] * self.geom.nd, self.geom.groups)
                self._P = y.reshape(y.shape[0], self.O, -1)
        return self._P

    def _P_from_output(self) -> Tensor | None:
        """P = (y - bias) / a from the forward's own output (no product at all), if that is as
        accurate as computing it: y's rounding error is eps * (|a P| + |bias|), so a channel whose
        bias dominates its pre-bias output (or whose a is 0) would lose digits; then None."""
        B = self.G.shape[0]
        aP = self.y.reshape(B, self.O, -1)
        if self.bias is not None:
            aP = aP - self.bias.to(aP.dtype).view(1, -1, 1)
        a = torch.ones_like(self.invstd) if self.a is None else self.a
        if self.bias is not None:
            typical = aP.abs().mean((0, 2))
            if bool((self.bias.to(aP.dtype).abs() > 10.0 * typical).any()):
                return None
        if bool((a.abs() < 1e-20).any()):
            return None
        return aP / a.view(1, -1, 1)

    def Gf(self) -> Tensor:
        """(B, O, T) output gradient."""
        return self.G.reshape(self.G.shape[0], self.O, -1)


class StdConvWeight(Factored):
    """Per-example gradient of the RAW weight of a weight-standardised conv.

    Row o of example b: ``dW_bo = (a_o/s_o) (g_bo - m1 1 - m2 what_o)`` with g_b the
    per-example gradient of W_eff, m1 = mean(g_bo), m2 = mean(g_bo * what_o), so
    ``||dW_bo||^2 = (a_o/s_o)^2 (||g_bo - m1 1||^2 - n (2 - r_o) m2^2)``. With g_bo =
    sum_t L[b,t,o] R[b,t] (R the unfolded input, centred per patch so that the mean direction
    is removed exactly), ``||g_bo - m1 1||^2 = sum_{t,s} L_t L_s (R~_t·R~_s)`` (ghost) and
    ``n m2 = sum_t L[b,t,o] P[b,t,o]``.
    """

    def __init__(self, state: _StdConvState):
        self.state = state
        self.coef = 1.0
        self.supports_ghost = state.geom.groups == 1

    def cost(self, form):
        st = self.state
        B, O, n = st.G.shape[0], st.O, st.n
        T = st.G[0, 0].numel()
        if form == "instantiate" and B * O * n > MAX_INSTANTIATE_NUMEL:
            return float("inf")
        if form == "ghost":
            return B * (T * T * (n + O) + T * n * O + _MEM_WEIGHT * T * n)
        return B * (T * O * n + _MEM_WEIGHT * O * n)

    def instantiate(self):
        return self.state.pulled()[0]

    def ghost_sq_norms(self):
        st = self.state
        what, a_over_s, r = st.stats()
        R = st.R()  # (B, n, T), centred
        G = st.Gf()  # (B, O, T)
        RR = torch.bmm(R.transpose(1, 2), R)  # (B, T, T)
        centred = (G * torch.bmm(G, RR)).sum(2)  # (B, O): ||g_bo - m1 1||^2
        # centred is itself a ghost sum over pairs of positions: its rounding scale is
        # sum_t L_t^2 |R_t|^2 (see contributions.rounding_scale)
        scale = (G * G * RR.diagonal(dim1=1, dim2=2).unsqueeze(1)).sum(2)  # (B, O)
        del RR
        nm2 = (G * st.P()).sum(2)  # (B, O): n * m2
        st._R = None
        rows = centred - (2.0 - r) * nm2 * nm2 / st.n
        sq = (rows.clamp_min(0) * a_over_s * a_over_s).sum(1)
        # ``rows`` is a difference of two terms of size ``centred`` and has an absolute rounding
        # error of a few ulps of ``centred`` and of its scale. Where it is not well above that
        # (the gradient of W_eff nearly along the direction the standardisation removes: with
        # fan-in 2 always, since both are then multiples of (1, -1); or positions whose terms
        # cancel), the difference is rounding noise and could be 0, or far below the truth, for
        # a large gradient. Those examples' rows are computed from their instantiated
        # per-example gradients, the same VJP as the clipped sum's, which then adds those
        # examples as these rows (their contribution is then exactly what was measured: the
        # VJP itself loses digits in this case, ~2^-24 var/eps relative). The threshold is the
        # linear forms' (contributions.cancelled: 2^19 ulps, times T / 256 past 256 positions);
        # at 2^16 without the factor, alike positions in a 2,048-wide conv left a row 0.6%
        # short and its example added 1.0059 C (a red team).
        T = G.shape[-1]
        tol = (CANCELLATION_ULPS * max(1.0, T / CANCELLATION_TOKENS)
               * torch.finfo(rows.dtype).eps)
        doubtful = (rows < tol * (centred + scale)).any(1)
        if not bool(doubtful.any()):
            return sq, None
        idx = doubtful.nonzero().squeeze(1)
        pulled = self._pulled_rows(idx).reshape(idx.numel(), -1)
        sq = sq.clone()
        sq[idx] = sq_rows(pulled)
        return sq, (idx, pulled)

    def _pulled_rows(self, idx: Tensor) -> Tensor:
        """(len(idx), *weight_shape): the per-example raw-weight gradients of examples ``idx``."""
        st = self.state
        if st._pulled is not None:
            return st._pulled[0][idx]
        from torch.func import vmap

        eff = per_example_conv_weight_grad(st.G[idx], st.x[idx], st.weight_shape, st.geom)
        return vmap(lambda e: st.pull_one(e)[0])(eff)

    def weighted_sum(self, w):
        st = self.state
        eff = conv_weight_grad(_scale_batch(st.G, w), st.x, st.weight_shape, st.geom)
        return st.pull_one(eff)[0]


class StdConvGain(Factored):
    """Per-example gradient of the gain: scale * <g_bo, what_o> (from the instantiated VJP when
    the weight took that path, else from P without instantiating anything)."""

    def __init__(self, state: _StdConvState):
        self.state = state
        self.coef = 1.0

    def instantiate(self):
        st = self.state
        if st._pulled is not None:
            return st._pulled[1]
        g = (st.Gf() * st.P()).sum(2) * st.scale  # (B, O)
        st._P = None
        return g.view(g.shape[0], *st.gain_shape)


# ---------------------------------------------------------------------------------------------
# rules


class _ConvLikeRule(LayerRule):
    """Shared capture: the (raw) input and its version. Subclasses whose class overrides
    ``forward`` (or ``_conv_forward``) with something this rule does not know (``known``) never
    get it: :func:`find_rule` gives them the torch.func fallback, which keeps the call's keyword
    arguments."""

    #: forward functions this rule understands (a subclass with another forward: fallback)
    forwards: tuple = ()

    def known(self, module: nn.Module) -> bool:
        # a subclass may keep the forward and override the _conv_forward it calls (a common
        # way to write weight standardisation): then the weight used is not the parameter
        conv = getattr(type(module), "_conv_forward", None)
        return type(module).forward in self.forwards and (
            conv is None or any(conv is getattr(k, "_conv_forward", None)
                                for k in (nn.Conv1d, nn.Conv2d, nn.Conv3d)))

    def capture(self, module, args, output):
        return {"x": _Watched(args[0]), **self.capture_params(module, output)}

    def capture_params(self, module, output) -> dict:
        return {}

    def conv_input(self, module, x) -> tuple[Tensor, tuple]:
        return _torch_conv_input(module, x)

    def contributions(self, module, saved, G):
        _check_unmodified(module, saved)
        x, padding = self.conv_input(module, saved["x"].tensor.to(G.dtype))
        geom = _geom(module, padding)
        out = self.weight_contributions(module, saved, x, G, geom)
        if module.bias is not None:
            out["bias"] = Dense(G.reshape(G.shape[0], G.shape[1], -1).sum(-1))
        return out

    def weight_contributions(self, module, saved, x, G, geom) -> dict:
        raise NotImplementedError


@register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(_ConvLikeRule):
    forwards = (nn.Conv1d.forward, nn.Conv2d.forward, nn.Conv3d.forward)

    def weight_contributions(self, module, saved, x, G, geom):
        shape = module.weight.shape
        if geom.groups == 1:
            return {"weight": ConvOuter(G, x, shape, geom)}
        return {"weight": ConvDense(G, x, shape, geom)}


def _register_timm_rules() -> None:
    try:
        from timm.layers.conv2d_same import Conv2dSame
        from timm.layers.std_conv import (ScaledStdConv2d, ScaledStdConv2dSame, StdConv2d,
                                          StdConv2dSame)
    except Exception:  # pragma: no cover - timm is a dependency
        return

    @register_rule(Conv2dSame)
    class TimmConv2dSameRule(ConvRule):
        """timm's Conv2dSame: dynamic TF-style 'SAME' padding, then a zero-padding conv."""

        forwards = (Conv2dSame.forward,)

        def conv_input(self, module, x):
            return _timm_same_input(module, x, force_zero_padding=True)

    @register_rule(StdConv2d, StdConv2dSame, ScaledStdConv2d, ScaledStdConv2dSame)
    class StdConvRule(_ConvLikeRule):
        """Weight-standardised convolutions (NF-ResNet, BiT): see the module docstring."""

        forwards = (StdConv2d.forward, StdConv2dSame.forward, ScaledStdConv2d.forward,
                    ScaledStdConv2dSame.forward)

        def capture_params(self, module, output):
            # at forward time: the engine copies other model states into the parameters
            # between forwards. The output (a reference, no copy) gives P for free when it is
            # not modified in place afterwards (see _StdConvState.P).
            bias = None if module.bias is None else module.bias.detach().clone()
            return {"std": standardisation_stats(module), "y": _Watched(output), "bias": bias}

        def conv_input(self, module, x):
            if getattr(module, "same_pad", False):
                return _timm_same_input(module, x, force_zero_padding=False)
            return _torch_conv_input(module, x)

        def weight_contributions(self, module, saved, x, G, geom):
            state = _StdConvState(module, x, G, geom, saved["std"])
            y = saved["y"]
            # P read off the output only from an unmodified output at the engine's precision
            # (a bf16 output under autocast would put bf16 rounding into the norms only)
            if not y.modified and y.tensor.dtype == G.dtype:
                state.y, state.bias = y.tensor, saved["bias"]
            out = {"weight": StdConvWeight(state)}
            if state.a is not None:
                out["gain"] = StdConvGain(state)
            return out


_register_timm_rules()


@register_rule(nn.GroupNorm)
class GroupNormRule(LayerRule):
    """y = xhat * gamma_c + beta_c with xhat normalised per (example, group): per-example grads
    sum_spatial G * xhat and sum_spatial G (xhat recomputed from the captured input)."""

    def capture(self, module, args, output):
        return {"x": _Watched(args[0])}

    def contributions(self, module, saved, G):
        _check_unmodified(module, saved)
        x = saved["x"].tensor.to(G.dtype)
        B, C = x.shape[:2]
        out = {}
        if module.weight is not None:
            xhat = F.group_norm(x, module.num_groups, None, None, module.eps)
            out["weight"] = Dense((G * xhat).reshape(B, C, -1).sum(-1))
        if module.bias is not None:
            out["bias"] = Dense(G.reshape(B, C, -1).sum(-1))
        return out
