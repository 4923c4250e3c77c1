"""Newton–Schulz (Eq. 13): dtype, orientation, the Muon band, Polar Express, Proposition 2."""

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dptrain.optim import newton_schulz, smooth_newton_schulz
from dptrain.optim.newton_schulz import MUON_COEFFICIENTS, POLAR_EXPRESS_COEFFICIENTS

#: the module (``dptrain.optim.newton_schulz`` as an attribute is the function the package exports)
NS = importlib.import_module("dptrain.optim.newton_schulz")


def _polar(X: torch.Tensor) -> torch.Tensor:
    """U V^T from an FP64 SVD."""
    U, _, Vh = torch.linalg.svd(X.double(), full_matrices=False)
    return U @ Vh


def _reference_ns(X: torch.Tensor, steps: int) -> torch.Tensor:
    """Eq. 13 written out: normalise, then X <- aX + b(XX^T)X + c(XX^T)^2 X on the wide side."""
    a, b, c = MUON_COEFFICIENTS
    tall = X.shape[0] > X.shape[1]
    Y = X.T if tall else X
    Y = Y / (torch.linalg.norm(Y) + 1e-7)
    for _ in range(steps):
        G = Y @ Y.T
        Y = a * Y + b * (G @ Y) + c * (G @ G @ Y)
    return Y.T if tall else Y


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_output_has_the_input_dtype(dtype):
    X = torch.randn(8, 12, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert newton_schulz(X).dtype == dtype
    assert newton_schulz(X, coefficients="polar_express").dtype == dtype
    assert smooth_newton_schulz(X, 5, 1e-4).dtype == dtype


def test_matches_eq13_written_out_in_float64():
    X = torch.randn(12, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(newton_schulz(X), _reference_ns(X, 5), rtol=1e-12, atol=1e-12)


@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 12), n=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_tall_is_the_transpose_of_wide(m, n, seed):
    X = torch.randn(m, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    for coefficients in ("muon", "polar_express"):
        torch.testing.assert_close(newton_schulz(X.T, coefficients=coefficients),
                                   newton_schulz(X, coefficients=coefficients).T,
                                   rtol=1e-12, atol=1e-12)


def test_a_tall_matrix_is_iterated_on_its_short_side(monkeypatch):
    # the same polar factor either way in exact arithmetic (p(X X^T) X = X p(X^T X)): only the
    # cost says which, an m x m gram instead of n x n (a 3072 x 768 MLP weight: 16x the flops)
    import importlib

    # (dptrain.optim's attribute of that name is the function)
    ns = importlib.import_module("dptrain.optim.newton_schulz")
    seen, iterate = [], ns._iterate
    monkeypatch.setattr(ns, "_iterate", lambda Y, schedule: seen.append(tuple(Y.shape))
                        or iterate(Y, schedule))
    X = torch.randn(2, 10, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    for fn in (newton_schulz, smooth_newton_schulz):
        assert fn(X).shape == (2, 10, 3) and fn(X.mT).shape == (2, 3, 10)
    assert seen == [(2, 3, 10)] * 4


def test_batched_equals_one_by_one():
    X = torch.randn(3, 6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    batched = newton_schulz(X)
    for k in range(3):
        torch.testing.assert_close(batched[k], newton_schulz(X[k]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(32, 64), (64, 32), (16, 128)])
def test_singular_values_land_in_the_muon_band(shape):
    X = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    s = torch.linalg.svdvals(newton_schulz(X, 5))
    assert s.min() > 0.68 and s.max() < 1.22, (s.min().item(), s.max().item())


def test_polar_express_is_closer_to_the_polar_factor_at_five_steps():
    gen = torch.Generator().manual_seed(4)
    for shape in [(32, 64), (48, 48), (100, 20)]:
        X = torch.randn(*shape, dtype=torch.float64, generator=gen)
        P = _polar(X)
        err_muon = torch.linalg.norm(newton_schulz(X, 5) - P)
        err_pe = torch.linalg.norm(newton_schulz(X, 5, coefficients="polar_express") - P)
        assert err_pe < 0.5 * err_muon, (shape, err_pe.item(), err_muon.item())


def _reference_polar_express(X: torch.Tensor, steps: int) -> torch.Tensor:
    """docs/optim.md: X / (||X||_F * 1.02 + 1e-6), the five quintics in order, then their limit
    (15/8, -10/8, 3/8), on the wide side."""
    tall = X.shape[0] > X.shape[1]
    Y = X.T if tall else X
    Y = Y / (torch.linalg.norm(Y) * 1.02 + 1e-6)
    for j in range(steps):
        a, b, c = POLAR_EXPRESS_COEFFICIENTS[j] if j < 5 else (15 / 8, -10 / 8, 3 / 8)
        G = Y @ Y.T
        Y = a * Y + b * (G @ Y) + c * (G @ G @ Y)
    return Y.T if tall else Y


@pytest.mark.parametrize("steps", [1, 4, 5, 6, 8])
@pytest.mark.parametrize("shape", [(6, 10), (10, 6)])
def test_polar_express_is_its_documented_definition(steps, shape):
    gen = torch.Generator().manual_seed(0)
    generic = torch.randn(*shape, dtype=torch.float64, generator=gen)
    # nearly rank one: sigma_1 ~ ||X||_F, where the 1.02 safety factor matters
    rank_one = (torch.randn(shape[0], 1, dtype=torch.float64, generator=gen)
                @ torch.randn(1, shape[1], dtype=torch.float64, generator=gen)
                + 1e-3 * torch.randn(*shape, dtype=torch.float64, generator=gen))
    for X in (generic, rank_one):
        torch.testing.assert_close(newton_schulz(X, steps, coefficients="polar_express"),
                                   _reference_polar_express(X, steps), rtol=1e-12, atol=1e-12)


def test_polar_express_beyond_five_steps_converges_to_the_polar_factor():
    # the five quintics carry a safety factor (the last has p(1) = 1.06, fixed point ~1.035):
    # repeating it pushed every singular value to ~1.035; later steps use the limit quintic
    X = torch.randn(64, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    err = [torch.linalg.norm(newton_schulz(X, k, coefficients="polar_express") - _polar(X))
           for k in (5, 8)]
    assert err[1] <= err[0]
    for k in (8, 20):
        s = torch.linalg.svdvals(newton_schulz(X, k, coefficients="polar_express"))
        assert (s - 1).abs().max() < 1e-3, (k, s.min().item(), s.max().item())


@settings(max_examples=15, deadline=None)
@given(m=st.integers(2, 16), n=st.integers(2, 16), seed=st.integers(0, 2**16),
       steps=st.integers(1, 8))
def test_proposition_2_newton_schulz_preserves_the_polar_factor(m, n, seed, steps):
    """NS maps U S V^T to U p(S) V^T with p > 0 on (0, 1]: polar(NS(X)) = polar(X), FP64."""
    gen = torch.Generator().manual_seed(seed)
    # Well-conditioned singular values in [0.2, 1] so that U, V are well defined numerically.
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, dtype=torch.float64, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64, generator=gen))
    s = 0.2 + 0.8 * torch.rand(k, dtype=torch.float64, generator=gen)
    X = U @ torch.diag(s) @ V.T
    for coefficients in ("muon", "polar_express"):
        Y = newton_schulz(X, steps, coefficients=coefficients)
        torch.testing.assert_close(_polar(Y), U @ V.T, rtol=0, atol=1e-9)


@pytest.mark.parametrize("coefficients", ["muon", "polar_express"])
def test_smooth_ns_equals_ns_away_from_zero_and_is_finite_at_zero(coefficients):
    X = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    # polar_express's own eps (1e-6) is below this tolerance at ||X|| ~ 11
    torch.testing.assert_close(smooth_newton_schulz(X, 5, 1e-12, coefficients=coefficients),
                               newton_schulz(X, 5, eps=0.0, coefficients=coefficients),
                               rtol=1e-6, atol=1e-6)
    assert torch.equal(smooth_newton_schulz(torch.zeros(4, 6), 5, 1e-4), torch.zeros(4, 6))


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_zero_matrix_with_eps_0_is_a_zero_update_and_the_others_unchanged(dtype, sync_free,
                                                                              monkeypatch):
    """eps = 0 (the exact iteration) and gamma_ns = 0 divided a zero matrix's zeros by 0: NaN,
    and Muon's weights NaN after a step without gradient. Now 0, and the batch's nonzero
    matrices as they were."""
    import functools

    monkeypatch.setattr(NS, "_normalise", functools.partial(NS._normalise, sync_free=sync_free))
    X = torch.randn(3, 6, 10, generator=torch.Generator().manual_seed(8)).to(dtype)
    X[1] = 0
    for out, one in (
            (newton_schulz(X, eps=0.0), lambda x: newton_schulz(x, eps=0.0)),
            (smooth_newton_schulz(X, gamma_ns=0.0),
             lambda x: smooth_newton_schulz(x, gamma_ns=0.0))):
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        rest = out[[0, 2]]
        assert torch.isfinite(rest).all() and torch.equal(rest, one(X[[0, 2]]))


@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("eps", [0.0, 1.1754943508222875e-38])
def test_a_norm_that_underflows_is_rescued_not_divided_by_eps_or_zero(dtype, tol, eps, sync_free,
                                                                    monkeypatch):
    """Entries ~1e-25: float32's squares underflow, the norm is 0, and the matrix was divided by
    eps alone (eps = 0: NaN; the config's smallest eps: 1e13x too large, NaN after the
    quintics). A red team's case against the zero-matrix guard, which had made it an
    unnormalised ~1e-22 result. Now the polar approximation of the unscaled matrix."""
    import functools

    monkeypatch.setattr(NS, "_normalise", functools.partial(NS._normalise, sync_free=sync_free))
    X = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for f, kw in ((newton_schulz, {"eps": eps}), (smooth_newton_schulz, {"gamma_ns": eps})):
        out = f((X * 1e-25).to(dtype), **kw)
        ref = f(X, **{k: 0.0 for k in kw})
        assert float((out.double() - ref).abs().max()) <= tol, (f.__name__, out)


@pytest.mark.parametrize("coefficients", ["muon", "polar_express"])
@pytest.mark.parametrize("sync_free", [False, True])
@pytest.mark.parametrize("scale", [1e-25, 1e-21])
def test_a_rescued_norm_keeps_eps_in_proportion(scale, sync_free, coefficients, monkeypatch):
    """The rescue rescales the matrix by s before the norm, so the guard is ||X|| + eps / s:
    with the default eps 1e-7 a 1e-25 gradient is ~1e-15 after it, as in float64 (a mutant
    adding eps itself gave an O(1) orthogonal update; the test above has eps ~ 0 only). Polar
    Express has its own eps (1e-6), kept in proportion the same way (a mutant that was not
    survived the muon case alone: a full-size step on a gradient of 1e-25)."""
    import functools

    monkeypatch.setattr(NS, "_normalise", functools.partial(NS._normalise, sync_free=sync_free))
    X = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(0),
                    dtype=torch.float64) * scale
    kw = {"eps": 1e-7, "coefficients": coefficients}
    ref = newton_schulz(X, **kw)  # float64: no underflow, the plain path
    out = newton_schulz(X.float(), **kw).double()  # float32: the rescue
    assert float(ref.abs().max()) < 1e-6
    assert torch.allclose(out, ref, rtol=1e-3, atol=1e-30)


def test_float16_smooth_ns_whose_gamma_squared_rounds_to_0():
    """float16: gamma_ns^2 = 1e-8 and ||X||^2 = 4e-10 both round to 0, the root's argument was 0
    and the result unnormalised (a red team's case); now X / sqrt(gamma^2 + ||X||^2)."""
    out = smooth_newton_schulz(torch.full((1, 1), 2e-5, dtype=torch.float16), 0, 1e-4)
    assert abs(float(out) - 2e-5 / (4e-10 + 1e-8) ** 0.5) <= 1e-3


def test_muon_with_eps_0_and_no_gradient_keeps_its_weights():
    from dptrain.optim.muon import Muon

    W = torch.nn.Parameter(torch.ones(4, 3))
    opt = Muon([W], lr=0.1, eps=0.0)
    W.grad = torch.zeros(4, 3)
    opt.step()
    assert torch.equal(W.detach(), torch.ones(4, 3))


def test_rejects_vectors():
    with pytest.raises(ValueError):
        newton_schulz(torch.ones(5))


@pytest.fixture(params=[False, True], ids=["host-branch", "sync-free"])
def normalise_path(request, monkeypatch):
    """Both forms of the overflow rescue: on the CPU the rescue is computed only when a matrix
    needs it; on devices both are computed and torch.where picks (forced here on the CPU)."""
    import functools

    if request.param:
        monkeypatch.setattr(NS, "_normalise", functools.partial(NS._normalise, sync_free=True))
    return request.param


@pytest.mark.parametrize("scale", [1e19, 1e25, 1e36])
@pytest.mark.parametrize("coefficients", ["muon", "polar_express"])
@pytest.mark.parametrize("smooth", [False, True])
def test_a_norm_past_float32s_range_is_not_a_zero_update(scale, coefficients, smooth,
                                                         normalise_path):
    """Both maps are homogeneous of degree 0 (up to eps), so a huge float32 matrix whose
    Frobenius norm (or its square) overflows float32 gives the polar approximation of the
    unscaled one, not X / inf = 0 as before. The ordinary range stays bit for bit (the other
    tests, and the equality below for the first matrix)."""
    g = torch.Generator().manual_seed(3)
    X = torch.randn(3, 8, 12, generator=g)
    f = ((lambda x: smooth_newton_schulz(x, 5, 1e-4, coefficients=coefficients)) if smooth
         else (lambda x: newton_schulz(x, coefficients=coefficients)))
    big = X.clone()
    big[1:] *= scale  # one batch of ordinary and huge matrices together
    ref, out = f(X), f(big)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], ref[0])
    torch.testing.assert_close(out[1:], ref[1:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("coefficients", ["muon", "polar_express"])
def test_the_sync_free_rescue_leaves_ordinary_matrices_bit_for_bit(dtype, coefficients,
                                                                   monkeypatch):
    import functools

    g = torch.Generator().manual_seed(4)
    for scale in (1e-30, 1e-6, 1.0, 1e6):
        X = (torch.randn(2, 16, 24, generator=g) * scale).to(dtype)
        for divide, guard in (
                (lambda y, n, s: y / (n + 1e-7 / s), lambda n: n + 1e-7),
                (lambda y, n, s: y * torch.rsqrt(n.square() + (1e-4 / s) * (1e-4 / s)),
                 lambda n: n.square() + 1e-8)):
            assert torch.equal(NS._normalise(X, divide, guard, sync_free=True),
                               NS._normalise(X, divide, guard, sync_free=False))
        host = newton_schulz(X, coefficients=coefficients)
        with monkeypatch.context() as m:
            m.setattr(NS, "_normalise", functools.partial(NS._normalise, sync_free=True))
            assert torch.equal(newton_schulz(X, coefficients=coefficients), host)


def test_float16_polar_express_whose_denominator_alone_overflows():
    """||X||_F just below float16's max (65504) but ||X||_F * 1.02 past it: the guard looks at
    the denominator, not the norm (a red team's case: all zeros before)."""
    g = torch.Generator().manual_seed(5)
    X = torch.randn(16, 24, generator=g, dtype=torch.float64)
    X = X * (64992.0 / float(X.norm()))
    out = newton_schulz(X.half(), coefficients="polar_express")
    assert bool(out.abs().max() > 0.1)
    ref = newton_schulz(X, coefficients="polar_express")
    assert float((out.double() - ref).abs().max()) < 2e-2


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0)])
def test_empty_matrices_give_empty_results(shape):
    for f in (newton_schulz, smooth_newton_schulz):
        assert f(torch.zeros(shape)).shape == shape


def test_the_coefficients_are_the_published_ones():
    # the references above read the module's own tables, so a mistyped digit there passed every
    # other test here: Keller Jordan's quintic, and modded-nanogpt's five Polar Express quintics
    # (train_gpt.py's polar_express_coeffs, as written there; arXiv 2505.16932)
    assert MUON_COEFFICIENTS == (3.4445, -4.7750, 2.0315)
    assert POLAR_EXPRESS_COEFFICIENTS == (
        (8.156554524902461, -22.48329292557795, 15.878769915207462),
        (4.042929935166739, -2.808917465908714, 0.5000178451051316),
        (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
        (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
        (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
    )
    assert NS.POLAR_EXPRESS_LIMIT == (15 / 8, -10 / 8, 3 / 8)
    # and the limit is what its docstring says: p(1) = 1, p'(1) = 0
    a, b, c = NS.POLAR_EXPRESS_LIMIT
    assert a + b + c == 1 and a + 3 * b + 5 * c == 0


@pytest.mark.parametrize("smooth", [False, True])
def test_a_norm_whose_squares_are_subnormal_is_rescued(smooth):
    """float32 entries ~1e-22: the squares are subnormal, so the norm is nonzero and above the
    smallest normal but only good to ~1e-2 (5.064e-22 for 5.055e-22). The rescue takes every
    norm below the root of the smallest normal (a mutant that took only norms below the smallest
    normal itself divided by the subnormal sum's root). steps = 0: the normalisation alone."""
    X = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    if smooth:
        out = smooth_newton_schulz((X * 1e-22).float(), 0, 0.0)
    else:
        out = newton_schulz((X * 1e-22).float(), 0, eps=0.0)
    ref = X / torch.linalg.matrix_norm(X, keepdim=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_the_sync_free_normalisation_reads_nothing_back_from_the_device(monkeypatch):
    """sync_free (a device's default) computes the plain and the rescued normalisation and lets
    torch.where pick, so that the host never waits on a tensor's value: no bool() of a tensor
    (a mutant that asked rescue.any() on every path passed the bit-for-bit tests)."""
    import functools

    monkeypatch.setattr(NS, "_normalise", functools.partial(NS._normalise, sync_free=True))
    X = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(0))
    X[1] *= 1e-25  # one matrix that needs the rescue, two that do not
    expected = [newton_schulz(X, coefficients=c) for c in ("muon", "polar_express")]
    expected.append(smooth_newton_schulz(X))

    def no_sync(self):
        raise AssertionError("a tensor's value was read on the host")

    monkeypatch.setattr(torch.Tensor, "__bool__", no_sync)
    got = [newton_schulz(X, coefficients=c) for c in ("muon", "polar_express")]
    got.append(smooth_newton_schulz(X))
    monkeypatch.undo()
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_smooth_ns_whose_sum_of_squares_alone_overflows_is_rescued():
    """||X||_F^2 fits float32 (2.3e38) and so does gamma_ns^2, but their sum does not: the guard
    is the sum Smooth-NS takes the root of (a mutant that added gamma_ns, not its square, to
    ||X||^2 saw a finite guard and divided by the root of inf: a zero update)."""
    X = torch.randn(4, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    X = X / torch.linalg.matrix_norm(X) * 1.5e19
    gamma = 1.5e19
    out = smooth_newton_schulz(X.float(), 0, gamma)
    ref = X / (torch.linalg.matrix_norm(X) ** 2 + gamma ** 2) ** 0.5  # X / (sqrt(2) ||X||)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-7)


def test_on_the_cpu_the_rescue_is_computed_only_for_a_matrix_that_needs_it(monkeypatch):
    """The CPU's default is not sync_free: an ordinary matrix's normalisation takes one norm,
    not a second one of the rescaled matrix that torch.where would then discard."""
    calls, norm = [], torch.linalg.matrix_norm
    monkeypatch.setattr(torch.linalg, "matrix_norm", lambda *a, **k: calls.append(1) or norm(*a, **k))
    X = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(0))
    newton_schulz(X)
    assert len(calls) == 1
    newton_schulz(X * 1e-25)  # the rescue: the rescaled matrix's norm as well
    assert len(calls) == 3
