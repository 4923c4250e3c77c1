"""Singular-value spectra as a PNG (matplotlib, Agg; needs the `plot` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from torch import Tensor

from dptrain.diagnostics.geometry import singular_values

__all__ = ["plot_spectra"]


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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path
