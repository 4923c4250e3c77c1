"""Counter-based Poisson sampling: purity, rate, independence, sharding."""

import hashlib
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy import stats

from dptrain.privacy.noise import chacha20
from dptrain.privacy.sampling import (
    SECURE_CHUNK,
    PoissonSampler,
    inclusion_uniforms,
    poisson_sample,
    shard_indices,
)


def test_uniforms_are_pure_in_index_not_in_array_layout():
    rng = np.random.default_rng(0)
    full = inclusion_uniforms(7, 3, np.arange(10_000))
    perm = rng.permutation(10_000)
    np.testing.assert_array_equal(inclusion_uniforms(7, 3, perm), full[perm])
    sub = np.sort(rng.choice(10_000, 500, replace=False))
    np.testing.assert_array_equal(inclusion_uniforms(7, 3, sub), full[sub])
    # shape is preserved, chunking does not matter
    np.testing.assert_array_equal(inclusion_uniforms(7, 3, perm.reshape(100, 100)),
                                  full[perm].reshape(100, 100))
    np.testing.assert_array_equal(inclusion_uniforms(7, 3, perm, chunk_size=37), full[perm])
    assert full.dtype == np.float64
    assert full.min() >= 0.0 and full.max() < 1.0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(-(2 ** 70), 2 ** 70), step=st.integers(0, 2 ** 40),
       idx=st.lists(st.integers(0, 2 ** 62), min_size=1, max_size=20))
def test_uniform_of_one_index_does_not_depend_on_its_neighbours(seed, step, idx):
    arr = np.array(idx, dtype=np.int64)
    together = inclusion_uniforms(seed, step, arr)
    alone = np.array([inclusion_uniforms(seed, step, np.array([i]))[0] for i in idx])
    np.testing.assert_array_equal(together, alone)
    assert ((together >= 0) & (together < 1)).all()


def test_inclusion_does_not_depend_on_dataset_size_or_chunking():
    big = poisson_sample(11, 5, 100_000, 0.05)
    for n in (1, 999, 65_536, 70_001):
        np.testing.assert_array_equal(poisson_sample(11, 5, n, 0.05), big[big < n])
    for chunk in (1_000, 4_096, 1 << 20):
        np.testing.assert_array_equal(poisson_sample(11, 5, 100_000, 0.05, chunk_size=chunk),
                                      big)
    # same decision as thresholding the uniforms directly
    u = inclusion_uniforms(11, 5, np.arange(100_000))
    np.testing.assert_array_equal(np.flatnonzero(u < 0.05), big)


def test_imagenet_sized_dataset_in_bounded_chunks():
    n, q = 1_300_000, 0.003
    a = poisson_sample(2, 9, n, q)
    b = poisson_sample(2, 9, n, q, chunk_size=1 << 17)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == np.int64 and (np.diff(a) > 0).all() and a[-1] < n
    mean, sd = n * q, math.sqrt(n * q * (1 - q))
    assert abs(len(a) - mean) < 6 * sd


@pytest.mark.parametrize("q", [0.001, 0.01, 0.3])
def test_empirical_rate_matches_q(q):
    # over 20 steps of 50k examples the count is Binomial(1e6, q); 6 sd is a p < 2e-9 test
    n, steps = 50_000, 20
    total = sum(len(poisson_sample(3, t, n, q)) for t in range(steps))
    trials = n * steps
    assert abs(total - trials * q) < 6 * math.sqrt(trials * q * (1 - q))


def test_uniforms_are_uniform():
    for seed, step in [(0, 0), (1, 1), (2 ** 63 + 5, 12345)]:
        u = inclusion_uniforms(seed, step, np.arange(200_000))
        assert stats.kstest(u, "uniform").pvalue > 1e-6
        # the low bits are not degenerate either: deciles are balanced
        counts = np.bincount((u * 10).astype(int), minlength=10)
        assert stats.chisquare(counts).pvalue > 1e-6


def _joint_inclusion_pvalue(a: np.ndarray, b: np.ndarray) -> float:
    table = np.array([[np.sum(a & b), np.sum(a & ~b)], [np.sum(~a & b), np.sum(~a & ~b)]])
    return stats.chi2_contingency(table, correction=False).pvalue


def test_independence_across_steps_and_seeds():
    n, q = 200_000, 0.1
    idx = np.arange(n)
    u00 = inclusion_uniforms(0, 0, idx)
    others = {"next step": inclusion_uniforms(0, 1, idx),
              "far step": inclusion_uniforms(0, 10 ** 9, idx),
              "next seed": inclusion_uniforms(1, 0, idx),
              "neg seed": inclusion_uniforms(-1, 0, idx)}
    # seeds that differ only above bit 32, 64, 100 or 127 (secure mode's are 128 bits): a seed
    # reduced to its low bits would be brute-forceable, and distinct seeds would share samples
    others.update({f"seed + 2**{k}": inclusion_uniforms(1 << k, 0, idx)
                   for k in (32, 64, 100, 127)})
    for name, u in others.items():
        r = np.corrcoef(u00, u)[0, 1]
        assert abs(r) < 6 / math.sqrt(n), name  # ~N(0, 1/n) under independence
        assert _joint_inclusion_pvalue(u00 < q, u < q) > 1e-6, name
        assert not np.array_equal(u00 < q, u < q), name
    # neighbouring indices within one step are not correlated either
    assert abs(np.corrcoef(u00[:-1], u00[1:])[0, 1]) < 6 / math.sqrt(n)


def _reference_uniform(seed: int, step: int, i: int) -> float:
    """The module docstring's construction, in plain Python integers."""
    mask, gamma = (1 << 64) - 1, 0x9E3779B97F4A7C15

    def mix64(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    k1 = int.from_bytes(hashlib.blake2b(f"{seed}:{step}".encode("ascii"), digest_size=8,
                                        person=b"dptrain-sample").digest(), "little")
    h = mix64(mix64((k1 + gamma * (i + 1)) & mask) ^ k1)
    return (h >> 11) * 2.0 ** -53


def _unmix64(z: int) -> int:
    """The inverse of SplitMix64's finaliser."""
    mask = (1 << 64) - 1

    def unxorshift(z, k):
        x = z
        for _ in range(64 // k + 1):
            x = z ^ (x >> k)
        return x & mask

    z = unxorshift(z, 31)
    z = (z * pow(0x94D049BB133111EB, -1, 1 << 64)) & mask
    z = unxorshift(z, 27)
    z = (z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & mask
    return unxorshift(z, 30)


def test_one_steps_key_gives_no_other_steps_key():
    # the step keys were mix64(k0 + GAMMA (t + 1)): mix64 is invertible, so the key of one
    # step (recoverable from its batches, in principle: the mixer is not a PRF) gave k0 and
    # every other step's batch. Now each is a one-way hash of (seed, step).
    from dptrain.privacy.sampling import _GAMMA, _mix64_int, _step_key

    mask = (1 << 64) - 1
    for z in (0, 1, 2 ** 63 + 5, mask):
        assert _unmix64(_mix64_int(z)) == z  # the inverse is right
    seed = 2 ** 127 + 12345
    for t in range(5):
        k0 = (_unmix64(_step_key(seed, t)) - _GAMMA * (t + 1)) & mask  # as the old chain
        assert _mix64_int(k0 + _GAMMA * (t + 2)) != _step_key(seed, t + 1)
        assert _step_key(seed, t) != _step_key(seed, t + 1)


def test_uniforms_follow_the_documented_construction():
    # the stream that resume and 1-vs-N-rank equality rest on; a change to it must be deliberate
    idx = np.array([0, 1, 2, 3, 1000, 65_535, 1_299_999, 2 ** 40 + 17])
    for seed, step in [(0, 0), (7, 3), (-5, 12), (2 ** 127 + 3, 10 ** 9), (123456789, 1)]:
        want = np.array([_reference_uniform(seed, step, int(i)) for i in idx])
        np.testing.assert_array_equal(inclusion_uniforms(seed, step, idx), want)
    want = [i for i in range(3000) if _reference_uniform(11, 4, i) < 0.05]
    np.testing.assert_array_equal(poisson_sample(11, 4, 3000, 0.05), np.array(want))


def test_sample_overlap_between_steps_is_like_independent_draws():
    n, q, steps = 20_000, 0.2, 30
    samples = [set(poisson_sample(5, t, n, q).tolist()) for t in range(steps)]
    overlaps = [len(samples[t] & samples[t + 1]) for t in range(steps - 1)]
    # each overlap ~ Binomial(n, q^2)
    mean, sd = n * q * q, math.sqrt(n * q * q * (1 - q * q))
    assert abs(np.mean(overlaps) - mean) < 6 * sd / math.sqrt(len(overlaps))


def test_empty_and_full_samples():
    e = poisson_sample(0, 0, 1000, 1e-9)
    assert e.shape == (0,) and e.dtype == np.int64
    assert poisson_sample(0, 0, 1000, 0.0).shape == (0,)
    assert poisson_sample(0, 0, 0, 0.5).shape == (0,)
    np.testing.assert_array_equal(poisson_sample(0, 0, 1000, 1.0), np.arange(1000))
    # at tiny q most steps are empty
    empties = sum(len(poisson_sample(4, t, 100, 1e-4)) == 0 for t in range(50))
    assert empties >= 40


def test_sampler_is_stateless_and_matches_function():
    s = PoissonSampler(seed=9, sample_rate=0.02, dataset_size=30_000)
    a5 = s.sample(5)
    s.sample(6)
    np.testing.assert_array_equal(s.sample(5), a5)
    np.testing.assert_array_equal(a5, poisson_sample(9, 5, 30_000, 0.02))
    assert not np.array_equal(s.sample(5), s.sample(6))
    assert s.expected_size == pytest.approx(600)
    assert "9" not in repr(s).replace("0.02", "").replace("30000", "")  # seed not shown


def test_bad_arguments():
    with pytest.raises(ValueError):
        inclusion_uniforms(0, 0, np.array([-1]))
    with pytest.raises(TypeError):
        inclusion_uniforms(0, 0, np.array([0.5]))
    with pytest.raises(ValueError):
        inclusion_uniforms(0, -1, np.arange(3))
    with pytest.raises(ValueError):
        poisson_sample(0, 0, 10, 1.5)
    with pytest.raises(TypeError):
        poisson_sample(0.5, 0, 10, 0.5)
    with pytest.raises(ValueError):
        shard_indices(np.arange(3), 2, 2)


@pytest.mark.parametrize("n", [0, 1, 5, 16, 17, 1001])
def test_shards_reassemble_and_are_balanced(n):
    idx = poisson_sample(1, 1, 10 * n + 10, 0.5)[:n]
    assert len(idx) == n
    for ws in (1, 2, 3, 4, 8):
        shards = [shard_indices(idx, r, ws) for r in range(ws)]
        np.testing.assert_array_equal(np.concatenate(shards), idx)
        sizes = [len(s) for s in shards]
        assert max(sizes) - min(sizes) <= 1
        assert sizes == sorted(sizes, reverse=True)
        # deterministic
        for r in range(ws):
            np.testing.assert_array_equal(shard_indices(idx, r, ws), shards[r])


def test_same_sample_in_a_fresh_process():
    code = ("import sys; sys.path.insert(0, sys.argv[1]);"
            "from dptrain.privacy.sampling import poisson_sample;"
            "print(','.join(map(str, poisson_sample(123, 7, 5000, 0.01))))")
    env = dict(os.environ, PYTHONHASHSEED="random")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code, root], env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out == ",".join(map(str, poisson_sample(123, 7, 5000, 0.01)))


def test_busiest_rank_microbatch_count_from_the_sample_size_alone():
    # every rank runs as many microbatches as the busiest one (FSDP collectives); the count from
    # |S_t| must equal the explicit maximum over the ranks' shares
    from dptrain.trainer import busiest_microbatches

    for n in (0, 1, 5, 31, 32, 33, 100, 1001):
        for world in (1, 2, 3, 4, 8, 64):
            for mb in (1, 3, 16, 64):
                explicit = max(-(-len(shard_indices(np.arange(n), r, world)) // mb)
                               for r in range(world))
                assert busiest_microbatches(n, world, mb) == explicit, (n, world, mb)


# ------------------------------------------------------------ secure mode: a ChaCha20 function


def _secure_reference(seed: int, step: int, i: int) -> float:
    """u_i of the module docstring, re-derived one index at a time."""
    c, r = divmod(i, SECURE_CHUNK)
    key = hashlib.blake2b(f"{seed}:{step}:{c}".encode(), digest_size=32,
                          person=b"dptrain-samp-cs").digest()
    w = int(chacha20(int.from_bytes(key, "little")).random_raw(r + 1)[r])
    return (w >> 11) * 2.0 ** -53


def test_secure_uniforms_follow_the_documented_construction():
    idx = [0, 1, 7, SECURE_CHUNK - 1, SECURE_CHUNK, 3 * SECURE_CHUNK + 5]
    got = inclusion_uniforms(2 ** 100 + 3, 9, idx, secure=True)
    assert got.tolist() == [_secure_reference(2 ** 100 + 3, 9, i) for i in idx]
    # another stream than the default one
    assert not np.array_equal(got, inclusion_uniforms(2 ** 100 + 3, 9, idx))


@pytest.mark.parametrize("chunk_size", [1, 1000, SECURE_CHUNK + 1, 1 << 20])
def test_secure_sample_is_the_indices_under_q_for_any_chunking(chunk_size):
    n, q = 2 * SECURE_CHUNK + 123, 0.01
    u = inclusion_uniforms(5, 3, np.arange(n), secure=True)
    expected = np.flatnonzero(u < q)
    got = poisson_sample(5, 3, n, q, chunk_size=chunk_size, secure=True)
    np.testing.assert_array_equal(got, expected)
    # a smaller dataset is a prefix: inclusion does not depend on N
    np.testing.assert_array_equal(poisson_sample(5, 3, 1000, q, secure=True),
                                  expected[expected < 1000])
    assert PoissonSampler(5, q, n, secure=True).sample(3).tolist() == expected.tolist()


def test_secure_uniforms_are_uniform_and_steps_independent():
    n = 200_000
    a = inclusion_uniforms(1, 0, np.arange(n), secure=True)
    b = inclusion_uniforms(1, 1, np.arange(n), secure=True)
    assert stats.kstest(a, "uniform").pvalue > 1e-6
    assert abs(np.corrcoef(a, b)[0, 1]) < 6 / math.sqrt(n)
    rate = np.mean(a < 0.05)
    assert abs(rate - 0.05) < 6 * math.sqrt(0.05 * 0.95 / n)


def test_secure_must_be_a_bool():
    for call in (lambda: poisson_sample(0, 0, 10, 0.5, secure=1),
                 lambda: inclusion_uniforms(0, 0, [1], secure=None),
                 lambda: PoissonSampler(0, 0.5, 10, secure="true")):
        with pytest.raises(TypeError, match="secure must be a bool"):
            call()


def test_secure_uniforms_of_scattered_indices_in_any_order_and_shape():
    n = 3 * SECURE_CHUNK + 100
    full = inclusion_uniforms(4, 2, np.arange(n), secure=True)
    rng = np.random.default_rng(0)
    pick = rng.permutation(n)[:6000]
    np.testing.assert_array_equal(inclusion_uniforms(4, 2, pick, secure=True), full[pick])
    np.testing.assert_array_equal(inclusion_uniforms(4, 2, pick.reshape(60, 100), secure=True),
                                  full[pick].reshape(60, 100))
    np.testing.assert_array_equal(inclusion_uniforms(4, 2, [5, 5, 5], secure=True), full[[5] * 3])
    assert inclusion_uniforms(4, 2, np.zeros(0, dtype=np.int64), secure=True).shape == (0,)
    # one index per chunk, far apart: each chunk drawn only up to that index (each checked
    # against the construction re-derived one index at a time)
    far = np.arange(300) * SECURE_CHUNK + 7
    assert inclusion_uniforms(4, 2, far, secure=True).tolist() == [
        _secure_reference(4, 2, int(i)) for i in far]


@pytest.mark.parametrize("secure", [False, True])
def test_a_uniform_of_exactly_0_is_not_sampled_at_rate_0(secure, monkeypatch):
    """Inclusion is u < q, strictly: at q = 0 nothing is sampled, even where an example's
    number is exactly 0 (chance 2^-53 per example and step; a mutant with u <= q sampled it,
    and no other test saw it)."""
    import dptrain.privacy.sampling as sampling

    name = "_secure_uniforms" if secure else "_uniforms_for"
    monkeypatch.setattr(sampling, name, lambda *a: np.zeros(a[-1] if secure else len(a[-1])))
    assert len(sampling.poisson_sample(0, 0, 5, 0.0, secure=secure)) == 0
    assert list(sampling.poisson_sample(0, 0, 5, 1e-9, secure=secure)) == [0, 1, 2, 3, 4]


def test_a_rate_that_is_not_a_probability_is_refused_when_the_sampler_is_built():
    # True would sample everyone (it is 1), 1.5 and -0.1 are no probability, "0.5" a string;
    # refused by the sampler's constructor, not at its first sample
    for bad, error in [(True, TypeError), (False, TypeError), (1.5, ValueError),
                       (-0.1, ValueError), ("0.5", TypeError), (float("nan"), ValueError)]:
        with pytest.raises(error):
            PoissonSampler(0, bad, 10)
        with pytest.raises(error):
            poisson_sample(0, 0, 10, bad)
    assert PoissonSampler(0, 1, 10).sample(0).tolist() == list(range(10))  # an int is a rate


def test_the_last_step_accepted_is_two_to_the_64_minus_2():
    from dptrain.privacy.sampling import _step_key

    assert 0 <= _step_key(3, 2 ** 64 - 2) < 2 ** 64
    with pytest.raises(ValueError, match="step must be < 2\\*\\*64 - 1"):
        _step_key(3, 2 ** 64 - 1)
