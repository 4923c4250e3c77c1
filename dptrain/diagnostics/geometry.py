"""Geometric diagnostics of clipping and noise for Muon (inner-momentum paper, Eqs. 8-12, 20).

Pure functions on tensors. Every computation runs in float64 on the input's device, whatever
the input dtype; matrices come back as float64 tensors and scalars as Python floats.

Notation (docs/diagnostics.md has the derivations):
    polar(X)         = U V^T from the thin SVD X = U S V^T (zero singular values dropped)
    polar error      = ||polar(X) - polar(Y)||_F / ||polar(Y)||_F        (Eq. 9, Y = reference)
    cosine error     = 1 - <X, Y>_F / (||X||_F ||Y||_F)                  (Eq. 8)
    clipping residual R = (1/m) sum_i (lam_i - lam_bar)(G_i - G_bar)     (Eqs. 10-12)
    eta_R            = ||R||_F / ||lam_bar * G_bar||_F                   (Eq. 20)

A tensor with more than two dims is viewed as the matrix (shape[0], prod(shape[1:])), the
convention Muon uses for conv weights (out, in*kh*kw).

Privacy: these functions compute statistics of whatever they are given. Run on private
records (per-example gradients, unnoised sums, clip factors), their outputs are NOT covered
by a training run's privacy guarantee; see docs/diagnostics.md.
"""

from __future__ import annotations

import math
from typing import Mapping, NamedTuple, Union

import torch
from torch import Tensor

__all__ = [
    "PRIVACY_NOTE",
    "SpectralGap",
    "as_matrix",
    "singular_values",
    "polar",
    "polar_error",
    "cosine_error",
    "clipping_residual",
    "clipped_mean",
    "normalized_residual",
    "gradient_snr",
    "effective_rank",
    "spectral_gap",
    "wedin_threshold",
    "summarize",
]

PRIVACY_NOTE = (
    "Diagnostics are computed outside the private release: any statistic computed here from "
    "private records (per-example gradients, unnoised sums, clip factors) is NOT covered by "
    "the training run's (epsilon, delta) guarantee. Run them on public or held-out probe data, "
    "or account for them separately."
)

# Relative tolerance below which a singular value counts as zero in polar(): the rank
# cutoff of numpy/torch matrix_rank, max(r, c) * eps(float64) * sigma_1.
_EPS64 = torch.finfo(torch.float64).eps


def _require_tensors(**named: object) -> None:
    """A list or an array is refused by name (it raised an AttributeError on ``.dim()``)."""
    for name, x in named.items():
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def as_matrix(X: Tensor) -> Tensor:
    """``X`` as a float64 matrix: 2-D as is, N-D (N > 2) as (shape[0], prod(shape[1:]))."""
    _require_tensors(X=X)
    if X.dim() < 2:
        raise ValueError(f"expected a matrix (>= 2 dims), got a tensor of shape {tuple(X.shape)}")
    X = X.detach().to(torch.float64)
    return X if X.dim() == 2 else X.reshape(X.shape[0], -1)


def _fro(X: Tensor) -> float:
    return float(torch.linalg.vector_norm(X.detach().to(torch.float64)))


def _check_same_shape(X: Tensor, Y: Tensor) -> None:
    _require_tensors(X=X, Y=Y)
    if X.shape != Y.shape:
        raise ValueError(f"shapes differ: {tuple(X.shape)} and {tuple(Y.shape)}")


def _finite(M: Tensor) -> bool:
    return bool(torch.isfinite(M).all())


def singular_values(X: Tensor) -> Tensor:
    """Singular values of ``as_matrix(X)`` in float64, descending, length min(r, c); all NaN
    when X holds a NaN or an infinity (the SVD would fail or return NaN silently)."""
    M = as_matrix(X)
    if not _finite(M):
        return torch.full((min(M.shape),), math.nan, dtype=torch.float64, device=M.device)
    return torch.linalg.svdvals(M)


def polar(X: Tensor) -> Tensor:
    """The polar factor U V^T of ``X`` from an FP64 thin SVD, as a float64 tensor of X's shape.

    This is the matrix Muon's Newton–Schulz iteration approximates. For X of rank k the
    result is the partial isometry U_k V_k^T over the k nonzero singular values (a singular
    value <= max(r, c) * eps64 * sigma_1 counts as zero), which is unique and is also what
    Newton–Schulz produces (an odd polynomial maps a zero singular value to zero).
    So polar(X) has singular values 1 (k times) and 0, and polar(0) = 0. A matrix holding a
    NaN or an infinity has no polar factor: the result is all NaN (not the zero matrix an
    infinite entry's NaN singular values would otherwise give).
    """
    M = as_matrix(X)
    if not _finite(M):
        return torch.full_like(M, math.nan).reshape(X.shape)
    U, S, Vh = torch.linalg.svd(M, full_matrices=False)
    if S.numel() == 0:
        return torch.zeros_like(M).reshape(X.shape)
    tol = max(M.shape) * _EPS64 * S[0]
    keep = (S > tol).to(torch.float64)  # 1 for kept directions, 0 for the null space
    return ((U * keep) @ Vh).reshape(X.shape)


def polar_error(X: Tensor, Y: Tensor) -> float:
    """Eq. 9: ||polar(X) - polar(Y)||_F / ||polar(Y)||_F, with Y the reference.

    Invariant to positive rescaling of either argument. ||polar(Y)||_F = sqrt(rank Y), so for a
    full-rank reference this is the Frobenius distance over sqrt(min(r, c)); it lies in [0, 2]
    when X and Y have the same rank. NaN when the reference is the zero matrix.
    """
    _check_same_shape(X, Y)
    PY = polar(Y)
    denom = _fro(PY)
    if denom == 0.0:
        return math.nan
    return _fro(polar(X) - PY) / denom


def cosine_error(X: Tensor, Y: Tensor) -> float:
    """Eq. 8: 1 - <X, Y>_F / (||X||_F ||Y||_F), in [0, 2]; NaN if either is zero.

    Works on tensors of any (equal) shape, flattened; computed in float64, and clamped to
    [0, 2]: for parallel X and Y the rounding of the norms can leave the quotient an ulp past
    +-1 (-2.2e-16 for X = Y = (3, 0.1, 0.1)).
    """
    _check_same_shape(X, Y)
    x = X.detach().to(torch.float64).reshape(-1)
    y = Y.detach().to(torch.float64).reshape(-1)
    nx, ny = float(torch.linalg.vector_norm(x)), float(torch.linalg.vector_norm(y))
    if nx == 0.0 or ny == 0.0:
        return math.nan
    error = 1.0 - float(torch.dot(x, y)) / (nx * ny)
    return min(max(error, 0.0), 2.0) if math.isfinite(error) else error


def _per_example(G: Tensor, lam: Tensor) -> tuple[Tensor, Tensor]:
    _require_tensors(G=G, lam=lam)
    if G.dim() < 1 or G.shape[0] == 0:
        raise ValueError(f"G must hold m >= 1 per-example tensors G[m, ...], got shape {tuple(G.shape)}")
    if lam.shape != (G.shape[0],):
        raise ValueError(
            f"lam must have shape ({G.shape[0]},) to match G's {G.shape[0]} examples, "
            f"got {tuple(lam.shape)}"
        )
    return G.detach().to(torch.float64), lam.detach().to(device=G.device, dtype=torch.float64)


def clipped_mean(G: Tensor, lam: Tensor) -> Tensor:
    """(1/m) sum_i lam_i G_i in float64: the clipped mean of the per-example tensors G[m, ...]."""
    G, lam = _per_example(G, lam)
    return torch.tensordot(lam, G, dims=1) / G.shape[0]


def clipping_residual(G: Tensor, lam: Tensor) -> tuple[Tensor, float, float]:
    """Clipping residual of per-example tensors ``G[m, ...]`` with clip factors ``lam[m]``.

    Returns ``(R, sigma_lambda, sigma_G)`` (Eqs. 10-12), all from float64 arithmetic:
        R            = (1/m) sum_i (lam_i - lam_bar)(G_i - G_bar)    (float64, shape G.shape[1:])
        sigma_lambda = sqrt((1/m) sum_i (lam_i - lam_bar)^2)          (population std, 1/m)
        sigma_G      = sqrt((1/m) sum_i ||G_i - G_bar||_F^2)
    Proposition 1: (1/m) sum_i lam_i G_i = lam_bar * G_bar + R exactly, and by Cauchy-Schwarz
    ||R||_F <= sigma_lambda * sigma_G. R is the part of the clipped mean that does not point
    along the mean gradient: it vanishes when all lam_i are equal (no clipping, or uniform
    clipping) and when all G_i are equal.
    """
    G, lam = _per_example(G, lam)
    m = G.shape[0]
    dlam = lam - lam.mean()  # [m]
    dG = G - G.mean(dim=0, keepdim=True)  # [m, ...]
    R = torch.tensordot(dlam, dG, dims=1) / m
    sigma_lambda = math.sqrt(float(dlam.square().sum()) / m)
    sigma_G = math.sqrt(float(dG.square().sum()) / m)
    return R, sigma_lambda, sigma_G


def normalized_residual(G: Tensor, lam: Tensor) -> float:
    """Eq. 20: eta_R = ||R||_F / ||lam_bar * G_bar||_F, the residual relative to the aligned part.

    With Proposition 1 the clipped mean is lam_bar * G_bar + R; eta_R measures how far the
    residual can turn it away from the mean gradient's direction (0: clipping only rescales).
    inf when the aligned part is zero and R is not; NaN when both are zero.
    """
    R, _, _ = clipping_residual(G, lam)
    Gd, lamd = _per_example(G, lam)
    aligned = _fro(lamd.mean() * Gd.mean(dim=0))
    r = _fro(R)
    if aligned == 0.0:
        return math.nan if r == 0.0 else math.inf
    return r / aligned


def gradient_snr(G: Tensor, N: Tensor) -> float:
    """||G||_F / ||N||_F: signal (a gradient) over noise (e.g. the release noise); inf if N = 0,
    nan if either holds a NaN or an infinity."""
    _require_tensors(G=G, N=N)
    _check_same_shape(G, N)
    n = _fro(N)
    g = _fro(G)
    if not (math.isfinite(g) and math.isfinite(n)):
        return math.nan
    if n == 0.0:
        return math.nan if g == 0.0 else math.inf
    return g / n


def effective_rank(X: Tensor) -> float:
    """(sum_i sigma_i)^2 / sum_i sigma_i^2, in [1, min(r, c)]; 0.0 for the zero matrix.

    n for a matrix with n equal singular values (e.g. the n x n identity), 1 for rank one.
    """
    s = singular_values(X)
    s2 = float(s.square().sum())
    if s2 == 0.0:
        return 0.0
    return float(s.sum()) ** 2 / s2


class SpectralGap(NamedTuple):
    gap: float
    """sigma_1 - sigma_2 (sigma_2 = 0 for a matrix with one row or one column)."""
    relative: float
    """(sigma_1 - sigma_2) / sigma_1; NaN for the zero matrix."""


def spectral_gap(X: Tensor) -> SpectralGap:
    """The gap between the two largest singular values, absolute and relative to sigma_1."""
    s = singular_values(X)
    s1 = float(s[0]) if s.numel() > 0 else 0.0
    s2 = float(s[1]) if s.numel() > 1 else 0.0
    gap = s1 - s2
    return SpectralGap(gap, gap / s1 if s1 > 0.0 else math.nan)


def _noise_op_norm(noise_multiplier: float, clip_norm: float, shape: tuple[int, int], batch_size: float) -> float:
    rows, cols = shape
    return noise_multiplier * clip_norm * (math.sqrt(rows) + math.sqrt(cols)) / batch_size


def wedin_threshold(X: Tensor, noise_multiplier: float, clip_norm: float) -> int | None:
    """Smallest batch size B with sigma*C*(sqrt(r) + sqrt(c)) / B < sigma_1(X) - sigma_2(X).

    sigma*C*(sqrt(r)+sqrt(c))/B is the typical operator norm of the release noise
    (entries N(0, (sigma*C/B)^2)) on an r x c matrix; by Wedin's theorem the top singular
    subspace of X survives the noise once that norm is below X's spectral gap. X is the clean
    (clipped, noise-free) mean gradient. Returns None when no batch suffices: the gap is 0 or
    within float64 rounding of it (<= max(r, c) * eps64 * sigma_1, polar's rank cutoff; e.g. an
    orthogonal matrix), too small for the ratio to be a finite float, or not a number (X holds
    a NaN or an infinity). Above 2^52 the float ratio has no integer resolution left and its
    ceiling is returned as it is.
    """
    # (NaN or inf returned None, "no batch suffices", instead of an error)
    if isinstance(noise_multiplier, bool) or not (math.isfinite(noise_multiplier)
                                                  and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {noise_multiplier}")
    if isinstance(clip_norm, bool) or not (math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"clip_norm must be finite and > 0, got {clip_norm}")
    M = as_matrix(X)
    s = singular_values(M)
    sigma_1 = float(s[0]) if s.numel() else 0.0
    gap = spectral_gap(M).gap
    if not gap > max(M.shape) * _EPS64 * sigma_1:  # also NaN
        return None
    shape = (M.shape[0], M.shape[1])
    ratio = _noise_op_norm(noise_multiplier, clip_norm, shape, 1.0) / gap
    if not math.isfinite(ratio):
        return None
    B = max(1, math.floor(ratio) + 1)
    if B >= 2 ** 52:  # B - 1 and B are (nearly) the same float: nothing left to settle
        return B
    # Settle float rounding against the defining strict inequality itself.
    while not _noise_op_norm(noise_multiplier, clip_norm, shape, B) < gap:
        B += 1
    while B > 1 and _noise_op_norm(noise_multiplier, clip_norm, shape, B - 1) < gap:
        B -= 1
    return B


def _matrix_stats(X: Tensor) -> dict:
    M = as_matrix(X)
    s = singular_values(M)
    gap = spectral_gap(M)
    return {
        "shape": list(X.shape),
        "frobenius_norm": _fro(M),
        "sigma_1": float(s[0]) if s.numel() else 0.0,
        "spectral_gap": gap.gap,
        "relative_gap": gap.relative,
        "effective_rank": effective_rank(M),
    }


Candidate = Union[Tensor, tuple[Tensor, Tensor]]


def summarize(
    reference: Tensor,
    candidates: Mapping[str, Candidate],
    *,
    noise: Tensor | None = None,
    noise_multiplier: float | None = None,
    clip_norm: float | None = None,
    batch_size: float | None = None,
) -> dict:
    """All diagnostics of one parameter matrix, as a JSON-serialisable dict.

    reference: the matrix the candidates are judged against, e.g. the unclipped mean
        gradient on held-out records.
    candidates: name -> a matrix of the reference's shape, or a pair ``(G, lam)`` of
        per-example tensors G[m, *reference.shape] and clip factors lam[m]; a pair is judged by
        its clipped mean (1/m) sum_i lam_i G_i and also reports the clipping residual
        (Eqs. 10-12, 20).
    noise: a noise matrix of the reference's shape: adds gradient_snr(reference, noise).
    noise_multiplier, clip_norm: add the reference's Wedin threshold; with batch_size also the
        noise operator-norm scale sigma*C*(sqrt(r)+sqrt(c))/B, whether it is below the gap, and
        the expected SNR ||reference||_F / (sigma*C*sqrt(r*c)/B).

    Returns {"privacy_note", "reference": {...}, "candidates": {name: {...}}}. Non-finite
    values are floats (nan/inf); an unreachable Wedin threshold is None.
    """
    ref = as_matrix(reference)
    rows, cols = ref.shape
    ref_stats = _matrix_stats(reference)
    if noise is not None:
        _check_same_shape(noise, reference)
        ref_stats["gradient_snr"] = gradient_snr(reference, noise)
    if noise_multiplier is not None and clip_norm is not None:
        ref_stats["wedin_threshold"] = wedin_threshold(ref, noise_multiplier, clip_norm)
        if batch_size is not None:
            if batch_size <= 0:
                raise ValueError(f"batch_size must be > 0, got {batch_size}")
            op = _noise_op_norm(noise_multiplier, clip_norm, (rows, cols), batch_size)
            ref_stats["noise_op_norm"] = op
            # (a gap within rounding of 0 is none, as for the threshold: with sigma = 0 an
            # orthogonal reference read "no batch suffices" and "recoverable" at once)
            ref_stats["wedin_recoverable"] = (op < ref_stats["spectral_gap"]
                                              and ref_stats["wedin_threshold"] is not None)
            std = noise_multiplier * clip_norm / batch_size
            expected_noise_fro = std * math.sqrt(rows * cols)
            ref_stats["expected_snr"] = (
                ref_stats["frobenius_norm"] / expected_noise_fro if expected_noise_fro > 0 else math.inf
            )

    out_candidates: dict[str, dict] = {}
    for name, cand in candidates.items():
        entry: dict = {}
        if isinstance(cand, (tuple, list)):
            G, lam = cand
            if tuple(G.shape[1:]) != tuple(reference.shape):
                raise ValueError(
                    f"candidate {name!r}: per-example shape {tuple(G.shape[1:])} differs from the "
                    f"reference's {tuple(reference.shape)}"
                )
            X = clipped_mean(G, lam)
            R, sigma_lambda, sigma_G = clipping_residual(G, lam)
            lamd = lam.detach().to(torch.float64)
            entry.update(
                num_examples=int(G.shape[0]),
                mean_lambda=float(lamd.mean()),
                fraction_clipped=float((lamd < 1.0).to(torch.float64).mean()),
                residual_norm=_fro(R),
                sigma_lambda=sigma_lambda,
                sigma_G=sigma_G,
                residual_bound=sigma_lambda * sigma_G,
                eta_R=normalized_residual(G, lam),
            )
        else:
            X = cand
            _check_same_shape(X, reference)
        entry["polar_error"] = polar_error(X, reference)
        entry["cosine_error"] = cosine_error(X, reference)
        entry.update(_matrix_stats(X))
        out_candidates[name] = entry

    return {"privacy_note": PRIVACY_NOTE, "reference": ref_stats, "candidates": out_candidates}
