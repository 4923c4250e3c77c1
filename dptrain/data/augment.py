"""Augmentation multiplicity (De et al. 2022, after Hoffer et al. 2019 and Fort et al. 2021).

With ``data.augmult = K``, each sampled example's query is the mean of its gradients over K
random views of it, and that mean is clipped once:

    u_b = (1/K) sum_k grad l(theta; view_k(x_b)),        lam_b = min(1, C / ||u_b||)

so an example still adds at most C to the release and the accounting is unchanged (K does not
enter epsilon). The trainer expresses this as a query plan whose entries are (state, view)
pairs with coefficients a_j / K (``dptrain.clipping.engine``: the norms include the cross terms
between views, exactly as between inner momentum's states), so augmult composes with inner
momentum and DiSK: each state is evaluated at every view.

A view is jax_privacy's ``apply_augmult`` transform on the normalised image: reflect-pad by
``pad`` pixels on each side, crop back to the original size at a random offset in
``[0, 2 * pad]`` per axis, and flip horizontally with probability 1/2. Its randomness is public
(the run's ``seed``, not the privacy seed) and a pure function of (seed, step, view, example's
dataset index) through the same SplitMix64 counter hash as dropout and Poisson sampling, so an
example gets the same views on any number of ranks, in any microbatch, after any resume.

Evaluation and ``dptrain diagnose`` use the un-augmented images.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from dptrain.models.dropout import hash_uniform_bits
from dptrain.privacy.sampling import _GAMMA, _mix64_int, _seed_key

__all__ = ["augment_batch", "augment_images", "default_pad", "view_offsets"]

# Domain separation from dropout's hash (which keys on (seed, step, stream, call)).
_DOMAIN = 0x6175676D756C7421  # b"augmult!"


def default_pad(image_size: int) -> int:
    """jax_privacy's CIFAR pad is 4 at 32 pixels: an eighth of the side (at least 1)."""
    return max(1, image_size // 8)


def view_offsets(seed: int, step: int, view: int, indices: Tensor, pad: int,
                 device=None) -> tuple[Tensor, Tensor, Tensor]:
    """(dy, dx, flip) of each example's ``view``-th view at ``step``: int64 offsets in
    ``[0, 2 * pad]`` and a bool flip, a pure function of (seed, step, view, index)."""
    k = _mix64_int(_mix64_int(_seed_key(int(seed)) ^ _DOMAIN) + _GAMMA * (int(step) + 1))
    k = _mix64_int(k + _GAMMA * (int(view) + 1))
    idx = torch.as_tensor(indices, dtype=torch.int64).reshape(-1).to(device)
    bits = hash_uniform_bits(k, idx, (3,))  # [B, 3] uniform in [0, 2**24)
    n = 2 * int(pad) + 1
    dy = (bits[:, 0] * n) >> 24  # floor(u * n): every offset has probability 1/n +- 2**-24
    dx = (bits[:, 1] * n) >> 24
    flip = bits[:, 2] < (1 << 23)
    return dy, dx, flip


def augment_images(x: Tensor, dy: Tensor, dx: Tensor, flip: Tensor, pad: int,
                   do_flip: bool = True) -> Tensor:
    """Example b of ``x`` [B, C, H, W]: reflect-padded by ``pad``, cropped at (dy_b, dx_b) to
    H x W, then mirrored if ``flip_b`` (and ``do_flip``)."""
    B, _, H, W = x.shape
    if B == 0:
        return x
    out = x
    if pad > 0:
        xp = F.pad(x, (pad, pad, pad, pad), mode="reflect")
        rows = dy.to(x.device)[:, None] + torch.arange(H, device=x.device)  # [B, H]
        cols = dx.to(x.device)[:, None] + torch.arange(W, device=x.device)  # [B, W]
        b = torch.arange(B, device=x.device)[:, None, None]
        # advanced indices around a slice: the broadcast [B, H, W] dims come first
        out = xp[b, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)
    if do_flip:
        out = torch.where(flip.to(x.device)[:, None, None, None], out.flip(-1), out)
    return out.contiguous()


def augment_batch(batch: dict, *, seed: int, step: int, indices, view: int, pad: int,
                  flip: bool = True) -> dict:
    """The ``view``-th views of an image batch ``{"images": [B, C, H, W], "labels": [B]}``
    whose examples have dataset ``indices`` (labels and any other entry unchanged)."""
    x = batch["images"]
    dy, dx, f = view_offsets(seed, step, view, indices, pad, device=x.device)
    return {**batch, "images": augment_images(x, dy, dx, f, pad, flip)}
