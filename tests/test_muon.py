"""DP-Muon against torch.optim.Muon and Eq. 7; DP-MuonBC's bias correction; DP-Muon-S."""

import math

import numpy as np
import pytest
import torch

from dptrain.optim import Muon, MuonBC, MuonS
from dptrain.optim.muon import heat_bias_correction, top_singular_value, probe_seed
from dptrain.optim.newton_schulz import MUON_COEFFICIENTS, newton_schulz, smooth_newton_schulz

LR, MU = 0.01, 0.95


def _grads(shape, num_steps, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=gen, dtype=dtype) for _ in range(num_steps)]


# --- DP-Muon vs torch.optim.Muon (noise 0, no clipping: the release is the gradient) ---------

def _run_pair(shape, grads, mine_kwargs):
    W0 = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    Wt, Wm = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(W0.clone())
    ref = torch.optim.Muon([Wt], lr=LR, weight_decay=0.0, momentum=MU, nesterov=True,
                           adjust_lr_fn="match_rms_adamw")
    mine = Muon([Wm], lr=LR, momentum=MU, nesterov=True, scale="match_rms_adamw", **mine_kwargs)
    for G in grads:
        before_t, before_m = Wt.detach().clone(), Wm.detach().clone()
        Wt.grad, Wm.grad = G.clone(), G.clone()
        ref.step()
        mine.step()
        yield Wt.detach() - before_t, Wm.detach() - before_m, Wt.detach(), Wm.detach()


@pytest.mark.parametrize("shape", [(16, 32), (32, 16), (24, 24)])
def test_ema_momentum_in_bf16_is_torch_muon_bit_for_bit(shape):
    """Same momentum convention (buf.lerp_(grad, 1 - mu)) and bf16 NS: identical parameters.
    A square matrix is iterated as it is, not transposed (torch transposes only m > n; the
    transpose's polar factor is the same, its bf16 rounding is not)."""
    for _, _, Wt, Wm in _run_pair(shape, _grads(shape, 5), dict(ns_dtype="bfloat16",
                                                               momentum_style="ema")):
        assert torch.equal(Wt, Wm)


@pytest.mark.parametrize("shape", [(16, 32), (32, 16)])
def test_eq7_momentum_in_bf16_matches_torch_muon_at_bf16_tolerance(shape):
    """Eq. 7's accumulated momentum is torch's EMA times 1/(1-mu); NS's normalisation removes
    the factor, so the steps agree up to bf16 rounding (~2^-8 relative)."""
    for dWt, dWm, _, _ in _run_pair(shape, _grads(shape, 6), dict(ns_dtype="bfloat16")):
        rel = torch.linalg.norm(dWt - dWm) / torch.linalg.norm(dWt)
        assert rel < 3e-2, rel.item()


def _ns_reference(X, steps=5, eps=1e-7):
    a, b, c = MUON_COEFFICIENTS
    tall = X.shape[0] > X.shape[1]
    Y = X.T if tall else X
    Y = Y / (torch.linalg.norm(Y) + eps)
    for _ in range(steps):
        G = Y @ Y.T
        Y = a * Y + b * (G @ Y) + c * (G @ G @ Y)
    return Y.T if tall else Y


@pytest.mark.parametrize("shape,scale,nesterov,weight_decay", [
    ((12, 20), "match_rms_adamw", True, 0.0),
    ((20, 12), "original", True, 0.1),
    ((12, 20), "original", False, 0.0),  # wide: s = 1, not sqrt(12/20)
    ((6, 3, 3, 3), "match_rms_adamw", False, 0.0),  # conv weight -> (6, 27)
    ((27, 4, 1, 1), "original", True, 0.0),  # 1x1 conv, tall -> (27, 4)
])
def test_float64_muon_is_eq7_exactly(shape, scale, nesterov, weight_decay):
    """An independent transcription of Eq. 7 in float64 (accumulated momentum, Nesterov)."""
    grads = _grads(shape, 5, dtype=torch.float64)
    W0 = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    W = torch.nn.Parameter(W0.clone())
    opt = Muon([W], lr=LR, momentum=MU, nesterov=nesterov, ns_dtype="float64", scale=scale,
               weight_decay=weight_decay)
    W_ref, M = W0.clone(), torch.zeros(shape, dtype=torch.float64)
    r, c = shape[0], math.prod(shape[1:])
    s = 0.2 * math.sqrt(max(r, c)) if scale == "match_rms_adamw" else math.sqrt(max(1, r / c))
    for G in grads:
        M = MU * M + G
        N = G + MU * M if nesterov else M
        O = _ns_reference(N.reshape(r, c)).reshape(shape)
        W_ref = W_ref * (1 - LR * weight_decay) - LR * s * O
        W.grad = G.clone()
        opt.step()
        torch.testing.assert_close(W.detach(), W_ref, rtol=1e-12, atol=1e-12)


def test_muon_refuses_vectors_and_names_them():
    with pytest.raises(ValueError, match="bias"):
        Muon([("w", torch.nn.Parameter(torch.ones(3, 3))),
              ("bias", torch.nn.Parameter(torch.ones(3)))])


# --- DP-MuonBC ------------------------------------------------------------------------------

def _gauss_hermite(n=4):
    """Nodes/weights of E f(Z), Z ~ N(0, 1): exact for polynomials of degree < 2n."""
    z, w = np.polynomial.hermite_e.hermegauss(n)
    return torch.tensor(z), torch.tensor(w / w.sum())


@pytest.mark.parametrize("kappa", [0.5, 1.0, 2.0])
def test_bias_correction_with_lambda_1_is_exact_for_quadratics(kappa):
    """F(x) = x^2, input a + nu*Z. E F = a^2 + nu^2; the antithetic probe's second difference
    is kappa^2 nu^2 E^2, mean kappa^2 nu^2, so Q_BC's mean is a^2 + (1 - lambda) nu^2:
    exact at lambda = 1 for every kappa. Expectations by Gauss-Hermite quadrature (exact here)."""
    a = torch.tensor([0.3, -1.7, 2.0], dtype=torch.float64)
    nu = 0.8
    z, w = _gauss_hermite()
    F = lambda X: X.square()  # noqa: E731 - elementwise quadratic, batch-friendly
    for lam, expected in [(1.0, a.square()), (1.25, a.square() - 0.25 * nu**2)]:
        mean_raw = torch.zeros_like(a)
        mean_bc = torch.zeros_like(a)
        for zi, wi in zip(z, w):  # the release's noise
            A = a + nu * zi
            mean_raw += wi * F(A)
            for ej, wj in zip(z, w):  # the public probe
                E = torch.full((1, *a.shape), float(ej), dtype=torch.float64)
                mean_bc += wi * wj * heat_bias_correction(F, A, nu, E, lam=lam, kappa=kappa)
        torch.testing.assert_close(mean_raw, a.square() + nu**2, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(mean_bc, expected, rtol=1e-12, atol=1e-12)


def test_bias_correction_brings_the_monte_carlo_mean_of_ns_closer_to_q_of_a():
    gen = torch.Generator().manual_seed(0)
    r, c, n, nu = 6, 10, 2000, 0.05
    U, _ = torch.linalg.qr(torch.randn(r, r, dtype=torch.float64, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(c, r, dtype=torch.float64, generator=gen))
    A = U @ torch.diag(torch.tensor([3.0, 2.0, 1.5, 1.0, 0.6, 0.3], dtype=torch.float64)) @ V.T

    def Q(X):
        return smooth_newton_schulz(X, 5, 1e-4)

    X = A + nu * torch.randn(n, r, c, dtype=torch.float64, generator=gen)  # noisy inputs
    E = torch.randn(n, r, c, dtype=torch.float64, generator=gen)  # one probe pair per draw
    raw = Q(X)
    h, lam, kappa = 2.0 * nu, 1.25, 2.0
    Qx = Q(torch.cat([X, X + h * E, X - h * E]))
    bc = Qx[:n] - lam / kappa**2 * (0.5 * (Qx[n:2 * n] + Qx[2 * n:]) - Qx[:n])
    # same formula as the optimizer's, per draw:
    torch.testing.assert_close(bc[0], heat_bias_correction(Q, X[0], nu, E[:1], lam=lam,
                                                           kappa=kappa))
    err_raw = torch.linalg.norm(raw.mean(0) - Q(A))
    err_bc = torch.linalg.norm(bc.mean(0) - Q(A))
    assert err_bc < 0.8 * err_raw, (err_bc.item(), err_raw.item())


def test_muon_bc_nu_follows_momentum_and_probes_are_public_and_replayable():
    W0 = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    grads = _grads((8, 12), 3)

    def run(global_seed, seed=7):
        torch.manual_seed(global_seed)  # must not matter: probes have their own generator
        W = torch.nn.Parameter(W0.clone())
        opt = MuonBC([("w", W)], lr=LR, release_noise_std=0.1, seed=seed)
        for G in grads:
            W.grad = G.clone()
            opt.step()
        return W.detach(), opt

    W_a, opt = run(0)
    W_b, _ = run(123)
    W_c, _ = run(0, seed=8)
    assert torch.equal(W_a, W_b)
    assert not torch.equal(W_a, W_c)
    assert opt.input_noise_std(opt.param_groups[0]) == pytest.approx(0.1 * (1 + 0.95))
    ema = MuonBC([torch.nn.Parameter(W0.clone())], release_noise_std=0.1, seed=0,
                 momentum_style="ema")
    assert ema.input_noise_std(ema.param_groups[0]) == pytest.approx(0.1 * 0.05 * 1.95)


@pytest.mark.parametrize("style,nesterov", [("accumulate", True), ("accumulate", False),
                                            ("ema", True), ("ema", False)])
def test_muon_bc_nu_is_the_release_noise_times_the_filter_gain_times_g_s_weight_in_n(style,
                                                                                    nesterov):
    mu, std, gain = 0.9, 0.1, 0.3
    opt = MuonBC([torch.nn.Parameter(torch.zeros(3, 4))], release_noise_std=std, seed=0,
                 momentum=mu, nesterov=nesterov, momentum_style=style)
    group = opt.param_groups[0]
    fresh = 1.0 if style == "accumulate" else 1 - mu  # G_t's weight in M_t
    weight = fresh * (1 + mu) if nesterov else fresh  # ... and in N_t
    assert opt.input_noise_std(group) == pytest.approx(std * weight)
    group["noise_gain"] = gain  # a filter's gain, set by the optimizer wrapper every step
    assert opt.input_noise_std(group) == pytest.approx(std * gain * weight)


def test_muon_bc_steps_are_eq7_with_q_bc_and_fresh_probes_per_step_and_parameter():
    # the probes of step t for parameter p: randn from torch.Generator seeded by
    # probe_seed("muon_bc_probe", seed, t, p) (docs/optim.md), in float32
    seed, std, lam, kappa, gamma, probes = 5, 0.2, 1.25, 2.0, 1e-4, 2
    gen = torch.Generator().manual_seed(0)
    W0 = {n: torch.randn(6, 10, dtype=torch.float64, generator=gen) for n in ("a", "b")}
    grads = [{n: torch.randn(6, 10, dtype=torch.float64, generator=gen) for n in W0}
             for _ in range(3)]
    params = {n: torch.nn.Parameter(w.clone()) for n, w in W0.items()}
    opt = MuonBC(list(params.items()), lr=LR, release_noise_std=std, seed=seed, momentum=MU,
                 ns_dtype="float64", bc_probes=probes)
    ref = {n: w.clone() for n, w in W0.items()}
    mom = {n: torch.zeros_like(w) for n, w in W0.items()}
    h = kappa * std * (1 + MU)

    def Q(X):
        return smooth_newton_schulz(X, 5, gamma)

    for t, gs in enumerate(grads):
        for n, p in params.items():
            p.grad = gs[n].clone()
        opt.step()
        for n in ref:
            mom[n] = MU * mom[n] + gs[n]
            N = gs[n] + MU * mom[n]
            g = torch.Generator().manual_seed(probe_seed("muon_bc_probe", seed, t, n))
            E = torch.randn((probes, *N.shape), generator=g, dtype=torch.float32).double()
            D = sum(0.5 * (Q(N + h * e) + Q(N - h * e)) for e in E) / probes
            O = Q(N) - lam / kappa ** 2 * (D - Q(N))
            ref[n] = ref[n] - LR * 0.2 * math.sqrt(max(N.shape)) * O
            torch.testing.assert_close(params[n].detach(), ref[n], rtol=1e-10, atol=1e-12)


def test_muon_bc_without_noise_is_muon_with_smooth_ns():
    W0 = torch.randn(8, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    Wa, Wb = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(W0.clone())
    bc = MuonBC([Wa], lr=LR, release_noise_std=0.0, seed=0, ns_dtype="float64", bc_gamma_ns=0.0)
    plain = Muon([Wb], lr=LR, ns_dtype="float64", eps=0.0)
    for G in _grads((8, 12), 3, dtype=torch.float64):
        Wa.grad, Wb.grad = G.clone(), G.clone()
        bc.step()
        plain.step()
    torch.testing.assert_close(Wa.detach(), Wb.detach(), rtol=1e-12, atol=1e-12)


# --- DP-Muon-S ------------------------------------------------------------------------------

def test_top_singular_value_of_a_zero_matrix_keeps_its_vector():
    v = torch.tensor([0.6, 0.8])
    sigma, v_new = top_singular_value(torch.zeros(3, 2), v, 3)
    assert sigma == 0 and torch.equal(v_new, v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("scale", [1.0, 0.7, 3e-3])
def test_top_singular_value_restarts_from_a_warm_start_in_the_null_space(dtype, scale):
    """A warm start with M v = 0 exactly (here: v on the columns where M is zero, as after a
    step whose gradient had other columns) spans a Krylov space that M maps to 0; sigma was 0,
    and the update with it. The restart finds sigma_1 (scale 0.7: the largest entry already in
    [0.5, 1), no rescaling); a zero matrix still keeps its vector (the test above)."""
    g = torch.Generator().manual_seed(3)
    M = torch.zeros(12, 9, dtype=torch.float64)
    M[:, :4] = torch.randn(12, 4, generator=g, dtype=torch.float64)
    M *= scale / M.abs().max()
    v = torch.zeros(9, dtype=torch.float64)
    v[4:] = torch.randn(5, generator=g, dtype=torch.float64)
    v /= v.norm()
    sigma, v_new = top_singular_value(M.to(dtype), v.to(dtype), 10)
    want = torch.linalg.svdvals(M.to(dtype).double())[0]
    assert abs(float(sigma) - float(want)) <= 1e-2 * float(want), (float(sigma), float(want))
    assert v_new.dtype == dtype
    assert float((M.to(dtype).double() @ v_new.double()).norm()) > 0.9 * float(want)


def test_top_singular_value_stops_once_the_ritz_residual_is_within_tol():
    """The stopping rule is the top Ritz pair's residual beta_j |s_j| <= tol theta, which a
    clear gap between sigma_1 and the rest meets within a few products; a mutant stopping on
    beta alone (the new direction's norm, which stays large) gave the same sigma after 48
    products instead of 3: DP-Muon-S 16x slower per step, unseen by the accuracy tests."""
    g = torch.Generator().manual_seed(5)
    U, _ = torch.linalg.qr(torch.randn(64, 48, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(48, 48, generator=g, dtype=torch.float64))
    spectrum = torch.cat([torch.tensor([10.0], dtype=torch.float64),
                          torch.linspace(1.0, 0.1, 47, dtype=torch.float64)])
    M = (U * spectrum) @ V.mT
    v = torch.randn(48, generator=g, dtype=torch.float64)
    products = []
    sigma, _ = top_singular_value(M, v / v.norm(), 50, 1e-4,
                                  reduce=lambda w: products.append(1))
    products = len(products) - 1  # (the first call sums the largest entry, not a product)
    assert abs(float(sigma) - 10.0) <= 1e-4 * 10.0
    assert products <= 5, products


@pytest.mark.parametrize("shape, noise", [((20, 30), 0.05), ((20, 30), 5.0), ((64, 48), 1.0),
                                          ((40, 200), 5.0)])
def test_muon_s_sigma1_is_within_1e_3_of_the_svd_on_noisy_releases(shape, noise):
    # the issue's test, on releases dominated by noise as well: the heavy-ball momentum of such
    # releases has a flat top of the spectrum (sigma_2/sigma_1 ~0.95-0.99), where three
    # warm-started power iterations (the earlier method) left sigma_1 2-14% low
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(*shape, dtype=torch.float64, generator=gen)
    W = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    opt = MuonS([("w", W)], lr=LR, momentum=0.9)
    errors = []
    for _ in range(6):  # the first step starts cold, the others from the last Ritz vector
        W.grad = base + noise * torch.randn(*shape, dtype=torch.float64, generator=gen)
        opt.step()
        state = opt.state[W]
        sigma_svd = torch.linalg.svdvals(state["momentum_buffer"])[0]
        errors.append(float(abs(state["sigma"] - sigma_svd) / sigma_svd))
    assert max(errors) < 1e-3, errors


def test_three_power_steps_would_miss_the_issues_accuracy():
    # what the test above guards against: plain power iteration, 3 warm-started steps per
    # optimizer step, on the same noisy momentum as its (20, 30), noise 5 case
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(20, 30, dtype=torch.float64, generator=gen)
    M, v = torch.zeros(20, 30, dtype=torch.float64), torch.ones(30, dtype=torch.float64) / 30**0.5
    errors = []
    for _ in range(6):
        M = 0.9 * M + base + 5.0 * torch.randn(20, 30, dtype=torch.float64, generator=gen)
        for _ in range(3):
            w = M.T @ (M @ v)
            v = w / torch.linalg.vector_norm(w)
        sigma = torch.linalg.vector_norm(M @ v)
        errors.append(float(1 - sigma / torch.linalg.svdvals(M)[0]))
    assert max(errors) > 1e-2


def _lanczos_reference(M: torch.Tensor, v: torch.Tensor, steps: int):
    # Lanczos on A = M^T M written out: an orthonormal basis of span{v, Av, ..., A^(steps-1) v}
    # by QR, the projected matrix Q^T A Q and its top eigenpair
    A = M.T @ M
    K = [v]
    for _ in range(steps - 1):
        K.append(A @ K[-1])
    Q, _ = torch.linalg.qr(torch.stack(K, dim=1))
    values, vectors = torch.linalg.eigh(Q.T @ A @ Q)
    y = Q @ vectors[:, -1]
    return values[-1].sqrt(), y * torch.sign(y @ v)


@pytest.mark.parametrize("steps", [2, 3, 5])
def test_top_singular_value_is_the_krylov_spaces_best_estimate(steps):
    # with tol 0 it takes exactly `steps` products: sigma_1 and the next step's warm start are
    # the top Ritz pair of span{v, Av, ..., A^(steps-1) v}
    gen = torch.Generator().manual_seed(steps)
    M = torch.randn(9, 7, dtype=torch.float64, generator=gen)
    v = torch.randn(7, dtype=torch.float64, generator=gen)
    v = v / torch.linalg.vector_norm(v)
    calls = []
    sigma, y = top_singular_value(M, v, steps, tol=0.0, reduce=calls.append)
    want_sigma, want_y = _lanczos_reference(M, v, steps)
    assert len(calls) == 1 + steps  # the largest entry's sum over ranks, then one per product
    assert calls[0].shape == (1,) and float(calls[0]) == float(M.abs().max())
    torch.testing.assert_close(sigma, want_sigma, rtol=1e-10, atol=0)
    torch.testing.assert_close(y * torch.sign(y @ v), want_y, rtol=0, atol=1e-8)
    assert sigma < torch.linalg.svdvals(M)[0]  # a lower bound until it has converged


def test_top_singular_value_stops_at_the_residual_tolerance():
    # sigma_1 = 3, well apart from the rest: a loose tolerance stops early with a lower bound
    # within it; a tight one agrees with the SVD to float64 rounding
    gen = torch.Generator().manual_seed(1)
    U, _ = torch.linalg.qr(torch.randn(30, 20, dtype=torch.float64, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(20, 20, dtype=torch.float64, generator=gen))
    S = torch.cat([torch.tensor([3.0], dtype=torch.float64),
                   torch.linspace(1.0, 0.1, 19, dtype=torch.float64)])
    M = U @ torch.diag(S) @ V.T
    v = torch.ones(20, dtype=torch.float64) / 20**0.5
    loose_calls, tight_calls = [], []
    loose, _ = top_singular_value(M, v, 50, tol=1e-2, reduce=loose_calls.append)
    tight, _ = top_singular_value(M, v, 50, tol=1e-12, reduce=tight_calls.append)
    assert len(loose_calls) < len(tight_calls) <= 1 + 20  # (the first: the largest entry)
    assert 3 * (1 - 1e-2) <= loose <= 3
    torch.testing.assert_close(tight, torch.tensor(3.0, dtype=torch.float64), rtol=1e-12, atol=0)


def test_muon_s_sigma_is_warm_started_from_the_seeded_vector():
    # the first step's vector is randn(c) from torch.Generator(probe_seed("muon_s_power", seed,
    # name)), normalised; each later step starts from the last step's top Ritz vector
    gen = torch.Generator().manual_seed(3)
    shape, seed, steps = (7, 5), 11, 3
    W = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float64))
    opt = MuonS([("w", W)], lr=LR, seed=seed, momentum=0.9, power_iters=steps, power_tol=0.0,
                ns_dtype="float64")
    v = torch.randn(shape[1], dtype=torch.float64, generator=torch.Generator().manual_seed(
        probe_seed("muon_s_power", seed, "w")))
    v = v / torch.linalg.vector_norm(v)
    M = torch.zeros(shape, dtype=torch.float64)
    for _ in range(4):
        G = torch.randn(*shape, dtype=torch.float64, generator=gen)
        W.grad = G.clone()
        opt.step()
        M = 0.9 * M + G
        sigma, v = _lanczos_reference(M, v, steps)
        got = opt.state[W]["power_vector"]
        torch.testing.assert_close(opt.state[W]["sigma"], sigma, rtol=1e-10, atol=0)
        torch.testing.assert_close(got * torch.sign(got @ v), v, rtol=0, atol=1e-8)


@pytest.mark.parametrize("wd", [0.0, 0.3])
def test_muon_s_update_is_sigma1_times_ns_and_heavy_ball_sgd_for_vectors(wd):
    # decoupled weight decay: W <- W (1 - lr wd) - lr sigma_1(M) NS(M), b <- b (1 - lr wd) - lr M_b
    gen = torch.Generator().manual_seed(1)
    W0 = torch.randn(6, 9, dtype=torch.float64, generator=gen)
    b0 = torch.randn(6, dtype=torch.float64, generator=gen)
    W, b = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(b0.clone())
    opt = MuonS([("w", W), ("b", b)], lr=LR, momentum=0.9, power_iters=50, ns_dtype="float64",
                weight_decay=wd)
    M_W, M_b = torch.zeros_like(W0), torch.zeros_like(b0)
    for _ in range(3):
        GW = torch.randn(6, 9, dtype=torch.float64, generator=gen)
        Gb = torch.randn(6, dtype=torch.float64, generator=gen)
        W.grad, b.grad = GW.clone(), Gb.clone()
        opt.step()
        M_W, M_b = 0.9 * M_W + GW, 0.9 * M_b + Gb
        sigma = torch.linalg.svdvals(M_W)[0]
        W0 = W0 * (1 - LR * wd) - LR * sigma * newton_schulz(M_W, 6, coefficients="polar_express")
        b0 = b0 * (1 - LR * wd) - LR * M_b
        torch.testing.assert_close(W.detach(), W0, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(b.detach(), b0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (128, 128)])
def test_muon_s_default_update_has_spectral_norm_lr_times_sigma1(shape):
    """DP-Muon-S's update is lr * sigma_1(M) * U V^T (docs/optim.md): with its default settings
    the update's spectral norm must be lr * sigma_1(M), to 2%. Five Polar Express steps leave
    singular values in about [0.86, 1.14], so the default update was 1.14x it; six give 1.008."""
    gen = torch.Generator().manual_seed(0)
    S = torch.randn(shape[0], 8, generator=gen) @ torch.randn(8, shape[1], generator=gen)
    G = (S / torch.linalg.matrix_norm(S, 2)
         + 0.5 * torch.randn(*shape, generator=gen) / math.sqrt(max(shape)))
    W = torch.nn.Parameter(torch.zeros(shape))
    opt = MuonS([("w", W)], lr=1.0, momentum=0.0)
    W.grad = G.clone()
    opt.step()
    ratio = (torch.linalg.matrix_norm(W.detach(), 2) / torch.linalg.matrix_norm(G, 2)).item()
    assert abs(ratio - 1.0) < 0.02, ratio


def test_muon_s_refuses_zero_newton_schulz_steps_like_muon():
    """Muon refuses ns_steps < 1; MuonS took 0 and stepped by sigma_1 * M / (1.02 ||M||_F)."""
    W = torch.nn.Parameter(torch.zeros(8, 16))
    with pytest.raises(ValueError, match="ns_steps"):
        Muon([W], ns_steps=0)
    with pytest.raises(ValueError, match="ns_steps"):
        MuonS([("w", W)], ns_steps=0)


@pytest.mark.parametrize("cls", ["Muon", "MuonBC"])
def test_original_scale_treats_a_conv1d_weight_like_the_equivalent_linear(cls):
    """transformers' Conv1D stores (in, out); the shape scale sqrt(max(1, fan_out / fan_in)) must
    be the Linear's. Same gradient (transposed), same step (transposed)."""
    from transformers.pytorch_utils import Conv1D

    from dptrain.optim.build import transposed_weights
    from dptrain.optim.muon import MuonBC

    torch.manual_seed(0)
    conv, lin = Conv1D(16, 4), torch.nn.Linear(4, 16, bias=False)  # fan_in 4, fan_out 16
    with torch.no_grad():
        lin.weight.copy_(conv.weight.T)
    assert transposed_weights(torch.nn.ModuleDict({"c": conv, "l": lin})) == {"c.weight"}
    g = torch.randn(16, 4, dtype=torch.float64)
    kw = dict(lr=0.1, scale="original", ns_dtype="float64")
    extra = dict(release_noise_std=0.0, seed=0) if cls == "MuonBC" else {}
    make = MuonBC if cls == "MuonBC" else Muon
    conv.weight.data, lin.weight.data = conv.weight.data.double(), lin.weight.data.double()
    before = lin.weight.detach().clone()
    for m, grad, t in ((conv, g.T, frozenset({"w"})), (lin, g, frozenset())):
        opt = make([("w", m.weight)], **kw, **extra, transposed=t)
        m.weight.grad = grad.clone()
        opt.step()
    step = lin.weight.detach() - before
    assert float(step.abs().max()) > 0
    torch.testing.assert_close(conv.weight.detach().T - before, step, rtol=1e-10, atol=1e-12)
    # the scale is 2 = sqrt(16 / 4): the step's RMS is lr * 2 * RMS(NS(g))


@pytest.mark.parametrize("shape", [(30, 20), (128, 32), (20, 30)])
@pytest.mark.parametrize("iters", [50, 200])
def test_lanczos_past_the_matrix_rank_stops_at_the_exhausted_krylov_space(shape, iters):
    """power_tol 0 with more products than the matrix's rank: the next directions were float32
    rounding noise and the tridiagonal's top eigenvalue grew to 15-250x sigma_1 (140.7 against
    9.51 for (30, 20) at 50 products). Now the iteration stops there, at sigma_1."""
    g = torch.Generator().manual_seed(0)
    M = torch.randn(shape, generator=g)
    v = torch.randn(shape[1], generator=g)
    sigma, y = top_singular_value(M, v / v.norm(), iters, tol=0.0)
    ref = float(torch.linalg.matrix_norm(M.double(), ord=2))
    assert abs(float(sigma) - ref) <= 1e-5 * ref
    assert abs(float(torch.linalg.vector_norm(M.double() @ y.double())) - ref) <= 1e-4 * ref


@pytest.mark.parametrize("scale", [1e19, 1e30, 1e-20, 1e-30])
def test_muon_s_sigma_of_a_matrix_past_float32s_squares_is_its_scaled_sigma(scale):
    """sigma_1 is homogeneous: a float32 matrix x 1e19 overflowed M^T M q (NaN parameters, or an
    eigh error), x 1e-20 lost digits to subnormals (47-99% low). Now the matrix is scaled by a
    power of two for the iteration: exactly the unscaled run's sigma times the scale, up to the
    power of two's rounding of ``scale``."""
    g = torch.Generator().manual_seed(1)
    G = torch.randn(20, 30, generator=g)
    sigmas = []
    for factor in (1.0, scale):
        p = torch.nn.Parameter(torch.zeros(20, 30))
        opt = MuonS([p], lr=1.0, momentum=0.0)
        p.grad = G * factor
        opt.step()
        assert torch.isfinite(p).all()
        sigmas.append(float(opt.state[p]["sigma"]) / factor)
    assert sigmas[1] == pytest.approx(sigmas[0], rel=1e-5)


def test_lanczos_guards_hold_for_bf16_matrices_and_for_sigma_past_float32_squares():
    """A red team's cases of the guards above: bf16 momentum (the breakdown threshold took
    bf16's eps, 0.5 x 64, and stopped at a 30-degree warm start: 21-34% low) now iterates in
    float32; float32 entries inside [2^-32, 2^32] whose sigma_1 passes ~4.3e9 (||M^T M q||
    overflowed, and the stop fired at once: 20-50% low) are scaled by their Frobenius norm."""
    g = torch.Generator().manual_seed(6)
    for dtype, scale in ((torch.bfloat16, 1.0), (torch.float32, 2.0 ** 31),
                         (torch.float32, 2.0 ** -32),  # (its norms' squares underflowed)
                         (torch.float64, 1e-200), (torch.float64, 1e250)):
        G = torch.randn(64, 64, generator=g, dtype=torch.float64)
        G = (G / G.abs().max() * scale).to(dtype)
        p = torch.nn.Parameter(torch.zeros(64, 64, dtype=dtype))
        opt = MuonS([p], lr=1e-12, momentum=0.0)
        p.grad = G.clone()
        opt.step()
        ref = float(torch.linalg.matrix_norm(G.double(), ord=2))
        assert abs(float(opt.state[p]["sigma"]) - ref) <= 1e-2 * ref, (dtype, scale)
    # a bf16 start vector is unit to 1e-3 only: Gram-Schmidt against it left ghost Ritz values
    # 50-60x sigma_1 on a clustered top until it was normalised again in float32
    U, _ = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(64, 64, generator=g, dtype=torch.float64))
    S = torch.cat([torch.full((8,), 1.0, dtype=torch.float64),
                   torch.linspace(0.5, 0.01, 56, dtype=torch.float64)])
    M = (U @ torch.diag(S) @ V.T).to(torch.bfloat16)
    v = torch.randn(64, generator=g).to(torch.bfloat16)
    sigma, y = top_singular_value(M, v / v.float().norm().to(torch.bfloat16), 50, tol=1e-4)
    ref = float(torch.linalg.matrix_norm(M.double(), ord=2))
    assert abs(float(sigma) - ref) <= 1e-2 * ref and sigma.dtype == y.dtype == torch.bfloat16


def test_smooth_ns_of_a_zero_matrix_with_a_huge_constant_is_zero():
    """bc_gamma_ns = 1e20 (accepted): gamma^2 is inf in float32, so the rescue took the zero
    matrix too and divided it by its largest entry, 0: NaN where the plain form gives 0."""
    assert torch.equal(smooth_newton_schulz(torch.zeros(4, 6), 5, 1e20), torch.zeros(4, 6))


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (3, 0, 2, 2)])
@pytest.mark.parametrize("make", [
    lambda p: Muon([p], lr=0.1, scale="original"),  # r / c divided by 0
    lambda p: MuonBC([p], lr=0.1, release_noise_std=0.1, seed=0),  # a batch of empty matrices
    lambda p: MuonS([p], lr=0.1, seed=0),
])
def test_an_empty_weight_steps_without_error(shape, make):
    p = torch.nn.Parameter(torch.zeros(shape))
    p.grad = torch.zeros(shape)
    opt = make(p)
    opt.step()
    opt.step()
    assert p.shape == shape


# --- defaults, settings the step must read, refusals ---------------------------------------

def test_muon_class_defaults_are_the_documented_eq7_settings():
    """OptimConfig leaves momentum, nesterov, ns_steps, eps, ... null: the classes' defaults are
    the run's. Muon's: lr 0.02, mu 0.95, Nesterov, 5 quintic steps in float32 with eps 1e-7, the
    match_rms_adamw scale, accumulated momentum (a default changed to mu 0.9, no Nesterov, the
    original scale or eps 1e-3 passed every other test)."""
    shape = (8, 12)
    W0 = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    Wd, We = torch.nn.Parameter(W0.clone()), torch.nn.Parameter(W0.clone())
    default = Muon([Wd])
    explicit = Muon([We], lr=0.02, momentum=0.95, nesterov=True, ns_steps=5,
                    ns_coefficients="muon", ns_dtype="float32", scale="match_rms_adamw",
                    momentum_style="accumulate", weight_decay=0.0, eps=1e-7)
    for G in _grads(shape, 3):
        G = G * 1e-4  # ||N||_F ~ 1e-2: eps = 1e-7 is visible in float32
        Wd.grad, We.grad = G.clone(), G.clone()
        default.step()
        explicit.step()
        assert torch.equal(Wd.detach(), We.detach())


def test_muon_bc_and_muon_s_class_defaults_are_the_documented_ones():
    W0 = torch.randn(6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grads = _grads((6, 10), 3, dtype=torch.float64)

    def run(make):
        W = torch.nn.Parameter(W0.clone())
        opt = make(W)
        for G in grads:
            W.grad = G.clone()
            opt.step()
        return W.detach()

    bc = dict(release_noise_std=0.3, seed=1)
    assert torch.equal(run(lambda W: MuonBC([("w", W)], **bc)),
                       run(lambda W: MuonBC([("w", W)], **bc, bc_lambda=1.25, bc_kappa=2.0,
                                            bc_gamma_ns=1e-4, bc_probes=1)))
    assert torch.equal(run(lambda W: MuonS([("w", W)], seed=1)),
                       run(lambda W: MuonS([("w", W)], seed=1, lr=0.02, momentum=0.9,
                                           power_iters=50, power_tol=1e-4, ns_steps=6,
                                           ns_coefficients="polar_express", eps=1e-7)))


@pytest.mark.parametrize("make, ns", [
    (lambda W: Muon([W], lr=LR, momentum=MU, ns_dtype="float64",
                    ns_coefficients="polar_express"),
     lambda N: newton_schulz(N, 5, coefficients="polar_express")),
    (lambda W: MuonBC([W], lr=LR, momentum=MU, ns_dtype="float64", release_noise_std=0.0,
                      seed=0, ns_coefficients="polar_express"),
     lambda N: smooth_newton_schulz(N, 5, 1e-4, coefficients="polar_express")),
    (lambda W: MuonBC([W], lr=LR, momentum=MU, ns_dtype="float64", release_noise_std=0.0,
                      seed=0, bc_gamma_ns=3.0),
     lambda N: smooth_newton_schulz(N, 5, 3.0)),
])
def test_muon_and_muon_bc_orthogonalise_with_the_configured_newton_schulz(make, ns):
    # every other test used the default quintic and Smooth-NS constant (or 0, within 1e-12 of
    # the default): a step that dropped ns_coefficients or bc_gamma_ns passed
    W0 = torch.randn(6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    W, ref, M = torch.nn.Parameter(W0.clone()), W0.clone(), torch.zeros_like(W0)
    opt = make(W)
    for G in _grads((6, 10), 3, dtype=torch.float64):
        W.grad = G.clone()
        opt.step()
        M = MU * M + G
        ref = ref - LR * 0.2 * math.sqrt(10) * ns(G + MU * M)
        torch.testing.assert_close(W.detach(), ref, rtol=1e-12, atol=1e-12)


def test_muon_s_newton_schulz_reads_eps_and_its_residual_tolerance():
    # eps (with the quintic) and power_tol are the group's: a step that dropped either
    # (NS's default eps, or tol 0: every product) passed the other tests
    gen = torch.Generator().manual_seed(4)
    G = torch.randn(7, 9, dtype=torch.float64, generator=gen)
    W = torch.nn.Parameter(torch.zeros(7, 9, dtype=torch.float64))
    opt = MuonS([("w", W)], lr=1.0, seed=2, momentum=0.0, ns_coefficients="muon", eps=0.5,
                power_tol=0.3, ns_dtype="float64")
    W.grad = G.clone()
    v = torch.randn(9, dtype=torch.float64, generator=torch.Generator().manual_seed(
        probe_seed("muon_s_power", 2, "w")))
    sigma, _ = top_singular_value(G, v / v.norm(), 50, 0.3)
    assert float(sigma) < 0.999 * float(torch.linalg.svdvals(G)[0])  # stopped early: tol read
    opt.step()
    torch.testing.assert_close(opt.state[W]["sigma"], sigma, rtol=1e-12, atol=0)
    torch.testing.assert_close(W.detach(), -sigma * newton_schulz(G, 6, coefficients="muon",
                                                                   eps=0.5),
                               rtol=1e-12, atol=1e-12)


def test_muon_bc_reads_bias_correction_settings_per_parameter_group():
    # a group's own bc_lambda (as torch.optim's per-group options) must not be replaced by the
    # constructor's
    W0 = torch.randn(6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    G = _grads((6, 10), 1, dtype=torch.float64)[0]
    outs = []
    for groups in ([{"params": [None], "bc_lambda": 0.5}], [{"params": [None]}]):
        W = torch.nn.Parameter(W0.clone())
        groups[0]["params"] = [W]
        opt = MuonBC(groups, lr=LR, release_noise_std=0.2, seed=0, ns_dtype="float64",
                     bc_lambda=0.5 if "bc_lambda" not in groups[0] else 2.0)
        assert opt.param_groups[0]["bc_lambda"] == 0.5
        W.grad = G.clone()
        opt.step()
        outs.append(W.detach())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


@pytest.mark.parametrize("make, match", [
    (lambda W: Muon([W], lr=True), "lr"),
    (lambda W: Muon([W], momentum=1.0), "momentum"),
    (lambda W: Muon([W], ns_coefficients="quintic"), "ns_coefficients"),
    (lambda W: MuonBC([W], release_noise_std=0.1, seed=0, bc_kappa=0.0), "bc_kappa"),
    (lambda W: MuonS([W], power_iters=1), "power_iters"),
    (lambda W: MuonS([W], momentum=1.0), "momentum"),
])
def test_settings_a_step_cannot_use_are_refused_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make(torch.nn.Parameter(torch.zeros(4, 6)))
