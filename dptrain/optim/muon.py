"""The Muon family on the private release: DP-Muon (Eq. 7), DP-MuonBC and DP-Muon-S.

All three read ``p.grad`` (the release, possibly filtered) and are pure post-processing.

Legend: G = p.grad, M = momentum buffer, N = what Newton–Schulz sees, O = NS(N),
(r, c) = the parameter viewed as a matrix: a conv weight (out, in, kh, kw) is (out, in*kh*kw).
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Literal

import torch
from torch import Tensor

from dptrain.optim.newton_schulz import newton_schulz, smooth_newton_schulz

__all__ = ["Muon", "MuonBC", "MuonS", "heat_bias_correction", "top_singular_value", "probe_seed"]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}


def _dtype_name(dtype: str | torch.dtype) -> str:
    if isinstance(dtype, torch.dtype):
        for name, dt in DTYPES.items():
            if dt == dtype:
                return name
        raise ValueError(f"unsupported Newton-Schulz dtype {dtype}")
    if dtype not in DTYPES:
        raise ValueError(f"ns_dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return dtype


def as_matrix(t: Tensor) -> Tensor:
    """(out, ...) -> (out, prod(...)): the matrix Muon orthogonalises (a view when possible)."""
    return t.reshape(t.shape[0], -1)


# Shape scale s(r, c) of the orthogonalised update.
SCALES: dict[str, Callable[[int, int], float]] = {
    # Moonshot's rule, torch.optim.Muon's adjust_lr_fn="match_rms_adamw": update RMS ~ 0.2.
    "match_rms_adamw": lambda r, c: 0.2 * math.sqrt(max(r, c)),
    # Keller Jordan's rule (also seed 3's sqrt(max(1, m/n))).
    "original": lambda r, c: math.sqrt(max(1.0, r / max(c, 1))),  # (an empty matrix: 1)
}


def _accumulate(buf: Tensor, grad: Tensor, mu: float, nesterov: bool) -> Tensor:
    """Eq. 7: M_t = mu*M_{t-1} + G_t; N_t = G_t + mu*M_t (Nesterov) or M_t."""
    buf.mul_(mu).add_(grad)
    return grad.add(buf, alpha=mu) if nesterov else buf


def _ema(buf: Tensor, grad: Tensor, mu: float, nesterov: bool) -> Tensor:
    """Seed 3 / torch.optim.Muon: M_t = mu*M + (1-mu)*G; N_t = (1-mu)*G + mu*M_t or M_t."""
    buf.lerp_(grad, 1 - mu)
    return grad.lerp(buf, mu) if nesterov else buf


MOMENTUM_STYLES: dict[str, Callable[[Tensor, Tensor, float, bool], Tensor]] = {
    "accumulate": _accumulate,
    "ema": _ema,
}

# Coefficient of the fresh input G_t in N_t: the factor by which the release's fresh noise
# reaches Newton–Schulz's input (DP-MuonBC's nu). Accumulate+Nesterov: N = (1+mu) G + mu^2 M_prev.
FRESH_GAIN: dict[str, Callable[[float, bool], float]] = {
    "accumulate": lambda mu, nesterov: (1 + mu) if nesterov else 1.0,
    "ema": lambda mu, nesterov: (1 - mu) * ((1 + mu) if nesterov else 1.0),
}


def _param_names(group: dict) -> list[str]:
    names = group.get("param_names")
    return list(names) if names is not None else [f"param{i}" for i in range(len(group["params"]))]


def probe_seed(*parts: object) -> int:
    """A 63-bit torch seed from public values, e.g. ("muon_bc_probe", seed, step, name)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _check_finite(**values: float) -> None:
    """ValueError naming the first argument that is not a finite number >= 0: NaN or inf made
    the weights NaN after one step, a negative lr a silent step uphill. (eps = 0 is the exact
    iteration the tests compare with, and a zero matrix then gives a zero update.)"""
    for name, v in values.items():
        if isinstance(v, Tensor):
            continue  # (a tensor lr, as torch.optim allows: the caller's own)
        if isinstance(v, bool) or not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")


try:  # DTensor: FSDP2's sharded parameters
    from torch.distributed.tensor import DTensor as _DTensor
except Exception:  # pragma: no cover
    _DTensor = None


def _local(t: Tensor) -> Tensor:
    """The local shard of an FSDP2 parameter/gradient (the tensor itself when not sharded)."""
    return t.to_local() if _DTensor is not None and isinstance(t, _DTensor) else t


def _sharded_newton_schulz(local_rows: list[Tensor], shapes: list[tuple[int, int]], group: dict,
                           at_owner: Callable[[int, Tensor], Tensor] | None = None
                           ) -> list[Tensor]:
    """Each rank's rows of NS_J of the FSDP2-sharded matrices whose local rows are given (their
    global (r, c) in ``shapes``), in the group's ``ns_dtype``: ``distributed_newton_schulz``;
    ``at_owner(i, X)`` instead of the iteration, at matrix i's owner rank (MuonBC's own map)."""
    from dptrain.parallel.newton_schulz import distributed_newton_schulz

    dtype = DTYPES[group["ns_dtype"]]
    return distributed_newton_schulz([X.to(dtype) for X in local_rows], shapes,
                                     steps=group["ns_steps"],
                                     coefficients=group["ns_coefficients"], eps=group["eps"],
                                     fn=at_owner)


def _check_newton_schulz(ns_steps: int, ns_coefficients: str) -> None:
    """ValueError for a Newton–Schulz setting ``step`` could not run, at construction: at the
    first step the release it would orthogonalise is already spent."""
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 1:
        raise ValueError(f"ns_steps must be an int >= 1, got {ns_steps!r}")
    if ns_coefficients not in ("muon", "polar_express"):
        raise ValueError(f"ns_coefficients must be 'muon' or 'polar_express', got "
                         f"{ns_coefficients!r}")


class Muon(torch.optim.Optimizer):
    """DP-Muon (Eq. 7 of Kim and Fan): momentum, Newton–Schulz, shape-scaled step.

    M_t = mu*M_{t-1} + G_t; N_t = G_t + mu*M_t (Nesterov); O_t = NS_J(N_t);
    W <- W*(1 - lr*weight_decay) - lr*s(r, c)*O_t.

    Warnings:
    - every parameter must have >= 2 dims; conv weights are orthogonalised as (out, in*kh*kw);
      embeddings, heads, gains and biases belong in another group (see ``groups.py`` presets);
    - ``ns_dtype`` is a performance option (bf16 is ~2x cheaper on GPUs); ``float64`` computes
      the same J steps with float64 rounding;
    - with ``momentum_style="ema"`` N is (1-mu) times Eq. 7's; Newton–Schulz's Frobenius
      normalisation removes that factor (up to ``eps``), so both styles give the same step;
    - ``scale="original"`` uses sqrt(max(1, r/c)) with r = fan-out of a ``nn.Linear``; HF GPT-2's
      ``Conv1D`` stores (in, out): pass its weights' names as ``transposed`` (the trainer does,
      ``dptrain.optim.build.transposed_weights``) so that r/c is fan-out / fan-in.
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        *,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: Literal["muon", "polar_express"] = "muon",
        ns_dtype: str | torch.dtype = "float32",
        scale: Literal["match_rms_adamw", "original"] = "match_rms_adamw",
        momentum_style: Literal["accumulate", "ema"] = "accumulate",
        weight_decay: float = 0.0,
        eps: float = 1e-7,
        transposed: frozenset[str] = frozenset(),
    ):
        _check_finite(lr=lr, weight_decay=weight_decay, eps=eps)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if scale not in SCALES:
            raise ValueError(f"scale must be one of {sorted(SCALES)}, got {scale!r}")
        if momentum_style not in MOMENTUM_STYLES:
            raise ValueError(f"momentum_style must be one of {sorted(MOMENTUM_STYLES)}")
        _check_newton_schulz(ns_steps, ns_coefficients)
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        ns_coefficients=ns_coefficients, ns_dtype=_dtype_name(ns_dtype),
                        scale=scale, momentum_style=momentum_style, weight_decay=weight_decay,
                        eps=eps, noise_gain=1.0)
        super().__init__(params, defaults)
        # names of weights stored (in, out), as transformers' Conv1D: their (r, c) for the
        # shape scale is the reverse of the storage shape (the orthogonalisation is symmetric)
        self.transposed = frozenset(transposed)
        for group in self.param_groups:
            for name, p in zip(_param_names(group), group["params"]):
                if p.ndim < 2:
                    raise ValueError(f"{type(self).__name__} needs parameters with >= 2 dims; "
                                     f"{name} has shape {tuple(p.shape)}")

    local_state_rows = True
    """Under FSDP the momentum buffers are this rank's rows (plain tensors): checkpoints wrap
    them as DTensors to save and unwrap them on load."""

    def _orthogonalise(self, N: Tensor, group: dict, state: dict, name: str) -> Tensor:
        """O = NS_J(N) for the (r, c) matrix N, computed in ``ns_dtype``."""
        X = N.to(DTYPES[group["ns_dtype"]])
        return newton_schulz(X, group["ns_steps"], coefficients=group["ns_coefficients"],
                             eps=group["eps"])

    @torch.no_grad()
    def step(self, closure=None):
        """Two phases per group: momentum and N_t for every matrix, then orthogonalisation
        (batched across ranks when the parameters are FSDP2 shards), then the updates.

        Sharded parameters (DTensor, rows split over ranks): momentum buffers stay sharded;
        plain Muon orthogonalises with ``distributed_newton_schulz`` (whole matrices at owner
        ranks, or model-parallel for matrices too large for one rank); subclasses with their own
        ``_orthogonalise`` (MuonBC) run it at each matrix's owner rank (owner-compute: each
        matrix is gathered once, on one rank, and its rows sent back)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            advance = MOMENTUM_STYLES[group["momentum_style"]]
            todo = []  # (name, p, local N as (rows, c), global (r, c), state)
            for name, p in zip(_param_names(group), group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                grad = _local(p.grad)
                if not state:
                    state["step"] = 0
                    state["momentum_buffer"] = torch.zeros_like(grad)
                N = advance(state["momentum_buffer"], grad, mu, group["nesterov"])
                rc = (p.shape[0], math.prod(p.shape[1:]))  # the stored matrix (global)
                # rc[1], not -1: a rank's shard may hold no rows of a small matrix
                todo.append((name, p, N.reshape(N.shape[0], rc[1]), rc, state))
            if not todo:
                continue
            sharded = isinstance(todo[0][1], _DTensor) if _DTensor is not None else False
            if sharded:
                def at_owner(i: int, X: Tensor) -> Tensor:  # MuonBC's own map
                    name, _, _, _, state = todo[i]
                    return self._orthogonalise(X, group, state, name)

                custom = type(self)._orthogonalise is not Muon._orthogonalise
                outs = _sharded_newton_schulz([t[2] for t in todo], [t[3] for t in todo],
                                              group, at_owner if custom else None)
            else:
                outs = [self._orthogonalise(N_rc, group, state, name)
                        for name, _, N_rc, rc, state in todo]
            for (name, p, N_rc, rc, state), O_rc in zip(todo, outs):
                state["step"] += 1
                # (fan-out, fan-in): a Conv1D weight is stored (in, out)
                s = SCALES[group["scale"]](*(rc[::-1] if name in self.transposed else rc))
                w = _local(p)
                if wd != 0:
                    w.mul_(1 - lr * wd)
                w.add_(O_rc.view(w.shape).to(w.dtype), alpha=-lr * s)
        return loss


def heat_bias_correction(
    Q: Callable[[Tensor], Tensor],
    A: Tensor,
    nu: float,
    E: Tensor,
    *,
    lam: float = 1.25,
    kappa: float = 2.0,
) -> Tensor:
    """Q_BC(A) = Q(A) - lam * [mean_k (Q(A + h E_k) + Q(A - h E_k))/2 - Q(A)] / kappa^2, h = kappa*nu.

    ``E`` has shape (num_probes, *A.shape): public probe directions, N(0, I) each. ``Q`` must
    accept a leading batch dimension. One call evaluates Q on the 1 + 2*num_probes inputs.
    With lam = 1 the correction is exact for every quadratic Q (see docs/optim.md).
    """
    h = kappa * nu
    X = torch.cat([A.unsqueeze(0), A.unsqueeze(0) + h * E, A.unsqueeze(0) - h * E])
    Qx = Q(X)
    num_probes = E.shape[0]
    Q0 = Qx[0]
    smoothed = 0.5 * (Qx[1:1 + num_probes] + Qx[1 + num_probes:]).mean(dim=0)
    return Q0 - (lam / (kappa * kappa)) * (smoothed - Q0)


class MuonBC(Muon):
    """DP-MuonBC: DP-Muon with a first-order inverse-heat correction of Newton–Schulz's bias.

    O_t = Q_BC(N_t) with Q = Smooth-NS (X / sqrt(gamma_ns^2 + ||X||_F^2), then J steps) and
    ``heat_bias_correction`` at nu = release_noise_std * noise_gain * (coefficient of G_t in N_t):
    (1 + mu) after Nesterov with accumulated momentum, (1 - mu)(1 + mu) with EMA momentum.
    ``noise_gain`` (a param-group entry, 1 by default) is the gain of a filter in front of the
    optimizer on the current release; ``DPOptimizer.step`` sets it before every step (a
    standalone MuonBC keeps 1).

    Probes are public randomness: a fresh ``torch.Generator`` per (seed, the parameter's step,
    parameter name), on the parameter's device, independent of the release's noise stream;
    resuming at step t on the same kind of device redraws the same probes (CPU and CUDA
    generators give different draws for one seed).

    Warnings:
    - 1 + 2*bc_probes Newton–Schulz evaluations per matrix per step (batched in one call);
    - with nu = 0 (no noise) the correction is skipped and the step equals Muon's with Smooth-NS.
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        *,
        release_noise_std: float,
        seed: int,
        bc_lambda: float = 1.25,
        bc_kappa: float = 2.0,
        bc_gamma_ns: float = 1e-4,
        bc_probes: int = 1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_coefficients: Literal["muon", "polar_express"] = "muon",
        ns_dtype: str | torch.dtype = "float32",
        scale: Literal["match_rms_adamw", "original"] = "match_rms_adamw",
        momentum_style: Literal["accumulate", "ema"] = "accumulate",
        weight_decay: float = 0.0,
        eps: float = 1e-7,
        transposed: frozenset[str] = frozenset(),
    ):
        _check_finite(release_noise_std=release_noise_std, bc_lambda=bc_lambda,
                      bc_kappa=bc_kappa, bc_gamma_ns=bc_gamma_ns)
        if bc_kappa <= 0 or bc_probes < 1 or bc_gamma_ns < 0:
            raise ValueError("need bc_kappa > 0, bc_probes >= 1 and bc_gamma_ns >= 0")
        super().__init__(params, lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                         ns_coefficients=ns_coefficients, ns_dtype=ns_dtype, scale=scale,
                         momentum_style=momentum_style, weight_decay=weight_decay, eps=eps,
                         transposed=transposed)
        self.release_noise_std = float(release_noise_std)
        self.seed = int(seed)
        for group in self.param_groups:
            group.setdefault("bc_lambda", bc_lambda)
            group.setdefault("bc_kappa", bc_kappa)
            group.setdefault("bc_gamma_ns", bc_gamma_ns)
            group.setdefault("bc_probes", bc_probes)

    def input_noise_std(self, group: dict) -> float:
        """nu: std of the fresh release noise per coordinate of Newton–Schulz's input."""
        gain = FRESH_GAIN[group["momentum_style"]](group["momentum"], group["nesterov"])
        return self.release_noise_std * group["noise_gain"] * gain

    def _orthogonalise(self, N: Tensor, group: dict, state: dict, name: str) -> Tensor:
        dtype = DTYPES[group["ns_dtype"]]

        def Q(X: Tensor) -> Tensor:
            return smooth_newton_schulz(X, group["ns_steps"], group["bc_gamma_ns"],
                                        coefficients=group["ns_coefficients"])

        A = N.to(dtype)
        nu = self.input_noise_std(group)
        if nu == 0.0:
            return Q(A)
        gen = torch.Generator(device=A.device)
        gen.manual_seed(probe_seed("muon_bc_probe", self.seed, state["step"], name))
        E = torch.randn((group["bc_probes"], *A.shape), generator=gen, device=A.device,
                        dtype=torch.float32).to(dtype)
        return heat_bias_correction(Q, A, nu, E, lam=group["bc_lambda"],
                                    kappa=group["bc_kappa"])


def top_singular_value(M: Tensor, v: Tensor, num_iters: int, tol: float = 0.0,
                       reduce: Callable[[Tensor], None] | None = None) -> tuple[Tensor, Tensor]:
    """sigma_1(M) and its right singular vector by Lanczos on M^T M from ``v`` (unit): the
    power iteration's products, at most ``num_iters`` of them, with the estimate the best one
    in their Krylov space (the largest eigenvalue of the Lanczos tridiagonal T, vectors fully
    reorthogonalised) instead of the last iterate's. Stops once the top Ritz pair's residual
    ``beta_j |s_j|`` is at most ``tol`` times its value (``tol`` 0: ``num_iters``
    products), which bounds the distance from sigma_1^2's estimate to an eigenvalue of M^T M.

    ``M`` may be this rank's rows of a matrix split by rows over ranks: ``reduce`` then sums a
    c-vector across them in place (one all-reduce per product), and every rank, holding the
    same sums, takes the same steps and stops after the same one.

    Returns (sigma, v_new), v_new the top Ritz vector (the next step's warm start); a zero
    matrix leaves ``v`` unchanged and gives sigma = 0. A nonzero matrix with ``v`` in its null
    space (M v = 0, so the Krylov space is {v} and sigma would be 0) is iterated once more
    from a fixed pseudo-random vector, the same on every rank.

    The iteration also stops where the Krylov space is exhausted, or numerically so: once the
    new direction's norm ``beta`` is at the rounding level of its product (``_BREAKDOWN``
    epsilons of the iteration's dtype, float32 or float64), it is rounding noise, and the
    tridiagonal T would no longer be M^T M's projection (with ``tol`` 0, Ritz values 6-150x
    sigma_1 were seen past a float32 matrix's rank); where the top of the spectrum is clustered
    closer than that, the estimate is then within the cluster. bf16 and float16 matrices (and
    their ``v``, normalised again) iterate in float32. M is first scaled by the power of two
    that brings its largest entry (summed over ``reduce``'s ranks: the same on every rank)
    into [0.5, 1), which is exact: sigma_1 then lies within [2^-10, 2^15] for any matrix of
    up to 2^30 entries split over up to 512 ranks, so no product, norm or square of the
    iteration overflows or loses its digits to subnormals (unscaled, M^T M q overflowed
    float32 from sigma_1 ~ 1.8e19 on, and below ~1e-11 its norms' squares underflowed).
    """
    out_dtype, v_in = M.dtype, v
    if M.dtype in (torch.bfloat16, torch.float16):
        M, v = M.float(), v.float()
        v = v / torch.linalg.vector_norm(v)  # (unit to bf16's 1e-3 only)
    info = torch.finfo(M.dtype)
    largest = M.abs().amax().reshape(1) if M.numel() else M.new_zeros(1)
    if reduce is not None:
        reduce(largest)
    largest = float(largest)
    shift = math.frexp(largest)[1] if math.isfinite(largest) and largest > 0 else 0
    if shift:
        M = torch.ldexp(M, torch.tensor(-shift, device=M.device))
    theta, y = _lanczos(M, v, num_iters, tol, reduce, info)
    if theta <= 0 and 0 < largest < math.inf:
        # M is not zero but maps every vector of v's Krylov space to 0 (v in its null space):
        # once more from a fixed pseudo-random start, the same on every rank
        gen = torch.Generator().manual_seed(_RESTART_SEED)
        v = torch.randn(M.shape[-1], generator=gen, dtype=torch.float64).to(M)
        theta, y = _lanczos(M, v / torch.linalg.vector_norm(v), num_iters, tol, reduce, info)
    if theta <= 0:
        return torch.zeros((), dtype=out_dtype, device=M.device), v_in
    return (torch.tensor(math.ldexp(math.sqrt(theta), shift), dtype=out_dtype, device=M.device),
            y.to(v_in.dtype))


def _lanczos(M: Tensor, v: Tensor, num_iters: int, tol: float,
             reduce: Callable[[Tensor], None] | None, info: torch.finfo) -> tuple[float, Tensor]:
    """The top Ritz value of M^T M from the unit ``v`` and its unit Ritz vector (``v`` where the
    value is <= 0); the iteration of ``top_singular_value``."""
    basis = [v]
    alphas: list[float] = []
    betas: list[float] = []
    theta, s = 0.0, None
    for _ in range(num_iters):
        q = basis[-1]
        w = M.mT @ (M @ q)
        if reduce is not None:
            reduce(w)
        alphas.append(float(torch.dot(q, w)))
        product = float(torch.linalg.vector_norm(w))
        Q = torch.stack(basis, dim=1)
        for _ in range(2):  # classical Gram-Schmidt twice: full reorthogonalisation
            w = w - Q @ (Q.mT @ w)
        beta = float(torch.linalg.vector_norm(w))
        theta, s = _top_ritz(alphas, betas)
        if (beta <= max(info.tiny, _BREAKDOWN * info.eps * product)
                or beta * abs(s[-1]) <= tol * theta):
            break
        betas.append(beta)
        basis.append(w / beta)
    if theta <= 0 or s is None:
        return theta, v
    y = Q @ s.to(dtype=Q.dtype, device=Q.device)
    return theta, y / torch.linalg.vector_norm(y)


#: a Lanczos direction whose norm is within this many epsilons of its product's is
#: rounding noise (the Krylov space is exhausted); see ``top_singular_value``
_BREAKDOWN = 64
#: the seed of the restart vector where a warm start lies in a nonzero matrix's null space
_RESTART_SEED = 0x5EED


def _top_ritz(alphas: list[float], betas: list[float]) -> tuple[float, Tensor]:
    """The largest eigenvalue of the symmetric tridiagonal matrix with diagonal ``alphas`` and
    off-diagonal ``betas`` (float64, on the CPU), and its unit eigenvector."""
    T = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if betas:
        off = torch.tensor(betas, dtype=torch.float64)
        T += torch.diag(off, 1) + torch.diag(off, -1)
    values, vectors = torch.linalg.eigh(T)
    return float(values[-1]), vectors[:, -1]


class MuonS(torch.optim.Optimizer):
    """DP-Muon-S ("Spectral Gradient Orthogonalization"): the update sigma_1(M) * U V^T.

    M_t = beta*M_{t-1} + G_t (heavy ball); for a matrix, W <- W - lr * sigma_1(M_t) * NS_J(M_t),
    sigma_1 by Lanczos on M^T M (``top_singular_value``: at most ``power_iters`` products, fewer
    once the residual is within ``power_tol``) warm-started from the previous step's top Ritz
    vector (kept in the state); parameters with < 2 dims take the heavy-ball SGD step
    W <- W - lr*M_t. ``weight_decay``: W <- W*(1 - lr*weight_decay) first, for every parameter
    (1-D ones too).

    Warnings:
    - ``eps`` is Newton–Schulz's normalisation guard with ``ns_coefficients="muon"`` only: the
      Polar Express coefficients (the default) use their own fixed safety terms;
    - U V^T is approximated by Newton–Schulz. The default, 6 Polar Express steps, leaves the
      singular values of a matrix normalised to ||M||_F in [0.992, 1.008] from 1e-3 of it up,
      so the update's spectral norm is lr * sigma_1 within 1%: 5 steps leave [0.85, 1.14] (an
      update up to 14% larger), Muon's quintic [0.68, 1.13] at any number of steps;
    - the first step's power vector is public randomness seeded from (seed, parameter name).
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        *,
        seed: int = 0,
        momentum: float = 0.9,
        power_iters: int = 50,
        power_tol: float = 1e-4,
        ns_steps: int = 6,
        ns_coefficients: Literal["muon", "polar_express"] = "polar_express",
        ns_dtype: str | torch.dtype = "float32",
        weight_decay: float = 0.0,
        eps: float = 1e-7,
    ):
        _check_finite(lr=lr, weight_decay=weight_decay, eps=eps)
        _check_newton_schulz(ns_steps, ns_coefficients)
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if power_iters < 2:  # one product leaves the warm start where it was
            raise ValueError(f"power_iters must be >= 2, got {power_iters}")
        if not 0.0 <= power_tol < 1.0:
            raise ValueError(f"power_tol must be in [0, 1), got {power_tol}")
        defaults = dict(lr=lr, momentum=momentum, power_iters=power_iters, power_tol=power_tol,
                        ns_steps=ns_steps, ns_coefficients=ns_coefficients,
                        ns_dtype=_dtype_name(ns_dtype),
                        weight_decay=weight_decay, eps=eps, noise_gain=1.0)
        super().__init__(params, defaults)
        self.seed = int(seed)

    local_state_rows = True
    """Under FSDP the momentum buffers are this rank's rows (plain tensors), as in Muon."""

    @torch.no_grad()
    def step(self, closure=None):
        """Sharded parameters (FSDP2 DTensors, rows split over ranks): the momentum buffers stay
        this rank's rows; sigma_1 by the same Lanczos steps with each product M^T M q summed
        across ranks (one all-reduce of a c-vector per step, the vectors replicated); U V^T by
        ``distributed_newton_schulz``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
            todo = []  # (p, local M as (rows, c), global (r, c), state)
            for name, p in zip(_param_names(group), group["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                grad = _local(p.grad)
                w = _local(p)
                if not state:
                    state["step"] = 0
                    state["momentum_buffer"] = torch.zeros_like(grad)
                    if p.ndim >= 2:
                        gen = torch.Generator(device=w.device)
                        gen.manual_seed(probe_seed("muon_s_power", self.seed, name))
                        v = torch.randn(math.prod(p.shape[1:]), generator=gen, device=w.device,
                                        dtype=w.dtype)
                        state["power_vector"] = v / torch.linalg.vector_norm(v)
                        state["sigma"] = torch.zeros((), dtype=w.dtype, device=w.device)
                M = state["momentum_buffer"].mul_(beta).add_(grad)
                state["step"] += 1
                if wd != 0:
                    w.mul_(1 - lr * wd)
                if p.ndim < 2:
                    w.add_(M, alpha=-lr)
                    continue
                rc = (p.shape[0], math.prod(p.shape[1:]))
                todo.append((p, M.reshape(M.shape[0], rc[1]), rc, state))  # rows may be 0
            if not todo:
                continue
            sharded = _DTensor is not None and isinstance(todo[0][0], _DTensor)
            for p, M_rc, rc, state in todo:
                sigma, v = top_singular_value(M_rc, state["power_vector"], group["power_iters"],
                                              group["power_tol"],
                                              reduce=_all_reduce if sharded else None)
                state["power_vector"].copy_(v)
                state["sigma"].copy_(sigma)
            if sharded:
                outs = _sharded_newton_schulz([t[1] for t in todo], [t[2] for t in todo], group)
            else:
                dtype = DTYPES[group["ns_dtype"]]
                outs = [newton_schulz(M_rc.to(dtype), group["ns_steps"],
                                      coefficients=group["ns_coefficients"], eps=group["eps"])
                        for _, M_rc, _, _ in todo]
            for (p, _, _, state), O_rc in zip(todo, outs):
                w = _local(p)
                w.add_(O_rc.view(w.shape).to(w.dtype) * state["sigma"], alpha=-lr)
        return loss


def _all_reduce(t: Tensor) -> None:
    import torch.distributed as dist

    dist.all_reduce(t)
