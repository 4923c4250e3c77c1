"""Newton–Schulz orthogonalisation (Eq. 13 of the DP-Muon paper) and its smooth variant.

``newton_schulz(X)`` approximates the polar factor U V^T of X = U S V^T by a fixed odd matrix
polynomial applied J times: X <- a X + b (X X^T) X + c (X X^T)^2 X. Every step maps U S V^T to
U p(S) V^T with p(s) = a s + b s^3 + c s^5, so the singular vectors (the polar factor) are never
touched; only the singular values are pushed towards 1 (Proposition 2 of the inner-momentum paper).

Shapes: any ``(..., m, n)`` tensor; leading dims are a batch. The iteration runs on the wide
orientation (m <= n), so the Gram matrix X X^T is the small one, (..., m, m).

The result has the dtype of the input: the optimizer casts to bf16 (or fp64) before calling when a
cheaper (or more exact) iteration is wanted; that is a performance option of the optimizer.
"""

from __future__ import annotations

import math
from typing import Callable, Literal

import torch
from torch import Tensor

__all__ = [
    "MUON_COEFFICIENTS",
    "POLAR_EXPRESS_COEFFICIENTS",
    "POLAR_EXPRESS_LIMIT",
    "newton_schulz",
    "smooth_newton_schulz",
]

MUON_COEFFICIENTS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic (a, b, c): maximal slope at 0; singular values end in ~[0.7, 1.2]."""

POLAR_EXPRESS_COEFFICIENTS: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
"""Polar Express (5 steps): one quintic per iteration. These carry the method's safety factor
(p(1) > 1 for the last one, whose fixed point is about 1.035), so iterations past the fifth use
``POLAR_EXPRESS_LIMIT`` instead of repeating the last one."""

POLAR_EXPRESS_LIMIT: tuple[float, float, float] = (15 / 8, -10 / 8, 3 / 8)
"""The quintic Polar Express's schedule tends to (its last entry): p(1) = 1 and p'(1) = 0, so
singular values near 1 converge to 1 quadratically."""

# Polar Express normalises by ||X||_F * 1.02 + 1e-6: its first quintic assumes sigma_max < 1
# with a small safety margin.
_POLAR_EXPRESS_SAFETY = 1.02
_POLAR_EXPRESS_EPS = 1e-6

Coefficients = Literal["muon", "polar_express"]


def _schedule(coefficients: Coefficients, steps: int) -> list[tuple[float, float, float]]:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0 (0: X normalised only), got {steps!r}")
    if coefficients == "muon":
        return [MUON_COEFFICIENTS] * steps
    if coefficients == "polar_express":
        n = len(POLAR_EXPRESS_COEFFICIENTS)
        return [POLAR_EXPRESS_COEFFICIENTS[j] if j < n else POLAR_EXPRESS_LIMIT
                for j in range(steps)]
    raise ValueError(f"coefficients must be 'muon' or 'polar_express', got {coefficients!r}")


def _iterate(X_wide: Tensor, schedule: list[tuple[float, float, float]]) -> Tensor:
    """J quintic steps on an already normalised wide (..., m, n) tensor, m <= n."""
    # Fused multiply-adds as torch.optim.Muon does, so that the bf16 setting rounds like it.
    if X_wide.ndim == 2:
        X = X_wide
        for a, b, c in schedule:
            A = X @ X.mT  # (m, m) Gram matrix
            B = torch.addmm(A, A, A, beta=b, alpha=c)  # b*A + c*A@A
            X = torch.addmm(X, B, X, beta=a)  # a*X + B@X
        return X
    batch = X_wide.shape[:-2]
    X = X_wide.flatten(0, -3)  # (a reshape to -1 is ambiguous for an empty matrix)
    for a, b, c in schedule:
        A = X @ X.mT  # (batch, m, m)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a)
    return X.reshape(*batch, *X.shape[-2:])


def _positive(d: Tensor) -> Tensor:
    """``d`` where it is > 0, else 1: a zero matrix's denominator (``eps`` = 0, ``gamma_ns`` =
    0) divides its zeros by 1 instead of by 0, which made them NaN; every other one unchanged."""
    return torch.where(d > 0, d, torch.ones_like(d))


def _normalise(Y: Tensor, divide: Callable[[Tensor, Tensor, Tensor | float], Tensor],
               guard: Callable[[Tensor], Tensor], *, sync_free: bool | None = None) -> Tensor:
    """``divide(Y, ||Y||_F, 1.0)`` per matrix, also where the normalisation over- or underflows
    Y's dtype.

    ``guard(||Y||_F)`` is the denominator, or the sum Smooth-NS takes the root of. Where it is
    not finite (float32's Frobenius norm is inf past ~1.8e19, and ``Y / inf`` = 0), below the
    dtype's smallest normal (eps = 0 or float16's rounding of gamma_ns^2 to 0), or where the
    norm is below the root of the smallest normal (its squares were subnormal or 0: a float32
    matrix of entries ~1e-25 has norm 0, and was divided by eps alone, or by 0), the matrix
    goes through ``divide(Y / s, ||Y / s||_F, s)`` with s = max|Y| instead: the same map up to
    rounding, since the normalisations are homogeneous in Y once their constants are divided
    by s. A zero matrix keeps s = 1, which is the plain expression (and ``_positive`` makes its
    zero denominator 1). Every other matrix gets the plain expression, bit for bit. On the CPU
    the rescue is computed only when a matrix needs it; on a device (``sync_free``, the default
    there) both are computed and ``torch.where`` picks, so that nothing waits on the device: a
    few passes over Y against the iteration's products.
    """
    norm = torch.linalg.matrix_norm(Y, keepdim=True)  # Frobenius, (..., 1, 1)
    plain = divide(Y, norm, 1.0)
    if Y.numel() == 0:
        return plain
    tiny = torch.finfo(Y.dtype).tiny
    g = guard(norm)
    rescue = ~torch.isfinite(g) | (g < tiny) | (norm < math.sqrt(tiny))
    if sync_free is None:
        sync_free = Y.device.type != "cpu"
    if not sync_free and not bool(rescue.any()):
        return plain
    # (a zero matrix keeps s = 1: with a huge Smooth-NS constant its guard is inf too, and
    # 0 / 0 would be NaN where the plain expression gives 0)
    largest = Y.abs().amax(dim=(-2, -1), keepdim=True)
    s = torch.where(rescue & (largest > 0), largest, torch.ones_like(norm))
    Ys = Y / s
    return torch.where(rescue, divide(Ys, torch.linalg.matrix_norm(Ys, keepdim=True), s), plain)


def _check_matrix(X: Tensor) -> None:
    if X.ndim < 2:
        raise ValueError(f"Newton-Schulz needs a matrix (..., m, n), got shape {tuple(X.shape)}")


def newton_schulz(
    X: Tensor,
    steps: int = 5,
    *,
    coefficients: Coefficients = "muon",
    eps: float = 1e-7,
) -> Tensor:
    """Approximate polar factor of ``X`` by ``steps`` Newton–Schulz iterations, in X's dtype.

    ``coefficients="muon"``: X / (||X||_F + eps), then the fixed quintic (3.4445, -4.7750, 2.0315).
    ``coefficients="polar_express"``: X / (||X||_F * 1.02 + 1e-6), then the Polar Express schedule.
    Tall inputs are transposed, iterated on the wide orientation and transposed back.
    """
    _check_matrix(X)
    schedule = _schedule(coefficients, steps)
    tall = X.shape[-2] > X.shape[-1]
    Y = X.mT if tall else X
    if coefficients == "polar_express":
        Y = _normalise(Y, lambda y, n, s: y / (n * _POLAR_EXPRESS_SAFETY
                                                 + _POLAR_EXPRESS_EPS / s),
                       lambda n: n * _POLAR_EXPRESS_SAFETY + _POLAR_EXPRESS_EPS)
    else:
        Y = _normalise(Y, lambda y, n, s: y / _positive(n + eps / s), lambda n: n + eps)
    Y = _iterate(Y, schedule)
    return Y.mT if tall else Y


def smooth_newton_schulz(
    X: Tensor,
    steps: int = 5,
    gamma_ns: float = 1e-4,
    *,
    coefficients: Coefficients = "muon",
) -> Tensor:
    """"Smooth-NS" of DP-MuonBC: X / sqrt(gamma_ns^2 + ||X||_F^2), then the same iteration
    (with ``polar_express``, X / (1.02 sqrt(gamma_ns^2 + ||X||_F^2)): its safety factor).

    The normalisation is a smooth function of X everywhere (also at 0), which the bias
    correction's Taylor argument needs; for ||X||_F >> gamma_ns it equals ``newton_schulz``.
    """
    _check_matrix(X)
    schedule = _schedule(coefficients, steps)
    tall = X.shape[-2] > X.shape[-1]
    Y = X.mT if tall else X
    Y = _normalise(Y, lambda y, n, s: y * _positive(n.square()
                                                    + (gamma_ns / s) * (gamma_ns / s)).rsqrt(),
                   lambda n: n.square() + gamma_ns * gamma_ns)
    if coefficients == "polar_express":
        Y = Y / _POLAR_EXPRESS_SAFETY
    Y = _iterate(Y, schedule)
    return Y.mT if tall else Y
