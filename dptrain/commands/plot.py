"""``dptrain plot``: a run's metrics over its steps as one figure, or several runs' overlaid.

    dptrain plot --run DIR [DIR ...] [--output FILE.png] [--force]

Reads ``DIR/metrics.jsonl`` (and ``DIR/summary.json`` once the run has finished, for the final
test metrics) and draws one panel per quantity: the training and test losses, epsilon spent,
each parameter group's learning rate, peak memory (with NVML's device memory on CUDA), GPU
utilisation and power, and every other test metric
(``dptrain.diagnostics.plotting.metric_series``). A run still in progress can be plotted: a
last line it is writing is left out. Values that are not finite (a run that diverged) are not
drawn, and said on stderr. The default output is ``DIR/metrics.png``; an existing file is kept
unless ``--force``. Several runs (``--run A B``, or ``--run`` repeated) share the panels, each
curve labelled with its run's directory name, and need ``--output``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dptrain.commands import FIGURES, check_new_file, require_matplotlib, writing
from dptrain.config import ConfigError

PROG = "dptrain plot"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plot", help="a run's metrics over its steps as a PNG (loss, epsilon, lr, memory, ...)",
        description="Draw a run's metrics.jsonl (and its summary.json's final test metrics) as "
                    "one PNG, one panel per quantity against the step; several runs share the "
                    "panels.")
    p.add_argument("--run", metavar="DIR", required=True, nargs="+", action="extend",
                   help="a run directory (--output-dir of dptrain train); several, or --run "
                        "repeated, are drawn in the same panels")
    p.add_argument("--output", metavar="FILE.png", default=None,
                   help="where to write the figure, .png, .pdf or .svg (default "
                        "DIR/metrics.png for one run; needed for several)")
    p.add_argument("--force", action="store_true", help="overwrite --output if it exists")
    return p


def read_rows(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``; an unreadable last line (one being written) is left
    out with a note, one elsewhere is an error naming its line."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ConfigError("--run", f"cannot read {path}: {e.strerror or e}") from None
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:  # bytes: a line cut inside a multi-byte character is an incomplete line too
            rows.append(json.loads(line.decode("utf-8")))
        except (UnicodeDecodeError, json.JSONDecodeError):
            if i == len(lines):
                print(f"{PROG}: note: {path}:{i} is incomplete (still being written?); "
                      "left out", file=sys.stderr)
                continue
            raise ConfigError("--run", f"{path}:{i} is not a JSON line") from None
        step = rows[-1].get("step") if isinstance(rows[-1], dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            raise ConfigError("--run", f"{path}:{i} is not a metrics row (no integer step)")
    return rows


def read_summary(path: Path) -> dict | None:
    """A finished run's ``summary.json`` (None when there is none yet); ConfigError naming
    ``--run`` when it is not what ``dptrain train`` writes."""
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError("--run", f"{path} is unreadable: {e}") from None
    ok = (isinstance(summary, dict) and isinstance(summary.get("steps"), int)
          and isinstance(summary.get("metrics", {}), dict))
    if not ok:
        raise ConfigError("--run", f"{path} is not a run summary (an object with an integer "
                                   "steps and a metrics mapping)")
    return summary


def run(args: argparse.Namespace) -> int:
    run_dirs = [Path(r) for r in args.run]
    seen: dict[Path, Path] = {}
    for run_dir in run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            raise ConfigError("--run", f"no metrics.jsonl in {run_dir}")
        key = run_dir.resolve()
        if key in seen:
            raise ConfigError("--run", f"{run_dir} is given twice (as {seen[key]})")
        seen[key] = run_dir
    if args.output is None and len(run_dirs) > 1:
        raise ConfigError("--output", f"needed with several runs ({len(run_dirs)} given): "
                                      f"where to write the figure")
    output = Path(args.output) if args.output is not None else run_dirs[0] / "metrics.png"
    check_new_file("--output", output, args.force, FIGURES)
    require_matplotlib("--output")
    from dptrain.diagnostics.plotting import metric_series, plot_metrics

    names = _labels(run_dirs)
    series: dict = {}
    titles = []
    for run_dir, name in zip(run_dirs, names):
        metrics = run_dir / "metrics.jsonl"
        rows = read_rows(metrics)
        summary = read_summary(run_dir / "summary.json")
        left_out: dict[str, list[int]] = {}
        one = metric_series(rows, summary, left_out)
        for label, steps in left_out.items():
            # (epsilon comes from the ledger, not the model: not finite only without noise)
            why = ("is infinite at {}: the run adds no noise (privacy.noise_multiplier 0, or "
                   "below 1e-100); not drawn" if label == "epsilon" else
                   "is not a finite number at {}; not drawn (did the run diverge?)")
            print(f"{PROG}: note: {name}: {label} {why.format(_steps(steps))}",
                  file=sys.stderr)
        if not one:
            if len(run_dirs) == 1:
                raise ConfigError("--run", f"{metrics} has no numbers to draw yet")
            # (a run of a sweep that has not logged its first row: the others are drawn)
            print(f"{PROG}: note: {name}: {metrics} has no numbers to draw yet; left out",
                  file=sys.stderr)
            continue
        for panel, curves in one.items():
            merged = series.setdefault(panel, {})
            for label, curve in curves.items():
                merged[label if len(run_dirs) == 1 else f"{name}: {label}"] = curve
        last = rows[-1] if rows else {}
        eps = summary.get("epsilon") if summary else last.get("epsilon")
        steps = summary["steps"] if summary else last.get("step")
        titles.append(f"{name}: step {steps}" + (
            f", epsilon {eps:.3f}" if isinstance(eps, (int, float)) else ""))
    if not series:
        raise ConfigError("--run", "none of the runs has numbers to draw yet")
    with writing("--output", output, printed=False):
        plot_metrics(series, output, title="\n".join(titles),
                     runs=names if len(run_dirs) > 1 else None)
    print(f"{PROG}: wrote {output} ({len(series)} panels: {', '.join(series)})")
    return 0


def _labels(run_dirs: list[Path]) -> list[str]:
    """What each run's curves are called: its directory's name, or its resolved path where two
    runs share a name (``a/run`` and ``b/run``); unique, since no run is given twice (a path
    holds a "/", a name does not)."""
    names = [d.resolve().name for d in run_dirs]
    return [n if names.count(n) == 1 else str(d.resolve()) for n, d in zip(names, run_dirs)]


def _steps(steps: list[int]) -> str:
    """``step 4``, or ``steps 2-8 (7 rows)``: where a metric was not finite."""
    if len(steps) == 1:
        return f"step {steps[0]}"
    return f"steps {min(steps)}-{max(steps)} ({len(steps)} rows)"
