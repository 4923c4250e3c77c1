"""The optimizer registry: name -> class, and how a class is built from config options.

Every class reads ``p.grad`` (the release after the filters) and keeps all its state in
``self.state``; none stashes anything on parameters. Classes take ``(params, lr, **options)``;
options named like a runtime value (``seed``, ``release_noise_std``, ``ns_dtype``,
``transposed``; ``Runtime``) are filled in by ``build_optimizer`` rather than by the config.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from dptrain.config import FLOAT32_TINY, ConfigError, _convert
from dptrain.optim.muon import Muon, MuonBC, MuonS

__all__ = ["SGD", "AdamW", "OPTIMIZERS", "RUNTIME_OPTIONS", "Runtime", "optimizer_options",
           "optimizer_name_hint", "check_options", "construct"]


class SGD(torch.optim.SGD):
    """Heavy-ball SGD: M_t = mu*M_{t-1} + G_t; W <- W - lr*M_t (torch's SGD, no dampening).

    ``weight_decay`` is torch's coupled L2 term (added to G before the momentum).
    """

    def __init__(self, params, lr: float = 0.1, *, momentum: float = 0.9,
                 nesterov: bool = False, weight_decay: float = 0.0):
        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov,
                         weight_decay=weight_decay)


class AdamW(torch.optim.AdamW):
    """AdamW with standard bias correction and decoupled weight decay (torch's AdamW)."""

    def __init__(self, params, lr: float = 1e-3, *, betas: tuple[float, float] | list[float] =
                 (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)


OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": SGD,
    "adamw": AdamW,
    "muon": Muon,
    "muon_bc": MuonBC,
    "muon_s": MuonS,
}


def optimizer_name_hint(key: str, value: Any, allowed=OPTIMIZERS) -> str | None:
    """What a user who wrote ``value`` for an optimizer's name may have meant (one of
    ``allowed``): names of the papers (DP-Muon-IM, DiSK, DP-SGD) and of other tools are
    settings here, not optimizers."""
    if key not in ("name", "optimizer") or not isinstance(value, str):
        return None
    v = value.lower().replace("-", "_")
    for prefix in ("dp_", "dp"):  # (DP-SGD, DPSGD, dp_adam: Opacus's and the papers' names)
        if v.startswith(prefix) and len(v) > len(prefix):
            v = v[len(prefix):]
            break
    if v in ("muon_im", "muonim", "im", "inner_momentum"):
        keep = ("'muon' (or another)" if "muon" in allowed
                else " or ".join(repr(a) for a in allowed))
        return (f"inner momentum is not an optimizer: keep {keep} and set "
                f"optim.inner_momentum.k_muon and k_other (configs/e2e_paper_gpt2_im.yaml)")
    filters = {"disk": "DiSK", "doppler": "DOPPLER"}
    if v in filters:
        return (f"{filters[v]} is a filter on the release: keep the optimizer and set "
                f"optim.filter.name={v}")
    v = {"muonbc": "muon_bc", "muons": "muon_s", "adam": "adamw"}.get(v, v)
    if v in allowed:  # (written otherwise)
        why = (" (every optimizer here updates with the clipped, noised release: there are "
               "no 'dp_' names)") if value.lower().startswith("dp") else ""
        return f"write {v!r}{why}"
    return None


@dataclass(frozen=True)
class Runtime:
    """Values the run supplies (not the config): passed to classes whose __init__ names them."""

    seed: int
    """Seed of public post-processing randomness (MuonBC probes, MuonS power vectors; inner
    momentum's past-state dropout is seeded from it too, by the trainer)."""
    release_noise_std: float
    """sigma*C/b: std per coordinate of the release's Gaussian noise (MuonBC's nu before gains)."""
    ns_dtype: str = "float32"
    """Newton–Schulz dtype (``performance.newton_schulz_dtype``)."""
    transposed: frozenset = frozenset()
    """Names of weight matrices stored (in, out), as transformers' Conv1D (Muon's shape scale)."""


RUNTIME_OPTIONS = frozenset(Runtime.__dataclass_fields__)


def _init_parameters(cls: type) -> dict[str, inspect.Parameter]:
    params = dict(inspect.signature(cls.__init__).parameters)
    for skip in ("self", "params", "lr"):
        params.pop(skip, None)
    return params


def optimizer_options(name: str) -> set[str]:
    """Config-settable options of optimizer ``name`` (its __init__ keywords minus runtime ones)."""
    return set(_init_parameters(OPTIMIZERS[name])) - RUNTIME_OPTIONS


# Type and range of every config-settable option, whichever optimizer takes it.
OPTION_TYPES: dict[str, Any] = {
    "momentum": float, "nesterov": bool, "weight_decay": float, "betas": list[float],
    "eps": float, "ns_steps": int, "ns_coefficients": Literal["muon", "polar_express"],
    "scale": Literal["match_rms_adamw", "original"],
    "momentum_style": Literal["accumulate", "ema"], "bc_lambda": float, "bc_kappa": float,
    "bc_gamma_ns": float, "bc_probes": int, "power_iters": int,
    "power_tol": float,
}


def _finite(x: float) -> bool:
    return math.isfinite(x)


_OPTION_RANGES: dict[str, tuple[Any, str]] = {
    "momentum": (lambda x: 0.0 <= x < 1.0, "must be in [0, 1)"),
    "weight_decay": (lambda x: _finite(x) and x >= 0, "must be finite and >= 0"),
    "betas": (lambda b: len(b) == 2 and all(0.0 <= x < 1.0 for x in b),
              "must be two numbers in [0, 1)"),
    # eps = 0 makes AdamW's step of an all-zero gradient (a noise-free run's empty sample, a
    # parameter without gradient) 0/0 = NaN, and so do values that round to 0 in float32 or bf16
    # (eps = 1e-50): floats' smallest normal. (Newton-Schulz divides a zero matrix by 1.)
    "eps": (lambda x: _finite(x) and x >= FLOAT32_TINY,
            f"must be finite and >= {FLOAT32_TINY:.3g} (float32's smallest normal: a smaller "
            f"one rounds to 0 in float32 or bf16, where AdamW's step of an all-zero gradient "
            f"is 0/0; Muon's Newton-Schulz guard is held to the same range)"),
    "ns_steps": (lambda x: x >= 1, "must be >= 1"),
    "bc_lambda": (lambda x: _finite(x) and x >= 0, "must be finite and >= 0"),
    "bc_kappa": (lambda x: _finite(x) and x > 0, "must be finite and > 0"),
    "bc_gamma_ns": (lambda x: _finite(x) and x > 0 and x * x >= FLOAT32_TINY,
                    f"must be finite and >= {math.sqrt(FLOAT32_TINY):.5g} (its square is added "
                    f"in float32 or bf16: a smaller one rounds to 0, and Smooth-NS is then "
                    f"not smooth at 0, as the bias correction needs)"),
    "bc_probes": (lambda x: x >= 1, "must be >= 1"),
    "power_iters": (lambda x: x >= 2, "must be >= 2"),
    "power_tol": (lambda x: 0.0 <= x < 1.0, "must be in [0, 1)"),
}


def check_options(options: dict, prefix: str = "") -> dict:
    """``options`` converted to their types (``1e-8`` is a string in YAML) and range-checked;
    a ConfigError names ``prefix + key``. Unknown names are left to the caller."""
    out = {}
    for key, value in options.items():
        field = f"{prefix}{key}"
        if key not in OPTION_TYPES:
            out[key] = value
            continue
        value = _convert(value, OPTION_TYPES[key], field)
        check, rule = _OPTION_RANGES.get(key, (None, ""))
        if check is not None and not check(value):
            raise ConfigError(field, f"{rule}, got {value}")
        out[key] = value
    if out.get("nesterov") and out.get("momentum") == 0.0:
        raise ConfigError(f"{prefix}nesterov", "needs momentum > 0 (the lookahead is along "
                                               "the momentum), got momentum 0")
    return out


def construct(name: str, named_params: list[tuple[str, torch.nn.Parameter]], *, lr: float,
              options: dict, runtime: Runtime) -> torch.optim.Optimizer:
    """Instantiate OPTIMIZERS[name] over ``named_params`` with config ``options`` and runtime."""
    cls = OPTIMIZERS[name]
    accepted = _init_parameters(cls)
    extra = {k: getattr(runtime, k) for k in RUNTIME_OPTIONS if k in accepted}
    return cls(list(named_params), lr=lr, **extra, **options)
