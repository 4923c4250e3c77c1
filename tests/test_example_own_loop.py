"""examples/own_loop.py (DP-Muon in a loop of one's own, from dptrain's pieces) computes the
mechanism it describes: its release equals clipped per-example gradients from torch.func plus
the same counter-based noise, and its epsilon is opacus' PRV accountant's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from _opacus import opacus_epsilon
from torch.func import functional_call, grad, vmap

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("own_loop", ROOT / "examples" / "own_loop.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("q, n, b", [(None, None, 100), (0.29, 100, 29)])
def test_release_is_clipped_per_example_gradients_plus_noise_over_b(example, monkeypatch, q, n,
                                                                    b):
    """b = max(1, floor(q N)) with q N read to 1e-9, as the trainer's: q = 0.29, N = 100 is
    28.999999999999996 in floating point, where the example's floor(q N) divided by 28."""
    from dptrain.clipping import ClippingEngine
    from dptrain.privacy.noise import gaussian_noise
    from dptrain.privacy.sampling import poisson_sample

    if q is not None:
        monkeypatch.setattr(example, "Q", q)
        monkeypatch.setattr(example, "N", n)
    X, y = example.make_data(example.N)
    model = example.make_model()
    engine = ClippingEngine(model, clip_norm=example.C)
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(p, x, t):
        out = functional_call(model, p, (x[None],))
        return torch.nn.functional.cross_entropy(out, t[None])

    sigma = 0.7
    clipped_some = False
    for step in range(2):
        got = example.release(step, engine, X, y, sigma)
        idx = torch.from_numpy(poisson_sample(example.SEED, step, example.N, example.Q))
        assert 0 < len(idx) != b  # a real Poisson draw; b is not the sampled count
        g = vmap(grad(one), in_dims=(None, 0, 0))(params, X[idx], y[idx])
        norms = torch.sqrt(sum(v.flatten(1).pow(2).sum(1) for v in g.values()))
        lam = (example.C / norms).clamp(max=1.0)
        clipped_some |= bool((lam < 1).any())
        for n, p in params.items():
            z = gaussian_noise(example.SEED, step, n, p.numel()).view_as(p)
            want = (torch.einsum("b...,b->...", g[n], lam) + sigma * example.C * z) / b
            torch.testing.assert_close(got[n], want, rtol=1e-4, atol=1e-6)
    assert clipped_some


def test_main_spends_the_calibrated_epsilon_by_opacus_prv_and_learns(example, capsys):
    out = example.main()
    want = opacus_epsilon("prv", out["sigma"], example.Q, example.STEPS, example.DELTA,
                          eps_error=0.01)
    assert out["epsilon"] == pytest.approx(want, rel=1e-9)
    assert 0.9 * example.EPSILON <= out["epsilon"] <= example.EPSILON
    assert out["accuracy"] > 0.7  # four classes: chance is 0.25
    assert f"epsilon {out['epsilon']:.3f}" in capsys.readouterr().out
