"""Geometric diagnostics of clipping and noise for Muon (docs/diagnostics.md).

Definitions from the inner-momentum paper (Bhusal et al., "Inner Momentum for Differentially
Private Muon"), Eqs. 8-12 and 20. Outputs computed on private data are not covered by a run's
privacy guarantee (``PRIVACY_NOTE``).
"""

from dptrain.diagnostics.geometry import (
    PRIVACY_NOTE,
    SpectralGap,
    as_matrix,
    clipped_mean,
    clipping_residual,
    cosine_error,
    effective_rank,
    gradient_snr,
    normalized_residual,
    polar,
    polar_error,
    singular_values,
    spectral_gap,
    summarize,
    wedin_threshold,
)
from dptrain.diagnostics.plotting import plot_spectra

__all__ = [
    "PRIVACY_NOTE",
    "SpectralGap",
    "as_matrix",
    "clipped_mean",
    "clipping_residual",
    "cosine_error",
    "effective_rank",
    "gradient_snr",
    "normalized_residual",
    "plot_spectra",
    "polar",
    "polar_error",
    "singular_values",
    "spectral_gap",
    "summarize",
    "wedin_threshold",
]
