"""``dptrain diagnose``: geometry probes of a checkpoint on the public probe set.

    dptrain diagnose --run DIR | --checkpoint PATH [--config PATH] [--probe-examples M]
                     [--params REGEX] [--compare-im K,GAMMA[,K_OTHER,GAMMA_OTHER]]
                     [--clip-norm C]
                     [--output FILE.json] [--plot FILE.png] [--force] [key.sub=value ...]

Rebuilds the run from the checkpoint's stored config (or ``--config``), loads the checkpoint and
reports, for each Muon matrix, how clipping changes the mean gradient of M test-split examples
(polar and cosine error, clipping residual, eta_R, SNR against the release noise, effective rank,
spectral gap, Wedin threshold); ``--compare-im`` adds the inner-momentum query. The computation
lives in ``dptrain.diagnostics.probes``; docs/diagnostics.md describes the output.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from dptrain.commands import FIGURES, JSON, check_new_files, require_matplotlib, writing
from dptrain.config import ConfigError, require_file
from dptrain.telemetry import write_json

PROG = "dptrain diagnose"
DEFAULT_PROBE_EXAMPLES = 64


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "diagnose", help="geometry probes of a checkpoint (polar error, clipping residual, ...)",
        description="Probe a checkpoint's Muon matrices on M examples of the public test split: "
                    "polar/cosine error of the clipped mean gradient against the unclipped "
                    "one, clipping residual and eta_R, SNR against the release noise, effective "
                    "rank, spectral gap, Wedin threshold; optionally the inner-momentum query "
                    "(--compare-im). Diagnostics computed on private records are not covered by "
                    "the run's privacy guarantee; the probe set here is the public test split.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", metavar="DIR", help="a run directory: its newest complete checkpoint")
    src.add_argument("--checkpoint", metavar="PATH", help="a checkpoint directory "
                                                          "(DIR/checkpoints/step-...)")
    p.add_argument("--config", metavar="PATH", default=None,
                   help="rebuild the run from this YAML instead of the checkpoint's stored config "
                        "(privacy, model and data must match the checkpoint)")
    p.add_argument("--probe-examples", metavar="M", default=str(DEFAULT_PROBE_EXAMPLES),
                   help=f"test-split examples to probe, evenly spaced (default "
                        f"{DEFAULT_PROBE_EXAMPLES}; at most the split's size)")
    p.add_argument("--params", metavar="REGEX", default=None,
                   help="probe only the Muon matrices whose name matches (re.search); default: "
                        "every matrix of a muon/muon_bc/muon_s group")
    p.add_argument("--compare-im", metavar="K,GAMMA", default=None,
                   help="also probe the inner-momentum query over the checkpoint's last K states "
                        "(K,GAMMA for every parameter, or K,GAMMA,K_OTHER,GAMMA_OTHER for the "
                        "Muon and the other parameters); the checkpoint must hold K past states")
    p.add_argument("--clip-norm", metavar="C", default=None,
                   help="clip the probe examples at C instead of the run's clip norm (what "
                        "clipping at C does to the same checkpoint's geometry; the SNR and "
                        "Wedin threshold then take the noise sigma*C/b a run at C would add)")
    p.add_argument("--output", metavar="FILE.json", default=None,
                   help="write the report as JSON (default with --run: DIR/diagnostics.json)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="write the singular-value spectra of the unclipped and clipped means "
                        "of the first 3 selected matrices (needs matplotlib; choose with "
                        "--params)")
    p.add_argument("--force", action="store_true", help="overwrite --output/--plot if they exist")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the config "
                                                "(e.g. performance.device=cpu)")
    from dptrain.commands.calibrate import accept_negative_values

    accept_negative_values(p)  # --compare-im -1,0.5 and --probe-examples -3: a range error
    return p


def _probe_examples(text) -> int:
    try:
        m = int(str(text).strip())
    except ValueError:
        raise ConfigError("--probe-examples", f"expected an integer >= 1, got {text!r}") from None
    if m < 1:
        raise ConfigError("--probe-examples", f"must be >= 1, got {m}")
    return m


def _fmt(x, width: int = 9) -> str:
    if x is None:
        return f"{'-':>{width}}"
    if isinstance(x, bool):
        return f"{str(x):>{width}}"
    if isinstance(x, int):  # (a batch size past 9 digits in the width, as a float is)
        return f"{x:>{width}d}" if abs(x) < 10 ** width else f"{x:>{width}.4g}"
    if isinstance(x, float) and not math.isfinite(x):
        return f"{str(x):>{width}}"
    return f"{x:>{width}.4g}"


UNDEFINED = "undef"
UNDEFINED_NOTE = (f"{UNDEFINED}: the current-only value is 0 up to float rounding (<= 1e-6; "
                  "e.g. nothing clipped, so the clipped mean is the reference) or not finite, "
                  "and a relative difference is undefined")


def _pct(x: float, width: int = 9) -> str:
    """A relative difference as a percentage; ``undef`` where it is not a number (the
    current-only value is 0 or not finite)."""
    text = UNDEFINED if not math.isfinite(x) else f"{100 * x:+.1f}%"
    return f"{text:>{width}}"


COLUMNS = [("e_pol", "polar_error"), ("e_cos", "cosine_error"), ("eta_R", "eta_R"),
           ("|R|", "residual_norm"), ("sig_lam", "sigma_lambda"), ("sig_G", "sigma_G"),
           ("SNR", "expected_snr"), ("r_eff", "effective_rank"), ("rel_gap", "relative_gap"),
           ("B*", "wedin_threshold")]


def render(report: dict) -> str:
    """The human-readable table of a report."""
    lines = []
    rel = report["release"]
    probe = report["probe"]
    lines.append(f"dptrain diagnose: {report['checkpoint']} (step {report['step']}, config from "
                 f"{report['config_source']})")
    lines.append(f"probe set: {probe['num_examples']} of {probe['test_size']} examples of the "
                 f"PUBLIC test split ({probe['selection']}; {probe['model_mode']})")
    own = rel.get("run_clip_norm", rel["clip_norm"])
    given = (f" (--clip-norm; the run's C is {own:.4g})" if own != rel["clip_norm"] else "")
    lines.append(f"release: sigma {rel['noise_multiplier']:.4g}, C {rel['clip_norm']:.4g}"
                 f"{given}, b {rel['denominator']}, noise std sigma*C/b {rel['noise_std']:.4g}")
    for q, st in report["clip_factors"].items():
        lines.append(f"clip factors ({q} query): mean {st['mean_lambda']:.4g}, min "
                     f"{st['min_lambda']:.4g}, clipped {100 * st['fraction_clipped']:.1f}%")
    im = report.get("compare_im")
    if im:
        other = (f"K {im['k_other']}, gamma {im['gamma_other']:g} (other parameters)"
                 if im.get("other_parameters", 1) else "no other parameters")
        lines.append(f"inner-momentum query: K {im['k_muon']}, gamma {im['gamma_muon']:g} (Muon "
                     f"matrices), {other}; {im['history_states']} past states in the "
                     f"checkpoint")
    lines.append("")
    names = list(report["matrices"])
    w = max([len("matrix")] + [len(n) for n in names])
    head = f"{'matrix':<{w}}  {'query':<8}" + "".join(f"{h:>10}" for h, _ in COLUMNS)
    lines.append(head)
    lines.append("-" * len(head))
    for n in names:
        e = report["matrices"][n]
        first = True
        for q, c in e["candidates"].items():
            label = n if first else ""
            first = False
            cells = "".join(" " + _fmt(c.get(k)) for _, k in COLUMNS)
            lines.append(f"{label:<{w}}  {q:<8}" + cells)
        if "relative_difference" in e:
            d = e["relative_difference"]
            lines.append(f"{'':<{w}}  {'im/cur-1':<8}" + "".join(
                " " + (_pct(d[k]) if k in d else f"{'':>9}") for _, k in COLUMNS))
    lines.append("")
    lines.append("reference = unclipped mean gradient of the probe examples; e_pol/e_cos: clipped "
                 "mean vs reference; clipped mean = mean(lambda) * mean gradient + R; eta_R: "
                 "||R|| / ||mean(lambda) * mean gradient||; |R|: ||R||; sig_lam, sig_G: std of "
                 "the clip factors and of the gradients (||R|| <= sig_lam * sig_G); SNR: "
                 "||clipped mean|| / (sigma*C/b*sqrt(r*c)); r_eff: effective rank; rel_gap: "
                 "(s1 - s2) / s1; B*: Wedin threshold of the clipped mean (docs/diagnostics.md)")
    if any("relative_difference" in e for e in report["matrices"].values()):
        lines.append("im/cur-1: the inner-momentum query's value over the current-only one's, "
                     "minus 1 (negative: lower with inner momentum)")
    if im:
        parts = []
        for k, s in im["relative_difference"].items():
            parts.append(f"{k} {_pct(s['mean'], 0)} (mean), IM lower in {s['im_lower']}"
                         f"/{s['matrices']}")
        lines.append("IM vs current-only (before noise and outer momentum): " + "; ".join(parts))
        undefined = any(not math.isfinite(v) for e in report["matrices"].values()
                        for v in e.get("relative_difference", {}).values())
        undefined |= any(not math.isfinite(s["mean"]) for s in im["relative_difference"].values())
        if undefined:
            lines.append(UNDEFINED_NOTE)
    lines.append("")
    lines.append("privacy: " + report["privacy_note"])
    lines.append("probe set: " + report["probe_note"])
    return "\n".join(lines)


def _note_a_later_end(run_dir: Path, path: Path) -> None:
    """A finished run whose newest checkpoint is older than its end (one written on a stop
    signal, or every few steps) is diagnosed at that checkpoint: say so."""
    import json

    from dptrain import checkpoint as ckpt

    try:
        steps = json.loads((run_dir / "summary.json").read_text()).get("steps")
    except (OSError, ValueError, AttributeError):
        return
    step = ckpt.checkpoint_step(path)
    if isinstance(steps, int) and step is not None and steps > step:
        print(f"{PROG}: note: the run finished at step {steps}; its newest checkpoint, "
              f"diagnosed here, is step {step} (the probes need a checkpoint's optimizer "
              f"state, which final/ does not hold)", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from dptrain.diagnostics.probes import (ImQuery, check_clip_norm, diagnose, load_run,
                                            resolve_checkpoint)

    # Everything that can be checked without loading the run, first.
    m = _probe_examples(args.probe_examples)
    clip_norm = check_clip_norm(args.clip_norm) if args.clip_norm is not None else None
    query = ImQuery.parse(args.compare_im) if args.compare_im is not None else None
    if args.params is not None:
        import re

        try:
            re.compile(args.params)
        except re.error as e:
            raise ConfigError("--params", f"not a valid regex: {e}") from None
    if args.run is not None and not Path(args.run).is_dir():
        raise ConfigError("--run", f"no run directory at {args.run}")
    output = Path(args.output) if args.output else (
        Path(args.run) / "diagnostics.json" if args.run is not None else None)
    plot = Path(args.plot) if args.plot else None
    if args.config is not None:
        require_file("--config", args.config)
    check_new_files((("--output", output, JSON), ("--plot", plot, FIGURES)), args.force,
                    inputs=(("--config", args.config),))
    if plot is not None:
        require_matplotlib("--plot")

    path = resolve_checkpoint(run_dir=args.run, checkpoint=args.checkpoint)
    if args.run is not None:
        _note_a_later_end(Path(args.run), path)
    run_ = load_run(path, config_path=args.config, overrides=args.overrides,
                    clip_norm=clip_norm)
    if run_.relocated:
        print(f"{PROG}: note: other files or test settings than the checkpoint's "
              f"({'; '.join(run_.relocated)}); the probe records must be held out from "
              f"training and public", file=sys.stderr)
    n_test = len(run_.task.test)
    if m > n_test:
        print(f"{PROG}: note: the test split has {n_test} examples; probing all of them",
              file=sys.stderr)
    report, spectra = diagnose(run_, probe_examples=m, params=args.params, compare_im=query)

    print(render(report))
    if output is not None:
        with writing("--output", output):
            write_json(output, report)
        print(f"wrote {output}")
    if plot is not None:
        from dptrain.diagnostics import plot_spectra
        from dptrain.diagnostics.probes import PLOT_MAX_MATRICES, spectra_for_plot

        curves, left_out = spectra_for_plot(spectra)
        if left_out:
            print(f"{PROG}: note: --plot shows the first {PLOT_MAX_MATRICES} of "
                  f"{PLOT_MAX_MATRICES + left_out} matrices; choose others with --params",
                  file=sys.stderr)
        with writing("--plot", plot):
            rel = report["release"]
            at = (f", clipped at C = {rel['clip_norm']:g}"
                  if rel["clip_norm"] != rel["run_clip_norm"] else "")
            plot_spectra(curves, plot, title=f"Singular-value spectra, step {report['step']} "
                                             f"(public probe set{at})")
        print(f"wrote {plot}")
    return 0
