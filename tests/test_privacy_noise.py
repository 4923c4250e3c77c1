"""Counter-based Gaussian noise: slicing invariance, distinct streams, distribution, dtypes."""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy import stats

from dptrain.privacy.noise import (BLOCK, SECURE_DRAWS, block_key, chacha20, gaussian_noise,
                                   secure_seed)

NUMEL = 3 * BLOCK + 1234


@pytest.fixture(scope="module")
def full():
    return gaussian_noise(42, 7, "layer.weight", NUMEL)


def test_full_draw_shape_and_determinism(full):
    assert full.shape == (NUMEL,) and full.dtype == torch.float32 and full.device.type == "cpu"
    assert torch.equal(full, gaussian_noise(42, 7, "layer.weight", NUMEL, 0, NUMEL))


@pytest.mark.parametrize("cuts", [
    [BLOCK], [BLOCK - 1, BLOCK + 1], [1, 2, 3], [2 * BLOCK, 3 * BLOCK],
    [NUMEL - 1], [10, 10, 70_000, 3 * BLOCK + 1]])
def test_slices_concatenate_to_full_draw(full, cuts):
    bounds = [0, *cuts, NUMEL]
    parts = [gaussian_noise(42, 7, "layer.weight", NUMEL, a, b) for a, b in zip(bounds, bounds[1:])]
    assert torch.equal(torch.cat(parts), full)


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(0, NUMEL), min_size=0, max_size=6))
def test_any_split_concatenates_to_full_draw(full, cuts):
    bounds = [0, *sorted(cuts), NUMEL]
    parts = [gaussian_noise(42, 7, "layer.weight", NUMEL, a, b) for a, b in zip(bounds, bounds[1:])]
    assert torch.equal(torch.cat(parts), full)


def test_fsdp_like_shards_across_world_sizes(full):
    for ws in (2, 3, 8):
        per = math.ceil(NUMEL / ws)  # FSDP pads to equal shards; the last may be short or empty
        shards = [gaussian_noise(42, 7, "layer.weight", NUMEL, min(r * per, NUMEL),
                                 min((r + 1) * per, NUMEL)) for r in range(ws)]
        assert torch.equal(torch.cat(shards), full)


def test_small_tensor_and_empty_slice():
    z = gaussian_noise(0, 0, "bias", 5)
    assert z.shape == (5,)
    assert torch.equal(gaussian_noise(0, 0, "bias", 5, 2, 4), z[2:4])
    assert gaussian_noise(0, 0, "bias", 5, 3, 3).shape == (0,)
    assert gaussian_noise(0, 0, "empty", 0).shape == (0,)


def test_different_seed_step_key_block_give_different_noise(full):
    n = BLOCK + 100
    base = full[:n]
    variants = {
        "seed": gaussian_noise(43, 7, "layer.weight", NUMEL, 0, n),
        "step": gaussian_noise(42, 8, "layer.weight", NUMEL, 0, n),
        "key": gaussian_noise(42, 7, "layer.bias", NUMEL, 0, n),
        "key prefix": gaussian_noise(42, 7, "layer.weigh", NUMEL, 0, n),
    }
    for name, z in variants.items():
        assert not torch.equal(z, base), name
        r = np.corrcoef(base.numpy(), z.numpy())[0, 1]
        assert abs(r) < 6 / math.sqrt(n), name
    # blocks of one tensor are not copies of each other
    b0, b1 = full[:BLOCK].numpy(), full[BLOCK:2 * BLOCK].numpy()
    assert abs(np.corrcoef(b0, b1)[0, 1]) < 6 / math.sqrt(BLOCK)
    # the hash input is unambiguous: distinct tuples, distinct seeds
    keys = {block_key(s, t, k, b) for s in (0, 1, 10) for t in (0, 1, 10)
            for k in ("a", "a1", "1") for b in (0, 1, 11)}
    assert len(keys) == 3 * 3 * 3 * 3
    assert all(0 <= k < 2 ** 128 for k in keys)
    assert max(keys) >= 2 ** 120  # the whole 128 bits are used


def test_seeds_that_differ_only_above_bit_32_or_64_give_different_noise():
    # torch's CPU generator keeps only the low 32 bits of its seed; the noise must not.
    n = 1000
    base = gaussian_noise(12345, 0, "w", n)
    for other in (12345 + (7 << 32), 12345 + (1 << 64), 12345 + (1 << 100)):
        z = gaussian_noise(other, 0, "w", n)
        assert abs(np.corrcoef(base.numpy(), z.numpy())[0, 1]) < 6 / math.sqrt(n), other


def test_former_colliding_blocks_differ():
    # With 32-bit generator seeds, block 0 of this key at steps 31768 and 59665 (seed 0) was
    # the same noise (found by a birthday search): two releases that revealed the difference
    # of their clipped sums on 65,536 coordinates.
    key = "transformer.h.0.mlp.c_fc.weight"
    a = gaussian_noise(0, 31768, key, BLOCK)
    b = gaussian_noise(0, 59665, key, BLOCK)
    assert abs(np.corrcoef(a.numpy(), b.numpy())[0, 1]) < 6 / math.sqrt(BLOCK)


def test_thread_count_does_not_change_the_noise():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gaussian_noise(9, 4, "w", 5 * BLOCK + 17, 100, 5 * BLOCK)
        torch.set_num_threads(2)
        two = gaussian_noise(9, 4, "w", 5 * BLOCK + 17, 100, 5 * BLOCK)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_philox_reference():
    # Block k is numpy's Philox4x64 keyed by block_key, drawn whole in float64 and rounded to
    # the requested dtype: an independent re-derivation.
    ref = np.concatenate([
        np.random.Generator(np.random.Philox(key=block_key(3, 2, "w", 0)))
        .standard_normal(BLOCK, dtype=np.float64)[-5:],
        np.random.Generator(np.random.Philox(key=block_key(3, 2, "w", 1)))
        .standard_normal(BLOCK, dtype=np.float64)[:5]])
    z64 = gaussian_noise(3, 2, "w", 2 * BLOCK + 10, BLOCK - 5, BLOCK + 5, dtype=torch.float64)
    assert np.array_equal(z64.numpy(), ref)
    z = gaussian_noise(3, 2, "w", 2 * BLOCK + 10, BLOCK - 5, BLOCK + 5)
    assert np.array_equal(z.numpy(), ref.astype(np.float32))


@pytest.mark.parametrize("secure", [False, True])
def test_standard_normal_statistics(secure):
    # secure: ChaCha20, each value the sum of four normals over 2 (still exactly N(0, 1))
    z = torch.cat([gaussian_noise(s, 0, "w", 4 * BLOCK, dtype=torch.float64, secure=secure)
                   for s in range(2)]).numpy()
    n = z.size
    # mean ~ N(0, 1/n); sample std ~ N(1, 1/(2n)): 6-sd tolerances (p < 2e-9)
    assert abs(z.mean()) < 6 / math.sqrt(n)
    assert abs(z.std() - 1) < 6 / math.sqrt(2 * n)
    assert stats.kstest(z, "norm").pvalue > 1e-6
    # tails: P(|Z| > 3) = 0.0027
    p3 = 2 * stats.norm.sf(3)
    assert abs(np.mean(np.abs(z) > 3) - p3) < 6 * math.sqrt(p3 * (1 - p3) / n)


def test_dtypes():
    z32 = gaussian_noise(1, 2, "w", 1000)
    z64 = gaussian_noise(1, 2, "w", 1000, dtype=torch.float64)
    assert z64.dtype == torch.float64 and z32.dtype == torch.float32
    assert torch.equal(gaussian_noise(1, 2, "w", 1000, 100, 900, dtype=torch.float64), z64[100:900])
    # drawn in float64 whatever the dtype and rounded: every dtype's noise is float64's
    assert torch.equal(z32, z64.to(torch.float32))
    # a float64 draw (numpy's float32 normals are another stream: this fails for them)
    assert not torch.equal(z64, z32.to(torch.float64))
    for dt in (torch.bfloat16, torch.float16):
        z = gaussian_noise(1, 2, "w", 1000, dtype=dt)
        assert z.dtype == dt
        assert torch.equal(z, z32.to(dt))  # float64 -> float32 -> dt
    with pytest.raises(TypeError):
        gaussian_noise(1, 2, "w", 10, dtype=torch.int64)


def test_device_argument_forms():
    a = gaussian_noise(1, 2, "w", 100, device="cpu")
    b = gaussian_noise(1, 2, "w", 100, device=torch.device("cpu"))
    assert torch.equal(a, b) and b.device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_slices_concatenate():
    full = gaussian_noise(3, 1, "w", NUMEL, device="cuda")
    assert full.device.type == "cuda"
    parts = [gaussian_noise(3, 1, "w", NUMEL, a, b, device="cuda")
             for a, b in [(0, 1000), (1000, 2 * BLOCK + 5), (2 * BLOCK + 5, NUMEL)]]
    assert torch.equal(torch.cat(parts), full)
    # drawn on the CPU and copied: the same numbers on every device type
    assert torch.equal(full.cpu(), gaussian_noise(3, 1, "w", NUMEL))


def test_bad_ranges():
    for start, end in [(5, 4), (0, 11), (-1, 3)]:
        with pytest.raises(ValueError):
            gaussian_noise(0, 0, "w", 10, start, end)
    with pytest.raises(TypeError):
        gaussian_noise(0, 0, 3, 10)
    with pytest.raises(TypeError):
        gaussian_noise(0, 1.5, "w", 10)


def test_secure_seed():
    import random

    seeds = set()
    for _ in range(8):  # the public generators in the same state before each draw: OS entropy
        random.seed(0)
        torch.manual_seed(0)
        np.random.seed(0)
        seeds.add(secure_seed())
    assert len(seeds) == 8  # 128-bit draws; a collision has probability < 1e-36
    assert all(isinstance(s, int) and 0 <= s < 2 ** 128 for s in seeds)
    assert max(seeds).bit_length() > 64  # not a 64-bit draw (all 8 under 2^64: p = 2^-512)
    s = seeds.pop()
    assert torch.equal(gaussian_noise(s, 0, "w", 10), gaussian_noise(s, 0, "w", 10))


def test_same_noise_in_a_fresh_process():
    code = ("import sys; sys.path.insert(0, sys.argv[1]);"
            "from dptrain.privacy.noise import gaussian_noise;"
            "print(gaussian_noise(5, 3, 'h.0.attn', 70000, 65530, 65540).tolist())")
    env = dict(os.environ, PYTHONHASHSEED="random")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code, root], env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert out == str(gaussian_noise(5, 3, "h.0.attn", 70000, 65530, 65540).tolist())


def test_block_share_partitions_whole_blocks_over_the_ranks():
    from dptrain.privacy.noise import BLOCK, block_share

    rng = np.random.default_rng(0)
    cases = [(0, 3), (1, 4), (BLOCK, 2), (BLOCK + 1, 2), (5 * BLOCK - 7, 3), (38_597_376, 8)]
    cases += [(int(rng.integers(1, 40 * BLOCK)), int(rng.integers(1, 9))) for _ in range(40)]
    for numel, world in cases:
        blocks = -(-numel // BLOCK)
        for index in range(3):
            shares = sorted(block_share(numel, index, r, world) for r in range(world))
            nonempty = [(lo, hi) for lo, hi in shares if hi > lo]
            assert sum(hi - lo for lo, hi in shares) == numel
            if numel:
                assert nonempty[0][0] == 0 and nonempty[-1][1] == numel
                assert all(a[1] == b[0] for a, b in zip(nonempty, nonempty[1:]))
            assert all(lo % BLOCK == 0 for lo, _ in nonempty)  # whole blocks only
            assert max(-(-(hi - lo) // BLOCK) for lo, hi in shares) == -(-blocks // world)
        # one-block parameters are spread over the ranks by their index
        owners = {next(r for r in range(world) if block_share(100, i, r, world) == (0, 100))
                  for i in range(world)}
        assert len(owners) == world


# ------------------------------------------------------------------ secure mode: ChaCha20 streams

# RFC 8439, appendix A.1: the ChaCha20 block function with an all-zero nonce, test vectors #1
# (key 0, block counter 0), #2 (key 0, counter 1) and #3 (key 00..00 01, counter 1). The key is
# read as a little-endian integer; the stream's 64-bit words are its keystream's bytes.
RFC8439 = [
    (0, 0, "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
           "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"),
    (0, 1, "9f07e7be5551387a98ba977c732d080dcb0f29a048e3656912c6533e32ee7aed"
           "29b721769ce64e43d57133b074d839d531ed1f28510afb45ace10a1f4b794d6f"),
    (1 << 248, 1, "3aeb5224ecf849929b9d828db1ced4dd832025e8018b8160b82284f3c949aa5a"
                  "8eca00bbb4a73bdad192b5c42f73f2fd4e273644c8b36125a64addeb006c13a0"),
]


@pytest.mark.parametrize("key, counter, keystream", RFC8439)
def test_the_secure_generator_is_chacha20(key, counter, keystream):
    words = chacha20(key).random_raw(8 * (counter + 1))[8 * counter:]
    assert words.astype("<u8").tobytes().hex() == keystream


def test_secure_noise_is_four_chacha20_normals_over_two():
    # an independent re-derivation: block k is ChaCha20 keyed with the secure block key, four
    # rows of BLOCK standard normals (numpy's Generator), summed and halved in float64
    def block(k: int) -> np.ndarray:
        g = np.random.Generator(chacha20(block_key(3, 2, "w", k, secure=True)))
        return g.standard_normal((4, BLOCK)).sum(axis=0) / 2

    assert SECURE_DRAWS == 4
    ref = np.concatenate([block(0)[-5:], block(1)[:5]])
    z64 = gaussian_noise(3, 2, "w", 2 * BLOCK + 10, BLOCK - 5, BLOCK + 5, dtype=torch.float64,
                         secure=True)
    assert np.array_equal(z64.numpy(), ref)
    z = gaussian_noise(3, 2, "w", 2 * BLOCK + 10, BLOCK - 5, BLOCK + 5, secure=True)
    assert np.array_equal(z.numpy(), ref.astype(np.float32))


def test_secure_noise_keys_are_256_bit_and_another_stream():
    k = block_key(3, 2, "w", 0, secure=True)
    assert block_key(3, 2, "w", 0) != k % 2 ** 128  # other personalisation: not a prefix
    assert k.bit_length() > 128  # a 256-bit digest (all under 2^128: p = 2^-128)
    a = gaussian_noise(5, 1, "w", 1000)
    b = gaussian_noise(5, 1, "w", 1000, secure=True)
    assert abs(np.corrcoef(a.numpy(), b.numpy())[0, 1]) < 6 / math.sqrt(1000)


def test_secure_noise_slices_concatenate_to_the_full_draw():
    n = 2 * BLOCK + 77
    full = gaussian_noise(11, 4, "layer.weight", n, secure=True)
    bounds = [0, 5, BLOCK + 3, 2 * BLOCK, n]
    parts = [gaussian_noise(11, 4, "layer.weight", n, a, b, secure=True)
             for a, b in zip(bounds, bounds[1:])]
    assert torch.equal(torch.cat(parts), full)


def test_secure_must_be_a_bool():
    with pytest.raises(TypeError, match="secure must be a bool"):
        gaussian_noise(0, 0, "w", 10, secure="yes")


def test_block_keys_follow_the_documented_encoding():
    # blake2b-128 (secure: 256) of "seed\0step\0block\0len(key):key", re-derived here: the noise
    # of a resumed run, and of 1 vs N ranks, rests on this stream; a change must be deliberate
    import hashlib

    for seed, step, key, block in [(0, 0, "w", 0), (-7, 3, "h.0.attn", 2), (2 ** 90, 10, "é:x", 11)]:
        kb = key.encode()
        msg = f"{seed}\0{step}\0{block}\0{len(kb)}:".encode() + kb
        for secure, size, person in [(False, 16, b"dptrain-noise-v2"), (True, 32, b"dptrain-noise-cs")]:
            want = int.from_bytes(hashlib.blake2b(msg, digest_size=size, person=person).digest(),
                                  "little")
            assert block_key(seed, step, key, block, secure=secure) == want


def test_a_negative_seed_is_a_seed_of_its_own():
    # "any Python int is a seed" (block_key): a negative one is accepted and is not its
    # absolute value's stream
    a, b = gaussian_noise(-5, 0, "w", 1000), gaussian_noise(5, 0, "w", 1000)
    assert a.shape == (1000,)
    assert abs(np.corrcoef(a.numpy(), b.numpy())[0, 1]) < 6 / math.sqrt(1000)


def test_block_share_refuses_a_rank_outside_the_world():
    # rank == world would draw rank (index % world)'s share a second time: noise counted twice
    # on those coordinates, none on the share it should have drawn
    from dptrain.privacy.noise import block_share

    for rank, world in [(2, 2), (-1, 2), (0, 0), (1, 1)]:
        with pytest.raises(ValueError, match="out of range"):
            block_share(10 * BLOCK, 0, rank, world)
    assert block_share(10 * BLOCK, 0, 1, 2) == (5 * BLOCK, 10 * BLOCK)


def test_block_share_of_whole_blocks_gives_each_rank_its_chunk_of_them():
    # numel a multiple of BLOCK: exactly numel / BLOCK blocks, split as torch.chunk splits them
    # (one count too many, numel // BLOCK + 1, left the last ranks with nothing to draw)
    from dptrain.privacy.noise import block_share

    for blocks, world in [(4, 4), (1, 1), (6, 3), (8, 8)]:
        want = [(c[0] * BLOCK, (c[-1] + 1) * BLOCK)
                for c in torch.arange(blocks).chunk(world)]
        assert [block_share(blocks * BLOCK, 0, r, world) for r in range(world)] == [
            (int(lo), int(hi)) for lo, hi in want]
