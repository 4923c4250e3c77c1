"""The clipping engine's own refusals.

``ClippingError`` is a ``ValueError`` whose message starts with "dptrain.clipping:". The engine
raises it where it cannot compute a model's per-example query exactly (a layer it has no rule
for, a forward that mixes examples, a tapped parameter used in a way that does not broadcast)
or where its arguments are wrong. The trainer turns it into a ``ConfigError`` naming the model's
setting; the engine tells it apart from an error of the user's own forward by its class, not by
its text.
"""

from __future__ import annotations

__all__ = ["ClippingError"]


class ClippingError(ValueError):
    """The clipping engine refuses this model, batch or plan (its message says why)."""
