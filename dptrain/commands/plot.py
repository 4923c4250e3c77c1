"""``dptrain plot``: a run's metrics over its steps as one PNG.

    dptrain plot --run DIR [--output FILE.png] [--force]

Reads ``DIR/metrics.jsonl`` (and ``DIR/summary.json`` once the run has finished, for the final
test metrics) and draws one panel per quantity: the training and test losses, epsilon spent,
each parameter group's learning rate, peak memory (with NVML's device memory on CUDA), GPU
utilisation and power, and every other test metric
(``dptrain.diagnostics.plotting.metric_series``). A run still in progress can be plotted: a
last line it is writing is left out. The default output is ``DIR/metrics.png``; an existing
file is kept unless ``--force``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from dptrain.commands import FIGURES, check_new_file, writing
from dptrain.config import ConfigError

PROG = "dptrain plot"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plot", help="a run's metrics over its steps as a PNG (loss, epsilon, lr, memory, ...)",
        description="Draw a run's metrics.jsonl (and its summary.json's final test metrics) as "
                    "one PNG, one panel per quantity against the step.")
    p.add_argument("--run", metavar="DIR", required=True, help="a run directory (--output-dir "
                                                               "of dptrain train)")
    p.add_argument("--output", metavar="FILE.png", default=None,
                   help="where to write the figure, .png, .pdf or .svg (default "
                        "DIR/metrics.png)")
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
    run_dir = Path(args.run)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError("--run", f"no metrics.jsonl in {run_dir}")
    from dptrain.diagnostics.plotting import metric_series, plot_metrics

    output = Path(args.output) if args.output is not None else run_dir / "metrics.png"
    check_new_file("--output", output, args.force, FIGURES)
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--output", "needs matplotlib (pip install 'dptrain[plot]')")
    rows = read_rows(metrics)
    summary = read_summary(run_dir / "summary.json")

    series = metric_series(rows, summary)
    if not series:
        raise ConfigError("--run", f"{metrics} has no numbers to draw yet")
    last = rows[-1] if rows else {}
    eps = summary.get("epsilon") if summary else last.get("epsilon")
    steps = summary["steps"] if summary else last.get("step")
    title = f"{run_dir.resolve().name}: step {steps}" + (
        f", epsilon {eps:.3g}" if isinstance(eps, (int, float)) else "")
    with writing("--output", output):
        plot_metrics(series, output, title=title)
    print(f"{PROG}: wrote {output} ({len(series)} panels: {', '.join(series)})")
    return 0
