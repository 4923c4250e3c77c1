"""DP-Muon in your own training loop, built from dptrain's pieces (no Trainer, no config).

    python examples/own_loop.py            # about ten seconds on one CPU core

What `dptrain train` does for every logical batch, written out for a model and data of your own:

1. Poisson-sample the batch S_t: example i is in it iff u(seed, t, i) < q, a pure function of
   (seed, t, i) (``dptrain.privacy.sampling.poisson_sample``);
2. per microbatch, clip each example's COMPLETE gradient to norm C and add it into a running
   sum (``ClippingEngine.accumulate``: ghost norms, no per-example gradient of the whole model);
3. once per logical batch, add Gaussian noise of std sigma*C to every coordinate and divide by
   the public denominator b = max(1, floor(q N)) (``dptrain.privacy.noise.gaussian_noise``,
   ``dptrain.privacy.config.expected_batch_size``): the release;
4. post-processing, free of privacy cost: Muon on the weight matrices, AdamW on the rest;
5. record the release in a ``Ledger``; ``epsilon(ledger, delta)`` is opacus' PRV accountant.

Here: a two-layer MLP on a synthetic 4-class task, N = 2,000, q = 0.05 (b = 100), 60 steps,
epsilon 4 at delta 1e-5 (sigma calibrated by ``calibrate_noise_multiplier``).

Keep the model and ``loss_fn`` fixed once the engine has run: it checks the model's structure
(every parameter used inside its own module) and that no example's loss reaches another's over
its first queries only. A loss that changes later (a penalty switched on, a term mixing the
examples) goes unchecked; build a new engine for a new model or loss. The engine refuses a
model whose trainable parameters changed since it was built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.clipping import ClippingEngine
from dptrain.optim import Muon
from dptrain.privacy.accounting import Ledger, calibrate_noise_multiplier, epsilon
from dptrain.privacy.config import expected_batch_size
from dptrain.privacy.noise import gaussian_noise
from dptrain.privacy.sampling import poisson_sample

N, Q, STEPS, C = 2000, 0.05, 60, 1.0
EPSILON, DELTA = 4.0, 1e-5
# Sampling and noise. For a real release: SEED = secure_seed() (dptrain.privacy.noise; the
# OS's entropy, never written anywhere) and secure=True in poisson_sample and gaussian_noise
# (ChaCha20 streams; the default ones are fast, reproducible and not cryptographic)
SEED = 0
MICROBATCH = 64


def make_data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Four overlapping Gaussian blobs in 20 dimensions (the same blobs for every seed)."""
    centres = 0.5 * torch.randn(4, 20, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    return centres[y] + torch.randn(n, 20, generator=g), y


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.GELU(), nn.Linear(64, 4))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    """Per-example losses, shape [B]: what the engine clips."""
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def release(step: int, engine: ClippingEngine, X, y, sigma: float) -> dict[str, torch.Tensor]:
    """The Gaussian release of logical batch ``step``: (sum_i clip_C(g_i) + sigma*C*Z) / b."""
    indices = torch.from_numpy(poisson_sample(SEED, step, len(X), Q))  # S_t, may be empty
    acc: dict[str, torch.Tensor] = {}  # the unnoised clipped sum: private, never logged
    for chunk in indices.split(MICROBATCH):
        engine.accumulate(loss_fn, (X[chunk], y[chunk]), acc)
    b = expected_batch_size(Q, len(X))  # public: never the sampled count, which is private
    out = {}
    for name, p in engine.params.items():
        s = acc.pop(name, torch.zeros_like(p))  # an empty batch still releases noise
        z = gaussian_noise(SEED, step, name, p.numel()).view_as(p)
        out[name] = (s + sigma * C * z) / b
    return out


def main() -> dict:
    X, y = make_data(N)
    Xt, yt = make_data(500, seed=2)
    model = make_model()
    sigma = calibrate_noise_multiplier(EPSILON, DELTA, Q, STEPS)
    engine = ClippingEngine(model, clip_norm=C)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    others = [p for p in model.parameters() if p.ndim != 2]
    muon = Muon(matrices, lr=0.02)
    adamw = torch.optim.AdamW(others, lr=0.01)
    ledger = Ledger()
    for step in range(STEPS):
        for name, g in release(step, engine, X, y, sigma).items():
            engine.params[name].grad = g
        ledger.record(sigma, Q)
        muon.step()
        adamw.step()
        muon.zero_grad()
        adamw.zero_grad()
    with torch.no_grad():
        accuracy = float((model(Xt).argmax(1) == yt).float().mean())
    eps = epsilon(ledger, DELTA)
    print(f"{STEPS} releases, sigma {sigma:.3f}: epsilon {eps:.3f} at delta {DELTA:g}; "
          f"test accuracy {accuracy:.3f}")
    return {"sigma": sigma, "epsilon": eps, "accuracy": accuracy, "steps": STEPS}


if __name__ == "__main__":
    main()
