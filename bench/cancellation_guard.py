"""What the ghost norms' cancellation check costs: one private step with it against the same
step without it, on the same model and microbatch.

    python bench/cancellation_guard.py [--rounds N] [--ghost auto|ghost] [--device cpu|cuda]

The check (dptrain/clipping/contributions.py: ``squared_norms_scaled``, ``cancelled``) reads,
per parameter in ghost form, the rounding scale sum_t |L_t|^2 |R_t|^2 of its ghost sum off the
diagonals of the Gram matrices it builds, and compares; one device sync for all parameters; a
flagged example (none in these batches) is recomputed in float64. Models and batches are
bench/dp_step.py's (GPT-2 4x256, vocabulary 8,192, T 64, B 32; timm nf_resnet26 at 64 px, B 16;
its weight-standardised convs carry their own check, which stays on in both variants).
``--ghost ghost`` puts every matrix in ghost form (the check's largest share). The variant
without the check is the same engine with ``cancelled`` returning None (the diagonals are still
read). The last line is one JSON object: ``guard_over_unguarded`` per model (ratio of medians
of interleaved rounds).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import median, model_variants_bench, ratio_of_medians  # noqa: E402
from dp_step import MODELS, BenchConfig, dptrain_step, gpt2_or_resnet, tiny_config  # noqa: E402


def steps_of(kind: str, cfg: BenchConfig, ghost: str) -> dict:
    from dptrain.clipping import engine

    dev = cfg.device
    s, build, batch, loss_fn = gpt2_or_resnet(kind, cfg)
    B = s.batch_size
    counted = {"flagged": 0, "checks": 0}
    flag = engine.cancelled

    def counting(sq, scale, *rest):
        doubt = flag(sq, scale, *rest)
        if doubt is not None:
            counted["flagged"] += int(doubt.sum())
            counted["checks"] += 1
        return doubt

    def variant(guarded: bool):
        step = dptrain_step(build(s, cfg.seed, dev), loss_fn, batch, B, cfg, "bookkeeping",
                            ghost)

        def run():
            engine.cancelled = counting if guarded else (lambda *args: None)
            try:
                step()
            finally:
                engine.cancelled = flag
        return run

    return {"guarded": variant(True), "unguarded": variant(False)}, counted


def summarize(times, counted) -> tuple[dict, str]:
    r = {"guarded_s": median(times.wall["guarded"]), "unguarded_s": median(times.wall["unguarded"]),
         "guard_over_unguarded": ratio_of_medians(times.wall["guarded"], times.wall["unguarded"]),
         "flagged_examples": counted["flagged"], "parameter_checks": counted["checks"]}
    return r, (f"with the check {r['guarded_s']:.3f} s, without {r['unguarded_s']:.3f} s, "
               f"ratio {r['guard_over_unguarded']:.3f}, flagged {r['flagged_examples']}")


def main(argv: list[str] | None = None) -> dict:
    def ghost_option(ap):
        ap.add_argument("--ghost", default="auto", choices=["auto", "ghost"])

    return model_variants_bench(
        __doc__, argv, lambda kind, cfg, args: steps_of(kind, cfg, args.ghost), summarize,
        make_config=lambda tiny: tiny_config() if tiny else BenchConfig(),
        models=",".join(MODELS[:2]), rounds=7, extra_args=ghost_option)


if __name__ == "__main__":
    main()
