"""Counter-based Poisson sampling.

Every example ``i`` is included in the logical batch of step ``t`` independently with
probability ``q``. Inclusion is decided by a uniform number ``u(seed, t, i)`` in ``[0, 1)`` that
is a *pure function* of ``(seed, t, i)``: it does not depend on the dataset size, on how the
indices are chunked, on the world size, on the microbatch size, or on any state carried between
steps. Two runs with the same seed therefore sample identical batches on 1 or N ranks, and a
resumed run needs nothing but the step counter.

Construction (all arithmetic modulo 2**64, ``mix64`` is SplitMix64's finaliser, a bijection
of 64-bit words)::

    k1   = blake2b-64(decimal(seed) ":" decimal(t), person="dptrain-sample")  # per-step key
    x_i  = k1 + GAMMA * (i + 1)                                 # SplitMix64 counter for i
    h_i  = mix64(mix64(x_i) XOR k1)                             # second round decorrelates steps
    u_i  = (h_i >> 11) * 2**-53                                 # 53 random bits -> [0, 1)

``GAMMA = 0x9E3779B97F4A7C15`` is odd, so ``i -> x_i`` is injective for ``i < 2**64`` and, as
``mix64`` is a bijection, distinct indices of one step get distinct 64-bit hashes. ``u < q``
then holds with probability ``ceil(q * 2**53) / 2**53`` (= q up to 1.1e-16).

This is a statistical pseudo-random function, not a cryptographic one. Each step's key is a
one-way hash of (seed, step) (any Python int is a valid seed): a step key recovered from that
step's batches (``mix64`` is invertible, so it is the only secret of a step) says nothing of
another step's batch. Until 2026-12-03 the step keys were ``mix64(k0 + GAMMA (t + 1))`` with
``k0 = blake2b-64(seed)``, so one step's key gave k0 and every batch of the run.

Secure mode (``secure=True``; the trainer passes ``privacy.secure_mode``) uses a cryptographic
pseudo-random function instead, so that the batches cannot be predicted, nor one step's batch
inferred from another's, without the seed::

    K_{t,c} = blake2b-256(decimal(seed) ":" decimal(t) ":" decimal(c), person="dptrain-samp-cs")
    u_i     = (w_i >> 11) * 2**-53,   w_i = word (i mod 2**16) of ChaCha20 keyed K_{t, i // 2**16}

(``w_i`` the 64-bit little-endian words of the ChaCha20 keystream, ``dptrain.privacy.noise.
chacha20``). It is a pure function of ``(seed, t, i)`` too, so everything above about chunks,
world sizes and resumes holds; it is another stream, so a secure run's batches are not those of
the same seed without secure mode (secure mode never reuses a seed anyway).
"""

from __future__ import annotations

import hashlib
import numbers

import numpy as np

__all__ = [
    "inclusion_uniforms",
    "poisson_sample",
    "PoissonSampler",
    "shard_indices",
    "DEFAULT_CHUNK",
    "SECURE_CHUNK",
]

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_INV_2_53 = 2.0 ** -53

DEFAULT_CHUNK = 1 << 20
"""Indices processed at once: bounds temporaries to a few tens of MiB for any N."""


def _mix64_int(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _mix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrap-around multiplication, in place)."""
    z ^= z >> np.uint64(30)
    z *= np.uint64(_M1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_M2)
    z ^= z >> np.uint64(31)
    return z


def _check_int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _seed_key(seed: int) -> int:
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be an integer, got {seed!r}")
    h = hashlib.blake2b(str(int(seed)).encode("ascii"), digest_size=8,
                        person=b"dptrain-sample")
    return int.from_bytes(h.digest(), "little")


def _step_key(seed: int, step: int) -> int:
    """The step's 64-bit key, a one-way function of (seed, step)."""
    step = _check_int("step", step)
    if step >= _MASK64:
        raise ValueError(f"step must be < 2**64 - 1, got {step}")
    _seed_key(seed)  # the seed's type check
    h = hashlib.blake2b(f"{int(seed)}:{step}".encode("ascii"), digest_size=8,
                        person=b"dptrain-sample")
    return int.from_bytes(h.digest(), "little")


def _uniforms_for(k1: int, idx: np.ndarray) -> np.ndarray:
    x = idx.astype(np.uint64)
    x += np.uint64(1)
    x *= np.uint64(_GAMMA)
    x += np.uint64(k1)
    _mix64(x)
    x ^= np.uint64(k1)
    _mix64(x)
    x >>= np.uint64(11)
    return x.astype(np.float64) * _INV_2_53


SECURE_CHUNK = 1 << 16
"""Indices per ChaCha20 key in secure mode (a fixed part of the definition of u_i)."""


def _secure_key(seed: int, step: int, chunk: int) -> int:
    step = _check_int("step", step)
    _seed_key(seed)  # the seed's type check
    h = hashlib.blake2b(f"{int(seed)}:{step}:{chunk}".encode("ascii"), digest_size=32,
                        person=b"dptrain-samp-cs")
    return int.from_bytes(h.digest(), "little")


def _secure_uniforms(seed: int, step: int, chunk: int, length: int) -> np.ndarray:
    """u of the first ``length`` indices of secure chunk ``chunk``."""
    from dptrain.privacy.noise import chacha20

    w = chacha20(_secure_key(seed, step, chunk)).random_raw(length)
    w >>= np.uint64(11)
    return w.astype(np.float64) * _INV_2_53


def inclusion_uniforms(seed: int, step: int, indices, *, chunk_size: int = DEFAULT_CHUNK,
                       secure: bool = False) -> np.ndarray:
    """Uniform numbers in [0, 1), one per entry of ``indices``, each a pure function of
    ``(seed, step, index)``. Example ``i`` is in the batch of ``step`` iff its number is < q.

    ``indices`` must be non-negative integers (any shape; the result has the same shape).
    ``secure``: secure mode's ChaCha20 function (module docstring); each 2**16-index chunk that
    an index falls in is drawn up to the largest index asked of it.
    """
    _check_secure(secure)
    k1 = _step_key(seed, step)
    idx = np.asarray(indices)
    if idx.size and not np.issubdtype(idx.dtype, np.integer):
        raise TypeError(f"indices must be integers, got dtype {idx.dtype}")
    idx = idx.astype(np.int64, copy=False)
    if idx.size and int(idx.min()) < 0:
        raise ValueError("indices must be >= 0")
    flat = idx.reshape(-1)
    out = np.empty(flat.shape, dtype=np.float64)
    chunk_size = _check_int("chunk_size", chunk_size, 1)
    if secure:
        # the indices sorted and grouped by chunk; each chunk's stream drawn up to the largest
        # offset asked of it (a prefix of the chunk's words): scattered indices cost one short
        # draw each, not a whole chunk and a mask over every index
        order = np.argsort(flat, kind="stable")
        chunk = flat[order] // SECURE_CHUNK
        starts = np.flatnonzero(np.r_[True, chunk[1:] != chunk[:-1]]) if flat.size else []
        for g0, g1 in zip(starts, [*starts[1:], flat.size]):
            at = order[g0:g1]
            c = int(chunk[g0])
            r = flat[at] - c * SECURE_CHUNK
            out[at] = _secure_uniforms(seed, step, c, int(r.max()) + 1)[r]
        return out.reshape(idx.shape)
    for lo in range(0, flat.size, chunk_size):
        hi = min(lo + chunk_size, flat.size)
        out[lo:hi] = _uniforms_for(k1, flat[lo:hi])
    return out.reshape(idx.shape)


def _check_secure(secure) -> None:
    if not isinstance(secure, bool):
        raise TypeError(f"secure must be a bool, got {secure!r}")


def _check_rate(q) -> float:
    if isinstance(q, bool) or not isinstance(q, numbers.Real):
        # (True sampled everyone, "0.5" was parsed: the Ledger refuses both for the same q)
        raise TypeError(f"sample rate must be a real number, got {type(q).__name__}")
    q = float(q)
    if not (0.0 <= q <= 1.0):
        raise ValueError(f"sample rate must be in [0, 1], got {q}")
    return q


def poisson_sample(seed: int, step: int, dataset_size: int, q: float, *,
                   chunk_size: int = DEFAULT_CHUNK, secure: bool = False) -> np.ndarray:
    """Sorted int64 indices ``i < dataset_size`` with ``u(seed, step, i) < q``.

    The set may be empty (it must then still be released: noise only). Works in chunks of
    ``chunk_size`` indices, so memory stays O(chunk_size + q*N) for any N; the result does not
    depend on ``chunk_size``. ``secure``: secure mode's ChaCha20 function (module docstring),
    which works in its own chunks of ``SECURE_CHUNK`` indices instead.
    """
    n = _check_int("dataset_size", dataset_size)
    q = _check_rate(q)
    chunk_size = _check_int("chunk_size", chunk_size, 1)
    _check_secure(secure)
    k1 = _step_key(seed, step)
    parts = []
    # secure mode works in its own chunks of 2**16 indices (one ChaCha20 key each)
    step_size = SECURE_CHUNK if secure else chunk_size
    for lo in range(0, n, step_size):
        hi = min(lo + step_size, n)
        idx = np.arange(lo, hi, dtype=np.int64)
        u = (_secure_uniforms(seed, step, lo // SECURE_CHUNK, hi - lo) if secure
             else _uniforms_for(k1, idx))
        parts.append(idx[u < q])
    if not parts:
        return np.empty(0, dtype=np.int64)
    return np.concatenate(parts)


class PoissonSampler:
    """Poisson sampler over ``range(dataset_size)`` with rate ``sample_rate``.

    Stateless: ``sample(step)`` can be called for any step in any order and on any rank.
    """

    def __init__(self, seed: int, sample_rate: float, dataset_size: int, *,
                 chunk_size: int = DEFAULT_CHUNK, secure: bool = False):
        _seed_key(seed)  # type check
        _check_secure(secure)
        self.secure = secure
        self.seed = int(seed)
        self.sample_rate = _check_rate(sample_rate)
        self.dataset_size = _check_int("dataset_size", dataset_size)
        self.chunk_size = _check_int("chunk_size", chunk_size, 1)

    def sample(self, step: int) -> np.ndarray:
        """Sorted int64 indices of the logical batch of ``step`` (possibly empty)."""
        return poisson_sample(self.seed, step, self.dataset_size, self.sample_rate,
                              chunk_size=self.chunk_size, secure=self.secure)

    @property
    def expected_size(self) -> float:
        return self.sample_rate * self.dataset_size

    def __repr__(self) -> str:  # the seed is deliberately not shown (secure mode)
        return (f"PoissonSampler(sample_rate={self.sample_rate}, "
                f"dataset_size={self.dataset_size}, secure={self.secure})")


def shard_indices(indices, rank: int, world_size: int) -> np.ndarray:
    """The contiguous part of ``indices`` that ``rank`` processes.

    Balanced: the first ``len % world_size`` ranks get one more element. Deterministic and
    order-preserving; concatenating the shards of ranks 0..world_size-1 gives ``indices`` back.
    A shard may be empty (a rank with nothing sampled still takes part in the release).
    """
    world_size = _check_int("world_size", world_size, 1)
    rank = _check_int("rank", rank)
    if rank >= world_size:
        raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
    idx = np.asarray(indices)
    if idx.ndim != 1:
        raise ValueError(f"indices must be 1-D, got shape {idx.shape}")
    base, rem = divmod(idx.shape[0], world_size)
    start = rank * base + min(rank, rem)
    stop = start + base + (1 if rank < rem else 0)
    return idx[start:stop]
