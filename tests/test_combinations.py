"""Feature combinations that the other tests do not put together (picked from a combinatorial
sweep of random valid configs, 42 under performance changes and 50 resumed, all of which agreed):

(a) performance settings leave the trained parameters equal to float32 rounding and the
    epsilon ledger identical, for image models with augmult + DiSK + EMA and GPT-2 with
    dropout + inner momentum + DOPPLER + untied embeddings, including microbatches of 1 and
    microbatches larger than the batch, two_pass vs bookkeeping, ghost vs instantiate vs memory,
    background vs inline noise, and a sample rate that leaves logical batches empty.
(b) a resume continues bit for bit for DP-Muon-S + augmult + EMA + inner momentum (k_other),
    which tests/test_checkpoint.py does not combine.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dptrain import checkpoint as ckpt
from dptrain.config import load
from dptrain.trainer import RunConfig, Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
IMAGES = str(ROOT / "configs" / "tiny_images.yaml")
BASE = ["train.progress=false", "performance.num_threads=1", "privacy.steps=3",
        "train.checkpoint_every=0"]

COMBOS = {
    "cnn+augmult+disk+ema": (IMAGES, ["data.augmult=2", "optim.filter.name=disk",
                                      "optim.filter.kappa=0.5", "optim.ema_decay=0.9",
                                      "optim.schedule=cosine", "optim.min_lr_ratio=0.1"]),
    "gpt2+dropout+im+doppler+untied": (TINY, ["model.dropout=0.1", "model.tie_embeddings=false",
                                              "optim.inner_momentum.k_muon=2",
                                              "optim.inner_momentum.k_other=1",
                                              "optim.filter.name=doppler",
                                              "optim.name=muon_bc"]),
    "gpt2+empty_batches+muon_s": (TINY, ["privacy.sample_rate=0.006", "optim.name=muon_s",
                                         "optim.schedule=linear", "optim.warmup_steps=1"]),
}
PERFS = [
    ["performance.microbatch_size=1", "performance.clipping=two_pass",
     "performance.ghost=instantiate", "performance.noise_prefetch=background"],
    ["performance.microbatch_size=64", "performance.clipping=bookkeeping",
     "performance.ghost=memory", "performance.noise_prefetch=inline"],
]


def _train(config, overrides, out=None):
    t = Trainer(load(RunConfig, config, [*BASE, *overrides]), out)
    for _ in range(t.plan.steps):
        t.private_step()
    return t


def _state(t):
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


@pytest.mark.parametrize("combo", list(COMBOS), ids=list(COMBOS))
def test_performance_settings_change_parameters_only_by_float32_rounding(combo):
    config, overrides = COMBOS[combo]
    ref = _train(config, [*overrides, "performance.microbatch_size=3",
                          "performance.ghost=ghost"])
    want, want_eps = _state(ref), ref.epsilon()
    want_ema = ({k: v.clone() for k, v in ref.optimizer.ema.values.items()}
                if ref.optimizer.ema is not None else None)
    for perf in PERFS:
        got = _train(config, [*overrides, *perf])
        assert got.epsilon() == want_eps  # the ledger, not a tolerance
        state = _state(got)
        for k, v in want.items():
            # the sweep saw <= 1.4e-5 of a tensor's largest entry (AdamW on tiny biases), and
            # <= 9e-7 absolute; a changed sample, clip factor or noise moves them by O(lr)
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=2e-6, msg=k)
        if want_ema is not None:
            for k, v in want_ema.items():
                torch.testing.assert_close(got.optimizer.ema.values[k], v, rtol=1e-4,
                                           atol=2e-6, msg=k)


def test_resume_bit_for_bit_muon_s_augmult_ema_inner_momentum(tmp_path):
    overrides = ["optim.name=muon_s", "data.augmult=2", "optim.ema_decay=0.9",
                 "optim.inner_momentum.k_muon=1", "optim.inner_momentum.k_other=2",
                 "optim.schedule=linear", "privacy.steps=4"]
    ref = _train(IMAGES, overrides)
    want = _state(ref)
    first = Trainer(load(RunConfig, IMAGES, [*BASE, *overrides]), tmp_path / "run")
    for _ in range(2):
        first.private_step()
    ckpt.save(first, tmp_path / "run")
    torch.manual_seed(4321)  # the resumed process's global RNG must not matter
    second = Trainer(load(RunConfig, IMAGES, [*BASE, *overrides]), tmp_path / "run")
    ckpt.load(second, ckpt.find_latest(tmp_path / "run"))
    while second.step < second.plan.steps:
        second.private_step()
    got = _state(second)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    for k, v in ref.optimizer.ema.values.items():
        assert torch.equal(second.optimizer.ema.values[k], v), k
