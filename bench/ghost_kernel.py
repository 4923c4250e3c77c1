"""The fused ghost-product kernel (dptrain/kernels/ghost.py) against its PyTorch reference.

For GPT-2 small's four block linears (c_attn 768->2304, attn c_proj 768->768, c_fc 768->3072,
mlp c_proj 3072->768) at microbatch B and sequence lengths T, times per-example squared norms
(``u = v``: the kernel computes the upper triangle of tiles) and cross products of two states
(``u != v``, inner momentum's cross terms), and the peak memory above the inputs. Prints a table
and, last, one JSON object: per T, reference time / kernel time and kernel peak / reference peak.

    python bench/ghost_kernel.py --device cuda             # the measurement (GPU)
    TRITON_INTERPRET=1 python bench/ghost_kernel.py --device cpu --tiny   # plumbing only

On CPU the kernel only runs under Triton's interpreter (numpy, not a speed measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, time_interleaved  # noqa: E402

from dptrain.kernels.ghost import available, outer_inner, outer_inner_reference  # noqa: E402

GPT2_SMALL = {"c_attn": (2304, 768), "attn.c_proj": (768, 768), "c_fc": (3072, 768),
              "mlp.c_proj": (768, 3072)}
TINY = {"a": (48, 16), "b": (16, 40)}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak(fn, device):
    """Peak bytes allocated by ``fn`` above what was allocated before (CUDA), else None."""
    if device.type != "cuda":
        return None
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    _sync(device)
    return torch.cuda.max_memory_allocated(device) - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-lens", default="128,256,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="small shapes (plumbing check)")
    args = ap.parse_args()
    device = torch.device(args.device)
    why = available(device)
    if why is not None:
        raise SystemExit(f"bench/ghost_kernel.py: {why}")
    layers = TINY if args.tiny else GPT2_SMALL
    seq_lens = [int(t) for t in args.seq_lens.split(",")] if not args.tiny else [20, 40]
    B = 2 if args.tiny else args.batch
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the engine's norms are exact float32
    g = torch.Generator(device=device).manual_seed(0)
    rows, summary = [], {}
    for T in seq_lens:
        tot = {"ref_self": 0.0, "k_self": 0.0, "ref_cross": 0.0, "k_cross": 0.0}
        peaks = {"ref": 0, "k": 0}
        max_err = max_cross_err = 0.0
        for name, (O, I) in layers.items():
            L = torch.randn(B, T, O, device=device, generator=g)
            R = torch.randn(B, T, I, device=device, generator=g)
            L2 = torch.randn(B, T, O, device=device, generator=g)
            R2 = torch.randn(B, T, I, device=device, generator=g)
            ref = outer_inner_reference(L.double(), R.double())
            max_err = max(max_err, float(((outer_inner(L, R).double() - ref).abs() / ref).max()))
            # the cross term can vanish: its error against the Cauchy-Schwarz bound of its size
            ref2 = outer_inner_reference(L2.double(), R2.double())
            cross = outer_inner_reference(L.double(), R.double(), L2.double(), R2.double())
            max_cross_err = max(max_cross_err, float((
                (outer_inner(L, R, L2, R2).double() - cross).abs() / (ref * ref2).sqrt()).max()))
            # interleaved rounds (bench/common.py); the warm-up call compiles the kernel
            times, errors = time_interleaved({
                "ref_self": lambda: outer_inner_reference(L, R),
                "k_self": lambda: outer_inner(L, R),
                "ref_cross": lambda: outer_inner_reference(L, R, L2, R2),
                "k_cross": lambda: outer_inner(L, R, L2, R2)}, rounds=args.rounds,
                device=device.type)
            if errors:
                raise SystemExit(f"bench/ghost_kernel.py: {errors}")
            t_rs, t_ks, t_rc, t_kc = (median(times.wall[k]) for k in tot)
            p_r = _peak(lambda: outer_inner_reference(L, R), device)
            p_k = _peak(lambda: outer_inner(L, R), device)
            for k, v in zip(tot, (t_rs, t_ks, t_rc, t_kc)):
                tot[k] += v
            if p_r is not None:
                peaks["ref"] = max(peaks["ref"], p_r)
                peaks["k"] = max(peaks["k"], p_k)
            rows.append((T, name, t_rs, t_ks, t_rc, t_kc, p_r, p_k))
        summary[T] = {
            "self_ref_over_kernel": round(tot["ref_self"] / tot["k_self"], 3),
            "cross_ref_over_kernel": round(tot["ref_cross"] / tot["k_cross"], 3),
            "peak_kernel_over_ref": (round(peaks["k"] / peaks["ref"], 4)
                                     if peaks["ref"] else None),
            "max_rel_err_vs_float64": max_err,
            "max_cross_err_vs_float64": max_cross_err,  # (relative to sqrt(self x self'))
        }
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({name}), B {B}, float32 (no TF32), medians of {args.rounds} interleaved rounds")
    print("| T | layer | ref self ms | kernel self ms | ref cross ms | kernel cross ms | "
          "ref peak MiB | kernel peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for T, name, a, b, c, d, pr, pk in rows:
        mib = (lambda x: "" if x is None else f"{x / 2**20:.1f}")
        print(f"| {T} | {name} | {a * 1e3:.2f} | {b * 1e3:.2f} | {c * 1e3:.2f} | {d * 1e3:.2f} | "
              f"{mib(pr)} | {mib(pk)} |")
    print(json.dumps({"device": str(device), "batch": B, "by_seq_len": summary}))


if __name__ == "__main__":
    main()
