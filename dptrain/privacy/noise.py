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

Secure mode (``secure=True``; the trainer passes ``privacy.secure_mode``): the seed comes from
the OS entropy pool (:func:`secure_seed`) and is never written to logs, metrics or checkpoints,
and the stream is a cryptographically secure one:

- block ``k`` is drawn by ChaCha20 (``randomgen.ChaCha``, 20 rounds), keyed with the 256-bit
  ``block_key(..., secure=True)`` (blake2b-256 of the same encoding, another personalisation);
  ChaCha20 is a stream cipher, so without the key its output cannot be told from uniform bits;
- each value is ``(n1 + n2 + n3 + n4) / 2`` of four standard normals of that stream (in float64),
  the mitigation of floating-point attacks on the sampler that Opacus's secure mode uses
  (Holohan and Braghin, 2021): a sum of several draws fills in the gaps that a single sampler's
  floating-point output leaves. It is a mitigation, not a proof; the released float32 values are
  still floating-point numbers (docs/privacy.md).

The price is drawing time: about 8x Philox's per block (BENCHMARKS.md, "Secure-mode noise").
Philox (the default, ``secure=False``) is built for statistical quality and is reproducible from
``privacy.seed``, which is what experiments need; it is not a CSPRNG.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

__all__ = ["BLOCK", "SECURE_DRAWS", "chacha20", "gaussian_noise", "block_key", "block_share",
           "secure_seed"]

BLOCK = 1 << 16


def _check_int(name: str, value, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def block_key(seed: int, step: int, key: str, block: int, *, secure: bool = False) -> int:
    """128-bit Philox key of noise block ``block`` of parameter ``key`` at ``step``; with
    ``secure=True`` the 256-bit ChaCha20 key of that block (another personalisation, so the two
    streams share nothing).

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
    if secure:
        digest = hashlib.blake2b(msg, digest_size=32, person=b"dptrain-noise-cs").digest()
    else:
        digest = hashlib.blake2b(msg, digest_size=16, person=b"dptrain-noise-v2").digest()
    return int.from_bytes(digest, "little")


SECURE_DRAWS = 4
"""Standard normals summed per value in secure mode (the sum is divided by sqrt(4) = 2)."""


def chacha20(key: int):
    """numpy ``BitGenerator`` of ChaCha20 (20 rounds) keyed with the 256-bit ``key``."""
    try:
        from randomgen import ChaCha
    except ImportError as e:  # a dependency in pyproject; named if an environment lacks it
        raise ImportError("privacy.secure_mode draws with ChaCha20 from the randomgen package: "
                          "pip install randomgen") from e
    return ChaCha(key=key, rounds=20)


def _draw_block(k: int, length: int, secure: bool) -> np.ndarray:
    """The float64 standard normals of one block keyed with ``k``."""
    if not secure:
        return np.random.Generator(np.random.Philox(key=k)).standard_normal(length)
    z = np.random.Generator(chacha20(k)).standard_normal((SECURE_DRAWS, length))
    return z.sum(axis=0) * (1.0 / math.sqrt(SECURE_DRAWS))


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
                   dtype: torch.dtype = torch.float32, secure: bool = False) -> torch.Tensor:
    """Standard normal values of global coordinates ``[start, end)`` of ``key``'s noise.

    Returns a 1-D tensor of ``end - start`` elements on ``device`` in ``dtype``. ``end`` defaults
    to ``numel``; ``start == end`` gives an empty tensor. ``secure``: the ChaCha20 stream of
    secure mode (see the module docstring), another stream than the default's. Blocks are
    drawn on up to ``torch.get_num_threads()`` threads (numpy releases the GIL while drawing); the values do
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
    if not isinstance(secure, bool):
        raise TypeError(f"secure must be a bool, got {secure!r}")
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
        z = _draw_block(block_key(seed, step, key, k, secure=secure), block_len, secure)
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

    Keep it in memory only; never log, print or checkpoint it. Pass ``secure=True`` to
    :func:`gaussian_noise` and to the sampler with it, so that the streams keyed with it are
    ChaCha20's (see the module docstring).
    """
    return secrets.randbits(128)
