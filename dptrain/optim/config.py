"""``OptimConfig``: the optimizer, its parameter groups, schedule and filter (post-processing only).

Nothing here touches the mechanism: these settings act on the release after it is made. The
Newton–Schulz dtype is a performance setting (``performance.newton_schulz_dtype``) handed to
``build_optimizer`` by the trainer.

A YAML example (the DP-Muon paper's E2E setting)::

    optim:
      name: muon            # matrices of GPT-2 ...
      lr: 0.002
      preset: gpt2          # ... and AdamW for embeddings, head, vectors:
      aux: {optimizer: adamw, lr: 0.0035}
      schedule: linear
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from dptrain.config import ConfigError, refuse_unused
from dptrain.optim.filters import FilterConfig
from dptrain.optim.groups import PRESETS, ParamGroupConfig
from dptrain.optim.inner_momentum import InnerMomentumConfig
from dptrain.optim.optimizers import (OPTIMIZERS, check_options, optimizer_name_hint,
                                      optimizer_options)
from dptrain.optim.schedules import SCHEDULES

__all__ = ["OptimConfig", "AuxGroupConfig", "ParamGroupConfig", "FilterConfig"]

# Top-level fields that are options of the ``name`` optimizer (null: that optimizer's default).
_OPTION_FIELDS = ("momentum", "nesterov", "weight_decay", "betas", "eps", "ns_steps",
                  "ns_coefficients", "scale", "momentum_style", "bc_lambda", "bc_kappa",
                  "bc_gamma_ns", "bc_probes", "power_iters", "power_tol")


@dataclass(kw_only=True)
class AuxGroupConfig:
    optimizer: Literal["adamw", "sgd"] = "adamw"
    """Optimizer of the preset's non-matrix parameters (embeddings, head, gains, biases)."""
    lr: float | None = None
    """Its base learning rate. Null: ``optim.lr``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Its options (e.g. betas, weight_decay, momentum); none is taken from the top level
    (``optim.momentum`` and the like are the main optimizer's), even where ``optimizer`` is
    ``optim.name``: its defaults, unless set here."""

    def validate(self) -> None:
        if self.lr is not None and not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ConfigError("lr", f"must be finite and >= 0, got {self.lr}")
        known = optimizer_options(self.optimizer)
        for key in self.kwargs:
            if key not in known:
                raise ConfigError(f"kwargs.{key}", f"not an option of {self.optimizer} "
                                                   f"(options: {', '.join(sorted(known))})")
        self.kwargs = check_options(self.kwargs, "kwargs.")

    @staticmethod
    def value_hint(key: str, value: Any) -> str | None:  # (dptrain.config.from_dict's errors)
        return optimizer_name_hint(key, value, allowed=("adamw", "sgd"))


@dataclass(kw_only=True)
class OptimConfig:
    name: Literal["sgd", "adamw", "muon", "muon_bc", "muon_s"] = "muon"
    """Main optimizer: of all parameters, or of the preset's matrices, or of unmatched ones."""
    lr: float = 0.002
    """Base learning rate of the main optimizer and of groups that set none."""
    momentum: float | None = None
    """Momentum mu (beta of DP-Muon-S). Null: muon/muon_bc 0.95, muon_s 0.9, sgd 0.9."""
    nesterov: bool | None = None
    """Nesterov lookahead. Null: muon/muon_bc true, sgd false."""
    weight_decay: float = 0.0
    """Weight decay of the main optimizer: decoupled (W *= 1 - lr*wd) for Muon and AdamW,
    torch's coupled L2 term for SGD."""
    betas: list[float] | None = None
    """AdamW (beta1, beta2). Null: (0.9, 0.999)."""
    eps: float | None = None
    """AdamW's epsilon (null: 1e-8), or Newton–Schulz's normalisation epsilon (null: 1e-7)."""
    ns_steps: int | None = None
    """Newton–Schulz iterations J. Null: 5 (muon_s: 6, so that its update's spectral norm is
    lr*sigma_1 within 1%; 5 Polar Express steps leave it up to 14% larger)."""
    ns_coefficients: Literal["muon", "polar_express"] | None = None
    """Newton–Schulz coefficients. Null: muon (muon_s: polar_express, closer to U V^T)."""
    scale: Literal["match_rms_adamw", "original"] | None = None
    """Muon's shape scale s: 0.2*sqrt(max(r, c)) (null, default) or sqrt(max(1, r/c))."""
    momentum_style: Literal["accumulate", "ema"] | None = None
    """Muon momentum: accumulate (Eq. 7, null) or ema (seed 3; pair it with scale: original)."""
    bc_lambda: float | None = None
    """DP-MuonBC correction strength lambda. Null: 1.25 (the paper); 1 is exact for quadratics."""
    bc_kappa: float | None = None
    """DP-MuonBC probe scale kappa (probes at kappa*nu). Null: 2."""
    bc_gamma_ns: float | None = None
    """DP-MuonBC Smooth-NS constant gamma_ns. Null: 1e-4."""
    bc_probes: int | None = None
    """DP-MuonBC antithetic probe pairs per step. Null: 1."""
    power_iters: int | None = None
    """DP-Muon-S: the most products with M^T M per step for sigma_1 (Lanczos steps,
    warm-started from the last step's vector; >= 2). Null: 50."""
    power_tol: float | None = None
    """DP-Muon-S: stop once the top Ritz pair's residual is at most this fraction of its value
    (0: ``power_iters`` steps, fewer only where the next direction is rounding noise). Null:
    1e-4."""
    preset: Literal["gpt2", "causal_lm", "nfresnet", "vit", "convnext"] | None = None
    """Split parameters into matrices (``name``) and the rest (``aux``) by model family
    (``causal_lm``: the decoder blocks' 2-D weights to ``name``; embeddings, head, norms and
    biases to ``aux``)."""
    aux: AuxGroupConfig = field(default_factory=AuxGroupConfig)
    """The optimizer of the preset's non-matrix group."""
    groups: list[ParamGroupConfig] = field(default_factory=list)
    """Explicit groups, matched before the preset's; first match wins."""
    unmatched: Literal["error", "default"] = "error"
    """With ``groups`` and no preset: parameters no group matches are an error, or go to the
    main optimizer (``default``). Without groups and preset every parameter uses ``name``."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule over the run's steps (the DP-Muon paper: linear, no warm-up)."""
    warmup_steps: int = 0
    """Linear warm-up steps (any schedule)."""
    min_lr_ratio: float = 0.0
    """Floor of linear/cosine decay, as a fraction of the base learning rate: the factor the
    decay reaches at step T, one past the last (dptrain/optim/schedules.py), so the last
    step's rate is one decay step above it (linear: min_lr_ratio + (1 - min_lr_ratio)/(T -
    warmup_steps))."""
    filter: FilterConfig = field(default_factory=FilterConfig)
    """Filter on the release before the optimizer (DiSK, DOPPLER)."""
    inner_momentum: InnerMomentumConfig = field(default_factory=InnerMomentumConfig)
    """DP-Muon-IM: each example's query averages its gradient over the current and up to K
    past models before clipping (separate histories for Muon and other parameters)."""
    ema_decay: float = 0.0
    """Exponential moving average of the parameters (bias-corrected, ``dptrain.optim.ema``):
    evaluation and the exported ``final/model.safetensors`` use the average; the last iterate
    is evaluated too (``last_iterate_*``) and exported as ``final/last_iterate.safetensors``.
    0: off. De et al. 2022 use 0.999 (CIFAR-10) and 0.99999 (ImageNet). Post-processing: no privacy cost."""
    ema_start_step: int = 0
    """Steps before the average starts (until then it equals the parameters)."""

    value_hint = staticmethod(optimizer_name_hint)

    def main_options(self) -> dict[str, Any]:
        """The top-level options that are set, as keyword arguments of the ``name`` optimizer."""
        out = {k: getattr(self, k) for k in _OPTION_FIELDS if getattr(self, k) is not None}
        if "betas" in out:
            out["betas"] = tuple(out["betas"])
        return out

    def main_group(self) -> ParamGroupConfig:
        """The main optimizer as a group (pattern filled in by a preset, or unused)."""
        return ParamGroupConfig(pattern="", optimizer=self.name, lr=self.lr,
                                kwargs=self.main_options())

    def applicability(self) -> list[tuple[str, str, dict]]:
        """Settings only some schedules read (``dptrain.config.unused_fields``). Not refused:
        ``ema_start_step`` with ``ema_decay: 0``, and the inner-momentum gammas with K = 0 (a
        sweep includes the switched-off point; K = 0 is DP-Muon whatever gamma)."""
        return [("optim.schedule", self.schedule, {"min_lr_ratio": ("linear", "cosine")}),
                # with a preset its groups take the leftovers of explicit groups. (``aux``
                # without a preset is not refused: ``optim.preset=null`` on a config with a
                # preset and its aux group is how a run switches to one optimizer)
                ("optim.preset", self.preset or "null", {"unmatched": ("null",)})]

    def validate(self) -> None:
        refuse_unused(self)
        if not (self.lr >= 0 and math.isfinite(self.lr)):
            raise ConfigError("lr", f"must be finite and >= 0, got {self.lr}")
        known = optimizer_options(self.name)
        for key in _OPTION_FIELDS:
            if getattr(self, key) is not None and key not in known:
                raise ConfigError(key, f"does not apply to optimizer {self.name!r}")
        # the same types and ranges as a group's kwargs (weight_decay always, even 0.0)
        check_options({k: getattr(self, k) for k in _OPTION_FIELDS if getattr(self, k) is not None})
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError("preset", f"must be one of {', '.join(PRESETS)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError("schedule", f"must be one of {', '.join(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ConfigError("warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError("min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ConfigError("ema_decay", f"must be in [0, 1), got {self.ema_decay}")
        if self.ema_start_step < 0:
            raise ConfigError("ema_start_step", f"must be >= 0, got {self.ema_start_step}")
        if self.inner_momentum.enabled and self.filter.name == "disk":
            raise ConfigError("inner_momentum", "cannot be combined with the DiSK filter (both "
                                                "define the query's evaluation points)")
        assert self.name in OPTIMIZERS
