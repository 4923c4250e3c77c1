"""bench/lm_loss_memory.py and its live-tensor counter: the counter sees exactly the storages
created inside it (views share, frees count, earlier tensors are the baseline), and both
benchmarked losses are the same loss."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from _bench import load_bench  # noqa: E402


@pytest.fixture(scope="module")
def bench():
    return load_bench("lm_loss_memory")


def test_live_tensor_peak_counts_storages_created_inside(bench):
    LiveTensorPeak = bench.LiveTensorPeak
    before = torch.zeros(1 << 20)  # 4 MiB that exists on entry: baseline
    with LiveTensorPeak() as t:
        a = before + 1  # 4 MiB
        v = a.view(2, -1)  # a view: no new storage
        del a
        b = torch.ones(1 << 19)  # 2 MiB: 6 MiB live
        del v, b  # 0 live
        c = torch.ones(1 << 18) * 3  # 1 MiB (ones, then the product: 2 MiB at once)
    assert t.peak_bytes == 6 * 2**20
    assert [n for n, _ in t.top] == [4 * 2**20, 2 * 2**20]
    assert t.top[0][1].startswith("add") and float(c[0]) == 3.0
    with LiveTensorPeak() as t2:
        before.mul_(2)  # in place on an earlier storage: nothing new
    assert t2.peak_bytes == 0


def test_both_benchmarked_losses_are_the_same_loss(bench):
    s = bench.Shape("tiny", 1, 32, 2, 97, 12, 3, prompt=4)
    batch = bench.batch_for(s, "cpu")
    assert (batch["labels"][:, :4] == -100).all() and (batch["labels"][:, 4:] >= 0).all()
    out = {}
    for name, fn in bench.LOSSES.items():
        model = bench.build_gpt2(s, 0, "cpu")
        loss = fn(model, batch)
        loss.sum().backward()
        out[name] = (loss.detach(), model.lm_head.weight.grad.clone())
    assert out["sliced"][0].shape == (3,)
    assert torch.allclose(out["dptrain"][0], out["sliced"][0], atol=1e-6)
    assert torch.allclose(out["dptrain"][1], out["sliced"][1], rtol=1e-5, atol=1e-7)


def test_dptrain_loss_peak_is_below_the_sliced_one(bench):
    # V large against the model: the logits dominate, so one logit-sized tensor less is visible
    s = bench.Shape("vocab-heavy", 1, 32, 2, 4096, 16, 4, prompt=2)
    peaks = {k: bench.peak_of_step(bench.setup(s, fn, "cpu"), "cpu")
             for k, fn in bench.LOSSES.items()}
    logits = s.batch_size * s.seq_len * s.vocab_size * 4
    assert peaks["sliced"] - peaks["dptrain"] > 0.8 * logits
