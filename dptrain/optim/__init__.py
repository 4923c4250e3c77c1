"""Post-processing of the private release: filters, the Muon family, AdamW/SGD, groups.

Public API: ``newton_schulz(X, steps=5)`` (Muon's iteration; outside checks call it),
``OptimConfig`` and ``build_optimizer`` (the one object the trainer drives). Everything here
acts on ``p.grad`` after the release, so none of it costs privacy.
"""

from dptrain.optim.build import DPOptimizer, build_optimizer
from dptrain.optim.config import AuxGroupConfig, OptimConfig
from dptrain.optim.filters import FilterConfig
from dptrain.optim.groups import ParamGroupConfig
from dptrain.optim.muon import Muon, MuonBC, MuonS
from dptrain.optim.newton_schulz import newton_schulz, smooth_newton_schulz
from dptrain.optim.optimizers import OPTIMIZERS

__all__ = [
    "newton_schulz",
    "smooth_newton_schulz",
    "OptimConfig",
    "AuxGroupConfig",
    "FilterConfig",
    "ParamGroupConfig",
    "build_optimizer",
    "DPOptimizer",
    "Muon",
    "MuonBC",
    "MuonS",
    "OPTIMIZERS",
]
