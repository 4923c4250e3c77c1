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

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, model_variants_bench, ratio_of_medians  # noqa: E402
from dp_step import MODELS, BenchConfig, dptrain_step, gpt2_or_resnet, tiny_config  # noqa: E402


def steps_of(kind: str, cfg: BenchConfig) -> dict:
    from dptrain.clipping import ClippingEngine
    from dptrain.clipping.rows import check_example_rows

    dev = cfg.device
    s, build, batch, loss_fn = gpt2_or_resnet(kind, cfg)
    B = s.batch_size
    checked = build(s, cfg.seed, dev)
    hooked = [(h.name, h.module) for h in ClippingEngine(checked).hooked]

    def check():
        assert check_example_rows(checked, hooked, loss_fn, batch, B, 0, collective=False)

    return {"check": check,
            "private_step": dptrain_step(build(s, cfg.seed, dev), loss_fn, batch, B, cfg,
                                         "bookkeeping")}


def summarize(times, _extra) -> tuple[dict, str]:
    r = {"check_s": median(times.wall["check"]),
         "private_step_s": median(times.wall["private_step"]),
         "check_over_step": ratio_of_medians(times.wall["check"], times.wall["private_step"])}
    return r, (f"check {r['check_s']:.3f} s, private step {r['private_step_s']:.3f} s, "
               f"check / step {r['check_over_step']:.2f}")


def main(argv: list[str] | None = None) -> dict:
    return model_variants_bench(__doc__, argv, lambda kind, cfg, args: steps_of(kind, cfg),
                                summarize, make_config=lambda tiny: tiny_config() if tiny
                                else BenchConfig(), models=",".join(MODELS), rounds=5)


if __name__ == "__main__":
    main()
