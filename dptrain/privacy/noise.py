"""Counter-based Gaussian noise for the release ``(sum + sigma*C*Z) / b``.

``gaussian_noise(seed, step, key, numel, start, end)`` returns the standard normal values of
the global flat coordinates ``[start, end)`` of the noise tensor ``Z`` for the parameter named
``key`` (``numel`` elements in total). Each value is a pure function of
``(seed, step, key, global coordinate)``:

- the global coordinates are split into fixed blocks of ``BLOCK = 2**16`` elements; block ``k``
  covers ``[k*BLOCK, min((k+1)*BLOCK, numel))``;
- block ``k`` is ``standard_normal(block_len)`` of numpy's counter-based Philox4x64-10 generator
  keyed with the 128-bit ``block_key(seed, step, key, k)`` = blake2b-128 of an unambiguous
  encoding of the four (blake2b, unlike Python's ``hash()``, is the same in every process);
- the blocks that overlap ``[start, end)`` are drawn whole and sliced.

Hence any split of ``[0, numel)`` across ranks (FSDP shards) or slices gives exactly the same
numbers as one full draw: 1, 2 or 8 ranks produce the same release. The numbers are drawn on the
CPU and copied to the target device, so they are also the same on every device type (CPU or
CUDA) and independent of the number of threads that draw them. Every block is drawn in float64
and rounded to float32 (other dtypes: then cast from float32) unless float64 is asked for, so a
float32 (or bf16) run's noise is its float64 run's rounded: ``performance.dtype`` does not change
the noise. (float64 runs need float64 draws: noise of float32 resolution added to a float64 sum
would leave the sum's low-order bits in the release as they are; until 2026-12-01 other dtypes
drew numpy's float32 normals, another stream.)

Why not ``torch.Generator``: the CPU generator seeds its Mersenne Twister from the low 32 bits of
the seed only, so the blocks of a run drew from 2**32 streams at most, and two blocks of one run
could get identical noise (a birthday collision is expected after ~65,000 blocks; GPT-2 small
has ~1,900 blocks per release). Two releases with a shared noise block reveal the difference of
their clipped sums on it exactly. With 128-bit keys a collision has probability ~n^2 / 2^129.

Secure mode: :func:`secure_seed` returns a 128-bit seed from the OS entropy pool. Philox is a
counter-based generator built for statistical quality, not a cryptographically secure PRNG; what
secure mode promises here is only that the seed is unpredictable and never written to logs,
metrics or checkpoints, so an adversary without access to the training process's memory cannot
reproduce or predict the noise. It does not protect against floating-point attacks on the
Gaussian sampler (e.g. Mironov's least-significant-bit attack on textbook samplers); see
docs/privacy.md.
"""

from __future__ import annotations

import hashlib
import numbers
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

__all__ = ["BLOCK", "gaussian_noise", "block_key", "block_share", "secure_seed"]

BLOCK = 1 << 16


def _check_int(name: str, value, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def block_key(seed: int, step: int, key: str, block: int) -> int:
    """128-bit Philox key of noise block ``block`` of parameter ``key`` at ``step``.

    The encoding is unambiguous (decimal integers and a length-prefixed UTF-8 key, separated),
    so distinct ``(seed, step, key, block)`` give distinct hash inputs; any Python int is a seed.
    """
    seed = _check_int("seed", seed, minimum=None)
    step = _check_int("step", step)
    block = _check_int("block", block)
    if not isinstance(key, str):
        raise TypeError(f"key must be a str (a parameter name), got {key!r}")
    kb = key.encode("utf-8")
    msg = b"%d\x00%d\x00%d\x00%d:" % (seed, step, block, len(kb)) + kb
    digest = hashlib.blake2b(msg, digest_size=16, person=b"dptrain-noise-v2").digest()
    return int.from_bytes(digest, "little")


def _draw_block(k: int, length: int, dtype) -> np.ndarray:
    return np.random.Generator(np.random.Philox(key=k)).standard_normal(length, dtype=dtype)


_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    """One pool per worker count, kept: a pool is never shut down while another thread (the
    trainer's background draw, performance.noise_prefetch) may be drawing on it."""
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ThreadPoolExecutor(workers,
                                                        thread_name_prefix="dptrain-noise")
        return pool


def gaussian_noise(seed: int, step: int, key: str, numel: int, start: int = 0,
                   end: int | None = None, *, device="cpu",
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal values of global coordinates ``[start, end)`` of ``key``'s noise.

    Returns a 1-D tensor of ``end - start`` elements on ``device`` in ``dtype``. ``end`` defaults
    to ``numel``; ``start == end`` gives an empty tensor. Blocks are drawn on up to
    ``torch.get_num_threads()`` threads (numpy releases the GIL while drawing); the values do
    not depend on how many.
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
    if end == start:
        return torch.empty(0, dtype=dtype, device=device)
    # drawn in float64 whatever the dtype (see the module docstring); each block is rounded to
    # float32 as it is copied out (one pass, no float64 array of the whole range), except for
    # float64; other dtypes are cast from float32 at the end
    out = np.empty(end - start, dtype=np.float64 if dtype == torch.float64 else np.float32)
    blocks = range(start // BLOCK, (end - 1) // BLOCK + 1)

    def fill(k: int) -> None:
        b0 = k * BLOCK
        block_len = min(BLOCK, numel - b0)
        z = _draw_block(block_key(seed, step, key, k), block_len, np.float64)
        lo, hi = max(start, b0), min(end, b0 + block_len)
        out[lo - start:hi - start] = z[lo - b0:hi - b0]

    workers = min(len(blocks), torch.get_num_threads())
    if workers > 1:
        list(_pool(workers).map(fill, blocks))
    else:
        for k in blocks:
            fill(k)
    z = torch.from_numpy(out)
    if z.dtype != dtype:  # cast on the host: a device gets the target dtype's bytes only
        z = z.to(dtype)
    return z.to(device) if device.type != "cpu" else z


def block_share(numel: int, index: int, rank: int, world: int) -> tuple[int, int]:
    """Flat coordinates ``[lo, hi)`` of a replicated tensor's noise that ``rank`` of ``world``
    draws: whole blocks, split as ``torch.chunk`` splits rows, with the ranks rotated by
    ``index`` (the parameter's position) so that one-block parameters do not all land on rank 0.
    For fixed ``numel`` and ``index`` the shares of the ``world`` ranks partition ``[0, numel)``."""
    from dptrain.parallel.dist import shard_bounds

    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} out of range for world size {world}")
    b0, b1 = shard_bounds(-(-numel // BLOCK), (rank + index) % world, world)
    return min(b0 * BLOCK, numel), min(b1 * BLOCK, numel)


def secure_seed() -> int:
    """A 128-bit seed from the OS entropy pool (``secrets``), for secure mode.

    Keep it in memory only; never log, print or checkpoint it. The noise generator keyed with it
    is still not a CSPRNG (see the module docstring): the guarantee is unpredictability of the
    seed, not cryptographic strength of the stream.
    """
    return secrets.randbits(128)
