"""Exponential moving average of the parameters (De et al. 2022 evaluate NF-ResNet-50 and WRNs
with it; jax_privacy's ``ema_coefficient``).

Post-processing of the releases: it reads only the parameters the optimizer produced, so it
costs no privacy. After every step t = 1, 2, ... (counted from ``start_step``):

    ema_t = ema_{t-1} + w_t * (theta_t - ema_{t-1}),    w_t = (1 - d) / (1 - d**t)

which is optax's ``ema(decay=d, debias=True)``: the zero-initialised average divided by its
bias (1 - d**t), i.e. a weighted mean of theta_1..theta_t with weights proportional to
d**(t - s). It never weights the initial parameters (a plain EMA started at theta_0 with
d = 0.9999 would still give them 61% of the weight after 5,000 steps). Before ``start_step``
the average follows the parameters exactly.

Each rank keeps the average of what it holds: the whole tensors when replicated, its shards
under FSDP (the averages are DTensors like the parameters). The averages are in the
parameters' dtype (float32 unless ``performance.dtype=float64``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

__all__ = ["ParameterEMA"]


class ParameterEMA:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], decay: float,
                 start_step: int = 0):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.params = dict(named_params)
        self.decay = float(decay)
        self.start_step = int(start_step)
        self.count = 0  # averaged updates so far (t)
        self.values: dict[str, Tensor] = {n: p.detach().clone() for n, p in self.params.items()}

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the parameters after optimizer step ``step`` (1-based: steps applied)."""
        if step <= self.start_step:
            for n, p in self.params.items():
                self.values[n].copy_(p.detach())
            return
        self.count += 1
        d = self.decay
        w = (1.0 - d) / (1.0 - d ** self.count)
        for n, p in self.params.items():
            self.values[n].lerp_(p.detach(), w)

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the parameters hold the averages (evaluation, export); the trained
        values are restored afterwards."""
        saved = {}
        try:
            with torch.no_grad():
                for n, p in self.params.items():
                    saved[n] = p.detach().clone()
                    p.copy_(self.values[n])
            yield
        finally:
            with torch.no_grad():
                for n, v in saved.items():
                    self.params[n].copy_(v)

    def state_dict(self) -> dict:
        return {"count": self.count, "values": dict(self.values)}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore a saved average. None (a checkpoint written without EMA): the average
        restarts from the current parameters, with count 0."""
        if state is None:
            self.count = 0
            with torch.no_grad():
                for n, p in self.params.items():
                    self.values[n].copy_(p.detach())
            return
        if set(state["values"]) != set(self.params):
            raise ValueError("parameter EMA of other parameters than this run's "
                             f"(saved {len(state['values'])}, here {len(self.params)})")
        self.count = int(state["count"])
        with torch.no_grad():
            for n, v in state["values"].items():
                self.values[n].copy_(v)
