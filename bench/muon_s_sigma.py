"""DP-Muon-S's sigma_1: Lanczos (since 2026-12-02) against the three warm-started power
iterations it replaced, in time per optimizer step and in accuracy against the SVD; and its
default 6 Newton-Schulz steps (since 2026-12-07) against the 5 before, in time and in how far
the update's spectral norm is from lr * sigma_1.

    python bench/muon_s_sigma.py [--width 768] [--layers 1] [--noise 1.0] [--steps 6]
                                 [--rounds 3] [--threads 1] [--device cpu|cuda]

The matrices are a GPT-2 block's (c_attn d x 3d, c_proj d x d, c_fc d x 4d, mlp.c_proj 4d x d,
float32, `--layers` blocks). Each step's "release" is a fixed signal plus `--noise` times a
fresh standard normal (DP releases are noise-dominated: noise 1 to 5). Variants, every one a
whole `MuonS.step` (heavy-ball momentum, sigma_1, Newton-Schulz, update):

- ``power3``: sigma_1 by the earlier method, 3 power iterations warm-started from the last
  step's vector (``top_singular_value`` replaced by that loop for this variant), 5
  Newton-Schulz steps (the earlier default);
- ``lanczos_ns5``: Lanczos on M^T M, stopped at residual 1e-4, at most 50 products; 5 steps;
- ``lanczos``: the default, Lanczos and 6 Newton-Schulz steps.

Accuracy: each variant runs `--steps` steps on the same releases; after each step the relative
error of its sigma_1 against ``torch.linalg.svdvals`` (float64) of its momentum, and the
update's spectral norm over lr * that sigma_1 (1 for the exact U V^T). Timing: interleaved
rounds (bench/common.py) of `--steps` steps each. The last line printed is one JSON object:
seconds per step, ``lanczos_over_power3``, ``ns6_over_ns5``, the errors, the update ratios and
the Lanczos products per step.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import git_commit, load_average, machine_description, median, now_utc, time_interleaved  # noqa: E402

import dptrain.optim.muon as muon  # noqa: E402
from dptrain.optim.muon import MuonS  # noqa: E402


def power3(M, v, num_iters, tol=0.0, reduce=None):
    """The earlier sigma_1: 3 power iterations from ``v`` (its settings ignored)."""
    tiny = torch.finfo(M.dtype).tiny
    sigma = torch.zeros((), dtype=M.dtype, device=M.device)
    for _ in range(3):
        u = M @ v
        u = u / (torch.linalg.vector_norm(u) + tiny)
        w = M.mT @ u
        sigma = torch.linalg.vector_norm(w)
        v = torch.where(sigma > 0, w / (sigma + tiny), v)
    return sigma, v


def shapes(width: int, layers: int) -> list[tuple[str, tuple[int, int]]]:
    d = width
    out = []
    for i in range(layers):
        out += [(f"h.{i}.c_attn", (d, 3 * d)), (f"h.{i}.c_proj", (d, d)),
                (f"h.{i}.c_fc", (d, 4 * d)), (f"h.{i}.mlp_proj", (4 * d, d))]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--noise", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    mats = shapes(args.width, args.layers)
    signal = {n: torch.randn(*s, generator=gen) for n, s in mats}
    releases = [{n: (signal[n] + args.noise * torch.randn(*s, generator=gen)).to(dev)
                 for n, s in mats} for _ in range(args.steps)]
    lanczos = muon.top_singular_value
    products: list[int] = []

    def counting(M, v, num_iters, tol=0.0, reduce=None):
        calls = [0]

        def count(w):
            calls[0] += 1
            if reduce is not None:
                reduce(w)
        out = lanczos(M, v, num_iters, tol, reduce=count)
        products.append(calls[0] - 1)  # (the first call sums the largest entry, not a product)
        return out

    # (sigma_1's method, Newton-Schulz steps: None is MuonS's default)
    methods = {"power3": (power3, 5), "lanczos_ns5": (counting, 5), "lanczos": (counting, None)}
    lr = 1e-3

    def run(name: str, errors: list[float] | None = None, updates: list[float] | None = None):
        params = [(n, torch.nn.Parameter(torch.zeros(*s, device=dev))) for n, s in mats]
        method, ns_steps = methods[name]
        opt = MuonS(params, lr=lr, momentum=0.9,
                    **({} if ns_steps is None else {"ns_steps": ns_steps}))
        muon.top_singular_value = method
        try:
            for rel in releases:
                before = [p.detach().clone() for _, p in params] if errors is not None else []
                for n, p in params:
                    p.grad = rel[n].clone()
                opt.step()
                if errors is not None:
                    for (_, p), w in zip(params, before):
                        st = opt.state[p]
                        s1 = torch.linalg.svdvals(st["momentum_buffer"].double())[0]
                        errors.append(float(abs(st["sigma"].double() - s1) / s1))
                        step = torch.linalg.matrix_norm((p.detach() - w).double(), 2)
                        updates.append(float(step / (lr * s1)))
        finally:
            muon.top_singular_value = lanczos

    errors = {name: [] for name in methods}
    updates = {name: [] for name in methods}
    for name in methods:
        run(name, errors[name], updates[name])
    counted = list(products)
    steps = {name: (lambda name=name: run(name)) for name in methods}
    timings, failed = time_interleaved(steps, rounds=args.rounds, device=args.device)
    if failed:
        raise SystemExit(f"bench/muon_s_sigma.py: {failed}")
    per_step = {n: median(v) / args.steps for n, v in timings.wall.items()}
    summary = {
        "bench": "muon_s_sigma", "date": now_utc(), "commit": git_commit(),
        "machine": machine_description(), "load_average": load_average(),
        "matrices": [f"{n} {s[0]}x{s[1]}" for n, s in mats], "noise": args.noise,
        "steps": args.steps, "rounds": args.rounds, "threads": args.threads,
        "seconds_per_step": per_step,
        "lanczos_over_power3": per_step["lanczos_ns5"] / per_step["power3"],
        "ns6_over_ns5": per_step["lanczos"] / per_step["lanczos_ns5"],
        "max_sigma_error": {n: max(e) for n, e in errors.items()},
        "median_sigma_error": {n: median(e) for n, e in errors.items()},
        "update_over_lr_sigma1": {n: {"min": min(u), "max": max(u)} for n, u in updates.items()},
        "lanczos_products_per_matrix": {"min": min(counted), "median": median(counted),
                                        "max": max(counted)},
    }
    for k in ("seconds_per_step", "max_sigma_error", "median_sigma_error"):
        print(k, {n: f"{v:.3g}" for n, v in summary[k].items()})
    print("update_over_lr_sigma1", {n: f"{u['min']:.4f}-{u['max']:.4f}"
                                    for n, u in summary["update_over_lr_sigma1"].items()})
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
