"""Privacy settings: everything that defines the mechanism, and nothing else.

Performance settings (microbatch size, dtype, threads, clipping implementation) live in
``dptrain.performance.PerformanceConfig`` and cannot change anything defined here.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Literal

from dptrain.config import FLOAT32_MAX, FLOAT32_TINY, ConfigError
from dptrain.privacy.accounting import MAX_STEPS, MIN_SAMPLE_RATE

NOISE_TAIL = 40.0
"""No float64 Gaussian draw exceeds ~38.5 standard deviations: sigma * C * NOISE_TAIL must fit
in float32 (``noise_fits``)."""


def noise_fits(sigma: float, clip_norm: float) -> bool:
    """Whether every noise value sigma * C * Z can be held in float32 (not inf, nor NaN in the
    model after it)."""
    return sigma * clip_norm * NOISE_TAIL < FLOAT32_MAX


def check_clip_norm(clip_norm: float, field: str = "clip_norm") -> None:
    """ConfigError naming ``field`` unless C is finite, > 0 and at least float32's smallest
    normal (below it the clip factors C/||u|| and the noise flush to 0)."""
    if not (clip_norm > 0 and math.isfinite(clip_norm)):
        raise ConfigError(field, f"must be finite and > 0, got {clip_norm}")
    if clip_norm < FLOAT32_TINY:
        raise ConfigError(field, f"{clip_norm:g} is below float32's smallest normal number "
                                 f"({FLOAT32_TINY:.3g})")


@dataclass(kw_only=True)
class PrivacyConfig:
    epsilon: float | None = 8.0
    """Target epsilon. With ``noise_multiplier: null`` sigma is calibrated to reach it over
    ``steps``; with both set, training refuses to start if the plan would exceed it. Null means
    no budget (sigma must then be given): epsilon is still reported."""
    delta: float = 1e-5
    """Target delta; ``1/84122`` is accepted."""
    sample_rate: float = 0.01
    """Poisson sampling rate q: every example is included independently with probability q."""
    steps: int = 100
    """Number of releases T (one per logical batch)."""
    clip_norm: float = 1.0
    """C: every example's complete query is clipped to L2 norm at most C (flat clipping)."""
    noise_multiplier: float | None = None
    """sigma: the release adds N(0, (sigma*C)^2) per coordinate. Null: calibrated."""
    accountant: Literal["prv", "rdp"] = "prv"
    """Accountant for epsilon and calibration (opacus' implementations)."""
    adjacency: Literal["add_remove", "replace_one"] = "add_remove"
    """Neighbouring datasets differ by adding/removing one example. ``replace_one`` is refused
    (see docs/privacy.md): its sensitivity is 2C and the Poisson-subsampled accountants used here
    only cover add/remove."""
    dataset_size: int | None = None
    """Public dataset size N. Null: the training set's length (treated as public). A value more
    than 10% off that length is warned about at the start of a run."""
    expected_batch_size: int | None = None
    """Public release denominator b, at most N. Null: max(1, floor(q * N)), q * N read to a
    relative 1e-9 (``expected_batch_size``: q = 0.29, N = 100 gives 29)."""
    seed: int | None = 0
    """Seed of the counter-based sampling and noise streams. Null with secure_mode."""
    secure_mode: bool = False
    """Draw the seed from OS entropy and never write it anywhere (exact replay impossible); the
    sampling and noise streams are ChaCha20's (a CSPRNG), each noise value the sum of four
    normals over 2 as in Opacus's secure mode (docs/privacy.md)."""

    def validate(self) -> None:
        if self.epsilon is not None and not (self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ConfigError("epsilon", f"must be finite and > 0, got {self.epsilon}")
        if not (0.0 < self.delta < 1.0):
            raise ConfigError("delta", f"must be in (0, 1), got {self.delta}")
        if not (0.0 < self.sample_rate <= 1.0):
            raise ConfigError("sample_rate", f"must be in (0, 1], got {self.sample_rate}")
        if self.sample_rate < MIN_SAMPLE_RATE:
            raise ConfigError("sample_rate", f"{self.sample_rate} is below {MIN_SAMPLE_RATE:.4g}, "
                                             f"the smallest the accountants can take")
        if self.steps < 1:
            raise ConfigError("steps", f"must be >= 1, got {self.steps}")
        if self.steps > MAX_STEPS:
            raise ConfigError("steps", f"must be <= {MAX_STEPS:.0e} (the accountants cannot "
                                       f"handle more releases), got {self.steps}")
        check_clip_norm(self.clip_norm)
        if self.noise_multiplier is not None and not (self.noise_multiplier >= 0
                                                      and math.isfinite(self.noise_multiplier)):
            raise ConfigError("noise_multiplier",
                              f"must be finite and >= 0, got {self.noise_multiplier}")
        if self.noise_multiplier is None and self.epsilon is None:
            raise ConfigError("noise_multiplier", "set noise_multiplier or a target epsilon")
        if self.adjacency == "replace_one":
            raise ConfigError(
                "adjacency",
                "replace_one is not supported: its sensitivity is 2C and the Poisson-subsampled "
                "accountants here only cover add_remove; use add_remove (see docs/privacy.md)")
        if self.dataset_size is not None and self.dataset_size < 1:
            raise ConfigError("dataset_size", f"must be >= 1, got {self.dataset_size}")
        if self.expected_batch_size is not None and self.expected_batch_size < 1:
            raise ConfigError("expected_batch_size",
                              f"must be >= 1, got {self.expected_batch_size}")
        if self.seed is not None and self.seed < 0:  # as the top-level seed
            raise ConfigError("seed", f"must be >= 0 or null, got {self.seed}")
        if self.secure_mode and self.seed is not None:
            raise ConfigError("seed", "must be null in secure_mode (the seed comes from OS entropy)")
        if not self.secure_mode and self.seed is None:
            raise ConfigError("seed", "must be set unless secure_mode is true")

    def public_dataset_size(self, train_size: int) -> int:
        """N as the plan uses it (b, calibration): ``dataset_size`` if set, else the training
        set's length."""
        return self.dataset_size if self.dataset_size is not None else train_size

    def release_denominator(self, dataset_size: int) -> int:
        """b: the public denominator of the release, ``expected_batch_size`` when set, else
        max(1, floor(q N)) with q N read to a relative 1e-9 (:func:`expected_batch_size`; N
        is :meth:`public_dataset_size`)."""
        if self.expected_batch_size is not None:
            return self.expected_batch_size
        return expected_batch_size(self.sample_rate, self.public_dataset_size(dataset_size))


def expected_batch_size(sample_rate: float, dataset_size: int) -> int:
    """The public denominator b = max(1, floor(q N)) of a release, with q N read to a relative
    1e-9: q = 0.29, N = 100 gives 28.999999999999996 in binary floating point, and a plain floor
    would give 28 where 29 is meant. Never the sampled count, which is private."""
    if isinstance(sample_rate, bool) or not (isinstance(sample_rate, numbers.Real)
                                             and 0.0 < sample_rate <= 1.0):
        raise ConfigError("sample_rate", f"must be a number in (0, 1], got {sample_rate!r}")
    if (isinstance(dataset_size, bool) or not isinstance(dataset_size, numbers.Integral)
            or dataset_size < 1):
        raise ConfigError("dataset_size", f"must be an int >= 1, got {dataset_size!r}")
    qn = sample_rate * dataset_size
    near = round(qn)
    return max(1, near if abs(qn - near) <= 1e-9 * max(1.0, qn) else math.floor(qn))
