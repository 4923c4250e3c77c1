"""Singular-value spectra as a PNG (matplotlib, Agg; needs the `plot` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from torch import Tensor

from dptrain.diagnostics.geometry import singular_values

__all__ = ["plot_audit_scores", "plot_spectra"]


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
    singular values are not drawn. Creates the parent directory. Returns the path.
    """
    if not named_matrices:
        raise ValueError("plot_spectra needs at least one matrix")
    # Figure without pyplot: no global state, no GUI backend, safe in threads and tests.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.4), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    for name, X in named_matrices.items():
        s = singular_values(X).cpu()
        if normalize and s.numel() and float(s[0]) > 0.0:
            s = s / s[0]
        ax.plot(range(1, s.numel() + 1), s.tolist(), marker="." if s.numel() <= 64 else None, label=name)
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


def _save(fig, path: str | Path) -> Path:
    """Lay out ``fig`` and write it as a PNG at ``path`` (parent directories created)."""
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
