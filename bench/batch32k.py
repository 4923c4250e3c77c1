"""Memory of a logical batch of 32,768 examples against the microbatch size (issue 5, item 7).

    python bench/batch32k.py [--microbatches 256,1024,4096,32768] [--config configs/batch32k.yaml]

For each microbatch size, a fresh process builds the run of ``configs/batch32k.yaml`` (65,536
synthetic 8x8 images, q = 0.5, tiny CNN, 2 releases), then resets the resident-set high-water
mark (Linux ``clear_refs``; bench/common.py) and takes the config's private steps. Reported per
size: wall seconds per step, the peak resident set during the steps above the resident set
after the build (what the logical batch costs), the peak of the build (imports, the data set)
and the release's checksum (the same for every microbatch size up to float summation order).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)


def child(config: str, microbatch: int) -> dict:
    import torch

    from common import _peak_rss_bytes, _reset_peak_rss
    from dptrain.config import load
    from dptrain.trainer import RunConfig, Trainer

    t0 = time.perf_counter()
    trainer = Trainer(load(RunConfig, config, [f"performance.microbatch_size={microbatch}",
                                               "train.progress=false"]))
    build_s = time.perf_counter() - t0
    build_peak = _peak_rss_bytes()
    base = _reset_peak_rss()
    sizes, steps = [], []
    for s in range(trainer.plan.steps):
        sizes.append(len(trainer.sample(s)))
        t0 = time.perf_counter()
        trainer.private_step()
        steps.append(time.perf_counter() - t0)
    peak = _peak_rss_bytes()
    checksum = float(sum(p.detach().double().sum() for _, p in trainer.named_params))
    return {"microbatch": microbatch, "logical_batches": sizes,
            "microbatches_per_step": [-(-n // microbatch) for n in sizes],
            "step_s": steps, "build_s": build_s,
            "step_peak_above_build_mib": (peak - base) / 2**20,
            "rss_after_build_mib": base / 2**20, "build_peak_mib": build_peak / 2**20,
            "param_checksum": checksum, "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "batch32k.yaml"))
    ap.add_argument("--microbatches", default="256,1024,4096,32768")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        print("RESULT " + json.dumps(child(args.config, args.child)), flush=True)
        return
    from common import git_commit, load_average, machine_description, now_utc

    rows = []
    for mb in [int(x) for x in args.microbatches.split(",")]:
        proc = subprocess.run([sys.executable, __file__, "--config", args.config,
                               "--child", str(mb)], capture_output=True, text=True, timeout=900)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        row = json.loads(line[7:]) if line else {"microbatch": mb, "error": proc.stderr[-500:]}
        rows.append(row)
        if "error" in row:
            print(f"microbatch {mb}: error {row['error']}")
        else:
            print(f"microbatch {mb:6d}: logical batches {row['logical_batches']}, "
                  f"{row['microbatches_per_step']} microbatches, step "
                  f"{', '.join(f'{s:.2f}' for s in row['step_s'])} s, step peak above build "
                  f"{row['step_peak_above_build_mib']:.0f} MiB (after build "
                  f"{row['rss_after_build_mib']:.0f} MiB, build peak "
                  f"{row['build_peak_mib']:.0f} MiB), checksum {row['param_checksum']:.9g}")
    print(json.dumps({"rows": rows, "machine": machine_description(), "load": load_average(),
                      "date": now_utc(), "commit": git_commit()}))


if __name__ == "__main__":
    main()
