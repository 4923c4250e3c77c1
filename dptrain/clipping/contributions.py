"""Per-example gradient *contributions* and the algebra on them.

Every use of a parameter in one forward pass contributes to each example's gradient. A
contribution is kept in whichever compact form the layer gives, never as the whole model's
per-example gradient:

``Outer(L, R, coef)``
    per-example gradient (the parameter viewed as a matrix ``[out, in]``) equal to
    ``coef * sum_t L[b, t] ⊗ R[b, t]``: Linear (L = output grad, R = input), Conv1D, Conv2d
    (R = unfolded input), Embedding (L = one-hot token ids). Norms by the ghost identity
    ``<sum_t L_t⊗R_t, sum_s L'_s⊗R'_s> = sum_{t,s} (L_t·L'_s)(R_t·R'_s)`` or by instantiation.
``Dense(g, coef)``
    the per-example gradient itself, ``g[b]`` shaped like the parameter (biases, norms' affine
    parameters, layers whose gradient passes through a Jacobian such as weight standardisation).
``Factored`` (subclasses)
    a layer-specific compact form that knows how to instantiate itself and, optionally, its own
    ghost squared norm and its weighted sum without instantiating (weight-standardised
    convolutions: one ``convolution_backward``, then one VJP). Whenever it has to be paired with
    another contribution, or has no ghost form, it is instantiated.

``Outer`` subclasses may also override ``dims``/``fast_instantiate``/``fast_weighted_sum`` (a
lazily unfolded convolution input, instantiation and weighted sums by ``convolution_backward``).

A parameter used several times (GPT-2's tied wte/lm_head, a module called twice, the same
layer evaluated at several model states for inner momentum or DiSK) simply has several
contributions; its per-example gradient is their sum, so its squared norm has cross terms
``2 <c_u, c_v>`` which :func:`squared_norms` includes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

#: Who computes the ghost products (a performance setting: the same quantity either way).
Kernels = Literal["torch", "triton"]

# Instantiating a per-example gradient of more than this many floats per microbatch is refused by
# the cost model (the ghost form is used instead).
MAX_INSTANTIATE_NUMEL = 1 << 28


@dataclass
class OneHot:
    """Implicit one-hot factor: row ``ids[b, t]`` of a ``num``-row matrix."""

    ids: Tensor  # (B, T) int64
    num: int

    @property
    def shape(self) -> tuple[int, int, int]:
        return (*self.ids.shape, self.num)


@dataclass
class Outer:
    """Per-example gradient = coef * sum_t L[b,t] ⊗ R[b,t], parameter viewed as (out, in)."""

    L: Tensor | OneHot  # (B, T, out)
    R: Tensor  # (B, T, in)
    coef: float = 1.0

    # Override points for subclasses (e.g. convolutions, whose R is an unfolded input that is
    # best never built when the instantiated form is chosen). ``None`` means "use the generic
    # code".
    def dims(self) -> tuple[int, int, int, int]:
        """(B, T, out, in) without building anything."""
        B, T = self.R.shape[:2]
        out = self.L.num if isinstance(self.L, OneHot) else self.L.shape[-1]
        return B, T, out, self.R.shape[-1]

    def fast_instantiate(self) -> Tensor | None:
        """(B, out, in) per-example gradient without the coefficient, or None."""
        return None

    def fast_weighted_sum(self, w: Tensor, dtype: torch.dtype) -> Tensor | None:
        """sum_b w_b * (per-example gradient)_b, shape (out, in) or the parameter's, or None."""
        return None

    def ghost_bytes(self) -> int:
        """Bytes this contribution keeps alive in ghost form until the clip factors are known:
        its factors (a one-hot factor as its ids), without building anything."""
        return sum(t.numel() * t.element_size()
                   for t in ((self.L.ids if isinstance(self.L, OneHot) else self.L), self.R))


@dataclass
class Dense:
    """Per-example gradient g[b], shaped (B, *param.shape)."""

    g: Tensor
    coef: float = 1.0


@dataclass
class Rows:
    """Per-example gradients of a few examples only: ``g[k]`` is example ``idx[k]``'s (flattened
    like the parameter). In a parameter's list it replaces those examples' share of the other
    contributions, which the clipped sum then weights 0 (:func:`refine_cancelled`)."""

    idx: Tensor  # (k,) int64
    g: Tensor  # (k, numel)
    coef: float = 1.0


class Factored:
    """Base of layer-specific contributions (see the module docstring). Subclasses set ``coef``
    and implement ``instantiate``; ``ghost_sq_norms`` and ``weighted_sum`` when
    ``supports_ghost`` (one without a ghost form is instantiated before any sum); ``cost`` for
    the choice by cost."""

    coef: float = 1.0
    supports_ghost: bool = False

    def instantiate(self) -> Tensor:
        """(B, *param.shape) per-example gradient, coefficient NOT applied."""
        raise NotImplementedError

    def weighted_sum(self, w: Tensor) -> Tensor:
        """sum_b w_b * g_b, parameter-shaped (coefficient NOT applied)."""
        raise NotImplementedError

    def ghost_sq_norms(self) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """(B,) squared norms of g_b without instantiating (coefficient NOT applied), and None
        or (idx, rows): examples whose ghost formula was within rounding of 0, with their
        instantiated gradients (k, numel), whose norms are in the first result and which the
        clipped sum adds as they are (a :class:`Rows` contribution)."""
        raise NotImplementedError

    def cost(self, form: str) -> float:
        """Estimated cost of computing the norms (and the sum) in ``form``."""
        return 0.0 if form == "instantiate" else float("inf")


Contribution = Outer | Dense | Factored | Rows


# ---------------------------------------------------------------------------------------------
# inner products between two contributions of the same parameter, per example: shape (B,)


def _ll(a: Tensor | OneHot, b: Tensor | OneHot) -> Tensor:
    """(B, Ta, Tb) matrix of dot products between the left factors."""
    if isinstance(a, OneHot) and isinstance(b, OneHot):
        return (a.ids[:, :, None] == b.ids[:, None, :]).to(torch.float32)
    if isinstance(a, OneHot):
        # a_t · b_s = b[s, ids_t]
        return torch.gather(b, 2, a.ids[:, None, :].expand(-1, b.shape[1], -1)).transpose(1, 2)
    if isinstance(b, OneHot):
        return _ll(b, a).transpose(1, 2)
    return torch.bmm(a, b.transpose(1, 2))


def _outer_inner(u: Outer, v: Outer, kernels: Kernels = "torch") -> Tensor:
    return _outer_inner_scaled(u, v, kernels)[0]


def _outer_inner_scaled(u: Outer, v: Outer, kernels: Kernels = "torch",
                        scale: bool = False) -> tuple[Tensor, Tensor | None]:
    """(<u_b, v_b>, and with ``scale`` for u is v, sum_t |L_t|^2 |R_t|^2: the Gram matrices'
    diagonals, read for free; see :func:`rounding_scale`)."""
    if kernels == "triton" and not isinstance(u.L, OneHot) and not isinstance(v.L, OneHot):
        from dptrain.kernels.ghost import outer_inner

        if u is v:
            return outer_inner(u.L, u.R), rounding_scale([Outer(u.L, u.R)]) if scale else None
        return outer_inner(u.L, u.R, v.L, v.R), None
    rr = torch.bmm(u.R, v.R.transpose(1, 2))  # (B, Tu, Tv)
    ll = _ll(u.L, v.L).to(rr.dtype)
    q = None
    if scale and u is v:
        q = (ll.diagonal(dim1=1, dim2=2) * rr.diagonal(dim1=1, dim2=2)).sum(1)
    return (ll * rr).sum(dim=(1, 2)), q


def instantiate(c: Outer | Factored) -> Tensor:
    """(B, out, in) per-example gradient of an Outer contribution (a Factored one: shaped like
    the parameter), WITHOUT its coefficient."""
    if isinstance(c, Factored):
        return c.instantiate()
    fast = c.fast_instantiate()
    if fast is not None:
        return fast
    if isinstance(c.L, OneHot):
        B, T = c.L.ids.shape
        g = c.R.new_zeros(B * c.L.num, c.R.shape[-1])
        rows = (c.L.ids + torch.arange(B, device=c.R.device)[:, None] * c.L.num).reshape(-1)
        g.index_add_(0, rows, c.R.reshape(B * T, -1))
        return g.view(B, c.L.num, -1)
    return torch.bmm(c.L.transpose(1, 2), c.R)


def add_instantiated(buf: Tensor | None, c: Contribution, alpha: float,
                     out: Tensor | None = None) -> Tensor:
    """``buf + alpha * g`` with g the per-example gradient of ``c`` (coefficient NOT applied),
    flattened to (B, numel). ``buf`` None: the first term, written into ``out`` (B, numel) when
    given (its previous contents are overwritten, never read), else into a new tensor. In place
    where possible: a dense Outer goes through one ``bmm``/``baddbmm_``, a one-hot one through
    ``index_add_`` (no (B, out, in) temporary), so summing the states' contributions of a
    parameter costs their products and no extra pass over the instantiated gradient."""
    if isinstance(c, Outer) and not isinstance(c.L, OneHot):
        fast = c.fast_instantiate()
        if fast is None:
            L, R = c.L, c.R
            B, o = L.shape[0], L.shape[-1]
            if buf is None:
                # scale the narrower factor (lm_head: L is (B, T, vocab), R is (B, T, d))
                if o <= R.shape[-1]:
                    L = L * alpha
                else:
                    R = R * alpha
                if out is None:
                    return torch.bmm(L.transpose(1, 2), R).reshape(B, -1)
                torch.bmm(L.transpose(1, 2), R, out=out.view(B, o, R.shape[-1]))
                return out
            buf.view(B, o, R.shape[-1]).baddbmm_(L.transpose(1, 2), R, alpha=alpha)
            return buf
        g = fast
    elif isinstance(c, Outer):  # one-hot left factor (embeddings)
        B, T = c.L.ids.shape
        if buf is None:
            buf = (out.zero_() if out is not None
                   else c.R.new_zeros(B, c.L.num * c.R.shape[-1]))
        rows = (c.L.ids + torch.arange(B, device=c.R.device)[:, None] * c.L.num).reshape(-1)
        buf.view(B * c.L.num, -1).index_add_(0, rows, c.R.reshape(B * T, -1), alpha=alpha)
        return buf
    elif isinstance(c, Dense):
        g = c.g
    else:
        g = c.instantiate()
    g = g.reshape(g.shape[0], -1)
    if buf is None:
        if out is None:
            return g * alpha
        return torch.mul(g.to(out.dtype), alpha, out=out)
    return buf.add_(g.to(buf.dtype), alpha=alpha)


def first_write_order(contribs: list[Contribution]) -> list[Contribution]:
    """The contributions with a dense Outer first: it starts an instantiated buffer with a plain
    product, where a one-hot one would need the buffer zeroed first."""
    return sorted(contribs, key=lambda c: 0 if isinstance(c, Outer)
                  and not isinstance(c.L, OneHot) else 1)


def _dense_outer_inner(d: Tensor, v: Outer) -> Tensor:
    """<d_b, sum_t L_t ⊗ R_t> with d viewed (B, out, in)."""
    d = d.reshape(d.shape[0], -1, v.R.shape[-1])
    dr = torch.bmm(d, v.R.transpose(1, 2))  # (B, out, T)
    if isinstance(v.L, OneHot):
        return torch.gather(dr, 1, v.L.ids[:, None, :]).sum(dim=(1, 2))
    return (dr * v.L.transpose(1, 2)).sum(dim=(1, 2))


def inner(u: Contribution, v: Contribution, kernels: Kernels = "torch") -> Tensor:
    """Per-example <u_b, v_b> of two contributions (coefficients not applied). ``kernels``:
    "triton" computes the ghost products of two dense outer-product forms with the fused kernel
    (dptrain/kernels/ghost.py) instead of two Gram matrices; same quantity."""
    if isinstance(u, Outer) and isinstance(v, Outer):
        return _outer_inner(u, v, kernels)
    if isinstance(u, Dense) and isinstance(v, Dense):
        return (u.g.flatten(1) * v.g.flatten(1)).sum(1)
    if isinstance(u, Dense):
        return _dense_outer_inner(u.g, v)
    return _dense_outer_inner(v.g, u)


# ---------------------------------------------------------------------------------------------
# cost model: ghost or instantiate, per parameter


def _dims(c: Outer) -> tuple[int, int, int, int]:
    return c.dims()


def choose_form(contribs: list[Contribution],
                policy: Literal["auto", "ghost", "instantiate", "memory"] = "auto") -> str:
    """'ghost' or 'instantiate' for one parameter's Outer contributions, by estimated flops.

    ghost:       sum_{u,v} B*Tu*Tv*(out+in)  (+ memory B*Tu*Tv)
    instantiate: sum_u B*Tu*out*in           (+ memory B*out*in)
    Dense contributions are already instantiated and do not enter the choice. A lone
    Factored contribution that supports the ghost form decides by its own ``cost``; Factored
    contributions paired with others are instantiated in either form.
    """
    if policy == "memory":
        return choose_form_memory(contribs, 1)
    outers = [c for c in contribs if isinstance(c, Outer)]
    if not outers:
        if len(contribs) == 1 and isinstance(contribs[0], Factored) and contribs[0].supports_ghost:
            if policy != "auto":
                return policy
            c = contribs[0]
            return "ghost" if c.cost("ghost") < c.cost("instantiate") else "instantiate"
        return "instantiate"
    B, _, out, inn = _dims(outers[0])
    too_big = B * out * inn > MAX_INSTANTIATE_NUMEL
    if policy == "ghost" or (policy == "auto" and too_big):
        return "ghost"
    if policy == "instantiate":
        return "instantiate"
    ghost = sum(_dims(u)[1] * _dims(v)[1] for u in outers for v in outers) * (out + inn)
    inst = sum(_dims(u)[1] for u in outers) * out * inn
    return "ghost" if ghost < inst else "instantiate"


#: Multi-state cost model: cost of one element of an instantiated per-example gradient (the
#: first write into the reused (B, out, in) buffer, the pass for its norm, the pass for the
#: clipped sum; memory-bound) in units of one multiply-add of the products. Measured on CPU
#: (1 thread, float32, GPT-2 shapes at T = 64, B = 16; issue 4, bench/inner_momentum.py):
#: these passes take about 25 multiply-add times per element, and with that the model picks
#: the faster form for the blocks' linears, the tied embedding/head and wpe at 2, 3 and 5
#: states (instantiate at every one of them; ghost would win with short T and wide layers).
INSTANTIATED_ELEMENT_COST = 24


def choose_form_states(contribs: list[Contribution], n_states: int,
                       policy: Literal["auto", "ghost", "instantiate", "memory"] = "auto") -> str:
    """'ghost' or 'instantiate' for one parameter evaluated at ``n_states`` model states of a
    query plan, ``contribs`` being its contributions at ONE state (the others are alike).

    One state: :func:`choose_form`. Several: a cost model that also counts the clipped sum,
    which is what grows with the states: per example,

    ghost:       sum over pairs u <= v of Tu*Tv*(l(u,v) + in)   (cross terms, each pair once;
                 l = 1 when a left factor is one-hot, a gather, else out)
                 + sum_u Tu*out*in                               (book-keeping products)
    instantiate: sum_u Tu*out*in                                 (baddbmm_ into one buffer;
                                                                  one-hot: Tu*in, index_add_)
                 + INSTANTIATED_ELEMENT_COST * out*in            (the buffer's passes)

    where a one-hot contribution's products cost Tu*in instead of Tu*out*in.
    """
    if policy == "memory":
        return choose_form_memory(contribs, n_states)
    if n_states <= 1:
        return choose_form(contribs, policy)
    allc = list(contribs) * n_states
    outers = [c for c in allc if isinstance(c, Outer)]
    if policy != "auto" or not outers:
        return choose_form(allc, policy)
    B, _, out, inn = _dims(outers[0])
    if B * out * inn > MAX_INSTANTIATE_NUMEL:
        return "ghost"
    ghost = inst = 0
    for i, u in enumerate(outers):
        tu = _dims(u)[1]
        hot_u = isinstance(u.L, OneHot)
        prod = tu * inn * (1 if hot_u else out)
        ghost += prod
        inst += prod
        for v in outers[i:]:
            ll = 1 if hot_u or isinstance(v.L, OneHot) else out
            ghost += tu * _dims(v)[1] * (ll + inn)
    inst += INSTANTIATED_ELEMENT_COST * out * inn
    return "ghost" if ghost < inst else "instantiate"


def choose_form_memory(contribs: list[Contribution], n_states: int) -> str:
    """``performance.ghost=memory``: the form that holds fewer bytes for one parameter evaluated
    at ``n_states`` states, ``contribs`` being its contributions at ONE state:

    ghost:       n_states x the contributions' factors (``Outer.ghost_bytes``), kept until the
                 clip factors are known, + the two (B, T, T) Gram matrices of one pair
    instantiate: the per-example buffer, B x out x in (one for all states)

    Dense contributions are rows of the buffer in either form and do not enter the choice; a
    lone Factored one decides as under ``auto`` (paired, it is instantiated in either form)."""
    outers = [c for c in contribs if isinstance(c, Outer)]
    if not outers:
        return choose_form(list(contribs) * n_states, "auto")
    B, _, out, inn = _dims(outers[0])
    if B * out * inn > MAX_INSTANTIATE_NUMEL:
        return "ghost"
    ref = outers[0].L if isinstance(outers[0].L, Tensor) else outers[0].R
    size = ref.element_size()
    T = max(_dims(c)[1] for c in outers)
    ghost = n_states * sum(c.ghost_bytes() for c in outers) + 2 * B * T * T * size
    inst = B * out * inn * size
    return "ghost" if ghost < inst else "instantiate"


def state_bytes(contribs: list[Contribution]) -> tuple[int | None, int]:
    """(bytes one state's contributions keep in ghost form, or None when a layer-specific form
    is among them; the element size of the per-example buffer)."""
    ghost, size = 0, 4
    for c in contribs:
        if isinstance(c, Outer):
            ghost += c.ghost_bytes()
            ref = c.L if isinstance(c.L, Tensor) else c.R
        elif isinstance(c, Dense):
            ghost += c.g.numel() * c.g.element_size()
            ref = c.g
        else:
            return None, size
        size = ref.element_size()
    return ghost, size


def squared_norms(contribs: list[Contribution],
                  kernels: Kernels = "torch") -> tuple[Tensor, list[Contribution]]:
    """Per-example squared norm of sum_u coef_u * c_u in ghost form (every pair of
    contributions, cross terms included), and the contributions the clipped sum is to use (a
    Factored one instantiated as a Dense unless it is alone and has a ghost form). A parameter
    in instantiated form never comes here: the engine sums its states as they arrive
    (:func:`add_instantiated`). ``kernels``: see :func:`inner`."""
    sq, _, contribs = squared_norms_scaled(contribs, kernels)
    return sq, contribs


def squared_norms_scaled(contribs: list[Contribution], kernels: Kernels = "torch"
                         ) -> tuple[Tensor, Tensor | None, list[Contribution]]:
    """:func:`squared_norms`, with the squared norms' :func:`rounding_scale` in the middle
    (None for a lone Factored form, which guards its own formula), read off the Gram matrices'
    diagonals where the torch path builds them."""
    if len(contribs) == 1 and isinstance(contribs[0], Factored) and contribs[0].supports_ghost:
        c = contribs[0]
        sq, rows = c.ghost_sq_norms()
        if rows is not None:
            contribs = [c, Rows(rows[0], rows[1], c.coef)]
        return sq * (c.coef * c.coef), None, contribs
    contribs = [Dense(instantiate(c), c.coef) if isinstance(c, Factored) else c for c in contribs]
    sq = scale = None
    for i, u in enumerate(contribs):
        for j in range(i, len(contribs)):
            v = contribs[j]
            w = u.coef * v.coef * (1.0 if i == j else 2.0)
            q = None
            if i != j:
                term = inner(u, v, kernels)
            elif isinstance(u, Outer):
                term, q = _outer_inner_scaled(u, u, kernels, scale=True)
            else:
                term = inner(u, u, kernels)
                q = term  # a Dense term's scale is its own square
            term = term * w
            sq = term if sq is None else sq + term
            if q is not None:
                q = q * w
                scale = q if scale is None else scale + q.to(scale.dtype)
    return sq, scale, contribs


#: A ghost squared norm below this many ulps of its rounding scale (see :func:`rounding_scale`)
#: is taken as lost to cancellation (:func:`refine_cancelled`), times T / 256 for sums over more
#: than 256 tokens: terms that are alike round alike, and their errors then add up over the T^2
#: products instead of cancelling, the more so for wide layers (each Gram entry's rounding is
#: shared by all pairs). Red-team constructions (half the tokens one vector, half a nearby one,
#: opposite signs) just above 2^16 ulps reached norms 0.45% short at width 2,048 and T = 1,024;
#: 2^19 leaves them within about 0.06%. Ordinary batches sit at 0.5 of the scale or above
#: (the threshold is 0.0625 = 2^19 x 2^-23 in float32 up to 256 tokens).
CANCELLATION_ULPS = 2.0 ** 19
CANCELLATION_TOKENS = 256


def rounding_scale(contribs: list[Contribution]) -> Tensor | None:
    """(B,) the scale of the rounding error of :func:`squared_norms`' ghost sums, per example:
    sum_u coef_u^2 sum_t |L_t|^2 |R_t|^2 (a Dense one: coef^2 |g|^2), i.e. the sum of the
    squared norms of the per-token (per-use) terms. Each product (L_t·L_s)(R_t·R_s) is rounded
    relative to |L_t||L_s||R_t||R_s|, so the sum's error is a few ulps of this scale (more for
    many alike tokens, see :data:`CANCELLATION_ULPS`) however small the sum itself: when the
    terms nearly cancel (per-token gradients far larger than their sum, the example's gradient)
    the ghost sum is noise, and could be 0 for a gradient far above the clip norm. Uncorrelated
    terms give a sum about equal to the scale. None for a lone Factored form (which guards its
    own formula)."""
    if len(contribs) == 1 and isinstance(contribs[0], Factored):
        return None
    q = None
    for c in contribs:
        if isinstance(c, Outer):
            r = torch.linalg.vector_norm(c.R, dim=-1).square()  # (B, T)
            if not isinstance(c.L, OneHot):
                r = r * torch.linalg.vector_norm(c.L, dim=-1).square().to(r.dtype)
            term = r.sum(1)
        elif isinstance(c, Dense):
            term = sq_rows(c.g)
        else:
            return None
        term = term * (c.coef * c.coef)
        q = term if q is None else q + term.to(q.dtype)
    return q


def tokens(contribs: list[Contribution]) -> int:
    """The number of per-token (per-use) terms of a parameter's ghost sum: its Outer
    contributions' T, summed."""
    return sum(c.dims()[1] for c in contribs if isinstance(c, Outer))


def cancelled(sq: Tensor, scale: Tensor | None, n_tokens: int = 1) -> Tensor | None:
    """(B,) bool: ghost squared norms ``sq`` within rounding of 0 at ``scale``, or None."""
    if scale is None:
        return None
    ulps = CANCELLATION_ULPS * max(1.0, n_tokens / CANCELLATION_TOKENS)
    return sq < ulps * torch.finfo(sq.dtype).eps * scale.to(sq.dtype)


def _take(c: Contribution, idx: Tensor, dtype: torch.dtype) -> Contribution:
    """Examples ``idx`` of ``c`` in ``dtype`` (plain Outer or Dense)."""
    if isinstance(c, Dense):
        return Dense(c.g[idx].to(dtype), c.coef)
    R = c.R[idx].to(dtype)
    L = OneHot(c.L.ids[idx], c.L.num) if isinstance(c.L, OneHot) else c.L[idx].to(dtype)
    return Outer(L, R, c.coef)


def refine_cancelled(contribs: list[Contribution], sq: Tensor, doubt: Tensor
                     ) -> tuple[Tensor, list[Contribution]]:
    """(``sq``, ``contribs``) with the examples where ``doubt`` taken out of the ghost form: each
    one's gradient of this parameter is instantiated, summed in float64 from its float32
    factors (whose products float64 holds exactly), rounded to the working dtype, and its
    squared norm is that of the rounded rows, which the clipped sum then adds as they are
    (a :class:`Rows` contribution; the others weight those examples 0). So the norm is the norm
    of what is added, however far the factors' terms cancel: a clipped sum formed from the
    factors would add their rounding residue, ~eps |L_t||R_t|, unrelated to the norm (1.9e4 C
    for identical tokens of size 1e10 with opposite output gradients). Rare by construction;
    one example at a time, the memory of one per-example gradient of the parameter each."""
    idx = doubt.nonzero().squeeze(1)
    dtype = sq.dtype
    rows = []
    for b in idx.tolist():
        g = None
        for c in contribs:
            one = _take(c, torch.tensor([b], device=idx.device), torch.float64)
            part = (one.g if isinstance(one, Dense) else instantiate(one)).reshape(-1) * c.coef
            g = part if g is None else g + part
        rows.append(g.to(dtype))
    g = torch.stack(rows)
    out = sq.clone()
    out[idx] = sq_rows(g.double()).to(dtype)
    return out, [*contribs, Rows(idx, g)]


#: Columns per block of :func:`sq_rows`: float32's own reduction of 512 elements is within 1e-7
#: (identical values; 2e-9 for alike ones), of 4,096 identical ones 4.6e-6.
SQ_ROWS_BLOCK = 512


def sq_rows(g: Tensor) -> Tensor:
    """(B,) squared norms of the rows of g (B, ...), without a squared copy of g, returned in
    g's dtype. The clip factors follow these norms, so they must not round low: float32's own
    reduction over a long row does (on CPU, 5.7e-5 relative over 590k alike elements, 1.4e-3
    over 2.4M: an instantiated 768 x 768 Linear's example then added 1.0005 C). So a row is
    reduced in blocks of :data:`SQ_ROWS_BLOCK` columns (a view: no copy) and the blocks'
    squares are added in float64 (within 1e-7 relative; BENCHMARKS.md: within a few percent
    of forming the instantiated gradient)."""
    g = g.reshape(g.shape[0], -1)
    B, n = g.shape
    if g.dtype == torch.float64 or n <= SQ_ROWS_BLOCK:  # (one block: float32 is exact enough)
        return torch.linalg.vector_norm(g, dim=1).square()
    if g.stride(1) != 1:
        g = g.contiguous()
    whole = n // SQ_ROWS_BLOCK * SQ_ROWS_BLOCK
    # each row's whole blocks, as a view (no copy, whatever the tail)
    blocks = g.as_strided((B, whole // SQ_ROWS_BLOCK, SQ_ROWS_BLOCK),
                          (g.stride(0), SQ_ROWS_BLOCK, 1), g.storage_offset())
    total = torch.linalg.vector_norm(blocks, dim=2).double().square().sum(1)
    if whole < n:
        total += torch.linalg.vector_norm(g[:, whole:].double(), dim=1).square()
    return total.to(g.dtype)


def drop_examples(c: Contribution, keep: Tensor) -> Contribution:
    """``c`` with the per-example gradient of every example where ``keep`` (bool, (B,)) is False
    set to exactly 0, whatever its captured tensors hold.

    An example whose loss or gradient is not finite gets clip factor 0, but weighting does not
    remove it: ``0 * inf`` and ``0 * nan`` are NaN, so one such example would turn the whole
    clipped sum, and the release, into NaN. Its rows are therefore selected away
    (``torch.where``) rather than multiplied by 0. Plain ``Outer`` and ``Dense`` forms keep their
    shape; other forms (convolutions, weight standardisation) are instantiated per example
    first, which keeps every other example's row exact: their per-example gradients are
    computed row by row. Used only for microbatches that hold such an example."""
    def rows(t: Tensor) -> Tensor:
        k = keep.to(t.device).view(-1, *([1] * (t.dim() - 1)))
        return torch.where(k, t, torch.zeros((), dtype=t.dtype, device=t.device))

    if isinstance(c, Dense):
        return Dense(rows(c.g), c.coef)
    if isinstance(c, Rows):
        k = keep.to(c.g.device)[c.idx.to(c.g.device)].view(-1, 1)
        return Rows(c.idx, torch.where(k, c.g, torch.zeros((), dtype=c.g.dtype, device=c.g.device)),
                    c.coef)
    if type(c) is Outer:
        L = c.L if isinstance(c.L, OneHot) else rows(c.L)
        return Outer(L, rows(c.R), c.coef)
    return Dense(rows(instantiate(c)), c.coef)


def clipped_sum(contribs: list[Contribution], lam: Tensor, shape: torch.Size,
                dtype: torch.dtype) -> Tensor:
    """sum_b lam_b * sum_u coef_u * c_u[b], reshaped to the parameter's shape."""
    total = None
    taken = [c for c in contribs if isinstance(c, Rows)]
    rest = lam
    if taken:  # those examples are added as their rows only
        rest = lam.clone()
        for c in taken:
            rest[c.idx.to(lam.device)] = 0
    for c in contribs:
        if isinstance(c, Rows):
            w = (lam[c.idx.to(lam.device)] * c.coef).to(dtype)
            part = (c.g.to(dtype) * w[:, None]).sum(0)
            total = part.reshape(shape) if total is None else total + part.reshape(shape)
            continue
        w = (rest * c.coef).to(dtype)
        if isinstance(c, Factored):
            part = c.weighted_sum(w).to(dtype)
        elif isinstance(c, Outer) and (fast := c.fast_weighted_sum(w, dtype)) is not None:
            part = fast.to(dtype)
        elif isinstance(c, Dense):
            part = torch.einsum("b...,b->...", c.g.to(dtype), w)
        elif isinstance(c.L, OneHot):
            B, T = c.L.ids.shape
            part = c.R.new_zeros(c.L.num, c.R.shape[-1], dtype=dtype)
            part.index_add_(0, c.L.ids.reshape(-1), (c.R.to(dtype) * w[:, None, None]).reshape(B * T, -1))
        else:
            # weight the narrower factor (lm_head: R is (B, T, d), L is (B, T, vocab))
            L, R = c.L.to(dtype), c.R.to(dtype)
            if L.shape[-1] <= R.shape[-1]:
                L = L * w[:, None, None]
            else:
                R = R * w[:, None, None]
            part = L.reshape(-1, L.shape[-1]).T @ R.reshape(-1, R.shape[-1])
        part = part.reshape(shape)
        total = part if total is None else total + part
    return total
