"""Figures as PNGs (matplotlib without pyplot; needs the `plot` extra): singular-value spectra,
audit scores, and a run's metrics over its steps."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from torch import Tensor

from dptrain.diagnostics.geometry import _EPS64, as_matrix, singular_values

__all__ = ["metric_series", "plot_audit_scores", "plot_metrics", "plot_spectra"]


def plot_spectra(
    named_matrices: Mapping[str, Tensor],
    path: str | Path,
    *,
    normalize: bool = True,
    title: str | None = None,
) -> Path:
    """Write a PNG with one curve per matrix: its singular values (FP64 SVD), descending.

    normalize: divide each spectrum by its sigma_1, so that matrices of different scale (an
    unclipped gradient, a clipped mean, a noisy release) compare by shape. Log y-axis; zero
    singular values (at most max(r, c) eps64 sigma_1, as :func:`polar` counts them) are not
    drawn, and a matrix of zeros is named "(zero)" in the legend. Creates the parent
    directory. Returns the path.
    """
    if not named_matrices:
        raise ValueError("plot_spectra needs at least one matrix")
    # Figure without pyplot: no global state, no GUI backend, safe in threads and tests.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    for name, X in named_matrices.items():
        s = singular_values(X).cpu()
        top = float(s[0]) if s.numel() else 0.0
        # zero as polar() counts it (at most max(r, c) eps64 sigma_1): a rank-deficient
        # gradient's rounding noise at 1e-17 squeezed the informative decades into the top
        zero = max(as_matrix(X).shape) * _EPS64 * top
        if normalize and top > 0.0:
            s, zero = s / top, zero / top
        y = [v if v > zero else math.nan for v in s.tolist()]
        said = ("" if any(not math.isnan(v) for v in y) else
                " (not finite)" if math.isnan(top) else " (zero)")
        ax.plot(range(1, s.numel() + 1), y, marker="." if s.numel() <= 64 else None,
                label=name + said)
    ax.set_yscale("log", nonpositive="mask")
    ax.set_xlabel("index i")
    ax.set_ylabel("sigma_i / sigma_1" if normalize else "sigma_i")
    ax.set_title(title or "Singular-value spectra")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_audit_scores(scores, included, path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG with the histograms of the included and the excluded canaries' scores
    (``dptrain audit``): the further apart, the more the releases reveal about a canary."""
    import numpy as np
    from matplotlib.figure import Figure

    scores = np.asarray(scores, dtype=np.float64)
    included = np.asarray(included, dtype=bool)
    fig = Figure(figsize=(6.4, 4.4), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    bins = np.histogram_bin_edges(scores, bins=min(60, max(10, scores.size // 20)))
    ax.hist(scores[~included], bins=bins, alpha=0.6, label=f"excluded ({int((~included).sum())})")
    ax.hist(scores[included], bins=bins, alpha=0.6, label=f"included ({int(included.sum())})")
    ax.set_xlabel("score: log-likelihood ratio, summed over steps")
    ax.set_ylabel("canaries")
    ax.set_title(title or "Canary scores")
    ax.legend()
    return _save(fig, path)


_COUNTS = ("tokens", "examples", "generated_prompts")
"""Test-set sizes (``test_tokens``, ``test_last_iterate_examples``, ...): constant over a run,
not worth a panel."""

_LOSSES = ("loss", "nll_per_token")

_BLEU = ("bleu", "bleu_uncased")
"""E2E/DART's BLEU, case-sensitive and uncased: one panel."""

_PANELS = {"epsilon": "epsilon spent", "peak_memory_gib": "peak memory (GiB)",
           # NVML's device memory beside PyTorch's peak: the gap is the context, NCCL, the cache
           "gpu_memory_used_gib": "peak memory (GiB)",
           "gpu_util_pct": "GPU utilisation (%)", "gpu_power_w": "GPU power (W)"}
"""Panel titles of row keys (others: the key, ``test_`` as "test ")."""

Series = dict[str, tuple[list[int], list[float]]]


def metric_series(rows: Iterable[Mapping], final: Mapping | None = None,
                  left_out: dict[str, list[int]] | None = None) -> dict[str, Series]:
    """The curves of a run's ``metrics.jsonl`` rows, by panel: ``{panel: {label: (steps,
    values)}}``, panels in the order of first appearance.

    - ``loss``: ``train_loss`` and the test losses (``test_loss``, ``test_nll_per_token``, and
      with a parameter EMA the last iterate's, ``test_last_iterate_loss``, ...);
    - ``learning rate``: one curve per parameter group (``lr`` is a mapping, or one number);
    - ``test BLEU``: E2E/DART's case-sensitive and uncased BLEU (and the last iterate's);
    - every other number in a row in a panel of its own: ``epsilon spent``, ``peak memory
      (GiB)``, ``test accuracy``, ...; ``time`` and the test-set sizes are not drawn;
    - ``final``: ``summary.json``'s ``steps`` and ``metrics`` (the final evaluation), added to
      the test curves at the last step;
    - values that are not finite numbers (``"nan"`` in strict JSON) are left out, and named
      in ``left_out`` when given (``{key: [steps]}``: a run that diverged); when several rows
      have the same step, the last one counts.
    """
    by_step: dict[int, Mapping] = {}
    for row in rows:
        by_step[int(row["step"])] = row
    if final is not None and final.get("metrics"):
        last = dict(by_step.get(int(final["steps"]), {"step": int(final["steps"])}))
        last.update({f"test_{k}": v for k, v in final["metrics"].items()})
        by_step[int(final["steps"])] = last
    panels: dict[str, Series] = {}

    def add(panel: str, label: str, step: int, value) -> None:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            return
        if isinstance(value, str) or not math.isfinite(value):
            # (strict JSON's "nan", "inf", "-inf": dptrain.telemetry.jsonable)
            if left_out is not None and (not isinstance(value, str)
                                         or value in ("nan", "inf", "-inf")):
                left_out.setdefault(label, []).append(step)
            return
        steps, values = panels.setdefault(panel, {}).setdefault(label, ([], []))
        steps.append(step)
        values.append(float(value))

    for step in sorted(by_step):
        row = by_step[step]
        for key, value in row.items():
            base = key.removeprefix("test_").removeprefix("last_iterate_")
            if key in ("step", "time") or (key.startswith("test_") and base in _COUNTS):
                continue
            if key == "lr":
                groups = value if isinstance(value, Mapping) else {"lr": value}
                for name, lr in groups.items():
                    add("learning rate", name, step, lr)
            elif key == "train_loss" or (key.startswith("test_") and base in _LOSSES):
                add("loss", key, step, value)
            elif key.startswith("test_") and base in _BLEU:
                add("test BLEU", key, step, value)
            else:
                add(_PANELS.get(key, key.replace("test_", "test ", 1)), key, step, value)
    return panels


_LINE_STYLES = ("-", "--", ":", "-.")


def plot_metrics(series: Mapping[str, Series], path: str | Path, *,
                 title: str | None = None, runs: Sequence[str] | None = None) -> Path:
    """Write a PNG with one panel per entry of :func:`metric_series`'s result (two columns),
    against the step (with markers up to 20 points: a test metric evaluated a few times
    shows where it was). ``runs``: the curves are several runs', labelled ``"run: label"``;
    each run gets one colour, each of its curves in a panel a line style. Returns the path."""
    if not series:
        raise ValueError("plot_metrics needs at least one series")
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    cols = 1 if len(series) == 1 else 2
    rows = -(-len(series) // cols)
    lines = title.count("\n") + 1 if title else 0
    fig = Figure(figsize=(6.0 * cols, 3.0 * rows + 0.25 * max(0, lines - 1)), dpi=100)
    colour = {run: f"C{k % 10}" for k, run in enumerate(runs or ())}
    for i, (panel, curves) in enumerate(series.items()):
        ax = fig.add_subplot(rows, cols, i + 1)
        drawn: dict[str, int] = {}  # run -> its curves in this panel so far
        for label, (steps, values) in curves.items():
            style = {}
            run = next((r for r in colour if label.startswith(f"{r}: ")), None)
            if run is not None:
                k = drawn[run] = drawn.get(run, -1) + 1
                style = {"color": colour[run], "linestyle": _LINE_STYLES[k % len(_LINE_STYLES)]}
            ax.plot(steps, values, marker="o" if len(steps) <= 20 else None, markersize=3,
                    label=label, **style)
        if panel == "learning rate" and all(v > 0 for _, vs in curves.values() for v in vs):
            ax.set_yscale("log")
        ax.set_title(panel)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # (no step 1.5)
        every = [x for steps, _ in curves.values() for x in steps]
        if every and max(every) - min(every) < 2:  # (one step: an axis from 3.8 to 4.2)
            ax.set_xlim(min(every) - 1, max(every) + 1)
        ax.grid(True, alpha=0.3)
        if len(curves) > 1 or runs:  # (several runs: whose curve it is)
            ax.legend(fontsize="small", ncol=2 if len(curves) > 6 else 1)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


FORMATS = ("png", "pdf", "svg")
"""What the figures are written as, by the path's suffix (anything else: PNG)."""


def _save(fig, path: str | Path) -> Path:
    """Lay out ``fig`` and write it at ``path`` (parent directories created), as PDF or SVG
    where the suffix says so, else as PNG."""
    from dptrain.telemetry import replace_atomically

    fig.tight_layout()
    suffix = Path(path).suffix.lower().lstrip(".")
    return replace_atomically(
        path, lambda tmp: fig.savefig(tmp, format=suffix if suffix in FORMATS else "png"))
