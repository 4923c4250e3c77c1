"""The one-off cost of the clipping engine's row check (dptrain/clipping/rows.py) against one
private step of the same model and microbatch.

    python bench/rows_check.py [--rounds N] [--threads K] [--device cpu|cuda] [--tiny]

The check runs once per engine, after its first query: three forwards without gradients of the
microbatch (one with example 0 replaced). Models and batches are bench/dp_step.py's (GPT-2
4x256, vocabulary 8,192, T 64, B 32; timm nf_resnet26 at 64 px, B 16). Interleaved rounds time
``check_example_rows`` on its own and the private step (``ClippingEngine.accumulate`` with the
check already done, noise and SGD as dp_step's dptrain variant); the ratio of medians says what
the check adds to the run's first step. The last line printed is one JSON object:
``check_over_step`` per model, and the absolute medians.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

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
from dp_step import (  # noqa: E402
    MODELS,
    BenchConfig,
    build_gpt2,
    build_resnet,
    dptrain_step,
    gpt2_batch,
    gpt2_loss,
    resnet_batch,
    resnet_loss,
    tiny_config,
)


def steps_of(kind: str, cfg: BenchConfig) -> dict:
    from dptrain.clipping import ClippingEngine
    from dptrain.clipping.rows import check_example_rows

    dev = cfg.device
    if kind == "gpt2":
        s = cfg.gpt2
        build, batch, loss_fn = build_gpt2, gpt2_batch(s, cfg.seed, dev), gpt2_loss
    else:
        s = cfg.resnet
        build, batch, loss_fn = build_resnet, resnet_batch(s, cfg.seed, dev), resnet_loss
    B = s.batch_size
    checked = build(s, cfg.seed, dev)
    hooked = [(h.name, h.module) for h in ClippingEngine(checked).hooked]

    def check():
        assert check_example_rows(checked, hooked, loss_fn, batch, B, 0, collective=False)

    return {"check": check,
            "private_step": dptrain_step(build(s, cfg.seed, dev), loss_fn, batch, B, cfg,
                                         "bookkeeping")}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated: gpt2,nfresnet")
    ap.add_argument("--tiny", action="store_true", help="tiny models, for tests")
    args = ap.parse_args(argv)
    cfg = tiny_config() if args.tiny else BenchConfig()
    cfg.device = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = load_average()
    t0 = time.perf_counter()
    out: dict = {"machine": machine_description(args.device), "git_commit": git_commit(),
                 "date": now_utc(), "rounds": args.rounds, "threads": torch.get_num_threads()}
    for kind in (m for m in args.models.split(",") if m):
        times, errors = time_interleaved(steps_of(kind, cfg), rounds=args.rounds, warmup=1,
                                         device=args.device)
        if errors:
            raise SystemExit(f"rows_check: {kind}: {errors}")
        out[kind] = {"check_s": median(times.wall["check"]),
                     "private_step_s": median(times.wall["private_step"]),
                     "check_over_step": ratio_of_medians(times.wall["check"],
                                                         times.wall["private_step"])}
        r = out[kind]
        print(f"{kind}: check {r['check_s']:.3f} s, private step {r['private_step_s']:.3f} s, "
              f"check / step {r['check_over_step']:.2f}", file=sys.stderr)
    out["load_average"] = {"start": load_start, "end": load_average()}
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
