"""Cost of Newton–Schulz's overflow-safe normalisation, this tree against a revision.

    python bench/ns_normalise.py [--base d94b1f6] [--rounds 5] [--dtype float32] [--sync-free]

``newton_schulz`` (5 Muon steps) on GPT-2 small's four Muon matrix shapes (c_attn 768 x 2304,
attn c_proj 768 x 768, c_fc 768 x 3072, mlp c_proj 3072 x 768, one of each), with
``dptrain/optim/newton_schulz.py`` of this tree and of ``--base`` loaded into one process,
interleaved (order rotated per round), medians of the rounds. The outputs are checked equal bit
for bit on these ordinary matrices. ``--sync-free`` times this tree's device form of the
overflow rescue (both forms computed, ``torch.where`` picks) on the CPU too, where it otherwise
computes the rescue only for a matrix that needs it. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import (git_commit, load_average, machine_description, module_at,  # noqa: E402
                    now_utc, time_interleaved)

MODULE = "dptrain/optim/newton_schulz.py"
SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="d94b1f6", help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    ap.add_argument("--sync-free", action="store_true",
                    help="this tree's device form of the rescue, on the CPU too")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(shape, generator=g).to(dtype) for shape in SHAPES]
    start = load_average()
    with tempfile.TemporaryDirectory() as tmp:
        tree = importlib.import_module("dptrain.optim.newton_schulz")
        if args.sync_free:
            tree._normalise = functools.partial(tree._normalise, sync_free=True)
        modules = {f"base ({args.base})": module_at(args.base, MODULE, "ns_base", tmp),
                   "this tree" + (" (sync-free)" if args.sync_free else ""): tree}
        outs = {k: [m.newton_schulz(X) for X in mats] for k, m in modules.items()}
        base_out, tree_out = outs.values()
        identical = all(torch.equal(a, b) for a, b in zip(base_out, tree_out))
        steps = {k: (lambda m=m: [m.newton_schulz(X) for X in mats]) for k, m in modules.items()}
        times, errors = time_interleaved(steps, rounds=args.rounds)
    if errors:
        raise SystemExit(f"failed: {errors}")
    medians = {k: statistics.median(v) for k, v in times.wall.items()}
    print(machine_description())
    print(f"load average: {start} at the start, {load_average()} at the end")
    print(f"| newton_schulz, 4 GPT-2 small matrices, {args.dtype} | s per call of all four |")
    print("|---|---|")
    for label, s in medians.items():
        print(f"| {label} | {s:.4f} |")
    base, tree = medians.values()
    print(f"this tree / base: {tree / base:.3f}; outputs bit-identical: {identical}")
    print(json.dumps({"s_per_call": medians, "tree_over_base": tree / base,
                      "bit_identical": identical, "dtype": args.dtype, "rounds": args.rounds,
                      "sync_free": args.sync_free,
                      "commit": git_commit(), "date": now_utc()}))


if __name__ == "__main__":
    main()
