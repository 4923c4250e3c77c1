"""``dptrain audit``: an empirical lower bound on a run's epsilon, from one training run with
gradient canaries (``dptrain.privacy.audit``).

    dptrain audit --config PATH [--canaries M] [--confidence P] [--audit-seed S]
                  [--output FILE.json] [--plot FILE.png] [--force] [key.sub=value ...]

Trains the config's run (every planned release, the same mechanism, on any number of ranks)
with M Dirac gradient canaries in its sums, scores each canary from the releases, and prints the
measured lower bound next to the accountant's epsilon, and checks that the noise at the canaries'
coordinates has the calibrated scale. Exit status 0 when the bound is at most the claim and the
noise is there, 1 when the bound exceeds the claim or the noise is missing or too small
somewhere (the mechanism or its accounting is wrong), 2 on bad input. The trained model is not
written: it holds canaries.
"""

from __future__ import annotations

import argparse
import math
import sys

from dptrain.commands import FIGURES, JSON, check_new_files, require_matplotlib, writing
from dptrain.config import ConfigError, require_file
from dptrain.telemetry import write_json

PROG = "dptrain audit"
DEFAULT_CANARIES = 1000


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "audit", help="empirical epsilon lower bound of a config's run (gradient canaries)",
        description="Train the config's run with M gradient canaries (each included with "
                    "probability 1/2, Poisson-sampled like an example, a clipped query of norm "
                    "C at one coordinate) and bound its epsilon from below from the releases "
                    "(Steinke, Nasr & Jagielski 2023). Exit 1 if the bound exceeds the "
                    "accountant's epsilon. The model is not saved.")
    p.add_argument("--config", required=True, help="YAML run config (see configs/)")
    p.add_argument("--canaries", metavar="M", default=str(DEFAULT_CANARIES),
                   help=f"number of canaries (default {DEFAULT_CANARIES})")
    p.add_argument("--confidence", metavar="P", default="0.95",
                   help="confidence of the lower bound (default 0.95)")
    p.add_argument("--audit-seed", metavar="S", default="0",
                   help="seed of the canaries' coordinates, inclusion and sampling (default 0; "
                        "never the privacy seed)")
    p.add_argument("--output", metavar="FILE.json", default=None, help="write the result as JSON")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="histogram of the included and excluded canaries' scores (matplotlib)")
    p.add_argument("--force", action="store_true", help="overwrite --output/--plot")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config")
    return p


def _number(flag: str, text: str, kind: type):
    try:
        return kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ConfigError(flag, f"must be {what}, got {text!r}") from None


def _parse(args: argparse.Namespace) -> tuple[int, float, int]:
    m = _number("--canaries", args.canaries, int)
    if m < 2:
        raise ConfigError("--canaries", f"must be at least 2, got {m}")
    confidence = _number("--confidence", args.confidence, float)
    if not 0 < confidence < 1:
        raise ConfigError("--confidence", f"must be in (0, 1), got {confidence}")
    seed = _number("--audit-seed", args.audit_seed, int)
    if seed < 0:
        raise ConfigError("--audit-seed", f"must be >= 0, got {seed}")
    require_file("--config", args.config)
    check_new_files((("--output", args.output, JSON), ("--plot", args.plot, FIGURES)),
                    args.force, inputs=(("--config", args.config),))
    if args.plot is not None:
        require_matplotlib("--plot")
    return m, confidence, seed


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from dptrain.config import load
    from dptrain.parallel.dist import check_accelerate_settings
    from dptrain.privacy.audit import (MAX_SUGGESTED_CANARIES, GradientCanaries, audit_scores,
                                       canaries_needed, largest_lower_bound)
    from dptrain.telemetry.progress import LogLines, progress_bar
    from dptrain.trainer import RunConfig, Trainer

    m, confidence, seed = _parse(args)
    check_accelerate_settings()
    cfg = load(RunConfig, args.config, args.overrides)
    trainer = Trainer(cfg)
    shapes = [(n, tuple(p.shape)) for n, p in trainer.named_params]
    total = sum(torch.Size(s).numel() for _, s in shapes)
    if m > total:
        raise ConfigError("--canaries", f"at most the model's {total} trainable coordinates, "
                                      f"got {m}")
    plan = trainer.plan
    trainer.audit = canaries = GradientCanaries(shapes, m, plan.clip_norm, plan.sample_rate, seed,
                                                plan.noise_multiplier)
    main = trainer.rank == 0
    bar = progress_bar(cfg.train.progress and main, total=plan.steps, desc=PROG, unit="step")
    lines = LogLines(plan.steps, 0, rate=not cfg.privacy.secure_mode, prefix=PROG,
                     enabled=cfg.train.progress and main and bar.disable)
    while trainer.step < plan.steps:
        trainer.private_step()
        bar.update(1)
        lines.update(trainer.step)
    bar.close()
    # each canary's coordinate is observed on one rank: the ranks' parts summed
    sums = torch.as_tensor(np.stack([canaries.scores, canaries.noise_squares,
                                     canaries.noise_count]), dtype=torch.float64)
    if trainer.world > 1:
        import torch.distributed as dist

        sums = sums.to(trainer.device)
        dist.all_reduce(sums)
    scores, squares, count = sums.cpu().numpy()
    result = audit_scores(scores, canaries.included, plan.delta, 1 - confidence)
    noise = canaries.noise_check(squares, count)
    claimed = trainer.epsilon()
    consistent = result.epsilon_lower_bound <= claimed and noise["ok"] is not False
    if not main:
        return 0 if consistent else 1
    ceiling = largest_lower_bound(m, plan.delta, 1 - confidence)
    appear = 1 - (1 - plan.sample_rate) ** plan.steps  # P(an included canary is ever sampled)
    report = {
        "config": str(args.config), "claimed_epsilon": claimed, "delta": plan.delta,
        "accountant": plan.accountant, "noise_multiplier": plan.noise_multiplier,
        "sample_rate": plan.sample_rate, "steps": plan.steps, "clip_norm": plan.clip_norm,
        "confidence": confidence, "audit_seed": seed, "world_size": trainer.world,
        **result.as_dict(), "noise_check": noise, "consistent": consistent,
        "largest_possible_bound": ceiling,
        "canaries_ever_sampled": appear,
        # per canary, for other analyses of the same run (ROC, TPR at low FPR, ...); "included"
        # is the number of included canaries (from the result)
        "scores": scores.tolist(), "canary_included": canaries.included.tolist(),
    }
    line = (f"{m} canaries ({result.included} included), {result.correct} of "
            f"{result.guesses} guesses correct: epsilon >= {result.epsilon_lower_bound:.3f} "
            f"with {confidence:.0%} confidence; the accountant's epsilon is {claimed:.3f} "
            f"(delta {plan.delta:.3g}, {plan.accountant})")
    # the verdict first: a write that fails after the run must not take the result with it
    if noise["ok"] is False:
        named = noise["parameters_below"]
        where = [f"{noise['coordinates_below']} of {noise['coordinates_checked']} canary "
                 f"coordinates"] if noise["coordinates_below"] else []
        if named:
            where.append(f"{len(named)} parameter(s) ({', '.join(named[:4])}"
                         f"{', ...' if len(named) > 4 else ''}; variance ratio to (sigma C)^2 "
                         f"down to {noise['smallest_variance_ratio']:.3g})")
        if noise["pool_below"]:
            where.append(f"all canary coordinates together (variance ratio "
                         f"{noise['variance_ratio']:.3g})")
        print(f"{PROG}: the noise is missing or too small at {'; at '.join(where)} "
              f"(chi-square tests at {noise['significance']:.3g} together): the mechanism is "
              f"wrong", file=sys.stderr)
    if result.epsilon_lower_bound <= claimed and noise["ok"] is not False:
        print(f"{PROG}: {line}: consistent")
        if ceiling <= claimed:
            limit = min(total, MAX_SUGGESTED_CANARIES)
            more = canaries_needed(claimed, plan.delta, 1 - confidence, limit=limit)
            print(f"{PROG}: note: with {m} canaries no run can show an epsilon above "
                  f"{ceiling:.2f}, so this audit cannot refute the claim of {claimed:.2f} "
                  + (f"({more} canaries could)" if more else
                     "(no audit can refute an infinite epsilon)" if math.isinf(claimed) else
                     f"(no number of canaries up to {limit} can at delta {plan.delta:.3g}"
                     + (", the model's trainable coordinates" if limit == total else "")
                     + "; the bound's delta term grows with the number of canaries)"),
                  file=sys.stderr)
        if appear < 0.5:
            print(f"{PROG}: note: an included canary is sampled at least once with "
                  f"probability {appear:.2f} (q = {plan.sample_rate:.3g}, {plan.steps} steps): "
                  "most are never in a release, which weakens the audit", file=sys.stderr)
    elif result.epsilon_lower_bound > claimed:
        print(f"{PROG}: {line}: the measured bound EXCEEDS the claim, so the mechanism or its "
              "accounting is wrong", file=sys.stderr)
    else:
        print(f"{PROG}: {line}", file=sys.stderr)
    try:
        if args.output:
            with writing("--output", args.output):
                write_json(args.output, report)
        if args.plot:
            from dptrain.diagnostics.plotting import plot_audit_scores

            with writing("--plot", args.plot):
                plot_audit_scores(scores, canaries.included, args.plot,
                                  title=f"{m} canaries: epsilon >= "
                                        f"{result.epsilon_lower_bound:.3f} (claimed "
                                        f"{claimed:.3f})")
    except ConfigError as e:
        if consistent:
            raise
        # a failed audit's status (1) outranks the failed write's (2): a job that looks for 1
        # must not read a refuted claim as a bad argument
        print(f"{PROG}: error: {e}", file=sys.stderr)
    return 0 if consistent else 1
