"""Median seconds of ``Trainer.private_step`` on the tiny configs, for A/B runs of two trees.

    PYTHONPATH=TREE python bench/trainer_step.py [--tree TREE] [--steps 40]

Builds configs/tiny.yaml (GPT-2 tiny) and configs/tiny_images.yaml (GroupNorm CNN) from TREE
(default: this checkout) with noise multiplier 1.0 and one torch thread, runs one step, then
times ``--steps`` more; prints one JSON object: the tree and each config's median seconds.
Alternate two trees (a ``git worktree`` of the base commit, same virtualenv) a few times and
compare the runs' spread: the whole release loop (sampling, collate, clipping, noise,
optimizer) in one number, on models small enough that per-step overheads show.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    sys.path.insert(0, args.tree)
    import torch

    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    torch.set_num_threads(1)
    out = {"tree": args.tree}
    for name in ("tiny.yaml", "tiny_images.yaml"):
        cfg = load(RunConfig, Path(args.tree) / "configs" / name, [
            "privacy.steps=100000", "privacy.noise_multiplier=1.0", "privacy.epsilon=null",
            "performance.num_threads=1"])
        trainer = Trainer(cfg, None)
        trainer.private_step()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            trainer.private_step()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
