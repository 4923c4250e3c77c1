"""How much slower are per-example weight-gradient products than the weight gradients of a
non-private backward, at the same shapes? (The floor of inner momentum's marginal cost.)

An extra model state of DP-Muon-IM (issue 4) costs one forward, one activation-only backward
and, for every weight matrix, the per-example products ``u_b += a_j * G_b^T X_b`` added into the
per-example buffer (``dptrain.clipping.contributions.add_instantiated``, one ``baddbmm_`` per
layer). The non-private step costs one forward and one backward whose weight gradients are ONE
product per layer over all B*T rows (``G^T X``). The forwards and activation backwards are the
same operations in both, and the products have the same multiply-adds as the weight gradients,
so

    marginal time per extra state / non-private step  ~=  1 + (t_products - t_wgrad) / t_nonprivate

which is above 1 exactly when the per-example products (inner dimension T) run slower per
multiply-add than the weight gradients (inner dimension B*T). This script measures the three
times in one interleaved run, at the GPT-2 shapes of ``bench/inner_momentum.py``, and prints that
implied floor; its last line is one JSON object.

    python bench/per_example_products.py                 # T = 64 and 128, B = 16
    python bench/per_example_products.py --seq-lens 64 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    git_commit,
    load_average,
    machine_description,
    median,
    now_utc,
    ratio_of_medians,
    time_interleaved,
)
from gpt2_bench import build_gpt2, gpt2_batch  # noqa: E402

import inner_momentum as im  # noqa: E402  (its GPT-2 shape, loss and non-private step)


def weight_shapes(model: torch.nn.Module) -> list[tuple[str, int, int]]:
    """(name, out, in) of every weight matrix whose gradient is a product over tokens: the
    blocks' Conv1D layers (stored (in, out)) and the (tied) lm_head."""
    from transformers.pytorch_utils import Conv1D

    out = []
    for name, m in model.named_modules():
        if isinstance(m, Conv1D):
            d_in, d_out = m.weight.shape
            out.append((name, d_out, d_in))
    V, d = model.lm_head.weight.shape
    out.append(("lm_head", V, d))
    return out


def make_factors(shapes, B: int, T: int, seed: int, device: str):
    """Random output gradients G (B, T, out) and inputs X (B, T, in) for each layer."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [(torch.randn(B, T, o, generator=g).to(device), torch.randn(B, T, i, generator=g).to(device))
            for _, o, i in shapes]


def products_step(factors, alpha: float = 0.5, in_out: list[bool] | None = None):
    """The engine's multi-state accumulation for one extra state: u_b += alpha * G_b^T X_b for
    every layer, into per-example buffers allocated once (as the engine's reused workspace).
    ``in_out[k]``: layer k's weight is stored (in, out), as transformers' Conv1D stores it, so
    the engine's rule forms ``Outer(X, G)`` (a buffer (B, in, out), u_b += alpha * X_b^T G_b);
    else (the lm_head, an nn.Linear) ``Outer(G, X)``."""
    from dptrain.clipping.contributions import Outer, add_instantiated

    in_out = in_out or [False] * len(factors)
    bufs = [torch.zeros(G.shape[0], G.shape[-1] * X.shape[-1], device=G.device) for G, X in factors]

    def step():
        for buf, (G, X), t in zip(bufs, factors, in_out):
            add_instantiated(buf, Outer(X, G) if t else Outer(G, X), alpha)

    step.bufs = bufs
    return step


def wgrad_step(factors):
    """The non-private backward's weight gradients: one G^T X over all B*T rows per layer."""
    out: list[Tensor] = []

    def step():
        out.clear()
        for G, X in factors:
            out.append(G.reshape(-1, G.shape[-1]).T @ X.reshape(-1, X.shape[-1]))

    step.out = out
    return step


def measure(shape, *, rounds: int, device: str, seed: int = 0) -> dict:
    """One interleaved run of the three steps at ``shape`` (bench/inner_momentum.GPT2Shape):
    the non-private step is inner_momentum.py's (same loss, SGD)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_gpt2(shape, seed, device)
    batch = gpt2_batch(shape, seed, device)
    shapes = weight_shapes(model)
    factors = make_factors(shapes, shape.batch_size, shape.seq_len, seed, device)
    steps = {"nonprivate": im.nonprivate_step(model, batch, im.BenchConfig()),
             "wgrad": wgrad_step(factors),
             "products": products_step(factors, in_out=[n != "lm_head" for n, _, _ in shapes])}
    times, errors = time_interleaved(steps, rounds=rounds, warmup=1, device=device)
    if errors:
        raise RuntimeError(f"failed: {errors}")
    w = times.wall
    t_np, t_wg, t_pr = (median(w[k]) for k in ("nonprivate", "wgrad", "products"))
    macs = sum(shape.batch_size * shape.seq_len * o * i for _, o, i in shapes)
    return {
        "B": shape.batch_size, "T": shape.seq_len, "layers": len(shapes),
        "gmacs": macs / 1e9,
        "nonprivate_s": t_np, "wgrad_s": t_wg, "products_s": t_pr,
        "products_over_wgrad": ratio_of_medians(w["products"], w["wgrad"]),
        "implied_marginal_floor": 1.0 + (t_pr - t_wg) / t_np,
        "wgrad_gmac_per_s": macs / 1e9 / t_wg, "products_gmac_per_s": macs / 1e9 / t_pr,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-lens", default="64,128", help="comma-separated T values")
    ap.add_argument("--batch-size", type=int, default=None, help="B (default 16)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--tiny", action="store_true", help="tiny model, for tests")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    base = im.tiny_config().gpt2 if args.tiny else im.GPT2Shape()
    print(f"# {now_utc()}  commit {git_commit()}  load {load_average()}")
    print(f"# {machine_description(args.device)}, {torch.get_num_threads()} torch thread(s)")
    rows = []
    for T in (int(t) for t in args.seq_lens.split(",")):
        shape = im.GPT2Shape(**{**base.__dict__, "seq_len": T,
                                        "batch_size": args.batch_size or base.batch_size})
        rows.append(measure(shape, rounds=args.rounds, device=args.device))
    print("| T | B | GMAC | non-private s | weight grads s (GMAC/s) | per-example products s "
          "(GMAC/s) | products / weight grads | implied marginal floor |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['B']} | {r['gmacs']:.2f} | {r['nonprivate_s']:.3f} | "
              f"{r['wgrad_s']:.3f} ({r['wgrad_gmac_per_s']:.1f}) | {r['products_s']:.3f} "
              f"({r['products_gmac_per_s']:.1f}) | {r['products_over_wgrad']:.2f} | "
              f"{r['implied_marginal_floor']:.2f} |")
    summary = {"rows": rows, "device": args.device}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
