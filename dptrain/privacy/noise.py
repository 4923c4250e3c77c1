"""Counter-based Gaussian noise for the release ``(sum + sigma*C*Z) / b``.

``gaussian_noise(seed, step, key, numel, start, end)`` returns the standard normal values of
the global flat coordinates ``[start, end)`` of the noise tensor ``Z`` for the parameter named
``key`` (``numel`` elements in total). Each value is a pure function of
``(seed, step, key, global coordinate)``:

- the global coordinates are split into fixed blocks of ``BLOCK = 2**16`` elements; block ``k``
  covers ``[k*BLOCK, min((k+1)*BLOCK, numel))``;
- block ``k`` is ``torch.randn(block_len, generator=g)`` with ``g`` a ``torch.Generator`` on the
  target device seeded by ``blake2b-63(seed, step, key, k)`` (blake2b, unlike Python's
  ``hash()``, is the same in every process);
- the blocks that overlap ``[start, end)`` are drawn whole and sliced.

Hence any split of ``[0, numel)`` across ranks (FSDP shards) or slices gives exactly the same
numbers as one full draw: 1, 2 or 8 ranks produce the same release. This holds for one *device
type*: the CPU and CUDA generators are different algorithms and give different numbers for the
same seed (both are standard normal). The values also depend on the drawing dtype (float64 is
drawn in float64; every other floating dtype is drawn in float32 and cast).

Secure mode: :func:`secure_seed` returns a seed from the OS entropy pool. torch's generators
(Mersenne Twister on CPU, Philox on CUDA) are *not* cryptographically secure PRNGs; what secure
mode promises here is only that the seed is unpredictable and never written to logs, metrics or
checkpoints, so an adversary without access to the training process's memory cannot reproduce
or predict the noise. It does not protect against an adversary who recovers generator state
from outputs, nor against floating-point attacks on the Gaussian sampler (e.g. Mironov's
least-significant-bit attack on textbook samplers); see docs/privacy.md.
"""

from __future__ import annotations

import hashlib
import numbers
import secrets

import torch

__all__ = ["BLOCK", "gaussian_noise", "block_seed", "secure_seed"]

BLOCK = 1 << 16
_MASK63 = (1 << 63) - 1


def _check_int(name: str, value, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def block_seed(seed: int, step: int, key: str, block: int) -> int:
    """63-bit seed of noise block ``block`` of parameter ``key`` at ``step``.

    The encoding is unambiguous (decimal integers and a length-prefixed UTF-8 key, separated),
    so distinct ``(seed, step, key, block)`` give distinct hash inputs.
    """
    seed = _check_int("seed", seed, minimum=None)
    step = _check_int("step", step)
    block = _check_int("block", block)
    if not isinstance(key, str):
        raise TypeError(f"key must be a str (a parameter name), got {key!r}")
    kb = key.encode("utf-8")
    msg = b"%d\x00%d\x00%d\x00%d:" % (seed, step, block, len(kb)) + kb
    digest = hashlib.blake2b(msg, digest_size=8, person=b"dptrain-noise").digest()
    return int.from_bytes(digest, "little") & _MASK63


def gaussian_noise(seed: int, step: int, key: str, numel: int, start: int = 0,
                   end: int | None = None, *, device="cpu",
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal values of global coordinates ``[start, end)`` of ``key``'s noise.

    Returns a 1-D tensor of ``end - start`` elements on ``device`` in ``dtype``. ``end`` defaults
    to ``numel``; ``start == end`` gives an empty tensor.
    """
    step = _check_int("step", step)
    numel = _check_int("numel", numel)
    start = _check_int("start", start)
    end = numel if end is None else _check_int("end", end)
    if not (start <= end <= numel):
        raise ValueError(f"need 0 <= start <= end <= numel, got start={start}, end={end}, "
                         f"numel={numel}")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating dtype, got {dtype}")
    device = torch.device(device)
    draw_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.empty(end - start, dtype=dtype, device=device)
    if end == start:
        return out
    g = torch.Generator(device=device)
    for k in range(start // BLOCK, (end - 1) // BLOCK + 1):
        b0 = k * BLOCK
        block_len = min(BLOCK, numel - b0)
        g.manual_seed(block_seed(seed, step, key, k))
        z = torch.randn(block_len, generator=g, device=device, dtype=draw_dtype)
        lo, hi = max(start, b0), min(end, b0 + block_len)
        out[lo - start:hi - start].copy_(z[lo - b0:hi - b0])
    return out


def secure_seed() -> int:
    """A 63-bit seed from the OS entropy pool (``secrets``), for secure mode.

    Keep it in memory only; never log, print or checkpoint it. torch's generator seeded with it
    is still not a CSPRNG (see the module docstring): the guarantee is unpredictability of the
    seed, not cryptographic strength of the stream.
    """
    return secrets.randbits(63)
