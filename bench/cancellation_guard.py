"""What the ghost norms' cancellation check costs: one private step with it against the same
step without it, on the same model and microbatch.

    python bench/cancellation_guard.py [--rounds N] [--ghost auto|ghost] [--device cpu|cuda]

The check (dptrain/clipping/contributions.py: ``squared_norms_scaled``, ``cancelled``) reads, per
parameter in ghost form, the rounding scale sum_t |L_t|^2 |R_t|^2 of its ghost sum off the
diagonals of the Gram matrices it builds, and compares; one device sync for all parameters; a
flagged example (none in these batches) is recomputed in float64. Models and batches are bench/dp_step.py's (GPT-2
4x256, vocabulary 8,192, T 64, B 32; timm nf_resnet26 at 64 px, B 16; its weight-standardised
convs carry their own check, which stays on in both variants). ``--ghost ghost`` puts every
matrix in ghost form (the check's largest share). The variant without the check is the same
engine with ``cancelled`` returning None (the diagonals are still read). The last line is one JSON object:
``guard_over_unguarded`` per model (ratio of medians of interleaved rounds).
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


def steps_of(kind: str, cfg: BenchConfig, ghost: str) -> dict:
    from dptrain.clipping import engine

    dev = cfg.device
    if kind == "gpt2":
        s, build = cfg.gpt2, build_gpt2
        batch, loss_fn = gpt2_batch(s, cfg.seed, dev), gpt2_loss
    else:
        s, build = cfg.resnet, build_resnet
        batch, loss_fn = resnet_batch(s, cfg.seed, dev), resnet_loss
    B = s.batch_size
    counted = {"flagged": 0, "checks": 0}
    flag = engine.cancelled

    def counting(sq, scale):
        doubt = flag(sq, scale)
        if doubt is not None:
            counted["flagged"] += int(doubt.sum())
            counted["checks"] += 1
        return doubt

    def variant(guarded: bool):
        step = dptrain_step(build(s, cfg.seed, dev), loss_fn, batch, B, cfg, "bookkeeping",
                            ghost)

        def run():
            engine.cancelled = counting if guarded else (lambda sq, scale: None)
            try:
                step()
            finally:
                engine.cancelled = flag
        return run

    return {"guarded": variant(True), "unguarded": variant(False)}, counted


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ghost", default="auto", choices=["auto", "ghost"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", default=",".join(MODELS[:2]),
                    help="comma-separated: gpt2,nfresnet")
    ap.add_argument("--tiny", action="store_true", help="tiny models, for tests")
    args = ap.parse_args(argv)
    cfg = tiny_config() if args.tiny else BenchConfig()
    cfg.device = args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = load_average()
    t0 = time.perf_counter()
    out: dict = {"machine": machine_description(args.device), "git_commit": git_commit(),
                 "date": now_utc(), "rounds": args.rounds, "ghost": args.ghost,
                 "threads": torch.get_num_threads()}
    for kind in (m for m in args.models.split(",") if m):
        steps, counted = steps_of(kind, cfg, args.ghost)
        times, errors = time_interleaved(steps, rounds=args.rounds, warmup=1, device=args.device)
        if errors:
            raise SystemExit(f"cancellation_guard: {kind}: {errors}")
        out[kind] = {"guarded_s": median(times.wall["guarded"]),
                     "unguarded_s": median(times.wall["unguarded"]),
                     "guard_over_unguarded": ratio_of_medians(times.wall["guarded"],
                                                              times.wall["unguarded"]),
                     "flagged_examples": counted["flagged"],
                     "parameter_checks": counted["checks"]}
        r = out[kind]
        print(f"{kind}: with the check {r['guarded_s']:.3f} s, without {r['unguarded_s']:.3f} s, "
              f"ratio {r['guard_over_unguarded']:.3f}, flagged {r['flagged_examples']}",
              file=sys.stderr)
    out["load_average"] = {"start": load_start, "end": load_average()}
    out["elapsed_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
