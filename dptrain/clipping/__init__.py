"""Per-example clipping of the complete gradient with ghost norms (see engine.py)."""

from dptrain.clipping.contributions import Dense, OneHot, Outer
from dptrain.clipping.engine import ClippingEngine, StepStats, per_example_grad_norms
from dptrain.clipping.errors import ClippingError
from dptrain.clipping.rules import LayerRule, find_rule, register_rule
from dptrain.clipping import rules_conv  # noqa: F401  (registers conv/GroupNorm/timm rules)

__all__ = ["ClippingEngine", "ClippingError", "StepStats", "per_example_grad_norms", "LayerRule",
           "register_rule", "find_rule", "Outer", "Dense", "OneHot"]
