"""Learning-rate schedules: a factor in [0, 1] that multiplies every group's base lr.

``step`` counts releases already applied (0 for the first step), ``total_steps`` is T.
Warm-up (any schedule): factor *= min(1, (step + 1) / warmup_steps). Decay runs over the steps
after warm-up, progress p = (step - warmup) / (T - warmup) in [0, 1):
constant 1; linear 1 - (1 - min_ratio) * p (the DP-Muon paper: no warm-up);
cosine min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2.
"""

from __future__ import annotations

import math
from typing import Callable

__all__ = ["SCHEDULES", "lr_factor"]

SCHEDULES: dict[str, Callable[[float, float], float]] = {
    "constant": lambda p, floor: 1.0,
    "linear": lambda p, floor: 1.0 - (1.0 - floor) * p,
    "cosine": lambda p, floor: floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p)),
}


def lr_factor(schedule: str, step: int, *, total_steps: int, warmup_steps: int = 0,
              min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the base learning rates at ``step`` (0-based)."""
    warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
    span = max(1, total_steps - warmup_steps)
    p = min(1.0, max(0.0, (step - warmup_steps) / span))
    return warm * SCHEDULES[schedule](p, min_lr_ratio)
