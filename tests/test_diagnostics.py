"""dptrain.diagnostics: definitions of the inner-momentum paper (Eqs. 8-12, 20), on random shapes."""

import inspect
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dptrain.diagnostics as diagnostics_pkg
from dptrain.diagnostics import (
    PRIVACY_NOTE,
    clipped_mean,
    clipping_residual,
    cosine_error,
    effective_rank,
    gradient_snr,
    normalized_residual,
    plot_spectra,
    polar,
    polar_error,
    singular_values,
    spectral_gap,
    summarize,
    wedin_threshold,
)

FAST = settings(max_examples=40, deadline=None)
dims = st.integers(min_value=1, max_value=7)
seeds = st.integers(min_value=0, max_value=2**31 - 1)


def randn(*shape, seed, dtype=torch.float64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def lam_for(G, C):
    """Clip factors min(1, C / ||G_i||_F) as the trainer computes them."""
    norms = torch.linalg.vector_norm(G.reshape(G.shape[0], -1), dim=1)
    return torch.clamp(C / norms, max=1.0)


# ---- Proposition 1 -------------------------------------------------------------------------


@FAST
@given(m=st.integers(1, 9), r=dims, c=dims, seed=seeds, C=st.floats(0.05, 5.0))
def test_proposition_1_identity_is_exact_and_residual_bounded(m, r, c, seed, C):
    G = randn(m, r, c, seed=seed) * (1 + 3 * torch.rand(m, 1, 1, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64))
    lam = lam_for(G, C)
    R, sigma_lambda, sigma_G = clipping_residual(G, lam)
    assert R.dtype == torch.float64 and R.shape == (r, c)
    direct = (lam[:, None, None] * G).sum(0) / m
    torch.testing.assert_close(lam.mean() * G.mean(0) + R, direct, rtol=0, atol=1e-10)
    torch.testing.assert_close(clipped_mean(G, lam), direct, rtol=0, atol=1e-12)
    assert torch.linalg.vector_norm(R).item() <= sigma_lambda * sigma_G * (1 + 1e-12) + 1e-15
    # The definitions themselves: population (1/m) statistics.
    assert sigma_lambda == pytest.approx(lam.std(unbiased=False).item(), abs=1e-12)
    dG = G - G.mean(0)
    assert sigma_G == pytest.approx(math.sqrt(dG.square().sum().item() / m), rel=1e-12)


@FAST
@given(m=st.integers(1, 9), r=dims, c=dims, seed=seeds, value=st.floats(0.01, 1.0))
def test_residual_vanishes_for_equal_clip_factors(m, r, c, seed, value):
    G = randn(m, r, c, seed=seed)
    R, sigma_lambda, _ = clipping_residual(G, torch.full((m,), value, dtype=torch.float64))
    assert sigma_lambda == pytest.approx(0.0, abs=1e-15)
    assert torch.linalg.vector_norm(R).item() <= 1e-14


def test_single_example_has_zero_residual_and_spread():
    G = randn(1, 3, 4, seed=0)
    R, sigma_lambda, sigma_G = clipping_residual(G, torch.tensor([0.3]))
    assert torch.count_nonzero(R) == 0 and sigma_lambda == 0.0 and sigma_G == 0.0
    assert normalized_residual(G, torch.tensor([0.3])) == 0.0


def test_clipping_residual_computes_in_float64_from_float32_inputs():
    G = randn(5, 4, 3, seed=1, dtype=torch.float32)
    lam = lam_for(G, 1.0)
    R, _, _ = clipping_residual(G, lam)
    R64, _, _ = clipping_residual(G.double(), lam.double())
    assert R.dtype == torch.float64
    torch.testing.assert_close(R, R64, rtol=0, atol=0)


def test_normalized_residual_is_residual_over_aligned_part():
    G = randn(6, 4, 5, seed=2)
    lam = torch.linspace(0.2, 1.0, 6, dtype=torch.float64)
    R, _, _ = clipping_residual(G, lam)
    expected = torch.linalg.vector_norm(R) / torch.linalg.vector_norm(lam.mean() * G.mean(0))
    assert normalized_residual(G, lam) == pytest.approx(expected.item(), rel=1e-12)
    # Scale invariance in G and in lam.
    assert normalized_residual(3 * G, 0.5 * lam) == pytest.approx(expected.item(), rel=1e-12)


def test_clipping_residual_rejects_mismatched_factors():
    with pytest.raises(ValueError, match="lam"):
        clipping_residual(torch.zeros(3, 2, 2), torch.ones(4))
    with pytest.raises(ValueError, match="m >= 1"):
        clipping_residual(torch.zeros(0, 2, 2), torch.ones(0))


# ---- polar factor and errors ---------------------------------------------------------------


@FAST
@given(r=dims, c=dims, seed=seeds)
def test_polar_factor_has_unit_singular_values(r, c, seed):
    X = randn(r, c, seed=seed)
    P = polar(X)
    assert P.dtype == torch.float64 and P.shape == X.shape
    torch.testing.assert_close(torch.linalg.svdvals(P), torch.ones(min(r, c), dtype=torch.float64), rtol=0, atol=1e-10)
    # P is the orthogonal factor of X = P H with H = P^T X symmetric positive semi-definite.
    H = P.T @ X if r >= c else X @ P.T
    torch.testing.assert_close(H, H.T, rtol=0, atol=1e-10)
    assert torch.linalg.eigvalsh(H).min().item() >= -1e-10


@FAST
@given(n=dims, seed=seeds)
def test_polar_of_orthogonal_matrix_is_itself(n, seed):
    Q, _ = torch.linalg.qr(randn(n, n, seed=seed))
    torch.testing.assert_close(polar(Q), Q, rtol=0, atol=1e-12)
    torch.testing.assert_close(polar(Q.float()), Q, rtol=0, atol=1e-6)  # float32 in, float64 out


def test_polar_of_rank_deficient_matrix_is_partial_isometry():
    u, v = randn(5, 1, seed=3), randn(4, 1, seed=4)
    P = polar(u @ v.T)
    expected = (u / u.norm()) @ (v / v.norm()).T
    torch.testing.assert_close(P, expected, rtol=0, atol=1e-12)
    assert torch.count_nonzero(polar(torch.zeros(3, 2))) == 0


def test_polar_views_conv_weights_as_out_by_rest():
    W = randn(4, 2, 3, 3, seed=5)
    torch.testing.assert_close(polar(W).reshape(4, -1), polar(W.reshape(4, -1)), rtol=0, atol=0)


@FAST
@given(r=dims, c=dims, seed=seeds, scale=st.floats(0.01, 100.0))
def test_polar_error_is_zero_under_positive_scaling(r, c, seed, scale):
    X = randn(r, c, seed=seed)
    assert polar_error(2 * X, X) == pytest.approx(0.0, abs=1e-9)
    assert polar_error(scale * X, X) == pytest.approx(0.0, abs=1e-9)


@FAST
@given(r=dims, c=dims, seed=seeds)
def test_polar_error_definition_and_negation(r, c, seed):
    X, Y = randn(r, c, seed=seed), randn(r, c, seed=seed + 7)
    expected = torch.linalg.vector_norm(polar(X) - polar(Y)) / math.sqrt(min(r, c))
    assert polar_error(X, Y) == pytest.approx(expected.item(), rel=1e-12, abs=1e-12)
    assert polar_error(-X, X) == pytest.approx(2.0, abs=1e-9)


def test_polar_error_nan_for_zero_reference_and_shape_check():
    assert math.isnan(polar_error(torch.ones(2, 2), torch.zeros(2, 2)))
    with pytest.raises(ValueError, match="shapes differ"):
        polar_error(torch.ones(2, 3), torch.ones(3, 2))


@FAST
@given(r=dims, c=dims, seed=seeds, scale=st.floats(0.01, 100.0))
def test_cosine_error_scaling_and_negation(r, c, seed, scale):
    X = randn(r, c, seed=seed)
    assert cosine_error(scale * X, X) == pytest.approx(0.0, abs=1e-12)
    assert cosine_error(-X, X) == pytest.approx(2.0, abs=1e-12)
    Y = randn(r, c, seed=seed + 1)
    expected = 1 - (X * Y).sum() / (X.norm() * Y.norm())
    assert cosine_error(X, Y) == pytest.approx(expected.item(), abs=1e-12)


def test_cosine_error_of_parallel_vectors_is_exactly_0_or_2():
    # the norms' rounding left 1 - cos at -2.2e-16 for X = Y (diagnose printed e_cos -2.22e-16)
    # and 2 + 4.4e-16 for X = -Y, outside the documented [0, 2]
    x = torch.tensor([3.0, 0.1, 0.1], dtype=torch.float64)
    assert cosine_error(x, x) == 0.0 and cosine_error(3 * x, x) == 0.0
    y = torch.tensor([0.98, 0.14, 0.29], dtype=torch.float64)
    assert cosine_error(-y, y) == 2.0
    assert math.isnan(cosine_error(torch.tensor([math.inf, 1.0]), torch.tensor([1.0, 1.0])))


def test_cosine_error_of_orthogonal_matrices_is_one():
    assert cosine_error(torch.eye(3), torch.tensor([[0.0, 1, 0], [1, 0, 0], [0, 0, 0]])) == 1.0
    assert math.isnan(cosine_error(torch.zeros(2, 2), torch.eye(2)))


def test_newton_schulz_preserves_the_polar_factor():
    """Proposition 2: polar(NS_J(X)) = polar(X) in float64 (NS maps sigma > 0 to sigma' > 0)."""
    import dptrain.optim.newton_schulz  # noqa: F401  (the module; CONTRACT.md names the function)
    from dptrain.optim import newton_schulz

    if inspect.ismodule(newton_schulz):  # the package does not re-export the function (yet)
        newton_schulz = newton_schulz.newton_schulz
    for seed, shape in enumerate([(6, 4), (4, 6), (5, 5)]):
        X = randn(*shape, seed=seed)
        O = newton_schulz(X, steps=5)
        assert polar_error(O, X) < 1e-10


# ---- spectra -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_effective_rank_of_identity_is_n(n):
    assert effective_rank(torch.eye(n)) == pytest.approx(n, rel=1e-12)


@FAST
@given(r=dims, c=dims, seed=seeds)
def test_effective_rank_of_rank_one_is_one_and_bounded(r, c, seed):
    u, v = randn(r, 1, seed=seed), randn(c, 1, seed=seed + 1)
    assert effective_rank(u @ v.T) == pytest.approx(1.0, rel=1e-9)
    X = randn(r, c, seed=seed + 2)
    assert 1.0 - 1e-12 <= effective_rank(X) <= min(r, c) + 1e-12
    assert effective_rank(torch.zeros(r, c)) == 0.0


def test_spectral_gap_and_relative_gap():
    X = torch.diag(torch.tensor([5.0, 2.0, 1.0]))
    gap = spectral_gap(X)
    assert gap.gap == pytest.approx(3.0) and gap.relative == pytest.approx(0.6)
    assert spectral_gap(torch.tensor([[3.0, 4.0]])) == (5.0, 1.0)  # one singular value: sigma_2 = 0
    assert singular_values(X).tolist() == [5.0, 2.0, 1.0]


def test_wedin_threshold_on_a_diagonal_matrix_by_hand():
    # 4 x 4, singular values (3, 1, 0, 0): gap 2; noise scale sigma*C*(2 + 2)/B.
    X = torch.diag(torch.tensor([3.0, 1.0, 0.0, 0.0]))
    # sigma = C = 1: 4/B < 2 <=> B > 2, so B = 3 (B = 2 gives equality, not below).
    assert wedin_threshold(X, 1.0, 1.0) == 3
    # sigma = 2.5, C = 0.7: 7/B < 2 <=> B > 3.5, so B = 4.
    assert wedin_threshold(X, 2.5, 0.7) == 4
    # 9 x 4 with gap 0.5: (3 + 2) * sigma * C / B < 0.5 with sigma*C = 1.25 <=> B > 12.5.
    Y = torch.zeros(9, 4)
    Y[0, 0], Y[1, 1] = 2.0, 1.5
    assert wedin_threshold(Y, 1.25, 1.0) == 13
    assert wedin_threshold(X, 0.0, 1.0) == 1  # no noise: any batch
    assert wedin_threshold(torch.eye(3), 1.0, 1.0) is None  # zero gap: no batch suffices
    with pytest.raises(ValueError, match="clip_norm"):
        wedin_threshold(X, 1.0, 0.0)


@FAST
@given(r=dims, c=dims, seed=seeds, sigma=st.floats(0.1, 10.0), C=st.floats(0.1, 10.0))
def test_wedin_threshold_is_the_smallest_batch(r, c, seed, sigma, C):
    X = randn(r, c, seed=seed)
    B = wedin_threshold(X, sigma, C)
    gap = spectral_gap(X).gap
    scale = sigma * C * (math.sqrt(r) + math.sqrt(c))
    assert scale / B < gap
    assert B == 1 or not scale / (B - 1) < gap


def test_gradient_snr():
    assert gradient_snr(torch.full((2, 2), 3.0), torch.full((2, 2), 1.5)) == pytest.approx(2.0)
    assert gradient_snr(torch.ones(2), torch.zeros(2)) == math.inf


# ---- summary and plot ----------------------------------------------------------------------


def test_summarize_reports_every_diagnostic_as_json():
    ref = randn(6, 4, seed=10)
    G = ref + 0.5 * randn(8, 6, 4, seed=11)
    lam = lam_for(G, 2.0)
    out = summarize(
        ref,
        {"clipped": (G, lam), "noisy": ref + 0.1 * randn(6, 4, seed=12)},
        noise=randn(6, 4, seed=13),
        noise_multiplier=1.0,
        clip_norm=2.0,
        batch_size=64,
    )
    json.dumps(out)  # serialisable
    assert out["privacy_note"] == PRIVACY_NOTE and "NOT covered" in PRIVACY_NOTE
    r = out["reference"]
    assert r["wedin_threshold"] == wedin_threshold(ref, 1.0, 2.0)
    assert r["effective_rank"] == pytest.approx(effective_rank(ref))
    assert r["gradient_snr"] == pytest.approx(gradient_snr(ref, randn(6, 4, seed=13)))
    assert r["wedin_recoverable"] == (64 >= r["wedin_threshold"])
    c = out["candidates"]["clipped"]
    X = clipped_mean(G, lam)
    assert c["polar_error"] == pytest.approx(polar_error(X, ref))
    assert c["cosine_error"] == pytest.approx(cosine_error(X, ref))
    assert c["eta_R"] == pytest.approx(normalized_residual(G, lam))
    assert c["residual_norm"] <= c["residual_bound"] + 1e-12
    assert "eta_R" not in out["candidates"]["noisy"]
    with pytest.raises(ValueError, match="shape"):
        summarize(ref, {"bad": torch.zeros(4, 6)})


def test_plot_spectra_writes_a_png(tmp_path):
    path = plot_spectra(
        {"reference": randn(8, 5, seed=20), "rank one": randn(8, 1, seed=21) @ randn(1, 5, seed=22)},
        tmp_path / "sub" / "spectra.png",
    )
    data = path.read_bytes()
    assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def _np_polar(X: torch.Tensor, rank: int) -> np.ndarray:
    """U_k V_k^T over the ``rank`` largest singular values, by numpy's SVD."""
    U, _, Vh = np.linalg.svd(X.double().numpy(), full_matrices=False)
    return U[:, :rank] @ Vh[:rank]


# ---- polar(): the documented rank cutoff and scale invariance ------------------------------


def test_polar_rank_cutoff_is_max_dim_times_eps_times_sigma1():
    """polar() drops a singular value <= max(r, c) * eps64 * sigma_1 (numpy's matrix_rank
    cutoff): on a 2 x 10 matrix with singular values (1, 1.2e-15) the second one lies between
    min(r, c) * eps * sigma_1 = 4.4e-16 and max(r, c) * eps * sigma_1 = 2.2e-15, so it is zero."""
    eps = np.finfo(np.float64).eps
    X = torch.zeros(2, 10, dtype=torch.float64)
    X[0, 0], X[1, 1] = 1.0, 1.2e-15
    assert 2 * eps < 1.2e-15 < 10 * eps  # the case the test is about
    expected = torch.zeros(2, 10, dtype=torch.float64)
    expected[0, 0] = 1.0
    torch.testing.assert_close(polar(X), expected, rtol=0, atol=1e-12)
    assert np.linalg.matrix_rank(X.numpy()) == 1  # the same cutoff as numpy
    # well above the cutoff the direction is kept
    X[1, 1] = 1e-12
    expected[1, 1] = 1.0
    torch.testing.assert_close(polar(X), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("scale", [1e-20, 1e-12, 1e12])
def test_polar_is_invariant_to_the_scale_of_tiny_and_huge_matrices(scale):
    """The cutoff is relative to sigma_1: a gradient of tiny norm keeps its polar factor."""
    X = randn(5, 3, seed=30)
    torch.testing.assert_close(polar(scale * X), torch.from_numpy(_np_polar(X, 3)), rtol=0, atol=1e-10)
    assert polar_error(scale * X, X) == pytest.approx(0.0, abs=1e-9)


# ---- polar error against a rank-deficient reference (the c_proj case) ----------------------


def test_polar_error_against_rank_one_reference_by_svd():
    """Eq. 9 with a rank-1 reference Y and a full-rank X: ||polar(X) - polar(Y)||_F over
    ||polar(Y)||_F = 1 (not over sqrt(min(r, c)), nor over ||polar(X)||_F = 2)."""
    u, v = randn(5, 1, seed=31), randn(4, 1, seed=32)
    Y = u @ v.T
    X = Y + randn(5, 4, seed=33)
    PX, PY = _np_polar(X, 4), (u / u.norm()).numpy() @ (v / v.norm()).numpy().T
    expected = np.linalg.norm(PX - PY) / np.linalg.norm(PY)
    assert np.linalg.norm(PY) == pytest.approx(1.0)
    assert polar_error(X, Y) == pytest.approx(expected, rel=1e-10)
    # summarize judges the candidate against the reference in the same direction
    out = summarize(Y, {"noisy": X})
    assert out["candidates"]["noisy"]["polar_error"] == pytest.approx(expected, rel=1e-10)
    # and the other way round the reference has rank 4: ||polar(X)||_F = 2
    assert polar_error(Y, X) == pytest.approx(expected / 2, rel=1e-10)


# ---- degenerate cases of eta_R and the SNR -------------------------------------------------


def test_normalized_residual_with_zero_mean_gradient():
    """Mean gradient 0: the aligned part lam_bar * G_bar is 0. eta_R is inf when R != 0
    (unequal clip factors) and NaN when R = 0 too (equal clip factors)."""
    A = randn(3, 4, seed=34)
    G = torch.stack([A, -A])
    # R = (1/2) [(1 - 0.75) A + (0.5 - 0.75)(-A)] = A / 4 != 0
    assert normalized_residual(G, torch.tensor([1.0, 0.5], dtype=torch.float64)) == math.inf
    assert math.isnan(normalized_residual(G, torch.tensor([0.5, 0.5], dtype=torch.float64)))


def test_gradient_snr_of_zero_signal_and_zero_noise_is_nan():
    assert math.isnan(gradient_snr(torch.zeros(2, 2), torch.zeros(2, 2)))
    assert gradient_snr(torch.zeros(2, 2), torch.ones(2, 2)) == 0.0


def test_gradient_snr_refuses_other_shapes_and_gives_nan_for_non_finite_entries():
    # as every other function: a (4, 3) gradient against (3, 4) noise is a mistake, not 1.0
    with pytest.raises(ValueError, match="shapes differ"):
        gradient_snr(torch.ones(4, 3), torch.ones(3, 4))
    for bad in (math.inf, -math.inf, math.nan):
        X = torch.ones(3, 3)
        X[1, 2] = bad
        assert math.isnan(gradient_snr(X, torch.ones(3, 3)))  # was inf (or nan for NaN)
        assert math.isnan(gradient_snr(torch.ones(3, 3), X))  # was 0.0


# ---- summarize(): the per-candidate fields by hand -----------------------------------------


def test_summarize_pair_candidate_fields_by_hand():
    """num_examples, mean_lambda, fraction_clipped (lam < 1 only: lam = 1 is not clipped),
    residual_bound = sigma_lambda * sigma_G, and sigma_1 of reference and candidate."""
    m = 5
    G = randn(m, 3, 4, seed=35)
    lam = torch.tensor([1.0, 0.5, 1.0, 0.25, 0.75], dtype=torch.float64)
    ref = G.mean(0)
    out = summarize(ref, {"clipped": (G, lam)})
    c = out["candidates"]["clipped"]
    assert c["num_examples"] == 5
    assert c["mean_lambda"] == pytest.approx(3.5 / 5)
    assert c["fraction_clipped"] == pytest.approx(3 / 5)
    lam_np, G_np = lam.numpy(), G.numpy()
    sigma_lambda = math.sqrt(((lam_np - lam_np.mean()) ** 2).mean())
    sigma_G = math.sqrt(((G_np - G_np.mean(0)) ** 2).sum() / m)
    assert c["sigma_lambda"] == pytest.approx(sigma_lambda, rel=1e-12)
    assert c["sigma_G"] == pytest.approx(sigma_G, rel=1e-12)
    assert c["residual_bound"] == pytest.approx(sigma_lambda * sigma_G, rel=1e-12)
    X = (lam_np[:, None, None] * G_np).sum(0) / m
    assert c["sigma_1"] == pytest.approx(np.linalg.svd(X, compute_uv=False)[0], rel=1e-12)
    assert out["reference"]["sigma_1"] == pytest.approx(
        np.linalg.svd(ref.numpy(), compute_uv=False)[0], rel=1e-12)


def test_a_gap_within_rounding_is_not_recoverable_without_noise_either():
    # sigma = 0 and an orthogonal reference (its gap is rounding): "no batch suffices" and
    # "recoverable" were said together
    Q, _ = torch.linalg.qr(torch.randn(5, 5, generator=torch.Generator().manual_seed(1),
                                       dtype=torch.float64))
    # (the gap is exactly 0 with MKL's AVX-512 SVD, a few ulps elsewhere; a few ulps set by
    # hand below, so the strictly positive case is checked on every machine)
    D = torch.diag(torch.tensor([1.0, 1.0 - 2.0 ** -51, 0.5, 0.25, 0.125], dtype=torch.float64))
    for X in (Q, D):
        r = summarize(X, {}, noise_multiplier=0.0, clip_norm=1.0, batch_size=1)["reference"]
        assert 0 <= r["spectral_gap"] < 1e-13 and r["wedin_threshold"] is None
        assert r["wedin_recoverable"] is False
    assert r["spectral_gap"] > 0
    D = torch.diag(torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    r = summarize(D, {}, noise_multiplier=0.0, clip_norm=1.0, batch_size=1)["reference"]
    assert r["wedin_threshold"] == 1 and r["wedin_recoverable"] is True


def test_summarize_wedin_recoverable_is_strict_at_equality():
    """diag(3, 1, 0, 0), sigma = C = 1: noise scale (2 + 2)/B equals the gap 2 at B = 2, which
    is not below it (the Wedin condition is strict); B = 3 is."""
    X = torch.diag(torch.tensor([3.0, 1.0, 0.0, 0.0], dtype=torch.float64))
    at2 = summarize(X, {}, noise_multiplier=1.0, clip_norm=1.0, batch_size=2)["reference"]
    assert at2["noise_op_norm"] == 2.0 and at2["spectral_gap"] == 2.0
    assert at2["wedin_recoverable"] is False and at2["wedin_threshold"] == 3
    at3 = summarize(X, {}, noise_multiplier=1.0, clip_norm=1.0, batch_size=3)["reference"]
    assert at3["wedin_recoverable"] is True
    # expected SNR: ||X||_F / (sigma*C/B * sqrt(r*c)) = sqrt(10) / (1/2 * 4)
    assert at2["expected_snr"] == pytest.approx(math.sqrt(10) / 2.0)


# ---- plot data and package exports ---------------------------------------------------------


def _captured_axes(monkeypatch, tmp_path, named, **kwargs):
    import dptrain.diagnostics.plotting as plotting

    seen = {}
    real_save = plotting._save

    def save(fig, path):
        seen["fig"] = fig
        return real_save(fig, path)

    monkeypatch.setattr(plotting, "_save", save)
    plot_spectra(named, tmp_path / "s.png", **kwargs)
    return seen["fig"].axes[0]


def test_plot_spectra_draws_normalised_singular_values_from_index_1(monkeypatch, tmp_path):
    X = torch.diag(torch.tensor([4.0, 2.0, 1.0], dtype=torch.float64))
    ax = _captured_axes(monkeypatch, tmp_path, {"d": X})
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [1, 2, 3]
    assert list(line.get_ydata()) == pytest.approx([1.0, 0.5, 0.25])
    assert line.get_label() == "d"
    ax = _captured_axes(monkeypatch, tmp_path, {"d": X}, normalize=False)
    assert list(ax.get_lines()[0].get_ydata()) == pytest.approx([4.0, 2.0, 1.0])


def test_plot_spectra_leaves_out_what_polar_counts_as_zero(monkeypatch, tmp_path, recwarn):
    # an exactly rank-1 gradient (c_proj's before a LayerNorm): its rounding noise at 1e-17
    # stretched the log axis over 17 decades (diagnose audit); polar() treats it as zero
    v = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    rank1 = torch.outer(v, v)
    assert float(singular_values(rank1)[1]) > 0  # (the SVD's rounding, not an exact zero)
    ax = _captured_axes(monkeypatch, tmp_path, {"r": rank1, "z": torch.zeros(3, 3),
                                                "n": torch.full((2, 2), math.nan)})
    r, z, n = ax.get_lines()
    ys = list(r.get_ydata())
    assert ys[0] == pytest.approx(1.0) and all(math.isnan(y) for y in ys[1:])
    assert z.get_label() == "z (zero)" and n.get_label() == "n (not finite)"
    assert all(math.isnan(y) for y in z.get_ydata())
    lo, _ = ax.get_ylim()
    assert lo > 1e-3  # the axis spans the drawn values, not the rounding
    assert not [w for w in recwarn if "log-scaled" in str(w.message)]


def test_package_exports_every_geometry_function():
    from dptrain.diagnostics import geometry

    assert set(diagnostics_pkg.__all__) == set(geometry.__all__) | {"plot_spectra"}
    for name in geometry.__all__:
        assert getattr(diagnostics_pkg, name) is getattr(geometry, name), name


# ---- wedin_threshold: float rounding settled against the strict inequality ----------------


@pytest.mark.parametrize("x, gap, expected", [
    # x / gap rounds UP to the integer 19 (truly just below it): floor(x/gap) + 1 = 20, but
    # x / 19 < gap already holds, so the smallest B is 19
    (18.468485381604676, 0.9720255464002462, 19),
    # x / gap rounds DOWN below 23: floor(x/gap) + 1 = 23, but x / 23 < gap fails, so B = 24
    (11.589738792772655, 0.5039016866422894, 24),
])
def test_wedin_threshold_is_exact_where_floor_of_the_ratio_is_off_by_one(x, gap, expected):
    """1 x 1 matrix [[gap]]: sigma_1 - sigma_2 = gap and sigma*C*(sqrt(1) + sqrt(1)) = x with
    sigma = x/2, C = 1 (exact in float)."""
    X = torch.tensor([[gap]], dtype=torch.float64)
    sigma = x / 2
    # the definition, by hand: smallest B with sigma*C*2/B < gap
    B = 1
    while not sigma * 1.0 * 2.0 / B < gap:
        B += 1
    assert B == expected
    assert wedin_threshold(X, sigma, 1.0) == expected


# ---- degenerate spectra and non-finite entries ---------------------------------------------


@pytest.mark.parametrize("X", [
    1e-30 * torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64)),  # ratio ~ 1e30
    torch.diag(torch.tensor([1e-300, 0.0], dtype=torch.float64)),  # gap 1e-300: ratio ~ 1e300
])
def test_wedin_threshold_of_a_tiny_gap_returns_without_settling_forever(X):
    """B - 1 and B are the same float above 2^53: the settling loops used never to end."""
    B = wedin_threshold(X, 1.0, 1.0)
    gap = float(X[0, 0] - X[1, 1])
    assert isinstance(B, int) and B >= 2 ** 52
    assert B == pytest.approx(2 * math.sqrt(2) / gap, rel=1e-12)


def test_wedin_threshold_none_for_a_rounding_level_or_unrepresentable_gap():
    Q, _ = torch.linalg.qr(torch.randn(50, 50, dtype=torch.float64,
                                       generator=torch.Generator().manual_seed(0)))
    # an orthogonal matrix: a gap of rounding noise (exactly 0 with MKL's AVX-512 SVD, which
    # returns every singular value as 1.0; 1e-15 or so elsewhere)
    assert 0 <= spectral_gap(Q).gap < 1e-13
    assert wedin_threshold(Q, 1.0, 1.0) is None
    # a gap of a few ulps set by hand, strictly positive whatever the LAPACK: rounding too
    # (max(r, c) * eps64 * sigma_1 = 3 * 2.2e-16 here)
    D = torch.diag(torch.tensor([1.0, 1.0 - 2.0 ** -51, 0.5], dtype=torch.float64))
    assert 0 < spectral_gap(D).gap < 1e-15
    assert wedin_threshold(D, 1.0, 1.0) is None
    # a subnormal gap: sigma*C*(sqrt(r)+sqrt(c)) / gap overflows to inf (was an OverflowError)
    sub = torch.diag(torch.tensor([1e-310, 0.0], dtype=torch.float64))
    assert wedin_threshold(sub, 1.0, 1.0) is None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_entries_give_nan_not_an_exception_or_a_zero_polar_factor(bad):
    X = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    Y = X.clone()
    Y[2, 1] = bad
    assert torch.isnan(polar(Y)).all() and polar(Y).shape == Y.shape
    assert torch.isnan(singular_values(Y)).all() and singular_values(Y).shape == (4,)
    assert math.isnan(polar_error(Y, X)) and math.isnan(polar_error(X, Y))
    assert math.isnan(effective_rank(Y)) and math.isnan(spectral_gap(Y).gap)
    assert wedin_threshold(Y, 1.0, 1.0) is None
    out = summarize(X, {"bad": Y}, noise_multiplier=1.0, clip_norm=1.0, batch_size=8)
    cand = out["candidates"]["bad"]
    assert math.isnan(cand["polar_error"]) and math.isnan(cand["sigma_1"])
    json.dumps(out)  # NaN is still a JSON float (as other degenerate values are)
    # the finite reference is unaffected
    assert out["reference"]["wedin_threshold"] == wedin_threshold(X, 1.0, 1.0)


def test_effective_rank_of_an_uneven_spectrum_by_hand():
    # (sum s)^2 / sum s^2: s = (3, 1) gives 16 / 10 (a mutant's nuclear / spectral norm, 4 / 3,
    # passed: the spectra tested before were flat)
    from dptrain.diagnostics.geometry import effective_rank

    assert effective_rank(torch.diag(torch.tensor([3.0, 1.0]))) == pytest.approx(1.6, rel=1e-12)
    X = torch.diag(torch.tensor([4.0, 2.0, 1.0, 1.0]))
    assert effective_rank(X) == pytest.approx(64 / 22, rel=1e-12)


# ---- low-precision inputs (mutation pass 2) -------------------------------------------------


def test_cosine_error_of_bfloat16_inputs_is_computed_in_float64():
    """bf16 gradients: the inner product and both norms in float64 (of the bf16 values), not in
    bf16 or float32, whose rounding is larger than a small cosine error itself."""
    X = randn(32, 48, seed=21).to(torch.bfloat16)
    Y = (X.double() + 1e-2 * randn(32, 48, seed=22)).to(torch.bfloat16)
    x, y = X.double().numpy().ravel(), Y.double().numpy().ravel()
    expected = 1.0 - float(x @ y) / (float(np.linalg.norm(x)) * float(np.linalg.norm(y)))
    assert 1e-6 < expected < 1e-3
    assert cosine_error(X, Y) == pytest.approx(expected, rel=1e-9, abs=1e-15)


def test_clipped_mean_keeps_clip_factors_in_float64_for_bfloat16_gradients():
    """lam is not rounded to the gradients' dtype: (1/m) sum_i lam_i G_i of the bf16 values
    with the float64 factors, against a numpy loop."""
    G = randn(5, 3, 4, seed=23).to(torch.bfloat16)
    lam = torch.tensor([1.0, 1 / 3, 0.123456789, 0.7071067811865476, 0.01], dtype=torch.float64)
    expected = sum(float(lam[i]) * G[i].double().numpy() for i in range(5)) / 5
    got = clipped_mean(G, lam)
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-15)
    R, s_lam, _ = clipping_residual(G, lam)
    l = lam.numpy()
    assert s_lam == pytest.approx(float(np.sqrt(((l - l.mean()) ** 2).mean())), rel=1e-12)
    Gd = G.double().numpy()
    R_ref = np.einsum("i,ijk->jk", l - l.mean(), Gd - Gd.mean(0)) / 5
    np.testing.assert_allclose(R.numpy(), R_ref, rtol=1e-12, atol=1e-15)


def test_singular_values_and_polar_of_an_ill_conditioned_matrix_are_float64():
    """The SVD runs in float64 whatever the input: a float32 SVD of a condition-1e9 matrix
    gets its small singular value wrong (and its polar factor's direction with it)."""
    U, _ = torch.linalg.qr(randn(6, 6, seed=24))
    V, _ = torch.linalg.qr(randn(4, 4, seed=25))
    s = torch.tensor([1.0, 1e-3, 1e-6, 1e-9], dtype=torch.float64)
    X = U[:, :4] @ torch.diag(s) @ V.T
    np.testing.assert_allclose(singular_values(X).numpy(), s.numpy(), rtol=1e-5)
    assert torch.allclose(polar(X), U[:, :4] @ V.T, atol=1e-6)
    ref = np.linalg.svd(X.numpy(), compute_uv=False)
    assert effective_rank(X) == pytest.approx(ref.sum() ** 2 / (ref ** 2).sum(), rel=1e-12)


def test_summarize_refuses_a_zero_batch_size():
    ref = randn(3, 4, seed=26)
    with pytest.raises(ValueError, match="batch_size"):
        summarize(ref, {}, noise_multiplier=1.0, clip_norm=1.0, batch_size=0)


def test_plot_spectra_labels_its_axes_by_normalisation(monkeypatch, tmp_path):
    X = torch.diag(torch.tensor([4.0, 2.0], dtype=torch.float64))
    assert _captured_axes(monkeypatch, tmp_path, {"d": X}).get_ylabel() == "sigma_i / sigma_1"
    ax = _captured_axes(monkeypatch, tmp_path, {"d": X}, normalize=False)
    assert ax.get_ylabel() == "sigma_i" and ax.get_xlabel() == "index i"


def test_plot_spectra_format_follows_an_upper_case_suffix(tmp_path):
    X = torch.diag(torch.tensor([4.0, 2.0], dtype=torch.float64))
    assert plot_spectra({"d": X}, tmp_path / "s.PDF").read_bytes().startswith(b"%PDF")
    assert b"<svg" in plot_spectra({"d": X}, tmp_path / "s.Svg").read_bytes()[:400]
