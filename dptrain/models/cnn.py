"""A tiny convolutional classifier for MNIST-sized images, normalised with GroupNorm.

GroupNorm normalises each example on its own, so per-example gradients stay per-example
(BatchNorm would mix the examples of a batch and is refused everywhere in dptrain).
"""

from __future__ import annotations

from torch import nn


def _groups(channels: int, wanted: int) -> int:
    """The largest divisor of ``channels`` that is <= ``wanted`` (GroupNorm needs a divisor)."""
    g = max(1, min(wanted, channels))
    while channels % g:
        g -= 1
    return g


class TinyCNN(nn.Module):
    """conv3x3 -> GroupNorm -> ReLU -> maxpool2, once per entry of ``channels``; then average
    pooling to ``pool`` x ``pool`` cells, a hidden linear layer of ``hidden`` units (ReLU) and
    the linear head (``hidden=0``: the head alone). Input ``[B, in_chans, H, W]``, output logits
    ``[B, num_classes]``; any H, W >= 2**len(channels) works."""

    def __init__(self, in_chans: int, num_classes: int, channels: list[int] | tuple[int, ...],
                 groups: int = 4, pool: int = 4, hidden: int = 32):
        super().__init__()
        layers: list[nn.Module] = []
        c_in = in_chans
        for c in channels:
            layers += [
                nn.Conv2d(c_in, c, kernel_size=3, padding=1),
                nn.GroupNorm(_groups(c, groups), c),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            c_in = c
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(pool)
        width = c_in * pool * pool
        self.hidden = nn.Sequential(nn.Linear(width, hidden), nn.ReLU()) if hidden else nn.Identity()
        self.head = nn.Linear(hidden or width, num_classes)

    def forward(self, x):
        x = self.features(x)
        x = self.hidden(self.pool(x).flatten(1))
        return self.head(x)
